"""scaffold_jax.diagnostics against analytic constants, dense Hessians and per-client loops.

* β, δ, G on quadratics with known constants (``data.synthetic.quadratic_problem``), and
  checked independently with ``numpy.linalg.eigvalsh`` on the stored A_i;
* β, δ on logistic regression with unequal client sizes against dense per-client Hessians;
* client gradients against a Python loop of ``jax.grad`` on each client's examples only;
* G falls as the s% similarity of a Fashion-MNIST split rises;
* SCAFFOLD drifts less than FedAvg on a label-skewed problem.
"""

import functools
import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close
from jax.flatten_util import ravel_pytree

import scaffold_jax as sj
from scaffold_jax import diagnostics as dg
from scaffold_jax.data.synthetic import figure3_problem, procedural_synthetic, quadratic_problem
from scaffold_jax.resources import DEFAULT_EXAMPLES_PER_CHUNK


# ------------------------------------------------------------------------------- helpers
@functools.partial(jax.jit, static_argnums=0)
def _mean_loss_grad(loss_fn, params, examples):
    return jax.grad(lambda p: jnp.mean(loss_fn(p, examples)))(params)


@functools.partial(jax.jit, static_argnums=0)
def _mean_loss_hessian(loss_fn, params, examples):
    w, unravel = ravel_pytree(params)
    return jax.hessian(lambda v: jnp.mean(loss_fn(unravel(v), examples)))(w)


def reference_client_grads(problem, data, params):
    """∇f_i(x) one client at a time, on that client's examples only (no mask, no padding)."""
    return [
        _mean_loss_grad(problem.loss_fn, params, data.client_examples(i))
        for i in range(data.num_clients)
    ]


def dense_client_hessians(problem, data, params):
    """``[N, P, P]`` float64 Hessians of each client's mean loss, by ``jax.hessian``."""
    return np.stack(
        [
            np.asarray(_mean_loss_hessian(problem.loss_fn, params, data.client_examples(i)))
            for i in range(data.num_clients)
        ]
    ).astype(np.float64)


def spectral_norms(matrices):
    """Largest absolute eigenvalue of each symmetric matrix ``[N, P, P] -> [N]``."""
    return np.array([np.abs(np.linalg.eigvalsh(m)).max() for m in matrices])


@pytest.fixture(scope="module")
def unequal_data():
    """7 label-skewed clients of sizes 2..13 (the conftest ``small_data``)."""
    from conftest import make_classification_clients

    return sj.from_client_arrays(make_classification_clients([2, 9, 5, 13, 3, 7, 11]))


@pytest.fixture(scope="module")
def unequal_problem():
    return sj.models.logistic_regression((5,), 3, zero_init=False, key=jr.key(3))


# ----------------------------------------------------------------------- client gradients
def test_client_gradients_match_per_client_loop(unequal_data, unequal_problem):
    params = unequal_problem.params
    want = reference_client_grads(unequal_problem, unequal_data, params)
    # examples_per_chunk=30 gives 2 clients per chunk: 7 clients leave a ragged last chunk.
    examples_per_chunk = 30
    for chunk in (DEFAULT_EXAMPLES_PER_CHUNK, examples_per_chunk):
        got = dg.client_gradients(unequal_problem, unequal_data, params, examples_per_chunk=chunk)
        for i, g in enumerate(want):
            assert_trees_close(jax.tree.map(lambda a, i=i: a[i], got), g, rtol=1e-5, atol=1e-7)

    flat = np.stack([np.asarray(ravel_pytree(g)[0], np.float64) for g in want])  # [N, P]
    full = flat.mean(axis=0)
    full_grad = dg.full_gradient(
        unequal_problem, unequal_data, params, examples_per_chunk=examples_per_chunk
    )
    np.testing.assert_allclose(ravel_pytree(full_grad)[0], full, rtol=1e-5, atol=1e-7)
    stats = dg.gradient_dissimilarity(
        unequal_problem, unequal_data, params, examples_per_chunk=examples_per_chunk
    )
    mean_sq = np.mean(np.sum(flat**2, axis=1))
    variance = np.mean(np.sum((flat - full) ** 2, axis=1))
    np.testing.assert_allclose(stats["mean_sq_client_grad"], mean_sq, rtol=1e-5)
    np.testing.assert_allclose(stats["sq_full_grad"], full @ full, rtol=1e-5)
    np.testing.assert_allclose(stats["grad_variance"], variance, rtol=1e-5)
    np.testing.assert_allclose(stats["G_at_x"], math.sqrt(variance), rtol=1e-5)
    np.testing.assert_allclose(stats["ratio"], mean_sq / (full @ full), rtol=1e-5)


@pytest.mark.slow  # ~7 s, mostly compiling the procedural generator
def test_client_gradients_on_procedural_clients():
    # The dataset protocol only: examples generated inside the program, unequal sizes.
    data = procedural_synthetic(
        5, alpha=1.0, beta=1.0, dim=6, num_classes=3, max_size=90, num_test_clients=0
    )
    assert len(set(np.asarray(data.counts).tolist())) > 1
    problem = sj.models.logistic_regression((6,), 3, zero_init=False, key=jr.key(1))
    got = dg.client_gradients(problem, data, problem.params)
    for i, g in enumerate(reference_client_grads(problem, data, problem.params)):
        assert_trees_close(jax.tree.map(lambda a, i=i: a[i], got), g, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------ analytic constants: quadratics
QUADRATICS = {
    "convex N=4": lambda: quadratic_problem(
        num_clients=4, dim=6, beta=2.0, delta=0.8, G=3.0, mu=0.1, seed=1
    ),
    # The paper's Figure 3 setting: non-convex client 0 (eigenvalue 2μ − 1 < 0), δ = 0.99.
    "figure3 N=2": lambda: figure3_problem(G=10.0, seed=0),
}


@pytest.mark.parametrize("name", sorted(QUADRATICS))
def test_quadratic_constants_match_analytic(name):
    qp = QUADRATICS[name]()
    x0 = qp.problem.params
    beta = dg.smoothness(qp.problem, qp.data, x0, num_iters=200)
    delta = dg.hessian_dissimilarity(qp.problem, qp.data, x0, num_iters=200, key=jr.key(7))

    # The construction's constants ...
    np.testing.assert_allclose(float(beta.value), qp.beta, rtol=1e-3)
    np.testing.assert_allclose(float(delta.value), qp.delta, rtol=1e-3)
    # ... and, independently, eigvalsh of the stored float32 Hessians, client by client.
    mean_hessian = qp.A.mean(axis=0)
    np.testing.assert_allclose(beta.per_client, spectral_norms(qp.A), rtol=1e-3)
    np.testing.assert_allclose(delta.per_client, spectral_norms(qp.A - mean_hessian), rtol=1e-3)
    assert float(delta.rel_change) < 1e-4

    # G: at x* the bound's right side is G², and ∇f(x*) = 0.
    x_star = {"x": jnp.asarray(qp.x_star, jnp.float32)}
    at_star = dg.gradient_dissimilarity(qp.problem, qp.data, x_star)
    np.testing.assert_allclose(math.sqrt(float(at_star["mean_sq_client_grad"])), qp.G, rtol=1e-3)
    np.testing.assert_allclose(float(at_star["G_at_x"]), qp.G, rtol=1e-3)
    assert float(at_star["sq_full_grad"]) < 1e-6 * qp.G**2

    # Away from x*: ∇f_i(x) = A_i x − b_i in float64.
    x = np.asarray(x0["x"], np.float64)
    grads = np.einsum("nij,j->ni", qp.A, x) - qp.b
    at_x0 = dg.gradient_dissimilarity(qp.problem, qp.data, x0)
    np.testing.assert_allclose(
        at_x0["mean_sq_client_grad"], np.mean(np.sum(grads**2, 1)), rtol=1e-4
    )
    np.testing.assert_allclose(at_x0["sq_full_grad"], np.sum(grads.mean(0) ** 2), rtol=1e-4)


def test_hessian_estimates_match_dense_hessians_unequal_clients(unequal_data, unequal_problem):
    params = unequal_problem.params
    hessians = dense_client_hessians(unequal_problem, unequal_data, params)
    want_beta = spectral_norms(hessians)
    want_delta = spectral_norms(hessians - hessians.mean(axis=0))
    # A small chunk forces several scan steps (and padded clients) in the mean HVP.
    beta = dg.smoothness(unequal_problem, unequal_data, params, num_iters=200)
    delta = dg.hessian_dissimilarity(
        unequal_problem, unequal_data, params, num_iters=200, examples_per_chunk=20
    )
    np.testing.assert_allclose(beta.per_client, want_beta, rtol=1e-3)
    np.testing.assert_allclose(delta.per_client, want_delta, rtol=1e-3)
    np.testing.assert_allclose(float(delta.value), want_delta.max(), rtol=1e-3)

    # A subset of clients: their own δ_i, still against the mean Hessian of ALL clients.
    subset = dg.hessian_dissimilarity(
        unequal_problem, unequal_data, params, num_iters=200, client_ids=[4, 1]
    )
    np.testing.assert_array_equal(subset.client_ids, [4, 1])
    np.testing.assert_allclose(subset.per_client, want_delta[[4, 1]], rtol=1e-3)
    with pytest.raises(ValueError, match="client_ids"):
        dg.smoothness(unequal_problem, unequal_data, params, client_ids=[7])


# --------------------------------------------------------------------- (G, B) fit and K
def test_fit_G_B():
    # Points exactly on m = G² + B² s: the fit recovers G and B.
    g, b = dg.fit_G_B([(4.0 + 9.0 * s, s) for s in (0.0, 0.5, 3.0)])
    assert g == pytest.approx(2.0) and b == pytest.approx(3.0)

    # Noisy points: the bound holds at every point and is tight at one.
    rng = np.random.default_rng(0)
    s = rng.uniform(0, 10, 20)
    m = 2.0 + 5.0 * s + rng.uniform(0, 3, 20)
    g, b = dg.fit_G_B(list(zip(m, s, strict=True)))
    slack = g**2 + b**2 * s - m
    assert slack.min() == pytest.approx(0.0, abs=1e-9) and np.all(slack >= -1e-9)
    assert b >= 1.0

    # One point: B = 1 (Jensen makes it always feasible) and G² = m − s.
    assert dg.fit_G_B([(5.0, 1.0)]) == pytest.approx((2.0, 1.0))
    # A slope below 1 is clipped to B = 1.
    g, b = dg.fit_G_B([(10.0, 1.0), (10.5, 2.0)])
    assert b == 1.0 and g == pytest.approx(3.0)
    with pytest.raises(ValueError, match="at least one"):
        dg.fit_G_B([])


def test_suggested_local_steps():
    assert dg.suggested_local_steps(1.0, 0.1) == 10
    assert dg.suggested_local_steps(1.0, 0.99) == 1
    assert dg.suggested_local_steps(2.0, 0.0) == math.inf
    with pytest.raises(ValueError, match="delta"):
        dg.suggested_local_steps(1.0, -1.0)


# ------------------------------------------------------------------------ ideal update
def test_ideal_update_is_k_gradient_steps(unequal_data, unequal_problem):
    lr, steps = 0.3, 3
    y = unequal_problem.params
    for _ in range(steps):
        grads = reference_client_grads(unequal_problem, unequal_data, y)
        full = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        y = jax.tree.map(lambda a, g: a - lr * g, y, full)
    want = jax.tree.map(lambda a, b: a - b, y, unequal_problem.params)
    got = dg.ideal_update(unequal_problem, unequal_data, unequal_problem.params, steps, lr)
    assert_trees_close(got, want, rtol=1e-4, atol=1e-6)


def test_ideal_update_distance_vanishes_for_one_full_batch_step(unequal_data, unequal_problem):
    # K = 1, S = N, full batches, η_g = 1: FedAvg IS gradient descent, so Δx is ideal.
    lr = 0.5
    sim = sj.Simulation(
        sj.fedavg(unequal_problem.loss_fn),
        unequal_problem,
        sj.BatchPlan.full(1),
        clients_per_round=unequal_data.num_clients,
    )
    x = jax.tree.map(np.asarray, unequal_problem.params)
    state, _ = sim.round(sj.hparams(client_lr=lr), sim.init(unequal_data), unequal_data, jr.key(0))
    delta = jax.tree.map(lambda a, b: a - b, sim.algorithm.server_params(state.server), x)
    distance = dg.ideal_update_distance(unequal_problem, unequal_data, x, delta, 1, lr)
    assert float(distance) < 1e-6 * float(jnp.linalg.norm(ravel_pytree(delta)[0]))
    # Two ideal steps are not one FedAvg step: the distance sees the difference.
    assert float(dg.ideal_update_distance(unequal_problem, unequal_data, x, delta, 2, lr)) > 1e-3


# ------------------------------------------------------------------------------ report
def test_diagnose_and_format_report():
    qp = quadratic_problem(num_clients=3, dim=4, beta=1.0, delta=0.25, G=2.0, mu=0.1, seed=2)
    report = dg.diagnose(qp.problem, qp.data, num_iters=200)
    assert report.num_clients == 3 and report.num_params == 4 and report.num_points == 1
    assert report.B is None and report.G == report.G_at_x
    assert report.beta == pytest.approx(1.0, rel=1e-3)
    assert report.delta == pytest.approx(0.25, rel=1e-3)
    assert report.suggested_local_steps == 4
    assert report.compile_seconds > 0 and report.run_seconds > 0

    x_star = {"x": jnp.asarray(qp.x_star, jnp.float32)}
    fitted = dg.diagnose(qp.problem, qp.data, trajectory=[x_star], num_iters=200)
    assert fitted.num_points == 2 and fitted.B is not None and fitted.B >= 1.0
    # The fitted bound holds at both points, and at x* (∇f = 0) G must reach qp.G.
    assert fitted.G >= qp.G * (1 - 1e-3)
    assert fitted.G**2 + fitted.B**2 * report.sq_full_grad >= report.mean_sq_client_grad * (
        1 - 1e-6
    )
    text = dg.format_report(fitted)
    for needle in ("N = 3 clients", "δ", "β", "suggested K", "compile", "B = "):
        assert needle in text


# --------------------------------------------------------------- G vs s% on Fashion-MNIST
@pytest.fixture(scope="module")
def fashion_mnist_20k():
    from scaffold_jax.data import sources

    try:
        ds = sources.load("fashion_mnist")
    except FileNotFoundError as err:
        pytest.skip(f"Fashion-MNIST is not installed (Debian: dataset-fashion-mnist): {err}")
    return ds.train["x"][:20000], ds.train["y"][:20000]


@jax.jit
def _gradient_descent(params, pooled):
    """10 full-batch steps on the pooled data: a fixed, non-trivial evaluation point."""
    problem = sj.models.logistic_regression((28, 28), 10)

    def step(_, p):
        grad = jax.grad(lambda q: jnp.mean(problem.loss_fn(q, pooled)))(p)
        return jax.tree.map(lambda a, g: a - 0.5 * g, p, grad)

    return jax.lax.fori_loop(0, 10, step, params)


def test_G_decreases_with_similarity_fashion_mnist(fashion_mnist_20k):
    from scaffold_jax.data.partition import similarity_split

    x, y = fashion_mnist_20k
    problem = sj.models.logistic_regression((28, 28), 10)
    params = _gradient_descent(problem.params, {"x": jnp.asarray(x), "y": jnp.asarray(y)})
    stats = {}
    for s in (0, 50, 100):
        data = sj.from_partition({"x": x, "y": y}, similarity_split(y, 100, s, seed=0))
        stats[s] = jax.device_get(dg.gradient_dissimilarity(problem, data, params))
    G = {s: float(v["G_at_x"]) for s, v in stats.items()}
    assert G[0] > G[50] > G[100] > 0, G
    # 100 clients of exactly 200 examples: f is the pooled mean whatever the split, so ∇f
    # is the same for every s and only the spread of the client gradients changes.
    np.testing.assert_allclose(stats[0]["sq_full_grad"], stats[100]["sq_full_grad"], rtol=1e-4)
    np.testing.assert_allclose(stats[50]["sq_full_grad"], stats[100]["sq_full_grad"], rtol=1e-4)


# ------------------------------------------------------------------ drift: SCAFFOLD vs FedAvg
def skewed_clients(num_clients=20, per_client=50, num_classes=4, dim=10, seed=0):
    """Every client holds ONE label (maximal label skew, like s = 0%)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(num_classes, dim)).astype(np.float32)
    clients = []
    for i in range(num_clients):
        label = i % num_classes
        x = centers[label] + rng.normal(size=(per_client, dim)).astype(np.float32)
        clients.append({"x": x, "y": np.full(per_client, label, np.int32)})
    return sj.from_client_arrays(clients)


def drift_of(make_algorithm, problem, data, plan, hp, num_rounds):
    """Per-round ``client_drift`` of a run, and the ideal-update distance of its last round."""
    sim = sj.Simulation(make_algorithm(problem.loss_fn), problem, plan, data.num_clients)
    state, key, drift = sim.init(data), jr.key(0), []
    for _ in range(num_rounds):
        x = jax.tree.map(np.asarray, sim.algorithm.server_params(state.server))
        state, metrics = sim.round(hp, state, data, key)
        drift.append(float(metrics["client_drift"]))
    # η_g = 1, so the server step IS the aggregated update Δx.
    delta = jax.tree.map(lambda a, b: a - b, sim.algorithm.server_params(state.server), x)
    distance = dg.ideal_update_distance(
        problem, data, x, delta, plan.num_steps, float(hp.client_lr)
    )
    return np.asarray(drift), float(distance)


def test_scaffold_drifts_less_than_fedavg_on_skewed_clients():
    data = skewed_clients()
    problem = sj.models.logistic_regression((10,), 4)
    # K = 10 full-batch steps (σ = 0, as in the paper's Figure 3): no minibatch noise, so
    # the ideal-update distance measures drift alone.
    plan = sj.BatchPlan.full(10)
    hp = sj.hparams(client_lr=0.05)
    fedavg_drift, fedavg_distance = drift_of(sj.fedavg, problem, data, plan, hp, 30)
    scaffold_drift, scaffold_distance = drift_of(sj.scaffold, problem, data, plan, hp, 30)
    # Round 1 is identical (all controls start at 0); after warm-up SCAFFOLD's corrected
    # steps follow ∇f while FedAvg's clients run toward their own optima.
    np.testing.assert_allclose(fedavg_drift[0], scaffold_drift[0], rtol=1e-5)
    fedavg_late, scaffold_late = fedavg_drift[10:].mean(), scaffold_drift[10:].mean()
    print(
        f"\nclient_drift (mean of rounds 11-30): FedAvg {fedavg_late:.4g}, "
        f"SCAFFOLD {scaffold_late:.4g}\nideal-update distance (round 30): "
        f"FedAvg {fedavg_distance:.4g}, SCAFFOLD {scaffold_distance:.4g}"
    )
    assert scaffold_late < 0.5 * fedavg_late
    assert scaffold_distance < 0.1 * fedavg_distance
