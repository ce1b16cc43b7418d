"""What the commands say while they work: timed phase lines and a progress bar.

One :class:`Progress` serves every command: ``run`` (rounds), ``sweep`` (rounds of all its
algorithms), ``reproduce`` (cells) and ``diagnose`` (gradient steps). Everything goes to
stderr, so stdout stays clean for tables. On a terminal (or in a notebook) the bar is
tqdm's, with its rate and ETA; when stderr is a file or a pipe (a batch job's log, a
test), an update is one plain line instead, e.g.::

    scaffold: round 20/100 (20%), 12.3 s elapsed, 2.1 round/s, ETA 38.1 s, acc=0.612

at most one per tenth of the work or per :data:`PLAIN_LINE_SECONDS` (and the last), so
that a command's log stays readable however often it evaluates (Figure 3's 15 cells of
1,000 evaluated rounds each: about a dozen lines).

The rate and the ETA count from the first update past the start (or a
:meth:`Progress.rebase`): what came before it, the first block's one-off costs
(compilation, the first execution, the first checkpoint), is not work the remaining units
will repeat.

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

#: A plain line at least this often (seconds) while the work moves, besides one per tenth.
PLAIN_LINE_SECONDS = 30.0

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

    Steady-state rate and ETA: a bar starts at the first update past zero, and the plain
    lines' rate counts from there too (so neither includes the first block's compilation
    and one-off costs), leaving out the time spent in :meth:`phase`. Disabled (a no-op)
    with ``enabled=False`` (``--quiet``). With ``brief`` set (a grid's cells after the
    first), a phase prints only its end line, and only when it took a second or more.

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
        self._warm = False  # an update since the start or the last rebase: the base is set
        self._printed = (-1.0, -1)  # (time, tenth of the work) of the last plain line
        self._final = False  # the line at the total was printed
        self.brief = False

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
        brief = self.brief
        if not brief:
            self.write(f"{text}...")
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self._phase_seconds += seconds
        # Only a phase that finished says so: a failed one is followed by its error.
        if not brief or seconds >= 1.0:
            self.write(f"{text}: {format_seconds(seconds)}")

    def rebase(self, done: float) -> None:
        """Starts at ``done`` units without counting them in the rate (a resumed run: the
        rounds before its checkpoint were run by another process)."""
        self.done = float(done)
        self._base = (self.done, time.perf_counter(), self._phase_seconds)
        self._warm = False

    # -- the bar -------------------------------------------------------------------
    def update(self, done: float, postfix: str | None = None) -> None:
        """Moves to ``done`` units (absolute); ``postfix``: shown after the rate."""
        if not self.enabled:
            return
        # The last line always comes, once: also when a grid's work-weighted units sum to
        # a hair under the total, or a rebase already moved to it (the cell that finished
        # last is counted before its final block's update arrives).
        final = self.total > 0 and done >= self.total * (1 - 1e-9) and not self._final
        if done == self.done and not final:
            return
        self.done = done
        warm = self._warm
        if not warm:  # the first update: the rate counts from here
            self._warm = True
            self._base = (done, time.perf_counter(), self._phase_seconds)
        if self.plain:
            now = time.perf_counter()
            tenth = int(10 * done / self.total) if self.total else 10
            last_time, last_tenth = self._printed
            if final or tenth > last_tenth or now - last_time >= PLAIN_LINE_SECONDS:
                self._printed = (now, tenth)
                self._final = self._final or final
                self.write(self._line(postfix, rate=warm))
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

    def _line(self, postfix: str | None, rate: bool = True) -> str:
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
        if rate and self.done > base_done and steady > 0:
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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
