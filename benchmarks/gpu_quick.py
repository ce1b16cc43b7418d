"""The benchmark workloads on an accelerator, in one short run (< 5 minutes on one GPU).

One process: the machine's matmul and bandwidth, then W1, W2, W2-mlp, W3 and W6 (skewed
client sizes) for SCAFFOLD and FedAvg by default (``--algorithms`` for more): engine,
bare, bare_tuned (interleaved, min of ``--repeats``), the per-client loop (one round),
compile time, peak host RSS, achieved GFLOP/s and % of the measured matmul peak. Then a
32-config sweep (8 step sizes × 4 seeds of SCAFFOLD on W1's shapes, ``bench_sweep.py``)
against the 32 runs one after the other, and the time the paper's full Table 3 protocol
would take: 13 rows × 3 similarities × 5 step sizes = 195 configs × 1,000 rounds,
estimated from the configs×rounds/s of a 5-step-size sweep on EMNIST-balanced's shapes
(100 clients × 1,128 images, S = 20, 5 epochs of batches of 0.2, i.e. K = 25, B = 226;
logistic regression; the rows' other epochs and S scale that figure, which the estimate
ignores). Prints the tables and writes JSON.

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
import bench_sweep  # noqa: E402
import bench_workloads  # noqa: E402
import workloads  # noqa: E402
from common import write_json  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="scaled-down workloads (CPU test)")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W2-mlp", "W3", "W6"])
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
    sweep32, table3 = sweeps(args.quick)
    summary = {
        "machine": machine,
        "quick": args.quick,
        "wall_s": time.perf_counter() - start,
        "workloads": results,
        "sweep32": sweep32,
        "table3_estimate": table3,
    }
    out = (
        Path(args.out)
        if args.out
        else HERE / "results" / f"{bench_machine.machine_slug(machine)}-gpu_quick.json"
    )
    write_json(out, summary)
    print()
    print(bench_workloads.format_table(rows))
    print(
        f"\n32-config sweep: {sweep32['sweep']['config_rounds_per_second']:.0f} configs×rounds/s "
        f"vs {sweep32['sequential']['config_rounds_per_second']:.0f} for 32 sequential runs "
        f"({sweep32['speedup']:.1f}×); the paper's Table 3 protocol (195 configs × 1,000 "
        f"rounds) would take about {table3['hours']:.2f} h here"
    )
    print(f"\nwrote {out} ({summary['wall_s']:.0f} s)")
    return summary


def sweeps(quick: bool) -> tuple[dict, dict]:
    """The 32-config sweep against sequential runs, and the Table 3 time estimate."""
    shape = ["--num-clients", "100", "--test-examples", "500"] if quick else []
    rounds = ["--rounds", "3" if quick else "20", "--repeats", "1"]
    sweep32 = bench_sweep.main([*shape, *rounds, "--step-sizes", "8", "--seeds", "4"])
    emnist = (
        ["--num-clients", "10", "--examples-per-client", "120", "--clients-per-round", "4"]
        if quick
        else ["--num-clients", "100", "--examples-per-client", "1128", "--clients-per-round", "20"]
    )
    batch = "24" if quick else "226"
    one = bench_sweep.main(
        [*emnist, "--local-steps", "25", "--batch-size", batch, "--step-sizes", "5",
         "--seeds", "1", "--rounds", "2" if quick else "10", "--repeats", "1",
         "--skip-sequential", "--test-examples", "500"]
    )  # fmt: skip
    rate = one["sweep"]["config_rounds_per_second"]
    config_rounds = 13 * 3 * 5 * 1000
    return sweep32, {"config_rounds": config_rounds, "config_rounds_per_second": rate,
                     "hours": config_rounds / rate / 3600}  # fmt: skip


if __name__ == "__main__":
    main()
