"""The client axis over many devices and hosts: a ``Mesh`` with a ``clients`` axis.

What lives where:

* the client table (every leaf of ``SimState.clients``, ``[N, ...]``): split in N/D
  contiguous blocks of rows over the D devices of the mesh (device d owns clients
  ``d·N/D .. (d+1)·N/D − 1``; with several hosts, each host owns the blocks of its
  devices). N must be a multiple of D: XLA keeps arrays at rest in equal blocks;
* the server state, the round counter, the hyper-parameters, the root key: replicated;
* the data: a :class:`~scaffold_jax.data.FederatedData`'s flat ``examples`` split by
  rows like the table (when the number of examples divides evenly, see
  :func:`place_data`); ``counts``, ``offsets`` (4 bytes per client, vs ~2.4 kB per client
  for a 610-parameter SCAFFOLD table) and the test set replicated. A procedural dataset has
  no examples to place: its clients are generated where they are trained.

A round (the same :meth:`~scaffold_jax.simulate.Simulation.round_fn`, with layout hints):

1. every device draws the same S ids (uniform over all N clients, the same sampler and
   keys as on one device);
2. the sampled clients are placed by POSITION in the sampled set: device d trains sampled
   clients ``d·⌈S/D⌉ ..`` (S need not divide by D; XLA pads the last block). Each
   client's key is ``fold_in(round_key, id)``, so results do not depend on the placement;
3. their rows reach them by a masked local gather plus an all-reduce of ``[S, P]``: each
   device reads the sampled rows it OWNS and writes zeros elsewhere, and the sum over
   devices is the gathered block, which each device then slices to its own clients;
4. the local work (``vmap(client_update)`` over S/D clients) runs on each device; the
   server's weighted means become partial sums plus an all-reduce of ``[P]``;
5. the new rows are all-gathered (``[S, P]``) and every device scatters, in place, the
   rows it owns.

So a round moves O(S·P) bytes between devices (one all-reduce and one all-gather of the
sampled rows, one all-reduce of the model update), independent of N; the sampling itself
(a permutation of N ids) runs, replicated, on every device. Placing clients on their
owner instead would save the row traffic but make the per-device count of sampled clients
random (a Binomial(S, 1/D)), which a static-shape program can only pad to a worst case
and which would leave devices idle; the rows are small next to the local work.

Why GSPMD and not ``shard_map``: the layout hints are a few ``with_sharding_constraint``
calls in the generic round (``Simulation._constrain``, a no-op when unsharded), so every
algorithm and dataset runs sharded unchanged, and the compiled program does exactly
steps 3-5 (``tests/test_sharding.py`` checks the collectives in the HLO). A hand-written
``shard_map`` could turn the all-reduce of step 3 into a reduce-scatter (half the bytes)
at the cost of per-device code for every table access and every dataset; at O(S·P) per
round that is not worth it.

Multi-host: call :func:`jax.distributed.initialize` first (on CPU, collectives go through
gloo, jax's default ``jax_cpu_collectives_implementation``); :func:`client_mesh` then spans
every process's devices, and each process runs the same program on its own blocks. See
``docs/scaling.md``.

Examples:
  >>> import scaffold_jax as sj
  >>> from scaffold_jax.sharding import client_mesh, shard
  >>> data = sj.data.synthetic.procedural_synthetic(64, 1.0, 1.0, sizes=20)
  >>> problem = sj.models.logistic_regression((60,), 10)
  >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
  ...                     sj.BatchPlan.fixed(10, 5), clients_per_round=8)
  >>> sharded = shard(sim, client_mesh())
  >>> result = sharded.run(data, sj.hparams(client_lr=0.1), num_rounds=2)
  >>> result.state.round.tolist()
  2
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scaffold_jax.simulate import Simulation
from scaffold_jax.tree import broadcast_rows
from scaffold_jax.tree import to_host as gather
from scaffold_jax.types import Algorithm, PyTree, SimState

__all__ = [
    "CLIENTS",
    "ShardedSimulation",
    "client_mesh",
    "data_shardings",
    "gather",
    "init_state",
    "place",
    "place_data",
    "place_state",
    "shard",
    "state_shardings",
]

CLIENTS = "clients"
_EXAMPLES_POLICIES = ("auto", "shard", "replicate")


def client_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = CLIENTS) -> Mesh:
    """A one-axis mesh over ``devices`` (default: all devices of all processes).

    The axis is ``Auto`` (GSPMD chooses the collectives). ``jax.devices()`` lists devices
    process by process, so with several hosts every host owns a contiguous range of the
    client table.

    Args:
      devices: the devices, in the order the table's blocks go to them.
      axis_name: the mesh axis the client axis is split over.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ValueError("client_mesh needs at least one device.")
    return Mesh(np.asarray(devices), (axis_name,), axis_types=(AxisType.Auto,))


def _axis(mesh: Mesh) -> str:
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"expected a one-axis mesh (the client axis), got axes {mesh.axis_names}; build "
            "it with scaffold_jax.sharding.client_mesh."
        )
    return mesh.axis_names[0]


def _rows(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(_axis(mesh)))


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _check_rows(what: str, size: int, mesh: Mesh) -> None:
    if size % mesh.size:
        raise ValueError(
            f"{what} has {size} rows, which do not split evenly over the {mesh.size} devices "
            f"of the mesh; XLA keeps arrays at rest in equal blocks. Use a number of clients "
            f"that is a multiple of {mesh.size}, or a mesh over a divisor of {size} devices."
        )


def state_shardings(state: SimState, mesh: Mesh) -> SimState:
    """The shardings of a :class:`SimState`: table rows split, server and round replicated.

    ``state`` may hold arrays or ``jax.ShapeDtypeStruct`` s (only the structure is used).
    """
    rows, rep = _rows(mesh), _replicated(mesh)
    return SimState(
        server=jax.tree.map(lambda _: rep, state.server),
        clients=jax.tree.map(lambda _: rows, state.clients),
        round=rep,
    )


def data_shardings(data: Any, mesh: Mesh, examples: str = "auto") -> Any:
    """The shardings :func:`place_data` gives ``data`` (same pytree structure).

    Everything is replicated except a :class:`~scaffold_jax.data.FederatedData`'s flat
    ``examples``, split by rows according to ``examples``:

    * ``"shard"``: split (1/D of the data per device); the sampled clients' batches then
      come from their owners by a masked gather plus an all-reduce of
      ``[S, K, B, ...]`` per round. ValueError if the rows do not split evenly.
    * ``"replicate"``: every device keeps all examples; batches are read locally, no
      traffic. Best when the data fit D times (Fashion-MNIST is 47 MB).
    * ``"auto"`` (default): ``"shard"`` when the rows split evenly, else ``"replicate"``.

    ``counts`` and ``offsets`` stay replicated: 4 bytes per client, read by the host-side
    checks of :meth:`~scaffold_jax.simulate.Simulation.run` (which cannot read an array
    spread over several processes) and by every device to find any client's examples.

    Args:
      data: a federated dataset (``FederatedData`` or procedural).
      mesh: the client mesh.
      examples: "auto", "shard" or "replicate".
    """
    if examples not in _EXAMPLES_POLICIES:
        raise ValueError(f"examples={examples!r} is unknown; use one of {_EXAMPLES_POLICIES}.")
    rep = _replicated(mesh)
    shardings = jax.tree.map(lambda _: rep, data)
    flat = getattr(data, "examples", None)
    if flat is None or examples == "replicate":
        return shardings
    num_rows = jax.tree.leaves(flat)[0].shape[0]
    if examples == "auto" and num_rows % mesh.size:
        return shardings
    _check_rows("the dataset's examples array", num_rows, mesh)
    return shardings.replace(examples=jax.tree.map(lambda _: _rows(mesh), flat))


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` laid out as ``sharding``, on one host or many.

    Single-process (or a global array already): ``device_put``. Multi-process, from a
    process-local value: every process must hold the same full value (built from the same
    seed) and keeps only the blocks of its own devices (``make_array_from_callback``).
    """
    if isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        # Typed keys: place the raw key data, then re-wrap it.
        impl = jr.key_impl(value)
        return jr.wrap_key_data(_put(jr.key_data(value), sharding), impl=impl)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if jax.process_count() == 1 or (
        isinstance(value, jax.Array) and not value.is_fully_addressable
    ):
        # One process, or already a global array: XLA moves what has to move.
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_state(state: SimState, mesh: Mesh) -> SimState:
    """``state`` with its client table split over ``mesh`` and the rest replicated.

    Raises:
      ValueError: N is not a multiple of the number of devices.
    """
    leaves = jax.tree.leaves(state.clients)
    if leaves:
        _check_rows("the client table", leaves[0].shape[0], mesh)
    return jax.tree.map(_put, state, state_shardings(state, mesh))


def place_data(data: Any, mesh: Mesh, examples: str = "auto") -> Any:
    """``data`` laid out over ``mesh`` as :func:`data_shardings` says."""
    return jax.tree.map(_put, data, data_shardings(data, mesh, examples))


def place(state: SimState, data: Any, mesh: Mesh, examples: str = "auto") -> tuple[SimState, Any]:
    """:func:`place_state` and :func:`place_data` together."""
    return place_state(state, mesh), place_data(data, mesh, examples)


def init_state(algorithm: Algorithm, params: PyTree, num_clients: int, mesh: Mesh) -> SimState:
    """The initial :class:`SimState`, built directly in its sharded layout.

    Equal to :func:`scaffold_jax.simulate.init_state` value for value, but each device
    allocates only its own block of the table and no host copy of the whole table is ever
    made: peak memory is one table, not two (the unsharded builder materialises a
    broadcast and then its copy). With several hosts every process calls it alike.

    Raises:
      ValueError: ``num_clients`` is not a multiple of the number of devices.
    """
    _check_rows("the client table", num_clients, mesh)
    server, client = algorithm.init(params)
    # Numpy constants, closed over: the program needs no inputs, so every process can
    # run it on the global mesh without first placing anything.
    server, client = jax.tree.map(np.asarray, (server, client))

    def build():
        return SimState(
            server=jax.tree.map(jnp.asarray, server),
            clients=broadcast_rows(client, num_clients),
            round=jnp.zeros((), jnp.int32),
        )

    like = jax.eval_shape(build)
    return jax.jit(build, out_shardings=state_shardings(like, mesh))()


class ShardedSimulation(Simulation):
    """A :class:`~scaffold_jax.simulate.Simulation` whose client axis is split over a mesh.

    Same constructor arguments as ``Simulation`` plus ``mesh``; the same compiled round
    with layout hints (see the module docstring), so its results equal the unsharded
    simulation's up to the order of floating-point sums (rtol 1e-5 in the tests).

    :meth:`init` returns the state already placed; :meth:`run` places ``data`` and the
    state it is given (or builds a placed one) before running, so
    ``ShardedSimulation(...).run(data, ...)`` is all a caller needs. To call the compiled
    :attr:`round` / :attr:`run_rounds` directly, pass a state from :meth:`init` and data
    from :meth:`place_data`.

    Args:
      algorithm, problem, plan, clients_per_round, weighting, eval_batch_size: as for
        :class:`~scaffold_jax.simulate.Simulation`.
      mesh: a one-axis mesh (default :func:`client_mesh` over all devices).
      examples: how :meth:`place_data` lays out materialised examples
        (see :func:`data_shardings`).
    """

    def __init__(
        self,
        algorithm: Algorithm,
        problem,
        plan,
        clients_per_round: int,
        weighting: str = "uniform",
        eval_batch_size: int = 4096,
        *,
        mesh: Mesh | None = None,
        examples: str = "auto",
    ):
        self.mesh = client_mesh() if mesh is None else mesh
        _axis(self.mesh)
        if examples not in _EXAMPLES_POLICIES:
            raise ValueError(f"examples={examples!r} is unknown; use one of {_EXAMPLES_POLICIES}.")
        self.examples = examples
        super().__init__(algorithm, problem, plan, clients_per_round, weighting, eval_batch_size)

    def resolve_client_chunk(self, data, configs: int = 1) -> None:
        """Always None: all S sampled clients in one vmap, split over the mesh.

        A ``lax.map`` over chunks of the sharded client axis would run the devices one
        chunk after another; each device already holds only S / devices clients.
        """
        del data, configs
        return None

    def _constrain(self, tree: PyTree, layout: str) -> PyTree:
        wsc = jax.lax.with_sharding_constraint
        if layout == "state":
            return SimState(
                server=wsc(tree.server, _replicated(self.mesh)),
                clients=wsc(tree.clients, _rows(self.mesh)),
                round=wsc(tree.round, _replicated(self.mesh)),
            )
        if layout == "sampled":
            return wsc(tree, _rows(self.mesh))
        if layout == "replicated":
            return wsc(tree, _replicated(self.mesh))
        raise ValueError(f"unknown layout {layout!r}")

    def init(self, data) -> SimState:
        """Checks the set-up against ``data``; the initial state, placed on the mesh."""
        self.check(data)
        return init_state(self.algorithm, self.problem.params, data.num_clients, self.mesh)

    def place_data(self, data):
        """``data`` laid out on this simulation's mesh (see :func:`data_shardings`)."""
        return place_data(data, self.mesh, self.examples)

    def place_state(self, state: SimState) -> SimState:
        """``state`` laid out on this simulation's mesh (see :func:`place_state`)."""
        return place_state(state, self.mesh)

    def run(self, data, *args, **kwargs):
        """:meth:`Simulation.run` on the mesh: places ``data`` and ``state`` first.

        Without ``state`` the initial state is built directly in its sharded layout
        (:meth:`init`).

        Checkpoints: ``checkpoint_dir`` saves as usual and ``resume=True`` restores the
        newest checkpoint directly in the mesh layout (each leaf is read to the host and
        placed with its ``NamedSharding``: table rows split, the rest replicated; no
        unplaced device copy is made, so the restore peaks at the host copy plus the placed
        table, as an unsharded resume does), then continues the run bit for bit as the
        uninterrupted sharded run. A checkpoint written by an unsharded
        :class:`~scaffold_jax.simulate.Simulation` of the same run resumes too.

        With several processes every process calls ``run`` with the same arguments and the
        same ``checkpoint_dir``, on a filesystem they all see. A save gathers the whole
        table to the host of EVERY process (a collective; host memory for one table per
        process) and process 0 writes it; a resume reads the files on every process, and
        each keeps only the blocks of its own devices (see :mod:`scaffold_jax.checkpoint`).

        Raises:
          ValueError: N is not a multiple of the number of devices (also when resuming).
        """
        bound = inspect.signature(Simulation.run).bind(self, data, *args, **kwargs)
        arguments = bound.arguments
        arguments["data"] = self.place_data(data)
        if arguments.get("state") is not None:
            arguments["state"] = self.place_state(arguments["state"])
        elif not arguments.get("resume", False):
            arguments["state"] = self.init(arguments["data"])
        # With resume=True, Simulation.run restores the state into _state_like: placed.
        return Simulation.run(*bound.args, **bound.kwargs)

    def _state_like(self, num_clients: int) -> SimState:
        """:meth:`Simulation._state_like` with this mesh's shardings on every leaf."""
        _check_rows("the client table", num_clients, self.mesh)
        like = super()._state_like(num_clients)
        return jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            like,
            state_shardings(like, self.mesh),
        )


def shard(simulation: Simulation, mesh: Mesh | None = None, examples: str = "auto"):
    """The :class:`ShardedSimulation` with ``simulation``'s configuration on ``mesh``.

    Examples:
      >>> import scaffold_jax as sj
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
      ...                     sj.BatchPlan.fixed(4, 2), clients_per_round=2)
      >>> shard(sim).mesh.axis_names
      ('clients',)
    """
    return ShardedSimulation(
        simulation.algorithm,
        simulation.problem,
        simulation.plan,
        simulation.clients_per_round,
        simulation.weighting,
        simulation.eval_batch_size,
        mesh=mesh,
        examples=examples,
    )
