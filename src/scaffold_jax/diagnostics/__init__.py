"""Theory quantities of SCAFFOLD measured on a federated problem: G, B, δ, β and client drift.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML 2020, https://arxiv.org/abs/1910.06378.

The paper's rates are stated in a few constants of the federated objective
``f(x) = (1/N) Σ_i f_i(x)``; this package measures them at given params x (the gradient
side in :mod:`~scaffold_jax.diagnostics.gradients`, the Hessian side in
:mod:`~scaffold_jax.diagnostics.hessian`, all at once with :func:`diagnose`):

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
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.random as jr
from jax.flatten_util import ravel_pytree

from scaffold_jax.diagnostics.gradients import (
    Dataset,
    _as_float32,
    _grad_chunk,
    _gradient_stats,
    _loss_fn,
    client_gradients,
    fit_G_B,
    full_gradient,
    gradient_dissimilarity,
    ideal_update,
    ideal_update_distance,
)
from scaffold_jax.diagnostics.hessian import (
    SpectralEstimate,
    _client_ids,
    _power_iteration,
    _spectral_static,
    hessian_dissimilarity,
    smoothness,
    suggested_local_steps,
)
from scaffold_jax.resources import DEFAULT_EXAMPLES_PER_CHUNK
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
