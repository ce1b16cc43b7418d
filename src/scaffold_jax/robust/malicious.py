"""The malicious set M: the first ⌊round(f·N, 9)⌋ clients of a permutation of the ids,
drawn once per run from ``fold_in(run_key, MALICIOUS_STREAM)``. M is a rank mask (client i
is malicious iff its position is below the count): the sets of f₁ < f₂ are nested, and f
may be swept (float32 data) in one program.

The count reads f as the decimal D·10⁻ᵖ of 6 significant digits that float32 holds exactly
(as :mod:`scaffold_jax.compression.fraction` does) and takes ⌊D·N / 10ᵖ⌋ in exact integer
arithmetic: 0.1, 0.3, 0.49, ... of any N < 2³¹ give ⌊round(f·N, 9)⌋ as typed. (A float32
f·N with a relative tolerance is not enough: near N = 10⁷ float32 steps by 0.5, and a
tolerance of 2⁻²⁰ is ~5 clients.) f = 0: nobody.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax.compression.fraction import _digits, _geq, _mul64

#: The stream of the run's key the permutation is drawn from ("mal").
MALICIOUS_STREAM = 0x6D616C


def ranks(run_key: jax.Array, num_clients: int) -> jax.Array:
    """int32 [N]: each client id's position in the run's permutation of 0..N−1."""
    perm = jax.random.permutation(jax.random.fold_in(run_key, MALICIOUS_STREAM), num_clients)
    return jnp.zeros(num_clients, jnp.int32).at[perm].set(jnp.arange(num_clients, dtype=jnp.int32))


def count(fraction: Any, num_clients: int) -> Any:
    """|M| = ⌊f·N⌋ with f read to 6 significant digits: an int32 numpy scalar for a host
    fraction, an int32 JAX scalar for a JAX (possibly traced) one; N static."""
    n = int(num_clients)
    if not isinstance(fraction, jax.Array):
        digits, places = _digits(fraction, np)
        return np.int32(int(digits) * n // 10 ** int(places))
    digits, places = _digits(fraction, jnp)
    # N = A·10ᵖ + B tabulated per p: ⌊D·N/10ᵖ⌋ = D·A + ⌊D·B/10ᵖ⌋, the last from a float32
    # estimate (off by < 1) and the largest neighbour c with c·10ᵖ <= D·B, exactly in 64 bits.
    powers = [10**p for p in range(16)]
    whole = jnp.asarray([n // q for q in powers], jnp.int32)[places]
    rest = jnp.asarray([n % q for q in powers], jnp.uint32)[places]
    lo = jnp.asarray([q & 0xFFFFFFFF for q in powers], jnp.uint32)[places]
    hi = jnp.asarray([q >> 32 for q in powers], jnp.uint32)[places]
    d = digits.astype(jnp.uint32)
    power = jnp.asarray(np.array(powers, np.float32))[places]
    estimate = jnp.floor(d.astype(jnp.float32) * rest.astype(jnp.float32) / power)
    c = jnp.maximum(estimate.astype(jnp.int32) + jnp.arange(-1, 2), 0).astype(jnp.uint32)
    c_hi, c_lo = _mul64(c, lo)
    fits = _geq(_mul64(d, rest), (c_hi + c * hi, c_lo))
    return digits * whole + jnp.max(jnp.where(fits, c, 0)).astype(jnp.int32)


def is_malicious(run_key: jax.Array, num_clients: int, fraction: Any, ids: Any) -> jax.Array:
    """bool [len(ids)]: whether each client id is in M (rank below :func:`count`)."""
    return ranks(run_key, num_clients)[ids] < count(fraction, num_clients)
