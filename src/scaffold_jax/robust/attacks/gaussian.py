"""Gaussian noise: every malicious client sends m ~ N(0, σ² I) in place of its message.

``gaussian(u, malicious, benign, key, sigma=1.0) -> [S, D]`` on one uplink entry of the
sampled clients, flattened: u float32 [S, D], ``malicious`` bool [S] (reporting and in M),
``benign`` unused. Row i's noise is drawn from ``jax.random.split(key, S)[i]``; the caller
folds the entry's index into ``key`` (one key per round, client and entry). Only malicious
rows change. ``sigma`` may be a traced scalar (a swept hyper-parameter).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def gaussian(
    u: jax.Array, malicious: jax.Array, benign: jax.Array, key: jax.Array, sigma: Any = 1.0
) -> jax.Array:
    """σ·N(0, I) noise on the malicious rows (row i from split(key, S)[i]), u elsewhere."""
    keys = jax.random.split(key, u.shape[0])
    noise = jax.vmap(lambda k: jax.random.normal(k, u.shape[1:], u.dtype))(keys)
    return jnp.where(malicious[:, None], jnp.asarray(sigma, u.dtype) * noise, u)
