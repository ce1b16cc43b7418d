"""Sign flipping: every malicious client sends m = −scale·u, u its honest message.

``signflip(u, malicious, benign, key, scale=1.0) -> [S, D]`` on one uplink entry of the
sampled clients, flattened: u float32 [S, D] (rows of clients that did not report may hold
anything), ``malicious`` bool [S] (reporting and in M), ``benign`` bool [S] (reporting, not
in M; unused here), ``key`` unused. Only malicious rows change. ``scale`` may be a traced
scalar (a swept hyper-parameter).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def signflip(
    u: jax.Array, malicious: jax.Array, benign: jax.Array, key: jax.Array, scale: Any = 1.0
) -> jax.Array:
    """−scale·u on the malicious rows, u elsewhere."""
    attacked = -jnp.asarray(scale, u.dtype) * u
    return jnp.where(malicious[:, None], attacked, u)
