"""A Little Is Enough (Baruch, Baruch, Goldberg, NeurIPS 2019): an omniscient attacker
hides inside the benign spread, coordinate by coordinate.

``alie(u, malicious, benign, key, z=None) -> [S, D]`` on one uplink entry of the sampled
clients, flattened: u float32 [S, D] (rows of clients that did not report may hold
anything: they are masked out exactly), ``malicious`` bool [S] (reporting and in M),
``benign`` bool [S] (reporting, not in M), ``key`` unused. With n = |benign| + |malicious|
reporting and m = |malicious|: s = max(1, ⌊n/2 + 1⌋ − m), z = Φ⁻¹((n − s)/n), and every
malicious client sends μ − z·σ, μ and σ the coordinate-wise mean and population standard
deviation (ddof 0) of the benign rows only. No benign client reported: it sends its u.
Only malicious rows change.

``z`` overrides the computed z: None (static) or a NaN value (traced, e.g. a sweep's
config where some runs compute it) means "compute"; any other scalar is used as given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri


def alie_z(n: Any, m: Any) -> tuple[jax.Array, jax.Array]:
    """(s, z) for n reporting clients of which m malicious, int32 and float32: z = −∞
    where s = n (m = 0, no attacker to place), and (1, 0) for n = 0."""
    n, m = jnp.asarray(n, jnp.int32), jnp.asarray(m, jnp.int32)
    s = jnp.maximum(1, n // 2 + 1 - m)
    p = (n - s).astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)
    return s, ndtri(jnp.where(n >= 1, jnp.clip(p, 0.0, 1.0), 0.5))


def alie(
    u: jax.Array, malicious: jax.Array, benign: jax.Array, key: jax.Array, z: Any = None
) -> jax.Array:
    """μ − z·σ of the benign rows on the malicious rows (u without benign rows), u elsewhere."""
    nb = jnp.sum(benign)
    _, computed = alie_z(nb + jnp.sum(malicious), jnp.sum(malicious))
    if z is not None:
        z = jnp.asarray(z, jnp.float32)
        computed = jnp.where(jnp.isnan(z), computed, z)
    count = jnp.maximum(nb, 1).astype(u.dtype)
    mean = jnp.sum(jnp.where(benign[:, None], u, 0.0), axis=0) / count
    var = jnp.sum(jnp.where(benign[:, None], jnp.square(u - mean[None, :]), 0.0), axis=0) / count
    # z is finite wherever a malicious row meets a benign one (m >= 1 and n − m >= 1 give
    # 1 <= s <= n/2); elsewhere the branch is unused, kept free of NaN all the same.
    z = jnp.where(jnp.isfinite(computed), computed, 0.0).astype(u.dtype)
    attacked = mean - z * jnp.sqrt(var)
    return jnp.where(malicious[:, None], jnp.where(nb > 0, attacked[None, :], u), u)
