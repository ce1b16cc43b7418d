"""Krum and Multi-Krum over the reporting rows (Blanchard, El Mhamdi, Guerraoui, Stainer,
"Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017).

``rows [S, D]`` float32 (a client's whole message per row), ``mask [S]`` bool (who
reported, n = mask.sum()), ``f`` the assumed Byzantine count and ``m`` the number averaged,
integer-valued, possibly traced. score(i) = the sum of the q = max(1, n − f − 2) smallest
‖u_i − u_j‖² over reporting j ≠ i (n − f − 2, not n − f). q is capped at the n − 1
neighbours i has, so a lone reporting row scores 0 and is selected.

- ``krum(rows, mask, f) -> (agg [D], selected [S])``: the reporting row of lowest score;
  ties go to the earliest index.
- ``multikrum(rows, mask, f, m) -> (agg [D], selected [S])``: the mean of the m
  lowest-score reporting rows, m clipped to [1, n]; ties by index (a stable order).

``selected`` marks the rows averaged. Rows not reporting are ignored exactly (zeroed before
any arithmetic, never selected). n = 0 gives zeros and nothing selected.

The distances come from one Gram matrix G = U Uᵀ (full float32 precision):
d_ij = G_ii + G_jj − 2 G_ij, clamped at 0. The cancellation makes d_ij exact only to about
float32 eps·(‖u_i‖² + ‖u_j‖²), so rows much closer than their norms can tie or swap order;
identical rows have distance exactly 0 and equal scores. An overflowing distance (inf or
NaN, from huge reporting values) counts as +inf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _order(rows: jax.Array, mask: jax.Array, f: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x, n, order): rows zeroed outside the mask, n, and the rows by (not reporting,
    score, index): the reporting rows first, lowest score first."""
    mask = jnp.asarray(mask).astype(bool)
    size = rows.shape[0]
    n = jnp.sum(mask, dtype=jnp.int32)
    x = jnp.where(mask[:, None], rows, jnp.zeros_like(rows))
    gram = jnp.matmul(x, x.T, precision=jax.lax.Precision.HIGHEST)
    sq = jnp.diagonal(gram)
    d = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)
    pair = mask[:, None] & mask[None, :] & ~jnp.eye(size, dtype=bool)
    d = jnp.where(pair & ~jnp.isnan(d), d, jnp.inf)
    q = jnp.maximum(1, n - jnp.asarray(f).astype(jnp.int32) - 2)
    q = jnp.minimum(q, n - 1)  # the neighbours a reporting row has
    nearest = jnp.sort(d, axis=1)
    take = jnp.arange(size, dtype=jnp.int32) < q
    score = jnp.sum(jnp.where(take[None, :], nearest, jnp.zeros_like(nearest)), axis=1)
    return x, n, jnp.lexsort((score, ~mask))


def krum(rows: jax.Array, mask: jax.Array, f: Any) -> tuple[jax.Array, jax.Array]:
    """The reporting row of lowest Krum score and a one-hot ``selected`` (zeros if n = 0)."""
    x, n, order = _order(rows, mask, f)
    selected = (jnp.arange(rows.shape[0]) == order[0]) & (n > 0)
    return x[order[0]], selected


def multikrum(rows: jax.Array, mask: jax.Array, f: Any, m: Any) -> tuple[jax.Array, jax.Array]:
    """The mean of the m lowest-score reporting rows, and which rows those are."""
    x, n, order = _order(rows, mask, f)
    m = jnp.clip(jnp.asarray(m).astype(jnp.int32), 1, n)
    rank = jnp.zeros(rows.shape[0], jnp.int32).at[order].set(jnp.arange(rows.shape[0]))
    selected = rank < m
    total = jnp.sum(jnp.where(selected[:, None], x, jnp.zeros_like(x)), axis=0)
    return total / jnp.maximum(m, 1).astype(rows.dtype), selected
