"""Geometric median by smoothed Weiszfeld iterations: RFA (Pillutla, Kakade, Harchaoui,
"Robust Aggregation for Federated Learning", IEEE Transactions on Signal Processing 2022).

``geomed(rows, mask, iterations=8, nu=1e-6) -> [D]``: ``rows [S, D]`` float32 (a client's
whole message per row), ``mask [S]`` bool (who reported, n = mask.sum()). z⁰ = the mean of
the reporting rows, then ``iterations`` (a static Python int) times
z ← Σ β_i u_i / Σ β_i with β_i = 1 / max(ν, ‖u_i − z‖) over the reporting rows; ν (which
may be traced) bounds the weight of a row at z. Rows not reporting are ignored exactly
(zeroed and given weight 0). n = 0 gives zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def geomed(rows: jax.Array, mask: jax.Array, iterations: int = 8, nu: Any = 1e-6) -> jax.Array:
    """The smoothed Weiszfeld estimate of the reporting rows' geometric median."""
    mask = jnp.asarray(mask).astype(bool)
    x = jnp.where(mask[:, None], rows, jnp.zeros_like(rows))
    nu = jnp.asarray(nu).astype(rows.dtype)
    n = jnp.sum(mask, dtype=jnp.int32).astype(rows.dtype)
    z0 = jnp.sum(x, axis=0) / jnp.maximum(n, 1.0)

    def step(_: Any, z: jax.Array) -> jax.Array:
        distance = jnp.linalg.norm(x - z[None, :], axis=1)
        beta = jnp.where(mask, 1.0 / jnp.maximum(nu, distance), jnp.zeros_like(distance))
        total = jnp.sum(beta[:, None] * x, axis=0)
        weight = jnp.sum(beta)
        return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1.0), z)

    return jax.lax.fori_loop(0, int(iterations), step, z0)
