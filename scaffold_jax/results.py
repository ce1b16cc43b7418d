"""Run records on disk: the per-run folder, rounds-to-target, paper-style tables, plots.

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
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

Record = dict[str, Any]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CSV_FILE = "metrics.csv"

RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"
DIVERGED = "diverged"

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

    A non-finite value (a diverged run) never counts as reaching the target: ``-inf`` is
    below every error target, and a NaN compares False either way, so both are excluded
    explicitly. The resolution is the evaluation cadence: with ``eval_every = 5`` the
    answer is a multiple of 5 (an upper bound on the true first round).

    Args:
      records: evaluation records in round order (each with ``"round"`` and ``metric``).
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
        if not is_finite_number(value):
            continue
        if (value >= target) if higher_is_better else (value <= target):
            return int(record["round"])
    return None


def best_value(
    records: Iterable[Mapping[str, Any]], metric: str = "test_accuracy", higher_is_better=True
) -> float | None:
    """The best finite value of ``metric`` over the records (None if there is none)."""
    values = [r[metric] for r in records if is_finite_number(r.get(metric))]
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
def environment() -> dict[str, Any]:
    """The software and hardware a run used: versions and devices."""
    import jax
    import jaxlib

    from scaffold_jax import __version__

    devices = jax.devices()
    return {
        "scaffold_jax": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
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
class PlotSpec(NamedTuple):
    """A plot to write at the end of a run.

    Attributes:
      filename: e.g. ``"accuracy.png"``.
      metric: the record field on the y axis.
      ylabel: the y-axis label.
      logy: log-scale y axis (errors f(x) − f*).
      panels: panel title -> series in that panel (None: one panel with every series).
      title: the figure title.
    """

    filename: str
    metric: str
    ylabel: str
    logy: bool = False
    panels: Mapping[str, Sequence[str]] | None = None
    title: str = ""


def plot_curves(records: Sequence[Mapping[str, Any]], spec: PlotSpec, path: Path) -> bool:
    """Draws ``spec.metric`` against rounds, one line per series; False if nothing to draw.

    Uses matplotlib's object API with the Agg canvas, so it never changes the global
    backend of a notebook or script that imports this module.
    """
    groups = by_series(records)
    panels = spec.panels or {"": list(groups)}
    panels = {
        title: [s for s in names if any(spec.metric in r for r in groups.get(s, []))]
        for title, names in panels.items()
    }
    panels = {title: names for title, names in panels.items() if names}
    if not panels:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 4.2 * len(panels)), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, names) in zip(axes, panels.items(), strict=True):
        for name in names:
            points = [
                (r["round"], r[spec.metric])
                for r in groups[name]
                if is_finite_number(r.get(spec.metric)) and (not spec.logy or r[spec.metric] > 0)
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=name)
        if spec.logy:
            ax.set_yscale("log")
        ax.set_xlabel("communication rounds")
        ax.set_ylabel(spec.ylabel)
        if title:
            ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if spec.title:
        fig.suptitle(spec.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


DEFAULT_PLOTS = (
    PlotSpec("accuracy.png", "test_accuracy", "test accuracy"),
    PlotSpec("loss.png", "test_loss", "test loss"),
)


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

    Raises:
      FileExistsError: the folder holds a run and ``overwrite`` is False.

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
    ):
        self.folder = Path(folder)
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
            self._close(INTERRUPTED if interrupted else FAILED, error=f"{exc_type.__name__}: {exc}")
        return False

    def open(self) -> None:
        """Creates the folder (refusing one that holds a run) and writes the config."""
        check_folder(self.folder, self.overwrite)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._started = datetime.datetime.now(datetime.timezone.utc)
        self._start_clock = time.perf_counter()
        _write_json(self.folder / CONFIG_FILE, self.config)
        self._metrics = open(self.folder / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self.files = [CONFIG_FILE, METRICS_FILE, SUMMARY_FILE]
        self._write_summary(RUNNING)

    # -- during the run --------------------------------------------------------------
    def record(self, series: str, record: Mapping[str, Any]) -> Record:
        """Appends one evaluation record of ``series`` and flushes it to disk."""
        if self._metrics is None:
            raise RuntimeError("RunWriter.record called before open() (use `with RunWriter`).")
        entry = {"series": str(series), **record}
        self.records.append(entry)
        self._metrics.write(json.dumps(entry, default=_json_default) + "\n")
        # flush, not fsync: a killed process loses nothing the OS already has, and an
        # fsync per evaluation would dominate short rounds.
        self._metrics.flush()
        return entry

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
        """Writes the final summary, the CSV and the plots; returns the summary."""
        self._write_csv()
        for spec in self.plots if plots is None else plots:
            try:
                if plot_curves(self.records, spec, self.folder / spec.filename):
                    self.files.append(spec.filename)
            except ImportError:  # matplotlib is an optional extra ("plots")
                print("matplotlib is not installed: no plots written.", file=sys.stderr)
                break
        return self._close(FINISHED)

    def close(self, status: str, error: str | None = None) -> dict[str, Any]:
        """Ends the run with ``status`` (e.g. ``"diverged"``) and an error message, without
        the CSV and plots; returns the summary."""
        return self._close(status, error)

    def _close(self, status: str, error: str | None = None) -> dict[str, Any]:
        self.status = status
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
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
        _write_json(self.folder / SUMMARY_FILE, summary)
        return summary

    def _write_csv(self) -> None:
        if not self.records:
            return
        columns = list(dict.fromkeys(k for r in self.records for k in r))
        with open(self.folder / CSV_FILE, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.records)
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
        raise FileExistsError(
            f"output folder {folder} already holds {what}; pass --overwrite "
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
