"""Round throughput of the vmapped engine against a per-client Python loop.

Workload (issue 2, "W1 small cross-device"): N = 1000 clients × 60 examples, 28×28 uint8
images (d = 784), 10 classes, multinomial logistic regression, S = 100 clients per round,
K = 5 local steps of B = 12. Data are synthetic with the real shapes and dtypes (the cost
of a round does not depend on pixel values).

Measured in ONE process, so the ratios are comparable on a noisy shared machine:
  * engine: ``Simulation.run_rounds`` (R rounds in one compiled ``lax.scan``), steady state;
  * per-client loop: a jitted K-step client function called from Python once per sampled
    client, then a jitted server update (how most simulators run).

Usage:
  python benchmarks/bench_round.py [--rounds 50] [--out benchmarks/results/round.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import scaffold_jax as sj
from scaffold_jax.simulate import client_keys, round_key_and_ids
from scaffold_jax.tree import take_rows


def make_data(num_clients: int, per_client: int, num_classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = num_clients * per_client
    examples = {
        "x": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        "y": rng.integers(0, num_classes, n).astype(np.int32),
    }
    parts = np.arange(n).reshape(num_clients, per_client)
    test = {"x": examples["x"][:1000], "y": examples["y"][:1000]}
    return sj.from_partition(examples, list(parts), test=test)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_engine(sim, data, hp, rounds, repeats):
    """Compile time and steady-state seconds per round of ``rounds`` rounds per program."""
    state = sim.init(data)
    key = jr.key(0)
    start = time.perf_counter()
    program = sim.run_rounds.lower(hp, state, data, key, num_rounds=rounds).compile()
    compile_s = time.perf_counter() - start
    state, _ = program(hp, state, data, key)  # warm-up
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = program(hp, state, data, key)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / rounds)
    return compile_s, min(times)


def time_per_client_loop(sim, data, hp, rounds):
    """The per-client loop: Python iterates over the sampled clients of each round."""
    alg, plan = sim.algorithm, sim.plan

    @jax.jit
    def client(hp, server, row, client_id, key):
        batches, mask = data.client_batches(client_id, key, plan)
        return alg.client_update(hp, server, row, batches, mask, key)

    @jax.jit
    def server_step(hp, server, outputs):
        return alg.server_update(hp, server, outputs, jnp.float32(data.num_clients))

    sample = jax.jit(
        lambda key, r: round_key_and_ids(key, r, data.num_clients, sim.clients_per_round)
    )
    state = sim.init(data)
    key = jr.key(0)

    def one_round(state, r):
        round_key, ids = sample(key, r)
        keys = client_keys(round_key, ids)
        rows_out, outs = [], []
        for s in range(sim.clients_per_round):
            row = take_rows(state.clients, ids[s])
            new_row, out = client(hp, state.server, row, ids[s], keys[s])
            rows_out.append(new_row)
            outs.append(out)
        outputs = jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
        server = server_step(hp, state.server, outputs)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *rows_out)
        clients = jax.tree.map(lambda a, v: a.at[ids].set(v), state.clients, stacked)
        return sj.SimState(server, clients, state.round + 1)

    state = one_round(state, 0)  # compile
    jax.block_until_ready(state)
    start = time.perf_counter()
    for r in range(1, rounds + 1):
        state = one_round(state, r)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-clients", type=int, default=1000)
    parser.add_argument("--per-client", type=int, default=60)
    parser.add_argument("--clients-per-round", type=int, default=100)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=50, help="rounds per compiled program")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    data = make_data(args.num_clients, args.per_client, 10)
    problem = sj.models.logistic_regression((28, 28), 10)
    plan = sj.BatchPlan.fixed(args.batch_size, args.local_steps)
    hp = sj.hparams(client_lr=0.05)
    rows = []
    for name, alg in (
        ("scaffold", sj.scaffold(problem.loss_fn)),
        ("fedavg", sj.fedavg(problem.loss_fn)),
    ):
        sim = sj.Simulation(alg, problem, plan, args.clients_per_round)
        compile_s, engine_s = time_engine(sim, data, hp, args.rounds, args.repeats)
        loop_s = time_per_client_loop(sim, data, hp, args.loop_rounds)
        rows.append(
            {
                "algorithm": name,
                "compile_s": compile_s,
                "engine_round_ms": engine_s * 1e3,
                "engine_rounds_per_s": 1 / engine_s,
                "loop_round_ms": loop_s * 1e3,
                "loop_rounds_per_s": 1 / loop_s,
                "speedup_vs_loop": loop_s / engine_s,
            }
        )
    result = {
        "workload": vars(args),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpu_count": __import__("os").cpu_count(),
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
        },
        "peak_rss_mib": peak_rss_mib(),
        "results": rows,
    }
    print(
        f"{'algorithm':10} {'compile s':>9} {'engine ms/round':>15} {'loop ms/round':>13} "
        f"{'speed-up':>8}"
    )
    for r in rows:
        print(
            f"{r['algorithm']:10} {r['compile_s']:9.2f} {r['engine_round_ms']:15.2f} "
            f"{r['loop_round_ms']:13.2f} {r['speedup_vs_loop']:7.1f}x"
        )
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB; {jax.devices()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
