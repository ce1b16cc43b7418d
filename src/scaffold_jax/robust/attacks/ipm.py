"""Inner-product manipulation (Xie, Koyejo, Gupta, "Fall of Empires: Breaking Byzantine-
tolerant SGD by Inner Product Manipulation", UAI 2019).

``ipm(u, malicious, benign, key, epsilon=0.1) -> [S, D]`` on one uplink entry of the
sampled clients, flattened: u float32 [S, D] (rows of clients that did not report may hold
anything: they are masked out exactly), ``malicious`` bool [S] (reporting and in M),
``benign`` bool [S] (reporting, not in M), ``key`` unused. Every malicious client sends
−ε · (mean of the benign rows' honest messages); where no benign client reported it sends
its u. Only malicious rows change. ``epsilon`` may be a traced scalar.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def ipm(
    u: jax.Array, malicious: jax.Array, benign: jax.Array, key: jax.Array, epsilon: Any = 0.1
) -> jax.Array:
    """−ε·mean(benign rows) on the malicious rows (u without benign rows), u elsewhere."""
    nb = jnp.sum(benign)
    total = jnp.sum(jnp.where(benign[:, None], u, 0.0), axis=0)
    mean = total / jnp.maximum(nb, 1).astype(u.dtype)
    attacked = jnp.where(nb > 0, -jnp.asarray(epsilon, u.dtype) * mean[None, :], u)
    return jnp.where(malicious[:, None], attacked, u)
