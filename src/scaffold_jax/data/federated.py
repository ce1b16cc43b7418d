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
from scaffold_jax.tree import tree_digest

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
      client_test: each client's own test examples (a natural dataset's test split, or a
        held-out fraction of its data), flat and client by client like ``examples``, or
        None; :func:`with_client_tests` attaches them. They feed the per-client metrics
        (:func:`scaffold_jax.engine.client_evaluation`).
      client_test_counts: ``[N]`` int32, test examples per client (0 allowed), or None.
      max_test_count: max_i client_test_counts[i] (static; the padded width of the
        personalized evaluation), 0 without client test data.
      num_clients: N (static).
      max_count: max_i counts[i] (static; the padded width of full-batch plans).
    """

    examples: Examples
    offsets: jax.Array
    counts: jax.Array
    test: Examples | None
    num_clients: int = flax.struct.field(pytree_node=False)
    max_count: int = flax.struct.field(pytree_node=False)
    client_test: Examples | None = None
    client_test_counts: jax.Array | None = None
    max_test_count: int = flax.struct.field(pytree_node=False, default=0)

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
    for i, ix in enumerate(client_indices):
        ix = np.asarray(ix)
        if not np.issubdtype(ix.dtype, np.integer):
            # np.int64(...) would silently truncate 2.7 to 2 (and read a mask as 0 / 1).
            raise ValueError(
                f"client {i}'s partition indices are {ix.dtype} values (e.g. "
                f"{ix.flat[0].item()!r}); indices must be integers: give each client an "
                "integer array of example indices."
            )
    order = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in client_indices])
    num_examples = int(np.shape(jax.tree.leaves(examples)[0])[0])
    if order.min() < 0 or order.max() >= num_examples:
        raise ValueError(
            f"the partition holds indices outside [0, {num_examples}), the number of examples; "
            "partition the same examples you pass."
        )
    # A count per example, not np.unique: a sort of millions of rows (Shakespeare's) took
    # seconds.
    distinct = np.count_nonzero(np.bincount(order, minlength=num_examples))
    if distinct != order.size:
        raise ValueError(
            f"the partition assigns {order.size - distinct} examples to more than "
            "one client; every example may belong to one client only."
        )
    if order.size == num_examples and np.array_equal(order, np.arange(num_examples)):
        # The pool is already client by client (a natural dataset's): a plain copy, not a
        # gather (still a copy: on CPU the device array would share the caller's memory).
        return _build(jax.tree.map(np.array, examples), counts, test, order)
    return _build(jax.tree.map(lambda a: np.asarray(a)[order], examples), counts, test, order)


def with_client_tests(data: FederatedData, tests: Sequence[Examples]) -> FederatedData:
    """``data`` with every client's own test examples (``tests[i]`` for client i; a client
    may have none), for the per-client metrics.

    Raises:
      ValueError: not one test split per client, or no client with a test example.
    """
    if len(tests) != data.num_clients:
        raise ValueError(
            f"{len(tests)} client test splits for {data.num_clients} clients: give one per "
            "client (an empty one for a client without test examples)."
        )
    counts = np.asarray([len(jax.tree.leaves(t)[0]) for t in tests])
    if counts.sum() == 0:
        raise ValueError("no client has a test example: per-client metrics need some.")
    examples = jax.tree.map(lambda *leaves: np.concatenate(leaves, axis=0), *tests)
    _check_values(examples, lambda row: f"client test example {row}")
    return data.replace(
        client_test=jax.tree.map(jnp.asarray, examples),
        client_test_counts=jnp.asarray(counts, jnp.int32),
        max_test_count=int(counts.max()),
    )


def _build(
    examples: Examples, counts: np.ndarray, test: Examples | None, order: np.ndarray | None = None
) -> FederatedData:
    """``order``: row r of ``examples`` is example ``order[r]`` of the caller's pool (a
    partition), for the messages."""
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def client_row(row: int) -> str:
        client = int(np.searchsorted(offsets, row, side="right")) - 1
        pool = "" if order is None else f", example {int(order[row])} of the examples passed"
        return f"client {client}'s example {row - int(offsets[client])}{pool}"

    _check_values(examples, client_row)
    if test is not None:
        leaves = jax.tree.leaves(test)
        if leaves and np.ndim(leaves[0]) and np.shape(leaves[0])[0] == 0:
            raise ValueError(
                "the test set is empty (0 examples): give it at least one example, or pass "
                "test=None to build the data without one."
            )
        _check_values(test, lambda row: f"test example {row}")
        test = jax.tree.map(jnp.asarray, test)
    return FederatedData(
        examples=jax.tree.map(jnp.asarray, examples),
        offsets=jnp.asarray(offsets, jnp.int32),
        counts=jnp.asarray(counts, jnp.int32),
        test=test,
        num_clients=len(counts),
        max_count=int(counts.max()),
    )


def _check_values(examples: Examples, where) -> None:
    """Refuses values that the move to the device would change silently, or that make every
    run diverge: NaN/Inf floats, floats beyond float32 (inf there), integers beyond the
    device's int32 (they would wrap). One pass per leaf (min and max); ``where(row)`` names
    the example of a bad row."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(examples):
        if not getattr(leaf, "is_fully_addressable", True) or not np.ndim(leaf):
            continue
        a = np.asarray(leaf)
        if a.size == 0:
            continue
        field = jax.tree_util.keystr(path) or "the examples"
        target = jax.dtypes.canonicalize_dtype(a.dtype)  # what jnp.asarray will make of it
        if np.issubdtype(a.dtype, np.floating):
            limit = float(np.finfo(target).max) if np.issubdtype(target, np.floating) else np.inf
            lo, hi = a.min(), a.max()  # NaN propagates through both
            if np.isfinite(lo) and np.isfinite(hi) and -limit <= lo and hi <= limit:
                continue
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(a) | (np.abs(a) > limit)
            row, value = _first(bad, a)
            if np.isfinite(value):
                kind = f"a value beyond {target}'s range (the device stores {a.dtype} as {target})"
            else:
                kind = "a non-finite value"
            finite_in = "" if target == a.dtype else f"in {target} "
            raise ValueError(
                f"the field {field} holds {kind}: {value!r} at {where(row)}. Features must be "
                f"finite {finite_in}(a NaN or Inf makes every run diverge); drop or repair "
                "those examples first (e.g. np.nan_to_num)."
            )
        elif np.issubdtype(a.dtype, np.integer) and target != a.dtype:
            info = np.iinfo(target)
            lo, hi = int(a.min()), int(a.max())
            if info.min <= lo and hi <= info.max:
                continue
            row, value = _first((a < info.min) | (a > info.max), a)
            raise ValueError(
                f"the field {field} holds {value!r} at {where(row)}, outside {target} (the "
                f"device stores {a.dtype} as {target}, where it would wrap); use values in "
                f"[{info.min}, {info.max}] (e.g. remap labels to 0..C-1)."
            )


def _first(bad: np.ndarray, a: np.ndarray) -> tuple[int, Any]:
    """The example (leading index) of the first True in ``bad`` and its value."""
    flat = int(np.flatnonzero(bad.reshape(-1))[0])
    return flat // max(1, a[0].size), a.reshape(-1)[flat].item()


def data_fingerprint(data: Any) -> str:
    """SHA-256 of a federated dataset's arrays (a materialised one's examples, counts and
    test set; a procedural one's keys, constants and counts): two runs on the same
    fingerprint trained on the same data, client for client. Part of every run's
    identity, so a resume onto other data (another subset, partition seed, file) is
    refused, and the same data read from another folder is not."""
    return tree_digest(
        (data.examples, data.counts, data.test) if hasattr(data, "examples") else data
    )
