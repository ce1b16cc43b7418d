"""Theory quantities of SCAFFOLD measured on a federated problem: G, B, δ, β and client drift.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML 2020, https://arxiv.org/abs/1910.06378.

The paper's rates are stated in a few constants of the federated objective
``f(x) = (1/N) Σ_i f_i(x)``; this module measures them at given params x:

* **(G, B)-bounded gradient dissimilarity** (Assumption A1):
  ``(1/N) Σ_i ‖∇f_i(x)‖² ≤ G² + B² ‖∇f(x)‖²``. FedAvg's rate degrades with G (client
  drift); SCAFFOLD's does not depend on it. :func:`gradient_dissimilarity` measures both
  sides at one x, :func:`fit_G_B` fits (G, B) over several points along a run.
* **δ-bounded Hessian dissimilarity** (Assumption A2): ``‖∇²f_i(x) − ∇²f(x)‖ ≤ δ``, and
  **β-smoothness**: ``‖∇²f_i(x)‖ ≤ β``. The paper's Section 5 ("usefulness of local
  steps") shows that SCAFFOLD gains from local steps when δ is small: for quadratics its
  number of rounds scales like ``β/(μK) + δ/μ``, so local steps help until K ≈ β/δ
  (:func:`suggested_local_steps`). :func:`hessian_dissimilarity` and :func:`smoothness`
  estimate δ and β by power iteration on Hessian-vector products.
* **Client drift**: how far the aggregated update of a round is from the "ideal" update
  (K full-gradient steps on f), :func:`ideal_update_distance`. The round program already
  reports ``client_drift`` (mean ‖y_i − x‖) and ``update_norm`` (‖Δx‖).

Everything that touches the clients is one jitted XLA program, vmapped over clients (no
Python loop over clients). The client axis is cut into chunks of about
``examples_per_chunk`` examples (``lax.map`` / ``lax.scan`` over chunks, ``vmap`` inside) so
that N · max_count examples never have to be materialised at once. Client i's gradient is
the gradient of the MASKED mean of its per-example losses over all of its data
(``BatchPlan.full()``), so unequal client sizes are exact. ∇f and ∇²f are the UNIFORM means
over clients, as in the paper (``f = (1/N) Σ f_i``).

Cost (P params, n examples in all, N clients, T power iterations): the gradient statistics
are one pass over the data; β costs T passes; δ costs T · (N + 1) passes, because the
operator ``v ↦ ∇²f_i v − ∇²f v`` needs the full-data Hessian ∇²f applied to each client's
own vector. Restrict δ and β to a subset of clients (``client_ids``) when N is large.

Examples:
  >>> from scaffold_jax.data.synthetic import quadratic_problem
  >>> qp = quadratic_problem(num_clients=3, dim=4, beta=1.0, delta=0.5, G=2.0, mu=0.1)
  >>> est = hessian_dissimilarity(qp.problem, qp.data, qp.problem.params, num_iters=200)
  >>> round(float(est.value), 3)
  0.5
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.flatten_util import ravel_pytree

from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.resources import DEFAULT_EXAMPLES_PER_CHUNK, clients_per_chunk
from scaffold_jax.tree import masked_mean
from scaffold_jax.types import Array, Problem, PyTree

__all__ = [
    "DiagnosticsReport",
    "SpectralEstimate",
    "client_gradients",
    "diagnose",
    "fit_G_B",
    "format_report",
    "full_gradient",
    "gradient_dissimilarity",
    "hessian_dissimilarity",
    "ideal_update",
    "ideal_update_distance",
    "smoothness",
    "suggested_local_steps",
]

# Any dataset speaking the protocol of :mod:`scaffold_jax.data.federated` (``num_clients``,
# ``max_count``, ``client_batches``): a FederatedData or a procedural dataset.
Dataset = Any

_FULL_PLAN = BatchPlan.full(1)


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


class DiagnosticsReport(NamedTuple):
    """What :func:`diagnose` measured.

    Attributes:
      num_clients: N.
      num_params: P, the number of scalar model parameters.
      num_points: points the (G, B) fit used (x plus the trajectory).
      G: the fitted G over all points; with one point, ``G_at_x``.
      B: the fitted B, or None with a single point (B is not identifiable from one x).
      G_at_x: ``sqrt((1/N) Σ‖∇f_i(x) − ∇f(x)‖²)``, the G of the bound with B = 1 at x.
      mean_sq_client_grad: ``(1/N) Σ_i ‖∇f_i(x)‖²``.
      sq_full_grad: ``‖∇f(x)‖²``.
      delta: δ = max_i ‖∇²f_i(x) − ∇²f(x)‖₂ (over the evaluated clients).
      beta: β = max_i ‖∇²f_i(x)‖₂ (over the evaluated clients).
      suggested_local_steps: ≈ β/δ (``math.inf`` when δ = 0).
      num_iters: power iterations used for δ and β.
      delta_rel_change: convergence indicator of δ (see :class:`SpectralEstimate`).
      beta_rel_change: convergence indicator of β.
      compile_seconds: time spent compiling the three programs.
      run_seconds: time spent running them (after compilation).
      points: ``((1/N) Σ‖∇f_i‖², ‖∇f‖²)`` at x and at each point of the trajectory, the
        pairs the (G, B) fit used (:func:`scaffold_jax.results.plot_gradient_fit`).
    """

    num_clients: int
    num_params: int
    num_points: int
    G: float
    B: float | None
    G_at_x: float
    mean_sq_client_grad: float
    sq_full_grad: float
    delta: float
    beta: float
    suggested_local_steps: float
    num_iters: int
    delta_rel_change: float
    beta_rel_change: float
    compile_seconds: float
    run_seconds: float
    points: tuple[tuple[float, float], ...] = ()


# ------------------------------------------------------------------------------ helpers
def _loss_fn(problem: Problem | Callable) -> Callable:
    """The per-example loss of a :class:`Problem` (a bare loss function is accepted too)."""
    return problem.loss_fn if isinstance(problem, Problem) else problem


def _client_data(data, client_id: Array) -> tuple[PyTree, Array]:
    """All of one client's examples, padded to ``max_count``: ``([m, ...], mask [m])``.

    Goes through the dataset protocol (``client_batches`` with a full plan), so it works for
    :class:`~scaffold_jax.data.FederatedData` and procedural datasets alike. The full plan
    draws no randomness; the key is a placeholder.
    """
    batches, mask = data.client_batches(client_id, jr.key(0), _FULL_PLAN)
    return jax.tree.map(lambda a: a[0], batches), mask[0]


def _client_objective(loss_fn: Callable, unravel: Callable) -> Callable:
    """``f_i(w; batch, mask)``: masked mean loss at FLAT params w (padding counts for 0)."""

    def objective(w, batch, mask):
        return masked_mean(loss_fn(unravel(w), batch).astype(jnp.float32), mask)

    return objective


def _chunked(ids: Array, chunk: int) -> tuple[Array, Array]:
    """``ids`` padded to a multiple of ``chunk`` and reshaped ``[num_chunks, chunk]``, with
    a validity mask; padding repeats the last id (it is weighted 0 wherever it is used)."""
    num = ids.shape[0]
    num_chunks = -(-num // chunk)
    slots = jnp.arange(num_chunks * chunk)
    padded = ids[jnp.minimum(slots, num - 1)]
    return padded.reshape(num_chunks, chunk), (slots < num).reshape(num_chunks, chunk)


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


def _mean_gradient_flat(loss_fn, data, w, unravel, chunk: int) -> Array:
    """∇f(w) = (1/N) Σ_i ∇f_i(w), accumulated over client chunks: ``[P]``."""
    ids, valid = _chunked(jnp.arange(data.num_clients, dtype=jnp.int32), chunk)

    def step(acc, xs):
        objective = _pooled_objective(loss_fn, unravel, data, *xs)
        return acc + jax.grad(objective)(w), None

    grad, _ = jax.lax.scan(step, jnp.zeros_like(w), (ids, valid))
    return grad


def _mean_hvps_flat(loss_fn, data, w, unravel, vectors: Array, chunk: int) -> Array:
    """``∇²f(w) v_m`` for every row of ``vectors`` ``[M, P]`` (one pass per vector)."""
    ids, valid = _chunked(jnp.arange(data.num_clients, dtype=jnp.int32), chunk)

    def step(acc, xs):
        grad = jax.grad(_pooled_objective(loss_fn, unravel, data, *xs))
        # vmap over tangents only: the primal gradient is computed once per chunk.
        hvps = jax.vmap(lambda v: jax.jvp(grad, (w,), (v,))[1])(vectors)
        return acc + hvps, None

    hvps, _ = jax.lax.scan(step, jnp.zeros_like(vectors), (ids, valid))
    return hvps


# ------------------------------------------------------------------------ jitted programs
@functools.partial(jax.jit, static_argnames=("loss_fn", "chunk"))
def _client_gradients(loss_fn, data, params, *, chunk: int):
    w, unravel = ravel_pytree(params)
    objective = _client_objective(loss_fn, unravel)

    def one(i):
        return jax.grad(objective)(w, *_client_data(data, i))

    ids = jnp.arange(data.num_clients, dtype=jnp.int32)
    flat = jax.lax.map(one, ids, batch_size=chunk)  # [N, P]
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
    objective = _client_objective(loss_fn, unravel)
    ids, valid = _chunked(jnp.arange(data.num_clients, dtype=jnp.int32), chunk)

    def step(carry, xs):
        n_a, mean_a, m2_a, sq_a = carry
        chunk_ids, chunk_valid = xs
        grads = jax.vmap(lambda i: jax.grad(objective)(w, *_client_data(data, i)))(chunk_ids)
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
    objective = _client_objective(loss_fn, unravel)
    # Client i's start vector depends on its id only, so an estimate for a client does not
    # change with the other clients evaluated beside it.
    start = jax.vmap(lambda i: jr.normal(jr.fold_in(key, i), w.shape, jnp.float32))(client_ids)
    start = start / jnp.linalg.norm(start, axis=1, keepdims=True)

    def client_hvp(args):
        i, v = args
        batch, mask = _client_data(data, i)
        return jax.jvp(lambda u: jax.grad(objective)(u, batch, mask), (w,), (v,))[1]

    def apply(vectors):
        out = jax.lax.map(client_hvp, (client_ids, vectors), batch_size=chunk)
        if mode == "delta":
            out = out - _mean_hvps_flat(loss_fn, data, w, unravel, vectors, mean_chunk)
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


# ------------------------------------------------------------------------------ public API
def _as_float32(params: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def _grad_chunk(data, examples_per_chunk: int) -> int:
    return clients_per_chunk(examples_per_chunk, data.max_count, data.num_clients)


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
    return _client_gradients(
        _loss_fn(problem), data, _as_float32(params), chunk=_grad_chunk(data, examples_per_chunk)
    )


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
    return _full_gradient(
        _loss_fn(problem), data, _as_float32(params), chunk=_grad_chunk(data, examples_per_chunk)
    )


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
    return _gradient_stats(
        _loss_fn(problem), data, _as_float32(params), chunk=_grad_chunk(data, examples_per_chunk)
    )


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


def _spectral(
    problem, data, params, num_iters, key, client_ids, examples_per_chunk, mode
) -> SpectralEstimate:
    if int(num_iters) < 1:
        raise ValueError(f"num_iters = {num_iters} is invalid: it must be >= 1.")
    ids = _client_ids(data, client_ids)
    return _power_iteration(
        _loss_fn(problem),
        data,
        _as_float32(params),
        ids,
        jr.key(0) if key is None else key,
        **_spectral_static(data, ids.shape[0], int(num_iters), examples_per_chunk, mode),
    )


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
    return _ideal_update(
        _loss_fn(problem),
        data,
        _as_float32(server_params),
        jnp.asarray(num_local_steps, jnp.int32),
        jnp.asarray(client_lr, jnp.float32),
        chunk=_grad_chunk(data, examples_per_chunk),
    )


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
    return _ideal_update_distance(
        _loss_fn(problem),
        data,
        _as_float32(server_params),
        _as_float32(delta_params),
        jnp.asarray(num_local_steps, jnp.int32),
        jnp.asarray(client_lr, jnp.float32),
        chunk=_grad_chunk(data, examples_per_chunk),
    )


def diagnose(
    problem: Problem,
    data: Dataset,
    params: PyTree | None = None,
    *,
    trajectory: Sequence[PyTree] = (),
    num_iters: int = 30,
    key: jax.Array | None = None,
    client_ids: Sequence[int] | Array | None = None,
    examples_per_chunk: int = DEFAULT_EXAMPLES_PER_CHUNK,
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> DiagnosticsReport:
    """Measures G (and B), δ, β and the suggested K at x, timing compile and run apart.

    Args:
      problem: a :class:`~scaffold_jax.types.Problem`.
      data: a federated dataset.
      params: the point x (default ``problem.params``).
      trajectory: more params along a run; with any, (G, B) is fitted over x and these
        points with :func:`fit_G_B`.
      num_iters: power iterations for δ and β.
      key: PRNG key of the power-iteration start vectors.
      client_ids: evaluate δ and β on these clients only (their cost grows with N).
      examples_per_chunk: memory knob.
      phase: called with a description of each stage (compiling, the gradient
        statistics, each power iteration); the context manager it returns is entered
        around it (progress lines, :meth:`scaffold_jax.progress.Progress.phase`).

    Returns:
      A :class:`DiagnosticsReport` (render it with :func:`format_report`).
    """
    if phase is None:
        phase = lambda text: contextlib.nullcontext()
    if int(num_iters) < 1:
        raise ValueError(f"num_iters = {num_iters} is invalid: it must be >= 1.")
    loss_fn = _loss_fn(problem)
    x = _as_float32(problem.params if params is None else params)
    points = [x, *(_as_float32(p) for p in trajectory)]
    ids = _client_ids(data, client_ids)
    key = jr.key(0) if key is None else key
    grad_chunk = _grad_chunk(data, examples_per_chunk)

    compile_seconds = 0.0

    def compiled(fn, *args, **static):
        nonlocal compile_seconds
        start = time.perf_counter()
        program = fn.lower(loss_fn, data, *args, **static).compile()
        compile_seconds += time.perf_counter() - start
        return program

    with phase("compiling the gradient statistics and the power iterations"):
        stats_program = compiled(_gradient_stats, x, chunk=grad_chunk)
        spectral = {
            mode: compiled(
                _power_iteration,
                x,
                ids,
                key,
                **_spectral_static(data, ids.shape[0], int(num_iters), examples_per_chunk, mode),
            )
            for mode in ("beta", "delta")
        }

    start = time.perf_counter()
    with phase(f"gradient statistics at {len(points)} point{'s' * (len(points) > 1)}"):
        stats = [jax.device_get(stats_program(data, p)) for p in points]
    clients = f"{ids.shape[0]} clients, {int(num_iters)} power iterations"
    with phase(f"β (smoothness): {clients}"):
        beta = jax.device_get(spectral["beta"](data, x, ids, key))
    with phase(f"δ (Hessian dissimilarity): {clients}"):
        delta = jax.device_get(spectral["delta"](data, x, ids, key))
    run_seconds = time.perf_counter() - start

    here = stats[0]
    if len(points) > 1:
        G, B = fit_G_B([(s["mean_sq_client_grad"], s["sq_full_grad"]) for s in stats])
    else:
        G, B = float(here["G_at_x"]), None
    beta_value, delta_value = float(beta.value), float(delta.value)
    return DiagnosticsReport(
        num_clients=int(data.num_clients),
        num_params=int(ravel_pytree(x)[0].shape[0]),
        num_points=len(points),
        G=float(G),
        B=None if B is None else float(B),
        G_at_x=float(here["G_at_x"]),
        mean_sq_client_grad=float(here["mean_sq_client_grad"]),
        sq_full_grad=float(here["sq_full_grad"]),
        delta=delta_value,
        beta=beta_value,
        suggested_local_steps=(
            suggested_local_steps(beta_value, delta_value) if beta_value > 0 else math.nan
        ),
        num_iters=int(num_iters),
        delta_rel_change=float(delta.rel_change),
        beta_rel_change=float(beta.rel_change),
        compile_seconds=compile_seconds,
        run_seconds=run_seconds,
        points=tuple((float(s["mean_sq_client_grad"]), float(s["sq_full_grad"])) for s in stats),
    )


def format_report(report: DiagnosticsReport) -> str:
    """A human-readable rendering of a :class:`DiagnosticsReport` (for the CLI)."""
    r = report
    if r.B is None:
        fit = f"G = {r.G:.6g} with B = 1 (one point; pass a trajectory to fit B)"
    else:
        fit = f"G = {r.G:.6g}, B = {r.B:.6g} (fitted over {r.num_points} points)"
    steps = "inf (δ = 0)" if math.isinf(r.suggested_local_steps) else f"{r.suggested_local_steps:g}"
    lines = [
        f"SCAFFOLD diagnostics at x: N = {r.num_clients} clients, P = {r.num_params} params",
        "  (Karimireddy et al. 2020, arXiv:1910.06378: Assumptions A1, A2)",
        f"  (1/N) Σ‖∇f_i(x)‖²    {r.mean_sq_client_grad:.6g}",
        f"  ‖∇f(x)‖²             {r.sq_full_grad:.6g}",
        f"  G at x (B = 1)       {r.G_at_x:.6g}",
        f"  (G, B)               {fit}",
        f"  δ (Hessian dissim.)  {r.delta:.6g}   [power iteration, {r.num_iters} iters, "
        f"last rel. change {r.delta_rel_change:.1e}]",
        f"  β (smoothness)       {r.beta:.6g}   [last rel. change {r.beta_rel_change:.1e}]",
        f"  suggested K ≈ β/δ    {steps}",
        f"  time                 compile {r.compile_seconds:.2f} s, run {r.run_seconds:.2f} s",
    ]
    return "\n".join(lines)
