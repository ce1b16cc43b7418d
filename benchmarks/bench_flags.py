"""XLA CPU flags against the default, on the engine's round (fresh processes, alternating).

Each flag set runs the same workload in a fresh subprocess (``bench_versions.child``: the
round program compiled for ``w.rounds`` rounds, min of ``--repeats`` calls), alternating
with the default, so that the ratio flag/default is taken within each pair on a noisy
machine; the median over pairs is reported.

Examples:
  python benchmarks/bench_flags.py --workloads W1 --pairs 3 --out benchmarks/results/flags.json
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from bench_versions import ROOT, child
from common import write_json

#: Flag sets tried, each against the default (XLA_FLAGS unset):
FLAG_SETS = {
    # Eigen's thread pool off: W1's dots are tiny, so handing each to two threads may cost
    # more synchronisation than it saves.
    "no_multi_thread_eigen": "--xla_cpu_multi_thread_eigen=false",
    # Unsafe math (reassociation, approximate division/exp): the answers change a little.
    "fast_math": "--xla_cpu_enable_fast_math=true",
    # Fewer, larger parallel tasks per fused loop.
    "parallel_split_1": "--xla_cpu_parallel_codegen_split_count=1",
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["W1"])
    parser.add_argument("--algorithm", default="scaffold")
    parser.add_argument("--flags", nargs="+", default=list(FLAG_SETS), choices=list(FLAG_SETS))
    parser.add_argument("--pairs", type=int, default=3, help="alternating default/flag pairs")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per process")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    base_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    rows = []
    for workload in args.workloads:
        for name in args.flags:
            pairs = []
            for _ in range(args.pairs):
                os.environ.clear()
                os.environ.update(base_env)
                default = child(ROOT, workload, args.algorithm, args.repeats)
                flagged = child(
                    ROOT, workload, args.algorithm, args.repeats, {"XLA_FLAGS": FLAG_SETS[name]}
                )
                pairs.append((default, flagged))
            ratios = [f["ms"] / d["ms"] for d, f in pairs]
            row = {
                "workload": workload,
                "algorithm": args.algorithm,
                "flags": FLAG_SETS[name],
                "default_ms": min(d["ms"] for d, _ in pairs),
                "flag_ms": min(f["ms"] for _, f in pairs),
                "ratio_median": float(np.median(ratios)),
                "ratios": ratios,
            }
            rows.append(row)
            print(
                f"{workload} {args.algorithm} {FLAG_SETS[name]}: default {row['default_ms']:.2f} "
                f"ms, with the flag {row['flag_ms']:.2f} ms, flag/default "
                f"{row['ratio_median']:.3f} (pairs: {', '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )
    result = {"rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
