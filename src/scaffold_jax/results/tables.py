"""Markdown and CSV tables: a sweep's summary and tidy table, the grid-edge warnings,
and the paper's tables.

The paper's layout (Karimireddy et al. 2020, Tables 3-5): rounds to reach a target with
the speed-up over SGD in parentheses, and ``"1k+"`` (``"<horizon>+"``) when the target was
not reached within the horizon.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from scaffold_jax.results.records import (
    _as_mapping,
    best_value,
    is_finite_number,
    rounds_to_target,
    summarize,
)

# ----------------------------------------------------------------------------- sweeps
#: What a sweep's summary reports of each series beside its metric, when its records
#: measure it: the record field, its column and how a value reads. Each is the last
#: record's, the mean over the chosen group's seeds.
COSTS = (
    ("dp_epsilon", "ε spent", lambda v: f"{v:.3g}"),
    ("bytes_up_total", "uplink", lambda v: format_bytes(v)),
    ("virtual_time", "virtual time", lambda v: format_seconds(v)),
)
#: The costs a run measures only when asked to (privacy, a clock), shown whenever measured;
#: the uplink, counted for every run, is shown beside a trade-off axis.
_OPTED_IN = ("dp_epsilon", "virtual_time")


@dataclasses.dataclass
class Series:
    """Some configs of a sweep's grid read as a grid of their own (what
    :func:`summarize`, :func:`sweep_table`, :func:`grid_edges` and the plots read of a
    :class:`~scaffold_jax.sweep.SweepResult`): the configs of one value of its trade-off
    axes (:func:`split_tradeoffs`).

    Attributes:
      algorithm: the grid's algorithm.
      configs, records, diverged_round: those of these configs.
      indices: each config's index in the grid it was taken from.
      parent: that grid's key.
      tradeoff: the trade-off values these configs share, ``{axis: value}`` (the grid's
        settings among them too).
      settings: per config, what places its records (None: unknown).
    """

    algorithm: str
    configs: list[dict[str, Any]]
    records: list[list[dict[str, Any]]]
    diverged_round: list[int]
    indices: list[int]
    parent: str
    tradeoff: dict[str, Any]
    settings: list[dict[str, Any]] | None = None

    @property
    def diverged(self) -> list[bool]:
        return [int(r) >= 0 for r in self.diverged_round]


def summary_metric(results: Mapping[str, Any] | Any) -> tuple[str, bool]:
    """What a sweep's summary ranks by: ``("test_accuracy", True)`` when its records
    measure an accuracy, else ``("test_loss", False)``: a problem without one (the
    quadratics) is ranked by its loss, and no accuracy target applies to it.

    Examples:
      >>> class Grid:
      ...     records = [[{"round": 0, "test_loss": 1.0}]]
      >>> summary_metric({"sgd": Grid()})
      ('test_loss', False)
    """
    for result in _as_mapping(results).values():
        if any("test_accuracy" in r for recs in result.records for r in recs):
            return "test_accuracy", True
    return "test_loss", False


def split_tradeoffs(
    results: Mapping[str, Any] | Any,
    axes: Sequence[str],
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Each grid cut into one :class:`Series` per value of its trade-off axes.

    A trade-off axis (privacy's ε or noise, compression's fraction or bits, a deadline,
    FedBuff's concurrency: a setting declared ``tradeoff=True``) is a cost, not a knob:
    less noise is always more accurate, so a choice over it says nothing. Each of its
    values is a series of its own, over whose configs the tuning knobs (step sizes...)
    are chosen.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      axes: the trade-off axes swept: hyper-parameters of the configs (``dp_epsilon``
        where a config holds it) or settings of a grid (``settings``).
      settings: per grid name, its data and shape settings.

    Returns:
      ``{series name: grid}``: without ``axes``, ``results`` as they are; else a Series
      per grid and value of its axes among the configs, named ``"<grid> <axis>=<value>"``
      (the grid's name alone when its configs share their values), in order.

    Examples:
      >>> class Grid:
      ...     algorithm = "fedavg"
      ...     configs = [{"client_lr": lr, "compress_fraction": f, "seed": 0}
      ...                for f in (0.01, 0.1) for lr in (0.1, 1.0)]
      ...     records = [[] for _ in configs]
      >>> split = split_tradeoffs({"fedavg": Grid()}, ["compress_fraction"])
      >>> {k: s.indices for k, s in split.items()}
      {'fedavg compress_fraction=0.01': [0, 1], 'fedavg compress_fraction=0.1': [2, 3]}
    """
    results = _as_mapping(results)
    if not axes:
        return dict(results)
    out: dict[str, Any] = {}
    for key, result in results.items():
        outer = {a: v for a, v in (settings or {}).get(key, {}).items() if a in axes}
        inner = [a for a in axes if a not in outer and any(a in c for c in result.configs)]
        parts: dict[tuple, list[int]] = {}
        for j, config in enumerate(result.configs):
            parts.setdefault(tuple(config.get(a) for a in inner), []).append(j)
        n = len(result.configs)
        diverged = [int(r) for r in getattr(result, "diverged_round", [-1] * n)]
        placed = getattr(result, "settings", None)
        for values, idx in parts.items():
            name = key
            if len(parts) > 1:
                name += " " + " ".join(f"{a}={v:g}" for a, v in zip(inner, values, strict=True))
            out[name] = Series(
                algorithm=result.algorithm,
                configs=[result.configs[j] for j in idx],
                records=[result.records[j] for j in idx],
                diverged_round=[diverged[j] for j in idx],
                indices=idx,
                parent=key,
                tradeoff={**outer, **dict(zip(inner, values, strict=True))},
                settings=None if placed is None else [placed[j] for j in idx],
            )
    return out


def frontier_rows(
    summary: Mapping[str, Mapping[str, Any]],
    results: Mapping[str, Any] | None = None,
    axes: Sequence[str] = (),
    hidden: Iterable[str] = (),
    settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per series of :func:`summarize`: its trade-off values, the tuned values it
    chose and what the chosen group measured (the frontier of a trade-off sweep).

    Args:
      summary: :func:`summarize` of ``results``.
      results: the series (:func:`split_tradeoffs`); None: no costs are read.
      axes: the trade-off axes swept (each a column).
      hidden: the names not listed among the chosen hyper-parameters (the trade-offs,
        shown as their columns, or fixed).
      settings: per grid name, its settings (the series' label drops the trade-offs).

    Returns:
      Dicts with ``series``, ``label`` (the series without its trade-off values),
      ``values`` (``{axis: value}``), ``hparams`` (the chosen values of the step sizes
      and of the other knobs the sweep varied), ``group`` (the chosen group,
      :func:`~scaffold_jax.results.group_runs`), ``target``, ``metric``, ``costs`` (per
      field of :data:`COSTS` the records carry, its mean final value over the group's
      seeds), ``time_to_target`` and ``bytes_up_to_target`` (means; None unless every
      seed reached the target).
    """
    hidden = set(hidden) | set(axes)
    # The knobs a reader compares: the step sizes and whatever the sweep varied (a fixed
    # value, e.g. the clip norm given once, is the config's: config.json has it).
    values: dict[str, set] = {}
    for entry in summary.values():
        for g in entry["groups"]:
            for name, value in g["hparams"].items():
                values.setdefault(name, set()).add(value)
    varied = {"client_lr", "server_lr"} | {k for k, v in values.items() if len(v) > 1}
    rows = []
    for name, entry in summary.items():
        g = entry["best"]
        result = None if results is None else results[name]
        values = dict(getattr(result, "tradeoff", {}) or {})
        parent = getattr(result, "parent", name)
        label = name
        if axes and result is not None:
            own = {k: v for k, v in (settings or {}).get(parent, {}).items() if k not in hidden}
            label = " ".join([result.algorithm, *(f"{k}={v:g}" for k, v in own.items())])
        runs = [] if result is None else [result.records[j] for j in g["configs"]]
        costs, to_target = {}, {}
        for field, *_ in COSTS:
            finals = [recs[-1].get(field) for recs in runs if recs]
            if finals and all(is_finite_number(v) for v in finals):
                costs[field] = statistics.fmean(finals)
        for field, total in (("time_to_target", "virtual_time"), ("bytes_up_to_target",
                                                                   "bytes_up_total")):  # fmt: skip
            if total in costs and entry.get("target") is not None:
                at = [
                    next((r.get(total) for r in recs if r["round"] == reached), None)
                    for recs, reached in zip(runs, g["rounds_to_target"], strict=True)
                ]
                ok = all(is_finite_number(v) for v in at)
                to_target[field] = statistics.fmean(at) if ok else None
        rows.append(
            {
                "series": name,
                "label": label,
                "values": {a: values.get(a) for a in axes},
                "hparams": {
                    k: v for k, v in g["hparams"].items() if k in varied and k not in hidden
                },
                "group": g,
                "target": entry.get("target"),
                "metric": entry.get("metric", "test_accuracy"),
                "costs": costs,
                **to_target,
            }
        )
    return rows


def format_frontier(rows: Sequence[Mapping[str, Any]], axes: Sequence[str] = ()) -> str:
    """A Markdown table of :func:`frontier_rows`, one row per series: the trade-off
    values (a column each), the chosen hyper-parameters, rounds to the target and how
    many seeds reached it (only when a target applies), the best and final metric, the
    final loss, the costs the records carry (ε spent and virtual time; with trade-off
    axes, the uplink and the uplink to the target too), the time to the target (where a
    clock runs) and divergences."""

    def fmt(mean, std, digits):
        return "not reached" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"

    first = rows[0] if rows else {}
    metric = first.get("metric", "test_accuracy")
    targeted = any(r["target"] is not None for r in rows)
    shown = [
        (field, head, show)
        for field, head, show in COSTS
        if any(field in r["costs"] for r in rows) and (axes or field in _OPTED_IN)
    ]
    timed = targeted and any("time_to_target" in r for r in rows)
    # What reaching the target sent: the measure of a compression sweep.
    sent = targeted and bool(axes) and any("bytes_up_to_target" in r for r in rows)
    body = []
    for r in rows:
        g = r["group"]
        seeds = len(g["seeds"])
        line = [r["label"], *(_value(r["values"].get(a)) for a in axes)]
        line.append(", ".join(f"{k}={v:g}" for k, v in r["hparams"].items()) or "—")
        if targeted:
            line.append(fmt(g["rounds_mean"], g["rounds_std"], 1))
            line.append(f"{g['reached']}/{seeds}")
        line.append("—" if g["best_value_mean"] is None else f"{g['best_value_mean']:.4f}")
        line.append(fmt(g["final_value_mean"], g["final_value_std"], 4))
        line.append(f"{g['final_loss_mean']:.4g}")
        line += [show(r["costs"][f]) if f in r["costs"] else "—" for f, _, show in shown]
        if sent:
            b = r.get("bytes_up_to_target")
            line.append("not reached" if b is None else format_bytes(b))
        if timed:
            t = r.get("time_to_target")
            line.append("not reached" if t is None else format_seconds(t))
        line.append(f"{g['num_diverged']}/{seeds}")
        body.append(line)
    header = ["algorithm", *axes, "hparams"]
    if targeted:
        header += ["rounds to target", "reached"]
    header += [f"best {metric}", f"final {metric}", "final loss", *(h for _, h, _ in shown)]
    if sent:
        header.append("uplink to target")
    if timed:
        header.append("time to target")
    header.append("diverged")
    return markdown_table(header, body)


def format_summary(
    summary: Mapping[str, Mapping[str, Any]],
    results: Mapping[str, Any] | None = None,
    axes: Sequence[str] = (),
    hidden: Iterable[str] = (),
) -> str:
    """A Markdown table of :func:`summarize`'s best configs, one row per series (an
    algorithm and setting, and each value of a trade-off axis): :func:`format_frontier`
    of :func:`frontier_rows`. Without a target (None: a problem without accuracy) the
    rounds-to-target columns are left out."""
    return format_frontier(frontier_rows(summary, results, axes, hidden), axes)


def _value(value: Any) -> str:
    return "—" if value is None else f"{value:g}"


def format_bytes(count: float) -> str:
    """A byte count in the unit that reads best (powers of 1000).

    Examples:
      >>> format_bytes(960), format_bytes(17_600_000), format_bytes(2.5e9)
      ('960 B', '17.6 MB', '2.5 GB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.3g} B"


# Keys of a sweep's record that are not measurements (see scaffold_jax.sweep.SweepResult).
_SWEEP_RECORD_KEYS = frozenset({"round", "seconds", "status", "config", "config_index"})


def sweep_table(
    results: Mapping[str, Any] | Any,
    target: float | None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
    tradeoffs: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """A sweep as a tidy table: one row per config (hyper-parameters × seed) of every grid.

    Every row has the same columns: ``algorithm``; the grid's settings (``settings``, the
    data and shape values of each grid, blank where a grid has none); every
    hyper-parameter of any config (blank where an algorithm does not declare it); ``seed``,
    ``status``, ``diverged_round``, ``rounds`` (the last evaluated round); ``final_<m>``
    for every metric of the last records; ``best_<metric>``; ``target`` and
    ``rounds_to_target`` (:func:`rounds_to_target`; blank if not reached) and ``chosen``
    (the config belongs to its grid's choice, :func:`summarize`: one per value of the
    trade-off axes, :func:`split_tradeoffs`). ``bytes_up_to_target`` and
    ``time_to_target`` where the records carry the totals; with ``target`` None (a
    problem without accuracy) the target columns are left out.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric``, or None.
      settings: per grid name, its data and shape settings (e.g. ``{"similarity": 0}``).
      metric: the record field of ``best_<metric>`` and the target.
      higher_is_better: True for accuracies.
      tradeoffs: the trade-off axes swept: the choice is made per value of them.

    Returns:
      The rows, as dicts of plain values (None for a blank cell).
    """
    results = _as_mapping(results)
    settings = settings or {}
    split = split_tradeoffs(results, tradeoffs, settings)
    summary = summarize(split, target, metric, higher_is_better)
    chosen_of: dict[str, set[int]] = {}
    for name, part in split.items():
        indices = getattr(part, "indices", None)
        best = summary[name]["best"]["configs"]
        chosen_of.setdefault(getattr(part, "parent", name), set()).update(
            best if indices is None else (indices[j] for j in best)
        )
    setting_names = list(dict.fromkeys(k for s in settings.values() for k in s))
    hparam_names = list(
        dict.fromkeys(k for r in results.values() for c in r.configs for k in c if k != "seed")
    )
    # A record also holds the values that place it (its grid's settings and config): they
    # are columns already, not measurements.
    placed = {
        k for r in results.values() for labels in getattr(r, "settings", None) or () for k in labels
    }
    metric_names = list(
        dict.fromkeys(
            k
            for r in results.values()
            for recs in r.records
            for k, v in recs[-1].items()
            if k not in _SWEEP_RECORD_KEYS
            and k not in placed
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        )
    )
    rows = []
    for key, result in results.items():
        chosen = chosen_of[key]
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
            if target is not None:
                row["target"] = target
                reached = rounds_to_target(records, target, metric, higher_is_better)
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


def grid_edges(
    results: Mapping[str, Any] | Any,
    summary: Mapping[str, Mapping[str, Any]],
    tradeoffs: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """The chosen values that lie at the edge of their grid: the optimum may lie beyond.

    For every grid of a sweep and every hyper-parameter it swept (two values or more), the
    chosen group's value (:func:`summarize`) is checked against the smallest and largest
    value of that axis. A trade-off (``tradeoffs``: a cost such as privacy's noise, where
    less is always more accurate) has no optimum to lie beyond: it is never checked.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      summary: :func:`summarize` of ``results``.
      tradeoffs: the names declared trade-offs.

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
    tradeoffs = set(tradeoffs)
    for key, result in _as_mapping(results).items():
        for name, value in summary[key]["best"]["hparams"].items():
            axis = sorted({c[name] for c in result.configs if name in c})
            if name in tradeoffs or len(axis) < 2 or value not in (axis[0], axis[-1]):
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
