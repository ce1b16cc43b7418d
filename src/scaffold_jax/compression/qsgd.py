"""QSGD: unbiased stochastic quantization to s = 2^(b−1) − 1 levels of the leaf's norm.

Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS 2017. For v with ‖v‖₂ > 0: ℓ_j = ⌊s|v_j|/‖v‖⌋ and
Q(v)_j = ‖v‖·sign(v_j)·(ℓ_j + ξ_j)/s, ξ_j ~ Bernoulli(s|v_j|/‖v‖ − ℓ_j), so E Q(v) = v
(Q(0) = 0). Cost: 32 + b·size bits (the norm, and a sign and a level per entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.compression import Compressor, register
from scaffold_jax.types import HParam

HPARAMS = {
    "compress_bits": HParam(
        8.0,
        "qsgd: bits per entry b (a sign and 2^(b-1)-1 levels), an integer in [2, 16]",
        maximum=16.0,
        minimum=2.0,
        integer=True,
        tradeoff=True,
    )
}


def levels(bits):
    """s = 2^(b−1) − 1 quantization levels for b bits (b an integer >= 2)."""
    return jnp.exp2(jnp.round(bits) - 1.0) - 1.0


def apply(v, key, residual, hparams):
    del residual
    s = levels(hparams["compress_bits"])
    norm = jnp.sqrt(jnp.sum(v * v))
    scaled = jnp.where(norm > 0, s * jnp.abs(v) / jnp.where(norm > 0, norm, 1.0), 0.0)
    low = jnp.floor(scaled)
    up = (jr.uniform(key, v.shape) < scaled - low).astype(jnp.float32)
    return jnp.where(norm > 0, norm * jnp.sign(v) * (low + up) / s, 0.0), None


def bits(size, hparams):
    b = hparams["compress_bits"]
    return 32 + (jnp.round(b) if isinstance(b, jax.Array) else round(b)) * size


register("qsgd", Compressor(apply, bits), HPARAMS, "QSGD, unbiased (compress_bits b)")
