"""Who may use a run folder: its lock file (``.lock``: process id, host, start time), which
keeps two processes out of one folder (:func:`check_lock`, a stale one cleared), and
:func:`check_folder`, which refuses a folder that holds a run (or clears it, with
``overwrite``)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

from scaffold_jax.results.files import (
    _OWN_FILES,
    CONFIG_FILE,
    FINISHED,
    INTERRUPTED,
    PARTS_FILE,
    RUNNING,
    _now,
    _temporary_name,
    _write_json,
    _writing,
)
from scaffold_jax.results.records import METRICS_FILE, SUMMARY_FILE, read_records, read_summary

try:  # POSIX: the lock is checked and taken under an flock of the folder (see _guard)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".lock"


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


# How long a lock file that is empty or cut short may be "being written": a process
# killed between creating and writing it (by a version that did not write it whole) left
# it so; younger, it may be a live process taking the folder, older it is stale.
_LOCK_GRACE = 5.0
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
_TAKING, _OWN = "taking", "own"
# The RunWriters open in this process: a second one on the same folder is refused.
_OPEN_WRITERS: weakref.WeakSet[Any] = weakref.WeakSet()


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
        with _writing(folder / SUMMARY_FILE, in_place=True):
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


def _release_lock(path: Path, identity: tuple[int, int], dir_fd: int | None = None) -> None:
    """Removes the lock file if it is still this writer's (``identity``); through the
    folder held open (``dir_fd``) when given, wherever that folder is now."""
    name = path if dir_fd is None else LOCK_FILE
    with _guard(path.parent), contextlib.suppress(OSError):  # gone (or the folder with it)
        if _identity(os.stat(name, dir_fd=dir_fd)) == identity:
            os.unlink(name, dir_fd=dir_fd)
