"""Markdown and CSV tables: a sweep's summary and tidy table, the grid-edge warnings,
and the paper's tables.

The paper's layout (Karimireddy et al. 2020, Tables 3-5): rounds to reach a target with
the speed-up over SGD in parentheses, and ``"1k+"`` (``"<horizon>+"``) when the target was
not reached within the horizon.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from scaffold_jax.results.records import _as_mapping, best_value, rounds_to_target, summarize


# ----------------------------------------------------------------------------- sweeps
def format_summary(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table of :func:`summarize`'s best configs, one row per algorithm."""

    def fmt(mean, std, digits):
        return "not reached" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"

    rows = []
    for name, entry in summary.items():
        g = entry["best"]
        hp = ", ".join(f"{k}={v:g}" for k, v in g["hparams"].items())
        best = "—" if g["best_value_mean"] is None else f"{g['best_value_mean']:.4f}"
        rows.append(
            [
                name,
                hp,
                "—" if entry.get("target") is None else fmt(g["rounds_mean"], g["rounds_std"], 1),
                f"{g['reached']}/{len(g['seeds'])}",
                best,
                fmt(g["final_value_mean"], g["final_value_std"], 4),
                f"{g['final_loss_mean']:.4g}",
                f"{g['num_diverged']}/{len(g['seeds'])}",
            ]
        )
    metric = next(iter(summary.values()), {}).get("metric", "test_accuracy")
    header = [
        "algorithm",
        "hparams",
        "rounds to target",
        "reached",
        f"best {metric}",
        f"final {metric}",
        "final loss",
        "diverged",
    ]
    return markdown_table(header, rows)


# Keys of a sweep's record that are not measurements (see scaffold_jax.sweep.SweepResult).
_SWEEP_RECORD_KEYS = frozenset({"round", "seconds", "status", "config", "config_index"})


def sweep_table(
    results: Mapping[str, Any] | Any,
    target: float | None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> list[dict[str, Any]]:
    """A sweep as a tidy table: one row per config (hyper-parameters × seed) of every grid.

    Every row has the same columns: ``algorithm``; the grid's settings (``settings``, the
    data and shape values of each grid, blank where a grid has none); every
    hyper-parameter of any config (blank where an algorithm does not declare it); ``seed``,
    ``status``, ``diverged_round``, ``rounds`` (the last evaluated round); ``final_<m>``
    for every metric of the last records; ``best_<metric>``; ``target`` and
    ``rounds_to_target`` (:func:`rounds_to_target`; blank if not reached) and ``chosen``
    (the config belongs to its grid's choice, :func:`summarize`).

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric``.
      settings: per grid name, its data and shape settings (e.g. ``{"similarity": 0}``).
      metric: the record field of ``best_<metric>`` and the target.
      higher_is_better: True for accuracies.

    Returns:
      The rows, as dicts of plain values (None for a blank cell).
    """
    results = _as_mapping(results)
    settings = settings or {}
    summary = summarize(results, target, metric, higher_is_better)
    setting_names = list(dict.fromkeys(k for s in settings.values() for k in s))
    hparam_names = list(
        dict.fromkeys(k for r in results.values() for c in r.configs for k in c if k != "seed")
    )
    metric_names = list(
        dict.fromkeys(
            k
            for r in results.values()
            for recs in r.records
            for k, v in recs[-1].items()
            if k not in _SWEEP_RECORD_KEYS
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        )
    )
    rows = []
    for key, result in results.items():
        chosen = set(summary[key]["best"]["configs"])
        diverged = list(getattr(result, "diverged_round", [-1] * len(result.configs)))
        for j, config in enumerate(result.configs):
            records = result.records[j]
            last = records[-1] if records else {}
            row: dict[str, Any] = {"algorithm": result.algorithm}
            row.update({k: settings.get(key, {}).get(k) for k in setting_names})
            row.update({k: config.get(k) for k in hparam_names})
            row["seed"] = config.get("seed")
            row["status"] = last.get("status", "ok")
            row["diverged_round"] = int(diverged[j]) if int(diverged[j]) >= 0 else None
            row["rounds"] = last.get("round")
            row.update({f"final_{m}": last.get(m) for m in metric_names})
            row[f"best_{metric}"] = best_value(records, metric, higher_is_better)
            row["target"] = target
            reached = (
                None
                if target is None
                else rounds_to_target(records, target, metric, higher_is_better)
            )
            row["rounds_to_target"] = reached
            at = {r["round"]: r for r in records}
            # What reaching it sent (engine.communication) and took (participation.clock).
            for name, total in (("bytes_up", "bytes_up_total"), ("time", "virtual_time")):
                if total in last:
                    row[f"{name}_to_target"] = (
                        None if reached is None else at[reached].get(total, 0)
                    )
            row["chosen"] = j in chosen
            rows.append(row)
    return rows


def csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` (dicts with the same keys) as CSV text with a header; None is a blank."""
    import io

    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


#: Axes that set a budget rather than tune accuracy: less noise is always "best", so the
#: edge of their grid says nothing about where an optimum lies.
BUDGETS = ("dp_noise_multiplier",)


def grid_edges(
    results: Mapping[str, Any] | Any, summary: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The chosen values that lie at the edge of their grid: the optimum may lie beyond.

    For every grid of a sweep and every hyper-parameter it swept (two values or more), the
    chosen group's value (:func:`summarize`) is checked against the smallest and largest
    value of that axis.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      summary: :func:`summarize` of ``results``.

    Returns:
      One dict per value at an edge: ``series`` (the grid name), ``name``, ``value``,
      ``edge`` (``"smallest"`` or ``"largest"``) and ``grid`` (the axis, sorted).

    Examples:
      >>> class Grid:  # what a SweepResult offers here
      ...     configs = [{"client_lr": lr, "seed": 0} for lr in (0.1, 0.3, 1.0)]
      >>> summary = {"sgd": {"best": {"hparams": {"client_lr": 1.0}}}}
      >>> [(e["name"], e["value"], e["edge"]) for e in grid_edges({"sgd": Grid()}, summary)]
      [('client_lr', 1.0, 'largest')]
    """
    out = []
    for key, result in _as_mapping(results).items():
        for name, value in summary[key]["best"]["hparams"].items():
            axis = sorted({c[name] for c in result.configs if name in c})
            if name in BUDGETS or len(axis) < 2 or value not in (axis[0], axis[-1]):
                continue
            edge = "smallest" if value == axis[0] else "largest"
            out.append({"series": key, "name": name, "value": value, "edge": edge, "grid": axis})
    return out


def format_grid_edge(edge: Mapping[str, Any]) -> str:
    """One line for an entry of :func:`grid_edges`, saying how to extend the grid.

    Below the smallest value it suggests only values a hyper-parameter can take (every one
    is >= 0, step sizes > 0): a smaller positive value in the grid's own ratio, or, when 0
    itself was chosen, values between 0 and the next one.

    Examples:
      >>> edge = {"series": "fedprox", "name": "prox_mu", "edge": "smallest"}
      >>> format_grid_edge({**edge, "value": 0, "grid": [0, 0.1, 1]}).split(", so ")[1]
      'the best value is 0 or lies between 0 and 0.1: refine the grid there (e.g. 0.01, 0.03).'
      >>> format_grid_edge({**edge, "value": 0.1, "grid": [0.1, 0.3, 1]}).split(": ")[-1]
      'extend the grid below 0.1 with smaller positive values (e.g. 0.033).'
    """
    grid, value = edge["grid"], edge["value"]
    values = ", ".join(f"{v:g}" for v in grid)
    head = f"{edge['series']}: the chosen {edge['name']} = {value:g} is the {edge['edge']} value"
    if edge["edge"] == "largest":
        advice = f"the best value may lie above it: extend the grid above {value:g}."
    elif value <= 0:
        step = grid[1]
        advice = (
            f"0 is also the smallest value allowed, so the best value is 0 or lies between 0 "
            f"and {step:g}: refine the grid there (e.g. {step / 10:.2g}, {step * 0.3:.2g})."
        )
    else:
        smaller = value * value / grid[1]  # one step of the grid's own ratio below
        advice = (
            f"the best value may lie below it: extend the grid below {value:g} with smaller "
            f"positive values (e.g. {smaller:.2g})."
        )
    return f"{head} of its grid ({values}); {advice}"


# ----------------------------------------------------------------------------- tables
def format_seconds(seconds: float) -> str:
    """A duration in the unit that reads best: seconds, minutes or hours.

    Examples:
      >>> format_seconds(42.31), format_seconds(754.0), format_seconds(9000.0)
      ('42.3 s', '12.6 min', '2.5 h')
    """
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def format_rounds(rounds: int | None, horizon: int) -> str:
    """``"77"``, or ``"1k+"`` / ``"<horizon>+"`` when the target was not reached.

    Examples:
      >>> format_rounds(77, 1000), format_rounds(None, 1000), format_rounds(None, 60)
      ('77', '1k+', '60+')
    """
    if rounds is not None:
        return str(int(rounds))
    if horizon >= 1000 and horizon % 1000 == 0:
        return f"{horizon // 1000}k+"
    return f"{horizon}+"


def format_speedup(rounds: int | None, baseline: int | None, horizon: int) -> str:
    """The speed-up over the baseline (SGD) as the paper prints it: ``"(4.1×)"``.

    A side that did not reach the target counts as the horizon, which turns the ratio into
    a bound: ``"(<0.3×)"`` when only the baseline reached it, ``"(>3.2×)"`` when only this
    method did, ``""`` when neither did.
    """
    if rounds is None and baseline is None:
        return ""
    if rounds is not None and baseline is not None:
        return f"({baseline / max(rounds, 1):.1f}×)"
    if rounds is None:
        return f"(<{baseline / horizon:.1f}×)"
    return f"(>{horizon / max(rounds, 1):.1f}×)"


def rounds_cell(
    rounds: int | None, baseline: int | None, horizon: int, with_speedup: bool = True
) -> str:
    """One table cell: rounds and the speed-up over the baseline: ``"77 (4.1×)"``.

    Examples:
      >>> rounds_cell(77, 317, 1000), rounds_cell(None, 317, 1000), rounds_cell(77, None, 1000)
      ('77 (4.1×)', '1k+ (<0.3×)', '77 (>13.0×)')
    """
    text = format_rounds(rounds, horizon)
    speedup = format_speedup(rounds, baseline, horizon) if with_speedup else ""
    return f"{text} {speedup}".strip()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table.

    Examples:
      >>> print(markdown_table(["method", "0%"], [["SGD", "317 (1.0×)"]]))
      | method | 0% |
      |---|---|
      | SGD | 317 (1.0×) |
    """
    lines = ["| " + " | ".join(str(h) for h in header) + " |"]
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Cell(NamedTuple):
    """One entry of a paper table: a row (e.g. method and epochs) in a column (similarity).

    Attributes:
      row: the row label fields, e.g. ``("SCAFFOLD", 5)``.
      column: the column label, e.g. ``"0%"``.
      rounds: rounds to the target (None: not reached within ``horizon``).
      horizon: the number of rounds run.
      value: a scalar for value tables (Table 5's best accuracy); None otherwise.
      client_lr: the η_l chosen for this cell.
      seeds: how many seeds ``rounds`` and ``value`` are the means of (1: a single run).
      rounds_std, value_std: their standard deviations over the seeds.
      reached: how many seeds reached the target (``rounds`` is None unless all did).
    """

    row: tuple
    column: str
    rounds: float | None = None
    horizon: int = 0
    value: float | None = None
    client_lr: float | None = None
    seeds: int = 1
    rounds_std: float | None = None
    value_std: float | None = None
    reached: int | None = None


def rounds_table(
    cells: Sequence[Cell], row_header: Sequence[str], baseline_row: str | None = "SGD"
) -> str:
    """The paper's rounds-to-target table: rows x columns, speed-up over the baseline.

    The baseline (SGD) of a column is the cell whose row starts with ``baseline_row``; a
    column without one gets no speed-ups (the paper's Table 4 has no SGD row).
    """
    columns = list(dict.fromkeys(c.column for c in cells))
    rows = list(dict.fromkeys(c.row for c in cells))
    at = {(c.row, c.column): c for c in cells}
    baselines = {
        col: next((c for c in cells if c.column == col and c.row[0] == baseline_row), None)
        for col in columns
    }
    body = []
    for row in rows:
        line = list(row)
        for col in columns:
            cell = at.get((row, col))
            if cell is None:
                line.append("")
                continue
            base = baselines[col]
            text = rounds_cell(
                cell.rounds,
                None if base is None else base.rounds,
                cell.horizon,
                with_speedup=base is not None,
            )
            if cell.seeds > 1:  # "14.7 ± 1.2 (2.6×)", or "100+ (2/3 seeds)"
                if cell.rounds is None:
                    reached = f"{cell.reached or 0}/{cell.seeds} seeds"
                    text = f"{format_rounds(None, cell.horizon)} ({reached})"
                else:
                    head = f"{cell.rounds:.1f} ± {cell.rounds_std or 0.0:.1f}"
                    text = head + text[len(format_rounds(cell.rounds, cell.horizon)) :]
            line.append(text)
        body.append(line)
    return markdown_table([*row_header, *columns], body)


def value_table(
    cells: Sequence[Cell], row_header: Sequence[str], fmt: str = ".3f", field: str = "value"
) -> str:
    """A table of one number per cell (Table 5's best accuracy, or the chosen η_l)."""
    columns = list(dict.fromkeys(c.column for c in cells))
    rows = list(dict.fromkeys(c.row for c in cells))
    at = {(c.row, c.column): c for c in cells}
    body = []
    for row in rows:
        line = list(row)
        for col in columns:
            cell = at.get((row, col))
            value = None if cell is None else getattr(cell, field)
            text = "" if value is None else format(value, fmt)
            if field == "value" and value is not None and cell.value_std is not None:
                text += f" ± {format(cell.value_std, fmt)}"  # a mean over seeds
            line.append(text)
        body.append(line)
    return markdown_table([*row_header, *columns], body)
