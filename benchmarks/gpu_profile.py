"""Where an accelerator's round time goes: a profile of the engine's round, per operation.

For W1 and W3 (SCAFFOLD and FedAvg), the engine's block of R rounds is compiled, warmed
up, timed, then run once more under ``jax.profiler.trace`` with a Perfetto trace. The
trace's device events (on a GPU, one per kernel launched; on a CPU, XLA's thunks) are
summed by name: the table of the operations that take the time, their count per round (on
a GPU, kernel launches per round) and their share of the round. Beside it, the compiled
program's structure per round (``bench_fixed_cost.structure``: operations and fusions
executed, while loops, of them with a trip count XLA cannot know), so a launch count can
be read against the program.

Prepared to run in one short call on a lent device (the machine has jax with CUDA, flax,
optax and orbax; the package importable from src/):

  PYTHONPATH=src python benchmarks/gpu_profile.py --out $OUT/profile.json --trace-dir $OUT/trace
  python benchmarks/gpu_profile.py --quick        # a check on this CPU (seconds)
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import workloads  # noqa: E402
from bench_fixed_cost import structure  # noqa: E402
from common import write_json  # noqa: E402


def perfetto_events(trace_dir: Path) -> list[dict]:
    """The complete events (``ph == "X"``) of the newest Perfetto trace under
    ``trace_dir``, each with its thread's name."""
    traces = sorted(trace_dir.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(traces[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    threads = {
        (e.get("pid"), e.get("tid")): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    processes = {
        e.get("pid"): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    out = []
    for e in events:
        if e.get("ph") == "X":
            where = (
                f"{processes.get(e.get('pid'), '')}/{threads.get((e.get('pid'), e.get('tid')), '')}"
            )
            out.append(
                {"name": e.get("name", ""), "dur_us": float(e.get("dur", 0.0)), "where": where}
            )
    return out


def device_table(events: list[dict], rounds: int, top: int) -> tuple[list[dict], dict]:
    """Events on the device (a GPU's streams; on a CPU, the XLA threads) summed by name:
    ``(rows, totals)``, rows by time, per round."""
    device = [e for e in events if "/device:" in e["where"].lower() or "gpu" in e["where"].lower()]
    if not device:  # a CPU: XLA's own thunks run on its client threads
        device = [e for e in events if "xla" in e["where"].lower() or "tfrt" in e["where"].lower()]
        # ... less the executor's own spans, which contain the operations' (counted twice).
        device = [e for e in device if not e["name"].startswith("ThunkExecutor")]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in device:
        by_name[e["name"]].append(e["dur_us"])
    total = sum(sum(v) for v in by_name.values()) or 1.0
    rows = sorted(
        (
            {
                "op": name,
                "us_per_round": sum(v) / rounds,
                "count_per_round": len(v) / rounds,
                "share": sum(v) / total,
            }  # fmt: skip
            for name, v in by_name.items()
        ),
        key=lambda r: -r["us_per_round"],
    )
    totals = {
        "events_per_round": len(device) / rounds,
        "busy_us_per_round": total / rounds,
        "distinct_ops": len(by_name),
    }
    return rows[:top], totals


def profile(workload: str, name: str, quick: bool, trace_dir: Path, top: int) -> dict:
    w = workloads.get_workload(workload, quick=quick)
    data, problem = workloads.make_data(w), workloads.make_problem(w)
    sim, run, state, compile_s, _ = workloads.engine_program(w, name, data, problem)
    hp = workloads.make_hparams(name, sim.algorithm)
    compiled = sim.run_rounds.lower(hp, state, data, jr.key(0), num_rounds=w.rounds).compile()
    state = jax.block_until_ready(run(state))  # warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        state = jax.block_until_ready(run(state))
        times.append((time.perf_counter() - start) * 1e3 / w.rounds)
    folder = trace_dir / f"{workload}_{name}"
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        state = jax.block_until_ready(run(state))
    rows, totals = device_table(perfetto_events(folder), w.rounds, top)
    return {
        "workload": workload, "algorithm": name, "rounds": w.rounds,
        "ms_per_round_min": min(times), "compile_s": compile_s[0],
        "program": structure(compiled.as_text(), w.rounds), **totals, "top": rows,
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test-sized data (seconds)")
    parser.add_argument("--workloads", nargs="+", default=["W1", "W3"])
    parser.add_argument("--algorithms", nargs="+", default=["scaffold", "fedavg"])
    parser.add_argument("--top", type=int, default=15, help="operations listed per program")
    parser.add_argument("--trace-dir", default="/tmp/scaffold_jax_profile")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0]} ({jax.default_backend()})", flush=True)
    results = []
    for workload in args.workloads:
        for name in args.algorithms:
            r = profile(workload, name, args.quick, Path(args.trace_dir), args.top)
            results.append(r)
            p = r["program"]
            print(
                f"\n{workload} {name}: {r['ms_per_round_min']:.3f} ms/round; "
                f"{r['events_per_round']:.0f} device events/round ({r['distinct_ops']} distinct), "
                f"busy {r['busy_us_per_round'] / 1e3:.3f} ms/round; program: {p['ops']:.0f} ops, "
                f"{p['whiles']:.1f} while loops ({p['data_dependent_whiles']} data-dependent) "
                "a round",
                flush=True,
            )
            print("| op | µs/round | count/round | share |\n|---|---|---|---|")
            for row in r["top"]:
                print(
                    f"| {row['op'][:60]} | {row['us_per_round']:.1f} | "
                    f"{row['count_per_round']:.1f} | {row['share']:.1%} |"
                )
    if args.out:
        write_json(args.out, {"device": str(jax.devices()[0]), "results": results})


if __name__ == "__main__":
    main()
