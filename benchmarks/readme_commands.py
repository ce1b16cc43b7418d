"""Times every `scaffold-jax` command of docs/getting-started.md as written: the costs its
"What the commands cost" states (the README shows three of them).

Each command runs in a fresh process (its own start-up, data loading and compilations
counted, the persistent compilation cache off so that every command compiles), in page
order, in one scratch folder where the repository's ``tests/`` and ``examples/`` are
linked (tests/test_doc_blocks.py runs the same commands shortened). A command whose name
matches ``--skip`` is not run (the full Table 3 protocol takes hours; its plan line gives
its estimate).

With ``--before DIR`` (a checkout of an earlier version, e.g. ``git worktree add
/tmp/before <commit>``) every command also runs with that version's package, the two
interleaved and alternating in order, so that a change is measured against its base
under the same load.

Examples:
  python benchmarks/readme_commands.py --out benchmarks/results/readme_commands.json
  python benchmarks/readme_commands.py --match "reproduce fig3" --match quadratic
  python benchmarks/readme_commands.py --before /tmp/before --repeats 3 \\
      --match "reproduce fig3" --match "table3 --quick" --match "--out runs/scaffold-s0" \\
      --match "sweep --algorithms scaffold fedavg --lr-grid" \\
      --also "scaffold-jax reproduce fig3 --quick" --out benchmarks/results/readme_commands.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_doc_blocks import GETTING_STARTED, _commands  # noqa: E402  (parsed once)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _argv(line: str) -> list[str]:
    argv = shlex.split(line, comments=True)
    if argv[0] == "scaffold-jax":
        return [sys.executable, "-m", "scaffold_jax.cli", *argv[1:]]
    return [sys.executable, *argv[1:]]  # python ...


def _time(line: str, code: Path, timeout: float) -> tuple[float, str, str]:
    """Runs ``line`` in a fresh scratch folder with the package of ``code``: (seconds,
    status, the end of stderr when it failed)."""
    scratch = Path(tempfile.mkdtemp(prefix="readme-commands-"))
    for name in ("tests", "examples"):
        (scratch / name).symlink_to(code / name)
    env = {**os.environ, "SCAFFOLD_JAX_COMPILE_CACHE": "off", "PYTHONPATH": str(code)}
    start = time.perf_counter()
    try:
        done = subprocess.run(_argv(line), cwd=scratch, env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
        status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        tail = "" if done.returncode == 0 else done.stderr[-500:]
    except subprocess.TimeoutExpired:
        status, tail = "timeout", ""
    return time.perf_counter() - start, status, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the timings as JSON")
    parser.add_argument("--match", action="append", default=[],
                        help="run only commands containing this text (repeatable)")  # fmt: skip
    parser.add_argument("--skip", action="append", default=["reproduce table3 --dataset"],
                        help="commands containing this text are not run (repeatable)")  # fmt: skip
    parser.add_argument("--also", action="append", default=[],
                        help="a command line to time besides the page's")  # fmt: skip
    parser.add_argument("--before", type=Path, default=None,
                        help="a checkout of an earlier version: each command runs with it and "
                        "with this one, interleaved (the order alternates by repeat)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs of each command (per code)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per command")
    args = parser.parse_args()
    codes = {"now": ROOT} if args.before is None else {"before": args.before.resolve(), "now": ROOT}
    rows = []
    for line in [*_commands(GETTING_STARTED), *args.also]:
        if line.startswith(("make", "source")) or (
            args.match and line not in args.also and not any(m in line for m in args.match)
        ):
            continue
        if any(s in line for s in args.skip):
            rows.append({"command": line, "status": "skipped"})
            print(f"skipped   {line}", flush=True)
            continue
        seconds = {name: [] for name in codes}
        status = "ok"
        for repeat in range(args.repeats):
            order = list(codes) if repeat % 2 == 0 else list(reversed(codes))
            for name in order:
                took, result, tail = _time(line, codes[name], args.timeout)
                seconds[name].append(round(took, 1))
                print(f"{took:7.1f} s  {name:6s} {result:8s} {line}", flush=True)
                if tail:
                    print(tail, flush=True)
                if result != "ok":
                    status = f"{name}: {result}"
        row = {"command": line, "status": status, "seconds": seconds}
        row["median"] = {name: statistics.median(v) for name, v in seconds.items()}
        if "before" in codes:
            row["speedup"] = round(row["median"]["before"] / max(row["median"]["now"], 1e-9), 2)
        rows.append(row)
    report = {"cpu": _cpu(), "cores": os.cpu_count(), "repeats": args.repeats, "commands": rows}
    if args.before is not None:
        report["before"] = str(args.before)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
