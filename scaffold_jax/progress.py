"""What the commands say while they work: timed phase lines and a progress bar.

One :class:`Progress` serves every command: ``run`` (rounds), ``sweep`` (rounds of all its
algorithms), ``reproduce`` (cells) and ``diagnose`` (gradient steps). Everything goes to
stderr, so stdout stays clean for tables. On a terminal (or in a notebook) the bar is
tqdm's, with its rate and ETA; when stderr is a file or a pipe (a batch job's log, a
test), each update is one plain line instead, e.g.::

    scaffold: round 20/100 (20%), 12.3 s elapsed, 2.1 round/s, ETA 38.1 s, acc=0.612

The long silent stretches before the first round, loading the data and compiling, are
:meth:`Progress.phase` lines, each with its duration, e.g. ``compiling 5 rounds as one
program: 31.2 s``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

# The record fields shown beside the bar, the first present wins.
_POSTFIX = (("test_accuracy", "acc"), ("error", "err"), ("test_loss", "loss"))


def format_seconds(seconds: float) -> str:
    """``12.3 s``, ``4:05`` (minutes) or ``1:02:03`` (hours)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def _count(units: float) -> str:
    """Whole units as they are; a grid's work-weighted rounds to the nearest one."""
    return f"{units:g}" if units == int(units) else f"{units:.0f}"


def _interactive(stream: TextIO) -> bool:
    """A terminal, or a notebook (whose stderr is no tty, but whose tqdm draws a widget)."""
    isatty = getattr(stream, "isatty", None)
    if isatty and isatty():
        return True
    # A running kernel, not merely an imported ipykernel module (libraries import it to
    # probe for notebooks, and a batch job's log must still get plain lines).
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and hasattr(shell, "kernel")


class Progress:
    """Progress over ``total`` units (rounds, cells, steps) plus timed phase lines.

    Steady-state rate and ETA: a bar starts at the first update past zero (so the rate of
    a round bar excludes the first compilation, as the plain lines' rate excludes the time
    spent in :meth:`phase`). Disabled (a no-op) with ``enabled=False`` (``--quiet``).

    Args:
      total: the number of units.
      desc: the label in front of the bar or line.
      unit: what a unit is called (``"round"``, ``"cell"``, ``"step"``).
      enabled: False: print nothing at all.
      leave: keep the finished bar on screen.
      stream: where to write (default ``sys.stderr`` at the time of each write).
      plain: force plain lines (True) or a bar (False); default: a bar on a terminal or
        in a notebook, plain lines otherwise.
    """

    def __init__(
        self,
        total: float,
        desc: str = "",
        unit: str = "round",
        enabled: bool = True,
        leave: bool = True,
        stream: TextIO | None = None,
        plain: bool | None = None,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.enabled, self.leave, self._stream = enabled, leave, stream
        self._plain = plain
        self.done = 0.0
        self.bar = None
        self._start = time.perf_counter()
        self._phase_seconds = 0.0  # spent in phase() since the start: not in the rate
        self._base = (0.0, self._start, 0.0)  # (done, time, phase seconds) the rate counts from

    @property
    def stream(self) -> TextIO:
        return sys.stderr if self._stream is None else self._stream

    @property
    def plain(self) -> bool:
        if self._plain is None:
            self._plain = not _interactive(self.stream)
        return self._plain

    # -- lines ---------------------------------------------------------------------
    def write(self, text: str) -> None:
        """Prints a line (on the bar's stream) without breaking the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, text: str) -> Iterator[None]:
        """A line ``text...`` when the phase starts and ``text: <seconds>`` when it ends;
        its time is left out of the plain lines' rate."""
        self.write(f"{text}...")
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self._phase_seconds += seconds
        # Only a phase that finished says so: a failed one is followed by its error.
        self.write(f"{text}: {format_seconds(seconds)}")

    def rebase(self, done: float) -> None:
        """Starts at ``done`` units without counting them in the rate (a resumed run: the
        rounds before its checkpoint were run by another process)."""
        self.done = float(done)
        self._base = (self.done, time.perf_counter(), self._phase_seconds)

    # -- the bar -------------------------------------------------------------------
    def update(self, done: float, postfix: str | None = None) -> None:
        """Moves to ``done`` units (absolute); ``postfix``: shown after the rate."""
        if not self.enabled or done == self.done:
            return
        self.done = done
        if self.plain:
            self.write(self._line(postfix))
            return
        if self.bar is None:
            self._open_bar(initial=done)
        else:
            self.bar.update(done - self.bar.n)
        if postfix:
            self.bar.set_postfix_str(postfix, refresh=False)

    def _open_bar(self, initial: float) -> None:
        from tqdm.auto import tqdm

        # Opened at the first update past zero, what came before (the first block,
        # compiling included) is its initial value, so its rate is the steady state.
        self.bar = tqdm(
            total=self.total, initial=initial, desc=self.desc, unit=self.unit,
            leave=self.leave, dynamic_ncols=True, file=self.stream, mininterval=0.5,
        )  # fmt: skip

    def show(self) -> None:
        """Draws the bar now, at zero (units that each take long, such as cells, where
        an empty bar beats silence); plain lines start with the first unit."""
        if self.enabled and not self.plain and self.bar is None:
            self._open_bar(initial=self.done)

    def _line(self, postfix: str | None) -> str:
        now = time.perf_counter()
        elapsed = now - self._start
        base_done, base_time, base_phases = self._base
        steady = now - base_time - (self._phase_seconds - base_phases)
        percent = 100.0 * self.done / self.total if self.total else 100.0
        parts = [
            f"{self.desc + ': ' if self.desc else ''}{self.unit} {_count(self.done)}/"
            f"{_count(self.total)} "
            f"({percent:.0f}%)",
            f"{format_seconds(elapsed)} elapsed",
        ]
        if self.done > base_done and steady > 0:
            rate = (self.done - base_done) / steady
            parts.append(f"{rate:.3g} {self.unit}/s")
            parts.append(f"ETA {format_seconds(max(self.total - self.done, 0) / rate)}")
        if postfix:
            parts.append(postfix)
        return ", ".join(parts)

    def __call__(self, record: Mapping[str, Any]) -> None:
        """A record sink: moves to the record's ``round``, showing its accuracy, error or
        loss (round 0 comes before the round program compiles: no update)."""
        postfix = None
        for key, label in _POSTFIX:
            value = record.get(key)
            if isinstance(value, (int, float)) and value == value:  # finite or inf, not NaN
                postfix = f"{label}={value:.4g}"
                break
        self.update(int(record["round"]), postfix)

    def step(self, text: str | None = None) -> None:
        """One more unit done, described by ``text`` (a finished cell): in the plain line,
        or as a line ``[done/total] text`` above the bar."""
        if self.enabled and text is not None and not self.plain:
            self.write(f"[{self.done + 1:g}/{self.total:g}] {text}")
            text = None
        self.update(self.done + 1, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
