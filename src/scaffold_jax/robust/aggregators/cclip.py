"""Centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
Optimization", ICML 2021).

``cclip(rows, mask, centre, tau, iterations=1) -> [D]``: ``rows [S, D]`` float32 (a
client's whole message per row), ``mask [S]`` bool (who reported, n = mask.sum()),
``centre [D]`` the starting point v⁰ (the previous round's aggregate), ``tau`` the radius
(possibly traced, may be +inf). ``iterations`` L (a static Python int) times:
v ← v + (1/n) Σ_i (u_i − v)·min(1, τ/‖u_i − v‖) over the reporting rows, a zero distance
giving factor 1. τ = ∞ with L = 1 is the mean of the reporting rows (to float rounding).
Rows not reporting are ignored exactly. n = 0 returns the centre unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cclip(
    rows: jax.Array, mask: jax.Array, centre: jax.Array, tau: Any, iterations: int = 1
) -> jax.Array:
    """The centered-clipping aggregate of the reporting rows, started at ``centre``."""
    mask = jnp.asarray(mask).astype(bool)
    x = jnp.where(mask[:, None], rows, jnp.zeros_like(rows))
    tau = jnp.asarray(tau).astype(rows.dtype)
    n = jnp.sum(mask, dtype=jnp.int32).astype(rows.dtype)
    v0 = jnp.asarray(centre).astype(rows.dtype)

    def step(_: Any, v: jax.Array) -> jax.Array:
        diff = x - v[None, :]
        distance = jnp.linalg.norm(diff, axis=1)
        positive = distance > 0
        factor = jnp.minimum(1.0, tau / jnp.where(positive, distance, 1.0))
        factor = jnp.where(mask, jnp.where(positive, factor, 1.0), 0.0)
        return v + jnp.sum(factor[:, None] * diff, axis=0) / jnp.maximum(n, 1.0)

    return jax.lax.fori_loop(0, int(iterations), step, v0)
