"""Times every `scaffold-jax` command of README.md as written: the costs the README states.

Each command runs in a fresh process (its own start-up, data loading and compilations
counted, the persistent compilation cache off so that every command compiles), in README
order, in one scratch folder where the repository's ``tests/`` and ``examples/`` are
linked (tests/test_readme.py runs the same commands shortened). A command whose name
matches ``--skip`` is not run (the full Table 3 protocol takes hours; its plan line gives
its estimate).

Examples:
  python benchmarks/readme_commands.py --out benchmarks/results/readme_commands.json
  python benchmarks/readme_commands.py --match "reproduce fig3" --match quadratic
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_readme import _commands  # noqa: E402  (the README's commands, parsed once)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the timings as JSON")
    parser.add_argument("--match", action="append", default=[],
                        help="run only commands containing this text (repeatable)")  # fmt: skip
    parser.add_argument("--skip", action="append", default=["reproduce table3 --dataset"],
                        help="commands containing this text are not run (repeatable)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="readme-commands-"))
    for name in ("tests", "examples"):
        (scratch / name).symlink_to(ROOT / name)
    env = {**os.environ, "SCAFFOLD_JAX_COMPILE_CACHE": "off", "PYTHONPATH": str(ROOT)}
    rows = []
    for line in _commands():
        if line.startswith(("make", "source")) or (
            args.match and not any(m in line for m in args.match)
        ):
            continue
        if any(s in line for s in args.skip):
            rows.append({"command": line, "seconds": None, "status": "skipped"})
            print(f"skipped   {line}", flush=True)
            continue
        argv = shlex.split(line, comments=True)
        if argv[0] == "scaffold-jax":
            argv = [sys.executable, "-m", "scaffold_jax.cli", *argv[1:]]
        else:  # python ...
            argv = [sys.executable, *argv[1:]]
        start = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)  # fmt: skip
            status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
            tail = "" if done.returncode == 0 else done.stderr[-500:]
        except subprocess.TimeoutExpired:
            status, tail = "timeout", ""
        seconds = time.perf_counter() - start
        rows.append({"command": line, "seconds": round(seconds, 1), "status": status})
        print(f"{seconds:7.1f} s  {status:8s} {line}", flush=True)
        if tail:
            print(tail, flush=True)
    report = {"cpu": _cpu(), "cores": os.cpu_count(), "commands": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
