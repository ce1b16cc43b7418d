"""The time study's table and figure (docs/results/time.md), from the sweep folders its
commands write: results/time-{sync, deadline, over, fedbuff20, fedbuff50, fedbuff20-avail,
fedbuff20-avail-topk, sync-avail, sync-avail-topk} (the folders found; the others are
left out).

For every setting and algorithm it takes the step size the sweep chose (its ``chosen`` row
in sweep.csv: the fewest rounds or server steps to the target; within a setting every
step size sees the same clients at the same times, so that is also the least virtual
time) and reports the virtual time to the target (the first evaluation at or above it),
the rounds or server steps, the uplink MB then, the mean staleness (FedBuff) and the
final and best test accuracy; the figure plots test accuracy against virtual time, one
panel per algorithm, over the first 12 virtual minutes.

Examples:
  python benchmarks/time_study.py --results results --figure docs/time.png \\
      --table docs/results/time_table.md
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

SETTINGS = {
    "sync": "synchronous, no deadline",
    "deadline": "synchronous, deadline 6 s",
    "over": "synchronous, 1.3x over-selection",
    "fedbuff20": "FedBuff M = 20, B = 10",
    "fedbuff50": "FedBuff M = 50, B = 10",
    "sync-avail": "synchronous, available 1/3",
    "sync-avail-topk": "synchronous, available 1/3, top-k 10%",
    "fedbuff20-avail": "FedBuff M = 20, B = 10, available 1/3",
    "fedbuff20-avail-topk": "FedBuff M = 20, B = 10, available 1/3, top-k 10%",
}
ALGORITHMS = {"scaffold": "SCAFFOLD", "fedavg": "FedAvg"}


def chosen(folder: Path) -> dict[str, dict]:
    """``{algorithm: row}`` of the chosen step size in ``folder/sweep.csv``."""
    with open(folder / "sweep.csv") as f:
        return {row["algorithm"]: row for row in csv.DictReader(f) if row["chosen"] == "True"}


def curve(folder: Path, row: dict) -> list[dict]:
    """The chosen config's records (round, virtual_time, test_accuracy, ...), in order."""
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if (
            rec.get("algorithm") == row["algorithm"]
            and rec.get("client_lr") == float(row["client_lr"])
            and "test_accuracy" in rec
        ):
            out.append(rec)
    return sorted(out, key=lambda r: r["round"])


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results")
    parser.add_argument("--figure", default=None)
    parser.add_argument("--table", default=None)
    parser.add_argument("--target", type=float, default=0.7)
    args = parser.parse_args(argv)
    root = Path(args.results)
    pct = f"{args.target:.0%}"
    lines = [
        f"| algorithm | setting | η_l | virtual minutes to {pct} | rounds (steps) to {pct} | "
        f"uplink MB to {pct} | mean staleness | final acc. | best acc. | total minutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    curves = defaultdict(dict)
    for algorithm, label in ALGORITHMS.items():
        for setting, words in SETTINGS.items():
            folder = root / f"time-{setting}"
            if not (folder / "sweep.csv").exists():
                continue
            row = chosen(folder).get(algorithm)
            if row is None:
                continue
            records = curve(folder, row)
            reached = next((r for r in records if r["test_accuracy"] >= args.target), None)
            stale = [r["staleness_mean"] for r in records if "staleness_mean" in r]
            uplink = f"{reached['bytes_up_total'] / 1e6:.3g}" if reached else "—"
            lines.append(
                f"| {label} | {words} | {float(row['client_lr']):g} | "
                f"{minutes(reached['virtual_time']) if reached else 'not reached'} | "
                f"{reached['round'] if reached else '—'} | "
                f"{uplink} | "
                f"{f'{sum(stale) / len(stale):.2f}' if stale else '0'} | "
                f"{records[-1]['test_accuracy']:.3f} | {float(row['best_test_accuracy']):.3f} | "
                f"{minutes(records[-1]['virtual_time'])} |"
            )
            curves[algorithm][setting] = records
    table = "\n".join(lines) + "\n"
    print(table)
    if args.table:
        Path(args.table).write_text(table)
    if args.figure:
        from scaffold_jax.results.plots import new_figure, save_figure, style_axes

        title = "Fashion-MNIST, N = 100, 0% similarity, lognormal devices: accuracy in time"
        fig, axes = new_figure(2, title=title, legend="below", legend_rows=len(SETTINGS))
        for ax, (algorithm, label) in zip(axes, ALGORITHMS.items(), strict=True):
            for k, (setting, records) in enumerate(curves[algorithm].items()):
                points = [(r.get("virtual_time", 0.0) / 60, r["test_accuracy"]) for r in records]
                style = "-" if setting in ("sync", "deadline", "over") else "--"
                ax.plot([p[0] for p in points], [p[1] for p in points], style,
                        label=SETTINGS[setting], color=f"C{k}")  # fmt: skip
            ax.axhline(args.target, color="0.6", linestyle=":", linewidth=1)
            ax.set_xlim(0, 12)  # the synchronous run without a deadline goes on to ~36 min
            style_axes(ax, xlabel="virtual time (minutes)", ylabel="test accuracy",
                       title=label, legend="below")  # fmt: skip
        save_figure(fig, args.figure)


if __name__ == "__main__":
    main()
