"""Client-axis pytree helpers: gather and scatter rows of the client table, masked means,
and whole arrays (even spread over processes) to host memory.

Every leaf of a client table has a leading ``[N, ...]`` client axis.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.types import PyTree


def take_rows(table: PyTree, ids: jax.Array) -> PyTree:
    """Rows ``ids`` (``[S]`` int32) of every leaf: ``[N, ...] -> [S, ...]``."""
    return jax.tree.map(lambda a: a[ids], table)


def set_rows(table: PyTree, ids: jax.Array, rows: PyTree, write: jax.Array | None = None) -> PyTree:
    """Writes ``rows`` (``[S, ...]``) at ``ids``; ids must be distinct.

    ``write`` (bool ``[S]``): only the rows where it is True are written; the others' table
    rows stay as they are (their ids are sent out of bounds and the scatter drops them, so
    the old rows need not be kept alive to be written back).

    Inside a jit whose client table is donated, XLA performs this scatter in place: no copy
    of the ``[N, ...]`` table is made per round.
    """
    mode, leaves = None, jax.tree.leaves(table)
    if write is not None and leaves:
        size = leaves[0].shape[0]
        # Distinct out-of-bounds ids (N, N + 1, ...), so the ids stay unique.
        ids = jnp.where(write, ids, size + jnp.arange(ids.shape[0], dtype=ids.dtype))
        mode = "drop"
    return jax.tree.map(
        lambda a, r: a.at[ids].set(r.astype(a.dtype), unique_indices=True, mode=mode),
        table,
        rows,
    )


def tree_bytes(tree: PyTree, min_width: int = 1) -> int:
    """Bytes of a pytree of arrays or ``ShapeDtypeStruct`` s, every element counted at
    least ``min_width`` bytes wide (4: as float32 once converted); PRNG keys left out."""
    return sum(
        math.prod(leaf.shape) * max(jnp.dtype(leaf.dtype).itemsize, min_width)
        for leaf in jax.tree.leaves(tree)
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )


def all_finite(tree: PyTree) -> jax.Array:
    """True (a bool scalar) when every floating-point value in ``tree`` is finite."""
    flags = [
        jnp.all(jnp.isfinite(a))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def weighted_mean(stacked: PyTree, weights: jax.Array) -> PyTree:
    """``Σ_s w_s t_s / Σ_s w_s`` over the leading axis of every leaf (float32); 0 when every
    weight is 0 (a round in which no sampled client takes part changes nothing)."""
    total = jnp.sum(weights)
    total = jnp.where(total > 0, total, 1.0)
    return jax.tree.map(
        lambda a: jnp.tensordot(weights, a.astype(jnp.float32), axes=1) / total, stacked
    )


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
    """``Σ_s w_s t_s`` over the leading axis of every leaf (float32)."""
    return jax.tree.map(lambda a: jnp.tensordot(weights, a.astype(jnp.float32), axes=1), stacked)


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``values`` over slots where ``mask`` is 1; 0 when the mask is empty."""
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def sq_norm(tree: PyTree) -> jax.Array:
    """Squared Euclidean norm of a whole pytree (0 for one without leaves: FedPer's Δφ
    when its head is every leaf)."""
    leaves = jax.tree.leaves(tree)
    return sum((jnp.sum(jnp.square(a.astype(jnp.float32))) for a in leaves), jnp.float32(0))


def to_host(tree: PyTree) -> PyTree:
    """Every leaf as a numpy array holding the GLOBAL value, on every process.

    On one process that is ``np.asarray``; with several, blocks owned by other processes
    are fetched with :func:`jax.experimental.multihost_utils.process_allgather` (a
    collective: every process must call it). Typed keys come back as their key data.
    """

    def one(a):
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jr.key_data(a)
        if not isinstance(a, jax.Array) or a.is_fully_addressable or a.is_fully_replicated:
            return np.asarray(a)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, tree)


def tree_digest(tree: PyTree) -> str:
    """SHA-256 of every leaf's dtype, shape and bytes (a typed PRNG key by its key data):
    two trees with the same digest hold the same arrays."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
            leaf = jr.key_data(leaf)
        array = np.ascontiguousarray(np.asarray(leaf))
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


_BITS = jnp.dtype(jnp.uint16)  # the storage of bfloat16 values: their bit patterns


def encode_storage(values: PyTree, dtype: Any) -> PyTree:
    """float32 values → a client table's storage form: float32, or for ``bfloat16`` their
    ``uint16`` bit patterns (rounded to nearest even). XLA's CPU backend has no bfloat16
    scatter: it converts a whole bfloat16 ``[N, ...]`` table to float32 and back to write a
    round's rows, where a ``uint16`` scatter writes them in place (SCAFFOLD's controls,
    compression's error-feedback residuals)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), values)
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"a client table is stored as float32 or bfloat16, not {dtype}.")
    return jax.tree.map(
        lambda a: jax.lax.bitcast_convert_type(jnp.asarray(a).astype(jnp.bfloat16), _BITS), values
    )


def decode_storage(stored: PyTree) -> PyTree:
    """:func:`encode_storage` 's form → float32 (exact: every bfloat16 is a float32)."""

    def one(a):
        a = jnp.asarray(a)
        if a.dtype == _BITS:
            a = jax.lax.bitcast_convert_type(a, jnp.bfloat16)
        return a.astype(jnp.float32)

    return jax.tree.map(one, stored)
