"""Coordinate-wise median over the reporting rows (Yin, Chen, Ramchandran, Bartlett,
"Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

``median(rows, mask) -> [D]``: ``rows [S, D]`` float32, one client's whole message per row;
``mask [S]`` bool, who reported (n = mask.sum(), 0 to S, may be traced). Per coordinate, the
median of the n reporting values; for n even the mean of the two middle values (so n ≤ 2
gives the mean). Rows not reporting are ignored exactly, whatever they hold: each column is
sorted (:func:`~scaffold_jax.robust.aggregators.sorting.sort_rows`) with them replaced by
+inf, then positions (n−1)//2 and n//2 are read. n = 0 gives
zeros. jit- and vmap-compatible (no Python branching on n).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scaffold_jax.robust.aggregators.sorting import sort_rows


def median(rows: jax.Array, mask: jax.Array) -> jax.Array:
    """The coordinate-wise median of the reporting rows (zeros when none reported)."""
    mask = jnp.asarray(mask).astype(bool)
    n = jnp.sum(mask, dtype=jnp.int32)
    ordered = sort_rows(jnp.where(mask[:, None], rows, jnp.inf))
    lo = jnp.take(ordered, jnp.maximum((n - 1) // 2, 0), axis=0)
    hi = jnp.take(ordered, n // 2, axis=0)
    return jnp.where(n > 0, 0.5 * (lo + hi), jnp.zeros_like(lo))
