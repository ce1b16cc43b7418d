"""Hyper-parameter and seed sweeps as ONE vmapped XLA program.

The paper tunes η_l per algorithm and every claim needs several seeds. A sweep of C
configs (hyper-parameters × seeds) runs the whole simulation under ``jax.vmap`` over a
config axis: every leaf of the state gains leading config axes, the hyper-parameters are
arrays, the root keys one per seed, and the dataset is shared (``in_axes=None``). The
rounds between two evaluations are one ``lax.scan`` of the vmapped round inside one ``jit``
whose carry is donated, so C configs × R rounds cost one compilation and run as one program.

Nothing is copied from :class:`~scaffold_jax.simulate.Simulation`: the sweep vmaps its
``round_fn`` and ``evaluate_fn``. Config j of a sweep therefore computes what
``simulation.run(data, hparams_j, seed=seeds[j])`` computes (the root key is
``jax.random.key(seed)``; round r uses ``fold_in(root, r)``), to float32 round-off.

Layout. Configs are grouped by seed into a ``[G, M]`` block (G seeds, at most M configs
per seed; see :class:`Sweep`). The configs of one seed share the key, so they sample the
same clients and minibatches (as their single runs do); the sweep computes those, and the
batch gather, once per seed.

Performance. The sweep amortises per-op overhead and shares the per-seed work; what it
cannot shrink is the per-config traffic over params-sized arrays (every config updates its
own y_i of every sampled client K times). Where one config's round is already large and
memory-bound (S = 100 clients on a 2-core CPU: the benchmark workload) a sweep runs at
about the speed of sequential runs of one compiled program, 0.8-1.0× in our measurements,
with one compilation instead of one per process; its gains grow as the per-config round
gets smaller (S = 10: 1.3-1.8×) and on accelerators, where small ops are launch-bound.
On the local steps alone, 8 configs vmapped over shared batches take 0.80× the time of 8
separate calls on that CPU, and a hand-written layer stacking their kernels into one wider
matmul 0.60× (``benchmarks/bench_config_axis.py``). The clients of a round run in chunks
sized for all the configs of a block together (``Simulation.round_fn(..., configs=...)``).

Divergence is per config. After every round, a config whose new server state or new client
rows hold a NaN/Inf is marked ``diverged`` at that round (1-based: the round that produced
the non-finite values) and keeps its previous state from then on; its round metrics become
NaN (client ids −1) and its evaluation records say ``status: "diverged"`` with NaN metrics,
as a single run of that config would report. vmap keeps the configs independent and every
check and ``where`` is per config, so the other configs continue bit for bit unaffected.

Chunking. When the states would not fit in memory the ``[G, M]`` block is cut into chunks
of ``g`` seeds × ``m`` configs, all of the same shape (out-of-range slots repeat the last
seed or config and their results are dropped), so the program compiles once. With

    cap = min(C, max_configs_per_chunk, floor(budget / bytes_per_config)), at least 1,

``m = min(M, cap)`` and ``g = min(G, cap // m)`` (whole seed groups first, so the shared
batches stay shared), each evened out to ``ceil(n / ceil(n / k))`` to minimise padding
(:func:`chunk_shape`), where

* ``bytes_per_config = 2 × state_bytes + S × (8 × params_bytes + batch_bytes)``: one
  :class:`~scaffold_jax.types.SimState` (client table + server) counted twice (room for a
  copy wherever XLA cannot update the table in place), plus the per-round working set of
  the S sampled clients: about 8 params-sized buffers each (y, gradient, corrections,
  controls, deltas, layout copies) and their gathered batches ``[K, B, ...]`` at float32
  width (uint8 images are converted inside the step). It errs on the safe side: for the
  benchmark workload (SCAFFOLD, N = 1000, 784×10 logistic regression) it says 102 MiB,
  XLA's own count of arguments and temporaries is about 50 MiB per config;
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
  {'client_lr': 0.1, 'server_lr': 1.0, 'prox_mu': 0.0, 'seed': 1}
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from scaffold_jax.simulate import Simulation, init_state, round_key_and_ids
from scaffold_jax.tree import set_rows, take_rows
from scaffold_jax.types import HParams, PyTree, SimState, check_hparams

HPARAM_NAMES = HParams._fields
#: Per sampled client, the number of params-sized float32 buffers the round keeps live.
WORK_BUFFERS_PER_CLIENT = 8
#: Fraction of the free memory a sweep may use when no budget is given.
DEFAULT_MEMORY_FRACTION = 0.5
_FALLBACK_AVAILABLE_BYTES = 2 << 30
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
    prox_mu: Sequence[float] | float = 0.0,
    seeds: Sequence[int] | int = 0,
) -> tuple[HParams, np.ndarray, list[dict[str, Any]]]:
    """The Cartesian product of hyper-parameter values and seeds, seeds varying fastest.

    Args:
      client_lr: η_l values (a scalar is a one-value axis); likewise for the others.
      server_lr: η_g values.
      prox_mu: FedProx μ values.
      seeds: root seeds.

    Returns:
      ``(hparams, seeds, configs)``: an :class:`HParams` whose leaves are float32 ``[C]``,
      int64 ``[C]`` seeds, and one dict per config (``client_lr``, ``server_lr``,
      ``prox_mu``, ``seed`` as Python numbers), in that order.

    Raises:
      ValueError: an empty axis, an invalid value (see :func:`~scaffold_jax.hparams`) or a
        negative seed.

    Examples:
      >>> hp, seeds, configs = grid(client_lr=[0.1, 0.3], seeds=[0, 1, 2])
      >>> hp.client_lr.shape, seeds.tolist()
      ((6,), [0, 1, 2, 0, 1, 2])
    """
    axes = {
        "client_lr": [float(v) for v in np.atleast_1d(client_lr)],
        "server_lr": [float(v) for v in np.atleast_1d(server_lr)],
        "prox_mu": [float(v) for v in np.atleast_1d(prox_mu)],
        "seed": [int(v) for v in np.atleast_1d(seeds)],
    }
    for name, values in axes.items():
        if not values:
            raise ValueError(f"the grid axis {name} is empty; give it at least one value.")
    configs = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
    hp = HParams(*(jnp.asarray([c[name] for c in configs], jnp.float32) for name in HPARAM_NAMES))
    check_hparams(hp)
    seed_array = _check_seeds([c["seed"] for c in configs], len(configs))
    return hp, seed_array, configs


def _check_seeds(seeds, num_configs: int) -> np.ndarray:
    seeds = np.asarray(seeds)
    if seeds.ndim != 1 or seeds.shape[0] != num_configs:
        raise ValueError(
            f"seeds must be one integer per config, shape [{num_configs}]; got shape {seeds.shape}."
        )
    if not np.issubdtype(seeds.dtype, np.integer) or np.any(seeds < 0):
        raise ValueError(f"seeds must be non-negative integers; got {seeds.tolist()}.")
    return seeds.astype(np.int64)


# ------------------------------------------------------------------------------ memory
def config_bytes(simulation: Simulation, data) -> int:
    """Estimated device bytes one config of a sweep needs (see the module docstring).

    ``2 × state_bytes + S × (WORK_BUFFERS_PER_CLIENT × params_bytes + batch_bytes)``, with
    the batch counted at float32 width.
    """
    state = jax.eval_shape(
        lambda: init_state(simulation.algorithm, simulation.problem.params, data.num_clients)
    )
    batches, _ = jax.eval_shape(
        lambda: data.client_batches(jnp.int32(0), jr.key(0), simulation.plan)
    )
    params_bytes = _tree_bytes(jax.eval_shape(lambda: simulation.problem.params), min_width=4)
    batch_bytes = _tree_bytes(batches, min_width=4)
    working = simulation.clients_per_round * (WORK_BUFFERS_PER_CLIENT * params_bytes + batch_bytes)
    return 2 * _tree_bytes(state) + working


def _tree_bytes(tree: PyTree, min_width: int = 1) -> int:
    return sum(
        math.prod(leaf.shape) * max(jnp.dtype(leaf.dtype).itemsize, min_width)
        for leaf in jax.tree.leaves(tree)
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )


def available_memory_bytes(device: jax.Device | None = None) -> int:
    """Free memory where the sweep runs: ``bytes_limit − bytes_in_use`` on an accelerator,
    ``MemAvailable`` of ``/proc/meminfo`` on CPU, 2 GiB when neither can be read."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        except Exception:  # backends without memory stats raise their own errors
            pass
    return _meminfo_available() or _FALLBACK_AVAILABLE_BYTES


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def choose_chunk_size(
    num_configs: int,
    bytes_per_config: int,
    memory_budget_bytes: int | None = None,
    max_configs_per_chunk: int | None = None,
) -> int:
    """The most configs a chunk may hold: as many as the budget holds, capped, at least 1.

    :func:`chunk_shape` then lays the chunk out over seeds and configs.

    Args:
      num_configs: C.
      bytes_per_config: from :func:`config_bytes`.
      memory_budget_bytes: the budget (default: half of :func:`available_memory_bytes`).
      max_configs_per_chunk: an upper bound set by the caller.

    Returns:
      An int in ``[1, C]``.

    Examples:
      >>> choose_chunk_size(10, bytes_per_config=100, memory_budget_bytes=450)
      4
      >>> choose_chunk_size(10, bytes_per_config=100, memory_budget_bytes=10**6)
      10
    """
    if memory_budget_bytes is None:
        memory_budget_bytes = int(DEFAULT_MEMORY_FRACTION * available_memory_bytes())
    chunk = min(num_configs, max(1, int(memory_budget_bytes // max(bytes_per_config, 1))))
    if max_configs_per_chunk is not None:
        if int(max_configs_per_chunk) < 1:
            raise ValueError(
                f"max_configs_per_chunk = {max_configs_per_chunk} is invalid: it must be >= 1."
            )
        chunk = min(chunk, int(max_configs_per_chunk))
    return chunk


# ------------------------------------------------------------------------------ results
@dataclasses.dataclass
class SweepResult:
    """What :func:`sweep` returns: per-config results in the single-run record format.

    Attributes:
      algorithm: the algorithm's name.
      configs: one dict per config (``client_lr``, ``server_lr``, ``prox_mu``, ``seed``).
      records: per config, one dict per evaluation with the keys of
        :attr:`~scaffold_jax.simulate.RunResult.records` (``round``, ``test_loss``,
        ``test_accuracy``, ``train_loss``, ``seconds``) plus ``status`` (``"ok"`` or
        ``"diverged"``) and ``config``. Metrics of a diverged config are NaN.
      diverged_round: int ``[C]``, the round that produced a NaN/Inf, −1 if none.
      server_states: the final server states, numpy leaves ``[C, ...]`` (a diverged config
        keeps its last finite state).
      client_states: the final client tables ``[C, N, ...]`` (numpy) when asked for with
        ``keep_client_states=True``, else None.
      client_ids: int32 ``[C, R, S]``, the clients sampled in every round (−1 once diverged).
      round_metrics: per-round metrics, each ``[C, R]`` (NaN once diverged).
      compile_seconds: compiling the round program(s) and the evaluation.
      run_seconds: wall time of all chunks after compilation.
      chunk_size: configs per chunk (``g × m``); chunk_shape: ``(g, m)``, seeds × configs
        per seed (see :class:`Sweep`); num_chunks: how many chunks ran.
      bytes_per_config: the estimate the chunk size was chosen from.
      targets: accuracy targets given to :func:`sweep`; see :meth:`rounds_to_target`.

    A record's ``seconds`` counts from the start of its chunk, compilation excluded.
    """

    algorithm: str
    configs: list[dict[str, Any]]
    records: list[list[dict[str, Any]]]
    diverged_round: np.ndarray
    server_states: PyTree = None
    client_states: PyTree = None
    client_ids: np.ndarray | None = None
    round_metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
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

    def rounds_to_target(self, target: float, metric: str = "test_accuracy") -> list[int | None]:
        """Per config, the first evaluated round whose ``metric`` ≥ ``target`` (None if
        never, or only after diverging)."""
        return [rounds_to_target(r, target, metric) for r in self.records]

    def summary(self, target: float | None = None) -> list[dict[str, Any]]:
        """One dict per config: config, status, diverged round, final metrics and rounds to
        each target (``target`` or, by default, :attr:`targets`)."""
        targets = self.targets if target is None else (target,)
        out = []
        for j, recs in enumerate(self.records):
            row = {
                "config": self.configs[j],
                "status": recs[-1]["status"],
                "diverged_round": int(self.diverged_round[j]) if self.diverged[j] else None,
            }
            row.update({k: v for k, v in recs[-1].items() if k not in ("config", "status")})
            row["rounds_to_target"] = {t: rounds_to_target(recs, t) for t in targets}
            out.append(row)
        return out


def rounds_to_target(
    records: Sequence[Mapping[str, Any]], target: float, metric: str = "test_accuracy"
) -> int | None:
    """The first evaluated round whose ``metric`` ≥ ``target``; None if never reached."""
    for r in records:
        if r.get("status", "ok") == "ok" and float(r.get(metric, np.nan)) >= target:
            return int(r["round"])
    return None


# ------------------------------------------------------------------------------ the program
def _all_finite(tree: PyTree) -> jax.Array:
    checks = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


class Sweep:
    """The compiled programs of a sweep over one :class:`Simulation`.

    Layout. Configs are grouped by seed: every leaf of the carry is ``[G, M, ...]`` for G
    distinct seeds with at most M configs each (shorter groups are padded with copies
    whose results are dropped). The outer ``vmap`` runs over the seeds (the keys), the
    inner one over the hyper-parameters of one seed with the key and the round number
    SHARED (``in_axes=None``). A single run's sampled clients and minibatches follow from
    its key and the round alone, so configs of one seed draw the same ones anyway; sharing
    them is exact, and it turns the batch gather and the forward/backward products of a
    group into one op each (whether that op beats M separate ones is the backend's
    business: on a 2-core CPU it saved 20% of the local steps at best, see
    ``benchmarks/bench_config_axis.py``).

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
        per_seed = jax.vmap(simulation.evaluate_fn, in_axes=(0, None))
        self.evaluate = jax.jit(jax.vmap(per_seed, in_axes=(0, None)))

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
    def guarded_round_fn(
        self, hparams: HParams, carry: SweepCarry, data, key: jax.Array, configs: int = 1
    ):
        """One round of ONE config, frozen once it produces a NaN/Inf (vmapped by
        :meth:`run_rounds_fn` over ``configs`` configs; ``carry`` here has no config axis)."""
        sim, state = self.simulation, carry.state
        # The ids round_fn will sample (the same call it makes): their old rows are kept
        # aside so that freezing a config rewrites S rows, not the whole [N, ...] table.
        _, ids = round_key_and_ids(key, state.round, data.num_clients, sim.clients_per_round)
        old_rows = take_rows(state.clients, ids)
        # Writing the rows back is a no-op that makes the table round_fn updates depend on
        # old_rows: the gather runs (and is materialised) before the in-place scatter.
        # Otherwise XLA fuses it into its late consumer below and copies the whole table.
        state = state._replace(clients=set_rows(state.clients, ids, old_rows))
        new, metrics = sim.round_fn(hparams, state, data, key, configs=configs)
        new_rows = take_rows(new.clients, ids)
        finite = _all_finite(new.server) & _all_finite(new_rows)
        keep = finite & ~carry.diverged
        state = SimState(
            server=optax.tree.where(keep, new.server, state.server),
            clients=set_rows(new.clients, ids, optax.tree.where(keep, new_rows, old_rows)),
            # Not frozen: the round number is shared by the configs of a seed, and a frozen
            # config's state no longer depends on it.
            round=new.round,
        )
        newly = ~finite & ~carry.diverged
        diverged = carry.diverged | ~finite
        diverged_round = jnp.where(newly, new.round, carry.diverged_round)
        metrics = {
            k: jnp.where(diverged, -1, v) if k == "client_ids" else jnp.where(diverged, jnp.nan, v)
            for k, v in metrics.items()
        }
        return SweepCarry(state, diverged, diverged_round), metrics

    def run_rounds_fn(
        self, hparams: HParams, carry: SweepCarry, data, keys: jax.Array, num_rounds: int
    ):
        """``num_rounds`` rounds of G × M configs as one ``lax.scan`` of the vmapped round.

        Args:
          hparams: leaves ``[G, M]``.
          carry: a :class:`SweepCarry` with leading ``[G, M]`` axes, except
            ``state.round``, ``[G]`` (donated by :attr:`run_rounds`).
          data: the dataset, shared by every config.
          keys: ``[G]`` root keys, one per seed.
          num_rounds: R (static).

        Returns:
          The new carry and the metrics, each ``[R, G, M, ...]``.
        """
        in_group = SweepCarry(SimState(server=0, clients=0, round=None), 0, 0)
        per_seed = SweepCarry(SimState(server=0, clients=0, round=0), 0, 0)
        # All G x M configs of the block work on each chunk of clients together.
        configs = math.prod(carry.diverged.shape)
        group = jax.vmap(
            functools.partial(self.guarded_round_fn, configs=configs),
            in_axes=(0, in_group, None, None),
            out_axes=(in_group, 0),
        )
        step = jax.vmap(group, in_axes=(0, per_seed, None, 0), out_axes=(per_seed, 0))

        def body(carry, _):
            return step(hparams, carry, data, keys)

        return jax.lax.scan(body, carry, None, length=num_rounds)

    # -------------------------------------------------------------- the host-side API
    def init(self, data, num_seeds: int, group_size: int) -> SweepCarry:
        """G × M copies of the initial state (every config starts from the same params)."""
        sim = self.simulation
        state = init_state(sim.algorithm, sim.problem.params, data.num_clients)
        shape = (num_seeds, group_size)
        return SweepCarry(
            state=SimState(
                server=jax.tree.map(
                    lambda a: jnp.broadcast_to(a, shape + a.shape).copy(), state.server
                ),
                clients=jax.tree.map(
                    lambda a: jnp.broadcast_to(a, shape + a.shape).copy(), state.clients
                ),
                round=jnp.zeros((num_seeds,), jnp.int32),
            ),
            diverged=jnp.zeros(shape, bool),
            diverged_round=jnp.full(shape, -1, jnp.int32),
        )

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
    ) -> SweepResult:
        """Runs every config (``grid[j]``, ``seeds[j]``) for ``num_rounds`` rounds.

        Evaluates at round 0 and every ``eval_every`` rounds, as :meth:`Simulation.run`
        does; the rounds in between are ONE compiled program for the whole chunk of
        configs. Only the program's length (``eval_every`` and a possible shorter last
        segment) and the chunk shape fix its shape.

        Args:
          data: the federated dataset, shared by all configs.
          grid: an :class:`HParams` whose leaves are ``[C]`` (scalars are broadcast).
          seeds: ``[C]`` non-negative root seeds; config j uses ``jax.random.key(seeds[j])``.
          num_rounds: R >= 1.
          eval_every: evaluation period (default R).
          targets: accuracy targets recorded in the result (see
            :meth:`SweepResult.summary`).
          configs: one dict per config for the records (default: the grid values and seed).
          max_configs_per_chunk: cap on configs run at once.
          memory_budget_bytes: device bytes a chunk may use (default: half of the free
            memory; see the module docstring).
          keep_client_states: also return the final client tables (host memory C × table).

        Raises:
          ValueError: invalid rounds, hyper-parameters, seeds or data.
        """
        sim = self.simulation
        if int(num_rounds) < 1:
            raise ValueError(f"num_rounds = {num_rounds} is invalid: it must be >= 1.")
        num_rounds = int(num_rounds)
        eval_every = int(num_rounds if eval_every is None else eval_every)
        if eval_every < 1:
            raise ValueError(f"eval_every = {eval_every} is invalid: it must be >= 1.")
        num_configs = int(np.shape(seeds)[0]) if np.ndim(seeds) else 0
        if num_configs < 1:
            raise ValueError("a sweep needs at least one config: seeds is empty or a scalar.")
        seeds = _check_seeds(seeds, num_configs)
        grid = _broadcast_grid(grid, num_configs)
        check_hparams(grid)
        sim.check(data)
        if configs is None:
            # str() of a float32 is its shortest round-trip decimal: 0.1, not 0.10000000149.
            host = {
                name: [float(str(v)) for v in np.asarray(getattr(grid, name))]
                for name in HPARAM_NAMES
            }
            configs = [
                {**{name: host[name][j] for name in HPARAM_NAMES}, "seed": int(seeds[j])}
                for j in range(num_configs)
            ]
        elif len(configs) != num_configs:
            raise ValueError(f"configs has {len(configs)} entries for {num_configs} configs.")
        configs = [dict(c) for c in configs]

        group_seeds, slots, real = _layout(seeds)
        num_seeds, group_size = slots.shape
        per_config = config_bytes(sim, data)
        cap = choose_chunk_size(num_configs, per_config, memory_budget_bytes, max_configs_per_chunk)
        g, m = chunk_shape(num_seeds, group_size, cap)
        lengths = [eval_every] * (num_rounds // eval_every)
        if num_rounds % eval_every:
            lengths.append(num_rounds % eval_every)

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
        for g0 in range(0, num_seeds, g):
            for m0 in range(0, group_size, m):
                # Out-of-range slots repeat the last seed / config: every chunk has the same
                # shape, so the program compiles once; those copies' results are dropped.
                rows, cols = np.arange(g0, g0 + g), np.arange(m0, m0 + m)
                valid = (rows < num_seeds)[:, None] & (cols < group_size)[None, :]
                rows, cols = np.minimum(rows, num_seeds - 1), np.minimum(cols, group_size - 1)
                valid &= real[np.ix_(rows, cols)]
                index = slots[np.ix_(rows, cols)]
                chunk = self._run_chunk(
                    data,
                    grid,
                    group_seeds[rows],
                    configs,
                    index,
                    valid,
                    lengths,
                    result,
                    keep_client_states,
                )
                for j, out in chunk.items():
                    outputs[j] = out

        def stack(trees):
            return jax.tree.map(lambda *a: np.stack(a), *trees)

        result.server_states = stack([o["server"] for o in outputs])
        if keep_client_states:
            result.client_states = stack([o["clients"] for o in outputs])
        result.client_ids = np.stack([o["client_ids"] for o in outputs])
        result.round_metrics = {
            k: np.stack([o["metrics"][k] for o in outputs]) for k in outputs[0]["metrics"]
        }
        return result

    def _run_chunk(
        self, data, grid, group_seeds, configs, index, valid, lengths, result, keep_clients
    ) -> dict[int, dict[str, Any]]:
        """Runs one ``[g, m]`` chunk (``index``: config ids; ``valid``: slots to keep).

        Appends to ``result.records`` and its timings; returns per-config outputs.
        """
        hp = jax.tree.map(lambda a: a[jnp.asarray(index)], grid)
        keys = jnp.stack([jr.key(int(s)) for s in group_seeds])
        carry = self.init(data, *index.shape)
        slots = [(a, b, int(index[a, b])) for a, b in zip(*np.nonzero(valid), strict=True)]

        start = time.perf_counter()
        # Lowering and compiling ahead of time times the compilation alone; the jitted
        # calls below then reuse the executable (and count in _cache_size()).
        for length in sorted(set(lengths)):
            self.run_rounds.lower(hp, carry, data, keys, num_rounds=length).compile()
        self.evaluate.lower(carry.state.server, data).compile()
        result.compile_seconds += time.perf_counter() - start

        run_start = time.perf_counter()
        done = 0

        def record():
            evaluated = jax.device_get(self.evaluate(carry.state.server, data))
            diverged_round = np.asarray(carry.diverged_round)
            seconds = time.perf_counter() - run_start
            for a, b, j in slots:
                diverged = diverged_round[a, b] >= 0
                entry = {"round": done}
                entry.update(
                    {k: float("nan") if diverged else float(v[a, b]) for k, v in evaluated.items()}
                )
                entry["seconds"] = seconds
                entry["status"] = "diverged" if diverged else "ok"
                entry["config"] = configs[j]
                result.records[j].append(entry)

        record()
        segments = []
        for length in lengths:
            carry, metrics = self.run_rounds(hp, carry, data, keys, num_rounds=length)
            segments.append(jax.device_get(metrics))
            done += length
            record()
        jax.block_until_ready(carry)
        result.run_seconds += time.perf_counter() - run_start

        metrics = {k: np.concatenate([s[k] for s in segments]) for k in segments[0]}
        server = jax.device_get(carry.state.server)
        clients = jax.device_get(carry.state.clients) if keep_clients else None
        diverged_round = np.asarray(carry.diverged_round)
        out = {}
        for a, b, j in slots:
            result.diverged_round[j] = diverged_round[a, b]
            out[j] = {
                "server": jax.tree.map(lambda x, a=a, b=b: x[a, b], server),
                "clients": None
                if clients is None
                else jax.tree.map(lambda x, a=a, b=b: x[a, b], clients),
                "client_ids": metrics["client_ids"][:, a, b],
                "metrics": {k: v[:, a, b] for k, v in metrics.items() if k != "client_ids"},
            }
        return out


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


def chunk_shape(num_seeds: int, group_size: int, max_configs: int) -> tuple[int, int]:
    """``(g, m)``: seeds and configs per seed in a chunk, with ``g × m ≤ max_configs``.

    Whole seed groups first (m = M, as many seeds as fit), else parts of one group; both
    evened out so the chunks are as equal as they can be (less padding).

    Examples:
      >>> chunk_shape(4, 8, 32), chunk_shape(4, 8, 20), chunk_shape(4, 8, 5)
      ((4, 8), (2, 8), (1, 4))
    """
    m = min(group_size, max(1, max_configs))
    m = math.ceil(group_size / math.ceil(group_size / m))
    g = min(num_seeds, max(1, max_configs // m))
    g = math.ceil(num_seeds / math.ceil(num_seeds / g))
    return g, m


def _broadcast_grid(grid: HParams, num_configs: int) -> HParams:
    if not isinstance(grid, HParams):
        raise TypeError(
            f"grid must be an HParams with [C] leaves (use scaffold_jax.sweep.grid(...)), got "
            f"{type(grid).__name__}."
        )
    leaves = []
    for name in HPARAM_NAMES:
        value = jnp.asarray(getattr(grid, name), jnp.float32)
        if value.ndim == 0:
            value = jnp.full((num_configs,), value)
        if value.shape != (num_configs,):
            raise ValueError(
                f"grid.{name} has shape {value.shape}; every hyper-parameter needs one value "
                f"per config, shape ({num_configs},), as seeds has."
            )
        leaves.append(value)
    return HParams(*leaves)


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
      targets: accuracy targets for :meth:`SweepResult.summary`.
      **options: ``configs``, ``max_configs_per_chunk``, ``memory_budget_bytes``,
        ``keep_client_states`` of :meth:`Sweep.run`.
    """
    return Sweep.of(simulation).run(data, grid, seeds, num_rounds, eval_every, targets, **options)


# ------------------------------------------------------------------------------ summary
def _hparam_key(config: Mapping[str, Any]) -> tuple:
    return tuple((k, v) for k, v in config.items() if k != "seed")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return float(np.mean(values)), float(np.std(values))


def summarize(
    results: Mapping[str, SweepResult] | SweepResult,
    target: float,
    metric: str = "test_accuracy",
) -> dict[str, dict[str, Any]]:
    """The paper's step-size selection: per algorithm, the best hyper-parameters.

    Configs that differ only in their seed form a group. A group's rounds to target is
    the mean over its seeds when EVERY seed reaches ``target`` (else it has not reached
    it); the best group has the fewest rounds to target, ties (including "nobody reached
    it") broken by the lower final training loss (test loss where there is none). A
    diverged seed counts as an infinite loss and as not reaching the target.

    Args:
      results: ``{algorithm name: SweepResult}`` or one result.
      target: the accuracy target (e.g. 0.5 for the paper's Table 3).
      metric: the record key compared with the target.

    Returns:
      ``{algorithm: {"best": group, "groups": [group, ...]}}``, each group a dict with
      ``hparams``, ``seeds``, ``rounds_to_target`` (per seed, None if not reached),
      ``reached`` (seeds that reached), ``rounds_mean``/``rounds_std`` (None unless all
      reached), ``final_accuracy_mean``/``_std``, ``final_loss_mean``, ``num_diverged``.
    """
    if isinstance(results, SweepResult):
        results = {results.algorithm: results}
    summary = {}
    for name, result in results.items():
        groups: dict[tuple, list[int]] = {}
        for j, config in enumerate(result.configs):
            groups.setdefault(_hparam_key(config), []).append(j)
        rows = []
        for key, members in groups.items():
            rounds = [rounds_to_target(result.records[j], target, metric) for j in members]
            reached = [r for r in rounds if r is not None]
            all_reached = len(reached) == len(rounds)
            accuracy = [float(result.records[j][-1].get(metric, np.nan)) for j in members]
            last = result.records[members[0]][-1]
            loss_name = "train_loss" if "train_loss" in last else "test_loss"
            losses = [
                float(result.records[j][-1].get(loss_name, np.nan))
                if not result.diverged[j]
                else float("inf")
                for j in members
            ]
            losses = [v if np.isfinite(v) else float("inf") for v in losses]
            mean_rounds, std_rounds = _mean_std(reached) if all_reached else (None, None)
            acc_mean, acc_std = _mean_std(accuracy)
            rows.append(
                {
                    "hparams": dict(key),
                    "seeds": [result.configs[j].get("seed") for j in members],
                    "configs": members,
                    "rounds_to_target": rounds,
                    "reached": len(reached),
                    "rounds_mean": mean_rounds,
                    "rounds_std": std_rounds,
                    "final_accuracy_mean": acc_mean,
                    "final_accuracy_std": acc_std,
                    "final_loss_mean": float(np.mean(losses)),
                    "num_diverged": int(sum(result.diverged[j] for j in members)),
                }
            )
        best = min(
            rows,
            key=lambda g: (
                float("inf") if g["rounds_mean"] is None else g["rounds_mean"],
                g["final_loss_mean"],
            ),
        )
        summary[name] = {"best": best, "groups": rows, "target": float(target)}
    return summary


def format_summary(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table of :func:`summarize`'s best configs, one row per algorithm."""

    def fmt(mean, std, digits):
        return "not reached" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"

    lines = [
        "| algorithm | hparams | rounds to target | reached | final accuracy | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in summary.items():
        g = entry["best"]
        hp = ", ".join(f"{k}={v:g}" for k, v in g["hparams"].items())
        lines.append(
            f"| {name} | {hp} | {fmt(g['rounds_mean'], g['rounds_std'], 1)} "
            f"| {g['reached']}/{len(g['seeds'])} "
            f"| {fmt(g['final_accuracy_mean'], g['final_accuracy_std'], 4)} "
            f"| {g['final_loss_mean']:.4g} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots
def plot_rounds_to_target(
    results: Mapping[str, SweepResult] | SweepResult,
    target: float,
    metric: str = "test_accuracy",
    ax=None,
):
    """Rounds to ``target`` against η_l, per algorithm, mean ± std over seeds.

    A step size whose seeds do not all reach the target is drawn as an ``x`` at the top
    of the axis. One line per algorithm (and per other hyper-parameter value, when those
    vary too). matplotlib is imported here, not by the package.

    Returns:
      The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    summary = summarize(results, target, metric)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    worst = max(
        [r["round"] for res in _as_mapping(results).values() for recs in res.records for r in recs]
        or [1]
    )
    for name, entry in summary.items():
        lines: dict[tuple, list[dict]] = {}
        for g in entry["groups"]:
            others = tuple((k, v) for k, v in g["hparams"].items() if k != "client_lr")
            lines.setdefault(others, []).append(g)
        varying = _varying(entry["groups"])
        for others, groups in lines.items():
            groups = sorted(groups, key=lambda g: g["hparams"]["client_lr"])
            label = name + "".join(f", {k}={v:g}" for k, v in others if k in varying)
            done = [g for g in groups if g["rounds_mean"] is not None]
            line = ax.errorbar(
                [g["hparams"]["client_lr"] for g in done],
                [g["rounds_mean"] for g in done],
                yerr=[g["rounds_std"] for g in done],
                marker="o",
                capsize=3,
                label=label,
            )
            missed = [g["hparams"]["client_lr"] for g in groups if g["rounds_mean"] is None]
            if missed:
                color = line[0].get_color()
                ax.scatter(missed, [worst] * len(missed), marker="x", color=color)
    ax.set_xscale("log")
    ax.set_xlabel("client step size η_l")
    ax.set_ylabel(f"rounds to {metric} ≥ {target:g}")
    ax.set_title("x: not reached")
    ax.legend()
    return ax.figure


def plot_best_curves(
    results: Mapping[str, SweepResult] | SweepResult,
    target: float,
    metric: str = "test_accuracy",
    ax=None,
):
    """``metric`` against rounds for each algorithm's best config (see :func:`summarize`),
    the mean over seeds with a ± std band and the target as a dashed line.

    Returns:
      The matplotlib Figure.
    """
    import matplotlib.pyplot as plt

    results = _as_mapping(results)
    summary = summarize(results, target, metric)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for name, entry in summary.items():
        best = entry["best"]
        curves = np.asarray(
            [
                [float(r.get(metric, np.nan)) for r in results[name].records[j]]
                for j in best["configs"]
            ]
        )
        rounds = [r["round"] for r in results[name].records[best["configs"][0]]]
        mean, std = np.mean(curves, axis=0), np.std(curves, axis=0)
        hp = ", ".join(
            f"{k}={v:g}" for k, v in best["hparams"].items() if k in _varying(entry["groups"])
        )
        (line,) = ax.plot(rounds, mean, label=f"{name} ({hp})" if hp else name)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.25, color=line.get_color())
    ax.axhline(target, linestyle="--", color="gray", linewidth=1)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.legend()
    return ax.figure


def _as_mapping(results) -> Mapping[str, SweepResult]:
    return {results.algorithm: results} if isinstance(results, SweepResult) else results


def _varying(groups: Sequence[Mapping[str, Any]]) -> set[str]:
    names = groups[0]["hparams"].keys() if groups else ()
    return {k for k in names if len({g["hparams"][k] for g in groups}) > 1}
