"""The ONE host loop: evaluation cadence, record sinks, checkpoints and resume, signals,
divergence policy.

Single runs (:func:`run`, what :meth:`Simulation.run`
calls), sweeps (:mod:`scaffold_jax.sweep`) and the command line all run their compiled
programs through :func:`drive`. What differs between them is a :class:`Task`: the compiled
block of rounds, the evaluation that turns a state into records, and the divergence
policy, ``raise`` for a single run (:class:`DivergenceError` naming the round) or
``freeze`` per config in a sweep (inside the compiled round; the loop then never stops).

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
identity: algorithm, data, plan, S, weighting, declared hyper-parameters, seed), and
continues bit for bit; the records saved with it open the new records.

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
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.random as jr
import numpy as np

from scaffold_jax import engine
from scaffold_jax.data.federated import data_fingerprint
from scaffold_jax.engine import MAX_ROUNDS, MAX_SEED, ROUNDS_WHY, SEED_WHY, check_count
from scaffold_jax.registry import ConfigError
from scaffold_jax.sampling import uniform
from scaffold_jax.types import HParams, PyTree, SimState, format_hparams
from scaffold_jax.versions import (  # noqa: F401  (accept_new_versions: the loop's API too)
    accept_new_versions,
    check_versions,
    library_versions,
)

Record = dict[str, Any]


# ----------------------------------------------------------------------------- results
@dataclasses.dataclass
class RunResult:
    """What :func:`run` returns (or attaches to the exception it raises).

    Attributes:
      state: the final :class:`SimState`.
      records: one dict per evaluation (round, test/train metrics, elapsed seconds). After
        ``resume=True`` it starts with the records restored from the checkpoint.
      client_ids: ``[R, S]`` int32, the clients sampled in every round run by THIS call
        (audit and replay); after a resume the first row is round ``resumed_from``. −1
        marks an empty slot of a varying cohort (Poisson sampling, too few available).
      reported: ``[R, S]`` bool, which of them reported their update: False for an empty
        slot and for a client that dropped out (``dropouts``) after being sampled.
      round_metrics: per-round metrics of the rounds run by this call, each ``[R]``.
      compile_seconds: time spent compiling the round program and the evaluation (once
        per call: one program runs every block, whatever the cadence).
      run_seconds: wall time of the rounds and evaluations after compilation (checkpoint
        writing excluded); :attr:`round_seconds` and ``eval_seconds`` split it.
      status: ``"finished"`` for a returned result; ``"diverged"`` on the result carried
        by a :class:`DivergenceError`; ``"interrupted"`` on the result carried (as
        ``.result``) by the ``KeyboardInterrupt`` or :class:`RunTerminated` raised on
        SIGINT / SIGTERM.
      resumed_from: the round of the checkpoint this call resumed from, else None.
      checkpoint_seconds: wall time spent writing checkpoints.
      eval_seconds: wall time of the evaluations (included in ``run_seconds``).
    """

    state: SimState
    records: list[dict[str, Any]]
    client_ids: np.ndarray
    round_metrics: dict[str, np.ndarray]
    compile_seconds: float
    run_seconds: float
    status: str = "finished"
    resumed_from: int | None = None
    checkpoint_seconds: float = 0.0
    eval_seconds: float = 0.0
    reported: np.ndarray | None = None

    def __post_init__(self):
        if self.reported is None:  # no dropouts: every sampled client reported
            self.reported = np.asarray(self.client_ids) >= 0

    @property
    def round_seconds(self) -> float:
        """Wall time of the rounds alone (``run_seconds − eval_seconds``)."""
        return self.run_seconds - self.eval_seconds

    def final(self, name: str) -> float:
        return float(self.records[-1][name])


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
        leading ``[num_rounds]`` axis, whose first ``n`` rows are the rounds run)."""

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

    Raises:
      DivergenceError, KeyboardInterrupt, RunTerminated: see the module docstring.
    """
    if phase is None:
        phase = lambda text: contextlib.nullcontext()
    records: list[Record] = []
    pending: dict[str, Any] = {}  # a checkpoint's round metrics since its last evaluation
    resumed_from = None
    seconds_before = 0.0  # run time spent by the process(es) before a resume
    if resume_into is not None:
        restored = checkpointer.restore_latest(resume_into)
        check_same_run(restored.extra.get("identity"), identity, str(restored.path))
        state, key, resumed_from = restored.state, restored.key, restored.round
        records = list(restored.extra.get("records", []))
        pending = restored.extra.get("pending", {})
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
        # losses) and the client drift (mean ‖y_i − x‖).
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
        run_seconds = time.perf_counter() - run_start
        return finish(
            Outcome(
                state=state,
                records=records,
                metrics=block_metrics,
                compile_seconds=compile_seconds,
                run_seconds=run_seconds - checkpoint_seconds,
                eval_seconds=eval_seconds,
                checkpoint_seconds=checkpoint_seconds,
                status=status,
                resumed_from=resumed_from,
            )
        )

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
#: clip norm and the fraction of its clients clipped).
RECORDED_ROUND_METRICS = (
    "local_loss", "client_drift", "participants", "available", "dropped", "steps_taken",
    "dp_clip_norm", "dp_clipped_fraction",
)  # fmt: skip


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


# ----------------------------------------------------------------------------- identity
def run_identity(
    simulation: engine.Simulation,
    data,
    hparams: HParams,
    seed: int,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """What fixes a single run's trajectory; a resumed run must agree on all of it: the
    algorithm and the options it was built with, the data (N and a fingerprint of its
    arrays: ``fingerprint`` if the caller has it), plan, S, weighting, sampler, the
    participation models, the hyper-parameters and the seed.

    ``hparams`` holds exactly the algorithm's declared hyper-parameters (resolved)."""
    identity = {
        "versions": library_versions(),
        "algorithm": simulation.algorithm.name,
        "algorithm_options": dict(simulation.algorithm.options),
        "data_fingerprint": fingerprint or data_fingerprint(data),
        "num_clients": int(data.num_clients),
        "clients_per_round": simulation.clients_per_round,
        "weighting": simulation.weighting,
        "plan": repr(simulation.plan),
        "seed": int(seed),
        "hparams": {k: np.asarray(v).tolist() for k, v in hparams.items()},
    }
    if simulation.weighting_options:  # only then: identities of earlier runs resume
        identity["weighting_options"] = simulation.weighting_options
    if simulation.sampler is not uniform:
        # Only another sampler is named: identities written before samplers existed resume.
        identity["sampler"] = _describe(simulation.sampler)
    if simulation.participation.describe():  # only then, as for the sampler
        identity["participation"] = {
            kind: repr(model) for kind, model in simulation.participation._asdict().items()
        }
    return json.loads(json.dumps(identity))  # the form it has after a JSON round trip


def _describe(fn) -> str:
    """A sampler as ``module.name(keyword=value, ...)``, a ``functools.partial`` unwrapped
    (what :func:`scaffold_jax.sampling.make` returns)."""
    keywords = getattr(fn, "keywords", {})
    fn = getattr(fn, "func", fn)
    args = ", ".join(f"{k}={v!r}" for k, v in sorted(keywords.items()))
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}({args})"


def check_same_run(saved: dict[str, Any] | None, current: Mapping[str, Any], where: str) -> None:
    """Raises ValueError naming every difference between two run identities."""
    if saved is None or current is None:
        return  # written by checkpoint.save() directly: nothing to compare

    def show(key, value):
        if key == "hparams" and isinstance(value, dict):
            return f"({format_hparams(value)})"
        return repr(value)

    diffs = [
        f"{k}: {show(k, saved.get(k))} in the checkpoint, {show(k, v)} now"
        for k, v in current.items()
        if k != "versions" and saved.get(k) != v
    ]
    if diffs:
        raise ConfigError(
            f"cannot resume from {where}: it belongs to a different run ({'; '.join(diffs)}). "
            "Resume with the same algorithm, data, batch plan, S, weighting, hparams and "
            "seed, or start a new run in another checkpoint directory."
        )
    check_versions(saved, where)


# ----------------------------------------------------------------------------- single runs
class _SingleRun:
    """A :class:`Task` for one run of a :class:`Simulation`: divergence policy ``raise``."""

    def __init__(self, simulation: engine.Simulation, data, hparams: HParams):
        self.simulation, self.data, self.hparams = simulation, data, hparams

    def compile_block(self, state, key, num_rounds):
        sim, data, hp = self.simulation, self.data, self.hparams
        stop = np.int32(num_rounds)
        program = sim.run_rounds.lower(
            hp, state, data, key, num_rounds=num_rounds, stop=stop
        ).compile()
        return lambda state, key, n: program(hp, state, data, key, stop=np.int32(n))

    def compile_evaluate(self, state):
        program = self.simulation.evaluate.lower(state.server, self.data, state.model).compile()
        return lambda state: program(state.server, self.data, state.model)

    def round_of(self, state):
        return int(state.round)

    def records(self, state, metrics, round, seconds):
        del state
        entry = {"round": int(round), **{k: float(v) for k, v in metrics.items()}}
        entry.update(self.simulation.report(self.hparams, round, self.data.num_clients))
        entry["seconds"] = seconds
        return [entry]

    def check(self, state, metrics, first, last):
        # The engine reports, per round, whether the round's new server state is finite:
        # the block's last entry is the state now, so no second pass over it is needed.
        finite = np.asarray(metrics["server_finite"], bool)
        if finite[-1]:
            return
        # The round counted is the first whose NEW SERVER STATE is non-finite, whatever the
        # length of the block checked (the update norm squares the update, so it overflows
        # rounds before the state does).
        bad = np.flatnonzero(~finite)
        diverged_round = first + int(bad[0]) + 1
        where = (
            ""
            if diverged_round == last
            else f" (The state is checked after each block of rounds, {first + 1}..{last} "
            f"here; round {diverged_round} is the first whose new server state held NaN/Inf.)"
        )
        raise Diverged(
            f"{self.simulation.algorithm.name} diverged: the server state holds NaN/Inf after "
            f"round {last} (the first non-finite update came from round {diverged_round}) "
            f"with {format_hparams(self.hparams)}. Lower client_lr or server_lr.{where}",
            diverged_round,
        )


def run(
    simulation: engine.Simulation,
    data,
    hparams: HParams | Mapping[str, Any],
    num_rounds: int,
    eval_every: int | None = None,
    seed: int = 0,
    state: SimState | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    resume: bool = False,
    identity: Mapping[str, Any] | None = None,
    on_restore: Callable[[list[Record]], None] | None = None,
    checkpoint_seconds: float | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> RunResult:
    """Runs ``num_rounds`` rounds of ``simulation``, evaluating at the start and every
    ``eval_every`` rounds (schedule, resume, signals: see the module docstring).

    The root key is ``jax.random.key(seed)``; round r uses ``fold_in(root, r)``, so a run
    resumed from a state at round r continues exactly as an uninterrupted one. To resume,
    pass the arguments of the interrupted call unchanged: ``num_rounds`` still counts from
    r0, and ``callback`` sees only the new records. A record is handed to ``callback``
    once the checkpoint of its round (if one is due) is written, so with a checkpoint at
    every evaluation (``checkpoint_every=eval_every``) no record is ever handed over twice,
    even across a crash; with a sparser cadence, the default's included, the records after
    the newest checkpoint are made again on resume (``on_restore`` gets the ones the
    checkpoint holds: a sink that persists records rewrites its copy with them). The data
    and the state are placed in the simulation's layout first.

    Divergence. After every block the server state is checked; NaN or Inf stops the run
    with :class:`DivergenceError` (a ``ValueError``) naming the round, the algorithm and
    the hyper-parameters, and carrying the result so far (``status="diverged"``). We raise
    rather than return: a single run that diverged is almost always a mistake to be seen,
    and a grid search can catch it and read ``err.result`` (sweeps freeze diverged configs
    instead, see :mod:`scaffold_jax.sweep`). The diverged state is never checkpointed.

    Args:
      simulation: the :class:`~scaffold_jax.engine.Simulation`.
      data: a federated dataset (:class:`~scaffold_jax.data.FederatedData` or a
        procedural one).
      hparams: :class:`HParams` or a mapping; names the algorithm does not declare are
        refused, declared ones not given take their defaults.
      num_rounds: rounds to run from r0 (>= 1).
      eval_every: evaluation period E in rounds (default: ``num_rounds``).
      seed: the root seed.
      state: a state to continue from (default: a fresh one). It is donated. Not with
        ``resume=True``.
      callback: called with each evaluation record as it is made.
      checkpoint_dir: where to save checkpoints (see :mod:`scaffold_jax.checkpoint`).
        Without ``resume`` it must not hold checkpoints already.
      checkpoint_every: checkpoint period in rounds (default: the adaptive cadence, at
        evaluations and within :data:`CHECKPOINT_SHARE` of the run's time; see the module
        docstring).
      keep_checkpoints: how many of the newest checkpoints to keep.
      resume: continue from the newest checkpoint in ``checkpoint_dir``.
      identity: more of what fixes the run (e.g. the command line's data source and
        partition), compared on resume beside :func:`run_identity`'s.
      on_restore, checkpoint_seconds, phase: see :func:`drive`.

    Returns:
      A :class:`RunResult` with ``status="finished"``.

    Raises:
      ValueError: bad arguments, data that do not fit, a checkpoint directory already
        in use, or a checkpoint of another run.
      FileNotFoundError: ``resume=True`` and no checkpoint in ``checkpoint_dir``.
      scaffold_jax.checkpoint.CheckpointError: every checkpoint there is corrupt.
      DivergenceError: the server state became NaN or Inf.
      KeyboardInterrupt: SIGINT (after the current block and its checkpoint).
      RunTerminated: SIGTERM (after the current block and its checkpoint).
    """
    num_rounds = check_count("num_rounds", num_rounds, maximum=MAX_ROUNDS, why=ROUNDS_WHY)
    eval_every = check_count("eval_every", num_rounds if eval_every is None else eval_every)
    seed = check_count("seed", seed, minimum=0, maximum=MAX_SEED, why=SEED_WHY)
    hparams = simulation.resolve_hparams(hparams)
    for name, value in hparams.items():
        if np.ndim(value) != 0:
            raise ValueError(
                f"hparams.{name} has shape {np.shape(value)}: Simulation.run takes scalar "
                "hyper-parameters; use scaffold_jax.sweep to run a grid of them."
            )
    if checkpoint_dir is None:
        if resume:
            raise ValueError("resume=True needs the checkpoint_dir to resume from.")
        if checkpoint_every is not None:
            raise ValueError(
                f"checkpoint_every = {checkpoint_every} was given without a checkpoint_dir "
                "to save in."
            )
    else:
        if checkpoint_every is not None:
            checkpoint_every = check_count("checkpoint_every", checkpoint_every)
        keep_checkpoints = check_count("keep_checkpoints", keep_checkpoints)
    if resume and state is not None:
        raise ValueError(
            "pass either state= (continue from a state in memory) or resume=True "
            "(continue from the checkpoint), not both."
        )

    simulation.check(data)
    if checkpoint_dir is not None:  # only a checkpoint carries it (the fingerprint costs)
        identity = dict(identity or {})
        identity = {
            **run_identity(simulation, data, hparams, seed, identity.get("data_fingerprint")),
            **identity,
        }
        identity = json.loads(json.dumps(identity))
    layout = simulation.layout
    data = layout.place_data(data)
    if not resume:
        state = simulation.init(data) if state is None else layout.place_state(state)
    task = _SingleRun(simulation, data, hparams)

    def finish(out: Outcome) -> RunResult:
        if out.metrics:
            metrics = {k: np.concatenate([m[k] for m in out.metrics]) for k in out.metrics[0]}
            client_ids = metrics.pop("client_ids")
            reported = metrics.pop("reported", None)
        else:
            reported = None
            metrics = {}
            client_ids = np.zeros((0, simulation.clients_per_round), np.int32)
        return RunResult(
            state=out.state,
            records=out.records,
            client_ids=client_ids,
            reported=reported,
            round_metrics=metrics,
            compile_seconds=out.compile_seconds,
            run_seconds=out.run_seconds,
            status=out.status,
            resumed_from=out.resumed_from,
            checkpoint_seconds=out.checkpoint_seconds,
            eval_seconds=out.eval_seconds,
        )

    checkpointer = None
    if checkpoint_dir is not None:
        from scaffold_jax.checkpoint import Checkpointer  # imported late: orbax is slow to import

        checkpointer = Checkpointer(checkpoint_dir, max_to_keep=keep_checkpoints)
    try:
        return drive(
            task,
            state,
            jr.key(seed),
            num_rounds,
            eval_every,
            finish,
            callback=callback,
            checkpointer=checkpointer,
            checkpoint_every=checkpoint_every,
            identity=identity,
            resume_into=simulation.state_like(data.num_clients) if resume else None,
            on_restore=on_restore,
            checkpoint_seconds=checkpoint_seconds,
            phase=phase,
        )
    finally:
        if checkpointer is not None:
            checkpointer.close()


class Simulation(engine.Simulation):
    """:class:`scaffold_jax.engine.Simulation` (the compiled programs, same arguments)
    with :meth:`run`, the host loop: what ``scaffold_jax.Simulation`` is."""

    def run(self, data, hparams: HParams | Mapping[str, Any], num_rounds: int, *args, **kwargs):
        """Runs the simulation in the host loop: :func:`run` ``(self, data, hparams,
        num_rounds, ...)``, with the same arguments (``eval_every``, ``seed``, ``state``,
        ``callback``, ``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints``,
        ``resume``, ...); see there for the schedule, checkpoints and resume, signals and
        divergence.

        Returns:
          A :class:`RunResult`.
        """
        return run(self, data, hparams, num_rounds, *args, **kwargs)
