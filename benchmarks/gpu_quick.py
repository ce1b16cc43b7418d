"""The issue-6 workloads on an accelerator, in one short run (< 5 minutes on one GPU).

One process: the machine's matmul and bandwidth, then W1, W2, W2-mlp and W3 for SCAFFOLD
and FedAvg by default (``--algorithms`` for more): engine, bare, bare_tuned (interleaved,
min of ``--repeats``), the per-client loop (one round), compile time, peak host RSS,
achieved GFLOP/s and % of the measured matmul peak. Prints the table and writes JSON.

On an accelerator nothing is chunked (``client_chunk="auto"`` keeps all S clients in one
vmap), so the "vmap-all" column stays empty. The device's own memory is reported from
``compiled.memory_analysis()`` in the JSON rows (temp bytes vs the client table).

Usage:
  python benchmarks/gpu_quick.py                     # on the GPU machine
  python benchmarks/gpu_quick.py --quick             # anywhere (CPU): scaled-down smoke test
  python benchmarks/gpu_quick.py --algorithms scaffold scaffold-I fedavg fedprox sgd
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_machine  # noqa: E402
import bench_workloads  # noqa: E402
import workloads  # noqa: E402
from common import write_json  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scaled-down workloads (CPU test)")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W2-mlp", "W3"])
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["scaffold", "fedavg"],
        choices=workloads.ALGORITHMS,
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-loop", action="store_true")
    parser.add_argument(
        "--out", default=None, help="default benchmarks/results/<machine>-quick.json"
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    machine = bench_machine.measure(quick=args.quick)
    print(
        f"{machine['devices']}: matmul {machine['peak_gflops']:.0f} GFLOP/s, "
        f"stream {machine['stream_gbps']:.0f} GB/s",
        flush=True,
    )
    results, rows = {}, []
    for name in args.workloads:
        result = bench_workloads.run(
            name,
            args.algorithms,
            quick=args.quick,
            repeats=args.repeats,
            loop=not args.no_loop,
            machine=machine,
        )
        results[name] = result
        rows += result["rows"]
    summary = {
        "machine": machine,
        "quick": args.quick,
        "wall_s": time.perf_counter() - start,
        "workloads": results,
    }
    out = (
        Path(args.out)
        if args.out
        else HERE / "results" / f"{bench_machine.machine_slug(machine)}-gpu_quick.json"
    )
    write_json(out, summary)
    print()
    print(bench_workloads.format_table(rows))
    print(f"\nwrote {out} ({summary['wall_s']:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
