"""Synthetic federated problems: prescribed-constant quadratics, Synthetic(α, β), procedural.

Three families, all speaking the dataset protocol of :mod:`scaffold_jax.data.federated`
(``num_clients``, ``counts``, ``max_count``, ``test``, ``client_batches``):

1. **Quadratics with prescribed constants** (:func:`quadratic_problem`,
   :func:`figure3_problem`) for the simulated experiment of Figure 3 in Karimireddy et al.,
   "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020
   (arXiv:1910.06378). Client i holds ``f_i(x) = ½ xᵀA_i x − b_iᵀx`` as ONE example, and
   the smoothness β, Hessian dissimilarity δ, strong convexity μ and gradient
   dissimilarity G at the optimum hold *exactly* (up to float32 storage), not as bounds.

2. **Synthetic(α, β)** logistic data (:func:`synthetic_alpha_beta`) of Li, Sahu, Zaheer,
   Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks" (FedProx),
   MLSys 2020 (arXiv:1812.06127), Section 5.1, itself after Shamir, Srebro, Zhang,
   "Communication-Efficient Distributed Optimization using an Approximate Newton-type
   Method" (DANE), ICML 2014. For client k::

       u_k ~ N(0, α²),  W_k ~ N(u_k, 1) [d × C],  b_k ~ N(u_k, 1) [C]      (the model)
       B_k ~ N(0, β²),  v_k ~ N(B_k, 1) [d]                               (the inputs)
       x ~ N(v_k, Σ),  Σ = diag(j^-1.2, j = 1..d),  y = argmax softmax(xᵀW_k + b_k)

   The paper writes ``N(0, α)``; its reference code (``np.random.normal(0, alpha)``) uses α
   and β as STANDARD DEVIATIONS, and so do we. Client sizes follow the same code:
   ``floor(lognormal(4, 2)) + 50`` ("powerlaw"), or a fixed int. ``iid=True`` is the code's
   Synthetic-IID variant (one shared W, b; v_k = B_k·1).

3. **Procedural clients** (:class:`ProceduralSynthetic`, built by
   :func:`procedural_synthetic`): the same Synthetic(α, β) process, but example j of
   client i is GENERATED inside the jitted round from its key, so 10⁶ clients cost only
   their ``counts`` array. :func:`synthetic_alpha_beta` materialises exactly these streams,
   so both agree example for example for the same seed.

Randomness (Synthetic and procedural). One root ``key = jax.random.key(seed)`` is cut
into independent streams with ``fold_in`` by a stream tag, so adding clients or examples
never shifts anyone else's numbers:

* sizes:   ``n_i    from fold_in(fold_in(key, 0), i)``
* model:   ``(u, W, b, B, v)_i from fold_in(fold_in(key, 1), i)``
* data:    ``x_ij   from fold_in(fold_in(seed_key, i), j)``, ``seed_key = fold_in(key, 2)``
* iid:     the shared (W, b) from ``fold_in(key, 3)``

Labels are ``argmax`` of float32 logits, so two differently compiled programs can in
principle disagree on an exact near-tie (a logit gap within float32 rounding,
probability ~1e-7 per example); features are bit-identical.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax import resources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData, from_client_arrays
from scaffold_jax.registry import Option, Registry
from scaffold_jax.types import Problem

__all__ = [
    "QuadraticProblem",
    "quadratic_problem",
    "quadratic_loss",
    "figure3_problem",
    "synthetic_alpha_beta",
    "ProceduralSynthetic",
    "procedural_synthetic",
]

Examples = Any

# ---------------------------------------------------------------------------------------
# 1. Quadratics with prescribed β, δ, G, μ
# ---------------------------------------------------------------------------------------


class QuadraticProblem(NamedTuple):
    """N quadratic clients with exactly known constants.

    Attributes:
      data: one example per client, ``{"A": [N, d, d], "b": [N, d]}`` float32; ``data.test``
        holds all N examples, so the mean test loss IS the global objective f(x).
      problem: ``Problem(params={"x": x0}, loss_fn=quadratic_loss, accuracy_fn=None)``.
      x_star: the minimiser of f = (1/N) Σ f_i, float64 ``[d]``, computed from the stored
        float32 A_i, b_i (so it is exact for the problem the engine sees).
      f_star: f(x*), float64.
      beta: ``max_i ‖A_i‖₂`` (smoothness of every client).
      delta: ``max_i ‖A_i − A‖₂`` with ``A = mean_i A_i`` (Hessian dissimilarity).
      G: ``sqrt((1/N) Σ_i ‖∇f_i(x*)‖²)``, the gradient dissimilarity at the optimum.
      mu: ``λ_min(A)``, the strong convexity of f.
      A: ``[N, d, d]`` float64 copy of the stored client Hessians.
      b: ``[N, d]`` float64 copy of the stored linear terms.
    """

    data: FederatedData
    problem: Problem
    x_star: np.ndarray
    f_star: float
    beta: float
    delta: float
    G: float
    mu: float
    A: np.ndarray
    b: np.ndarray


def quadratic_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Per-example quadratic loss ``½ xᵀA x − bᵀx``.

    Args:
      params: ``{"x": [d]}``.
      batch: ``{"A": [B, d, d], "b": [B, d]}``.

    Returns:
      ``[B]`` float32 losses.
    """
    x = params["x"]
    # HIGHEST: on GPUs the default float32 matmul may run in TF32, which would blur the
    # exact constants (and f − f*) this problem exists to provide.
    ax = jnp.einsum("bij,j->bi", batch["A"], x, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum((0.5 * ax - batch["b"]) * x[None, :], axis=-1)


def _check_finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number.")
    return value


def _max_feasible_delta(num_clients: int, beta: float, mu: float, convex: bool) -> float:
    """The largest δ any set of N quadratic clients with these β, μ can have.

    Take the client i and unit v with vᵀE_i v = ±δ (E_i = A_i − A, Σ_i E_i = 0). If it is
    −δ, some other client has vᵀE_k v ≥ δ/(N−1), so
    ``lower + δ ≤ vᵀA v ≤ β − δ/(N−1)`` and ``μ ≤ vᵀA v``; the +δ case is stricter. With
    ``lower = 0`` (convex clients) or ``−β`` (‖A_i‖ ≤ β only) this gives
    ``δ ≤ min((β − μ)(N − 1), (β − lower)(N − 1)/N)``, and our construction attains it.
    """
    if num_clients < 2:
        return 0.0
    lower = 0.0 if convex else -beta
    return min((beta - mu) * (num_clients - 1), (beta - lower) * (num_clients - 1) / num_clients)


def quadratic_problem(
    num_clients: int,
    dim: int,
    beta: float,
    delta: float,
    G: float,
    mu: float,
    seed: int = 0,
    *,
    convex_clients: bool = True,
    start_distance: float = 1.0,
) -> QuadraticProblem:
    """N quadratic clients ``f_i(x) = ½ xᵀA_i x − b_iᵀx`` with prescribed constants.

    With ``A = (1/N) Σ A_i`` and ``x* = A⁻¹ (1/N) Σ b_i``, the construction makes these hold
    exactly (up to float32 rounding of the stored A_i, b_i):

    * ``β = max_i ‖A_i‖₂`` — every client is β-smooth and one attains it;
    * ``δ = max_i ‖A_i − A‖₂`` — the paper's δ-bounded Hessian dissimilarity, attained;
    * ``μ = λ_min(A)`` — f is μ-strongly convex (clients need not be, see below);
    * ``G² = (1/N) Σ_i ‖∇f_i(x*)‖²``.

    What G means: the paper's (G, B)-bounded gradient dissimilarity asks
    ``(1/N) Σ‖∇f_i(x)‖² ≤ G² + B²‖∇f(x)‖²`` for all x. At x* the right side is G², so
    every valid (G', B) pair has G' ≥ G: this G is the smallest one any B allows, and the
    quantity measured at x*. Away from x*, with ``∇f_i(x) = A_i(x − x*) + ∇f_i(x*)``, the
    bound holds with ``(√2·G, B = √2·(1 + δ/μ))``.

    Construction (Q a Haar-random orthonormal basis; every matrix diagonal in it):
    ``A_i = Q diag(a + e_i) Qᵀ``. Direction 0 carries the dissimilarity: ``e_i0 = δ c_i``
    with ``c = (−1, 1/(N−1), …, 1/(N−1))`` (Σ c = 0), ``a_0 = β − δ/(N−1)``, so clients
    1..N−1 reach eigenvalue β there and client 0 has ``‖E_0‖ = δ``. Directions
    ``j ≥ 1`` get ``a_j = geomspace(β, μ, d)[j]`` (so ``a_{d−1} = μ``) and random
    dissimilarity ``e_ij = ρ_j s_j c_{(i+j) mod N}`` with ``ρ_j ~ U(0, 0.9)`` and ``s_j``
    the largest value (at most δ) keeping eigenvalues in ``[0, β]``: clients are convex in
    every direction but 0, so non-convexity appears only where δ forces it. The 0.9 keeps
    a spectral gap, so β and δ are attained cleanly in direction 0 only. The gradients at
    the optimum ``g_i = ∇f_i(x*)`` are centred Gaussians (Σ g_i = 0) rescaled to mean square G², and
    ``x* = 0``, ``b_i = −g_i``. Placing x* at the origin is deliberate: near the optimum
    each f_i is O(G‖x‖), so float32 evaluation of f − f* stays accurate down to the
    float32 optimisation floor (about ``(εG)²/μ``) even for G = 100; the start point
    ``x0`` is at ``start_distance`` from x* in a random direction. Draws happen in a fixed
    order from ``numpy.random.default_rng(seed)``, so problems differing only in G share
    the same Hessians, directions and start point.

    Feasibility. Any N clients (not just ours) must satisfy
    ``δ ≤ min((β − μ)(N − 1), (β − lower)(N − 1)/N)`` with ``lower = 0`` when
    ``convex_clients`` (every A_i ⪰ 0) and ``lower = −β`` otherwise (only ‖A_i‖₂ ≤ β:
    clients may be non-convex, as the paper's δ-analysis allows). For N = 2 and convex
    clients that is δ ≤ β/2; for N = 2 in general δ ≤ β − μ.

    Args:
      num_clients: N >= 1 (N >= 2 when δ > 0 or G > 0).
      dim: d >= 2 (one direction carries δ, another pins λ_min(A) = μ).
      beta: β > 0.
      delta: δ >= 0, at most the feasibility bound above.
      G: G >= 0.
      mu: 0 < μ <= β.
      seed: numpy seed of the construction.
      convex_clients: require every A_i positive semi-definite (default) or only
        ‖A_i‖₂ <= β.
      start_distance: ‖x0 − x*‖ >= 0 of the initial params.

    Returns:
      A :class:`QuadraticProblem`.

    Raises:
      ValueError: naming the parameter and its allowed range.

    Examples:
      >>> qp = quadratic_problem(num_clients=2, dim=3, beta=1.0, delta=0.3, G=10.0, mu=0.1)
      >>> qp.data.num_clients, qp.data.examples["A"].shape
      (2, (2, 3, 3))
    """
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients={num_clients!r} is invalid: it must be an integer >= 1.")
    if isinstance(dim, bool) or int(dim) != dim or dim < 2:
        raise ValueError(
            f"dim={dim!r} is invalid: it must be an integer >= 2 (direction 0 carries δ, "
            "another pins λ_min(A) = μ)."
        )
    n, d = int(num_clients), int(dim)
    beta = _check_finite("beta", beta)
    delta = _check_finite("delta", delta)
    G = _check_finite("G", G)
    mu = _check_finite("mu", mu)
    start_distance = _check_finite("start_distance", start_distance)
    if beta <= 0:
        raise ValueError(f"beta={beta} is invalid: it must be > 0 (the smoothness max ‖A_i‖).")
    if not 0 < mu <= beta:
        raise ValueError(
            f"mu={mu} is invalid: it must be in (0, beta] = (0, {beta}] (λ_min of the mean "
            "Hessian; f must be strongly convex)."
        )
    if delta < 0:
        raise ValueError(f"delta={delta} is invalid: it must be >= 0.")
    if G < 0:
        raise ValueError(f"G={G} is invalid: it must be >= 0.")
    if start_distance < 0:
        raise ValueError(f"start_distance={start_distance} is invalid: it must be >= 0.")
    if n < 2 and (delta > 0 or G > 0):
        raise ValueError(
            f"num_clients={n} is invalid with delta={delta}, G={G}: one client cannot differ "
            "from the average; use num_clients >= 2 or delta = G = 0."
        )
    delta_max = _max_feasible_delta(n, beta, mu, convex_clients)
    if delta > delta_max * (1 + 1e-12):
        kind = "convex (A_i ⪰ 0)" if convex_clients else "‖A_i‖₂ <= beta"
        hint = "; convex_clients=False allows non-convex clients." if convex_clients else "."
        raise ValueError(
            f"delta={delta} is infeasible: with num_clients={n}, beta={beta}, mu={mu} and "
            f"{kind} clients it must be in [0, {delta_max:.6g}] "
            "(delta <= min((beta - mu)(N-1), (beta - lower)(N-1)/N), lower = 0 for convex "
            f"clients, -beta otherwise){hint}"
        )

    check_quadratic_size(n, d)
    rng = np.random.default_rng(seed)
    # Haar-random basis: QR of a Gaussian matrix with the signs of R's diagonal fixed.
    z = rng.standard_normal((d, d))
    q, r = np.linalg.qr(z)
    q = q * np.sign(np.diag(r))
    c = np.full(n, 1.0 / (n - 1)) if n > 1 else np.zeros(1)
    c[0] = -1.0 if n > 1 else 0.0
    a = np.empty(d)
    a[0] = beta - delta / (n - 1) if n > 1 else beta
    a[1:] = np.geomspace(beta, mu, d)[1:]
    a[-1] = mu
    rho = rng.uniform(0.0, 0.9, size=d)
    # Directions j >= 1 stay within [0, beta] even for non-convex clients: only direction
    # 0 needs negative curvature (when delta > beta (N-1)/N), so only it gets any.
    s = np.minimum(np.minimum(delta, a), (beta - a) * (n - 1))
    e = np.empty((n, d))
    for j in range(d):
        scale = delta if j == 0 else rho[j] * max(s[j], 0.0)
        e[:, j] = scale * np.roll(c, -j)  # e[i, j] = scale * c[(i + j) % n]
    eig = a[None, :] + e  # [N, d], every entry in [lower, beta]
    A64 = np.einsum("ij,nj,kj->nik", q, eig, q)
    A64 = 0.5 * (A64 + np.swapaxes(A64, 1, 2))
    g = rng.standard_normal((n, d))
    g -= g.mean(axis=0)
    if G > 0:
        g *= G / math.sqrt(float(np.mean(np.sum(g * g, axis=1))))
    else:
        g[:] = 0.0
    direction = rng.standard_normal(d)
    direction /= np.linalg.norm(direction)

    A32 = A64.astype(np.float32)
    b32 = (-g).astype(np.float32)
    # Exact constants of the STORED problem: recompute x*, f* from the float32 arrays.
    A_st, b_st = A32.astype(np.float64), b32.astype(np.float64)
    A_mean, b_mean = A_st.mean(axis=0), b_st.mean(axis=0)
    x_star = np.linalg.solve(A_mean, b_mean)
    f_star = float(0.5 * x_star @ A_mean @ x_star - b_mean @ x_star)
    x0 = (x_star + start_distance * direction).astype(np.float32)

    data = from_client_arrays(
        [{"A": A32[i : i + 1], "b": b32[i : i + 1]} for i in range(n)],
        test={"A": A32, "b": b32},
    )
    problem = Problem(params={"x": jnp.asarray(x0)}, loss_fn=quadratic_loss, accuracy_fn=None)
    return QuadraticProblem(
        data=data,
        problem=problem,
        x_star=x_star,
        f_star=f_star,
        beta=beta,
        delta=delta,
        G=G,
        mu=mu,
        A=A_st,
        b=b_st,
    )


def check_quadratic_size(num_clients: int, dim: int) -> None:
    """ValueError when :func:`quadratic_problem`'s arrays do not fit in host memory: its N
    Hessians d x d are built in float64 (and read back from their float32 copy), so
    ``dim = 10**8`` would otherwise fail inside numpy asking for petabytes."""
    _check_host_memory(
        8 * dim * dim * (2 * num_clients + 2), f"dim={dim!r} with num_clients={num_clients}",
        "the clients' d x d Hessians, in float64", "use a smaller dim",
    )  # fmt: skip


def figure3_problem(
    G: float,
    seed: int = 0,
    dim: int = 10,
    mu: float = 0.01,
    delta: float | None = None,
    start_distance: float = 1.0,
) -> QuadraticProblem:
    """The paper's Figure 3 setting: N = 2 quadratic clients, β = 1, δ ≈ 1, given G.

    The paper states N = 2, β = 1, δ = 1, G ∈ {1, 10, 100} but not the functions. With
    μ > 0 and N = 2 exactly δ = β is impossible (E_1 = −E_2, so along E's top eigenvector
    one client has ``vᵀAv + δ ≤ β``, i.e. ``μ ≤ β − δ``); we keep β = 1 exact and take
    the largest feasible ``δ = β − μ = 0.99`` by default. Hence the clients are
    non-convex: client 0 has eigenvalue ``2μ − 1 = −0.98`` in the δ direction (the paper's
    δ-analysis allows non-convex f_i), client 1 has eigenvalue 1 there, and f is
    μ-strongly convex. The dissimilarity sits in the slowest direction of f (forced when
    δ ≈ β). μ = 0.01 (condition number 100) and d = 10 are our choices.

    Consequence for step sizes: along that direction one full-batch FedAvg round with K
    local steps multiplies the error by ``½[(1 − η)^K + (1 + (1 − 2μ)η)^K]``, which is
    < 1 only for ``η_l ≲ 2μ / ((K − 1)(1 − 2μ))`` (≈ 0.0022 at K = 10): FedAvg needs a
    far smaller local step than SGD's 1/β here, whatever G. Pass a smaller ``delta`` (e.g.
    0.5, the largest with both clients convex, via :func:`quadratic_problem`) for a
    milder problem.

    Args:
      G: gradient dissimilarity at the optimum (the paper uses 1, 10, 100).
      seed: construction seed; problems differing only in G share everything else.
      dim: dimension d >= 2.
      mu: strong convexity of f, 0 < μ < 1.
      delta: Hessian dissimilarity; defaults to ``1 − mu``, the largest feasible.
      start_distance: ‖x0 − x*‖.

    Returns:
      A :class:`QuadraticProblem` with N = 2, β = 1.
    """
    if delta is None:
        delta = 1.0 - float(mu)
    return quadratic_problem(
        num_clients=2,
        dim=dim,
        beta=1.0,
        delta=delta,
        G=G,
        mu=mu,
        seed=seed,
        convex_clients=False,
        start_distance=start_distance,
    )


# ---------------------------------------------------------------------------------------
# 2-3. Synthetic(α, β): the shared generator
# ---------------------------------------------------------------------------------------

_SIZES, _MODEL, _DATA, _IID = 0, 1, 2, 3  # stream tags folded into the root key
_LOGNORMAL_MEAN, _LOGNORMAL_SIGMA, _MIN_SIZE = 4.0, 2.0, 50  # FedProx / LEAF code
_CHUNK = 4096  # examples per compiled materialisation call (one compile for any size)


def _feature_std(dim: int) -> jax.Array:
    """Standard deviations ``sqrt(Σ_jj) = j^-0.6`` of the diagonal covariance, j = 1..d."""
    return jnp.arange(1, dim + 1, dtype=jnp.float32) ** -0.6


def _client_model(
    key: jax.Array,
    client_id: jax.Array,
    alpha: jax.Array,
    beta: jax.Array,
    *,
    dim: int,
    num_classes: int,
    iid: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Client ``client_id``'s ``(W [d, C], b [C], v [d])`` from ``fold_in(model_root, i)``.

    One normal draw of ``2 + dC + C + d`` numbers laid out as ``(u, B, W, b, v)`` — one
    draw, not five: every separate ``jr.normal`` adds about a second of XLA compile time
    on a CPU.
    """
    k = jr.fold_in(jr.fold_in(key, _MODEL), client_id)
    dc = dim * num_classes
    draw = jr.normal(k, (2 + dc + num_classes + dim,))
    u, big_b = alpha * draw[0], beta * draw[1]
    if iid:
        # Synthetic-IID (FedProx code): one global (W, b) ~ N(0, 1); x centred at B_k·1.
        shared = jr.normal(jr.fold_in(key, _IID), (dc + num_classes,))
        w = shared[:dc].reshape(dim, num_classes)
        b = shared[dc:]
        v = jnp.full((dim,), big_b)
    else:
        w = u + draw[2 : 2 + dc].reshape(dim, num_classes)
        b = u + draw[2 + dc : 2 + dc + num_classes]
        v = big_b + draw[2 + dc + num_classes :]
    return w, b, v


def _examples(
    key: jax.Array,
    client_id: jax.Array,
    js: jax.Array,
    model: tuple[jax.Array, jax.Array, jax.Array],
) -> dict[str, jax.Array]:
    """Examples ``js`` ([n] int32) of one client with the given model: ``{"x", "y"}``."""
    w, b, v = model
    client_key = jr.fold_in(jr.fold_in(key, _DATA), client_id)
    std = _feature_std(v.shape[-1])
    z = jax.vmap(lambda j: jr.normal(jr.fold_in(client_key, j), v.shape))(js)
    x = v[None, :] + std[None, :] * z
    # An explicit product-and-sum rather than a dot, which XLA may lower differently per
    # program (or run in TF32 on GPUs): labels should not depend on how a client is batched.
    logits = jnp.sum(x[:, :, None] * w[None, :, :], axis=1) + b[None, :]
    return {"x": x, "y": jnp.argmax(logits, axis=-1).astype(jnp.int32)}


def _generate(key, alpha, beta, client_id, js, *, dim, num_classes, iid):
    model = _client_model(key, client_id, alpha, beta, dim=dim, num_classes=num_classes, iid=iid)
    return _examples(key, client_id, js, model)


_STATIC = ("dim", "num_classes", "iid")


@jax.jit
def _size_normals(key: jax.Array, ids: jax.Array) -> jax.Array:
    return jax.vmap(lambda i: jr.normal(jr.fold_in(jr.fold_in(key, _SIZES), i)))(ids)


def _client_sizes(key: jax.Array, num_clients: int, sizes: str | int, max_size: int | None):
    """Total examples per client (numpy int64): ``floor(lognormal(4, 2)) + 50`` or fixed."""
    if isinstance(sizes, str):
        z = np.asarray(_size_normals(key, jnp.arange(num_clients, dtype=jnp.int32)), np.float64)
        # Cap the exponent so a freak draw cannot overflow the int32 counts.
        log_n = np.minimum(_LOGNORMAL_MEAN + _LOGNORMAL_SIGMA * z, 30 * math.log(2))
        n = np.floor(np.exp(log_n)).astype(np.int64) + _MIN_SIZE
    else:
        n = np.full(num_clients, int(sizes), np.int64)
    if max_size is not None:
        n = np.minimum(n, int(max_size))
    return n


@functools.partial(jax.jit, static_argnames=_STATIC)
def _materialise_chunk(key, alpha, beta, client_ids, js, *, dim, num_classes, iid):
    """Examples for flat (client_id, j) pairs [n]: each client's model is recomputed from
    its own key, so the numbers equal those of the per-client (procedural) path."""

    def one(i, j):
        ex = _generate(key, alpha, beta, i, j[None], dim=dim, num_classes=num_classes, iid=iid)
        return jax.tree.map(lambda a: a[0], ex)

    return jax.vmap(one)(client_ids, js)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _models(key, alpha, beta, client_ids, *, dim, num_classes, iid):
    """The models of clients ``client_ids`` ([n]): ``(W [n, d, C], b [n, C], v [n, d])``."""
    kw = dict(dim=dim, num_classes=num_classes, iid=iid)
    return jax.vmap(lambda i: _client_model(key, i, alpha, beta, **kw))(client_ids)


def _materialise(key, alpha, beta, client_ids, js, *, dim, num_classes, iid) -> dict:
    """Numpy examples for flat ``(client_ids, js)``, generated in fixed-size chunks."""
    total = len(client_ids)
    out = {"x": np.empty((total, dim), np.float32), "y": np.empty(total, np.int32)}
    for start in range(0, total, _CHUNK):
        stop = min(start + _CHUNK, total)
        ids = np.zeros(_CHUNK, np.int32)
        pos = np.zeros(_CHUNK, np.int32)
        ids[: stop - start] = client_ids[start:stop]
        pos[: stop - start] = js[start:stop]
        ex = _materialise_chunk(
            key, alpha, beta, jnp.asarray(ids), jnp.asarray(pos),
            dim=dim, num_classes=num_classes, iid=iid,
        )  # fmt: skip
        for name in out:
            out[name][start:stop] = np.asarray(ex[name])[: stop - start]
    return out


def _check_host_memory(needed: int, what: str, holds: str, fix: str) -> None:
    """ValueError when building data needs more host memory than is available."""
    available = resources.available_memory_bytes(jax.devices("cpu")[0])
    if needed > available:
        # (an absurd size, dim = 10**400, is beyond format_bytes' float)
        size = f"{needed} bytes ({resources.format_bytes(needed)})" if needed < 2**100 else (
            "more than 2**100 bytes"
        )  # fmt: skip
        raise ValueError(
            f"{what} needs {size} of host memory for {holds}, more than the {available} bytes "
            f"({resources.format_bytes(available)}) available; {fix}."
        )


def _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size):
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients={num_clients!r} is invalid: it must be an integer >= 1.")
    for name, value in (("alpha", alpha), ("beta", beta)):
        value = _check_finite(name, value)
        if value < 0:
            raise ValueError(f"{name}={value} is invalid: it must be >= 0 (a standard deviation).")
    if isinstance(dim, bool) or int(dim) != dim or dim < 1:
        raise ValueError(f"dim={dim!r} is invalid: it must be an integer >= 1 (the paper: 60).")
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(
            f"num_classes={num_classes!r} is invalid: it must be an integer >= 2 (paper: 10)."
        )
    if isinstance(sizes, str):
        if sizes != "powerlaw":
            raise ValueError(f"sizes={sizes!r} is invalid: use 'powerlaw' or an integer >= 1.")
    elif isinstance(sizes, bool) or int(sizes) != sizes or sizes < 1:
        raise ValueError(f"sizes={sizes!r} is invalid: use 'powerlaw' or an integer >= 1.")
    if max_size is not None and (
        isinstance(max_size, bool) or int(max_size) != max_size or max_size < 1
    ):
        raise ValueError(f"max_size={max_size!r} is invalid: it must be None or an integer >= 1.")


def synthetic_alpha_beta(
    num_clients: int,
    alpha: float,
    beta: float,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    sizes: str | int = "powerlaw",
    test_fraction: float = 0.2,
    *,
    iid: bool = False,
    max_size: int | None = None,
) -> FederatedData:
    """Synthetic(α, β) of Li et al. (FedProx) as a device-resident :class:`FederatedData`.

    Client i draws ``n_i`` examples (``floor(lognormal(4, 2)) + 50`` for "powerlaw", as the
    FedProx/LEAF code; or ``sizes`` each), then holds out ``floor(test_fraction · n_i)`` of
    them: its training examples are the stream indices ``j < n_train_i``, its test examples
    ``n_train_i <= j < n_i`` — the same distribution, never trained on. ``data.test`` pools
    all clients' held-out examples (so it weights clients by size, like the paper's pooled
    test accuracy).

    The examples are exactly those of ``procedural_synthetic(..., seed=seed)`` with the same
    α, β, d, C, iid: client i's training rows are its procedural examples ``0..n_train_i−1``.

    Args:
      num_clients: N >= 1 (the paper: 30).
      alpha: α >= 0, the std of the model prior (how much clients' labelling differs).
      beta: β >= 0, the std of the input prior (how much clients' inputs differ).
      dim: input dimension d (60 in the paper).
      num_classes: C (10 in the paper).
      seed: the root key's seed.
      sizes: "powerlaw" or a fixed number of examples per client (before the split).
      test_fraction: fraction held out per client, in [0, 1); 0 gives ``test=None``.
      iid: the Synthetic-IID variant (shared W, b; v_k = B_k·1).
      max_size: optional cap on n_i (the lognormal tail reaches 10⁴–10⁵).

    Returns:
      ``FederatedData`` with examples ``{"x": float32 [n, d], "y": int32 [n]}``.

    Examples:
      >>> data = synthetic_alpha_beta(num_clients=3, alpha=1.0, beta=1.0, sizes=10)
      >>> data.counts.tolist(), data.examples["x"].shape, int(data.test["y"].shape[0])
      ([8, 8, 8], (24, 60), 6)
    """
    _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size)
    test_fraction = _check_finite("test_fraction", test_fraction)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} is invalid: it must be in [0, 1).")
    n, dim, num_classes = int(num_clients), int(dim), int(num_classes)
    key = jr.key(seed)
    _check_host_memory(  # before the sizes are drawn: every client holds >= 1 example
        n * (4 * dim + 4 + 64), f"num_clients={n} with dim={dim!r}",
        f"at least {n} examples of {dim} float32 features",
        "use fewer clients (or procedural_synthetic, which keeps none)",
    )  # fmt: skip
    totals = _client_sizes(key, n, sizes, max_size)
    _check_host_memory(
        int(totals.sum()) * (4 * dim + 4), f"dim={dim!r} with num_clients={n}",
        f"{int(totals.sum())} examples of {dim} float32 features",
        "use a smaller dim or fewer clients (or procedural_synthetic, which keeps none)",
    )  # fmt: skip
    n_test = np.floor(test_fraction * totals).astype(np.int64)
    n_train = totals - n_test  # >= 1 because test_fraction < 1 and totals >= 1

    def flat(counts: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.repeat(np.arange(n, dtype=np.int32), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        js = np.arange(int(counts.sum())) - np.repeat(starts, counts) + np.repeat(first, counts)
        return ids, js.astype(np.int32)

    a, b = jnp.float32(alpha), jnp.float32(beta)
    kw = dict(dim=dim, num_classes=num_classes, iid=bool(iid))
    train = _materialise(key, a, b, *flat(n_train, np.zeros(n, np.int64)), **kw)
    test = None
    if n_test.sum() > 0:
        test = jax.tree.map(jnp.asarray, _materialise(key, a, b, *flat(n_test, n_train), **kw))
    offsets = np.concatenate([[0], np.cumsum(n_train)[:-1]])
    return FederatedData(
        examples=jax.tree.map(jnp.asarray, train),
        offsets=jnp.asarray(offsets, jnp.int32),
        counts=jnp.asarray(n_train, jnp.int32),
        test=test,
        num_clients=n,
        max_count=int(n_train.max()),
    )


@flax.struct.dataclass
class ProceduralSynthetic:
    """Synthetic(α, β) clients generated on the fly: 10⁶ clients, no data memory.

    Implements the dataset protocol of :class:`~scaffold_jax.data.federated.FederatedData`
    (``num_clients``, ``counts``, ``max_count``, ``test``, ``client_batches``). Example j of
    client i is a pure function of ``(key, i, j)``: its features come from
    ``fold_in(fold_in(seed_key, i), j)`` and its label from client i's model, itself drawn
    from ``fold_in(model_root, i)`` (see the module docstring). So a client's data are the
    same on every visit, under any vmap/jit/sharding, and equal to
    :meth:`client_examples`. Build it with :func:`procedural_synthetic`.

    Attributes:
      key: the root key (typed, ``jax.random.key(seed)``).
      alpha: float32 scalar α (a leaf: changing it does not recompile).
      beta: float32 scalar β.
      counts: ``[N]`` int32 training examples per client (positions ``0..counts[i]−1``).
      test: ``{"x": [T, d], "y": [T]}`` held-out examples (see :func:`procedural_synthetic`).
      num_clients: N (static).
      max_count: max_i counts[i] (static; the padded width of a round's batches).
      dim: input dimension d (static).
      num_classes: C (static).
      iid: Synthetic-IID variant (static).
    """

    key: jax.Array
    alpha: jax.Array
    beta: jax.Array
    counts: jax.Array
    test: Examples | None
    num_clients: int = flax.struct.field(pytree_node=False)
    max_count: int = flax.struct.field(pytree_node=False)
    dim: int = flax.struct.field(pytree_node=False)
    num_classes: int = flax.struct.field(pytree_node=False)
    iid: bool = flax.struct.field(pytree_node=False)

    @property
    def _static(self) -> dict[str, Any]:
        return dict(dim=self.dim, num_classes=self.num_classes, iid=self.iid)

    def examples_at(self, client_id: jax.Array, js: jax.Array) -> dict[str, jax.Array]:
        """Examples ``js`` (``[n]`` int) of client ``client_id``: ``{"x": [n, d], "y": [n]}``.

        Jittable and vmappable over ``client_id``; no bound check on ``js`` (indices at or
        beyond ``counts[i]`` are that client's held-out stream).
        """
        js = jnp.asarray(js, jnp.int32)
        return _generate(self.key, self.alpha, self.beta, client_id, js, **self._static)

    def client_batches(
        self, client_id: jax.Array, key: jax.Array, plan: BatchPlan
    ) -> tuple[Examples, jax.Array]:
        """Batches ``[K, B, ...]`` and mask ``[K, B]`` for one client (vmap over clients).

        Positions come from ``plan.positions(key, counts[i], max_count)`` exactly as for
        :class:`FederatedData`; the examples at those positions are then generated. Padded
        slots generate an example too (position 0) and are masked out.
        """
        count = self.counts[client_id]
        pos, mask = plan.positions(key, count, self.max_count)
        ex = self.examples_at(client_id, pos.reshape(-1))
        return jax.tree.map(lambda a: a.reshape(pos.shape + a.shape[1:]), ex), mask

    def client_examples(self, client_id: int) -> dict[str, np.ndarray]:
        """Client ``client_id``'s ``counts[i]`` training examples as numpy (for inspection)."""
        count = int(self.counts[client_id])
        ids = np.full(count, int(client_id), np.int32)
        js = np.arange(count, dtype=np.int32)
        return _materialise(self.key, self.alpha, self.beta, ids, js, **self._static)

    def client_model(self, client_id: int | np.ndarray) -> dict[str, np.ndarray]:
        """Client model(s) ``{"W": [..., d, C], "b": [..., C], "v": [..., d]}`` as numpy.

        ``client_id`` may be an int or an array of ids (vectorised).
        """
        ids = np.asarray(client_id, np.int32)
        w, b, v = _models(self.key, self.alpha, self.beta, ids.reshape(-1), **self._static)
        return {
            name: np.asarray(a).reshape(ids.shape + a.shape[1:])
            for name, a in (("W", w), ("b", b), ("v", v))
        }

    @property
    def num_examples(self) -> int:
        """Total training examples over all clients."""
        return int(np.asarray(self.counts, np.int64).sum())


def procedural_synthetic(
    num_clients: int,
    alpha: float,
    beta: float,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    sizes: str | int = "powerlaw",
    *,
    max_size: int | None = 1000,
    num_test_clients: int = 100,
    test_per_client: int = 20,
    iid: bool = False,
) -> ProceduralSynthetic:
    """Builds :class:`ProceduralSynthetic` clients (Synthetic(α, β) generated on the fly).

    ``counts`` are drawn procedurally per client id (the same "powerlaw" or fixed sizes as
    :func:`synthetic_alpha_beta`) and materialised as an ``[N]`` int32 array (four bytes
    per client) because the engine reads ``counts[ids]`` for weighting. They are capped at
    ``max_size`` (default 1000; ``None`` for no cap): ``max_count`` is the padded width of
    every round's batches, and over a million clients the uncapped lognormal(4, 2) tail
    reaches sizes of the order of the number of clients; the cap clips that tail only.

    A single global model fits Synthetic(α, β) well only for few clients: every client's
    W_k carries independent N(0, 1) entries (whatever α), so with thousands of clients the
    pooled labels are close to unpredictable from x (even a centralised logistic regression
    does little better than chance; benchmarks/README.md has the accuracies). For a
    learnable many-client task use ``iid=True``, which keeps the input heterogeneity (β).

    Test set: ``num_test_clients`` distinct clients chosen at random (numpy, from ``seed``)
    each contribute ``test_per_client`` examples from their stream positions
    ``counts[i] .. counts[i] + test_per_client − 1``, which no round ever draws; generated
    once, as concrete arrays.

    Args:
      num_clients: N >= 1 (10⁶ is fine).
      alpha: α >= 0 (std of the model prior).
      beta: β >= 0 (std of the input prior).
      dim: d (60 in the paper).
      num_classes: C (10 in the paper).
      seed: root key seed; same seed ⇒ same clients as :func:`synthetic_alpha_beta`.
      sizes: "powerlaw" or a fixed number of training examples per client.
      max_size: cap on a client's training examples, or None.
      num_test_clients: clients in the test set (at most N; 0 gives ``test=None``).
      test_per_client: held-out examples per test client.
      iid: the Synthetic-IID variant.

    Returns:
      A :class:`ProceduralSynthetic`.

    Examples:
      >>> data = procedural_synthetic(10**6, alpha=1.0, beta=1.0, sizes=20)
      >>> data.num_clients, data.counts.shape, data.test["x"].shape
      (1000000, (1000000,), (2000, 60))
    """
    _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size)
    for name, value in (
        ("num_test_clients", num_test_clients),
        ("test_per_client", test_per_client),
    ):
        if isinstance(value, bool) or int(value) != value or value < 0:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 0.")
    n = int(num_clients)
    key = jr.key(seed)
    _check_host_memory(  # the per-client sizes (drawn as float64 normals, kept as int32)
        n * 36, f"num_clients={n}", "the clients' sizes", "use fewer clients"
    )
    counts = _client_sizes(key, n, sizes, max_size)
    data = ProceduralSynthetic(
        key=key,
        alpha=jnp.float32(alpha),
        beta=jnp.float32(beta),
        counts=jnp.asarray(counts, jnp.int32),
        test=None,
        num_clients=n,
        max_count=int(counts.max()),
        dim=int(dim),
        num_classes=int(num_classes),
        iid=bool(iid),
    )
    num_test_clients = min(int(num_test_clients), n)
    if num_test_clients > 0 and test_per_client > 0:
        rng = np.random.default_rng(seed)
        test_ids = np.sort(rng.choice(n, size=num_test_clients, replace=False)).astype(np.int32)
        ids = np.repeat(test_ids, int(test_per_client))
        js = (counts[ids] + np.tile(np.arange(int(test_per_client)), num_test_clients)).astype(
            np.int32
        )
        test = _materialise(key, data.alpha, data.beta, ids, js, **data._static)
        data = data.replace(test=jax.tree.map(jnp.asarray, test))
    return data


# --------------------------------------------------------------------------------------
# The registry: each family as a dataset a config names (``--dataset quadratic``)
# --------------------------------------------------------------------------------------
class Family(NamedTuple):
    """A synthetic family built for a run.

    Attributes:
      data: the federated data (materialised or procedural).
      example_shape: the shape of one example's input (for the model), or None when the
        family brings its own problem.
      num_classes: C, or None.
      problem: the family's own :class:`~scaffold_jax.types.Problem` (the quadratics'), or
        None: the config's model is built for ``example_shape`` and ``num_classes``.
      info: what the run's summary says about the data (constants, sizes).
    """

    data: Any
    example_shape: tuple[int, ...] | None
    num_classes: int | None
    problem: Problem | None
    info: dict[str, Any]


class FamilySpec(NamedTuple):
    """A registered synthetic family.

    Attributes:
      build: ``build(num_clients, seed, **options) -> Family``.
      description: one line for help texts.
      options: ``{name: Option}``, its declared options (passed as keywords).
      brings_problem: whether its :class:`Family` brings its own problem (no model).
    """

    build: Callable[..., Family]
    description: str
    options: Mapping[str, Option] = {}
    brings_problem: bool = False


def _quadratic_family(num_clients, seed, *, dim, beta, delta, G, mu, start) -> Family:
    qp = quadratic_problem(num_clients, dim, beta, delta, G, mu, seed, convex_clients=False,
                           start_distance=start)  # fmt: skip
    info = {"beta": qp.beta, "delta": qp.delta, "G": qp.G, "mu": qp.mu, "f_star": qp.f_star}
    return Family(qp.data, None, None, qp.problem, info)


def _synthetic_family(num_clients, seed, *, alpha, beta, dim, iid, procedural) -> Family:
    if procedural:
        data = procedural_synthetic(num_clients, alpha, beta, dim, seed=seed, iid=iid)
    else:
        data = synthetic_alpha_beta(num_clients, alpha, beta, dim, seed=seed, iid=iid)
    return Family(data, (dim,), data.num_classes if procedural else 10, None, {})


_QUADRATIC_OPTIONS = {
    "quad_dim": Option(10, "quadratic: dimension d", "int", low=1, argument="dim"),
    "quad_beta": Option(1.0, "quadratic: smoothness beta of every client", "float", low=0.0,
                        strict=True, argument="beta"),
    "quad_delta": Option(0.5, "quadratic: Hessian dissimilarity delta (feasible: see "
                         "quadratic_problem)", "float", low=0.0, argument="delta"),
    "quad_G": Option(1.0, "quadratic: gradient dissimilarity G at the optimum", "float",
                     low=0.0, argument="G"),
    "quad_mu": Option(0.01, "quadratic: strong convexity mu of the mean", "float", low=0.0,
                      strict=True, argument="mu"),
    "quad_start": Option(1.0, "quadratic: distance of the initial params from the optimum",
                         "float", low=0.0, argument="start"),
}  # fmt: skip


def _synthetic_options(procedural: bool) -> dict[str, Option]:
    return {
        "synth_alpha": Option(1.0, "Synthetic(alpha, beta): std of the model prior alpha",
                              "float", low=0.0, argument="alpha"),
        "synth_beta": Option(1.0, "Synthetic(alpha, beta): std of the input prior beta",
                             "float", low=0.0, argument="beta"),
        "synth_dim": Option(60, "Synthetic(alpha, beta): input dimension d", "int", low=1,
                            argument="dim"),
        "synth_iid": Option(False, "Synthetic(alpha, beta): the IID variant (one shared "
                            "model)", "bool", argument="iid"),
    }  # fmt: skip


#: The synthetic families a config may name as its dataset.
FAMILIES: Registry[FamilySpec] = Registry("synthetic family")
FAMILIES.register(
    "quadratic",
    FamilySpec(
        _quadratic_family,
        "quadratics with prescribed beta, delta, G, mu (Figure 3's family; brings its own "
        "loss, no model)",
        _QUADRATIC_OPTIONS,
        brings_problem=True,
    ),
)
FAMILIES.register(
    "synthetic",
    FamilySpec(
        functools.partial(_synthetic_family, procedural=False),
        "Synthetic(alpha, beta) logistic data of Li et al. (FedProx), materialised",
        _synthetic_options(False),
    ),
)
FAMILIES.register(
    "procedural_synthetic",
    FamilySpec(
        functools.partial(_synthetic_family, procedural=True),
        "Synthetic(alpha, beta) generated inside the round from the client id: 10^6 "
        "clients cost only their counts",
        _synthetic_options(True),
    ),
)
