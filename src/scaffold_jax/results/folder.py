"""The run folder: :class:`RunWriter` writes it as the run goes (its files are listed in
:mod:`scaffold_jax.results`), holding the folder's lock (:mod:`scaffold_jax.results.lock`)
and recording the software and hardware of the run in the summary
(:mod:`scaffold_jax.results.provenance`)."""

from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scaffold_jax.results.files import (
    CONFIG_FILE,
    CSV_FILE,
    FAILED,
    FINISHED,
    INTERRUPTED,
    PARTS_FILE,
    PERSONAL_FILE,
    RUNNING,
    RunFolderError,
    _json_default,
    _now,
    _replacing,
    _write_json,
    _writing,
    read_parts,
)
from scaffold_jax.results.lock import (
    _DIR_FLAGS,
    _OPEN_WRITERS,
    LOCK_FILE,
    _identity,
    _release_lock,
    _remove_temporaries,
    _take_lock,
    check_folder,
    check_lock,
)
from scaffold_jax.results.plots import DEFAULT_PLOTS, PlotSpec, plot_curves
from scaffold_jax.results.provenance import environment
from scaffold_jax.results.records import (
    METRICS_FILE,
    SUMMARY_FILE,
    Record,
    by_series,
    read_records,
    read_summary,
    series_summary,
)


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

    The writer holds the folder it opened (its device and inode, and an open descriptor):
    before every write it checks (:meth:`check_place`) that the path still leads to that
    folder and that the folder still holds this writer's lock. A folder deleted or moved
    under the run stops it with one :class:`RunFolderError`; nothing is ever written at
    the old path again (a checkpointer checks its own folders likewise), and a moved
    folder gets its ``"failed"`` summary where it is now, ready for ``--resume``.

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
        self._clients: dict[str, list[dict]] = {}  # personal.csv's rows, by series
        self._csv_columns: set[str] = set()
        self._csv_writer: csv.DictWriter | None = None
        self._started = None
        self._abs = Path(os.path.abspath(self.folder))
        self._dir_fd: int | None = None  # the folder, open: found again wherever it moves
        self._place: tuple[int, int] | None = None  # its (device, inode) when opened
        self._lock_id: tuple[int, int] | None = None  # the lock file's

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
                self.close(
                    INTERRUPTED if interrupted else FAILED,
                    # RunTerminated's str() is its exit code; its message says where it stopped.
                    error=f"{exc_type.__name__}: {getattr(exc, 'message', None) or exc}",
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
        self._lock_id = _take_lock(self.folder)
        self._lock = self._lock_path = self.folder / LOCK_FILE
        try:
            self._hold_folder()
            _remove_temporaries(self.folder)
            self._started = datetime.datetime.now(datetime.timezone.utc)
            self._start_clock = time.perf_counter()
            if self.resume:
                self.records = read_records(self.folder)
                self.parts = read_parts(self.folder)
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
        self.check_place()
        with _writing(self.folder / PARTS_FILE):
            with open(self.folder / PARTS_FILE, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        self.parts[key] = {"payload": payload, "entries": list(entries)}
        if PARTS_FILE not in self.files:
            self.files.append(PARTS_FILE)

    def keep_finished_parts(self, keys: Iterable[str] | None = None) -> dict[str, Any]:
        """On resume of a run made of parts: cuts the records back to those of the
        finished parts (``keys``: only these; the rest run again) and returns
        ``{key: payload}`` of the parts kept."""
        keys = list(self.parts) if keys is None else [k for k in keys if k in self.parts]
        self.parts = {key: self.parts[key] for key in keys}
        self.reset_records([e for key in keys for e in self.parts[key]["entries"]])
        return {key: self.parts[key]["payload"] for key in keys}

    def _hold_folder(self) -> None:
        """Remembers the folder just locked (see :meth:`check_place`)."""
        try:
            self._dir_fd = os.open(self.folder, _DIR_FLAGS)
            self._place = _identity(os.fstat(self._dir_fd))
        except OSError:  # a system that cannot open a folder (Windows): by its path only
            self._place = _identity(os.stat(self.folder))
        _OPEN_WRITERS.add(self)
        self.check_place()  # deleted or moved since the lock was taken

    def check_place(self) -> None:
        """Raises :class:`RunFolderError` when the folder is no longer the one this writer
        opened (deleted, moved, or replaced by another at its path) or no longer holds
        this writer's lock: the run must stop, and write nothing at that path again (a
        folder there now is not this run's). Called before every write."""
        if self._place is None:
            return
        try:
            place = _identity(os.stat(self.folder))
        except OSError:
            place = None
        if place != self._place:
            raise RunFolderError(
                errno.ENOENT,
                f"the output folder {self.folder} was deleted or moved while the run was "
                "writing it; the run stopped and writes nothing more there. If it was moved, "
                "resume it where it is now: --resume --out <its new place>.",
            )
        try:
            lock = _identity(os.stat(self._lock_path))
        except OSError:
            lock = None
        if lock != self._lock_id:
            raise RunFolderError(
                errno.ENOENT,
                f"the lock file {self.folder / LOCK_FILE} of this run was deleted or replaced "
                f"while the run was writing {self.folder} (the folder being deleted, or "
                "another process taking it); the run stopped and writes nothing more there.",
            )

    def _moved_but_ours(self) -> bool:
        """Whether the folder held open is away from its path but still holds this
        writer's lock (moved, not deleted, and not taken by another process)."""
        if self._dir_fd is None:
            return False
        try:
            return _identity(os.stat(LOCK_FILE, dir_fd=self._dir_fd)) == self._lock_id
        except OSError:
            return False

    def _release(self) -> None:
        _OPEN_WRITERS.discard(self)
        if self._lock is not None:
            # Through the folder held open when there is one: a moved folder's lock goes,
            # and whatever is at the old path now is never touched.
            _release_lock(self._lock, self._lock_id, self._dir_fd)
            self._lock = None
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None

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
        self.check_place()
        if self._metrics is not None:
            self._metrics.close()
        with _writing(path):
            with _replacing(path) as f:
                for entry in self.records:
                    f.write(json.dumps(entry, default=_json_default) + "\n")
            self._metrics = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._rewrite_csv()

    # -- during the run --------------------------------------------------------------
    def record(
        self,
        series: str,
        record: Mapping[str, Any],
        settings: Mapping[str, Any] | None = None,
    ) -> Record:
        """Appends one evaluation record of ``series`` and flushes it to disk.

        ``settings``: what places the series (its algorithm, η_l, a data setting), written
        in the record before its measurements and kept apart from them in the summary
        (``runs[series]["settings"]``; not among its final metrics)."""
        if self._metrics is None:
            raise RuntimeError("RunWriter.record called before open() (use `with RunWriter`).")
        self.check_place()  # a deleted folder's open files would take records silently
        if settings:
            self.describe(series, settings=dict(settings))
        entry = {"series": str(series), **(settings or {}), **record}
        line = json.dumps(entry, default=_json_default) + "\n"
        with _writing(self._metrics.name):
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
        if self._csv is not None and self._csv_columns.issuperset(entry):
            with _writing(self._csv.name):
                self._csv_writer.writerow(entry)
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

    def write_text(self, name: str, text: str, required: bool = False) -> Path | None:
        """Writes an extra file (a table, a sweep's CSV) into the folder, atomically.

        The records are the run; a file made from them is not. One that cannot be written
        (a full disk) is reported on stderr and left out of the summary's ``files``, never
        turned into a failed run: :meth:`finish`'s policy for the plots. ``required``:
        raise :class:`RunFolderError` instead. A folder deleted or moved under the run
        always raises (see :meth:`check_place`).

        Returns:
          The file's path, or None when it could not be written.
        """
        self.check_place()
        path = self.folder / name
        try:
            with _writing(path), _replacing(path) as f:
                f.write(text)
        except RunFolderError as err:
            if required:
                raise
            self._left_out(name, err.__cause__ or err)
            return None
        if name not in self.files:
            self.files.append(name)
        return path

    def write_figure(self, name: str, fig: Any, dpi: int = 120) -> Path | None:
        """Saves a matplotlib figure into the folder (format from the suffix), with
        :meth:`write_text`'s policy: one that cannot be written is reported on stderr and
        left out (a partial file removed), never failing the run.

        Returns:
          The file's path, or None when it could not be written.
        """
        self.check_place()
        path = self.folder / name
        try:
            fig.savefig(path, dpi=dpi)
        except OSError as err:
            self._left_out(name, err)
            return None
        if name not in self.files:
            self.files.append(name)
        return path

    def _left_out(self, name: str, err: BaseException) -> None:
        """Reports a file of a finished run that could not be written and leaves it out:
        no partial file stays, and the summary does not list it."""
        reason = getattr(err, "strerror", None) or err
        print(f"could not write {name}: {reason}; left out of {self.folder}.", file=sys.stderr)
        path = self.folder / name
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.unlink()
        if name in self.files:
            self.files.remove(name)

    # -- the end ---------------------------------------------------------------------
    def finish(self, plots: Sequence[PlotSpec] | None = None) -> dict[str, Any]:
        """Writes the final summary, the CSV and the plots; returns the summary.

        The run has finished when this is called: a CSV or plot that cannot be written (a
        full disk) is reported on stderr and left out, never turned into a failed run.
        A folder deleted or moved under the run has not finished: that raises
        :class:`RunFolderError` (see :meth:`check_place`).
        """
        self.check_place()
        for spec in self.plots if plots is None else plots:
            try:
                drawn = plot_curves(self.records, spec, self.folder / spec.filename)
                if drawn is not None and spec.filename not in self.files:  # a resume has it
                    self.files.append(spec.filename)
            except ImportError:  # matplotlib is an optional extra ("plots")
                print("matplotlib is not installed: no plots written.", file=sys.stderr)
                break
            except OSError as err:
                self._left_out(spec.filename, err)
        return self.close(FINISHED)

    def close(self, status: str, error: str | None = None) -> dict[str, Any]:
        """Ends the run with ``status`` (e.g. ``"diverged"``) and an error message, without
        the CSV and plots; returns the summary."""
        for name in ("_metrics", "_csv"):
            if getattr(self, name) is not None:
                try:
                    getattr(self, name).close()
                except OSError:
                    pass  # a write that failed already said so
                setattr(self, name, None)
        summary = self._write_summary(status, error)
        # Only once the summary says so: a summary that could not be written leaves the
        # run open, and leaving the `with` block then records why it failed.
        self.status = status
        return summary

    def summary(self, status: str | None = None, error: str | None = None) -> dict[str, Any]:
        """The summary dict as it stands (what ``summary.json`` holds)."""
        runs = {}
        for name, recs in by_series(self.records).items():
            info = self.series_info.get(name, {})
            measured = series_summary(recs, self.targets, info.get("settings", {}))
            runs[name] = {**info, **measured}
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
        try:
            self.check_place()
        except RunFolderError:
            # Nothing at the old path; a folder moved away, still holding this run's lock,
            # gets the summary that says why the run stopped (through the folder held
            # open), so that it can be resumed where it is now.
            if status not in (RUNNING, FINISHED) and self._moved_but_ours():
                with contextlib.suppress(OSError):
                    _write_json(self.folder / SUMMARY_FILE, summary, dir_fd=self._dir_fd)
            raise
        with _writing(self.folder / SUMMARY_FILE):
            _write_json(self.folder / SUMMARY_FILE, summary)
        return summary

    def write_clients(self, series: str, clients: Mapping[str, Any]) -> None:
        """Writes ``personal.csv`` anew with run ``series``'s per-client evaluation
        (``client, n_train, n_test, global, personal``: accuracies on each client's own
        test data, empty where it has none; ``global`` empty where the server keeps no
        whole model) beside the other runs' of the folder."""
        columns = ("client", "n_train", "n_test", "global", "personal")
        values = [np.asarray(clients[name]).tolist() for name in columns]
        self._clients[series] = [
            {"series": series, **{name: _cell(v) for name, v in zip(columns, row, strict=True)}}
            for row in zip(*values, strict=True)
        ]
        path = self.folder / PERSONAL_FILE
        with _writing(path), _replacing(path, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=("series", *columns))
            writer.writeheader()
            for rows in self._clients.values():
                writer.writerows(rows)
        if PERSONAL_FILE not in self.files:
            self.files.append(PERSONAL_FILE)

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
        columns = list(dict.fromkeys(k for r in self.records for k in r))
        self._csv_columns = set(columns)
        with _writing(path):
            with _replacing(path, newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(self.records)
            self._csv = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
            # One writer for the appended rows (a sweep appends ~165k in Figure 3).
            self._csv_writer = csv.DictWriter(self._csv, fieldnames=columns)
        if CSV_FILE not in self.files:
            self.files.append(CSV_FILE)


def _cell(value: Any) -> Any:
    """A CSV cell: NaN (no test example, no global model) as an empty cell."""
    if isinstance(value, float):  # a float32 accuracy as float32 prints it (0.95)
        return "" if math.isnan(value) else float(f"{value:.7g}")
    return value
