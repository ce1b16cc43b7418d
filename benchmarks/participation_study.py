"""The participation study's tables and figure (docs/results/participation.md), from the
four sweep folders its commands write: results/participation-{uniform, diurnal,
stragglers, dropouts}.

For every scenario and algorithm it takes the step size the sweep chose (its ``chosen``
rows in sweep.csv: the fewest mean rounds to the target, then the best accuracy) and
reports, over the seeds, the rounds to the target (mean ± std; seeds that never reached it
counted as not reached) and the best test accuracy (mean ± std); the figure plots the mean
test accuracy of those configs against the rounds, one panel per scenario.

Examples:
  python benchmarks/participation_study.py --results results --figure docs/participation.png
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

SCENARIOS = {
    "uniform": "(a) uniform, always available",
    "diurnal": "(b) diurnal: 4 groups in turn",
    "stragglers": "(c) stragglers: K_i uniform in [1, K]",
    "dropouts": "(d) 20% dropouts",
}
ALGORITHMS = {"scaffold": "SCAFFOLD", "fedavg": "FedAvg", "fednova": "FedNova", "feddyn": "FedDyn"}


def chosen_rows(folder: Path) -> dict[str, list[dict]]:
    """``{algorithm: [row per seed]}`` of the chosen step size in ``folder/sweep.csv``."""
    out = defaultdict(list)
    with open(folder / "sweep.csv") as f:
        for row in csv.DictReader(f):
            if row["chosen"] == "True":
                out[row["algorithm"]].append(row)
    return out


def curves(folder: Path, picks: dict[str, list[dict]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{algorithm: (rounds, mean test accuracy over seeds)}`` of the chosen configs."""
    wanted = {(a, float(r["client_lr"]), int(r["seed"])) for a, rows in picks.items() for r in rows}
    series = defaultdict(dict)
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        key = (rec.get("algorithm"), rec.get("client_lr"), rec.get("seed"))
        if key in wanted and "test_accuracy" in rec:
            series[key][rec["round"]] = rec["test_accuracy"]
    out = {}
    for algorithm in picks:
        runs = [v for k, v in series.items() if k[0] == algorithm]
        rounds = np.array(sorted(set.intersection(*(set(r) for r in runs))))
        acc = np.mean([[run[t] for t in rounds] for run in runs], axis=0)
        out[algorithm] = (rounds, acc)
    return out


def summary(rows: list[dict]) -> tuple[str, str, str]:
    """``(step size, rounds to target, best accuracy)`` cells of one algorithm."""
    reached = [
        float(r["rounds_to_target"]) for r in rows if r["rounds_to_target"] not in ("", "None")
    ]
    best = np.array([float(r["best_test_accuracy"]) for r in rows])
    if len(reached) == len(rows):
        rounds = f"{np.mean(reached):.1f} ± {np.std(reached):.1f}"
    elif reached:
        rounds = f"{np.mean(reached):.1f} ({len(reached)}/{len(rows)} seeds)"
    else:
        rounds = "not reached"
    return rows[0]["client_lr"], rounds, f"{best.mean():.3f} ± {best.std():.3f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="where the sweep folders are")
    parser.add_argument("--figure", default="docs/participation.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(16, 3.8), sharey=True)
    table = ["| scenario | algorithm | η_l | rounds to 70% | best test accuracy |",
             "|---|---|---|---|---|"]  # fmt: skip
    for ax, (scenario, title) in zip(axes, SCENARIOS.items(), strict=True):
        folder = Path(args.results) / f"participation-{scenario}"
        picks = chosen_rows(folder)
        for algorithm, (rounds, acc) in curves(folder, picks).items():
            # FedNova is FedAvg when every client takes the same steps ((b), (d)): dashed,
            # so that the curve under it shows.
            style = "--" if algorithm == "fednova" else "-"
            ax.plot(rounds, acc, style, label=ALGORITHMS.get(algorithm, algorithm))
        for algorithm in ALGORITHMS:
            if algorithm in picks:
                lr, rounds, best = summary(picks[algorithm])
                table.append(f"| {title} | {ALGORITHMS[algorithm]} | {lr} | {rounds} | {best} |")
        ax.axhline(0.7, color="grey", lw=0.6, ls=":")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylim(0.4, 0.85)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (mean of 3 seeds)")
    axes[-1].legend(loc="lower right")
    fig.suptitle("Fashion-MNIST, 0% similarity, logistic regression, 100 clients, S = 20, 5 epochs")
    fig.tight_layout()
    fig.savefig(args.figure, dpi=110)
    print("\n".join(table))
    print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
