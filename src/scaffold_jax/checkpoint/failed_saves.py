"""A save that failed: the operating-system error behind orbax's and tensorstore's
(:func:`_os_problem`), the threads orbax started for it (:func:`_settle`), and orbax's
repeated reports of it kept off stderr (:func:`_filter_orbax_noise`, :class:`_HeldLog`):
the caller gets the error once, as a
:class:`~scaffold_jax.checkpoint.CheckpointWriteError`."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from typing import Any


def _settle(before: set[threading.Thread], timeout: float = 30.0) -> None:
    """Waits for the threads orbax started for a save that failed (those still writing,
    or failing in turn), so that its temporary directory can be removed for good."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread():
            continue
        if type(thread).__module__.startswith("orbax"):
            # threading's own join: orbax's re-raises the thread's error, said already.
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_problem(err: BaseException) -> tuple[int, str] | None:
    """The operating-system error behind a failed save, as (errno, its text): an
    OSError, or tensorstore's ``[os_error_code='28']`` in the text of the ValueError that
    orbax passes on; None if there is none (not a failed write: a bug to show as is)."""
    seen, error = set(), err
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno, error.strerror or str(error)
        found = _OS_ERROR_CODE.search(str(error))
        if found:
            code = int(found.group(1))
            return code, os.strerror(code)
        error = error.__cause__ or error.__context__
    text = str(err)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO):
        if os.strerror(code) in text:
            return code, os.strerror(code)
    return None


#: The loggers orbax reports a save's errors on: absl's (its own log, its threads'), and
#: asyncio's (its tasks' and futures' exceptions nobody retrieved).
_ORBAX_LOGGERS = ("absl", "asyncio")


class _HeldLog(logging.Filter):
    """While held (see :meth:`~scaffold_jax.checkpoint.Checkpointer.save`), holds back the
    records of orbax's loggers and the errors its threads (or those of its asyncio loops)
    end with."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.thread_errors: list[Any] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def hold(self) -> None:
        for name in _ORBAX_LOGGERS:
            logging.getLogger(name).addFilter(self)
        _HOLDING.append(self)

    def stop(self) -> None:
        for name in _ORBAX_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        with contextlib.suppress(ValueError):
            _HOLDING.remove(self)

    def release(self) -> None:
        """Passes what it held on: each record to its own logger, each thread's error to
        ``threading.excepthook``."""
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        for args in self.thread_errors:
            threading.excepthook(args)
        self.records.clear()
        self.thread_errors.clear()


#: The holds in force (a save in progress, a checkpointer closing after a failed one).
_HOLDING: list[_HeldLog] = []


#: The errno of every save that failed in this process (its late reports are repeats).
_FAILED_CODES: set[int] = set()


@functools.cache
def _filter_orbax_noise() -> None:
    """Keeps orbax's second and third reports of a failed save off stderr (once per
    process, when the first :class:`~scaffold_jax.checkpoint.Checkpointer` opens): its
    threads log the error they hand to the caller (absl ERROR records with a traceback
    each), its asyncio tasks that failed unawaited are reported when collected (asyncio's
    "Task exception was never retrieved", with a traceback), a thread of it may end with
    the error, and tensorstore writes still in flight complete into the closed event loop
    of that thread ("Event loop is closed", an unraisable exception). The caller gets the
    error itself, once (:class:`~scaffold_jax.checkpoint.CheckpointWriteError`). Every
    other record, unraisable exception and thread error is passed on as before."""
    logging.getLogger("absl").addFilter(_not_a_rethrown_error)
    logging.getLogger("asyncio").addFilter(_not_a_repeated_report)
    sys.unraisablehook = functools.partial(_unraisable_hook, sys.unraisablehook)
    threading.excepthook = functools.partial(_thread_error_hook, threading.excepthook)


def _not_a_rethrown_error(record: logging.LogRecord) -> bool:
    if "_SignalingThread.run() raised an exception" in str(record.msg):
        return False
    return not (record.exc_info and _repeats_a_failed_save(record.exc_info[1]))


def _not_a_repeated_report(record: logging.LogRecord) -> bool:
    """asyncio's report of a task or future of a failed save: its error unretrieved, or
    the task left pending when orbax closed its loop."""
    if record.exc_info and _repeats_a_failed_save(record.exc_info[1]):
        return False
    if _FAILED_CODES and "Task was destroyed but it is pending" in str(record.msg):
        text = record.getMessage()
        return "orbax" not in text and "tensorstore" not in text
    return True


def _repeats_a_failed_save(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a late report of a save that failed in this process (raised to
    its caller once already): that write error, or a callback into the event loop orbax
    closed after it."""
    try:
        if not _FAILED_CODES or exc is None:
            return False
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return True
        problem = _os_problem(exc)
        return problem is not None and problem[0] in _FAILED_CODES
    except Exception:  # noqa: BLE001 - a filter never fails what it filters
        return False


def _unraisable_hook(previous, unraisable) -> None:
    if not (_late_loop_callback(unraisable) or _repeats_a_failed_save(unraisable.exc_value)):
        previous(unraisable)


def _thread_error_hook(previous, args) -> None:
    """``threading.excepthook`` but for a thread of orbax (or of its asyncio loops) that
    ends with the error of a failed save."""
    if not _in_orbax(args):
        previous(args)
    elif _HOLDING:  # during a save: said with it if it fails, passed on if not
        _HOLDING[-1].thread_errors.append(args)
    elif not _repeats_a_failed_save(args.exc_value):
        previous(args)


def _in_orbax(args) -> bool:
    """Whether a thread's error came through orbax, tensorstore or an asyncio loop."""
    if type(args.thread).__module__.startswith("orbax"):
        return True
    parts = [f"{os.sep}{part}{os.sep}" for part in ("orbax", "tensorstore", "asyncio")]
    return any(part in code.co_filename for code in _codes(args.exc_traceback) for part in parts)


def _late_loop_callback(unraisable) -> bool:
    """A callback into an event loop that orbax already closed after a failed save."""
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
        return False
    return any(c.co_name == "call_soon_threadsafe" for c in _codes(unraisable.exc_traceback))


def _codes(tb: types.TracebackType | None) -> Iterator[types.CodeType]:
    """The code of each frame of a traceback, outermost first."""
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next
