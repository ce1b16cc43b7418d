"""Single runs in the host loop: :func:`run` drives one :class:`Simulation`'s compiled
rounds through :func:`~scaffold_jax.loop.drive` with the divergence policy ``raise``, and
:class:`Simulation` is the engine's with :meth:`~Simulation.run`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.random as jr
import numpy as np

from scaffold_jax import engine
from scaffold_jax.engine import (
    MAX_ROUNDS,
    MAX_SEED,
    ROUNDS_WHY,
    SEED_WHY,
    buffered,
    check_count,
    check_rounds_fit,
    communication,
    inflight,
)
from scaffold_jax.loop.driver import (
    Diverged,
    Outcome,
    Record,
    carried_totals,
    drive,
    remember_totals,
)
from scaffold_jax.loop.identity import run_identity
from scaffold_jax.types import HParams, SimState, format_hparams


@dataclasses.dataclass
class RunResult:
    """What :func:`run` returns (or attaches to the exception it raises).

    Attributes:
      state: the final :class:`SimState`.
      records: one dict per evaluation (round, test/train metrics, elapsed seconds). After
        ``resume=True`` it starts with the records restored from the checkpoint. Their
        running totals (``bytes_down_total``, ``bytes_up_total``, ``virtual_time``) count
        from the state's round 0, the first record's included: a run continuing a state
        (``state=``) or a checkpoint continues them. A fresh FedBuff run's round-0 record
        also names the M clients started at time 0 (``started_ids``).
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
      clients: the newest evaluation of every evaluated client on its own test data
        (data with client test examples): ``[E]`` arrays ``client``, ``n_train``,
        ``n_test``, ``global`` (x's accuracy) and ``personal`` (p_i's), what
        ``personal.csv`` holds; None without client test data.
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
    clients: dict[str, np.ndarray] | None = None

    def __post_init__(self):
        if self.reported is None:  # no dropouts: every sampled client reported
            self.reported = np.asarray(self.client_ids) >= 0

    @property
    def round_seconds(self) -> float:
        """Wall time of the rounds alone (``run_seconds − eval_seconds``)."""
        return self.run_seconds - self.eval_seconds

    def final(self, name: str) -> float:
        return float(self.records[-1][name])


class _SingleRun:
    """A :class:`~scaffold_jax.loop.Task` for one run of a :class:`Simulation`:
    divergence policy ``raise``."""

    def __init__(self, simulation: engine.Simulation, data, hparams: HParams, key: jax.Array):
        self.simulation, self.data, self.hparams = simulation, data, hparams
        self.traffic = None  # bytes per client (engine.communication), at the first record
        self.key = key
        self.per_client = None  # the newest per-client evaluation (personal.csv)

    def compile_block(self, state, key, num_rounds):
        sim, data, hp = self.simulation, self.data, self.hparams
        stop = np.int32(num_rounds)
        program = sim.run_rounds.lower(
            hp, state, data, key, num_rounds=num_rounds, stop=stop
        ).compile()
        return lambda state, key, n: program(hp, state, data, key, stop=np.int32(n))

    def compile_evaluate(self, state):
        sim, data, hp, key = self.simulation, self.data, self.hparams, self.key
        program = sim.evaluate.lower(state.server, data, state.model).compile()
        if not sim.evaluates_clients(data):
            return lambda state: program(state.server, data, state.model)
        clients = sim.evaluate_clients.lower(hp, state, data, key).compile()

        def evaluate(state):
            # Every client's own model on its own test data; the per-client numbers of
            # the newest evaluation stay on the device for personal.csv.
            metrics, self.per_client = clients(hp, state, data, key)
            return {**program(state.server, data, state.model), **metrics}

        return evaluate

    def round_of(self, state):
        return int(state.round)

    def records(self, state, metrics, round, seconds):
        del state
        entry = {"round": int(round), **{k: float(v) for k, v in metrics.items()}}
        if self.traffic is None:
            sim = self.simulation
            hparams = {k: float(v) for k, v in jax.device_get(dict(self.hparams)).items()}
            self.traffic = communication.traffic(sim.algorithm, sim.problem.params, hparams)
        communication.with_bytes(entry, self.traffic)
        entry.update(self.simulation.report(self.hparams, round, self.data.num_clients))
        execution = self.simulation.execution
        if execution is not None and round == 0:
            # FedBuff's first step starts M clients at time 0 besides its B replacements:
            # the start's own started_ids, so the record says who trained when.
            entry["started_ids"] = buffered.first_clients(
                self.simulation.participation, self.key, self.data.num_clients,
                execution.concurrency,
            )  # fmt: skip
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
    keep_checkpoints: int = 1,
    resume: bool = False,
    identity: Mapping[str, Any] | None = None,
    on_restore: Callable[[list[Record]], None] | None = None,
    checkpoint_seconds: float | None = None,
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> RunResult:
    """Runs ``num_rounds`` rounds of ``simulation``, evaluating at the start and every
    ``eval_every`` rounds (schedule, resume, signals: see :mod:`scaffold_jax.loop.driver`).

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
        ``resume=True``. The records' running totals continue the state's: those a run
        kept for the state it returned, else what a FedBuff state says itself, else
        (a state made otherwise, past round 0) they count from this call.
      callback: called with each evaluation record as it is made.
      checkpoint_dir: where to save checkpoints (see :mod:`scaffold_jax.checkpoint`).
        Without ``resume`` it must not hold checkpoints already.
      checkpoint_every: checkpoint period in rounds (default: the adaptive cadence, at
        evaluations and within :data:`~scaffold_jax.loop.CHECKPOINT_SHARE` of the run's
        time; see :mod:`scaffold_jax.loop.driver`).
      keep_checkpoints: how many of the newest checkpoints a finished run leaves (default
        1: its final state, all that a resume with more rounds needs). While it runs,
        at least the newest two are kept, so that a corrupt newest one falls back.
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
    check_rounds_fit(simulation, num_rounds)
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
        identity = run_identity(simulation, data, hparams, seed, more=identity)
    layout = simulation.layout
    data = layout.place_data(data)
    totals = None
    if state is not None:  # looked up by the state's own arrays, before placing them
        totals = carried_totals(state.round, int(state.round))
        if totals is None and simulation.execution is not None:
            totals = inflight.running_totals(simulation.execution, state)
    if not resume:
        state = simulation.init(data) if state is None else layout.place_state(state)
    key = jr.key(seed)
    task = _SingleRun(simulation, data, hparams, key)

    def finish(out: Outcome) -> RunResult:
        if out.metrics:
            metrics = {k: np.concatenate([m[k] for m in out.metrics]) for k in out.metrics[0]}
            client_ids, reported = metrics.pop("client_ids"), metrics.pop("reported", None)
        else:
            metrics, reported = {}, None
            client_ids = np.zeros((0, simulation.clients_per_round), np.int32)
        # The totals go with the state, for a run that continues it (state=).
        remember_totals(out.state.round, int(out.state.round), out.totals)
        rest = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
        del rest["metrics"], rest["totals"]  # per block: concatenated above; kept above
        clients = None if task.per_client is None else jax.device_get(task.per_client)
        return RunResult(
            **rest, client_ids=client_ids, reported=reported, round_metrics=metrics,
            clients=clients,
        )  # fmt: skip

    opened = contextlib.nullcontext()
    if checkpoint_dir is not None:
        from scaffold_jax.checkpoint import Checkpointer  # imported late: orbax is slow to import

        # Two while running: a corrupt newest checkpoint falls back to the one before.
        opened = Checkpointer(checkpoint_dir, max_to_keep=max(2, keep_checkpoints))
    with opened as checkpointer:
        result = drive(
            task, state, key, num_rounds, eval_every, finish, callback=callback,
            checkpointer=checkpointer, checkpoint_every=checkpoint_every, identity=identity,
            resume_into=simulation.state_like(data.num_clients) if resume else None,
            on_restore=on_restore, checkpoint_seconds=checkpoint_seconds, phase=phase,
            totals=totals,
        )  # fmt: skip
        if checkpointer is not None and result.status == "finished":
            checkpointer.keep_newest(keep_checkpoints)
        return result


class Simulation(engine.Simulation):
    """:class:`scaffold_jax.engine.Simulation` (the compiled programs, same arguments)
    with :meth:`run`, the host loop: what ``scaffold_jax.Simulation`` is."""

    def run(self, data, hparams: HParams | Mapping[str, Any], num_rounds: int, *args, **kwargs):
        """Runs the simulation in the host loop: :func:`run` ``(self, data, hparams,
        num_rounds, ...)`` with the same arguments (``eval_every``, ``seed``, ``state``,
        ``callback``, ``checkpoint_dir``, ``resume``...), which returns a :class:`RunResult`;
        see there for the schedule, checkpoints and resume, signals and divergence."""
        return run(self, data, hparams, num_rounds, *args, **kwargs)
