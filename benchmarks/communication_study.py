"""The communication study's table and figure (docs/results/communication.md), from the
sweep folders its commands write: results/comm-{none, qsgd8, qsgd4, topk1, topk10,
signef, topk1-dy, topk1-dc, qsgd4-dy, qsgd4-dc}.

For every compression setting, similarity and algorithm it takes the step size the sweep
chose (its ``chosen`` row in sweep.csv: the fewest rounds to the target, then the best
accuracy) and reports the rounds to the target, the uplink MB (all clients, cumulative)
when the target was first reached, the uplink MB of one participant's round, and the best
test accuracy; the figure plots test accuracy against cumulative uplink MB, one panel per
similarity.

Examples:
  python benchmarks/communication_study.py --results results \\
      --figure docs/communication.png --table docs/results/communication_table.md
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

SETTINGS = {
    "none": "uncompressed",
    "qsgd8": "qsgd 8 bits",
    "qsgd4": "qsgd 4 bits",
    "topk10": "topk 10% + EF",
    "topk1": "topk 1% + EF",
    "signef": "signef (sign + EF)",
    "topk1-dy": "topk 1% + EF, Δy only",
    "topk1-dc": "topk 1% + EF, Δc only",
    "qsgd4-dy": "qsgd 4 bits, Δy only",
    "qsgd4-dc": "qsgd 4 bits, Δc only",
}
ALGORITHMS = {"scaffold": "SCAFFOLD", "fedavg": "FedAvg", "fedprox": "FedProx", "feddyn": "FedDyn"}
DRAWN = ("none", "qsgd4", "topk1")  # the figure's settings (all would be unreadable)


def chosen(folder: Path) -> dict[tuple[str, float], dict]:
    """``{(algorithm, similarity): row}`` of the chosen step size in ``folder/sweep.csv``."""
    with open(folder / "sweep.csv") as f:
        return {
            (row["algorithm"], float(row["similarity"])): row
            for row in csv.DictReader(f)
            if row["chosen"] == "True"
        }


def curve(folder: Path, row: dict) -> list[tuple[int, float, float]]:
    """``[(round, uplink MB cumulative, test accuracy)]`` of the chosen config."""
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if (
            rec.get("algorithm") == row["algorithm"]
            and rec.get("similarity") == float(row["similarity"])
            and rec.get("client_lr") == float(row["client_lr"])
            and "test_accuracy" in rec
        ):
            out.append((rec["round"], rec.get("bytes_up_total", 0) / 1e6, rec["test_accuracy"]))
    return sorted(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results")
    parser.add_argument("--figure", default=None)
    parser.add_argument("--table", default=None)
    parser.add_argument("--target", type=float, default=0.7)
    args = parser.parse_args(argv)
    root = Path(args.results)
    lines = [
        "| similarity | algorithm | compression | η_l | rounds to "
        f"{args.target:.0%} | uplink MB to {args.target:.0%} | uplink MB per client-round | "
        "best test accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    curves = defaultdict(dict)
    for similarity in (0.0, 10.0):
        for algorithm, label in ALGORITHMS.items():
            for setting, words in SETTINGS.items():
                folder = root / f"comm-{setting}"
                if not (folder / "sweep.csv").exists():
                    continue
                row = chosen(folder).get((algorithm, similarity))
                if row is None:
                    continue
                points = curve(folder, row)
                reached = next((p for p in points if p[2] >= args.target), None)
                per_round = float(row["final_bytes_up"]) / 20 / 1e6  # S = 20 participants
                lines.append(
                    f"| {similarity:g}% | {label} | {words} | {float(row['client_lr']):g} | "
                    f"{reached[0] if reached else 'not reached'} | "
                    f"{f'{reached[1]:.3g}' if reached else '—'} | {per_round:.3g} | "
                    f"{float(row['best_test_accuracy']):.3f} |"
                )
                curves[similarity][(algorithm, setting)] = points
    table = "\n".join(lines) + "\n"
    print(table)
    if args.table:
        Path(args.table).write_text(table)
    if args.figure:
        from scaffold_jax.results.plots import new_figure, save_figure, style_axes

        title = "Fashion-MNIST, N = 100, S = 20: accuracy per uplink MB"
        rows = len(ALGORITHMS) * len(DRAWN)
        fig, axes = new_figure(2, title=title, legend="below", legend_rows=rows)
        styles = {"none": "-", "qsgd4": "--", "topk1": ":"}
        for ax, similarity in zip(axes, (0.0, 10.0), strict=True):
            for (algorithm, setting), points in curves[similarity].items():
                if setting not in DRAWN:
                    continue
                points = [p for p in points if p[1] > 0]  # round 0 sent nothing: off a log axis
                ax.plot([p[1] for p in points], [p[2] for p in points], styles[setting],
                        label=f"{ALGORITHMS[algorithm]}, {SETTINGS[setting]}",
                        color=f"C{list(ALGORITHMS).index(algorithm)}")  # fmt: skip
            ax.set_xscale("log")
            style_axes(ax, xlabel="uplink MB (cumulative, all clients)", ylabel="test accuracy",
                       title=f"similarity {similarity:g}%", legend="below")  # fmt: skip
        save_figure(fig, args.figure)


if __name__ == "__main__":
    main()
