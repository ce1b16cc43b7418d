"""The gradient side: every client's full gradient, their mean and spread (G and B of
Assumption A1), the ideal update; and the client chunks the Hessian side shares."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.flatten_util import ravel_pytree

from scaffold_jax.engine import FULL_DATA
from scaffold_jax.resources import DEFAULT_EXAMPLES_PER_CHUNK, clients_per_chunk
from scaffold_jax.tree import masked_mean
from scaffold_jax.types import Array, Problem, PyTree

# Any dataset speaking the protocol of :mod:`scaffold_jax.data.federated` (``num_clients``,
# ``max_count``, ``client_batches``): a FederatedData or a procedural dataset.
Dataset = Any


def _loss_fn(problem: Problem | Callable) -> Callable:
    """The per-example loss of a :class:`Problem` (a bare loss function is accepted too)."""
    return problem.loss_fn if isinstance(problem, Problem) else problem


def _client_data(data, client_id: Array) -> tuple[PyTree, Array]:
    """All of one client's examples, padded to ``max_count``: ``([m, ...], mask [m])``.

    Goes through the dataset protocol (``client_batches`` with a full plan), so it works for
    :class:`~scaffold_jax.data.FederatedData` and procedural datasets alike. The full plan
    draws no randomness; the key is a placeholder.
    """
    batches, mask = data.client_batches(client_id, jr.key(0), FULL_DATA)
    return jax.tree.map(lambda a: a[0], batches), mask[0]


def _client_objective(loss_fn: Callable, unravel: Callable, data) -> Callable:
    """``f_i(w, i)``: client i's masked mean loss at FLAT params w (padding counts for 0)."""

    def objective(w, i):
        batch, mask = _client_data(data, i)
        return masked_mean(loss_fn(unravel(w), batch).astype(jnp.float32), mask)

    return objective


def _chunked(num: int, chunk: int) -> tuple[Array, Array]:
    """Client ids ``0..num-1`` padded to a multiple of ``chunk`` and reshaped ``[num_chunks,
    chunk]``, with a validity mask; padding repeats the last id (it is weighted 0 wherever
    it is used)."""
    num_chunks = -(-num // chunk)
    slots = jnp.arange(num_chunks * chunk, dtype=jnp.int32)
    ids = jnp.minimum(slots, num - 1)
    return ids.reshape(num_chunks, chunk), (slots < num).reshape(num_chunks, chunk)


def _pooled_objective(loss_fn, unravel, data, chunk_ids, chunk_valid) -> Callable:
    """The chunk's share of f = (1/N) Σ_i f_i as ONE weighted sum over pooled examples.

    Per-example losses do not depend on the batch they sit in, so a chunk's clients can be
    pooled into one batch with weights ``mask / (n_i N)``: one gradient (or one batched
    HVP) per chunk instead of one per client.
    """
    batch, mask = jax.vmap(functools.partial(_client_data, data))(chunk_ids)  # [c, m]
    counts = jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    scale = chunk_valid.astype(jnp.float32) / (counts * data.num_clients)
    weights = (mask * scale[:, None]).reshape(-1)
    pooled = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), batch)

    def objective(w):
        return jnp.sum(loss_fn(unravel(w), pooled).astype(jnp.float32) * weights)

    return objective


def _chunk_sum(loss_fn, unravel, data, chunk: int, init: Array, term: Callable) -> Array:
    """``init`` plus ``term(objective)`` summed over the chunks of clients, ``objective`` the
    chunk's :func:`_pooled_objective` at flat params: with ``term`` a gradient at w, ∇f(w)."""
    ids, valid = _chunked(data.num_clients, chunk)

    def step(acc, xs):
        return acc + term(_pooled_objective(loss_fn, unravel, data, *xs)), None

    return jax.lax.scan(step, init, (ids, valid))[0]


def _mean_gradient_flat(loss_fn, data, w, unravel, chunk: int) -> Array:
    """∇f(w) = (1/N) Σ_i ∇f_i(w), accumulated over client chunks: ``[P]``."""
    return _chunk_sum(loss_fn, unravel, data, chunk, jnp.zeros_like(w), lambda f: jax.grad(f)(w))


@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _client_gradients(loss_fn, data, params, *, chunk: int):
    w, unravel = ravel_pytree(params)
    grad = functools.partial(jax.grad(_client_objective(loss_fn, unravel, data)), w)
    ids = jnp.arange(data.num_clients, dtype=jnp.int32)
    flat = jax.lax.map(grad, ids, batch_size=chunk)  # [N, P]
    return jax.vmap(unravel)(flat)


@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _full_gradient(loss_fn, data, params, *, chunk: int):
    w, unravel = ravel_pytree(params)
    return unravel(_mean_gradient_flat(loss_fn, data, w, unravel, chunk))


@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _gradient_stats(loss_fn, data, params, *, chunk: int) -> dict[str, Array]:
    """One pass over the clients, memory O(chunk · P) whatever N is.

    The spread ``(1/N) Σ‖∇f_i − ∇f‖²`` is accumulated with Chan et al.'s pairwise update of
    (count, mean, sum of squared deviations) rather than as ``mean_sq − ‖∇f‖²``: the
    difference of two large numbers would lose the G of a nearly homogeneous problem to
    float32 cancellation.
    """
    w, unravel = ravel_pytree(params)
    grad = functools.partial(jax.grad(_client_objective(loss_fn, unravel, data)), w)
    ids, valid = _chunked(data.num_clients, chunk)

    def step(carry, xs):
        n_a, mean_a, m2_a, sq_a = carry
        chunk_ids, chunk_valid = xs
        grads = jax.vmap(grad)(chunk_ids)
        v = chunk_valid.astype(jnp.float32)
        n_b = jnp.sum(v)
        mean_b = (v @ grads) / jnp.maximum(n_b, 1.0)
        m2_b = jnp.sum(v * jnp.sum(jnp.square(grads - mean_b[None, :]), axis=1))
        sq_b = jnp.sum(v * jnp.sum(jnp.square(grads), axis=1))
        n = n_a + n_b
        d = mean_b - mean_a
        mean = mean_a + d * (n_b / jnp.maximum(n, 1.0))
        m2 = m2_a + m2_b + jnp.sum(jnp.square(d)) * (n_a * n_b / jnp.maximum(n, 1.0))
        return (n, mean, m2, sq_a + sq_b), None

    zero = jnp.zeros((), jnp.float32)
    init = (zero, jnp.zeros_like(w), zero, zero)
    (n, mean, m2, sq), _ = jax.lax.scan(step, init, (ids, valid))
    mean_sq = sq / n
    sq_full = jnp.sum(jnp.square(mean))
    variance = m2 / n
    return {
        "mean_sq_client_grad": mean_sq,
        "sq_full_grad": sq_full,
        "grad_variance": variance,
        # inf at a stationary point of f with heterogeneous clients: no finite B with G = 0.
        "ratio": mean_sq / sq_full,
        "G_at_x": jnp.sqrt(variance),
    }


@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _ideal_update(loss_fn, data, params, num_local_steps, client_lr, *, chunk: int):
    w, unravel = ravel_pytree(params)

    def step(_, y):
        return y - client_lr * _mean_gradient_flat(loss_fn, data, y, unravel, chunk)

    # K is data (a traced bound: a while loop), so changing it does not recompile.
    y = jax.lax.fori_loop(0, num_local_steps, step, w)
    return unravel(y - w)


@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _ideal_update_distance(
    loss_fn, data, server_params, delta_params, num_local_steps, client_lr, *, chunk: int
):
    ideal = _ideal_update(loss_fn, data, server_params, num_local_steps, client_lr, chunk=chunk)
    diff, _ = ravel_pytree(jax.tree.map(lambda a, b: a - b, delta_params, ideal))
    return jnp.linalg.norm(diff)


def _as_float32(params: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def _grad_chunk(data, examples_per_chunk: int) -> int:
    return clients_per_chunk(examples_per_chunk, data.max_count, data.num_clients)


def _run(program, problem, data, params, examples_per_chunk: int, *args, **static):
    """``program`` with ``problem``'s loss at float32 ``params``, over chunks of clients of
    about ``examples_per_chunk`` examples (unless ``static`` says its own ``chunk``)."""
    static.setdefault("chunk", _grad_chunk(data, examples_per_chunk))
    return program(_loss_fn(problem), data, _as_float32(params), *args, **static)


def client_gradients(
    problem: Problem | Callable,
    data: Dataset,
    params: PyTree,
    *,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> PyTree:
    """Every client's full local gradient ∇f_i(x), stacked: a pytree with leaves ``[N, ...]``.

    ``∇f_i(x)`` is the gradient of the mean loss over ALL of client i's examples (masked,
    so exact for unequal sizes). Clients are processed ``lax.map``-chunked, about
    ``examples_per_chunk`` examples per vmapped chunk.

    Args:
      problem: a :class:`~scaffold_jax.types.Problem` (or its per-example ``loss_fn``).
      data: a federated dataset (``num_clients``, ``max_count``, ``client_batches``).
      params: the point x (a pytree like ``problem.params``).
      examples_per_chunk: memory knob: examples per vmapped chunk of clients.

    Returns:
      The params pytree with a leading ``[N]`` client axis on every leaf (float32).
    """
    return _run(_client_gradients, problem, data, params, examples_per_chunk)


def full_gradient(
    problem: Problem | Callable,
    data: Dataset,
    params: PyTree,
    *,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> PyTree:
    """∇f(x) = (1/N) Σ_i ∇f_i(x), the gradient of the paper's uniform objective.

    Computed without materialising the ``[N, P]`` client gradients: each chunk of clients
    contributes one gradient of its pooled, weighted loss.
    """
    return _run(_full_gradient, problem, data, params, examples_per_chunk)


def gradient_dissimilarity(
    problem: Problem | Callable,
    data: Dataset,
    params: PyTree,
    *,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> dict[str, Array]:
    """Both sides of Assumption A1, ``(1/N) Σ‖∇f_i(x)‖² ≤ G² + B²‖∇f(x)‖²``, at one x.

    Args:
      problem: a :class:`~scaffold_jax.types.Problem` (or its per-example ``loss_fn``).
      data: a federated dataset.
      params: the point x.
      examples_per_chunk: memory knob: examples per vmapped chunk of clients.

    Returns:
      A dict of float32 scalars:

      * ``mean_sq_client_grad``: ``(1/N) Σ_i ‖∇f_i(x)‖²``;
      * ``sq_full_grad``: ``‖∇f(x)‖²``;
      * ``grad_variance``: ``(1/N) Σ_i ‖∇f_i(x) − ∇f(x)‖²`` (= the difference of the two);
      * ``ratio``: ``mean_sq_client_grad / sq_full_grad``, the B² that makes G = 0 at x
        (``inf`` where ∇f(x) = 0);
      * ``G_at_x``: ``sqrt(grad_variance)``, the G that makes the bound tight at x with
        B = 1. Since ``mean_sq ≥ ‖∇f‖²`` always (Jensen), B ≥ 1 is the natural range.
    """
    return _run(_gradient_stats, problem, data, params, examples_per_chunk)


def fit_G_B(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fits the (G, B) of Assumption A1 over points ``(mean_sq_client_grad, sq_full_grad)``.

    The assumption asks ``m_k ≤ G² + B² s_k`` at every point (``m_k = (1/N)Σ‖∇f_i(x_k)‖²``,
    ``s_k = ‖∇f(x_k)‖²``); any B² trades against G², so a fit must choose. Ours:

    1. B² is the least-squares slope of m on s (how fast client gradients grow with the
       full gradient along the run), clipped below at 1: Jensen gives ``m_k ≥ s_k``, so
       B ≥ 1 is always feasible and the paper's bound with G = 0 needs B ≥ 1 anyway.
       With one point, or all points at the same s, the slope is undefined and B² = 1.
    2. G² is then the SMALLEST value for which the bound holds at every point:
       ``G² = max(0, max_k (m_k − B² s_k))`` (the line is lifted onto the upper envelope
       of the points, so it touches at least one).

    The bound therefore holds at all points by construction; B is a least-squares
    estimate, not the smallest possible B.

    Args:
      points: ``(mean_sq_client_grad, sq_full_grad)`` pairs, e.g. from
        :func:`gradient_dissimilarity` at several params along a run.

    Returns:
      ``(G, B)`` as Python floats.

    Examples:
      >>> fit_G_B([(4.0 + 9.0 * s, s) for s in (0.0, 1.0, 2.0)])
      (2.0, 3.0)
    """
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    if pts.shape[0] == 0:
        raise ValueError("fit_G_B needs at least one (mean_sq_client_grad, sq_full_grad) point.")
    if not np.all(np.isfinite(pts)):
        raise ValueError(f"fit_G_B got non-finite points: {pts.tolist()}.")
    mean_sq, sq_full = pts[:, 0], pts[:, 1]
    b_sq = 1.0
    spread = sq_full - sq_full.mean()
    denom = float(np.sum(spread * spread))
    if pts.shape[0] >= 2 and denom > 0:
        slope = float(np.sum(spread * (mean_sq - mean_sq.mean())) / denom)
        b_sq = max(1.0, slope)
    g_sq = max(0.0, float(np.max(mean_sq - b_sq * sq_full)))
    return math.sqrt(g_sq), math.sqrt(b_sq)


def ideal_update(
    problem: Problem | Callable,
    data: Dataset,
    server_params: PyTree,
    num_local_steps: int | Array,
    client_lr: float | Array,
    *,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> PyTree:
    """The ideal update of a round: K full-gradient steps on f from x, ``y_K − x``.

    ``y_0 = x``, ``y_{k+1} = y_k − η_l ∇f(y_k)`` with ``∇f = (1/N) Σ_i ∇f_i``: what the
    round would do if every client could see all the data. K and η_l are data (changing
    them does not recompile). Cost: K passes over the data.
    """
    steps, lr = jnp.asarray(num_local_steps, jnp.int32), jnp.asarray(client_lr, jnp.float32)
    return _run(_ideal_update, problem, data, server_params, examples_per_chunk, steps, lr)


def ideal_update_distance(
    problem: Problem | Callable,
    data: Dataset,
    server_params: PyTree,
    delta_params: PyTree,
    num_local_steps: int | Array,
    client_lr: float | Array,
    *,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
) -> Array:
    """Client drift as the paper frames it: ``‖Δx − (y_K − x)‖`` for the ideal y_K.

    Args:
      problem: a :class:`~scaffold_jax.types.Problem` (or its per-example ``loss_fn``).
      data: a federated dataset.
      server_params: x, the server model at the start of the round.
      delta_params: Δx, the aggregated client update of the round (``mean_S Δy_i``,
        before the server step size η_g).
      num_local_steps: K.
      client_lr: η_l.
      examples_per_chunk: memory knob.

    Returns:
      float32 scalar ``‖Δx − ideal‖``, with ``ideal`` from :func:`ideal_update`.
    """
    steps, lr = jnp.asarray(num_local_steps, jnp.int32), jnp.asarray(client_lr, jnp.float32)
    delta = _as_float32(delta_params)
    return _run(
        _ideal_update_distance, problem, data, server_params, examples_per_chunk, delta, steps, lr
    )
