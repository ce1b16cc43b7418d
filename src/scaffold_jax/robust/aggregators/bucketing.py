"""Bucketing (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets
via Bucketing", ICLR 2022): before a robust aggregator, the reporting clients are shuffled
and averaged in buckets of s, and the aggregator runs over the bucket means.

``bucket(rows, mask, key, size) -> (means [S, D], bucket_mask [S], bucket_of [S] int32)``:
``rows [S, D]`` float32, ``mask [S]`` bool (who reported, n = mask.sum()), ``key`` a PRNG
key, ``size`` s ≥ 1 (possibly traced). A random permutation of the n reporting clients is
drawn from ``key`` (the rows ordered by (not reporting, uniform draw)), and each run of s
consecutive clients in that order is a bucket (the last may be smaller). Row b of ``means``
is bucket b's mean for b < ⌈n/s⌉ (``bucket_mask``); the other rows are zero and masked.
``bucket_of[i]`` is row i's bucket, −1 for a row not reporting. Rows not reporting are
ignored exactly.

With s = 1 the means are the reporting rows permuted, so a permutation-invariant
aggregator gives the unbucketed aggregate up to float rounding (summation order); Krum's
ties may fall differently (they go to the earliest row in the permuted order). A caller
that knows s = 1 statically skips bucketing to keep the run bitwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def bucket(
    rows: jax.Array, mask: jax.Array, key: jax.Array, size: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The bucket means of a random permutation of the reporting rows."""
    mask = jnp.asarray(mask).astype(bool)
    count = rows.shape[0]
    n = jnp.sum(mask, dtype=jnp.int32)
    size = jnp.maximum(jnp.asarray(size).astype(jnp.int32), 1)
    order = jnp.lexsort((jax.random.uniform(key, (count,)), ~mask))
    position = jnp.zeros(count, jnp.int32).at[order].set(jnp.arange(count, dtype=jnp.int32))
    bucket_of = jnp.where(mask, position // size, -1)
    segment = jnp.where(mask, bucket_of, count)  # out of range: dropped by segment_sum
    x = jnp.where(mask[:, None], rows, jnp.zeros_like(rows))
    sums = jax.ops.segment_sum(x, segment, num_segments=count)
    members = jax.ops.segment_sum(mask.astype(rows.dtype), segment, num_segments=count)
    bucket_mask = jnp.arange(count, dtype=jnp.int32) < (n + size - 1) // size
    means = sums / jnp.maximum(members, 1.0)[:, None]
    return means, bucket_mask, bucket_of.astype(jnp.int32)
