"""A sweep's host half, which ``scaffold_jax.sweep`` offers too: :meth:`Sweep.run` cuts a
grid of configs into chunks that fit in memory and drives each chunk's vmapped program
(:mod:`scaffold_jax.sweep`) through :func:`~scaffold_jax.loop.drive` (divergence policy
``freeze``), with checkpoints and resume; :class:`SweepResult` gathers the results."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.data.federated import data_fingerprint
from scaffold_jax.engine import (
    MAX_ROUNDS,
    ROUNDS_WHY,
    Simulation,
    check_count,
    check_rounds_fit,
    communication,
)
from scaffold_jax.loop.driver import drive
from scaffold_jax.loop.identity import run_identity
from scaffold_jax.resources import choose_chunk_size, chunk_shape
from scaffold_jax.sweep import Sweep as _Program
from scaffold_jax.sweep import SweepCarry, check_seeds, config_bytes
from scaffold_jax.types import HParams, PyTree


def _check_timed_sizes(sim, host: dict[str, list[float]], seeds) -> None:
    """Refuses a synchronous sweep whose configs of one seed send uplinks of different
    sizes (a compressor's bits or fraction varied) under the virtual clock: the configs of
    a seed share the round's cohort, so its clock times one size."""
    if sim.execution is not None or sim.participation.profiles is None:
        return
    if getattr(sim.algorithm.messages, "sizes", None) is None:
        return
    sizes: dict[int, set[int]] = {}
    for j, seed in enumerate(np.asarray(seeds).tolist()):
        values = {k: v[j] for k, v in host.items()}
        up = communication.traffic(sim.algorithm, sim.problem.params, values).up
        sizes.setdefault(seed, set()).add(up)
    varied = [seed for seed, ups in sizes.items() if len(ups) > 1]
    if varied:
        raise ValueError(
            f"this sweep varies the compressed uplink's size (bytes {sorted(sizes[varied[0]])}) "
            f"among the configs of seed {varied[0]}, but under the virtual clock (profiles) the "
            "configs of a seed share the round's cohort and its clock: sweep the compressor's "
            "values as separate runs (or separate sweeps), or give each value its own seed."
        )


@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` returns: per-config results in the single-run record format.

    Attributes:
      algorithm: the algorithm's name.
      configs: one dict per config (``client_lr``, ``server_lr``, ``prox_mu``, ``seed``).
      records: per config, one dict per evaluation with the keys of
        :attr:`~scaffold_jax.loop.RunResult.records` (``round``, ``test_loss``,
        ``test_accuracy``, ``train_loss``, ``seconds``) plus ``status`` (``"ok"`` or
        ``"diverged"``) and ``config``. Metrics of a diverged config are NaN.
      diverged_round: int ``[C]``, the round that produced a NaN/Inf, −1 if none.
      server_states: the final server states, numpy leaves ``[C, ...]`` (a diverged config
        keeps its last finite state).
      client_states: the final client tables ``[C, N, ...]`` (numpy) when asked for with
        ``keep_client_states=True``, else None.
      model_states: the final running statistics of a model that keeps them
        (``SimState.model``, leaves ``[C, ...]``; a per-client table only with
        ``keep_client_states=True``), else None.
      client_ids: int32 ``[C, R, S]``, the clients sampled in every round (−1 once diverged,
        and for a varying cohort's empty slots).
      reported: bool ``[C, R, S]``, which of them reported (False for a client that dropped
        out, an empty slot, or once diverged).
      round_metrics: per-round metrics, each ``[C, R]`` (NaN once diverged).
      compile_seconds: compiling the round program(s) and the evaluation.
      run_seconds: wall time of all chunks after compilation.
      eval_seconds: the part of ``run_seconds`` spent evaluating.
      chunk_size: configs per chunk (``g × m``); chunk_shape: ``(g, m)``, seeds × configs
        per seed (see :class:`Sweep`); num_chunks: how many chunks ran.
      bytes_per_config: the estimate the chunk size was chosen from.
      targets: accuracy targets given to :func:`sweep` (:func:`scaffold_jax.results.sweep_rows`
        reports the rounds to each).

    A record's ``seconds`` counts from the start of its chunk, compilation excluded.
    """

    algorithm: str
    configs: list[dict[str, Any]]
    records: list[list[dict[str, Any]]]
    diverged_round: np.ndarray
    server_states: PyTree = None
    client_states: PyTree = None
    model_states: PyTree = None
    client_ids: np.ndarray | None = None
    reported: np.ndarray | None = None
    round_metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    eval_seconds: float = 0.0
    chunk_size: int = 0
    chunk_shape: tuple[int, int] = (0, 0)
    num_chunks: int = 0
    bytes_per_config: int = 0
    targets: tuple[float, ...] = ()

    @property
    def num_configs(self) -> int:
        return len(self.configs)

    @property
    def diverged(self) -> np.ndarray:
        """bool ``[C]``."""
        return np.asarray(self.diverged_round) >= 0

    def final(self, name: str) -> np.ndarray:
        """The last record's ``name`` for every config, float64 ``[C]``."""
        return np.asarray([float(r[-1].get(name, np.nan)) for r in self.records])


class Sweep(_Program):
    """The vmapped programs of a sweep (:mod:`scaffold_jax.sweep`) with :meth:`run`, the
    host loop: what ``scaffold_jax.sweep.Sweep`` is, as ``scaffold_jax.Simulation`` is the
    engine's with ``run``."""

    def run(
        self,
        data,
        grid: HParams,
        seeds: Sequence[int] | np.ndarray,
        num_rounds: int,
        eval_every: int | None = None,
        targets: Sequence[float] = (),
        configs: Sequence[Mapping[str, Any]] | None = None,
        max_configs_per_chunk: int | None = None,
        memory_budget_bytes: int | None = None,
        keep_client_states: bool = False,
        callback: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        checkpoint_seconds: float | None = None,
        resume: bool = False,
        phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
        progress: Callable[[float], None] | None = None,
        identity: Mapping[str, Any] | None = None,
        keep_checkpoints: int = 1,
    ) -> SweepResult:
        """Runs every config (``grid[j]``, ``seeds[j]``) for ``num_rounds`` rounds.

        Evaluates at round 0 and every ``eval_every`` rounds, as a single run does; the
        rounds in between are ONE compiled program for the whole chunk of configs. Only
        the program's length (``eval_every`` and a possible shorter last segment) and the
        chunk shape fix its shape.

        Args:
          data: the federated dataset, shared by all configs.
          grid: an :class:`HParams` whose leaves are ``[C]`` (scalars are broadcast;
            declared hyper-parameters not in it take their defaults).
          seeds: ``[C]`` non-negative root seeds; config j uses ``jax.random.key(seeds[j])``.
          num_rounds: R >= 1.
          eval_every: evaluation period (default R).
          targets: accuracy targets recorded in the result (see
            :func:`scaffold_jax.results.sweep_rows`).
          configs: one dict per config whose entries are added to the config's record of
            its hyper-parameters and seed (labels).
          max_configs_per_chunk: cap on configs run at once.
          memory_budget_bytes: device bytes a chunk may use (default: half of the free
            memory; see :mod:`scaffold_jax.sweep`).
          keep_client_states: also return the final client tables (host memory C × table).
          callback: a record sink called with every record as it is made (each carries
            its ``config`` and ``config_index``), e.g. a run writer's.
          checkpoint_dir: checkpoint every chunk into ``<checkpoint_dir>/chunk-<i>``
            (the loop's checkpoints: every ``checkpoint_every`` rounds, default the
            loop's adaptive cadence at evaluations, and after ``checkpoint_seconds`` of
            wall time), so that ``resume=True`` continues the sweep: a finished chunk is
            read back, an unfinished one continues from its newest checkpoint bit for bit,
            and its restored records are handed to ``callback`` again (so a sink that
            dropped the unfinished records has each exactly once). After a resume, the
            per-round metrics of rounds run before the checkpoint are not kept: NaN
            (client ids −1).
          phase: wraps each compilation (see :func:`scaffold_jax.loop.drive`).
          progress: called after each evaluation with the fraction of the sweep done, in
            [0, 1] (chunks run one after the other, each for every round).
          identity: more of what fixes the sweep's results (the data's fingerprint, the
            model...), checked on resume beside the chunk's own
            (:func:`~scaffold_jax.loop.run_identity` with the chunk's configs).
          keep_checkpoints: how many of the newest checkpoints each finished chunk leaves
            (default 1: its final state, all that a resume or an extension needs; while
            a chunk runs, at least two are kept).

        Raises:
          ValueError: invalid rounds, hyper-parameters, seeds or data.
        """
        sim = self.simulation
        num_rounds = check_count("num_rounds", num_rounds, maximum=MAX_ROUNDS, why=ROUNDS_WHY)
        check_rounds_fit(sim, num_rounds)  # one config's; chunks of configs fit the rest
        eval_every = check_count("eval_every", num_rounds if eval_every is None else eval_every)
        keep_checkpoints = check_count("keep_checkpoints", keep_checkpoints)
        num_configs = int(np.shape(seeds)[0]) if np.ndim(seeds) else 0
        if num_configs < 1:
            raise ValueError("a sweep needs at least one config: seeds is empty or a scalar.")
        seeds = check_seeds(seeds, num_configs)
        grid = self.resolve_grid(grid, num_configs)
        sim.check(data)
        if configs is not None and len(configs) != num_configs:
            raise ValueError(f"configs has {len(configs)} entries for {num_configs} configs.")
        # str() of a float32 is its shortest round-trip decimal: 0.1, not 0.10000000149.
        host = {name: [float(str(v)) for v in np.asarray(value)] for name, value in grid.items()}
        labels = [{}] * num_configs if configs is None else [dict(c) for c in configs]
        configs = [
            {**{k: v[j] for k, v in host.items()}, "seed": int(seeds[j]), **labels[j]}
            for j in range(num_configs)
        ]

        _check_timed_sizes(sim, host, seeds)
        if checkpoint_dir is not None and "data_fingerprint" not in (identity or {}):
            # Once for every chunk: a resume onto other data is refused.
            identity = {**dict(identity or {}), "data_fingerprint": data_fingerprint(data)}
        group_seeds, slots, real = _layout(seeds)
        num_seeds, group_size = slots.shape
        per_config = config_bytes(sim, data)
        cap = choose_chunk_size(num_configs, per_config, memory_budget_bytes, max_configs_per_chunk)
        g, m = chunk_shape(num_seeds, group_size, cap)

        result = SweepResult(
            algorithm=sim.algorithm.name, configs=configs, records=[[] for _ in configs],
            diverged_round=np.full((num_configs,), -1, np.int64), chunk_size=g * m,
            chunk_shape=(g, m), num_chunks=math.ceil(num_seeds / g) * math.ceil(group_size / m),
            bytes_per_config=per_config, targets=tuple(float(t) for t in targets),
        )  # fmt: skip
        done: dict[int, Any] = {}  # per config, what its chunk's finish made
        starts = [(g0, m0) for g0 in range(0, num_seeds, g) for m0 in range(0, group_size, m)]
        for i, (g0, m0) in enumerate(starts):
            # Out-of-range slots repeat the last seed / config: every chunk has the same
            # shape, so the program compiles once; those copies' results are dropped.
            rows, cols = np.arange(g0, g0 + g), np.arange(m0, m0 + m)
            valid = (rows < num_seeds)[:, None] & (cols < group_size)[None, :]
            rows, cols = np.minimum(rows, num_seeds - 1), np.minimum(cols, group_size - 1)
            valid &= real[np.ix_(rows, cols)]
            index = slots[np.ix_(rows, cols)]
            keys = jnp.stack([jr.key(int(s)) for s in group_seeds[rows]])
            chunk = _Chunk(
                self, data, grid, index, valid, result, keep_client_states, num_rounds, keys
            )
            on_block = None
            if progress is not None:

                def on_block(r, c=i, total=result.num_chunks):
                    progress((c + min(r / num_rounds, 1.0)) / total)

            done |= chunk.run(
                self.init(data, *index.shape), eval_every, callback,
                None if checkpoint_dir is None else Path(checkpoint_dir) / f"chunk-{i}",
                resume, identity, keep_checkpoints, checkpoint_every=checkpoint_every,
                checkpoint_seconds=checkpoint_seconds, phase=phase, on_block=on_block,
            )  # fmt: skip
        outputs = [done[j] for j in range(num_configs)]

        def stack(trees):
            return jax.tree.map(lambda *a: np.stack(a), *trees)

        result.server_states = stack([o["server"] for o in outputs])
        if keep_client_states:
            result.client_states = stack([o["clients"] for o in outputs])
        if outputs[0]["model"] is not None:
            result.model_states = stack([o["model"] for o in outputs])
        result.client_ids = np.stack([o["client_ids"] for o in outputs])
        result.round_metrics = {
            k: np.stack([o["metrics"][k] for o in outputs]) for k in outputs[0]["metrics"]
        }
        reported = result.round_metrics.pop("reported", None)
        result.reported = result.client_ids >= 0 if reported is None else reported
        return result


class _Chunk:
    """The loop's :class:`~scaffold_jax.loop.Task` for one ``[g, m]`` chunk of a sweep
    (``index``: config ids; ``valid``: the slots whose results are kept). Its divergence
    policy is ``freeze``, inside the compiled round; :meth:`check` never stops."""

    def __init__(
        self, sweep: Sweep, data, grid, index, valid, result, keep_clients, num_rounds, keys
    ):
        self.sweep, self.data, self.result, self.keep_clients = sweep, data, result, keep_clients
        self.num_rounds, self.keys = num_rounds, keys
        self.hparams = jax.tree.map(lambda a: a[jnp.asarray(index)], grid)
        self.slots = [(a, b, int(index[a, b])) for a, b in zip(*np.nonzero(valid), strict=True)]
        self._hparams_on_host = None
        self._traffic_of: dict[tuple, communication.Traffic] = {}

    def run(self, carry, eval_every, callback, directory, resume, identity, keep, **options):
        """Drives the chunk from ``carry`` (or, with ``resume``, from its newest checkpoint in
        ``directory``, if any), checkpointing into ``directory`` unless it is None and
        leaving its ``keep`` newest checkpoints once finished; ``options``:
        :func:`~scaffold_jax.loop.drive`'s. Returns :meth:`finish`'s outputs."""
        args = (self.keys, self.num_rounds, eval_every, self.finish)
        if directory is None:
            return drive(self, carry, *args, callback=callback, **options)
        from scaffold_jax.checkpoint import Checkpointer  # imported late: orbax is slow to import

        configs = [self.result.configs[j] for _, _, j in self.slots]
        identity = run_identity(self.sweep.simulation, self.data, configs=configs, more=identity)
        # Two while running: a corrupt newest checkpoint falls back to the one before.
        with Checkpointer(directory, max_to_keep=max(2, keep)) as checkpointer:
            restore = resume and checkpointer.latest_round() is not None

            def on_restore(records):
                for entry in records:
                    self.result.records[entry["config_index"]].append(entry)
                    if callback is not None:
                        callback(entry)

            outputs = drive(
                self, None if restore else carry, *args, callback=callback,
                checkpointer=checkpointer, identity=identity, on_restore=on_restore,
                resume_into=jax.eval_shape(lambda: carry) if restore else None, **options,
            )  # fmt: skip
            # drive returns only when the chunk is done (a signal or an error raises).
            checkpointer.keep_newest(keep)
            return outputs

    def round_of(self, carry: SweepCarry) -> int:
        return int(np.asarray(carry.state.round)[0])

    def compile_block(self, carry, keys, num_rounds):
        # Lowering and compiling ahead of time times the compilation alone; the jitted
        # calls then reuse the executable (and count in run_rounds._cache_size()).
        run_rounds, hp, data = self.sweep.run_rounds, self.hparams, self.data
        stop = np.int32(num_rounds)
        run_rounds.lower(hp, carry, data, keys, num_rounds=num_rounds, stop=stop).compile()
        return lambda carry, keys, n: run_rounds(
            hp, carry, data, keys, num_rounds=num_rounds, stop=np.int32(n)
        )

    def compile_evaluate(self, carry):
        sweep, data, hp, keys = self.sweep, self.data, self.hparams, self.keys
        sweep.evaluate.lower(carry.state.server, data, carry.state.model).compile()
        if not sweep.simulation.evaluates_clients(data):
            return lambda carry: sweep.evaluate(carry.state.server, data, carry.state.model)
        sweep.evaluate_clients.lower(hp, carry.state, data, keys).compile()

        def evaluate(carry):
            metrics, self.per_client = sweep.evaluate_clients(hp, carry.state, data, keys)
            return {**sweep.evaluate(carry.state.server, data, carry.state.model), **metrics}

        return evaluate

    def records(self, carry, metrics, round, seconds):
        # Host values only: a sweep makes a record per config per evaluation (Figure 3
        # ~165k), so one transfer per block, never a JAX index per value.
        diverged_round = np.asarray(carry.diverged_round)
        values = {k: np.asarray(v) for k, v in metrics.items()}
        simulation = self.sweep.simulation
        out = []
        for a, b, j in self.slots:
            diverged = diverged_round[a, b] >= 0
            entry = {"round": int(round)}
            entry.update(
                {k: float("nan") if diverged else float(v[a, b]) for k, v in values.items()}
            )
            communication.with_bytes(entry, self._traffic(a, b))
            if simulation.algorithm.report is not None:
                hparams = {k: float(v[a, b]) for k, v in self._host_hparams().items()}
                entry.update(simulation.report(hparams, round, self.data.num_clients))
            entry["seconds"] = seconds
            entry["status"] = "diverged" if diverged else "ok"
            entry["config"] = self.result.configs[j]
            entry["config_index"] = j
            self.result.records[j].append(entry)
            out.append(entry)
        return out

    def _traffic(self, a: int, b: int) -> communication.Traffic:
        """Bytes per client of the config in slot ``(a, b)`` (a compressor's bits or
        fraction may differ by config), computed once per slot: a sweep makes a record per
        config per evaluation."""
        if (a, b) not in self._traffic_of:
            sim = self.sweep.simulation
            hparams = {k: float(v[a, b]) for k, v in self._host_hparams().items()}
            self._traffic_of[(a, b)] = communication.traffic(
                sim.algorithm, sim.problem.params, hparams
            )
        return self._traffic_of[(a, b)]

    def _host_hparams(self) -> dict[str, np.ndarray]:
        if self._hparams_on_host is None:
            self._hparams_on_host = jax.device_get(dict(self.hparams))
        return self._hparams_on_host

    def check(self, carry, metrics, first, last):
        del carry, metrics, first, last  # freeze: the compiled round handles divergence

    def finish(self, outcome) -> dict[int, dict[str, Any]]:
        self.result.compile_seconds += outcome.compile_seconds
        self.result.run_seconds += outcome.run_seconds
        self.result.eval_seconds += outcome.eval_seconds
        carry = outcome.state
        segments = outcome.metrics
        ran = sum(len(s["client_ids"]) for s in segments)
        if ran < self.num_rounds:  # resumed: the rounds before the checkpoint are not kept
            like = jax.eval_shape(
                lambda: self.sweep.run_rounds_fn(
                    self.hparams, carry, self.data, self.keys, self.num_rounds - ran
                )
            )[1]
            segments = [{k: _missing(v) for k, v in like.items()}, *segments]
        metrics = {k: np.concatenate([s[k] for s in segments]) for k in segments[0]}
        server = jax.device_get(carry.state.server)
        clients = jax.device_get(carry.state.clients) if self.keep_clients else None
        model = carry.state.model
        keep_model = model is not None and ("server" in model or self.keep_clients)
        model = jax.device_get(model) if keep_model else None
        diverged_round = np.asarray(carry.diverged_round)
        out = {}
        for a, b, j in self.slots:
            self.result.diverged_round[j] = diverged_round[a, b]
            pick = lambda tree, a=a, b=b: jax.tree.map(lambda x: x[a, b], tree)  # noqa: E731
            out[j] = {
                "server": pick(server),
                "clients": pick(clients),  # None stays None (an empty tree)
                "model": pick(model),
                "client_ids": metrics["client_ids"][:, a, b],
                "metrics": {k: v[:, a, b] for k, v in metrics.items() if k != "client_ids"},
            }
        return out


def _missing(like) -> np.ndarray:
    """Per-round metrics not kept (rounds run before a resume): −1 ids, NaN, False."""
    integer, flag = np.issubdtype(like.dtype, np.integer), like.dtype == bool
    return np.full(like.shape, -1 if integer else False if flag else np.nan, like.dtype)


def _layout(seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups configs by seed (in order of first appearance).

    Returns:
      ``(group_seeds [G], slots [G, M], real [G, M])``: the seed of each group, the config
      index in each slot (a short group repeats its last config) and which slots are real.
    """
    groups: dict[int, list[int]] = {}
    for j, seed in enumerate(seeds.tolist()):
        groups.setdefault(seed, []).append(j)
    size = max(len(members) for members in groups.values())
    slots = np.asarray(
        [members + [members[-1]] * (size - len(members)) for members in groups.values()]
    )
    real = np.asarray([[i < len(members) for i in range(size)] for members in groups.values()])
    return np.asarray(list(groups), np.int64), slots, real


def sweep(
    simulation: Simulation,
    data,
    grid: HParams,
    seeds: Sequence[int] | np.ndarray,
    num_rounds: int,
    eval_every: int | None = None,
    targets: Sequence[float] = (),
    **options: Any,
) -> SweepResult:
    """Runs a grid of configs of ``simulation`` (one algorithm; several algorithms are
    several sweeps, each its own program) as one vmapped program per chunk: :meth:`Sweep.run`
    with the same arguments (``grid`` as :func:`~scaffold_jax.sweep.grid` makes it), on the
    :class:`Sweep` kept per simulation, so repeated sweeps of one shape never recompile."""
    return Sweep.of(simulation).run(data, grid, seeds, num_rounds, eval_every, targets, **options)
