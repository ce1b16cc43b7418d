"""Skewed client sizes (workload W6): how much of the local work is useful, and what it
costs per round.

Under an ``epochs`` plan a client of n_i examples takes E · ceil(n_i / B) steps; W6's
Dirichlet α = 0.1 split gives clients of 1 to ~2,200 examples. The engine sorts the
sampled clients by step count into its chunks and stops each chunk's local loop after its
longest client; before, every client ran the K of the largest of all N clients, masked.
This script reports, for the rounds it times, the fraction of the steps run that are a
client's own (``useful_steps``; ``useful_steps_padded`` for the padded round), and ms per
round of the engine with its automatic chunk, one vmap over all S (``client_chunk=None``:
each round as long as its longest sampled client) and one client at a time, interleaved
in one process. The before/after times come from ``bench_versions.py --workloads W6``.

Examples:
  python benchmarks/bench_skew.py --out benchmarks/results/skew.json
  python benchmarks/bench_skew.py --quick
"""

from __future__ import annotations

import jax
import numpy as np
import workloads
from common import engine_parser, write_json


def main(argv=None) -> dict:
    args = engine_parser(__doc__).parse_args(argv)
    w = workloads.get_workload("W6", quick=args.quick)
    data, problem = workloads.make_data(w), workloads.make_problem(w)
    counts = np.asarray(data.counts)
    steps = np.asarray(w.plan.local_steps(counts))
    print(
        f"{w.describe()}; client sizes {counts.min()}..{counts.max()} (median "
        f"{int(np.median(counts))}), steps {steps.min()}..{steps.max()} (mean {steps.mean():.1f})",
        flush=True,
    )
    rows = []
    for name in args.algorithms:
        programs, rounds, sims = {}, {}, {}
        for label, chunk in (("auto", "auto"), ("all_S", None), ("one", 1)):
            sim, run, state, compile_s, _ = workloads.engine_program(
                w, name, data, problem, client_chunk=chunk
            )
            programs[label], rounds[label], sims[label] = (run, state), w.rounds, sim
        wall, _, args_out = workloads._interleaved(programs, args.repeats, rounds, stateless=())
        # The rounds the timed programs ran: the sampled ids of the last state's rounds.
        sim = sims["auto"]
        ids = np.asarray(
            jax.vmap(
                lambda r: workloads.round_key_and_ids(
                    jax.random.key(0), r, data.num_clients, w.clients_per_round
                )[1]
            )(np.arange(int(args_out["auto"].round)))
        )
        row = {
            "workload": w.name,
            "algorithm": name,
            "client_chunk": sim.resolve_client_chunk(data),
            **workloads.useful_step_fraction(sim, data, ids),
            **{f"{k}_ms": 1e3 * min(v) for k, v in wall.items()},
        }
        rows.append(row)
        print(
            f"{name:<9} useful steps {row['useful_steps']:.0%} (padded round "
            f"{row['useful_steps_padded']:.0%}); ms/round: auto chunk {row['client_chunk']} "
            f"{row['auto_ms']:.1f}, all S in one vmap {row['all_S_ms']:.1f}, one client at a "
            f"time {row['one_ms']:.1f}",
            flush=True,
        )
    result = {"workload": w.describe(), "rows": rows}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
