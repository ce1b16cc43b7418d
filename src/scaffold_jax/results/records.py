"""Reading and summarising run records: rounds to a target, best values, the step-size
selection, a sweep's rows, and the records and summary of a run folder.

:func:`rounds_to_target` is the package's only rounds-to-target and :func:`select` its only
step-size selection policy (``reproduce`` reaches it through
:meth:`scaffold_jax.experiments.CellResult.choose`, ``sweep`` through :func:`summarize`).

A record is a flat dict with at least ``"series"`` (which curve it belongs to) and
``"round"``, plus whatever the evaluation measured (``test_accuracy``, ``test_loss``,
``train_loss``, ``error``...).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

Record = dict[str, Any]

# The run folder's files read here (scaffold_jax.results.folder writes them).
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

# Record fields that place a record rather than measure: left out of a series' "final"
# metrics, as are the settings its writer was given (RunWriter.record(settings=)).
PLACE_KEYS = frozenset({"series", "round", "config_index"})


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
    records: Sequence[Mapping[str, Any]],
    targets: Sequence[float] = (),
    settings: Iterable[str] = (),
) -> dict[str, Any]:
    """Rounds to each target accuracy, best and final metrics of one series (``settings``:
    the record fields that hold its settings, not measurements)."""
    skip = PLACE_KEYS | set(settings)
    out: dict[str, Any] = {"num_records": len(records)}
    if not records:
        return out
    out["last_round"] = int(records[-1]["round"])
    if any("test_accuracy" in r for r in records):
        reached = {_target_key(t): rounds_to_target(records, t) for t in targets}
        out["rounds_to_target"] = reached
        # The cumulative bytes (scaffold_jax.engine.communication) at the round each target
        # was first reached: what "rounds to target" costs on the network.
        # Likewise the virtual clock's seconds (scaffold_jax.participation.clock).
        at = {int(r["round"]): r for r in records}
        totals = {"bytes_up_to_target": "bytes_up_total"}
        totals.update(bytes_down_to_target="bytes_down_total", time_to_target="virtual_time")
        for name, total in totals.items():
            if any(total in r for r in records):
                out[name] = {
                    k: None if n is None else at[n].get(total, 0 if n == 0 else None)
                    for k, n in reached.items()
                }
        out["best_test_accuracy"] = best_value(records, "test_accuracy")
    for name in ("test_loss", "train_loss", "error"):
        if any(name in r for r in records):
            out[f"best_{name}"] = best_value(records, name, higher_is_better=False)
    out["final"] = {k: v for k, v in records[-1].items() if k not in skip and is_finite_number(v)}
    drift = mean_over_rounds(records, "client_drift")
    if drift is not None:
        out["mean_client_drift"] = drift
    return out


def mean_over_rounds(records: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """The mean over every round of a metric each record reports as its mean over the
    rounds since the previous record (``client_drift``): the records' values weighted by
    the rounds each covers. From the records alone, so a resumed run's summary is the
    uninterrupted one's. None: no record has a finite value of it."""
    total = rounds = 0.0
    previous = None
    for record in records:
        value, now = record.get(name), record.get("round")
        if previous is not None and is_finite_number(value) and now > previous:
            total += (now - previous) * float(value)
            rounds += now - previous
        previous = now
    return total / rounds if rounds else None


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


# ----------------------------------------------------------------------------- run folder
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
