"""Scaled sign with error feedback (Karimireddy, Rebjock, Stich, Jaggi, ICML 2019):
u = v + e_i, m = (‖u‖₁/size)·sign(u), e_i ← u − m. Cost: size + 32 bits (a sign per entry
and the scale)."""

from __future__ import annotations

import jax.numpy as jnp

from scaffold_jax.compression import Compressor, register


def apply(v, key, residual, hparams):
    del key, hparams
    u = v + residual
    sent = jnp.sum(jnp.abs(u)) / u.shape[0] * jnp.sign(u)
    return sent, u - sent


def bits(size, hparams):
    del hparams
    return size + 32


register(
    "signef", Compressor(apply, bits, error_feedback=True), {},
    "scaled sign with error feedback",
)  # fmt: skip
