"""The run folder: :class:`RunWriter` writes it as the run goes, :func:`check_folder`
refuses (or clears, with ``overwrite``) one that holds a run, and a lock file keeps two
processes out of one folder (:func:`check_lock`). The summary records the software and
hardware of the run (:func:`environment`).

Every run (``scaffold-jax run`` or one ``scaffold-jax reproduce`` protocol) owns one output
folder:

* ``config.json``: the full configuration, as given and resolved;
* ``metrics.jsonl``: one JSON object per evaluation, appended and flushed as it is made,
  so a run killed at any point keeps every record it finished;
* ``summary.json``: written at the start (``"status": "running"``) and rewritten at the
  end: status (``finished``, ``failed`` or ``interrupted``), rounds to each target, best
  accuracy, compile and steady-state time, the jax version and devices;
* ``metrics.csv``: the same records as a table;
* ``accuracy.png`` / ``loss.png`` (or the plots an experiment asks for): one line per
  series (algorithm, or algorithm and setting).
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import functools
import importlib.metadata
import json
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from scaffold_jax.results.plots import DEFAULT_PLOTS, PlotSpec, plot_curves
from scaffold_jax.results.records import (
    METRICS_FILE,
    SUMMARY_FILE,
    Record,
    by_series,
    read_records,
    read_summary,
    series_summary,
)

try:  # POSIX: the lock is checked and taken under an flock of the folder (see _guard)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

CONFIG_FILE = "config.json"
CSV_FILE = "metrics.csv"
PARTS_FILE = "parts.jsonl"

RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"

# Files a writer may have made; --overwrite removes only these (and those a previous
# summary lists), never the whole folder: `--out .` must not wipe a working directory.
_OWN_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CSV_FILE, "accuracy.png", "loss.png")


# ----------------------------------------------------------------------------- environment
@functools.cache
def git_revision() -> dict[str, Any]:
    """``{"git_commit": <sha>, "git_dirty": <bool>}`` of the checkout the package is
    imported from (dirty: tracked files changed since that commit); both None when it is
    not in one (an installed wheel), or git is missing or fails."""
    root = Path(__file__).resolve().parents[3]  # src/scaffold_jax/results/folder.py

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


def _temporary_name(path: Path) -> Path:
    """A name next to ``path`` that no other process picks: two processes rewriting the
    same file (two resumes started together) never share a temporary file."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def _replacing(path: Path, newline: str | None = None, dir_fd: int | None = None):
    """A new text file that replaces ``path`` when the block ends (written under a
    temporary name, then renamed: atomic); removed if the block raises. With ``dir_fd``:
    ``path.name`` in that open folder, wherever it is now."""
    tmp = _temporary_name(path)
    src, dst = (tmp.name, path.name) if dir_fd is not None else (tmp, path)
    fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    try:
        with open(fd, "w", encoding="utf-8", newline=newline) as f:
            yield f
        os.replace(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(src, dir_fd=dir_fd)
        raise


_TEMPORARY = re.compile(r"^(?P<name>.+?)\.(?:(?P<pid>\d+)-[0-9a-f]{8}\.)?tmp$")


def _remove_temporaries(folder: Path) -> None:
    """Removes the temporary files of the run's own files that a process killed while
    rewriting one left behind (its pid gone; named ``<file>.tmp`` by older versions)."""
    for path in _entries(folder):
        found = _TEMPORARY.match(path.name)
        if not found or found["name"] not in (*_OWN_FILES, PARTS_FILE, LOCK_FILE):
            continue
        pid = found["pid"]
        if pid is not None and (int(pid) == os.getpid() or _alive(int(pid))):
            continue  # being written (a stale lock's summary, by another process)
        if path.is_file() and not path.is_symlink():
            with contextlib.suppress(OSError):
                path.unlink()


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _write_json(path: Path, obj: Any, dir_fd: int | None = None) -> None:
    # Written to a temporary name and renamed: a crash mid-write never leaves a truncated
    # summary or config behind.
    text = json.dumps(obj, indent=1, default=_json_default, allow_nan=True) + "\n"
    with _replacing(path, dir_fd=dir_fd) as f:
        f.write(text)


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
                self._close(
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
        return self._close(FINISHED)

    def close(self, status: str, error: str | None = None) -> dict[str, Any]:
        """Ends the run with ``status`` (e.g. ``"diverged"``) and an error message, without
        the CSV and plots; returns the summary."""
        return self._close(status, error)

    def _close(self, status: str, error: str | None = None) -> dict[str, Any]:
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
    # A folder that cannot be cleared (read-only, not ours) says so in one line.
    with _writing(folder):
        for name in names:
            path = folder / name
            # Only plain files directly inside the folder: a crafted summary cannot make
            # us delete anything elsewhere.
            if path.parent == folder and path.is_file():
                path.unlink()
        _remove_temporaries(folder)
        checkpoints = folder / "checkpoints"  # scaffold_jax.experiments.CHECKPOINTS
        if checkpoints.is_dir() and not checkpoints.is_symlink():
            shutil.rmtree(checkpoints)


# ----------------------------------------------------------------------------- the lock
LOCK_FILE = ".lock"


class RunFolderError(OSError):
    """A run folder could not be written (a full disk, a read-only folder, ...)."""

    def __str__(self) -> str:  # the message alone: it names the file and the fix
        return self.strerror or super().__str__()


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
            and not issubclass(exc_type, RunFolderError)
        ):
            raise RunFolderError(exc.errno, _cannot_write(self.path, exc)) from exc
        return False


#: The errors of a folder that may not be written (a read-only file system, permissions).
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
#: The errors of a disk without room (no space, a quota, a file size limit).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _cannot_write(path: Path, exc: OSError) -> str:
    """One line: what could not be written, the actual problem and its fix (a folder that
    may not be written is another --out; a full disk is space freed, then --resume)."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EROFS:
        return f"cannot write {path}: it is on a read-only file system. Choose a writable --out."
    if exc.errno in _NOT_WRITABLE:
        return (
            f"cannot write {path}: permission denied. Choose a writable --out, or make this "
            "folder writable."
        )
    if exc.errno in _NO_ROOM:
        return (
            f"cannot write {path}: {reason}. Every record finished before is in "
            f"{METRICS_FILE}; free space, then --resume."
        )
    return (
        f"cannot write {path}: {reason}. Every record finished before is in {METRICS_FILE}; "
        "fix that, or choose another --out, then --resume."
    )


def read_parts(folder: str | os.PathLike) -> dict[str, Any]:
    """The finished parts a folder holds: ``{key: {"payload", "entries"}}`` (a line cut
    short by a kill, and what follows it, is left out: that part runs again)."""
    folder = Path(folder)
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


# How long a lock file that is empty or cut short may be "being written": a process
# killed between creating and writing it (by a version that did not write it whole) left
# it so; younger, it may be a live process taking the folder, older it is stale.
_LOCK_GRACE = 5.0
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
_TAKING, _OWN = "taking", "own"
# The writers open in this process: a second one on the same folder is refused.
_OPEN_WRITERS: weakref.WeakSet[RunWriter] = weakref.WeakSet()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


@contextlib.contextmanager
def _guard(folder: Path):
    """Serialises checking, clearing and taking the lock among processes: an exclusive
    ``flock`` on the folder itself, held for the few system calls they take. Without it
    two processes that both find a stale lock could each clear it and take the folder
    (the second clearing the first one's new lock). A folder that cannot be opened
    (missing) or locked (a filesystem without flock), or a holder stuck for 10 s, leaves
    the lock unguarded: as before, never worse."""
    fd = None
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fd = os.open(folder, _DIR_FLAGS)
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock


def _read_lock(folder: Path) -> tuple[dict[str, Any] | None, float, tuple[int, int] | None]:
    """The lock's content (None: no lock; ``{}``: empty or cut short), its age in seconds
    and its identity (device, inode)."""
    try:
        with open(folder / LOCK_FILE, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read()
    except FileNotFoundError:
        return None, 0.0, None
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    return (info if isinstance(info, dict) else {}), time.time() - st.st_mtime, _identity(st)


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

    A lock file that is empty or cut short (a process killed between creating and writing
    it) is waited for while it is younger than a few seconds (a process may be taking the
    folder), and is stale after that.

    Raises:
      FileExistsError: another live process (or one on another host, which cannot be
        checked) holds the folder.
    """
    folder = Path(folder)
    deadline = time.monotonic() + _LOCK_GRACE + 1.0
    while True:
        with _guard(folder):
            if _check_lock(folder) != _TAKING:
                return
        if time.monotonic() > deadline:
            raise FileExistsError(_taking_message(folder))
        time.sleep(0.1)


def _check_lock(folder: Path) -> str | None:
    """:func:`check_lock` once, under :func:`_guard`: None (no lock, or a stale one
    cleared), ``_OWN`` (this process's) or ``_TAKING`` (unreadable, young)."""
    info, age, identity = _read_lock(folder)
    if info is None:
        return None
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int) or not isinstance(host, str):
        if age < _LOCK_GRACE:
            return _TAKING
        _clear_stale(
            folder,
            identity,
            f"a process stopped while taking the folder (it left {LOCK_FILE} empty or cut "
            "short), e.g. killed with SIGKILL; resume it with --resume",
        )
        return None
    here = host == platform.node()
    if here and pid == os.getpid():
        return _OWN  # an earlier writer of this process
    if here and not _alive(pid):
        _clear_stale(
            folder,
            identity,
            f"the process (pid {pid} on {host}) stopped without closing the run, e.g. "
            "killed with SIGKILL; resume it with --resume",
        )
        return None
    raise FileExistsError(
        f"output folder {folder} is in use by a running scaffold-jax (pid {pid} on host "
        f"{host}, since {info.get('started')}); wait for it to finish or stop it (kill -INT "
        f"{pid}), or choose another output folder. If that process is gone (another host), "
        f"delete {folder / LOCK_FILE}."
    )


def _clear_stale(folder: Path, identity: tuple[int, int] | None, why: str) -> None:
    summary = read_summary(folder)
    if summary is not None and summary.get("status") == RUNNING:
        summary["status"] = INTERRUPTED
        summary["error"] = why
        _write_json(folder / SUMMARY_FILE, summary)
    path = folder / LOCK_FILE
    with contextlib.suppress(FileNotFoundError):
        if _identity(os.stat(path)) == identity:  # the very file judged stale
            path.unlink()


def _taking_message(folder: Path) -> str:
    return (
        f"output folder {folder} is being taken by another process: its lock file "
        f"{folder / LOCK_FILE} is still unreadable after {_LOCK_GRACE:g} s. Try again; if "
        "no process uses that folder, delete that file."
    )


def _take_lock(folder: Path) -> tuple[int, int]:
    """Takes the folder's lock; returns the lock file's identity (device, inode).

    The lock file never exists half-written: it is written under a temporary name, then
    hard-linked as ``.lock`` (``link(2)`` fails if that exists), all under
    :func:`_guard`, so that of two processes taking the folder together exactly one does
    and the other is refused as "in use"."""
    path = folder / LOCK_FILE
    text = json.dumps({"pid": os.getpid(), "host": platform.node(), "started": _now()})
    tmp = _temporary_name(path)
    with _writing(path):
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
    try:
        deadline = time.monotonic() + _LOCK_GRACE + 1.0
        while True:
            with _guard(folder):
                state = _check_lock(folder)  # a live holder raises; a stale lock is cleared
                if state == _OWN and any(w._abs == Path(os.path.abspath(folder))
                                         for w in _OPEN_WRITERS):  # fmt: skip
                    raise FileExistsError(
                        f"output folder {folder} is in use by another writer of this process."
                    )
                if state == _OWN:  # left by a writer of this process that is gone
                    path.unlink(missing_ok=True)
                if state != _TAKING:
                    try:
                        with _writing(path):
                            _link(tmp, path)
                        return _identity(os.stat(path))
                    except FileExistsError:
                        pass  # taken since (a process not using the guard): check it again
            if time.monotonic() > deadline:
                raise FileExistsError(_taking_message(folder))
            time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _link(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: an exclusive create, then the text
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())


def _release_lock(
    path: Path, identity: tuple[int, int] | None = None, dir_fd: int | None = None
) -> None:
    """Removes the lock file if it is still this writer's (``identity``); through the
    folder held open (``dir_fd``) when given, wherever that folder is now."""
    with _guard(path.parent):
        try:
            if dir_fd is not None:
                if (
                    identity is not None
                    and _identity(os.stat(LOCK_FILE, dir_fd=dir_fd)) == identity
                ):
                    os.unlink(LOCK_FILE, dir_fd=dir_fd)
            elif identity is not None:
                if _identity(os.stat(path)) == identity:
                    path.unlink()
            else:
                info, _, _ = _read_lock(path.parent)
                if info and info.get("pid") == os.getpid():
                    path.unlink(missing_ok=True)
        except OSError:
            pass  # gone already (or the folder with it)
