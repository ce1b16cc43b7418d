"""Each column of an ``[S, D]`` matrix sorted, by a bitonic network of elementwise min/max
instead of ``jnp.sort``: XLA's CPU sort along the client axis costs ~130 ns an element
(100 ms for S = 100 rows of W1's 7,850 parameters, 12× the whole mean round), the network
~15× less (benchmarks/README.md, "Robust aggregation"). Rows are padded to a power of two
with +inf, which sorts last; the network is ⌈log₂ S⌉(⌈log₂ S⌉ + 1)/2 compare-exchange
layers, each one pass over the matrix, unrolled at trace time (S is static).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sort_rows(x: jax.Array) -> jax.Array:
    """``x [S, D]`` with every column in ascending order (the values of ``jnp.sort(x,
    axis=0)``; NaN-free input)."""
    count, size = x.shape
    n = 1 << max(1, (count - 1).bit_length())
    x = jnp.concatenate([x, jnp.full((n - count, size), jnp.inf, x.dtype)], 0)
    k = 2
    while k <= n:
        j = k // 2
        while j >= 1:
            # Pairs (i, i + j) within blocks of 2j; a block sorts up where bit k of i is 0.
            pairs = x.reshape(n // (2 * j), 2, j, size)
            lo = jnp.minimum(pairs[:, 0], pairs[:, 1])
            hi = jnp.maximum(pairs[:, 0], pairs[:, 1])
            up = (((np.arange(n // (2 * j)) * 2 * j) & k) == 0)[:, None, None]
            x = jnp.stack([jnp.where(up, lo, hi), jnp.where(up, hi, lo)], 1).reshape(n, size)
            j //= 2
        k *= 2
    return x[:count]
