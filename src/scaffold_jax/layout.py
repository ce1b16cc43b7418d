"""Where the client axis lives: one device, or a ``Mesh`` with a ``clients`` axis.

A layout is a VALUE handed to the engine (``Simulation(..., layout=ClientMesh(mesh))``),
not a subclass of it: :class:`SingleDevice` (the default) changes nothing;
:class:`ClientMesh` splits the client axis over the devices of a mesh, on one host or
many. The engine calls a layout at four points only: to build and restore the state
(:meth:`~ClientMesh.state_shardings`), to place data and states
(:meth:`~ClientMesh.place_data`, :meth:`~ClientMesh.place_state`), and to pin the layout
of a round's intermediate values (:meth:`~ClientMesh.constrain`).

What lives where on a mesh:

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

A round (the same :meth:`~scaffold_jax.engine.Simulation.round_fn`, with layout hints):

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
calls in the generic round (:meth:`ClientMesh.constrain`, a no-op on one device), so every
algorithm and dataset runs sharded unchanged, and the compiled program does exactly
steps 3-5 (``tests/test_layout.py`` checks the collectives in the HLO). A hand-written
``shard_map`` could turn the all-reduce of step 3 into a reduce-scatter (half the bytes)
at the cost of per-device code for every table access and every dataset; at O(S·P) per
round that is not worth it.

Multi-host: call :func:`jax.distributed.initialize` first (on CPU, collectives go through
gloo, jax's default ``jax_cpu_collectives_implementation``); :func:`client_mesh` then spans
every process's devices, and each process runs the same program on its own blocks. See
``docs/scaling.md``.

Examples:
  >>> import scaffold_jax as sj
  >>> from scaffold_jax.layout import ClientMesh
  >>> data = sj.data.synthetic.procedural_synthetic(64, 1.0, 1.0, sizes=20)
  >>> problem = sj.models.logistic_regression((60,), 10)
  >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
  ...                     sj.BatchPlan.fixed(10, 5), clients_per_round=8,
  ...                     layout=ClientMesh())
  >>> result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=2)
  >>> result.state.round.tolist()
  2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from scaffold_jax.tree import to_host as gather
from scaffold_jax.types import PyTree, SimState

__all__ = [
    "CLIENTS",
    "ClientMesh",
    "SingleDevice",
    "client_mesh",
    "data_shardings",
    "gather",
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
    """The shardings of a :class:`SimState`: the tables' rows (the clients', the message
    transforms', FedBuff's in-flight table's where its M rows split evenly) split; server,
    round and the availability state (``[N]`` bytes at most) replicated.

    ``state`` may hold arrays or ``jax.ShapeDtypeStruct`` s (only the structure is used).
    """
    rows, rep = _rows(mesh), _replicated(mesh)
    return SimState(
        server=jax.tree.map(lambda _: rep, state.server),
        clients=jax.tree.map(lambda _: rows, state.clients),
        round=rep,
        model=_model_tree(state.model, rep, rows),
        participation=jax.tree.map(lambda _: rep, state.participation),
        messages=jax.tree.map(lambda _: rows, state.messages),
        inflight=jax.tree.map(
            lambda a: rows if np.ndim(a) and np.shape(a)[0] % mesh.size == 0 else rep,
            state.inflight,
        ),
    )


def _model_tree(model, replicated, rows):
    """``SimState.model`` with every leaf replaced: the server's statistics by
    ``replicated``, a per-client table's by ``rows``."""
    if model is None:
        return None
    out = {}
    for where, tree in model.items():
        sharding = replicated if where == "server" else rows
        out[where] = jax.tree.map(lambda _, s=sharding: s, tree)
    return out


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
    checks of :meth:`~scaffold_jax.engine.Simulation.check` (which cannot read an array
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


@dataclasses.dataclass(frozen=True)
class SingleDevice:
    """The default layout: the whole client axis on the default device; changes nothing.

    On CPU the engine may then run the sampled clients in cache-sized chunks
    (``Simulation(client_chunk="auto")``).
    """

    #: Whether the engine may run the sampled clients in sequential chunks.
    allows_client_chunks = True

    def constrain(self, tree: PyTree, kind: str) -> PyTree:
        del kind
        return tree

    def state_shardings(self, like: SimState) -> None:
        del like
        return None

    def place_data(self, data: Any) -> Any:
        return data

    def place_state(self, state: SimState) -> SimState:
        return state

    def check_num_clients(self, num_clients: int) -> None:
        del num_clients


@dataclasses.dataclass(frozen=True)
class ClientMesh:
    """The client axis split over a one-axis mesh (see the module docstring).

    Results equal the single-device run's up to the order of floating-point sums (rtol
    1e-5 in the tests). All S sampled clients run in one vmap split over the mesh: a
    ``lax.map`` over chunks of the sharded axis would run the devices one chunk after
    another, and each device already holds only S / D clients.

    Args:
      mesh: a one-axis mesh (default :func:`client_mesh` over all devices).
      examples: how :meth:`place_data` lays out materialised examples (see
        :func:`data_shardings`).
    """

    mesh: Mesh | None = None
    examples: str = "auto"

    allows_client_chunks = False

    def __post_init__(self):
        if self.mesh is None:
            object.__setattr__(self, "mesh", client_mesh())
        _axis(self.mesh)
        if self.examples not in _EXAMPLES_POLICIES:
            raise ValueError(
                f"examples={self.examples!r} is unknown; use one of {_EXAMPLES_POLICIES}."
            )

    def constrain(self, tree: PyTree, kind: str) -> PyTree:
        """Pins ``tree``'s layout: ``"replicated"`` (on every device), ``"sampled"``
        (``[S, ...]`` leaves split over the client axis) or ``"state"`` (a
        :class:`SimState`: table rows split, server and round replicated)."""
        wsc = jax.lax.with_sharding_constraint
        if kind == "state":
            return jax.tree.map(wsc, tree, state_shardings(tree, self.mesh))
        if kind == "sampled":
            return wsc(tree, _rows(self.mesh))
        if kind == "replicated":
            return wsc(tree, _replicated(self.mesh))
        raise ValueError(f"unknown layout kind {kind!r}")

    def state_shardings(self, like: SimState) -> SimState:
        """See :func:`state_shardings`."""
        return state_shardings(like, self.mesh)

    def place_data(self, data: Any) -> Any:
        """See :func:`place_data`."""
        return place_data(data, self.mesh, self.examples)

    def place_state(self, state: SimState) -> SimState:
        """See :func:`place_state`."""
        return place_state(state, self.mesh)

    def check_num_clients(self, num_clients: int) -> None:
        """ValueError unless N splits evenly over the mesh's devices."""
        _check_rows("the client table", num_clients, self.mesh)


def shard(simulation: Any, mesh: Mesh | None = None, examples: str = "auto") -> Any:
    """``simulation`` with its client axis on ``mesh``: ``simulation.replace(layout=
    ClientMesh(mesh, examples))``.

    Examples:
      >>> import scaffold_jax as sj
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
      ...                     sj.BatchPlan.fixed(4, 2), clients_per_round=2)
      >>> shard(sim).layout.mesh.axis_names
      ('clients',)
    """
    return simulation.replace(layout=ClientMesh(mesh, examples))
