"""The driver of the host loop, :func:`drive`, and the signals it defers.

Schedule. The loop is anchored at the round the run started from, r0 (0 for a fresh
run): evaluations at r0, r0 + E, r0 + 2E, ... and at the last round r0 + ``num_rounds``;
checkpoints (with a checkpoint directory) at r0 and every ``checkpoint_every`` rounds
after it, and at the last round, so a finished run always leaves its final state. Without
``checkpoint_every`` the cadence is adaptive: a checkpoint at an evaluation once the time
since the last one is at least (1 - s) / s times what that one took to write, s =
:data:`CHECKPOINT_SHARE`, so writing checkpoints costs at most about that share of the
run's time (a resume is exact from any checkpoint; a sparser cadence only means more
rounds to run again after a kill). The
rounds between two such points are one call of ONE compiled program, as long as the
longest such block (a shorter block stops early inside it), so a run compiles once
whatever its cadence. Evaluations are timed apart from the rounds.

Resuming restores the newest readable checkpoint (falling back past corrupt ones, see
:func:`scaffold_jax.checkpoint.restore_latest`), refuses one written by another run (its
identity, :func:`~scaffold_jax.loop.run_identity`: algorithm, data, plan, S, weighting,
sampler, participation, declared hyper-parameters, seed), and continues bit for bit; the
records saved with it open the new records.

Running totals. Records carry the running totals of some round metrics since the state's
round 0 (:data:`RUNNING_TOTALS`: the clients that downloaded and uploaded, whose bytes
the records report, and the virtual clock's seconds), the first record included (0 for a
fresh run). They are the state's: a resume continues its checkpoint's, and a run
continuing a state in memory continues the ``totals`` it is given (a single run keeps
the totals of every state it returns for that, :func:`remember_totals`).

Signals. While a loop runs, SIGINT and SIGTERM are deferred: the current compiled block
finishes, a checkpoint is saved (when there is a directory), then SIGINT raises a plain
``KeyboardInterrupt`` and SIGTERM a :class:`RunTerminated` (a ``SystemExit`` with code
143), each carrying the result so far, ``status="interrupted"``, as ``result``. A second
signal acts at once. With several processes (``jax.distributed``) a signal received by any
of them stops all of them after the same block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np

from scaffold_jax.loop.identity import check_same_run
from scaffold_jax.registry import ConfigError
from scaffold_jax.types import PyTree

Record = dict[str, Any]


# ----------------------------------------------------------------------------- stopping
class DivergenceError(ValueError):
    """The server state of a run became NaN or Inf; the run stopped.

    Attributes:
      result: the :class:`RunResult` so far, ``status="diverged"``; its ``state`` is the
        non-finite one, its ``records`` the (finite) evaluations made before.
      records: ``result.records``.
      diverged_round: the round that produced the non-finite values (1-based, i.e. the
        value of ``state.round`` after it, as :mod:`scaffold_jax.sweep` reports it).
    """

    def __init__(self, message: str, result: Any, diverged_round: int):
        super().__init__(message)
        self.result = result
        self.records = result.records
        self.diverged_round = diverged_round


class RunTerminated(SystemExit):
    """SIGTERM stopped a run after its current compiled block (and its checkpoint).

    A ``SystemExit`` with code 143 (128 + SIGTERM, what a shell reports for a process
    killed by SIGTERM). ``result`` is the result so far, ``status="interrupted"``;
    ``message`` says where the checkpoint is.
    """

    def __init__(self, message: str, result: Any):
        super().__init__(128 + int(signal.SIGTERM))
        self.message = message
        self.result = result


class Diverged(Exception):
    """Raised by a task's divergence policy: the loop stops and raises
    :class:`DivergenceError` with the result so far."""

    def __init__(self, message: str, diverged_round: int):
        super().__init__(message)
        self.diverged_round = diverged_round


# ----------------------------------------------------------------------------- signals
class _DeferredSignals:
    """Holds SIGINT and SIGTERM back until the current compiled block has finished.

    A compiled block cannot be stopped half-way without losing it, so the first signal is
    only noted; the loop saves a checkpoint at the end of the block and then raises. A
    second signal acts at once (the user does not want to wait). The previous handlers are
    restored on exit. Off the main thread Python cannot install handlers: nothing changes.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _DeferredSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            # None: a handler installed outside Python; SIG_IGN: the signal is ignored on
            # purpose (e.g. nohup). Either way it is not ours to take over.
            if previous is None or previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            return
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __exit__(self, *exc_info) -> None:
        self._restore()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    del frame
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_exits():
    """Outside a running loop, SIGTERM (a scheduler's kill, ``timeout``) exits as a shell
    reports it, 128 + 15, through ``SystemExit``, so that a run writer records
    ``"interrupted"`` on its way out (a running loop defers it to the end of its block
    itself). The command line wraps every command in it. Off the main thread, nothing
    changes."""
    try:
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    except ValueError:  # not the main thread: keep the default
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _agreed_signal(received: int | None) -> tuple[int | None, bool]:
    """``(signal, here)``: the signal to stop on and whether THIS process received it.

    With several processes every one must stop after the same block (the checkpoint and
    the next block are collectives), so the processes pool what they received at every
    block boundary (a collective) and all stop if any of them was signalled.
    """
    if jax.process_count() == 1:
        return received, received is not None
    from jax.experimental import multihost_utils

    pooled = multihost_utils.process_allgather(np.asarray([received or 0], np.int32))
    pooled = np.asarray(pooled).reshape(-1)
    pooled = pooled[pooled != 0]
    if received is not None:
        return received, True
    return (int(pooled[0]), False) if pooled.size else (None, False)


# ----------------------------------------------------------------------------- the loop
class Task(Protocol):
    """What :func:`drive` runs: compiled programs over a state, and a divergence policy."""

    def compile_block(self, state: PyTree, key: jax.Array, num_rounds: int) -> Callable:
        """The compiled ``fn(state, key, n) -> (state, metrics)`` of a block of the first
        ``n <= num_rounds`` of ``num_rounds`` rounds (the state is donated; metrics gain a
        leading ``[num_rounds]`` axis, whose first ``n`` rows are the rounds run). The
        driver calls it once with ``n = 0`` (no round) to learn which metrics the rounds
        report before any has run."""

    def compile_evaluate(self, state: PyTree) -> Callable:
        """The compiled ``fn(state) -> metrics`` of the evaluation."""

    def round_of(self, state: PyTree) -> int:
        """The round ``state`` is at."""

    def records(self, state: PyTree, metrics: Mapping[str, np.ndarray], round: int, seconds: float):
        """The evaluation records (a list of dicts) of ``state``, whose evaluation gave the
        host ``metrics``, at ``round``."""

    def check(self, state: PyTree, metrics: Mapping[str, np.ndarray], first: int, last: int):
        """The divergence policy after rounds ``first + 1 .. last``: raise
        :class:`Diverged` to stop, or return."""


@dataclasses.dataclass
class Outcome:
    """What :func:`drive` hands to its ``finish`` callback."""

    state: PyTree
    records: list[Record]
    metrics: list[dict[str, np.ndarray]]
    compile_seconds: float
    run_seconds: float
    eval_seconds: float
    checkpoint_seconds: float
    status: str
    resumed_from: int | None
    totals: dict[str, Any] | None = None
    """The running totals at ``state`` (:data:`RUNNING_TOTALS`' round metrics, float64,
    summed since round 0); None when unknown (a resume from a checkpoint without them)."""


#: The adaptive checkpoint cadence's budget: the share of a run's wall time that writing
#: checkpoints may take (see the module docstring).
CHECKPOINT_SHARE = 0.1


def drive(
    task: Task,
    state: PyTree | None,
    key: jax.Array,
    num_rounds: int,
    eval_every: int,
    finish: Callable[[Outcome], Any],
    callback: Callable[[Record], None] | None = None,
    checkpointer: Any = None,
    checkpoint_every: int | None = None,
    identity: Mapping[str, Any] | None = None,
    resume_into: PyTree | None = None,
    on_restore: Callable[[list[Record]], None] | None = None,
    checkpoint_seconds: float | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
    on_block: Callable[[int], None] | None = None,
    totals: Mapping[str, Any] | None = None,
) -> Any:
    """Runs ``task`` for ``num_rounds`` rounds from ``state`` (or, with ``resume_into``,
    from the newest checkpoint of ``checkpointer`` restored into that shape).

    Args:
      task: the compiled programs and divergence policy (see :class:`Task`).
      state: the state to start from (donated), or None when resuming.
      key: the root key(s) of the programs.
      num_rounds: rounds to run from the start round r0 (checked >= 1 by the caller).
      eval_every: evaluation period E.
      finish: makes the caller's result from an :class:`Outcome`; its value is returned,
        and attached as ``result`` to the exceptions the loop raises.
      callback: a record sink, called with every new record, after the checkpoint of
        its round (when one is due) is written.
      checkpointer: a :class:`~scaffold_jax.checkpoint.Checkpointer`, or None.
      checkpoint_every: checkpoint period in rounds (with a checkpointer); None: the
        adaptive cadence (at evaluations, within :data:`CHECKPOINT_SHARE` of the time).
      identity: what fixes the run's trajectory; stored with every checkpoint and compared
        on resume (see :func:`check_same_run`).
      resume_into: the state's shapes (``jax.ShapeDtypeStruct`` leaves) to restore into.
      on_restore: called, on resume, with the records the checkpoint holds (every
        record up to its round, exactly once) before any new one: a sink that persists
        records rewrites its copy with them, so a record made after that checkpoint by the
        interrupted process is not kept twice.
      checkpoint_seconds: also save at the end of any block when this many seconds of
        wall time have passed since the last save (blocks end at every evaluation and
        checkpoint round).
      phase: called with a description of each compilation, e.g. ``"compiling 5 rounds
        as one program"``; the context manager it returns is entered around it (progress
        lines such as :meth:`scaffold_jax.progress.Progress.phase`).
      on_block: called with the round reached once each evaluation's records have all
        been handed to ``callback`` (one call per evaluation, however many records).
      totals: the running totals ``state`` carries (:attr:`Outcome.totals` of the run
        that made it), continued by this one; None: 0 (a resume continues its
        checkpoint's).

    Raises:
      DivergenceError, KeyboardInterrupt, RunTerminated: see the module docstring.
    """
    if phase is None:
        phase = lambda text: contextlib.nullcontext()
    records: list[Record] = []
    pending: dict[str, Any] = {}  # a checkpoint's round metrics since its last evaluation
    # The running totals up to the last record (the counts exact: float64 sums of whole
    # numbers), from the state's round 0; None after a checkpoint written without them.
    transfers: dict[str, Any] | None = dict(totals or {})
    resumed_from = None
    seconds_before = 0.0  # run time spent by the process(es) before a resume
    if resume_into is not None:
        restored = checkpointer.restore_latest(resume_into)
        check_same_run(restored.extra.get("identity"), identity, str(restored.path))
        state, key, resumed_from = restored.state, restored.key, restored.round
        records = list(restored.extra.get("records", []))
        pending = restored.extra.get("pending", {})
        kept = restored.extra.get("transfers")
        transfers = None if kept is None else {k: np.asarray(v) for k, v in kept.items()}
        seconds_before = float(restored.extra.get("seconds", 0.0))
        start = int(restored.extra.get("start_round", 0))
        if on_restore is not None:
            on_restore(list(records))
    else:
        if checkpointer is not None and checkpointer.latest_round() is not None:
            raise ValueError(
                f"checkpoint_dir {checkpointer.directory} already holds checkpoints (the "
                f"newest at round {checkpointer.latest_round()}); pass resume=True to "
                "continue that run or use an empty directory."
            )
        start = task.round_of(state)
    end = start + num_rounds
    current = task.round_of(state)
    if current > end:
        raise ConfigError(
            f"the checkpoint is at round {current}, past the end of this run (round "
            f"{end} = {start} + num_rounds {num_rounds}); pass a larger num_rounds."
        )

    def due(r: int, every: int) -> bool:
        return r == end or (r - start) % every == 0

    def next_point(r: int, every: int) -> int:
        return min(end, start + ((r - start) // every + 1) * every)

    def next_boundary(r: int) -> int:
        boundary = next_point(r, eval_every)
        if checkpointer is not None and checkpoint_every is not None:
            boundary = min(boundary, next_point(r, checkpoint_every))
        return boundary

    # The blocks between evaluations and checkpoints, known up front: ONE program, as long
    # as the longest of them, runs every block (a shorter one stops early inside it).
    longest, r = 0, current
    while r < end:
        longest, r = max(longest, next_boundary(r) - r), next_boundary(r)
    t0 = time.perf_counter()
    with phase("compiling the evaluation"):
        evaluate = task.compile_evaluate(state)
    if longest:
        with phase(f"compiling {longest} round{'s' * (longest > 1)} as one program"):
            program = task.compile_block(state, key, longest)
            # A block of no round says which metrics the rounds report (its rows are
            # zeros) before any has run: the first record carries the totals that the
            # later ones will (a curve against time or bytes starts at the start).
            state, like = program(state, key, 0)
        if transfers is not None:
            # Per config (a sweep's [G, M]); a checkpoint older than a total counts it as 0.
            transfers = {
                name: np.broadcast_to(
                    np.asarray(transfers.get(name, 0.0), np.float64), np.shape(like[name])[1:]
                ).copy()
                for name in RUNNING_TOTALS
                if name in like
            }
    compile_seconds = time.perf_counter() - t0
    block_metrics: list[dict[str, np.ndarray]] = []
    # The rounds since the last evaluation, for the means a record reports; a checkpoint
    # between two evaluations holds them (``pending``), so a resumed record is exact.
    since_record: list[dict[str, np.ndarray]] = (
        [{k: np.asarray(v["values"], v["dtype"]) for k, v in pending.items()}] if pending else []
    )
    eval_seconds = 0.0
    save_every_seconds = checkpoint_seconds
    checkpoint_seconds = 0.0
    last_save = time.perf_counter()
    last_save_cost = 0.0  # seconds the newest save took (the adaptive cadence's measure)
    run_start = time.perf_counter()

    def elapsed() -> float:
        spent = time.perf_counter() - run_start
        return seconds_before + spent - checkpoint_seconds

    def record() -> list[Record]:
        """Evaluates and returns the new records (kept in ``records``: the next
        checkpoint holds them); :func:`deliver` hands them over."""
        nonlocal eval_seconds
        t0 = time.perf_counter()
        metrics = jax.device_get(evaluate(state))
        eval_seconds += time.perf_counter() - t0
        # Free with every round, as means over the rounds since the last evaluation (none
        # before a round ran): the clients' own training loss (their local steps' minibatch
        # losses) and the client drift (mean ‖y_i − x‖); the running totals.
        if transfers is not None:
            transfers.update(_added(transfers, since_record))
            metrics.update({RUNNING_TOTALS[name]: value for name, value in transfers.items()})
        for name in RECORDED_ROUND_METRICS:
            values = [m[name] for m in since_record if name in m]
            if values:
                metrics[name] = np.mean(np.concatenate(values), axis=0)
        since_record.clear()
        new = task.records(state, metrics, current, elapsed())
        records.extend(new)
        return new

    def deliver(new: list[Record]) -> None:
        for entry in new:
            if callback is not None:
                callback(entry)
        if new and on_block is not None:
            on_block(current)

    def save() -> None:
        nonlocal checkpoint_seconds, last_save, last_save_cost
        t0 = time.perf_counter()
        extra = {"identity": identity, "start_round": start, "records": records}
        extra["pending"] = _pending(since_record)
        if transfers is not None:
            extra["transfers"] = {k: np.asarray(v).tolist() for k, v in transfers.items()}
        extra["seconds"] = elapsed()
        checkpointer.save(state, key, extra, step=current)
        last_save = time.perf_counter()
        last_save_cost = last_save - t0
        checkpoint_seconds += last_save_cost

    def save_due(evaluated: bool) -> bool:
        since = time.perf_counter() - last_save
        if save_every_seconds is not None and since >= save_every_seconds:
            return True
        if checkpoint_every is not None:
            return due(current, checkpoint_every)
        budget = (1 - CHECKPOINT_SHARE) / CHECKPOINT_SHARE * last_save_cost
        return current == end or (evaluated and since >= budget)

    def outcome(status: str) -> Any:
        jax.block_until_ready(state)
        run_seconds = time.perf_counter() - run_start - checkpoint_seconds
        # The rounds since the last record too: the totals are the state's.
        totals = None if transfers is None else _added(transfers, since_record)
        return finish(Outcome(
            state=state, records=records, metrics=block_metrics, status=status,
            compile_seconds=compile_seconds, run_seconds=run_seconds, eval_seconds=eval_seconds,
            checkpoint_seconds=checkpoint_seconds, resumed_from=resumed_from, totals=totals,
        ))  # fmt: skip

    def stop_if_signalled(signals: _DeferredSignals) -> None:
        received, here = _agreed_signal(signals.received)
        if received is None:
            return
        if checkpointer is not None and checkpointer.latest_round() != current:
            save()
        where = (
            f"checkpoint at round {current} in {checkpointer.directory}"
            if checkpointer is not None
            else "no checkpoint_dir, nothing saved"
        )
        name = signal.Signals(received).name
        by = "" if here else " by another process"
        message = f"{name} received{by}: stopped after round {current} ({where})."
        partial = outcome("interrupted" if current < end else "finished")
        if received == signal.SIGTERM:
            raise RunTerminated(message, partial)
        # A plain KeyboardInterrupt, not a subclass: only then does an uncaught one make
        # Python exit "killed by SIGINT" (status 130), which is what lets a shell loop
        # around the command stop on Ctrl-C.
        interrupt = KeyboardInterrupt(message)
        interrupt.result = partial
        raise interrupt

    with _DeferredSignals() as signals:
        if resumed_from is None:
            new = record()
            if checkpointer is not None:
                save()  # so that resume works even if round r0 + 1 is never reached
            deliver(new)
        while current < end:
            stop_if_signalled(signals)
            boundary = next_boundary(current)
            first, length = current, boundary - current
            state, metrics = program(state, key, length)
            metrics = {k: v[:length] for k, v in jax.device_get(metrics).items()}
            block_metrics.append(metrics)
            since_record.append(metrics)
            current = boundary
            try:
                task.check(state, metrics, first, current)
            except Diverged as err:
                raise DivergenceError(str(err), outcome("diverged"), err.diverged_round) from None
            evaluated = due(current, eval_every)
            new = record() if evaluated else []
            if checkpointer is not None and save_due(evaluated):
                save()
            # After the checkpoint: a sink never holds a record a resume would make again.
            deliver(new)
        # A signal during the last block (or before a run with nothing left to do) is
        # still honoured: the caller asked to stop whatever comes after this run.
        stop_if_signalled(signals)
    return outcome("finished")


#: Round metrics every record reports as their mean since the previous evaluation (those a
#: round reports: the cohort of a varying-size sampler or of partial participation, the
#: available clients, the dropped ones, the stragglers' completed steps, a private run's
#: clip norm and the fraction of its clients clipped, the malicious clients sampled and
#: reported and how many of them a Krum selected).
RECORDED_ROUND_METRICS = (
    "local_loss", "client_drift", "participants", "available", "dropped", "steps_taken",
    "dp_clip_norm", "dp_clipped_fraction", "downloads", "uploads", "late", "round_duration",
    "staleness_mean", "staleness_max", "malicious_sampled", "malicious_reported",
    "aggregator_selected_malicious",
)  # fmt: skip

#: Round metrics whose running totals records also carry, by the total's name: the
#: counts of clients that downloaded and uploaded (:mod:`scaffold_jax.engine.communication`)
#: and the virtual clock's seconds (:mod:`scaffold_jax.participation.clock`).
RUNNING_TOTALS = {
    "downloads": "downloads_total",
    "uploads": "uploads_total",
    "round_duration": "virtual_time",
}


def _added(totals: Mapping[str, Any], since_record: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """``totals`` plus the rounds of ``since_record`` (float64: whole counts stay exact)."""
    out = dict(totals)
    for name in totals:
        values = [m[name] for m in since_record if name in m]
        if values:
            out[name] = out[name] + np.sum(np.concatenate(values).astype(np.float64), axis=0)
    return out


# The totals of the states single runs returned (Outcome.totals), by an array of the state
# that is theirs alone (a SimState's round counter): a run continuing one of them in memory
# continues its totals, as a resume continues its checkpoint's. A state is a NamedTuple,
# which cannot be referenced weakly; its arrays can, and an entry goes with its array.
_CARRIED: dict[int, tuple[weakref.ref, int, dict[str, Any]]] = {}


def remember_totals(anchor: jax.Array, round: int, totals: Mapping[str, Any] | None) -> None:
    """Keeps the running ``totals`` of a state at ``round`` for :func:`carried_totals`,
    by ``anchor``, an array of that state alone (not copied: while it lives)."""
    if totals is None:
        return
    key = id(anchor)
    try:
        ref = weakref.ref(anchor, lambda _, key=key: _CARRIED.pop(key, None))
    except TypeError:  # not an array that can be referenced weakly: nothing to carry
        return
    _CARRIED[key] = (ref, int(round), dict(totals))


def carried_totals(anchor: Any, round: int) -> dict[str, Any] | None:
    """The totals :func:`remember_totals` kept for ``anchor`` at ``round``, or None."""
    kept = _CARRIED.get(id(anchor))
    if kept is None or kept[0]() is not anchor or kept[1] != round:
        return None
    return dict(kept[2])


def _pending(since_record: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """The recorded round metrics of the rounds since the last evaluation, JSON-able for
    a checkpoint (a float32 round-trips exactly through a Python float)."""
    out = {}
    for name in RECORDED_ROUND_METRICS:
        values = [m[name] for m in since_record if name in m]
        if values:
            array = np.concatenate(values)
            out[name] = {"values": array.tolist(), "dtype": str(array.dtype)}
    return out
