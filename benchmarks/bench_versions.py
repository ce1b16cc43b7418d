"""The engine's round time and compile time, this working tree against a git revision.

A refactor must not cost speed. Both versions run the SAME workloads through their own
package through THIS tree's ``benchmarks/workloads.py`` (``engine_program``:
``Simulation.run_rounds`` compiled for ``w.rounds`` rounds; so a workload added since the
revision runs on both), each in a fresh subprocess, ALTERNATING (before, after, before,
after, ...) so that a noisy shared machine affects both alike; the ratio after / before is
taken within each pair, and the median over pairs is reported with the per-version minima.

Examples:
  python benchmarks/bench_versions.py --before HEAD~1 --workloads W1 W3 --pairs 5
  python benchmarks/bench_versions.py --before b38b229 --out results/versions.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import write_json

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[4])  # this tree's workloads, whichever package is timed
import jax
import workloads
w = workloads.get_workload(sys.argv[1])
name, repeats = sys.argv[2], int(sys.argv[3])
data, problem = workloads.make_data(w), workloads.make_problem(w)
sim, run, state, compile_s, _ = workloads.engine_program(w, name, data, problem)
state = jax.block_until_ready(run(state))  # warm up
times = []
for _ in range(repeats):
    start = time.perf_counter()
    state = jax.block_until_ready(run(state))
    times.append((time.perf_counter() - start) / w.rounds)
import scaffold_jax
print(json.dumps({"ms": 1e3 * min(times), "compile_s": compile_s[0],
                  "package": scaffold_jax.__file__}))
"""


def child(tree: Path, workload: str, algorithm: str, repeats: int, env=None) -> dict:
    """Times ``workload``/``algorithm`` in a fresh process running ``tree``'s package (with
    ``env`` added to the environment, e.g. ``XLA_FLAGS``).

    The package is ``tree/src``'s: with the tree's root on the path instead, an editable
    install of this checkout wins and both "versions" are this one (as every comparison
    made with this script between the move to a src/ layout and its fix was)."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree / "src")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, workload, algorithm, str(repeats), str(ROOT / "benchmarks")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to((tree / "src").resolve()):
        raise RuntimeError(f"timed {result['package']}, not {tree}'s package")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision to compare with")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W3"])
    parser.add_argument("--algorithms", nargs="+", default=["scaffold", "fedavg"])
    parser.add_argument("--pairs", type=int, default=5, help="alternating before/after pairs")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before), args.before],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            for workload in args.workloads:
                for algorithm in args.algorithms:
                    pairs = []
                    for _ in range(args.pairs):
                        old = child(before, workload, algorithm, args.repeats)
                        new = child(ROOT, workload, algorithm, args.repeats)
                        pairs.append((old, new))
                    row = {
                        "workload": workload,
                        "algorithm": algorithm,
                        "before_ms": min(p[0]["ms"] for p in pairs),
                        "after_ms": min(p[1]["ms"] for p in pairs),
                        "ratio_median": float(np.median([p[1]["ms"] / p[0]["ms"] for p in pairs])),
                        "ratios": [p[1]["ms"] / p[0]["ms"] for p in pairs],
                        "before_compile_s": float(np.median([p[0]["compile_s"] for p in pairs])),
                        "after_compile_s": float(np.median([p[1]["compile_s"] for p in pairs])),
                    }
                    rows.append(row)
                    print(
                        f"{workload} {algorithm:<9} before {row['before_ms']:.2f} ms, after "
                        f"{row['after_ms']:.2f} ms, after/before {row['ratio_median']:.3f} "
                        f"(pairs: {', '.join(f'{r:.2f}' for r in row['ratios'])}); compile "
                        f"{row['before_compile_s']:.2f} -> {row['after_compile_s']:.2f} s",
                        flush=True,
                    )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False
            )
    result = {"before": args.before, "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
