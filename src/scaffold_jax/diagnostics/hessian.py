"""The Hessian side of the diagnostics: δ (Assumption A2) and β by power iteration on
Hessian-vector products, for every evaluated client at once, and the K ≈ β/δ they suggest."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.flatten_util import ravel_pytree

from scaffold_jax.diagnostics.gradients import Dataset, _chunk_sum, _client_objective, _run
from scaffold_jax.resources import DEFAULT_EXAMPLES_PER_CHUNK, clients_per_chunk
from scaffold_jax.types import Array, Problem, PyTree


class SpectralEstimate(NamedTuple):
    """A largest-absolute-eigenvalue estimate from power iteration, per client and max.

    Attributes:
      value: float32 scalar, the max over the evaluated clients (δ or β).
      per_client: ``[M]`` float32, the estimate for each evaluated client.
      client_ids: ``[M]`` int32, which clients were evaluated.
      rel_change: float32 scalar, ``max_i |λ_i^(T) − λ_i^(T−1)| / λ_i^(T)`` over the last
        iteration: a convergence indicator (power iteration approaches from below).
    """

    value: Array
    per_client: Array
    client_ids: Array
    rel_change: Array


@functools.partial(jax.jit, static_argnames=("loss_fn", "mode", "num_iters", "chunk", "mean_chunk"))
def _power_iteration(
    loss_fn, data, params, client_ids, key, *, mode: str, num_iters: int, chunk: int,
    mean_chunk: int,
) -> SpectralEstimate:  # fmt: skip
    """Power iteration for every client in ``client_ids`` at once.

    ``mode="beta"``: the operator is ∇²f_i; ``mode="delta"``: ∇²f_i − ∇²f (symmetric). The
    estimate is ``‖M v‖`` for the normalised iterate v, i.e. the square root of the
    Rayleigh quotient of M² = MᵀM, which converges to the largest ABSOLUTE eigenvalue even
    when ±λ tie (a plain Rayleigh quotient vᵀMv would not), monotonically from below.
    """
    w, unravel = ravel_pytree(params)
    objective = _client_objective(loss_fn, unravel, data)
    # Client i's start vector depends on its id only, so an estimate for a client does not
    # change with the other clients evaluated beside it.
    start = jax.vmap(lambda i: jr.normal(jr.fold_in(key, i), w.shape, jnp.float32))(client_ids)
    start = start / jnp.linalg.norm(start, axis=1, keepdims=True)

    def client_hvp(args):
        i, v = args
        return jax.jvp(lambda u: jax.grad(objective)(u, i), (w,), (v,))[1]

    def apply(vectors):
        out = jax.lax.map(client_hvp, (client_ids, vectors), batch_size=chunk)
        if mode == "delta":  # minus ∇²f v_m for every row (one pass over the data each),
            # vmapped over the tangents only: the primal gradient is computed once per chunk.
            hvps = lambda f: jax.vmap(lambda v: jax.jvp(jax.grad(f), (w,), (v,))[1])(vectors)
            out = out - _chunk_sum(
                loss_fn, unravel, data, mean_chunk, jnp.zeros_like(vectors), hvps
            )
        return out

    def body(carry, _):
        vectors, _ = carry
        image = apply(vectors)
        norms = jnp.linalg.norm(image, axis=1)
        # A zero image (no dissimilarity at all) stays zero instead of dividing by 0.
        vectors = image / jnp.maximum(norms, jnp.finfo(jnp.float32).tiny)[:, None]
        return (vectors, norms), norms

    init = (start, jnp.zeros(client_ids.shape, jnp.float32))
    _, history = jax.lax.scan(body, init, None, length=num_iters)
    last = history[-1]
    previous = history[-2] if num_iters > 1 else jnp.zeros_like(last)
    change = jnp.abs(last - previous) / jnp.maximum(last, jnp.finfo(jnp.float32).tiny)
    change = jnp.where(last > 0, change, 0.0)
    return SpectralEstimate(
        value=jnp.max(last), per_client=last, client_ids=client_ids, rel_change=jnp.max(change)
    )


def _spectral(
    problem, data, params, num_iters, key, client_ids, examples_per_chunk, mode
) -> SpectralEstimate:
    if int(num_iters) < 1:
        raise ValueError(f"num_iters = {num_iters} is invalid: it must be >= 1.")
    ids = _client_ids(data, client_ids)
    key = jr.key(0) if key is None else key
    static = _spectral_static(data, ids.shape[0], int(num_iters), examples_per_chunk, mode)
    return _run(_power_iteration, problem, data, params, examples_per_chunk, ids, key, **static)


def _client_ids(data, client_ids: Sequence[int] | Array | None) -> Array:
    if client_ids is None:
        return jnp.arange(data.num_clients, dtype=jnp.int32)
    ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= data.num_clients:
        raise ValueError(
            f"client_ids must be a non-empty list of ids in [0, {data.num_clients}); "
            f"got {ids.tolist()[:10]}."
        )
    return jnp.asarray(ids, jnp.int32)


def _spectral_static(data, num_evaluated, num_iters, examples_per_chunk, mode) -> dict:
    return dict(
        mode=mode,
        num_iters=num_iters,
        chunk=clients_per_chunk(examples_per_chunk, data.max_count, num_evaluated),
        # Every vector of the chunk sees every pooled example: size the chunk by both.
        mean_chunk=clients_per_chunk(
            examples_per_chunk, data.max_count * num_evaluated, data.num_clients
        ),
    )


def hessian_dissimilarity(
    problem: Problem | Callable,
    data: Dataset,
    params: PyTree,
    num_iters: int = 30,
    key: jax.Array | None = None,
    *,
    client_ids: Sequence[int] | Array | None = None,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> SpectralEstimate:
    """δ = max_i ‖∇²f_i(x) − ∇²f(x)‖₂ (Assumption A2), by power iteration on HVPs.

    For every client at once (vmapped, chunked), power iteration runs on the symmetric
    operator ``v ↦ ∇²f_i(x) v − ∇²f(x) v``, with Hessian-vector products
    ``jax.jvp(jax.grad(f_i), (x,), (v,))`` on the flattened params
    (``jax.flatten_util.ravel_pytree``) and ``∇²f v = (1/N) Σ_j ∇²f_j v``. The estimate is
    the largest ABSOLUTE eigenvalue (a spectral norm), approached from below; its relative
    error shrinks like ``(|λ₂|/|λ₁|)^(2T)``. Check ``rel_change`` for convergence.

    Cost: ``num_iters · (N + 1)`` passes over the data (each client vector needs the
    full-data Hessian); use ``client_ids`` to take the max over a subset of clients.

    Args:
      problem: a :class:`~scaffold_jax.types.Problem` (or its per-example ``loss_fn``).
      data: a federated dataset.
      params: the point x.
      num_iters: T, power iterations (static: a new T compiles a new program). On
        Fashion-MNIST logistic regression the max settles within ~20; if ``rel_change``
        is above ~1e-3, run more.
      key: PRNG key of the start vectors (client i's from ``fold_in(key, i)``); default
        ``jax.random.key(0)``.
      client_ids: evaluate only these clients (∇²f is still the mean over ALL clients).
      examples_per_chunk: memory knob: examples (× vectors) per vmapped chunk.

    Returns:
      A :class:`SpectralEstimate`; ``.value`` is δ.
    """
    return _spectral(problem, data, params, num_iters, key, client_ids, examples_per_chunk, "delta")


def smoothness(
    problem: Problem | Callable,
    data: Dataset,
    params: PyTree,
    num_iters: int = 30,
    key: jax.Array | None = None,
    *,
    client_ids: Sequence[int] | Array | None = None,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> SpectralEstimate:
    """β = max_i ‖∇²f_i(x)‖₂ (largest absolute eigenvalue), by power iteration on HVPs.

    The paper's β-smoothness asks ``‖∇²f_i‖ ≤ β`` everywhere; this is its value at x (a
    lower bound on the global β). Same method and arguments as
    :func:`hessian_dissimilarity`, with the operator ``v ↦ ∇²f_i(x) v``; cost
    ``num_iters`` passes over the data.

    Returns:
      A :class:`SpectralEstimate`; ``.value`` is β.
    """
    return _spectral(problem, data, params, num_iters, key, client_ids, examples_per_chunk, "beta")


def suggested_local_steps(beta: float, delta: float) -> float:
    """The number of local steps K ≈ β/δ past which SCAFFOLD stops gaining from them.

    In the paper's analysis of local steps (Section 5, quadratics with δ-bounded Hessian
    dissimilarity), SCAFFOLD needs about ``β/(μK) + δ/μ`` rounds (up to constants and
    log factors): the first term shrinks with K, the second does not. Local steps pay off
    until the two are equal, at K ≈ β/δ; beyond that, more local computation buys no
    fewer rounds. With identical clients (δ = 0) every extra step helps: ``math.inf``.

    Args:
      beta: the smoothness β (> 0).
      delta: the Hessian dissimilarity δ (>= 0).

    Returns:
      ``max(1, round(β/δ))`` as a float, or ``math.inf`` when δ = 0.

    Examples:
      >>> suggested_local_steps(1.0, 0.1)
      10.0
    """
    beta, delta = float(beta), float(delta)
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta={beta} is invalid: it must be finite and > 0.")
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta={delta} is invalid: it must be finite and >= 0.")
    if delta == 0:
        return math.inf
    return float(max(1, round(beta / delta)))
