"""The robustness study (docs/results/robustness.md): FedAvg and SCAFFOLD under Byzantine
attacks, against the mean and five robust aggregators, with and without bucketing.

Fashion-MNIST over N = 100 clients at 0% and 10% similarity (the paper's splits), S = 20
clients a round, logistic regression, the paper's local work (batches of a fifth of the
client's data, one epoch: K = 5), η_l = 0.1, η_g = 1, 30 rounds evaluated every 5. Each
(algorithm, attack, aggregator, bucket size) cell is ONE sweep over the malicious fraction
f ∈ {0, 0.1, 0.2} × three seeds (nine configs in one vmapped program: the malicious set is
a rank mask, so f is data). Attacks at their defaults (sign flip s = 1, Gaussian σ = 1,
ALIE's z from n and m, IPM ε = 0.1, label flipping); the trimmed mean drops β = 0.2 at
each end, Krum assumes F = ⌊f·S⌋, centered clipping τ = ``--clip-radius`` with one
iteration, the geometric median 8 Weiszfeld steps.

Examples:
  python benchmarks/robust_study.py --out benchmarks/results/robust_study.json
  python benchmarks/robust_study.py --quick
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import scaffold_jax as sj
from scaffold_jax import robust
from scaffold_jax.data import partition, sources
from scaffold_jax.sweep import grid

ALGORITHMS = ("fedavg", "scaffold")
ATTACKS = ("signflip", "gaussian", "labelflip", "alie", "ipm")
AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "geomed", "cclip")
FRACTIONS = (0.0, 0.1, 0.2)
TARGET = 0.65


def make_data(similarity: float, num_clients: int, max_train: int | None):
    ds = sources.load("fashion_mnist")
    train = ds.train if max_train is None else {k: v[:max_train] for k, v in ds.train.items()}
    parts = partition.similarity_split(
        train["y"], num_clients=num_clients, similarity=similarity, seed=0
    )
    return sj.from_partition(train, parts, test=ds.test)


def first_at(records, target):
    return next((r["round"] for r in records if r.get("test_accuracy", -1) >= target), None)


def run_cell(algorithm, attack, aggregator, bucket, data, problem, plan, args) -> list[dict]:
    """One sweep: the rows of each fraction f (means ± std over the seeds)."""
    wrapped = robust.attacked(sj.algorithms.make(algorithm, problem.loss_fn), attack)
    wrapped = robust.robustly_aggregated(wrapped, aggregator)
    extra = {"trim_fraction": [0.2]} if aggregator == "trimmed_mean" else {}
    if aggregator != "mean":
        extra["bucket_size"] = [bucket]
    if aggregator == "cclip":
        extra["clip_radius"] = [args.clip_radius]
    sim = sj.Simulation(wrapped, problem, plan, args.clients_per_round)
    hp, seeds, configs = grid(
        client_lr=[0.1], byzantine_fraction=list(args.fractions), seeds=args.seeds, **extra
    )
    start = time.perf_counter()
    swept = sj.loop.sweep(sim, data, hp, seeds, args.rounds, args.eval_every)
    seconds = time.perf_counter() - start
    rows = []
    for f in args.fractions:
        runs = [j for j, c in enumerate(configs) if np.isclose(c["byzantine_fraction"], f)]
        final = [swept.records[j][-1]["test_accuracy"] for j in runs]
        best = [max(r.get("test_accuracy", 0.0) for r in swept.records[j]) for j in runs]
        hits = [first_at(swept.records[j], TARGET) for j in runs]
        selected = [np.mean([r.get("aggregator_selected_malicious", np.nan)
                             for r in swept.records[j][1:]]) for j in runs]  # fmt: skip
        rows.append({
            "algorithm": algorithm, "attack": attack, "aggregator": aggregator,
            "bucket_size": bucket, "f": f, "final": float(np.mean(final)),
            "final_std": float(np.std(final)), "best": float(np.mean(best)),
            "rounds_to_target": None if None in hits else float(np.mean(hits)),
            "selected_malicious": float(np.mean(selected)), "seconds": seconds,
        })  # fmt: skip
    shown = ", ".join(f"f={r['f']:g}: {r['final']:.3f}" for r in rows)
    print(f"{algorithm:8s} {attack:9s} {aggregator:12s} s={bucket}: {shown} ({seconds:.0f} s)",
          flush=True)  # fmt: skip
    return rows


def one_by_one(algorithm, attack, aggregator, data, problem, plan, args) -> dict:
    """One cell's configs as its sweep (one program) and one by one, each config in a
    Simulation of its own (compiled for it, as a separate process would compile it):
    the seconds of each."""
    wrapped = robust.robustly_aggregated(
        robust.attacked(sj.algorithms.make(algorithm, problem.loss_fn), attack), aggregator
    )
    hp, seeds, configs = grid(client_lr=[0.1], byzantine_fraction=list(args.fractions),
                              seeds=args.seeds)  # fmt: skip
    start = time.perf_counter()
    sim = sj.Simulation(wrapped, problem, plan, args.clients_per_round)
    sj.loop.sweep(sim, data, hp, seeds, args.rounds, args.eval_every)
    swept = time.perf_counter() - start
    start = time.perf_counter()
    for config in configs:
        sim = sj.Simulation(wrapped, problem, plan, args.clients_per_round)
        given = sj.hparams(client_lr=0.1, byzantine_fraction=config["byzantine_fraction"])
        sim.run(data, given, num_rounds=args.rounds, eval_every=args.eval_every,
                seed=config["seed"])  # fmt: skip
    single = time.perf_counter() - start
    print(f"{algorithm} {attack} {aggregator}: sweep of {len(configs)} configs {swept:.1f} s, "
          f"one by one {single:.1f} s ({single / swept:.1f}x)", flush=True)  # fmt: skip
    return {"cell": [algorithm, attack, aggregator], "configs": len(configs),
            "sweep_s": swept, "one_by_one_s": single}  # fmt: skip


def table(rows: list[dict], similarity: float, f: float) -> str:
    """Final accuracy (mean ± std over seeds) at fraction ``f``: attacks × aggregators, one
    column per aggregator and bucket size, one row per algorithm and attack."""
    cols = [(a, b) for a in AGGREGATORS for b in (1, 2) if not (a == "mean" and b == 2)]
    head = " | ".join(a if b == 1 else f"{a} (s=2)" for a, b in cols)
    lines = [f"| {similarity:.0%} similarity, f = {f:g} | {head} |",
             "|---|" + "---|" * len(cols)]  # fmt: skip
    cells = {(r["algorithm"], r["attack"], r["aggregator"], r["bucket_size"]): r
             for r in rows if np.isclose(r["f"], f)}  # fmt: skip
    for algorithm in ALGORITHMS:
        for attack in ATTACKS:
            values = []
            for a, b in cols:
                r = cells.get((algorithm, attack, a, b))
                values.append("" if r is None else f"{r['final']:.3f} ± {r['final_std']:.3f}")
            if any(values):
                lines.append(f"| {algorithm} · {attack} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test-sized (seconds)")
    parser.add_argument("--similarities", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS))
    parser.add_argument("--aggregators", nargs="+", default=list(AGGREGATORS))
    parser.add_argument("--clip-radius", type=float, default=1.0)
    parser.add_argument(
        "--buckets",
        nargs="+",
        type=int,
        default=[1, 2],
        help="bucket sizes of the robust aggregators",
    )
    parser.add_argument(
        "--one-by-one",
        action="store_true",
        help="only time one cell as a sweep against its configs one by one",
    )
    parser.add_argument("--out")
    parser.add_argument("--table")
    args = parser.parse_args(argv)
    args.num_clients, args.clients_per_round = (20, 10) if args.quick else (100, 20)
    args.rounds, args.eval_every = (4, 2) if args.quick else (30, 5)
    args.seeds = [0] if args.quick else [0, 1, 2]
    args.fractions = FRACTIONS
    max_train = 2000 if args.quick else None
    problem = sj.models.logistic_regression((28, 28), 10)
    plan = sj.BatchPlan.fraction_of_data(0.2, num_epochs=1)
    if args.one_by_one:
        data = make_data(args.similarities[0], args.num_clients, max_train)
        timing = one_by_one("scaffold", "alie", "median", data, problem, plan, args)
        if args.out:
            Path(args.out).write_text(json.dumps(timing, indent=1))
        return timing
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "table")},
              "rows": {}, "seconds": {}}  # fmt: skip
    tables = []
    for similarity in args.similarities:
        data = make_data(similarity, args.num_clients, max_train)
        start, rows = time.perf_counter(), []
        for algorithm in ALGORITHMS:
            for attack in args.attacks:
                for aggregator in args.aggregators:
                    for bucket in (1,) if aggregator == "mean" else args.buckets:
                        rows += run_cell(algorithm, attack, aggregator, bucket, data, problem,
                                         plan, args)  # fmt: skip
        result["rows"][str(similarity)] = rows
        result["seconds"][str(similarity)] = time.perf_counter() - start
        tables += [table(rows, similarity, f) for f in args.fractions if f > 0]
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.table:
        Path(args.table).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
