"""A run folder's files: their names, the run's statuses, and writing them so that
neither a crash nor a full disk leaves a torn one: a JSON or table file is written under
a temporary name and renamed (:func:`_replacing`), and an ``OSError`` becomes one
:class:`RunFolderError` line naming the file and the fix (:func:`_writing`)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any

from scaffold_jax.results.records import METRICS_FILE, SUMMARY_FILE

CONFIG_FILE = "config.json"
CSV_FILE = "metrics.csv"
#: Every evaluated client's accuracy on its own test data, global and personal model.
PERSONAL_FILE = "personal.csv"
PARTS_FILE = "parts.jsonl"

RUNNING, FINISHED, FAILED, INTERRUPTED = "running", "finished", "failed", "interrupted"

# Files a writer may have made; --overwrite removes only these (and those a previous
# summary lists), never the whole folder: `--out .` must not wipe a working directory.
_OWN_FILES = (
    CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CSV_FILE, PERSONAL_FILE,
    "accuracy.png", "loss.png", "accuracy_vs_uplink.png", "accuracy_vs_time.png",
)  # fmt: skip


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


def _write_json(path: Path, obj: Any, dir_fd: int | None = None) -> None:
    # Written to a temporary name and renamed: a crash mid-write never leaves a truncated
    # summary or config behind.
    text = json.dumps(obj, indent=1, default=_json_default, allow_nan=True) + "\n"
    with _replacing(path, dir_fd=dir_fd) as f:
        f.write(text)


class RunFolderError(OSError):
    """A run folder could not be written (a full disk, a read-only folder, ...)."""

    def __str__(self) -> str:  # the message alone: it names the file and the fix
        return self.strerror or super().__str__()


@contextlib.contextmanager
def _writing(path: Path, in_place: bool = False):
    """Turns an OSError while writing ``path`` into a one-line :class:`RunFolderError`
    (``in_place``: the write belongs to a ``--resume`` or ``--overwrite`` of the folder
    that holds ``path``, where another ``--out`` is not the fix)."""
    try:
        yield
    except RunFolderError:
        raise  # said already, by a block inside this one
    except OSError as exc:
        raise RunFolderError(exc.errno, _cannot_write(path, exc, in_place)) from exc


#: The errors of a folder that may not be written (a read-only file system, permissions).
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
#: The errors of a disk without room (no space, a quota, a file size limit).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _cannot_write(path: Path, exc: OSError, in_place: bool = False) -> str:
    """One line: what could not be written, the actual problem and its fix (a folder that
    may not be written is another --out, or, ``in_place``, made writable; a full disk is
    space freed, then --resume)."""
    reason = exc.strerror or str(exc)
    if in_place and exc.errno in _NOT_WRITABLE:
        why = "on a read-only file system" if exc.errno == errno.EROFS else "not writable"
        return (
            f"cannot write {path}: the run's folder is {why}, and --resume or --overwrite "
            "writes where the run is. Make the folder writable, or copy it to a writable "
            "place and --resume there."
        )
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
