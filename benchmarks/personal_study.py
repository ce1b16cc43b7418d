"""The personalization study (docs/results/personalization.md): one global model (FedAvg,
SCAFFOLD, each with and without fine-tuning) against a model per client (Ditto over FedAvg
and over SCAFFOLD, FedRep, FedPer, APFL, pFedMe, Per-FedAvg), all evaluated on every
client's own held-out test data.

Fashion-MNIST over N = 100 clients, two label skews: ``similarity0`` (the paper's 0%
similarity: every client holds one label) and ``shards2`` (two shards of sorted labels a
client: one or two labels), each client holding out a fifth of its examples as its own
test data. A 784-200-10 MLP (body: the hidden layer; head: the output layer), S = 20, the
paper's local work (batches of 0.2 of the client's data, one epoch: K = 5). Each method
is ONE sweep (its step sizes × its own hyper-parameters × three seeds, one vmapped
program); the reported config is the one with the best mean final
``personal_accuracy_mean`` over the seeds, and its numbers are means (± std) over them.

Examples:
  python benchmarks/personal_study.py --out benchmarks/results/personal_study.json
  python benchmarks/personal_study.py --quick
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import scaffold_jax as sj
from scaffold_jax.data import partition, sources
from scaffold_jax.data.federated import with_client_tests
from scaffold_jax.engine.personal import Personalization
from scaffold_jax.sweep import grid

FINETUNE = 5  # fine-tuning steps: one epoch of the paper's local work (K = 5)
#: (label, registry name, factory options, extra hyper-parameter axes, fine-tuning steps)
METHODS = (
    ("FedAvg", "fedavg", {}, {}, 0),
    ("FedAvg + fine-tuning", "fedavg", {}, {}, FINETUNE),
    ("SCAFFOLD", "scaffold", {}, {}, 0),
    ("SCAFFOLD + fine-tuning", "scaffold", {}, {}, FINETUNE),
    ("Ditto(FedAvg)", "ditto", {"base": "fedavg"}, {"ditto_lambda": [0.1, 1.0]}, 0),
    ("Ditto(SCAFFOLD)", "ditto", {"base": "scaffold"}, {"ditto_lambda": [0.1, 1.0]}, 0),
    ("FedRep", "fedrep", {}, {}, 0),
    ("FedPer", "fedper", {}, {}, 0),
    ("APFL", "apfl", {}, {"apfl_alpha": [0.25, 0.75]}, 0),
    ("pFedMe", "pfedme", {}, {}, 0),
    ("Per-FedAvg (FO)", "perfedavg", {}, {"perfedavg_alpha": [0.01, 0.1]}, 0),
)
TARGETS = (0.8, 0.9)


def make_data(setting: str, num_clients: int, max_train: int | None):
    ds = sources.load("fashion_mnist")
    train = ds.train
    if max_train is not None:
        train = {k: v[:max_train] for k, v in train.items()}
    labels = train["y"]
    if setting == "similarity0":
        parts = partition.similarity_split(labels, num_clients=num_clients, similarity=0, seed=0)
    else:
        parts = partition.shard_split(labels, num_clients=num_clients, shards_per_client=2, seed=0)
    kept, held = partition.local_test_split(parts, 0.2, seed=0)
    data = sj.from_partition(train, kept, test=ds.test)
    tests = [{k: v[ix] for k, v in train.items()} for ix in held]
    return with_client_tests(data, tests)


def first_at(records, name, target):
    """The round and uplink MB of the first record at or above ``target`` (None, None)."""
    for r in records:
        if r.get(name, -1.0) >= target:
            return r["round"], r.get("bytes_up_total", float("nan")) / 1e6
    return None, None


def run_method(method, data, problem, plan, args) -> dict:
    label, name, options, axes, finetune = method
    algorithm = sj.algorithms.make(name, problem.loss_fn, **options)
    sim = sj.Simulation(algorithm, problem, plan, args.clients_per_round,
                        personalization=Personalization(finetune_steps=finetune))  # fmt: skip
    hp, seeds, configs = grid(client_lr=args.lrs, seeds=args.seeds, **axes)
    start = time.perf_counter()
    swept = sj.loop.sweep(sim, data, hp, seeds, args.rounds, args.eval_every)
    seconds = time.perf_counter() - start
    by_setting: dict[tuple, list[int]] = {}
    for j, config in enumerate(configs):
        key = tuple((k, v) for k, v in sorted(config.items()) if k != "seed")
        by_setting.setdefault(key, []).append(j)

    def final(j, metric):
        return swept.records[j][-1].get(metric, float("nan"))

    best = max(by_setting, key=lambda k: np.mean([final(j, "personal_accuracy_mean")
                                                   for j in by_setting[k]]))  # fmt: skip
    runs = by_setting[best]
    row = {"method": label, "config": dict(best), "seconds": seconds, "configs": len(configs)}
    for metric in ("personal_accuracy_mean", "personal_accuracy_worst10", "personal_gain_fraction",
                   "local_accuracy_mean", "test_accuracy"):  # fmt: skip
        values = [final(j, metric) for j in runs]
        row[metric] = float(np.mean(values))
        row[metric + "_std"] = float(np.std(values))
    for target in TARGETS:
        hits = [first_at(swept.records[j], "personal_accuracy_mean", target) for j in runs]
        reached = [h for h in hits if h[0] is not None]
        row[f"rounds_to_{target}"] = (
            float(np.mean([h[0] for h in reached])) if len(reached) == len(runs) else None
        )
        row[f"uplink_mb_to_{target}"] = (
            float(np.mean([h[1] for h in reached])) if len(reached) == len(runs) else None
        )
    row["curve"] = [  # the mean over the seeds at each evaluation
        {"round": r["round"], "personal": float(np.mean(
            [swept.records[j][i]["personal_accuracy_mean"] for j in runs]))}
        for i, r in enumerate(swept.records[runs[0]])
    ]  # fmt: skip
    print(
        f"{label:24s} personal {row['personal_accuracy_mean']:.3f} (worst 10% "
        f"{row['personal_accuracy_worst10']:.3f}, gain {row['personal_gain_fraction']:.2f}), "
        f"x on T_i {row['local_accuracy_mean']:.3f}, test {row['test_accuracy']:.3f}; "
        f"{dict(best)}; {seconds:.0f} s",
        flush=True,
    )
    return row


def table(result: dict) -> str:
    lines = []
    for setting, rows in result["settings"].items():
        lines += [
            f"**{setting}** ({result['describe'][setting]})",
            "",
            "| method | personal acc. (mean) | worst 10% | gain fraction | x on T_i | global test "
            "| rounds to 0.8 / 0.9 | uplink MB to 0.9 | chosen |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:

            def show(name, r=r):
                v = r[name]
                return "—" if v is None or np.isnan(v) else f"{v:.3f} ± {r[name + '_std']:.3f}"

            rounds = " / ".join("—" if r[f"rounds_to_{t}"] is None else f"{r[f'rounds_to_{t}']:.0f}"
                                for t in TARGETS)  # fmt: skip
            mb = r["uplink_mb_to_0.9"]
            chosen = ", ".join(f"{k} {v:g}" for k, v in r["config"].items())
            lines.append(
                f"| {r['method']} | {show('personal_accuracy_mean')} | "
                f"{show('personal_accuracy_worst10')} | {show('personal_gain_fraction')} | "
                f"{show('local_accuracy_mean')} | {show('test_accuracy')} | {rounds} | "
                f"{'—' if mb is None else f'{mb:.1f}'} | {chosen} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="test-sized (seconds)")
    parser.add_argument("--settings", nargs="+", default=["similarity0", "shards2"])
    parser.add_argument("--methods", nargs="+", default=None, help="labels (default: all)")
    parser.add_argument("--out")
    parser.add_argument("--table")
    args = parser.parse_args(argv)
    args.num_clients, args.clients_per_round = (20, 5) if args.quick else (100, 20)
    args.rounds, args.eval_every = (4, 2) if args.quick else (30, 5)
    args.lrs, args.seeds = ([0.1], [0]) if args.quick else ([0.03, 0.1], [0, 1, 2])
    max_train = 2000 if args.quick else None
    problem = sj.models.mlp((28, 28), 10, hidden_sizes=(200,), key=jax.random.key(0))
    plan = sj.BatchPlan.fraction_of_data(0.2, num_epochs=1)
    describe = {
        "similarity0": "0% similarity: one label a client",
        "shards2": "two shards of sorted labels a client: one or two labels",
    }
    result = {"describe": describe, "settings": {}, "args": {
        k: v for k, v in vars(args).items() if k not in ("out", "table")}}  # fmt: skip
    for setting in args.settings:
        data = make_data(setting, args.num_clients, max_train)
        print(f"{setting}: {data.num_clients} clients, {int(data.counts.sum())} training and "
              f"{int(data.client_test_counts.sum())} client test examples", flush=True)  # fmt: skip
        rows = []
        for method in METHODS:
            if args.methods is None or method[0] in args.methods:
                rows.append(run_method(method, data, problem, plan, args))
        result["settings"][setting] = rows
    text = table(result)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.table:
        Path(args.table).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
