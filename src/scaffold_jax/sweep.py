"""Sweeps over any declared hyper-parameter × seeds as ONE vmapped XLA program.

The paper tunes η_l per algorithm and every claim needs several seeds. A sweep of C
configs (hyper-parameters × seeds) runs the whole simulation under ``jax.vmap`` over a
config axis: every leaf of the state gains leading config axes, the hyper-parameters are
arrays, the root keys one per seed, and the dataset is shared (``in_axes=None``). The
rounds between two evaluations are one loop of the vmapped round inside one ``jit``
whose carry is donated, so C configs × R rounds cost one compilation and run as one
program, driven by the same host loop as a single run (:func:`scaffold_jax.loop.drive`).
Their host half (:meth:`Sweep.run`, :class:`SweepResult`, :func:`sweep`: the chunks and
their driving) is :mod:`scaffold_jax.loop.sweeps`, above the programs, and found here too.

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

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax import engine
from scaffold_jax.engine import MAX_SEED, SEED_WHY, Simulation
from scaffold_jax.resources import WORK_BUFFERS_PER_CLIENT
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
    seed_array = check_seeds([c["seed"] for c in configs], len(configs))
    return hp, seed_array, configs


def check_seeds(seeds, num_configs: int) -> np.ndarray:
    """``seeds`` as int64 ``[num_configs]``, each a valid root seed, else ValueError."""
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
        lambda: engine.initial_state(
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
        self.evaluate_clients = jax.jit(self.evaluate_clients_fn)

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
            SimState(
                server=0, clients=0, round=0, model=0, participation=0, messages=0, inflight=0
            ),
            0,
            0,
        )
        if sim.configs_one_at_a_time(data):
            step = engine.one_after_another(group)
        else:
            step = jax.vmap(group, in_axes=(0, per_seed, 0), out_axes=(per_seed, 0))

        return engine.repeat_rounds(
            lambda carry: step(hparams, carry, keys), carry, num_rounds, stop
        )

    def evaluate_fn(self, server: PyTree, data, model: PyTree = None) -> dict[str, jax.Array]:
        """Every config's centralised metrics, ``[G, M]`` each: :meth:`Simulation.evaluate_fn
        <scaffold_jax.engine.Simulation.evaluate_fn>` vmapped over the configs, or one config
        after another (``lax.map``) where vmapped configs would make every convolution over
        the evaluation set a grouped one (:meth:`Simulation.configs_one_at_a_time
        <scaffold_jax.engine.Simulation.configs_one_at_a_time>`)."""
        sim = self.simulation

        def one(server, model):
            return sim.evaluate_fn(server, data, model)

        over = engine.one_after_another if sim.configs_one_at_a_time(data) else jax.vmap
        return over(over(one))(server, model)

    def evaluate_clients_fn(self, hparams: HParams, state: SimState, data, keys: jax.Array):
        """Every config's evaluation of each client on its own test data
        (:meth:`Simulation.evaluate_clients_fn
        <scaffold_jax.engine.Simulation.evaluate_clients_fn>`), metrics ``[G, M]`` and
        per-client arrays ``[G, M, E]``; ``state`` as the carry's (``round`` ``[G]``),
        ``keys`` the seeds' ``[G]``."""
        sim = self.simulation
        over = engine.one_after_another if sim.configs_one_at_a_time(data) else jax.vmap

        def one_seed(hp, state, key):
            configs = jax.tree.leaves(hp)[0].shape[0]
            # What the evaluation reads, every leaf per config (the round is the seed's).
            state = SimState(
                state.server, state.clients, jnp.broadcast_to(state.round, (configs,)),
                state.model,
            )  # fmt: skip
            return over(lambda hp, state: sim.evaluate_clients_fn(hp, state, data, key))(hp, state)

        return jax.vmap(one_seed)(hparams, state, keys)

    # -------------------------------------------------------------- what the host calls
    def init(self, data, num_seeds: int, group_size: int) -> SweepCarry:
        """G × M copies of the initial state (every config starts from the same params,
        after the algorithm's warm-start pass if it has one, which no hyper-parameter
        affects), built by one jitted program: the ``[G, M, N, ...]`` table is allocated
        once."""
        sim = self.simulation
        shape = (num_seeds, group_size)

        def build(params, data):
            state = sim.warm_start_fn(
                engine.initial_state(
                    sim.algorithm,
                    params,
                    data.num_clients,
                    sim.problem,
                    sim.participation,
                    sim.execution,
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


def _frozen(name: str, value: jax.Array) -> Any:
    """A diverged config's round metric: client ids (and FedBuff's integer metrics) −1,
    flags (``server_finite``) False, numbers NaN."""
    if name == "client_ids" or jnp.issubdtype(value.dtype, jnp.integer):
        return jnp.asarray(-1, value.dtype)
    return False if value.dtype == jnp.bool_ else jnp.nan
