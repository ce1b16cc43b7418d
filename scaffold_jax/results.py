"""Run records on disk: the per-run folder, rounds-to-target, the step-size selection,
paper-style tables, and every plot.

One of each: :func:`rounds_to_target` is the package's only rounds-to-target;
:func:`select` is the only step-size selection policy (``reproduce`` reaches it through
:func:`scaffold_jax.experiments.choose`, ``sweep`` through :func:`summarize`); every plot
(run curves, a sweep's rounds to target and best curves, client drift, G against
similarity) is a ``matplotlib.figure.Figure`` in one style (:func:`new_figure`,
:func:`style_axes`), never pyplot and never a change of the global backend.

Every run (``scaffold-jax run`` or one ``scaffold-jax reproduce`` protocol) owns one output
folder, written by a :class:`RunWriter`:

* ``config.json``: the full configuration, as given and resolved;
* ``metrics.jsonl``: one JSON object per evaluation, appended and flushed as it is made,
  so a run killed at any point keeps every record it finished;
* ``summary.json``: written at the start (``"status": "running"``) and rewritten at the
  end: status (``finished``, ``failed`` or ``interrupted``), rounds to each target, best
  accuracy, compile and steady-state time, the jax version and devices;
* ``metrics.csv``: the same records as a table;
* ``accuracy.png`` / ``loss.png`` (or the plots an experiment asks for): one line per
  series (algorithm, or algorithm and setting).

A record is a flat dict with at least ``"series"`` (which curve it belongs to) and
``"round"``, plus whatever the evaluation measured (``test_accuracy``, ``test_loss``,
``train_loss``, ``error``...).

Tables follow the paper's layout (Karimireddy et al. 2020, Tables 3-5): rounds to reach a
target with the speed-up over SGD in parentheses, and ``"1k+"`` (``"<horizon>+"``) when the
target was not reached within the horizon.
"""

from __future__ import annotations

import csv
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

Record = dict[str, Any]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CSV_FILE = "metrics.csv"
PARTS_FILE = "parts.jsonl"

RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"

# Record fields that describe the setting of a series rather than measure it: left out of
# a series' "final" metrics.
SETTING_KEYS = frozenset(
    {"series", "round", "algorithm", "epochs", "sampled", "similarity", "client_lr",
     "local_steps", "G"}
)  # fmt: skip

# Files a writer may have made; --overwrite removes only these (and those a previous
# summary lists), never the whole folder: `--out .` must not wipe a working directory.
_OWN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CSV_FILE, "accuracy.png", "loss.png")


# ----------------------------------------------------------------------------- metrics
def is_finite_number(value: Any) -> bool:
    """True for a real, finite int or float (not a bool, NaN or ±inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rounds_to_target(
    records: Iterable[Mapping[str, Any]],
    target: float,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> int | None:
    """The first evaluated round at which ``metric`` reaches ``target``, or None.

    This is the package's one rounds-to-target: single runs, paper tables, sweeps and the
    step-size selection (:func:`select`) all count with it.

    A diverged run never reaches the target: a non-finite value never counts (``-inf`` is
    below every error target, and a NaN compares False either way, so both are excluded
    explicitly), and neither does a record whose ``status`` is present and not ``"ok"``
    (a sweep config after it diverged). The resolution is the evaluation cadence: with
    ``eval_every = 5`` the answer is a multiple of 5 (an upper bound on the true first
    round).

    Args:
      records: evaluation records in round order (each with ``"round"`` and ``metric``,
        optionally ``"status"``).
      target: the level to reach.
      metric: the record field to compare.
      higher_is_better: True for accuracies (``>= target``), False for losses and errors
        (``<= target``).

    Examples:
      >>> recs = [{"round": 0, "test_accuracy": 0.1}, {"round": 5, "test_accuracy": 0.6}]
      >>> rounds_to_target(recs, 0.5), rounds_to_target(recs, 0.9)
      (5, None)
    """
    for record in records:
        value = record.get(metric)
        if not _counts(record) or not is_finite_number(value):
            continue
        if (value >= target) if higher_is_better else (value <= target):
            return int(record["round"])
    return None


def _counts(record: Mapping[str, Any]) -> bool:
    """False for a record made after its run diverged (``status`` present, not ``"ok"``)."""
    return record.get("status", "ok") == "ok"


def best_value(
    records: Iterable[Mapping[str, Any]], metric: str = "test_accuracy", higher_is_better=True
) -> float | None:
    """The best finite value of ``metric`` over the records (None if there is none);
    records made after a divergence (``status`` not ``"ok"``) do not count."""
    values = [r[metric] for r in records if _counts(r) and is_finite_number(r.get(metric))]
    if not values:
        return None
    return float(max(values) if higher_is_better else min(values))


def by_series(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Record]]:
    """Groups records by their ``"series"`` field, keeping first-appearance order."""
    out: dict[str, list[Record]] = {}
    for record in records:
        out.setdefault(str(record.get("series", "")), []).append(dict(record))
    return out


def series_summary(
    records: Sequence[Mapping[str, Any]], targets: Sequence[float] = ()
) -> dict[str, Any]:
    """Rounds to each target accuracy, best and final metrics of one series."""
    out: dict[str, Any] = {"num_records": len(records)}
    if not records:
        return out
    out["last_round"] = int(records[-1]["round"])
    if any("test_accuracy" in r for r in records):
        out["rounds_to_target"] = {_target_key(t): rounds_to_target(records, t) for t in targets}
        out["best_test_accuracy"] = best_value(records, "test_accuracy")
    for name in ("test_loss", "train_loss", "error"):
        if any(name in r for r in records):
            out[f"best_{name}"] = best_value(records, name, higher_is_better=False)
    out["final"] = {
        k: v for k, v in records[-1].items() if k not in SETTING_KEYS and is_finite_number(v)
    }
    return out


def _target_key(target: float) -> str:
    return format(float(target), "g")


# ----------------------------------------------------------------------------- selection
class Candidate(NamedTuple):
    """One run offered to the step-size selection (:func:`select`).

    Attributes:
      hparams: the hyper-parameters that define the run's group, without the seed (e.g.
        ``{"client_lr": 0.1, "server_lr": 1.0}``).
      records: its evaluation records in round order.
      diverged: whether the run produced a NaN/Inf (a record with ``status`` other than
        ``"ok"`` marks it diverged too).
      seed: its seed (reported, never compared).
    """

    hparams: Mapping[str, Any]
    records: Sequence[Mapping[str, Any]]
    diverged: bool = False
    seed: Any = None


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = math.fsum(values) / len(values)
    if not math.isfinite(mean):
        return mean, math.nan
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _final(records: Sequence[Mapping[str, Any]], name: str) -> float:
    value = records[-1].get(name) if records else None
    return float(value) if is_finite_number(value) else math.nan


def _loss_name(records: Sequence[Mapping[str, Any]]) -> str:
    return "train_loss" if any("train_loss" in r for r in records) else "test_loss"


def group_runs(
    candidates: Sequence[Candidate],
    target: float | None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> list[dict[str, Any]]:
    """Groups runs that differ only in their seed and measures each group.

    Returns:
      One dict per group, in first-appearance order: ``hparams``, ``seeds``, ``configs``
      (indices into ``candidates``), ``rounds_to_target`` (per seed, None if not
      reached), ``reached`` (seeds that reached), ``rounds_mean`` / ``rounds_std`` (None
      unless every seed reached), ``best_value_mean`` (mean over seeds of the best
      ``metric`` of each run; None if a seed has no finite value), ``final_value_mean`` /
      ``_std`` (the last record's ``metric``), ``final_loss_mean`` (final training loss,
      test loss where there is none; +inf for a diverged or non-finite seed) and
      ``num_diverged``.
    """
    members: dict[tuple, list[int]] = {}
    for j, cand in enumerate(candidates):
        members.setdefault(tuple(cand.hparams.items()), []).append(j)
    groups = []
    for key, idx in members.items():
        runs = [candidates[j] for j in idx]
        diverged = [bool(c.diverged) or not all(_counts(r) for r in c.records) for c in runs]
        if target is None:
            rounds = [None] * len(runs)
        else:
            rounds = [rounds_to_target(c.records, target, metric, higher_is_better) for c in runs]
        reached = [r for r in rounds if r is not None]
        all_reached = target is not None and len(reached) == len(runs)
        bests = [best_value(c.records, metric, higher_is_better) for c in runs]
        losses = [
            math.inf if bad else _final(c.records, _loss_name(c.records))
            for c, bad in zip(runs, diverged, strict=True)
        ]
        losses = [v if math.isfinite(v) else math.inf for v in losses]
        rounds_mean, rounds_std = _mean_std(reached) if all_reached else (None, None)
        final_mean, final_std = _mean_std([_final(c.records, metric) for c in runs])
        groups.append(
            {
                "hparams": dict(key),
                "seeds": [c.seed for c in runs],
                "configs": idx,
                "rounds_to_target": rounds,
                "reached": len(reached),
                "rounds_mean": rounds_mean,
                "rounds_std": rounds_std,
                "best_value_mean": None if None in bests else _mean_std(bests)[0],
                "final_value_mean": final_mean,
                "final_value_std": final_std,
                "final_loss_mean": _mean_std(losses)[0],
                "num_diverged": sum(diverged),
            }
        )
    return groups


def selection_key(group: Mapping[str, Any], higher_is_better: bool = True) -> tuple:
    """The sort key of :func:`select`'s policy for one group of :func:`group_runs`
    (smaller is better)."""
    rounds = group["rounds_mean"]
    best = group["best_value_mean"]
    if best is None:  # no finite value at all: worse than any value
        best_key = math.inf
    else:
        best_key = -best if higher_is_better else best
    client_lr = group["hparams"].get("client_lr")
    return (
        group["num_diverged"] > 0,
        math.inf if rounds is None else rounds,
        best_key,
        group["final_loss_mean"],
        math.inf if client_lr is None else float(client_lr),
    )


def select(
    candidates: Sequence[Candidate],
    target: float | None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The step-size selection policy: the one ``reproduce`` and ``sweep`` both use.

    Candidates are groups of runs that differ only in their seed (:func:`group_runs`).
    The chosen group is the first in this order, each criterion breaking the ties of the
    ones before it:

    1. a group with any diverged seed ranks after every group without one (a step size
       that blew up is unusable, even if it reached the target first);
    2. the fewer mean rounds to ``target`` over its seeds (:func:`rounds_to_target`), a
       group counting as reaching only when ALL its seeds reach (else +inf); with
       ``target=None`` this criterion is skipped;
    3. the better mean over seeds of the best value of ``metric`` over each run (higher,
       or lower with ``higher_is_better=False``; a seed without a finite value is worst);
    4. the lower mean final training loss (test loss where records have no training loss;
       a non-finite final loss counts as +inf);
    5. the smaller ``client_lr`` (then the first group given), so the choice is
       deterministic.

    Args:
      candidates: the runs, e.g. one per (η_l, seed) of a grid.
      target: the level ``metric`` must reach, or None to rank by the best value alone.
      metric: the record field compared with ``target``.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      ``(best group, every group)``, groups as :func:`group_runs` makes them.

    Raises:
      ValueError: there are no candidates.

    Examples:
      >>> runs = [
      ...     Candidate({"client_lr": lr}, [{"round": 5, "test_accuracy": acc}], seed=0)
      ...     for lr, acc in ((0.1, 0.6), (0.3, 0.7), (1.0, 0.4))
      ... ]
      >>> best, groups = select(runs, target=0.5)
      >>> best["hparams"], best["rounds_mean"], len(groups)
      ({'client_lr': 0.3}, 5.0, 3)
    """
    if not candidates:
        raise ValueError("select needs at least one run to choose from.")
    groups = group_runs(candidates, target, metric, higher_is_better)
    best = min(groups, key=lambda g: selection_key(g, higher_is_better))
    return best, groups


def _as_mapping(results: Any) -> Mapping[str, Any]:
    # A single SweepResult (duck-typed: this module sits below scaffold_jax.sweep).
    return {results.algorithm: results} if hasattr(results, "configs") else results


def summarize(
    results: Mapping[str, Any] | Any,
    target: float | None,
    metric: str = "test_accuracy",
    higher_is_better: bool = True,
) -> dict[str, dict[str, Any]]:
    """A sweep's step-size selection: per algorithm, the best hyper-parameters.

    Each config of a :class:`~scaffold_jax.sweep.SweepResult` is one run; configs that
    differ only in their ``seed`` form a group, and :func:`select` (the one policy, see
    there for its tie-break order) picks the best group.

    Args:
      results: ``{algorithm name: SweepResult}`` or one SweepResult.
      target: the target of ``metric`` (e.g. 0.5 for the paper's Table 3), or None.
      metric: the record key compared with the target.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      ``{algorithm: {"best": group, "groups": [group, ...], "target", "metric"}}``, each
      group as :func:`group_runs` makes it (``configs`` indexes the result's configs).
    """
    summary = {}
    for name, result in _as_mapping(results).items():
        diverged = list(getattr(result, "diverged", [False] * len(result.configs)))
        candidates = [
            Candidate(
                {k: v for k, v in config.items() if k != "seed"},
                result.records[j],
                bool(diverged[j]),
                config.get("seed"),
            )
            for j, config in enumerate(result.configs)
        ]
        best, groups = select(candidates, target, metric, higher_is_better)
        summary[name] = {
            "best": best,
            "groups": groups,
            "target": None if target is None else float(target),
            "metric": metric,
        }
    return summary


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


def sweep_rows(result: Any, target: float | None = None) -> list[dict[str, Any]]:
    """One dict per config of a :class:`~scaffold_jax.sweep.SweepResult`: config, status,
    diverged round, final metrics and rounds to each target (``target`` or, by default,
    the result's ``targets``)."""
    targets = result.targets if target is None else (target,)
    out = []
    for j, recs in enumerate(result.records):
        row = {
            "config": result.configs[j],
            "status": recs[-1]["status"],
            "diverged_round": int(result.diverged_round[j]) if result.diverged[j] else None,
        }
        row.update({k: v for k, v in recs[-1].items() if k not in ("config", "status")})
        row["rounds_to_target"] = {t: rounds_to_target(recs, t) for t in targets}
        out.append(row)
    return out


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
            row["rounds_to_target"] = (
                None
                if target is None
                else rounds_to_target(records, target, metric, higher_is_better)
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
            if len(axis) < 2 or value not in (axis[0], axis[-1]):
                continue
            edge = "smallest" if value == axis[0] else "largest"
            out.append({"series": key, "name": name, "value": value, "edge": edge, "grid": axis})
    return out


def format_grid_edge(edge: Mapping[str, Any]) -> str:
    """One line for an entry of :func:`grid_edges`, saying how to extend the grid."""
    values = ", ".join(f"{v:g}" for v in edge["grid"])
    beyond = "below" if edge["edge"] == "smallest" else "above"
    return (
        f"{edge['series']}: the chosen {edge['name']} = {edge['value']:g} is the "
        f"{edge['edge']} value of its grid ({values}); the best value may lie {beyond} it: "
        f"extend the grid {beyond} {edge['value']:g}."
    )


# ----------------------------------------------------------------------------- tables
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
    """

    row: tuple
    column: str
    rounds: int | None = None
    horizon: int = 0
    value: float | None = None
    client_lr: float | None = None


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
            line.append(
                rounds_cell(
                    cell.rounds,
                    None if base is None else base.rounds,
                    cell.horizon,
                    with_speedup=base is not None,
                )
            )
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
            line.append("" if value is None else format(value, fmt))
        body.append(line)
    return markdown_table([*row_header, *columns], body)


# ----------------------------------------------------------------------------- environment
@functools.cache
def git_revision() -> dict[str, Any]:
    """``{"git_commit": <sha>, "git_dirty": <bool>}`` of the checkout the package is
    imported from (dirty: tracked files changed since that commit); both None when it is
    not in one (an installed wheel), or git is missing or fails."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *argv], capture_output=True, text=True, check=True,
            timeout=10,
        ).stdout.strip()  # fmt: skip

    try:
        # The checkout must be the package's own: a wheel installed into a virtualenv
        # that happens to sit inside some other repository is not in a checkout.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return {"git_commit": None, "git_dirty": None}
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit or None, "git_dirty": dirty if commit else None}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The software and hardware a run used: the package's version and git commit (see
    :func:`git_revision`), the versions of python, jax, jaxlib, flax, optax and numpy
    (None for one not installed), and the devices."""
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "scaffold_jax": _version("scaffold-jax"),
        **git_revision(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": _version("flax"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "num_devices": len(devices),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _json_default(value: Any) -> Any:
    """numpy and jax scalars/arrays in configs and records become plain JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write_json(path: Path, obj: Any) -> None:
    # Written to a temporary name and renamed: a crash mid-write never leaves a truncated
    # summary or config behind.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default, allow_nan=True) + "\n")
    os.replace(tmp, path)


def read_records(folder: str | os.PathLike) -> list[Record]:
    """The records of a run folder's ``metrics.jsonl`` (a torn last line is ignored)."""
    path = Path(folder) / METRICS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a process killed mid-write leaves at most one partial, final line
    return out


def read_summary(folder: str | os.PathLike) -> dict[str, Any] | None:
    """A run folder's ``summary.json``, or None if it has none (or it is unreadable)."""
    path = Path(folder) / SUMMARY_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------- plots
# The one plot style. Every plot of the package is a matplotlib ``Figure`` made by
# :func:`new_figure` (object API, Agg canvas, constrained layout: never pyplot and never
# ``matplotlib.use``, so a notebook's or script's backend is left alone) and finished by
# :func:`style_axes` (labels, grid, the legend outside the axes so it never covers a
# curve). matplotlib is the optional "plots" extra: it is imported by these functions only.
PANEL_SIZE = (4.8, 3.4)  # inches per panel, without the legend
LEGEND_WIDTH = 2.4  # inches added on the right for a legend beside a single panel
_LEGEND_ROW = 0.17  # inches per legend entry below a panel
_FONT = 8


def new_figure(
    num_panels: int = 1, *, title: str = "", legend: str = "right", legend_rows: int = 0
):
    """A new Figure in the package's one style, and its axes (one row of panels).

    Args:
      num_panels: panels side by side.
      title: the figure title (``suptitle``).
      legend: where :func:`style_axes` will put each panel's legend: ``"right"`` (beside
        the panel, the room is added to the width), ``"below"`` (under the panel, the room
        is added to the height: for several panels side by side) or ``"none"``.
      legend_rows: the most legend entries of a panel, for ``legend="below"``.

    Returns:
      ``(fig, axes)``: a ``matplotlib.figure.Figure`` with an Agg canvas (so
      ``fig.savefig`` works without pyplot) and a list of ``num_panels`` axes, gridded.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = PANEL_SIZE[0] * num_panels + (LEGEND_WIDTH if legend == "right" else 0.0)
    height = PANEL_SIZE[1] + (0.3 if title else 0.0)
    if legend == "below":
        height += 0.35 + _LEGEND_ROW * legend_rows
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, num_panels, squeeze=False)[0])
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=_FONT)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, axes


def style_axes(
    ax, *, xlabel: str, ylabel: str, title: str = "", legend: str = "right", ncol: int = 1
) -> None:
    """Labels, grid and legend of one panel, in the package's one style.

    The legend (when the panel has labelled artists) sits outside the axes, beside
    (``"right"``) or under (``"below"``) them, so it never covers a curve; constrained
    layout (or the caller's ``tight_layout``) makes room for it and for the labels.
    """
    ax.set_xlabel(xlabel, fontsize=_FONT + 1)
    ax.set_ylabel(ylabel, fontsize=_FONT + 1)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if not handles or legend == "none":
        return
    if legend == "below":
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, frameon=False, ncol=ncol
        )
    else:
        ax.legend(
            loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7,
            frameon=False, ncol=ncol,
        )  # fmt: skip


def _log_axis(ax, values: Sequence[float], axis: str = "x") -> None:
    """A log axis ticked at exactly ``values`` (a step-size grid) with plain labels: no
    minor-tick labels to collide with them, rotated when there are many, and a label left
    out where it would overlap the one before (a grid spanning many decades)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    ticks = sorted({float(v) for v in values if v > 0})
    logs = [math.log10(t) for t in ticks]
    span = (logs[-1] - logs[0]) if ticks else 0.0
    labelled, last = set(), -math.inf
    for tick, at in zip(ticks, logs, strict=True):
        if at - last >= _MIN_LABEL_GAP * span:
            labelled.add(tick)
            last = at
    which.set_major_locator(FixedLocator(ticks))
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v in labelled else ""))
    which.set_minor_locator(NullLocator())
    if axis == "x" and len(ticks) > 5:
        ax.tick_params(axis="x", labelrotation=45)


#: The least distance between two labelled ticks of a log axis, as a fraction of its span.
_MIN_LABEL_GAP = 0.07


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Writes ``fig`` to ``path`` (format from the suffix); returns the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def _figure(ax, **new_figure_args):
    """``(fig, ax)``: the figure of the given axes (a notebook's), else a new one."""
    if ax is not None:
        return ax.figure, ax
    fig, (ax,) = new_figure(**new_figure_args)
    return fig, ax


def _target_lines(ax, targets: float | Sequence[float] | None) -> None:
    """A dashed line at each target level, one legend entry for them all."""
    levels = [] if targets is None else [float(t) for t in np.atleast_1d(targets)]
    for i, level in enumerate(levels):
        name = "target" if len(levels) == 1 else "targets"
        label = f"{name} {', '.join(f'{t:g}' for t in levels)}" if i == 0 else None
        ax.axhline(level, linestyle="--", color="gray", linewidth=1, label=label)


def _integer_axis(ax, axis: str = "x") -> None:
    """Ticks at whole numbers only (rounds): no 0.5-round ticks on a short run."""
    from matplotlib.ticker import MaxNLocator

    locator = MaxNLocator(integer=True, steps=[1, 2, 5, 10])
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(locator)


def _metric_label(metric: str) -> str:
    return metric.replace("_", " ")


class PlotSpec(NamedTuple):
    """A plot to write at the end of a run.

    Attributes:
      filename: e.g. ``"accuracy.png"``.
      metric: the record field on the y axis.
      ylabel: the y-axis label.
      logy: log-scale y axis (errors f(x) − f*).
      panels: panel title -> series in that panel (None: one panel with every series).
      title: the figure title.
      target: a target level of ``metric``, or several, drawn as dashed lines (None: none).
      legend: the legend label of a series name (None: the name itself), e.g. without
        what its panel's title already says.
    """

    filename: str
    metric: str
    ylabel: str
    logy: bool = False
    panels: Mapping[str, Sequence[str]] | None = None
    title: str = ""
    target: float | Sequence[float] | None = None
    legend: Callable[[str], str] | None = None


def plot_curves(
    records: Sequence[Mapping[str, Any]], spec: PlotSpec, path: str | os.PathLike | None = None
):
    """``spec.metric`` against rounds, one line per series (a panel per ``spec.panels``).

    Args:
      records: evaluation records, each with ``"series"`` and ``"round"``.
      spec: what to draw.
      path: where to write the image (None: only return the figure).

    Returns:
      The ``matplotlib.figure.Figure``, or None when there is nothing to draw.
    """
    groups = by_series(records)
    panels = spec.panels or {"": list(groups)}
    panels = {
        title: [s for s in names if any(spec.metric in r for r in groups.get(s, []))]
        for title, names in panels.items()
    }
    panels = {title: names for title, names in panels.items() if names}
    if not panels:
        return None
    where = "right" if len(panels) == 1 else "below"
    rows = max(len(names) for names in panels.values()) + (spec.target is not None)
    fig, axes = new_figure(len(panels), title=spec.title, legend=where, legend_rows=rows)
    for ax, (title, names) in zip(axes, panels.items(), strict=True):
        for name in names:
            points = [
                (r["round"], r[spec.metric])
                for r in groups[name]
                if is_finite_number(r.get(spec.metric)) and (not spec.logy or r[spec.metric] > 0)
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=name if spec.legend is None else spec.legend(name))
        _target_lines(ax, spec.target)
        if spec.logy:
            ax.set_yscale("log")
        _integer_axis(ax)
        style_axes(ax, xlabel="communication rounds", ylabel=spec.ylabel, title=title, legend=where)
    if path is not None:
        save_figure(fig, path, dpi=110)
    return fig


DEFAULT_PLOTS = (
    PlotSpec("accuracy.png", "test_accuracy", "test accuracy"),
    PlotSpec("loss.png", "test_loss", "test loss"),
)


def _varying(groups: Sequence[Mapping[str, Any]]) -> set[str]:
    names = groups[0]["hparams"].keys() if groups else ()
    return {k for k in names if len({g["hparams"][k] for g in groups}) > 1}


def _hparam_name(name: str) -> str:
    return {"client_lr": "η_l", "server_lr": "η_g"}.get(name, name)


def _label(name: str, hparams: Mapping[str, Any], show: Iterable[str]) -> str:
    parts = [f"{_hparam_name(k)} = {v:g}" for k, v in hparams.items() if k in set(show)]
    return f"{name} ({', '.join(parts)})" if parts else name


def _x_axis(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """The hyper-parameter a rounds-to-target plot puts on its x axis: the one with the
    most values over every grid (η_l on a tie, then the first declared)."""
    counts: dict[str, set] = {}
    for entry in summary.values():
        for group in entry["groups"]:
            for k, v in group["hparams"].items():
                counts.setdefault(k, set()).add(v)
    if not counts:
        return "client_lr"
    most = max(len(v) for v in counts.values())
    ties = [k for k, v in counts.items() if len(v) == most]
    return "client_lr" if "client_lr" in ties else ties[0]


def plot_rounds_to_target(
    results: Mapping[str, Any] | Any,
    target: float,
    metric: str = "test_accuracy",
    ax=None,
    higher_is_better: bool = True,
):
    """A sweep's rounds to ``target`` against its swept hyper-parameter (η_l, or the one
    with the most values), per grid, mean ± std over seeds.

    One line per grid (and per value of the other hyper-parameters, when those vary too).
    A value whose seeds do not all reach the target is drawn as an ``x`` at the horizon
    (the last evaluated round), one that diverged on any seed as a ``v`` there, as the
    legend says.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric``.
      metric: the record field compared with the target.
      ax: draw into these axes (e.g. a notebook's) instead of a new figure.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    results = _as_mapping(results)
    summary = summarize(results, target, metric, higher_is_better)
    fig, ax = _figure(ax)
    x_name = _x_axis(summary)
    horizon = max(
        [r["round"] for res in results.values() for recs in res.records for r in recs] or [1]
    )
    xs, shown = [], set()
    for name, entry in summary.items():
        lines: dict[tuple, list[dict]] = {}
        for g in entry["groups"]:
            others = tuple((k, v) for k, v in g["hparams"].items() if k != x_name)
            lines.setdefault(others, []).append(g)
        varying = _varying(entry["groups"]) - {x_name}
        for others, groups in lines.items():
            groups = sorted(groups, key=lambda g: g["hparams"][x_name])
            xs += [g["hparams"][x_name] for g in groups]
            done = [g for g in groups if g["rounds_mean"] is not None and not g["num_diverged"]]
            label = _label(name, dict(others), varying)
            if done:
                line = ax.errorbar(
                    [g["hparams"][x_name] for g in done],
                    [g["rounds_mean"] for g in done],
                    yerr=[g["rounds_std"] for g in done],
                    marker="o",
                    capsize=3,
                    label=label,
                )
                color = line[0].get_color()
            else:
                (line,) = ax.plot([], [], marker="o", label=label)
                color = line.get_color()
            # A value that blew up on some seed is unusable even if it reached the target
            # first (the selection ranks it last): marked at the horizon, not on the line.
            for marker, failed in (
                ("v", [g for g in groups if g["num_diverged"]]),
                ("x", [g for g in groups if g["rounds_mean"] is None and not g["num_diverged"]]),
            ):
                if failed:
                    shown.add(marker)
                    at = [g["hparams"][x_name] for g in failed]
                    ax.scatter(at, [horizon] * len(at), marker=marker, color=color, zorder=3)
    for marker, text in (("x", "not reached"), ("v", "diverged")):
        if marker in shown:
            ax.scatter([], [], marker=marker, color="gray", label=f"{text} (at {horizon} rounds)")
    if all(x > 0 for x in xs):
        _log_axis(ax, xs)
    # From 0 to past the horizon: the "not reached" marks stay in view, and equal rounds
    # (a flat line) still get whole-number ticks.
    ax.set_ylim(0, horizon * 1.08)
    _integer_axis(ax, "y")
    relation = "≥" if higher_is_better else "≤"
    what = f"{_metric_label(metric)} {relation} {target:g}"
    kind = {"client_lr": "client step size ", "server_lr": "server step size "}
    xlabel = kind.get(x_name, "") + _hparam_name(x_name)
    style_axes(
        ax,
        xlabel=xlabel,
        ylabel=f"rounds to {what}",
        title=f"Rounds to {what}\n(mean ± std over seeds)",
    )
    return fig


def plot_best_curves(
    results: Mapping[str, Any] | Any,
    target: float | None,
    metric: str = "test_accuracy",
    ax=None,
    higher_is_better: bool = True,
):
    """``metric`` against rounds for each grid's chosen config (:func:`summarize`): the
    mean over its seeds, a band of ± 1 standard deviation over the seeds, and the target
    as a dashed line.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric`` the choice was made for (None: best value alone).
      metric: the record field drawn.
      ax: draw into these axes instead of a new figure.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    results = _as_mapping(results)
    summary = summarize(results, target, metric, higher_is_better)
    fig, ax = _figure(ax)
    num_seeds = set()
    for name, entry in summary.items():
        best = entry["best"]
        runs = [results[name].records[j] for j in best["configs"]]
        length = min(len(r) for r in runs)
        curves = np.asarray(
            [[float(r.get(metric, np.nan)) for r in recs[:length]] for recs in runs]
        )
        rounds = [r["round"] for r in runs[0][:length]]
        mean, std = curves.mean(axis=0), curves.std(axis=0)
        num_seeds.add(len(runs))
        label = _label(name, best["hparams"], _varying(entry["groups"]) | {"client_lr"})
        (line,) = ax.plot(rounds, mean, label=label)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.25, color=line.get_color())
    _target_lines(ax, target)
    _integer_axis(ax)
    seeds = "/".join(str(n) for n in sorted(num_seeds))
    style_axes(
        ax,
        xlabel="communication rounds",
        ylabel=_metric_label(metric),
        title=f"The chosen config of each grid\nmean over {seeds} seeds, band ± 1 std",
    )
    return fig


def plot_drift(
    histories: Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str = "Client drift",
    ylabel: str = "client drift, mean ‖yᵢ − x‖",
):
    """Per-round drift curves (e.g. FedAvg vs SCAFFOLD), log scale when all positive.

    Args:
      histories: name -> ``[R]`` per-round values (e.g. ``result.round_metrics
        ["client_drift"]``).
      path: where to write the image (the format follows the suffix); None: don't.
      title: figure title.
      ylabel: y-axis label.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    fig, (ax,) = new_figure()
    positive = True
    for name, values in histories.items():
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        positive &= bool(np.all(values > 0))
        ax.plot(np.arange(1, values.size + 1), values, label=str(name))
    if positive:
        ax.set_yscale("log")
    style_axes(ax, xlabel="communication rounds", ylabel=ylabel, title=title)
    _integer_axis(ax)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_G_vs_similarity(
    similarities: Sequence[float],
    G_values: Sequence[float],
    path: str | os.PathLike | None = None,
    *,
    title: str = "Gradient dissimilarity vs data similarity",
):
    """G (e.g. ``DiagnosticsReport.G_at_x``) against the s% similarity of the split.

    Returns:
      The ``matplotlib.figure.Figure`` (also written to ``path`` when given).

    Raises:
      ValueError: the two sequences do not pair up.
    """
    s = np.asarray(similarities, dtype=np.float64).reshape(-1)
    g = np.asarray(G_values, dtype=np.float64).reshape(-1)
    if s.shape != g.shape:
        raise ValueError(f"{s.size} similarities but {g.size} G values; they must pair up.")
    order = np.argsort(s)
    fig, (ax,) = new_figure(legend="none")
    ax.plot(s[order], g[order], marker="o")
    style_axes(ax, xlabel="similarity s (%)", ylabel="G", title=title)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_gradient_fit(
    points: Sequence[tuple[float, float]],
    G: float,
    B: float | None,
    path: str | os.PathLike | None = None,
    *,
    title: str = "Gradient dissimilarity (A1): (1/N) Σ‖∇f_i‖² ≤ G² + B²‖∇f‖²",
):
    """The points ``((1/N) Σ‖∇f_i(x)‖², ‖∇f(x)‖²)`` of ``scaffold-jax diagnose`` (x and
    the points of its gradient-descent path) and the bound fitted to them (B = 1 when
    ``B`` is None, a single point).

    Returns:
      The ``matplotlib.figure.Figure`` (also written to ``path`` when given).
    """
    import numpy as np

    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    slope = 1.0 if B is None else float(B) ** 2
    grid = np.linspace(0.0, max(float(pts[:, 1].max()), 1e-12) * 1.05, 50)
    fig, (ax,) = new_figure()
    ax.plot(pts[:, 1], pts[:, 0], marker="o", linestyle="none", label="measured")
    ax.plot(grid, G**2 + slope * grid, label=f"G = {G:.3g}, B = {1.0 if B is None else B:.3g}")
    style_axes(ax, xlabel="‖∇f(x)‖²", ylabel="(1/N) Σ‖∇f_i(x)‖²", title=title)
    if path is not None:
        save_figure(fig, path)
    return fig


# ----------------------------------------------------------------------------- TensorBoard
TENSORBOARD_DIR = "tensorboard"  # the run folder's event files


class TensorBoardSink:
    """A record sink that writes every numeric field of each record as a TensorBoard
    scalar (tag: the field name, under the record's series when there are several;
    step: the record's ``round``), flushed per record, into ``<folder>/tensorboard``.

    It uses tensorboardX (the optional ``tensorboard`` extra; no TensorFlow needed).
    Pass it as (or call it from) the ``callback=`` of ``Simulation.run`` / ``loop.run``.

    Raises:
      ImportError: tensorboardX is not installed (the message says how to get it).
    """

    def __init__(self, folder: str | os.PathLike, series_prefix: bool = False):
        try:
            from tensorboardX.event_file_writer import EventsWriter
        except ImportError as err:
            raise ImportError(
                "--tensorboard needs tensorboardX: pip install 'scaffold-jax[tensorboard]'"
            ) from err
        self.directory = Path(folder) / TENSORBOARD_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.series_prefix = series_prefix
        # tensorboardX's synchronous events writer: its SummaryWriter queues events for a
        # background thread, whose flush() does not wait for them, so a killed run would
        # lose the last ones.
        # The nanoseconds make the file name unique (tensorboardX names it by the second:
        # a second sink in the same second would overwrite the first) and keep files in
        # the order they were written, which is the order TensorBoard reads them in.
        self._events = EventsWriter(
            str(self.directory / "events"), filename_suffix=f".{time.time_ns()}"
        )

    def __call__(self, record: Mapping[str, Any]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        step = int(record["round"])
        prefix = f"{record['series']}/" if self.series_prefix and "series" in record else ""
        values = [
            summary_pb2.Summary.Value(tag=prefix + name, simple_value=float(value))
            for name, value in record.items()
            if name != "round" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        summary = summary_pb2.Summary(value=values)
        self._events.write_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
        self._events.flush()

    def purge_from(self, step: int) -> None:
        """Tells TensorBoard to drop the events of step >= ``step`` written before this
        call (a ``SessionLog.START`` event, what ``SummaryWriter(purge_step=)`` writes):
        a run resumed from its checkpoint at round R re-runs rounds R+1, ... whose
        records the interrupted process may already have written."""
        from tensorboardX.proto import event_pb2

        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._events.write_event(
            event_pb2.Event(wall_time=time.time(), step=int(step), session_log=start)
        )
        self._events.flush()

    def close(self) -> None:
        self._events.close()


# ----------------------------------------------------------------------------- writer
class RunWriter:
    """Writes one run's folder as the run goes.

    Use it as a context manager: entering creates the folder and writes ``config.json``
    and a ``"running"`` summary; :meth:`record` appends each evaluation to
    ``metrics.jsonl`` and flushes it; :meth:`finish` writes the final summary, the CSV
    and the plots (:meth:`close` ends a run otherwise, e.g. ``"diverged"``). Leaving the
    block with an exception records the status (``"interrupted"`` for Ctrl-C / SIGTERM,
    ``"failed"`` otherwise) and the error in ``summary.json`` before the exception
    propagates.

    Args:
      folder: the output folder (created if missing).
      config: the configuration (any JSON-serialisable dict).
      targets: target accuracies whose rounds-to-target the summary reports.
      overwrite: replace a folder that already holds a run. Without it, a folder with a
        run in it (finished or not) is refused: a finished run's results are precious,
        and an interrupted run's records are evidence.
      plots: the plots :meth:`finish` draws.
      resume: continue the run the folder holds: its records are kept (and cut back by
        :meth:`reset_records` to what the checkpoint holds), its files are not deleted.

    While open, the writer holds the folder's lock (``.lock``: process id, host, start
    time): a second writer, or an ``overwrite``, is refused while this one lives; a lock
    left by a process that died (``kill -9``) is recognised as stale on the same host, the
    summary it left at ``"running"`` is marked ``"interrupted"``, and the folder can be
    resumed or overwritten. A write that fails (a full disk, a read-only folder) raises
    :class:`RunFolderError` naming the file; records already written stay intact.

    Raises:
      FileExistsError: the folder holds a run and ``overwrite`` is False, or it is in use.
      RunFolderError: the folder cannot be written.

    Examples:
      >>> import tempfile
      >>> folder = tempfile.mkdtemp()
      >>> with RunWriter(folder, {"algorithm": "sgd"}, targets=[0.5]) as writer:
      ...     writer.record("sgd", {"round": 0, "test_accuracy": 0.1})
      ...     writer.record("sgd", {"round": 5, "test_accuracy": 0.6})
      ...     summary = writer.finish(plots=())
      >>> summary["status"], summary["runs"]["sgd"]["rounds_to_target"]
      ('finished', {'0.5': 5})
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        config: Mapping[str, Any],
        targets: Sequence[float] = (),
        overwrite: bool = False,
        plots: Sequence[PlotSpec] = DEFAULT_PLOTS,
        resume: bool = False,
    ):
        self.folder = Path(folder)
        self.resume = resume
        self.parts: dict[str, Any] = {}
        self._lock = None
        self.config = dict(config)
        self.targets = [float(t) for t in targets]
        self.overwrite = overwrite
        self.plots = tuple(plots)
        self.records: list[Record] = []
        self.series_info: dict[str, dict[str, Any]] = {}
        self.extra: dict[str, Any] = {}
        self.files: list[str] = []
        self.status = RUNNING
        self._metrics = None
        self._csv = None  # metrics.csv, open for appending, and its columns
        self._csv_columns: list[str] = []
        self._started = None

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> RunWriter:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            if self.status == RUNNING:
                self.finish()
        elif self.status == RUNNING:
            interrupted = issubclass(exc_type, (KeyboardInterrupt, SystemExit))
            try:
                self._close(
                    INTERRUPTED if interrupted else FAILED, error=f"{exc_type.__name__}: {exc}"
                )
            except OSError:  # the disk that failed the run may fail the summary too
                pass
        self._release()
        return False

    def open(self) -> None:
        """Takes the folder's lock, creates the folder (refusing one that holds a run,
        unless resuming or overwriting) and writes the config."""
        if self.resume:
            check_lock(self.folder)
        else:
            check_folder(self.folder, self.overwrite)
        with _writing(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock = _take_lock(self.folder)
        try:
            self._started = datetime.datetime.now(datetime.timezone.utc)
            self._start_clock = time.perf_counter()
            if self.resume:
                self.records = read_records(self.folder)
                self.parts = _read_parts(self.folder)
                previous = read_summary(self.folder) or {}
                self.files = [f for f in previous.get("files", []) if f != CSV_FILE]
            with _writing(self.folder / CONFIG_FILE):
                _write_json(self.folder / CONFIG_FILE, self.config)
            with _writing(self.folder / METRICS_FILE):
                self._metrics = open(self.folder / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
            self.files = list(dict.fromkeys([CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, *self.files]))
            self._rewrite_csv()
            self._write_summary(RUNNING)
        except BaseException:
            self._release()
            raise

    def save_part(self, key: str, payload: Any, entries: Sequence[Mapping[str, Any]]) -> None:
        """Marks a part of the run finished (a cell of a protocol, an algorithm's grid):
        ``payload`` is what the caller needs to skip it on resume, ``entries`` the records
        it wrote. Appended to ``parts.jsonl`` and flushed, after those records."""
        line = json.dumps(
            {"key": key, "payload": payload, "entries": list(entries)}, default=_json_default
        )
        with _writing(self.folder / PARTS_FILE):
            with open(self.folder / PARTS_FILE, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        self.parts[key] = {"payload": payload, "entries": list(entries)}
        if PARTS_FILE not in self.files:
            self.files.append(PARTS_FILE)

    def keep_finished_parts(self) -> dict[str, Any]:
        """On resume of a run made of parts: cuts the records back to those of the
        finished parts (the rest run again) and returns ``{key: payload}``."""
        self.reset_records([e for part in self.parts.values() for e in part["entries"]])
        return {key: part["payload"] for key, part in self.parts.items()}

    def _release(self) -> None:
        if self._lock is not None:
            _release_lock(self._lock)
            self._lock = None

    def reset_records(
        self, records: Sequence[Mapping[str, Any]], series: str | None = None
    ) -> None:
        """Replaces every record on disk by ``records`` (given ``series``, or each with its
        own ``"series"``): on resume, the records the checkpoint (or the finished part of
        a sweep) holds, so each evaluation is in ``metrics.jsonl`` exactly once. Written
        to a temporary file and renamed (atomic)."""
        self.records = [
            dict(r) if series is None else {"series": str(series), **r} for r in records
        ]
        path = self.folder / METRICS_FILE
        if self._metrics is not None:
            self._metrics.close()
        tmp = path.with_name(path.name + ".tmp")
        with _writing(path):
            with open(tmp, "w", encoding="utf-8") as f:
                for entry in self.records:
                    f.write(json.dumps(entry, default=_json_default) + "\n")
            os.replace(tmp, path)
            self._metrics = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._rewrite_csv()

    # -- during the run --------------------------------------------------------------
    def record(self, series: str, record: Mapping[str, Any]) -> Record:
        """Appends one evaluation record of ``series`` and flushes it to disk."""
        if self._metrics is None:
            raise RuntimeError("RunWriter.record called before open() (use `with RunWriter`).")
        entry = {"series": str(series), **record}
        line = json.dumps(entry, default=_json_default) + "\n"
        with _writing(self.folder / METRICS_FILE):
            end = self._metrics.tell()
            try:
                self._metrics.write(line)
                # flush, not fsync: a killed process loses nothing the OS already has, and
                # an fsync per evaluation would dominate short rounds.
                self._metrics.flush()
            except OSError:
                self._cut(end)  # no torn last line: the file ends with a whole record
                raise
        self.records.append(entry)
        if set(entry) <= set(self._csv_columns) and self._csv is not None:
            with _writing(self.folder / CSV_FILE):
                csv.DictWriter(self._csv, fieldnames=self._csv_columns).writerow(entry)
                self._csv.flush()
        else:  # a new column: the header changes, so the table is written again
            self._rewrite_csv()
        return entry

    def _cut(self, size: int) -> None:
        try:
            self._metrics.close()
        except OSError:
            pass  # the buffered bytes that failed are dropped with the file object
        self._metrics = None
        try:
            os.truncate(self.folder / METRICS_FILE, size)
        except OSError:
            pass

    def describe(self, series: str, /, **info: Any) -> None:
        """Attaches facts about a series (algorithm, η_l, compile/run seconds) to the
        summary."""
        self.series_info.setdefault(str(series), {}).update(info)

    def add(self, **extra: Any) -> None:
        """Adds top-level fields to the summary (dataset, chosen step sizes, tables...)."""
        self.extra.update(extra)

    def write_text(self, name: str, text: str) -> Path:
        """Writes an extra file (e.g. a markdown table) into the folder."""
        path = self.folder / name
        path.write_text(text)
        if name not in self.files:
            self.files.append(name)
        return path

    # -- the end ---------------------------------------------------------------------
    def finish(self, plots: Sequence[PlotSpec] | None = None) -> dict[str, Any]:
        """Writes the final summary, the CSV and the plots; returns the summary.

        The run has finished when this is called: a CSV or plot that cannot be written (a
        full disk) is reported on stderr and left out, never turned into a failed run.
        """
        for spec in self.plots if plots is None else plots:
            try:
                if plot_curves(self.records, spec, self.folder / spec.filename) is not None:
                    self.files.append(spec.filename)
            except ImportError:  # matplotlib is an optional extra ("plots")
                print("matplotlib is not installed: no plots written.", file=sys.stderr)
                break
            except OSError as err:
                print(f"could not write {spec.filename}: {err}", file=sys.stderr)
        return self._close(FINISHED)

    def close(self, status: str, error: str | None = None) -> dict[str, Any]:
        """Ends the run with ``status`` (e.g. ``"diverged"``) and an error message, without
        the CSV and plots; returns the summary."""
        return self._close(status, error)

    def _close(self, status: str, error: str | None = None) -> dict[str, Any]:
        self.status = status
        for name in ("_metrics", "_csv"):
            if getattr(self, name) is not None:
                try:
                    getattr(self, name).close()
                except OSError:
                    pass  # a write that failed already said so
                setattr(self, name, None)
        return self._write_summary(status, error)

    def summary(self, status: str | None = None, error: str | None = None) -> dict[str, Any]:
        """The summary dict as it stands (what ``summary.json`` holds)."""
        runs = {}
        for name, recs in by_series(self.records).items():
            runs[name] = {**self.series_info.get(name, {}), **series_summary(recs, self.targets)}
        for name, info in self.series_info.items():
            runs.setdefault(name, dict(info))
        out: dict[str, Any] = {
            "status": status or self.status,
            "started_at": self._started.isoformat(timespec="seconds") if self._started else None,
            "updated_at": _now(),
            "wall_seconds": round(time.perf_counter() - self._start_clock, 3)
            if self._started
            else None,
            "environment": environment(),
            "targets": self.targets,
            **self.extra,
            "runs": runs,
        }
        if len(runs) == 1:
            # A single-series run: the headline numbers at the top level too.
            (only,) = runs.values()
            for key in ("rounds_to_target", "best_test_accuracy", "compile_seconds",
                        "run_seconds", "seconds_per_round"):  # fmt: skip
                if key in only:
                    out[key] = only[key]
        if error is not None:
            out["error"] = error
        out["files"] = list(self.files)
        return out

    def _write_summary(self, status: str, error: str | None = None) -> dict[str, Any]:
        summary = self.summary(status, error)
        with _writing(self.folder / SUMMARY_FILE):
            _write_json(self.folder / SUMMARY_FILE, summary)
        return summary

    def _rewrite_csv(self) -> None:
        """Writes ``metrics.csv`` anew from the records (its columns: every field any
        record has) and keeps it open: :meth:`record` appends each new row and flushes
        it, as ``metrics.jsonl``, so the table is complete whenever the run is killed."""
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        path = self.folder / CSV_FILE
        if not self.records:
            path.unlink(missing_ok=True)  # a resume cut back to nothing
            return
        self._csv_columns = list(dict.fromkeys(k for r in self.records for k in r))
        tmp = path.with_name(path.name + ".tmp")
        with _writing(path):
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                writer = csv.DictWriter(f, fieldnames=self._csv_columns)
                writer.writeheader()
                writer.writerows(self.records)
            os.replace(tmp, path)
            self._csv = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        if CSV_FILE not in self.files:
            self.files.append(CSV_FILE)


def check_folder(folder: str | os.PathLike, overwrite: bool = False, dry_run: bool = False) -> None:
    """Refuses a folder that holds a run unless ``overwrite``; with it, removes the run's
    files (only those a writer makes, never anything else in the folder).

    Args:
      folder: the output folder.
      overwrite: replace a run found there.
      dry_run: only check (an early check before loading data must not delete the old
        run: the new one might still fail to start).

    Raises:
      FileExistsError: naming the folder, the run's status and what to do.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"output folder {folder} exists and is not a folder.")
    check_lock(folder)
    if not any((folder / name).exists() for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)):
        return
    summary = read_summary(folder)
    status = (summary or {}).get("status", "unknown")
    if not overwrite:
        if status == FINISHED:
            what = "a finished run"
        else:
            num = len(read_records(folder))
            what = f"an unfinished run (status {status!r}, {num} records kept)"
        resume = "" if status == FINISHED else " --resume to continue it,"
        raise FileExistsError(
            f"output folder {folder} already holds {what}; pass{resume} --overwrite "
            "(overwrite=True) to replace it, or choose another output folder."
        )
    if dry_run:
        return
    names = set(_OWN_FILES) | set((summary or {}).get("files", []))
    for name in names:
        path = folder / name
        # Only plain files directly inside the folder: a crafted summary cannot make us
        # delete anything elsewhere.
        if path.parent == folder and path.is_file():
            path.unlink()
    checkpoints = folder / "checkpoints"  # scaffold_jax.experiments.CHECKPOINTS
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        shutil.rmtree(checkpoints)


# ----------------------------------------------------------------------------- the lock
LOCK_FILE = ".lock"


class RunFolderError(OSError):
    """A run folder could not be written (a full disk, a read-only folder, ...)."""


class _writing:
    """Turns an OSError while writing ``path`` into a one-line :class:`RunFolderError`."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if (
            exc_type is not None
            and issubclass(exc_type, OSError)
            and exc_type is not RunFolderError
        ):
            reason = exc.strerror or str(exc)
            raise RunFolderError(
                exc.errno,
                f"cannot write {self.path}: {reason}. Every record finished before is in "
                f"{METRICS_FILE}; free space or choose a writable --out, then --resume.",
            ) from exc
        return False


def _read_parts(folder: Path) -> dict[str, Any]:
    parts = {}
    try:
        lines = (folder / PARTS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return parts
    for line in lines:
        try:
            part = json.loads(line)
        except ValueError:
            break  # a line cut short by a kill: that part runs again
        parts[part["key"]] = {"payload": part["payload"], "entries": part["entries"]}
    return parts


def _lock_info(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # half-written or unreadable: treat as another live holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def check_lock(folder: str | os.PathLike) -> None:
    """Refuses a folder held by a live run; clears a stale lock (its process is gone),
    marking the summary it left at ``"running"`` as ``"interrupted"``.

    Raises:
      FileExistsError: another live process (or one on another host, which cannot be
        checked) holds the folder.
    """
    folder = Path(folder)
    info = _lock_info(folder)
    if info is None:
        return
    pid, host = info.get("pid"), info.get("host")
    here = host == platform.node()
    if here and isinstance(pid, int) and pid == os.getpid():
        return  # our own (an earlier writer of this process that did not close)
    if here and isinstance(pid, int) and not _alive(pid):
        summary = read_summary(folder)
        if summary is not None and summary.get("status") == RUNNING:
            summary["status"] = INTERRUPTED
            summary["error"] = (
                f"the process (pid {pid} on {host}) stopped without closing the run, e.g. "
                "killed with SIGKILL; resume it with --resume"
            )
            _write_json(folder / SUMMARY_FILE, summary)
        (folder / LOCK_FILE).unlink(missing_ok=True)
        return
    where = f"pid {pid} on host {host}, since {info.get('started')}" if info else "unknown"
    raise FileExistsError(
        f"output folder {folder} is in use by a running scaffold-jax ({where}); wait for it "
        f"to finish or stop it (kill -INT {pid}), or choose another output folder. If that "
        f"process is gone (another host), delete {folder / LOCK_FILE}."
    )


def _take_lock(folder: Path) -> Path:
    path = folder / LOCK_FILE
    info = {"pid": os.getpid(), "host": platform.node(), "started": _now()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        check_lock(folder)  # stale: cleared; live: raises
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info))
    return path


def _release_lock(path: Path) -> None:
    info = _lock_info(path.parent)
    if info and info.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
