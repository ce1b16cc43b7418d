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

Synthetic(α, β) and its procedural clients (with how their randomness is drawn) are in
:mod:`~scaffold_jax.data.synthetic_alpha_beta`; this module holds the quadratics and
registers the three families as :data:`FAMILIES`, the datasets a config may name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax.data.federated import FederatedData, from_client_arrays
from scaffold_jax.data.synthetic_alpha_beta import (
    ProceduralSynthetic,
    check_finite,
    check_host_memory,
    check_int,
    procedural_synthetic,
    synthetic_alpha_beta,
)
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
    n = check_int("num_clients", num_clients, 1)
    d = check_int("dim", dim, 2, " (direction 0 carries δ, another pins λ_min(A) = μ)")
    beta = check_finite("beta", beta)
    delta = check_finite("delta", delta)
    G = check_finite("G", G)
    mu = check_finite("mu", mu)
    start_distance = check_finite("start_distance", start_distance)
    if beta <= 0:
        raise ValueError(f"beta={beta} is invalid: it must be > 0 (the smoothness max ‖A_i‖).")
    if not 0 < mu <= beta:
        raise ValueError(
            f"mu={mu} is invalid: it must be in (0, beta] = (0, {beta}] (λ_min of the mean "
            "Hessian; f must be strongly convex)."
        )
    for name, value in (("delta", delta), ("G", G), ("start_distance", start_distance)):
        if value < 0:
            raise ValueError(f"{name}={value} is invalid: it must be >= 0.")
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
    check_host_memory(
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


_SYNTHETIC_OPTIONS = {
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
        _SYNTHETIC_OPTIONS,
    ),
)
FAMILIES.register(
    "procedural_synthetic",
    FamilySpec(
        functools.partial(_synthetic_family, procedural=True),
        "Synthetic(alpha, beta) generated inside the round from the client id: 10^6 "
        "clients cost only their counts",
        _SYNTHETIC_OPTIONS,
    ),
)
