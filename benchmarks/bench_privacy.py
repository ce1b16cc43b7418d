"""What user-level differential privacy costs a round: W1 with DP off, on (fixed-size
sampling: clipping, noise, adaptive clipping), and on with Poisson sampling (whose round
is padded to a fixed width of masked rows).

All programs are compiled first and then timed interleaved in one process (min and median
of ``--repeats`` calls of R rounds each), with their compile time and XLA's temp memory.
The DP programs run with z = 1, C = 0.5 and adaptive clipping on (η_C = 0.2): every part
of the mechanism is in the timed program.

``--message-norms`` instead measures what a SCAFFOLD client's message is made of on
Fashion-MNIST (1,000 clients, similarity 0, logistic regression, the paper's plan): after
``--rounds`` plain rounds, ‖Δy_i‖ and ‖Δc_i‖ of 100 clients, so that the share of the clip
budget Δc_i takes is measured, not assumed (docs/results/privacy.md).

Examples:
  python benchmarks/bench_privacy.py --out benchmarks/results/privacy.json
  python benchmarks/bench_privacy.py --quick
  python benchmarks/bench_privacy.py --message-norms --rounds 0 20 100
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import workloads
from common import engine_parser, ratio_rows, write_json

import scaffold_jax as sj
from scaffold_jax import sampling
from scaffold_jax.tree import sq_norm
from scaffold_jax.types import resolve_hparams

DP = {"dp_noise_multiplier": 1.0, "dp_clip": 0.5, "dp_clip_lr": 0.2}


def program(w, name, data, problem, private: bool, sampler: str):
    """``(run, state, compile_s, temp_bytes, width)`` of R rounds of one variant."""
    algorithm = workloads.make_algorithm(name, problem.loss_fn)
    if private:
        algorithm = sj.privacy.private(algorithm)
    sim = sj.Simulation(
        algorithm, problem, w.plan, w.clients_per_round, sampler=sampling.make(sampler)
    )
    hp = workloads.make_hparams(name)
    hp = resolve_hparams(algorithm, {**hp, **(DP if private else {})})
    state, key = sim.init(data), jr.key(0)
    start = time.perf_counter()
    compiled = sim.run_rounds.lower(hp, state, data, key, num_rounds=w.rounds).compile()
    compile_s = time.perf_counter() - start
    memory = workloads.memory_stats(compiled) or {}
    width = w.clients_per_round
    if sampler == "poisson":
        width = sampling.poisson_bound(data.num_clients, w.clients_per_round)

    def run(state):
        return compiled(hp, state, data, key)[0]

    return run, state, compile_s, memory.get("temp_size_in_bytes"), width


def message_norms(rounds: list[int]) -> dict:
    """‖Δy_i‖ and ‖Δc_i‖ of 100 SCAFFOLD clients after each of ``rounds`` plain rounds."""
    from scaffold_jax.engine import client_keys, round_key_and_ids
    from scaffold_jax.experiments import RunConfig, build

    config = RunConfig(num_clients=1000, clients_per_round=100, similarity=0.0)
    built = build(config)
    sim, data, hp = built.simulation, built.data, built.hparams
    inner, out = sim.algorithm, {}
    for r in rounds:
        state = sim.run(data, hp, r, max(r, 1)).state if r else sim.init(data)
        _, ids = round_key_and_ids(jr.key(1), r, data.num_clients, 100)
        keys = client_keys(jr.key(2), ids)
        dy, dc = [], []
        for i, client in enumerate(np.asarray(ids)):
            row = jax.tree.map(lambda a, c=client: a[c], state.clients)
            batches, mask = data.client_batches(jnp.int32(client), keys[i], sim.plan)
            _, o = inner.client_update(hp, state.server, row, batches, mask, keys[i])
            dy.append(float(jnp.sqrt(sq_norm(o.delta_params))))
            dc.append(float(jnp.sqrt(sq_norm(o.message["delta_control"]))))
        dy, dc = np.asarray(dy), np.asarray(dc)
        share = dy / np.sqrt(dy**2 + dc**2)
        out[r] = {
            "delta_y_median": float(np.median(dy)),
            "delta_c_median": float(np.median(dc)),
            "delta_y_share_of_norm_median": float(np.median(share)),
        }
        print(
            f"after {r:4d} rounds: median |dy| {np.median(dy):.4f}, |dc| {np.median(dc):.4f}, "
            f"|dy| / |(dy, dc)| {np.median(share):.3f}",
            flush=True,
        )
    return {"message_norms": out}


def main(argv=None) -> dict:
    parser = engine_parser(__doc__)
    parser.add_argument("--message-norms", action="store_true")
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 20, 100])
    args = parser.parse_args(argv)
    if args.message_norms:
        result = message_norms(args.rounds)
        write_json(args.out, result)
        return result
    w = workloads.get_workload("W1", quick=args.quick)
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    print(w.describe(), flush=True)
    variants = {
        "plain": (False, "uniform"),
        "dp": (True, "uniform"),
        "plain_poisson": (False, "poisson"),
        "dp_poisson": (True, "poisson"),
    }
    rows = []
    for name in args.algorithms:
        programs, rounds, info = {}, {}, {}
        for label, (private, sampler) in variants.items():
            run, state, compile_s, temp, width = program(w, name, data, problem, private, sampler)
            programs[label], rounds[label] = (run, state), w.rounds
            info[label] = {"compile_s": compile_s, "temp_bytes": temp, "round_width": width}
        wall, _, _ = workloads._interleaved(programs, args.repeats, rounds, stateless=())
        rows += ratio_rows(name, wall, info)
    result = {"workload": w.describe(), "dp": DP, "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
