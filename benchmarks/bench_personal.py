"""What personalization costs: the evaluation of every client's own model on its own test
data against the global evaluation of the same examples, and a personalized algorithm's
round against its base's.

``eval``: N clients (100,000 by default; ``--quick``: 2,000) of 20 training and 20 test
examples, d = 100 features, 10 classes, logistic regression. Three compiled programs,
timed interleaved: the global evaluation (``Simulation.evaluate``) of x on the pooled
client test examples, the clients' evaluation of a global algorithm (p_i = x: FedAvg), and
of a personalized one (Ditto: each client's own v_i from the ``[N, P]`` table, and x).

``rounds``: W1's clients (1,000 × 60 Fashion-MNIST-sized images, S = 100, K = 5, B = 12)
with a 784-200-10 MLP (FedRep and FedPer need a body): Ditto(FedAvg) vs FedAvg,
Ditto(SCAFFOLD) vs SCAFFOLD, FedRep, FedPer, APFL, pFedMe and Per-FedAvg vs FedAvg,
interleaved, ms a round, compile time and XLA temp.

Examples:
  python benchmarks/bench_personal.py --out benchmarks/results/personal.json
  python benchmarks/bench_personal.py --quick
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import workloads
from common import engine_parser, peak_rss_mib, ratio_rows, write_json

import scaffold_jax as sj
from scaffold_jax.engine import heldout_metrics

#: Round programs: (label, registry name, factory options, base label).
ROUNDS = (
    ("fedavg", "fedavg", {}, None),
    ("ditto(fedavg)", "ditto", {"base": "fedavg"}, "fedavg"),
    ("scaffold", "scaffold", {}, None),
    ("ditto(scaffold)", "ditto", {"base": "scaffold"}, "scaffold"),
    ("fedrep", "fedrep", {}, "fedavg"),
    ("fedper", "fedper", {}, "fedavg"),
    ("apfl", "apfl", {}, "fedavg"),
    ("pfedme", "pfedme", {}, "fedavg"),
    ("perfedavg", "perfedavg", {}, "fedavg"),
)


def eval_data(num_clients: int, dim: int = 100, classes: int = 10, each: int = 20):
    rng = np.random.default_rng(0)
    n = num_clients * each

    def pool():
        return {
            "x": rng.normal(size=(n, dim)).astype(np.float32),
            "y": rng.integers(0, classes, n).astype(np.int32),
        }

    train, test = pool(), pool()
    counts = np.full(num_clients, each)
    data = sj.data.from_partition(train, np.split(np.arange(n), num_clients), test=test)
    data = data.replace(
        client_test=jax.tree.map(jnp.asarray, test),
        client_test_counts=jnp.asarray(counts, jnp.int32),
        max_test_count=each,
    )
    return data


def bench_eval(args) -> list[dict]:
    num_clients = 2_000 if args.quick else args.clients
    data = eval_data(num_clients)
    problem = sj.models.logistic_regression((100,), 10, zero_init=False, key=jr.key(1))
    plan = sj.BatchPlan.fixed(batch_size=5, num_steps=4)
    hp = sj.hparams(client_lr=0.1)
    key = jr.key(0)
    programs, info = {}, {}
    for label, name in (
        ("global", "fedavg"),
        ("clients_fedavg", "fedavg"),
        ("clients_ditto", "ditto"),
    ):
        alg = sj.algorithms.make(name, problem.loss_fn)
        # The global evaluation of the same examples: the test metrics alone.
        sim = sj.Simulation(alg, problem, plan, 10, evaluators=(heldout_metrics,))
        state = sim.init(data)
        hparams = sj.types.resolve_hparams(alg, hp)
        start = time.perf_counter()
        if label == "global":
            compiled = sim.evaluate.lower(state.server, data).compile()
            call = lambda s, c=compiled: c(s.server, data)  # noqa: E731
        else:
            compiled = sim.evaluate_clients.lower(hparams, state, data, key).compile()
            call = lambda s, c=compiled, h=hparams: c(h, s, data, key)  # noqa: E731
        info[label] = {
            "compile_s": time.perf_counter() - start,
            "temp_bytes": (workloads.memory_stats(compiled) or {}).get("temp_size_in_bytes"),
            "table_bytes": workloads.tree_bytes(state.clients),
        }
        programs[label] = (call, state)  # stateless: every call evaluates the same state
    rounds = dict.fromkeys(programs, 1)
    wall, _, _ = workloads._interleaved(programs, args.repeats, rounds, stateless=tuple(programs))
    print(f"evaluation of {num_clients:,} clients x 20 test examples (d = 100, 10 classes)")
    rows = ratio_rows("eval", wall, info, base="global")
    for row in rows:
        row["clients"] = num_clients
    return rows


def bench_rounds(args) -> list[dict]:
    # W1's clients with a one-hidden-layer MLP: FedRep and FedPer need a body to share.
    w = dataclasses.replace(
        workloads.get_workload("W1", quick=args.quick), model="mlp", hidden_sizes=(200,)
    )
    data = workloads.make_data(w)
    problem = workloads.make_problem(w)
    hp = sj.hparams(client_lr=0.05)
    print(w.describe())
    programs, info, base_of = {}, {}, {}
    for label, name, options, base in ROUNDS:
        alg = sj.algorithms.make(name, problem.loss_fn, **options)
        sim = sj.Simulation(alg, problem, w.plan, w.clients_per_round)
        hparams = sj.types.resolve_hparams(alg, hp)
        state = sim.init(data)
        key = jr.key(0)
        start = time.perf_counter()
        compiled = sim.run_rounds.lower(hparams, state, data, key, num_rounds=w.rounds).compile()
        info[label] = {
            "compile_s": time.perf_counter() - start,
            "temp_bytes": (workloads.memory_stats(compiled) or {}).get("temp_size_in_bytes"),
        }
        programs[label] = (lambda s, c=compiled, h=hparams, k=key: c(h, s, data, k)[0], state)
        base_of[label] = base
    wall, _, _ = workloads._interleaved(
        programs, args.repeats, dict.fromkeys(programs, w.rounds), ()
    )
    rows = []
    for label, base in base_of.items():
        if base is None:
            continue
        pair = {label: wall[label], base: wall[base]}
        rows += [r for r in ratio_rows(label, pair, info, base=base) if r["variant"] == label]
    return rows


def main(argv=None) -> dict:
    parser = engine_parser(__doc__)
    parser.add_argument("--clients", type=int, default=100_000, help="clients evaluated")
    parser.add_argument("--parts", nargs="+", default=["eval", "rounds"])
    args = parser.parse_args(argv)
    result = {}
    if "eval" in args.parts:
        result["eval"] = bench_eval(args)
    if "rounds" in args.parts:
        result["rounds"] = bench_rounds(args)
    result["peak_rss_mib"] = peak_rss_mib()
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
