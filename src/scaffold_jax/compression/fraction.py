"""The entry count k = ⌈fraction·size⌉ of ``topk`` and ``randk``, exact at every leaf size.

The fraction is a hyper-parameter, so the compiled round holds it as float32 data (a
sweep varies it in one program), and float32 cannot tell 0.3 from its neighbours well
enough for a leaf of millions of entries: ⌈float32(0.3)·2²⁴⌉ is one more than
⌈0.3·2²⁴⌉, and no tolerance fixes every case. So the count is not taken from the float32
product. The fraction is read back as the decimal of 6 significant digits d = D·10⁻ᵖ
that float32 holds exactly (every value a user types with up to 6 significant digits is
recovered as typed; a longer one is rounded to 6), and k = ⌈D·size / 10ᵖ⌉ is computed in
exact integer arithmetic: 64-bit products built from 32-bit halves in the program (JAX
runs without 64-bit types by default), Python integers on the host. Both read D and p
with the same float32 operations, so the bytes counted on the host are those the
program sends.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Significant digits of the fraction that float32 carries exactly (2⁻²⁴ < ½·10⁻⁶).
DIGITS = 6
#: 10⁻ʲ for j = 0..9: the number of them above the fraction is ⌊-log10⌋ + 1, which fixes
#: the decimal places p = DIGITS - 1 + that (at most 15). Below 1e-10 the digits are
#: fewer, and every leaf a model can have (< 2³¹ entries) gets k = 1 all the same.
_DECADES = np.array([10.0**-j for j in range(10)], np.float32)
_MAX_SIZE = 2**31 - 1
#: 10ᵖ for p = 0..15 in float32 (exact to 10¹⁰, the nearest float32 beyond).
_POWERS = np.array([10.0**p for p in range(16)], np.float32)


def _digits(fraction: Any, xp: Any) -> tuple[Any, Any]:
    """(D, p): the fraction's 6 significant digits as an integer and its decimal places,
    from float32 operations that numpy and XLA compute alike."""
    f = xp.asarray(fraction, xp.float32)
    places = DIGITS - 1 + xp.sum(f < xp.asarray(_DECADES), dtype=xp.int32)
    scale = xp.asarray(_POWERS)[places]
    return xp.round(f * scale).astype(xp.int32), places


def _check_size(size: int) -> int:
    size = int(size)
    if not 1 <= size <= _MAX_SIZE:
        raise ValueError(f"a leaf of {size} entries cannot be compressed: 1 to 2**31 - 1.")
    return size


def fraction_count(fraction: Any, size: int) -> Any:
    """k = ⌈fraction·size⌉ in [1, size], with the fraction read to 6 significant digits
    (see the module docstring): 0.07 of 100 is 7 and 0.3 of 2²⁴ + 1 is 5,033,166.

    Args:
      fraction: in (0, 1]: a number on the host (the bytes counted), a float32 JAX value
        in the program (traced: a sweep's config).
      size: the leaf's number of entries (static).

    Returns:
      An int32 numpy scalar for a host fraction, an int32 JAX scalar for a JAX one.
    """
    size = _check_size(size)
    if not isinstance(fraction, jax.Array):
        digits, places = _digits(fraction, np)
        k = -(-int(digits) * size // 10 ** int(places))
        return np.int32(min(max(k, 1), size))
    digits, places = _digits(fraction, jnp)
    # size = A·10ᵖ + B, tabulated for every p: k = D·A + ⌈D·B / 10ᵖ⌉ (D·A <= size since
    # D·10⁻ᵖ <= 1, and D·B < 2⁵¹ is where 64 bits are needed).
    powers = [10**p for p in range(16)]
    whole = jnp.asarray([size // q for q in powers], jnp.int32)[places]
    rest = jnp.asarray([size % q for q in powers], jnp.uint32)[places]
    power_lo = jnp.asarray([q & 0xFFFFFFFF for q in powers], jnp.uint32)[places]
    power_hi = jnp.asarray([q >> 32 for q in powers], jnp.uint32)[places]
    d = digits.astype(jnp.uint32)
    target = _mul64(d, rest)
    # A float32 estimate of ⌈D·B / 10ᵖ⌉ (< 10⁶, off by well under 1), then the smallest of
    # its neighbours c with c·10ᵖ >= D·B, compared exactly.
    power = jnp.asarray(_POWERS)[places]
    estimate = jnp.ceil(d.astype(jnp.float32) * rest.astype(jnp.float32) / power)
    candidates = jnp.maximum(estimate.astype(jnp.int32) + jnp.arange(-1, 2), 0).astype(jnp.uint32)
    hi, lo = _mul64(candidates, power_lo)
    enough = _geq((hi + candidates * power_hi, lo), target)
    ceiling = jnp.min(jnp.where(enough, candidates, jnp.uint32(2**32 - 1)))
    k = digits * whole + ceiling.astype(jnp.int32)
    return jnp.clip(k, 1, size).astype(jnp.int32)


def _mul64(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 64-bit product of uint32 ``a`` and ``b`` as (high, low) uint32 words."""
    mask = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & mask, a >> 16, b & mask, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> 16) + (p01 & mask) + (p10 & mask)
    low = (middle << 16) | (p00 & mask)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16)
    return high, low


def _geq(x: tuple[jax.Array, jax.Array], y: tuple[jax.Array, jax.Array]) -> jax.Array:
    """x >= y for 64-bit values as (high, low) uint32 words."""
    return (x[0] > y[0]) | ((x[0] == y[0]) & (x[1] >= y[1]))
