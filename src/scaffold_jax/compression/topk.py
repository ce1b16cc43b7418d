"""Top-k sparsification with error feedback (Stich, Cordonnier, Jaggi, NeurIPS 2018;
Karimireddy, Rebjock, Stich, Jaggi, ICML 2019).

u = v + e_i; the sent m keeps the k = ⌈fraction·size⌉ entries of u of largest |u_j|
(ties: the lowest index first) and zeros elsewhere; e_i ← u − m. k is data (the fraction
is a hyper-parameter a sweep may vary in one program), so the selection cannot be
``lax.top_k`` (whose k must be static): :func:`keep_largest` finds the k-th largest
value by bisection on its 32 bits (32 counting passes, ~10x faster on a CPU than a stable
sort of every entry; benchmarks/bench_compression.py times it apart). Cost:
k·(32 + ⌈log₂ size⌉) bits (a value and an index per entry kept).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from scaffold_jax.compression import Compressor, fraction_count, register, whole
from scaffold_jax.types import HParam

HPARAMS = {
    "compress_fraction": HParam(
        0.01,
        "topk, randk: fraction of each leaf's entries sent, in (0, 1]",
        maximum=1.0,
        tradeoff=True,
    )
}


def keep_largest(keys, k):
    """The mask of the k largest of the ``uint32`` vector ``keys`` (ties: the lowest index
    first), for a traced k in [1, size]: the k-th largest value t is built bit by bit from
    the top (the largest t with at least k keys >= t), then every key above t is kept and
    as many keys equal to t, in index order, as k leaves."""

    def bit(i, t):
        candidate = t | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(jnp.sum(keys >= candidate) >= k, candidate, t)

    t = jax.lax.fori_loop(0, 32, bit, jnp.uint32(0))
    above, tied = keys > t, keys == t
    return above | (tied & (jnp.cumsum(tied) <= k - jnp.sum(above)))


def apply(v, key, residual, hparams):
    del key
    u = v + residual
    # |u|'s bit patterns order as its values do (non-negative floats).
    magnitude = jax.lax.bitcast_convert_type(jnp.abs(u), jnp.uint32)
    k = fraction_count(hparams["compress_fraction"], v.shape[0])
    sent = jnp.where(keep_largest(magnitude, k), u, 0.0)
    return sent, u - sent


def bits(size, hparams):
    k = whole(fraction_count(hparams["compress_fraction"], size))
    return k * (32 + math.ceil(math.log2(size)))


register(
    "topk", Compressor(apply, bits, error_feedback=True), HPARAMS,
    "top-k with error feedback (compress_fraction)",
)  # fmt: skip
