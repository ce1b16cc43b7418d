"""Random-k sparsification, unbiased: k = ⌈fraction·size⌉ entries drawn uniformly without
replacement, scaled by size/k, zeros elsewhere (E m = v). Cost: 32·k + 64 bits (the
values, and the 64-bit seed the server redraws the positions from).

The k entries are those of the k largest of size independent 32-bit random words
(:func:`~scaffold_jax.compression.topk.keep_largest`, no sort): a uniform k-subset, up to
ties between two words at the k-th (probability below size·2⁻³² per leaf, broken by
index)."""

from __future__ import annotations

import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.compression import Compressor, fraction_count, register, whole
from scaffold_jax.compression.topk import HPARAMS, keep_largest


def apply(v, key, residual, hparams):
    del residual
    size = v.shape[0]
    k = fraction_count(hparams["compress_fraction"], size)
    chosen = keep_largest(jr.bits(key, (size,), jnp.uint32), k)
    return jnp.where(chosen, v * (size / k.astype(jnp.float32)), 0.0), None


def bits(size, hparams):
    return 32 * whole(fraction_count(hparams["compress_fraction"], size)) + 64


register("randk", Compressor(apply, bits), HPARAMS, "random-k, unbiased (compress_fraction)")
