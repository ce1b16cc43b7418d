"""Round time of the engine against its own limits, per workload and algorithm.

For each algorithm of a workload (see ``workloads.py``), in ONE process: the engine
(``Simulation.run_rounds``), the bare per-client gradient work on pre-gathered batches
(``bare``: params as stored; ``bare_tuned``: the fastest formulation, kernels ``[out, in]``),
timed interleaved, min of ``--repeats``; the per-client Python loop; compile time; peak RSS;
``compiled.memory_analysis()`` of the engine program; achieved GFLOP/s (matmul FLOPs of the
gradients, see ``workloads.flops_per_example_gradient``) and its fraction of the dense
matmul peak (``bench_machine.py``, measured after the workload unless given).

Examples:
  python benchmarks/bench_workloads.py --workload W1 --out w1.json
  python benchmarks/bench_workloads.py --workload W3 --algorithms scaffold fedavg --repeats 3
  python benchmarks/bench_workloads.py --workload W1 --quick --no-loop
  python benchmarks/bench_workloads.py --workload W1 --algorithms fedavg --ablation fedavg

Columns: ``engine`` is ``Simulation.run_rounds`` as it is (on CPU the sampled clients run
in cache-sized chunks, ``client_chunk="auto"``); ``vmap-all`` the engine with all S clients
in one vmap (``client_chunk=None``; shown only where the engine chunks); ``bare``/``tuned``
the floors (see ``workloads.py``); ``loop/e`` the per-client loop's time over the
engine's; GFLOP/s and % peak of the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_machine  # noqa: E402
import workloads  # noqa: E402
from common import peak_rss_mib, write_json  # noqa: E402

COLUMNS = (
    ("workload", "{:<8}", "workload"),
    ("algorithm", "{:<10}", "algorithm"),
    ("engine_ms", "{:.2f}", "engine ms"),
    ("unchunked_ms", "{:.2f}", "vmap-all ms"),
    ("bare_ms", "{:.2f}", "bare ms"),
    ("bare_tuned_ms", "{:.2f}", "tuned ms"),
    ("engine_over_bare", "{:.2f}x", "e/bare"),
    ("engine_over_bare_tuned", "{:.2f}x", "e/tuned"),
    ("loop_over_engine", "{:.1f}x", "loop/e"),
    ("compile_s", "{:.2f}", "compile s"),
    ("engine_rss_mib", "{:.0f}", "RSS MiB"),
    ("best_gflops", "{:.1f}", "GFLOP/s"),
    ("peak_fraction", "{:.1%}", "% peak"),
)


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """A fixed-width text table; missing values print as ``-``."""
    cells = [[title for _, _, title in columns]]
    for row in rows:
        cells.append(
            ["-" if row.get(key) is None else fmt.format(row[key]) for key, fmt, _ in columns]
        )
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for r in cells:
        parts = [
            c.ljust(wd) if fmt.startswith("{:<") else c.rjust(wd)
            for c, wd, (_, fmt, _) in zip(r, widths, columns, strict=True)
        ]
        lines.append(" ".join(parts))
    return "\n".join(lines)


ABLATION_COLUMNS = (
    ("workload", "{:<8}", "workload"),
    ("algorithm", "{:<10}", "algorithm"),
    ("variant", "{:<50}", "variant"),
    ("ms", "{:.2f}", "ms/round"),
    ("cpu_ms", "{:.2f}", "CPU ms/round"),
    ("compile_s", "{:.2f}", "compile s"),
)


def run(
    workload: str,
    algorithms=workloads.ALGORITHMS,
    quick: bool = False,
    repeats: int = 5,
    loop: bool = True,
    rounds: int | None = None,
    machine: dict | None = None,
    verbose: bool = True,
    ablation=(),
) -> dict:
    """Measures ``algorithms`` on one workload (and the ablation for those in
    ``ablation``); returns the JSON-able result."""
    w = workloads.get_workload(workload, quick)
    if rounds is not None:
        w = dataclasses.replace(w, rounds=rounds)
    import jax

    jax.block_until_ready(jax.jit(lambda x: x + 1)(1.0))  # JAX and XLA up, nothing else
    rss_baseline = peak_rss_mib()
    start = time.perf_counter()
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    rss_data = peak_rss_mib()
    if verbose:
        print(w.describe(), f"(data {time.perf_counter() - start:.1f} s)", flush=True)
    rows = []
    for name in algorithms:
        rows.append(workloads.measure(w, name, data, problem, repeats=repeats, loop=loop))
        if verbose:
            print(format_table(rows[-1:]).splitlines()[1], flush=True)
    ablation_rows = []
    for name in ablation:
        ablation_rows += workloads.ablation(w, name, data, problem, repeats=repeats)
        if verbose:
            print(format_table(ablation_rows, ABLATION_COLUMNS), flush=True)
    if machine is None:
        # Measured last, so that its buffers do not count in the workloads' peak RSS.
        machine = bench_machine.measure(quick=True)
    for row in rows:
        for key in ("engine", "best", "bare", "bare_tuned"):
            row[f"{key}_peak_fraction"] = row[f"{key}_gflops"] / machine["peak_gflops"]
        row["peak_fraction"] = row["best_peak_fraction"]
    return {
        "workload": {
            **{k: v for k, v in dataclasses.asdict(w).items() if k != "plan"},
            "plan": repr(w.plan),
            "steps_and_batch": w.steps_and_batch,
            "description": w.describe(),
            "quick": quick,
        },
        "machine": machine,
        "peak_rss_baseline_mib": rss_baseline,
        "peak_rss_after_data_mib": rss_data,
        "rows": rows,
        "ablation": ablation_rows,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(workloads.WORKLOADS))
    parser.add_argument(
        "--algorithms", nargs="*", default=list(workloads.ALGORITHMS), choices=workloads.ALGORITHMS
    )
    parser.add_argument("--quick", action="store_true", help="a scaled-down smoke test")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (min is kept)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per engine program")
    parser.add_argument("--no-loop", action="store_true", help="skip the per-client loop")
    parser.add_argument(
        "--ablation",
        nargs="*",
        default=[],
        choices=workloads.ALGORITHMS,
        help="also time the engine with each optimisation undone, for these algorithms",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = run(
        args.workload,
        args.algorithms,
        quick=args.quick,
        repeats=args.repeats,
        loop=not args.no_loop,
        rounds=args.rounds,
        ablation=args.ablation,
    )
    print(format_table(result["rows"]))
    if result["ablation"]:
        print(format_table(result["ablation"], ABLATION_COLUMNS))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
