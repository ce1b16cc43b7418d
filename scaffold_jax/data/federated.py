"""The device-resident federated dataset.

All clients' examples live in flat arrays (``examples`` leaves ``[n_total, ...]``) ordered
client by client, with per-client ``offsets`` and ``counts`` ``[N]``: no ``[N, n_max]``
padding blow-up when client sizes are skewed. Images stay uint8 on device; models
normalise them inside the step. Padded batch slots are masked, so unequal sizes are exact.

The engine talks to a dataset through three members, which procedural datasets
(:mod:`scaffold_jax.data.synthetic`) provide as well:

* ``num_clients`` (static int) and ``counts`` (``[N]`` int32, examples per client);
* ``client_batches(client_id, key, plan) -> (batches [K, B, ...], mask [K, B])`` for ONE
  client (the engine vmaps it over the sampled clients).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax.data.batching import BatchPlan

Examples = Any  # a pytree of arrays with a leading example axis, e.g. {"x": ..., "y": ...}


@flax.struct.dataclass
class FederatedData:
    """Examples of all clients in flat arrays, plus an optional held-out test set.

    Attributes:
      examples: pytree of ``[n_total, ...]`` arrays, client i's examples at rows
        ``offsets[i] : offsets[i] + counts[i]``.
      offsets: ``[N]`` int32.
      counts: ``[N]`` int32, every entry >= 1.
      test: pytree of ``[n_test, ...]`` arrays (same structure as ``examples``) or None.
      num_clients: N (static).
      max_count: max_i counts[i] (static; the padded width of full-batch plans).
    """

    examples: Examples
    offsets: jax.Array
    counts: jax.Array
    test: Examples | None
    num_clients: int = flax.struct.field(pytree_node=False)
    max_count: int = flax.struct.field(pytree_node=False)

    def client_batches(
        self, client_id: jax.Array, key: jax.Array, plan: BatchPlan
    ) -> tuple[Examples, jax.Array]:
        """Batches ``[K, B, ...]`` and mask ``[K, B]`` for one client (vmap over clients)."""
        count = self.counts[client_id]
        pos, mask = plan.positions(key, count, self.max_count)
        rows = self.offsets[client_id] + pos
        return jax.tree.map(lambda a: a[rows], self.examples), mask

    @property
    def num_examples(self) -> int:
        return int(jax.tree.leaves(self.examples)[0].shape[0])

    def client_examples(self, client_id: int) -> Examples:
        """Client ``client_id``'s examples as numpy arrays (for inspection and tests)."""
        start = int(self.offsets[client_id])
        stop = start + int(self.counts[client_id])
        return jax.tree.map(lambda a: np.asarray(a[start:stop]), self.examples)


def from_client_arrays(clients: Sequence[Examples], test: Examples | None = None) -> FederatedData:
    """Builds a :class:`FederatedData` from per-client example pytrees of unequal sizes.

    Args:
      clients: one pytree per client, e.g. ``[{"x": x_0, "y": y_0}, ...]`` or
        ``[(x_0, y_0), ...]``; every leaf of client i has leading size n_i >= 1.
      test: an optional held-out set with the same structure.

    Examples:
      >>> import numpy as np
      >>> data = from_client_arrays([{"x": np.zeros((3, 2)), "y": np.zeros(3, int)},
      ...                            {"x": np.ones((5, 2)), "y": np.ones(5, int)}])
      >>> data.num_clients, data.max_count, data.counts.tolist()
      (2, 5, [3, 5])
    """
    if len(clients) == 0:
        raise ValueError("from_client_arrays needs at least one client; got an empty list.")
    structure = jax.tree.structure(clients[0])
    counts = []
    for i, client in enumerate(clients):
        if jax.tree.structure(client) != structure:
            raise ValueError(
                f"client {i} has pytree structure {jax.tree.structure(client)}, but client 0 "
                f"has {structure}; every client must hold the same fields."
            )
        sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(client)}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"client {i}: every leaf must share one leading example axis; got sizes {sizes}."
            )
        (n,) = sizes
        if n == 0:
            raise ValueError(
                f"client {i} has no data (0 examples). Drop it or give it at least one example."
            )
        counts.append(n)
    examples = jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *clients)
    return _build(examples, np.asarray(counts), test)


def from_partition(
    examples: Examples, client_indices: Sequence[np.ndarray], test: Examples | None = None
) -> FederatedData:
    """Builds a :class:`FederatedData` from a pool of examples and per-client index lists
    (the output of a partitioner in :mod:`scaffold_jax.data.partition`)."""
    if len(client_indices) == 0:
        raise ValueError("the partition is empty: it assigns no clients.")
    counts = np.asarray([len(ix) for ix in client_indices])
    if np.any(counts == 0):
        empty = np.flatnonzero(counts == 0)[:5].tolist()
        raise ValueError(
            f"clients {empty} have no data (0 examples); use fewer clients or a partition "
            "that gives every client at least one example."
        )
    order = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in client_indices])
    num_examples = int(np.shape(jax.tree.leaves(examples)[0])[0])
    if order.min() < 0 or order.max() >= num_examples:
        raise ValueError(
            f"the partition holds indices outside [0, {num_examples}), the number of examples; "
            "partition the same examples you pass."
        )
    if np.unique(order).size != order.size:
        raise ValueError(
            f"the partition assigns {order.size - np.unique(order).size} examples to more than "
            "one client; every example may belong to one client only."
        )
    return _build(jax.tree.map(lambda a: np.asarray(a)[order], examples), counts, test)


def _build(examples: Examples, counts: np.ndarray, test: Examples | None) -> FederatedData:
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    if test is not None:
        test = jax.tree.map(jnp.asarray, test)
    return FederatedData(
        examples=jax.tree.map(jnp.asarray, examples),
        offsets=jnp.asarray(offsets, jnp.int32),
        counts=jnp.asarray(counts, jnp.int32),
        test=test,
        num_clients=len(counts),
        max_count=int(counts.max()),
    )
