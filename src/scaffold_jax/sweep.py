"""Sweeps over any declared hyper-parameter × seeds as ONE vmapped XLA program.

The paper tunes η_l per algorithm and every claim needs several seeds. A sweep of C
configs (hyper-parameters × seeds) runs the whole simulation under ``jax.vmap`` over a
config axis: every leaf of the state gains leading config axes, the hyper-parameters are
arrays, the root keys one per seed, and the dataset is shared (``in_axes=None``). The
rounds between two evaluations are one loop of the vmapped round inside one ``jit``
whose carry is donated, so C configs × R rounds cost one compilation and run as one
program, driven by the same host loop as a single run (:func:`scaffold_jax.loop.drive`).

Any hyper-parameter the algorithm declares can be an axis of the grid (``grid(client_lr=
[...], prox_mu=[...])``, FedDyn's ``alpha``, a plugin's own); those not given take their
declared defaults. Nothing is copied from :class:`~scaffold_jax.engine.Simulation`: the
sweep vmaps its ``round_fn`` and ``evaluate_fn``. Config j of a sweep therefore computes
what ``simulation.run(data, hparams_j, seed=seeds[j])`` computes (the root key is
``jax.random.key(seed)``; round r uses ``fold_in(root, r)``), to float32 round-off.

Layout. Configs are grouped by seed into a ``[G, M]`` block (G seeds, at most M configs
per seed; see :class:`Sweep`). The configs of one seed share the key, so they sample the
same clients and minibatches (as their single runs do); the sweep computes those, and the
batch gather, once per seed. Inside a round the M configs run inside each client's work
(:meth:`Simulation.round_fn <scaffold_jax.engine.Simulation.round_fn>` with ``configs``):
the rows are gathered client-major ``[S, M, ...]`` and each client's local steps of the M
configs run side by side on its batches, so their products are one wider dot. The clients
run in chunks sized for all the configs of a block together
(:meth:`Simulation.resolve_client_chunk
<scaffold_jax.engine.Simulation.resolve_client_chunk>` with ``configs``). On CPU a model
with convolutions or loops runs its seeds, configs and evaluations one after another
instead (:meth:`Simulation.configs_one_at_a_time
<scaffold_jax.engine.Simulation.configs_one_at_a_time>`). How the sweep compares with
sequential runs is measured in benchmarks/README.md.

Divergence is per config (the loop's ``freeze`` policy). After every round, a config whose
new server state or new client rows hold a NaN/Inf is marked ``diverged`` at that round
(1-based: the round that produced the non-finite values) and keeps its previous state
from then on; its round metrics become NaN (client ids −1) and its evaluation records say
``status: "diverged"`` with NaN metrics, as a single run of that config would report. vmap
keeps the configs independent and every check and ``where`` is per config, so the other
configs continue bit for bit unaffected.

Chunking. When the states would not fit in memory the ``[G, M]`` block is cut into chunks
of ``g`` seeds × ``m`` configs, all of the same shape (out-of-range slots repeat the last
seed or config and their results are dropped), so the program compiles once. With

    cap = min(C, max_configs_per_chunk, floor(budget / bytes_per_config)), at least 1,

``m = min(M, cap)`` and ``g = min(G, cap // m)`` (whole seed groups first, so the shared
batches stay shared), each evened out to ``ceil(n / ceil(n / k))`` to minimise padding
(:func:`~scaffold_jax.resources.chunk_shape`), where

* ``bytes_per_config = 2 × state_bytes + S × (8 × params_bytes + batch_bytes)``: one
  :class:`~scaffold_jax.types.SimState` (client table + server) counted twice (room for a
  copy wherever XLA cannot update the table in place), plus the per-round working set of
  the S sampled clients: about 8 params-sized buffers each (y, gradient, corrections,
  controls, deltas, layout copies) and their gathered batches ``[K, B, ...]`` at float32
  width (uint8 images are converted inside the step). It errs on the safe side (compared
  with XLA's own count in benchmarks/README.md);
* ``budget = memory_budget_bytes``, by default half the memory still free: on an
  accelerator ``bytes_limit − bytes_in_use`` from ``device.memory_stats()``, on CPU
  ``MemAvailable`` from ``/proc/meminfo`` (2 GiB when neither can be read).

Examples:
  >>> import numpy as np, scaffold_jax as sj
  >>> from scaffold_jax.sweep import grid, sweep
  >>> rng = np.random.default_rng(0)
  >>> data = sj.data.from_client_arrays(
  ...     [{"x": rng.normal(size=(n, 4)).astype("float32"), "y": rng.integers(0, 3, n)}
  ...      for n in (5, 8, 6)], test={"x": np.zeros((4, 4), "float32"), "y": np.zeros(4, int)})
  >>> problem = sj.models.logistic_regression((4,), 3)
  >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
  ...                     sj.BatchPlan.fixed(batch_size=4, num_steps=3), clients_per_round=2)
  >>> hp, seeds, configs = grid(client_lr=[0.05, 0.1], seeds=[0, 1])
  >>> result = sweep(sim, data, hp, seeds, num_rounds=4, eval_every=2)
  >>> len(result.records), [r["round"] for r in result.records[3]]
  (4, [0, 2, 4])
  >>> result.configs[3]
  {'client_lr': 0.1, 'server_lr': 1.0, 'seed': 1}
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.data.federated import data_fingerprint
from scaffold_jax.engine import (
    MAX_ROUNDS,
    MAX_SEED,
    ROUNDS_WHY,
    SEED_WHY,
    Simulation,
    check_count,
    initial_state,
    one_after_another,
    repeat_rounds,
)
from scaffold_jax.loop import drive
from scaffold_jax.resources import WORK_BUFFERS_PER_CLIENT, choose_chunk_size, chunk_shape
from scaffold_jax.tree import tree_bytes
from scaffold_jax.types import HParams, PyTree, SimState, check_hparams

_ATTRIBUTE = "_sweep_program"  # where Sweep.of keeps a simulation's Sweep


class SweepCarry(NamedTuple):
    """The state of G seeds × M configs carried between rounds.

    Attributes:
      state: a :class:`SimState` whose leaves have leading ``[G, M]`` axes (the client
        table is ``[G, M, N, ...]``), except ``round``, ``[G]``: the configs of a seed are
        always at the same round.
      diverged: bool ``[G, M]``, set once a config produced a NaN/Inf.
      diverged_round: int32 ``[G, M]``, the round that produced it (−1 while finite).
    """

    state: SimState
    diverged: jax.Array
    diverged_round: jax.Array


# ------------------------------------------------------------------------------ the grid
def grid(
    client_lr: Sequence[float] | float,
    server_lr: Sequence[float] | float = 1.0,
    seeds: Sequence[int] | int = 0,
    **others: Sequence[float] | float,
) -> tuple[HParams, np.ndarray, list[dict[str, Any]]]:
    """The Cartesian product of hyper-parameter values and seeds, seeds varying fastest.

    Args:
      client_lr: η_l values (a scalar is a one-value axis); likewise for the others.
      server_lr: η_g values.
      seeds: root seeds.
      **others: any other declared hyper-parameter (``prox_mu=[0.1, 1.0]``, ...); the
        sweep refuses names its algorithm does not declare, and gives those not named here
        their declared defaults.

    Returns:
      ``(hparams, seeds, configs)``: an :class:`HParams` whose leaves are float32 ``[C]``,
      int64 ``[C]`` seeds, and one dict per config (the hyper-parameters given, then
      ``seed``, as Python numbers), in that order.

    Raises:
      ValueError: an empty axis, an invalid value (see :func:`~scaffold_jax.hparams`) or a
        negative seed.

    Examples:
      >>> hp, seeds, configs = grid(client_lr=[0.1, 0.3], seeds=[0, 1, 2])
      >>> hp.client_lr.shape, seeds.tolist()
      ((6,), [0, 1, 2, 0, 1, 2])
    """
    axes = {"client_lr": client_lr, "server_lr": server_lr, **others}
    axes = {name: [float(v) for v in np.atleast_1d(values)] for name, values in axes.items()}
    axes["seed"] = [int(v) for v in np.atleast_1d(seeds)]
    for name, values in axes.items():
        if not values:
            raise ValueError(f"the grid axis {name} is empty; give it at least one value.")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:  # the same config twice: counted twice in a mean over seeds
            raise ValueError(
                f"the grid axis {name} repeats {', '.join(f'{v:g}' for v in repeated)}; give "
                "each value once."
            )
    configs = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
    names = [name for name in axes if name != "seed"]
    hp = HParams({name: [c[name] for c in configs] for name in names})
    check_hparams(hp)
    seed_array = _check_seeds([c["seed"] for c in configs], len(configs))
    return hp, seed_array, configs


def _check_seeds(seeds, num_configs: int) -> np.ndarray:
    seeds = np.asarray(seeds)
    if seeds.ndim != 1 or seeds.shape[0] != num_configs:
        raise ValueError(
            f"seeds must be one integer per config, shape [{num_configs}]; got shape {seeds.shape}."
        )
    # Seeds beyond int64 come as an object array of Python ints.
    integers = np.issubdtype(seeds.dtype, np.integer) or (
        seeds.dtype == object and all(isinstance(s, (int, np.integer)) for s in seeds.tolist())
    )
    if not integers or any(int(s) < 0 for s in seeds.tolist()):
        raise ValueError(f"seeds must be non-negative integers; got {seeds.tolist()}.")
    big = [int(s) for s in seeds.tolist() if int(s) > MAX_SEED]
    if big:
        raise ValueError(f"seed = {big[0]} is invalid: it must be <= {MAX_SEED}{SEED_WHY}.")
    return seeds.astype(np.int64)


# ------------------------------------------------------------------------------ memory
def config_bytes(simulation: Simulation, data) -> int:
    """Estimated device bytes one config of a sweep needs (see the module docstring).

    ``2 × state_bytes + S × (WORK_BUFFERS_PER_CLIENT × params_bytes + batch_bytes)``, with
    the batch counted at float32 width.
    """
    state = jax.eval_shape(
        lambda: initial_state(
            simulation.algorithm, simulation.problem.params, data.num_clients, simulation.problem
        )
    )
    batches, _ = jax.eval_shape(
        lambda: data.client_batches(jnp.int32(0), jr.key(0), simulation.plan)
    )
    params_bytes = tree_bytes(jax.eval_shape(lambda: simulation.problem.params), min_width=4)
    batch_bytes = tree_bytes(batches, min_width=4)
    working = simulation.clients_per_round * (WORK_BUFFERS_PER_CLIENT * params_bytes + batch_bytes)
    return 2 * tree_bytes(state) + working


# ------------------------------------------------------------------------------ results
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


# ------------------------------------------------------------------------------ the program
class Sweep:
    """The compiled programs of a sweep over one :class:`Simulation`.

    Layout. Configs are grouped by seed: every leaf of the carry is ``[G, M, ...]`` for G
    distinct seeds with at most M configs each (shorter groups are padded with copies
    whose results are dropped). A ``vmap`` runs over the seeds (the keys; ``lax.map``
    where :meth:`Simulation.configs_one_at_a_time
    <scaffold_jax.engine.Simulation.configs_one_at_a_time>`), and each seed's round runs
    its M configs inside the clients' work with the key and the round number SHARED. A
    single run's sampled clients and minibatches follow from its key and the round alone,
    so configs of one seed draw the same ones anyway; sharing them is exact, and it turns
    the batch gather and the forward/backward products of a group into one op each
    (whether that op beats M separate ones is the backend's business; see
    benchmarks/README.md).

    Build one per simulation (:meth:`of` and :func:`sweep` keep it) so that a second sweep
    of the same shape reuses the compiled program: :attr:`run_rounds` and
    :attr:`evaluate` are ``jax.jit`` functions whose ``_cache_size()`` counts their
    compilations.

    Args:
      simulation: the :class:`Simulation` to vmap (its algorithm, plan, S, weighting).
    """

    def __init__(self, simulation: Simulation):
        if not isinstance(simulation, Simulation):
            raise TypeError(f"simulation must be a Simulation, got {type(simulation).__name__}.")
        self.simulation = simulation
        self.run_rounds = jax.jit(
            self.run_rounds_fn, static_argnames=("num_rounds",), donate_argnums=(1,)
        )
        self.evaluate = jax.jit(self.evaluate_fn)

    @classmethod
    def of(cls, simulation: Simulation) -> Sweep:
        """The :class:`Sweep` of ``simulation``, made once and kept while it lives.

        It is stored on the simulation itself: a Sweep references its simulation, so a
        ``WeakKeyDictionary`` would keep both alive forever.
        """
        program = getattr(simulation, _ATTRIBUTE, None)
        if not isinstance(program, cls):
            program = cls(simulation)
            setattr(simulation, _ATTRIBUTE, program)
        return program

    # -------------------------------------------------------------- the pure programs
    def run_rounds_fn(
        self,
        hparams: HParams,
        carry: SweepCarry,
        data,
        keys: jax.Array,
        num_rounds: int,
        stop=None,
    ):
        """``num_rounds`` rounds of G × M configs as one loop of the vmapped round.

        Args:
          hparams: leaves ``[G, M]``.
          carry: a :class:`SweepCarry` with leading ``[G, M]`` axes, except
            ``state.round``, ``[G]`` (donated by :attr:`run_rounds`).
          data: the dataset, shared by every config.
          keys: ``[G]`` root keys, one per seed.
          num_rounds: R (static).
          stop: run only the first ``stop`` of the R rounds (traced; see
            :meth:`Simulation.run_rounds_fn <scaffold_jax.engine.Simulation.run_rounds_fn>`).

        Returns:
          The new carry and the metrics, each ``[R, G, M, ...]``.
        """
        sim = self.simulation
        # All G x M configs of the block work on each chunk of clients together: the round
        # is the simulation's, with the chunk sized for all of them (fixed at trace time).
        chunk = sim.resolve_client_chunk(data, configs=math.prod(carry.diverged.shape))
        sim = sim.replace(client_chunk=chunk)

        def group(hp, carry: SweepCarry, key):
            # The M configs of one seed in one round: they share its sample and
            # minibatches, and each client runs their local steps side by side.
            configs = carry.diverged.shape[0]
            state, metrics = sim.round_fn(
                hp, carry.state, data, key, diverged=carry.diverged, configs=configs
            )
            finite = metrics.pop("finite")
            newly = ~finite & ~carry.diverged
            diverged = carry.diverged | ~finite
            diverged_round = jnp.where(newly, state.round, carry.diverged_round)

            def frozen(v):  # per config, broadcast over a metric's own axes
                return diverged.reshape(diverged.shape + (1,) * (v.ndim - 1))

            metrics = {k: jnp.where(frozen(v), _frozen(k, v), v) for k, v in metrics.items()}
            return SweepCarry(state, diverged, diverged_round), metrics

        # The round counter and the availability state are the seed's (no config moves
        # them), shared by the configs of a seed.
        per_seed = SweepCarry(
            SimState(server=0, clients=0, round=0, model=0, participation=0), 0, 0
        )
        if sim.configs_one_at_a_time(data):
            step = one_after_another(group)
        else:
            step = jax.vmap(group, in_axes=(0, per_seed, 0), out_axes=(per_seed, 0))

        return repeat_rounds(lambda carry: step(hparams, carry, keys), carry, num_rounds, stop)

    def evaluate_fn(self, server: PyTree, data, model: PyTree = None) -> dict[str, jax.Array]:
        """Every config's centralised metrics, ``[G, M]`` each: :meth:`Simulation.evaluate_fn
        <scaffold_jax.engine.Simulation.evaluate_fn>` vmapped over the configs, or one config
        after another (``lax.map``) where vmapped configs would make every convolution over
        the evaluation set a grouped one (:meth:`Simulation.configs_one_at_a_time
        <scaffold_jax.engine.Simulation.configs_one_at_a_time>`)."""
        sim = self.simulation

        def one(server, model):
            return sim.evaluate_fn(server, data, model)

        over = one_after_another if sim.configs_one_at_a_time(data) else jax.vmap
        return over(over(one))(server, model)

    # -------------------------------------------------------------- the host-side API
    def init(self, data, num_seeds: int, group_size: int) -> SweepCarry:
        """G × M copies of the initial state (every config starts from the same params,
        after the algorithm's warm-start pass if it has one, which no hyper-parameter
        affects), built by one jitted program: the ``[G, M, N, ...]`` table is allocated
        once."""
        sim = self.simulation
        shape = (num_seeds, group_size)

        def build(params, data):
            state = sim.warm_start_fn(
                initial_state(
                    sim.algorithm, params, data.num_clients, sim.problem, sim.participation
                ),
                data,
            )
            copies = jax.tree.map(lambda a: jnp.broadcast_to(a, shape + a.shape), state)
            per_seed = jax.tree.map(
                lambda a: jnp.broadcast_to(a, (num_seeds, *a.shape)), state.participation
            )
            return SweepCarry(
                state=copies._replace(
                    round=jnp.zeros((num_seeds,), jnp.int32), participation=per_seed
                ),
                diverged=jnp.zeros(shape, bool),
                diverged_round=jnp.full(shape, -1, jnp.int32),
            )

        return jax.jit(build)(sim.problem.params, data)

    def resolve_grid(self, grid: HParams, num_configs: int) -> HParams:
        """``grid`` with every declared hyper-parameter as a float32 ``[C]`` leaf (scalars
        broadcast, missing ones at their declared defaults), checked.

        Raises:
          TypeError: ``grid`` is not an HParams.
          ValueError: an undeclared name, a leaf that is not ``[C]``, an invalid value.
        """
        if not isinstance(grid, HParams):
            raise TypeError(
                f"grid must be an HParams with [C] leaves (use scaffold_jax.sweep.grid(...)), "
                f"got {type(grid).__name__}."
            )
        for name, value in grid.items():
            if np.ndim(value) not in (0, 1) or (np.ndim(value) == 1 and len(value) != num_configs):
                raise ValueError(
                    f"grid.{name} has shape {np.shape(value)}; every hyper-parameter needs one "
                    f"value per config, shape ({num_configs},), as seeds has."
                )
        resolved = self.simulation.resolve_hparams(grid)
        return HParams({k: jnp.broadcast_to(v, (num_configs,)) for k, v in resolved.items()})

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
            memory; see the module docstring).
          keep_client_states: also return the final client tables (host memory C × table).
          callback: a record sink called with every record as it is made (each carries
            its ``config`` and ``config_index``), e.g. a run writer's.
          checkpoint_dir: checkpoint every chunk into ``<checkpoint_dir>/chunk-<i>``
            (the loop's checkpoints: every ``checkpoint_every`` rounds, default the
            loop's adaptive cadence at evaluations, and after ``checkpoint_seconds`` of
            wall time), so that
            ``resume=True`` continues the sweep: a finished chunk is read back, an
            unfinished one continues from its newest checkpoint bit for bit, and its
            restored records are handed to ``callback`` again (so a sink that dropped the
            unfinished records has each exactly once). After a resume, the per-round
            metrics of rounds run before the checkpoint are not kept: NaN (client ids −1).
          phase: wraps each compilation (see :func:`scaffold_jax.loop.drive`).
          progress: called after each evaluation with the fraction of the sweep done, in
            [0, 1] (chunks run one after the other, each for every round).
          identity: more of what fixes the sweep's results (the data's fingerprint, the
            model...), checked on resume beside the chunk's own (algorithm, N, configs,
            plan, S, weighting).

        Raises:
          ValueError: invalid rounds, hyper-parameters, seeds or data.
        """
        sim = self.simulation
        num_rounds = check_count("num_rounds", num_rounds, maximum=MAX_ROUNDS, why=ROUNDS_WHY)
        eval_every = check_count("eval_every", num_rounds if eval_every is None else eval_every)
        num_configs = int(np.shape(seeds)[0]) if np.ndim(seeds) else 0
        if num_configs < 1:
            raise ValueError("a sweep needs at least one config: seeds is empty or a scalar.")
        seeds = _check_seeds(seeds, num_configs)
        grid = self.resolve_grid(grid, num_configs)
        sim.check(data)
        if configs is not None and len(configs) != num_configs:
            raise ValueError(f"configs has {len(configs)} entries for {num_configs} configs.")
        # str() of a float32 is its shortest round-trip decimal: 0.1, not 0.10000000149.
        host = {name: [float(str(v)) for v in np.asarray(value)] for name, value in grid.items()}
        configs = [
            {
                **{name: host[name][j] for name in host},
                "seed": int(seeds[j]),
                **(dict(configs[j]) if configs is not None else {}),
            }
            for j in range(num_configs)
        ]

        if checkpoint_dir is not None and "data_fingerprint" not in (identity or {}):
            # Once for every chunk: a resume onto other data is refused.
            identity = {**dict(identity or {}), "data_fingerprint": data_fingerprint(data)}
        group_seeds, slots, real = _layout(seeds)
        num_seeds, group_size = slots.shape
        per_config = config_bytes(sim, data)
        cap = choose_chunk_size(num_configs, per_config, memory_budget_bytes, max_configs_per_chunk)
        g, m = chunk_shape(num_seeds, group_size, cap)

        result = SweepResult(
            algorithm=sim.algorithm.name,
            configs=configs,
            records=[[] for _ in configs],
            diverged_round=np.full((num_configs,), -1, np.int64),
            chunk_size=g * m,
            chunk_shape=(g, m),
            num_chunks=math.ceil(num_seeds / g) * math.ceil(group_size / m),
            bytes_per_config=per_config,
            targets=tuple(float(t) for t in targets),
        )
        outputs: list[Any] = [None] * num_configs
        done: list[Any] = []
        for g0 in range(0, num_seeds, g):
            for m0 in range(0, group_size, m):
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
                carry = self.init(data, *index.shape)
                on_block = None
                if progress is not None:
                    chunks_done = len(done)

                    def on_block(r, c=chunks_done, total=result.num_chunks):
                        progress((c + min(r / num_rounds, 1.0)) / total)

                chunk_out = _drive_chunk(
                    self, chunk, carry, keys, num_rounds, eval_every, callback,
                    None if checkpoint_dir is None else Path(checkpoint_dir) / f"chunk-{len(done)}",
                    checkpoint_every, checkpoint_seconds, resume,
                    {"phase": phase, "on_block": on_block}, identity,
                )  # fmt: skip
                done.append(chunk_out)
                for j, out in chunk_out.items():
                    outputs[j] = out

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


def _drive_chunk(
    sweep, chunk, carry, keys, num_rounds, eval_every, callback, directory, every, seconds, resume,
    hooks, identity,
):  # fmt: skip
    if directory is None:
        return drive(
            chunk, carry, keys, num_rounds, eval_every, chunk.finish, callback=callback, **hooks
        )
    from scaffold_jax.checkpoint import Checkpointer  # imported late: orbax is slow to import

    # The caller's identity last, as loop.run's: its form of a key (the command line's
    # algorithm_options, by config key) is the one its checks compare.
    identity = json.loads(json.dumps({
        "algorithm": sweep.simulation.algorithm.name,
        "algorithm_options": dict(sweep.simulation.algorithm.options),
        "num_clients": int(chunk.data.num_clients),
        "configs": [chunk.result.configs[j] for _, _, j in chunk.slots],
        "plan": repr(sweep.simulation.plan),
        "clients_per_round": sweep.simulation.clients_per_round,
        "weighting": sweep.simulation.weighting,
        "weighting_options": sweep.simulation.weighting_options,
        **dict(identity or {}),
    }))  # fmt: skip
    with Checkpointer(directory, max_to_keep=2) as checkpointer:
        restore = resume and checkpointer.latest_round() is not None

        def on_restore(records):
            for entry in records:
                chunk.result.records[entry["config_index"]].append(entry)
                if callback is not None:
                    callback(entry)

        return drive(
            chunk,
            None if restore else carry,
            keys,
            num_rounds,
            eval_every,
            chunk.finish,
            callback=callback,
            checkpointer=checkpointer,
            checkpoint_every=every,
            identity=identity,
            resume_into=jax.eval_shape(lambda: carry) if restore else None,
            on_restore=on_restore,
            checkpoint_seconds=seconds,
            **hooks,
        )


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
        evaluate, data = self.sweep.evaluate, self.data
        evaluate.lower(carry.state.server, data, carry.state.model).compile()
        return lambda carry: evaluate(carry.state.server, data, carry.state.model)

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
            if simulation.algorithm.report is not None:
                hparams = {k: v[a, b] for k, v in self._host_hparams().items()}
                entry.update(simulation.report(hparams, round, self.data.num_clients))
            entry["seconds"] = seconds
            entry["status"] = "diverged" if diverged else "ok"
            entry["config"] = self.result.configs[j]
            entry["config_index"] = j
            self.result.records[j].append(entry)
            out.append(entry)
        return out

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
        if model is not None and ("server" in model or self.keep_clients):
            model = jax.device_get(model)
        else:
            model = None
        diverged_round = np.asarray(carry.diverged_round)
        out = {}
        for a, b, j in self.slots:
            self.result.diverged_round[j] = diverged_round[a, b]
            out[j] = {
                "server": jax.tree.map(lambda x, a=a, b=b: x[a, b], server),
                "clients": None
                if clients is None
                else jax.tree.map(lambda x, a=a, b=b: x[a, b], clients),
                "model": jax.tree.map(lambda x, a=a, b=b: x[a, b], model),
                "client_ids": metrics["client_ids"][:, a, b],
                "metrics": {k: v[:, a, b] for k, v in metrics.items() if k != "client_ids"},
            }
        return out


def _frozen(name: str, value: jax.Array) -> Any:
    """A diverged config's round metric: client ids −1, flags (``server_finite``) False,
    numbers NaN."""
    if name == "client_ids":
        return -1
    return False if value.dtype == jnp.bool_ else jnp.nan


def _missing(like) -> np.ndarray:
    """Per-round metrics not kept (rounds run before a resume): −1 ids, NaN, False."""
    if np.issubdtype(like.dtype, np.integer):
        return np.full(like.shape, -1, like.dtype)
    if like.dtype == bool:
        return np.zeros(like.shape, bool)
    return np.full(like.shape, np.nan, like.dtype)


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
    """Runs a grid of configs of ``simulation`` as one vmapped program per chunk.

    A thin wrapper over :meth:`Sweep.run` that keeps one :class:`Sweep` per simulation,
    so repeated sweeps of the same shape never recompile.

    Args:
      simulation: the :class:`Simulation` (one algorithm; several algorithms are several
        sweeps, each its own program).
      data: the federated dataset.
      grid: :class:`HParams` with ``[C]`` leaves (see :func:`grid`).
      seeds: ``[C]`` root seeds.
      num_rounds: R.
      eval_every: evaluation period (default R).
      targets: accuracy targets for :func:`scaffold_jax.results.sweep_rows`.
      **options: ``configs``, ``max_configs_per_chunk``, ``memory_budget_bytes``,
        ``keep_client_states``, ``callback``, ``checkpoint_dir``, ``phase``, ``progress``...
        of :meth:`Sweep.run`.
    """
    return Sweep.of(simulation).run(data, grid, seeds, num_rounds, eval_every, targets, **options)


# ------------------------------------------------------------------------------ summary
# The step-size selection of a sweep (summarize, format_summary) and its plots
# (plot_rounds_to_target, plot_best_curves) live in scaffold_jax.results, with the one
# policy that `reproduce` uses too.
