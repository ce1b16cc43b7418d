"""What a checkpoint records to verify it, and the checks of a restore: the SHA-256 of every
leaf (of every block, for a leaf spread over processes: each process hashes its own, only
the digests travel, and the processes agree on whether a step verifies), of the root key
and of the metadata itself (:data:`FORMAT`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.types import PyTree

FORMAT = "scaffold_jax.checkpoint/1"


class _Corrupt(Exception):
    """Internal: one step is unreadable or fails verification."""


def _leaf_paths(tree: PyTree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _sha256(array: np.ndarray) -> str:
    # Hash the raw bytes (no copy for contiguous arrays); reshape first so 0-d arrays and
    # extension dtypes such as bfloat16 can be viewed as bytes.
    flat = np.ascontiguousarray(array).reshape(-1)
    return hashlib.sha256(flat.view(np.uint8).data).hexdigest()


def _spreads(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding`` puts blocks on other processes (never with one process)."""
    return not sharding.is_fully_addressable


def _is_spread(a: Any) -> bool:
    """Whether ``a`` is a (non-empty) jax.Array with blocks held by other processes."""
    return isinstance(a, jax.Array) and a.size > 0 and _spreads(a.sharding)


def _host_or_spread(a: Any) -> Any:
    """``a`` as saved: a jax.Array spread over processes as it is; anything else as a
    numpy array (typed keys as their key data)."""
    if isinstance(a, jax.Array):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jr.key_data(a)
        if _is_spread(a):
            return a
        if a.size == 0:  # nothing to fetch, from any process
            return np.zeros(a.shape, a.dtype)
    return np.asarray(a)


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A block's place in its array as text, e.g. ``"0:12,0:5,0:3"`` (``""`` for a scalar)."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _block_digests(a: jax.Array) -> dict[str, str]:
    """The SHA-256 of each block of ``a`` this process holds, one copy of each: the
    ``replica_id == 0`` one (another process hashes a block held by several)."""
    return {
        _block_key(s.index, a.shape): _sha256(np.asarray(s.data))
        for s in a.addressable_shards
        if s.replica_id == 0
    }


def _gather_block_digests(own: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    """Every process's block digests, merged (a collective with several processes).

    Only the digests travel: each process's ``own`` as JSON bytes, padded to the longest,
    through two ``process_allgather`` calls on small numpy arrays.
    """
    if jax.process_count() == 1:
        return own
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps({str(i): d for i, d in own.items()}).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    merged: dict[int, dict[str, str]] = {}
    for row, size in zip(rows, sizes, strict=True):
        for i, digests in json.loads(row[: int(size)].tobytes()).items():
            merged.setdefault(int(i), {}).update(digests)
    return merged


def _block_sharding(m: dict[str, Any], like: Any) -> jax.sharding.Sharding | None:
    """``like``'s sharding when the leaf ``m`` was saved in exactly its blocks and it spreads
    over processes (each process then reads its own blocks); None to read it whole.

    Decided from global information only, so every process decides alike."""
    sharding = getattr(like, "sharding", None)
    if "blocks" not in m or not isinstance(sharding, jax.sharding.Sharding):
        return None
    if not _spreads(sharding):
        return None
    shape = tuple(m["shape"])
    keys = {_block_key(i, shape) for i in sharding.devices_indices_map(shape).values()}
    return sharding if keys == set(m["blocks"]) else None


def _verified(value: Any, m: dict[str, Any]) -> bool:
    """Whether ``value`` (a numpy array, or a jax.Array of this process's blocks) has the
    shape, dtype and checksum(s) ``m`` records."""
    if list(value.shape) != m["shape"] or str(jnp.dtype(value.dtype)) != m["dtype"]:
        return False
    if "sha256" in m:  # one digest for the leaf: value is whole
        return _sha256(np.asarray(value)) == m["sha256"]
    blocks = m["blocks"]
    if isinstance(value, jax.Array):  # this process's blocks, replicas included
        pieces = [(_block_key(s.index, value.shape), s.data) for s in value.addressable_shards]
    else:  # read whole: check every block saved
        pieces = [(k, value[_block_slices(k)]) for k in blocks]
    return all(blocks.get(k) == _sha256(np.asarray(data)) for k, data in pieces)


def _block_slices(key: str) -> tuple[slice, ...]:
    if not key:
        return ()
    return tuple(slice(*(int(x) for x in part.split(":"))) for part in key.split(","))


def _split_key(key: jax.Array) -> tuple[str, np.ndarray]:
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jr.key_impl(key)), np.asarray(jr.key_data(key), np.uint32)
    if key.dtype != jnp.uint32 or key.ndim != 1:
        raise TypeError(
            f"key must be a typed PRNG key or raw uint32 key data, got {key.dtype}{key.shape}."
        )
    # Raw key data of the default implementation (what jax.random.PRNGKey returns).
    return str(jr.key_impl(jr.wrap_key_data(key))), np.asarray(key, np.uint32)


def _key_size(impl: str) -> int:
    return int(jr.key_data(jr.key(0, impl=impl)).shape[-1])


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, allow_nan=True).encode()).hexdigest()


def _verified_payload(meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint")
    payload = meta.get("payload")
    if not isinstance(payload, dict) or _digest(payload) != meta.get("sha256"):
        raise ValueError("metadata checksum mismatch")
    return payload


def _place(value: np.ndarray, like: Any) -> jax.Array:
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    # Spread over processes, but the checkpoint's blocks differ from this sharding's: every
    # process read the whole value and builds its own blocks from it.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _agree(err: _Corrupt | None) -> _Corrupt | None:
    """``err``, or a :class:`_Corrupt` if another process failed where this one did not.

    With several processes a collective: each reports whether it could read and verify
    the step, and the step counts as corrupt for all when it is for any.
    """
    if jax.process_count() == 1:
        return err
    from jax.experimental import multihost_utils

    failed = multihost_utils.process_allgather(np.asarray([err is not None], np.int32))
    failed = np.asarray(failed).reshape(-1)
    if err is None and failed.any():
        where = ", ".join(str(int(i)) for i in np.flatnonzero(failed))
        return _Corrupt(f"unreadable or failing verification on process(es) {where}")
    return err


def _check_matches(path: Path, saved: list[dict[str, Any]], like_state: PyTree) -> None:
    """Raises ValueError naming the differences if ``saved`` does not fit ``like_state``."""
    paths = _leaf_paths(like_state)
    like_leaves = jax.tree.leaves(like_state)
    problems = []
    if [m["path"] for m in saved] != paths:
        problems.append(
            f"it holds {len(saved)} arrays {[m['path'] for m in saved][:6]}, this simulation's "
            f"state has {len(paths)} {paths[:6]}"
        )
    else:
        for m, like in zip(saved, like_leaves, strict=True):
            shape, dtype = list(np.shape(like)), str(jnp.dtype(like.dtype))
            if m["shape"] != shape or m["dtype"] != dtype:
                problems.append(
                    f"{m['path']} is {m['dtype']}{tuple(m['shape'])} in the checkpoint but "
                    f"{dtype}{tuple(shape)} here"
                )
    if problems:
        # FedBuff's in-flight table has M rows (scaffold_jax.engine.buffered).
        table = " (.inflight: FedBuff's in-flight table, of another concurrency M)"
        raise ValueError(
            f"checkpoint {path} does not match this simulation: {'; '.join(problems[:3])}"
            f"{table if any('.inflight' in p for p in problems) else ''}. It was written by a "
            "run with another model, number of clients, algorithm or execution; resume with "
            "the same configuration or use another checkpoint directory."
        )
