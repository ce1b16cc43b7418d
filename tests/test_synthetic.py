"""Tests for scaffold_jax.data.synthetic.

The quadratic constants are MEASURED through the problem's own ``loss_fn`` with autodiff
(power iteration on Hessian-vector products, gradients at x*), never read back from the
construction. Compiled programs are shared between tests (module fixtures, one batch plan,
one set of static shapes) because XLA compile time dominates on small CPUs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from scaffold_jax.data import synthetic as syn
from scaffold_jax.data.batching import BatchPlan

# ---------------------------------------------------------------------------------------
# Quadratics: measure β, δ, μ, G, x*, f* with autodiff
# ---------------------------------------------------------------------------------------

_POWER_ITERS = 500


def _power_norm(matvec, dim: int) -> jax.Array:
    """‖H‖₂ of a symmetric H given ``v -> Hv``: power iteration on H² (robust to ±λ)."""
    v0 = jr.normal(jr.key(123), (dim,))
    v0 = v0 / jnp.linalg.norm(v0)

    def body(_, v):
        w = matvec(matvec(v))
        return w / jnp.linalg.norm(w)

    v = jax.lax.fori_loop(0, _POWER_ITERS, body, v0)
    return jnp.linalg.norm(matvec(v))


@functools.partial(jax.jit, static_argnums=0)
def _measure(loss_fn, x, A, b):
    """Measured constants of the quadratic clients at x (= x*) via loss_fn and autodiff."""
    dim = x.shape[0]

    def f_i(y, a_i, b_i):  # client i's loss: its single example
        return loss_fn({"x": y}, {"A": a_i[None], "b": b_i[None]})[0]

    def f(y):  # the global objective: the mean over the N one-example clients
        return jnp.mean(loss_fn({"x": y}, {"A": A, "b": b}))

    def hvp_i(a_i, b_i, v):
        return jax.jvp(lambda y: jax.grad(f_i)(y, a_i, b_i), (x,), (v,))[1]

    def hvp_f(v):
        return jax.jvp(jax.grad(f), (x,), (v,))[1]

    norms = jax.vmap(lambda a_i, b_i: _power_norm(lambda v: hvp_i(a_i, b_i, v), dim))(A, b)
    dissim = jax.vmap(lambda a_i, b_i: _power_norm(lambda v: hvp_i(a_i, b_i, v) - hvp_f(v), dim))(
        A, b
    )
    eye = jnp.eye(dim)
    client_hessians = jax.vmap(lambda a_i, b_i: jax.vmap(lambda v: hvp_i(a_i, b_i, v))(eye))(A, b)
    grads = jax.vmap(lambda a_i, b_i: jax.grad(f_i)(x, a_i, b_i))(A, b)
    return {
        "client_norms": norms,
        "client_dissim": dissim,
        "hessian_f": jax.vmap(hvp_f)(eye),
        "client_hessians": client_hessians,
        "grads": grads,
        "grad_f": jax.grad(f)(x),
        "f": f(x),
    }


def measure(qp: syn.QuadraticProblem) -> dict[str, np.ndarray]:
    A, b = qp.data.test["A"], qp.data.test["b"]
    x = jnp.asarray(qp.x_star, jnp.float32)
    out = jax.tree.map(np.asarray, _measure(qp.problem.loss_fn, x, A, b))
    out["beta"] = float(out["client_norms"].max())
    out["delta"] = float(out["client_dissim"].max())
    out["mu"] = float(np.linalg.eigvalsh(out["hessian_f"].astype(np.float64)).min())
    out["G"] = float(np.sqrt(np.mean(np.sum(out["grads"].astype(np.float64) ** 2, axis=1))))
    return out


QUAD_CASES = [
    # (num_clients, dim, beta, delta, G, mu, convex_clients); shapes shared with the
    # Figure 3 test where possible (each (N, d) compiles the measurement once).
    (2, 10, 1.0, 0.4, 3.0, 0.05, True),
    # δ at the feasibility bound min((β − μ)(N − 1), β(N − 1)/N) = 1.6: still exact.
    (5, 6, 2.0, 1.6, 10.0, 0.1, True),
    (3, 5, 1.0, 1.2, 1.0, 0.01, False),
]


@pytest.mark.parametrize("case", QUAD_CASES, ids=lambda c: f"N{c[0]}-d{c[1]}-convex{c[6]}")
def test_quadratic_constants_are_exact_when_measured(case):
    n, d, beta, delta, G, mu, convex = case
    qp = syn.quadratic_problem(n, d, beta, delta, G, mu, seed=7, convex_clients=convex)
    m = measure(qp)
    np.testing.assert_allclose(m["beta"], beta, rtol=1e-4)
    np.testing.assert_allclose(m["delta"], delta, rtol=1e-4)
    np.testing.assert_allclose(m["mu"], mu, rtol=1e-4)
    np.testing.assert_allclose(m["G"], G, rtol=1e-4)
    # Power iteration agrees with the eigen-decomposition of the autodiff Hessians.
    hess = m["client_hessians"].astype(np.float64)
    eig_norms = np.abs(np.linalg.eigvalsh(hess)).max(axis=1)
    np.testing.assert_allclose(m["client_norms"], eig_norms, rtol=1e-4, atol=1e-6)
    if convex:
        assert np.linalg.eigvalsh(hess).min() >= -1e-5  # every client convex
    # x* is the minimiser: ∇f(x*) = 0 (float32 gradients of size ~G cancel) and f(x*) = f*.
    assert np.linalg.norm(m["grad_f"]) <= 1e-5 * max(1.0, G)
    np.testing.assert_allclose(m["f"], qp.f_star, atol=1e-5 * max(1.0, G))
    np.testing.assert_allclose(qp.A.mean(0) @ qp.x_star, qp.b.mean(0), atol=1e-9)
    # ... and f >= f* around it and at the start point, which sits at the chosen distance.
    x0 = np.asarray(qp.problem.params["x"], np.float64)
    np.testing.assert_allclose(np.linalg.norm(x0 - qp.x_star), 1.0, rtol=1e-5)
    rng = np.random.default_rng(0)
    for x in [x0, *(qp.x_star + 0.1 * rng.standard_normal((3, d)))]:
        fx = float(jnp.mean(qp.problem.loss_fn({"x": jnp.asarray(x, jnp.float32)}, qp.data.test)))
        assert fx > qp.f_star


def test_figure3_problem_constants_for_each_G():
    measured = {}
    for G in (1.0, 10.0, 100.0):
        qp = syn.figure3_problem(G)
        assert qp.data.num_clients == 2 and qp.beta == 1.0
        np.testing.assert_allclose(qp.delta, 1.0 - qp.mu)
        m = measure(qp)
        np.testing.assert_allclose(m["beta"], 1.0, rtol=1e-4)
        np.testing.assert_allclose(m["delta"], 0.99, rtol=1e-4)
        np.testing.assert_allclose(m["mu"], 0.01, rtol=1e-4)
        np.testing.assert_allclose(m["G"], G, rtol=1e-4)
        assert np.linalg.norm(m["grad_f"]) <= 1e-5 * G
        # N = 2: E_1 = −E_2 and ∇f_1(x*) = −∇f_2(x*), both of norm G.
        hess = m["client_hessians"].astype(np.float64)
        e = hess - hess.mean(0)
        np.testing.assert_allclose(e[0], -e[1], atol=1e-6)
        np.testing.assert_allclose(np.linalg.norm(m["grads"], axis=1), [G, G], rtol=1e-4)
        # δ ≈ β forces one non-convex client: eigenvalue 2μ − 1 in the δ direction.
        np.testing.assert_allclose(np.linalg.eigvalsh(hess).min(), 2 * 0.01 - 1, rtol=1e-4)
        measured[G] = qp
    # Only the gradient scale changes with G: same Hessians and start point.
    np.testing.assert_array_equal(measured[1.0].A, measured[100.0].A)
    np.testing.assert_allclose(100 * measured[1.0].b, measured[100.0].b, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        measured[1.0].problem.params["x"], measured[100.0].problem.params["x"]
    )


def test_quadratic_data_protocol_and_identical_clients():
    qp = syn.quadratic_problem(3, 4, beta=2.0, delta=0.0, G=0.0, mu=0.5, seed=1)
    data = qp.data
    assert data.num_clients == 3 and data.max_count == 1
    assert data.counts.tolist() == [1, 1, 1]
    assert data.examples["A"].dtype == jnp.float32 and data.examples["b"].shape == (3, 4)
    batches, mask = data.client_batches(jnp.int32(2), jr.key(0), BatchPlan.full(2))
    assert batches["A"].shape == (2, 1, 4, 4) and mask.tolist() == [[1.0], [1.0]]
    np.testing.assert_array_equal(batches["A"][0, 0], data.examples["A"][2])
    # δ = 0 and G = 0: every client is f itself.
    np.testing.assert_array_equal(qp.A[0], qp.A[2])
    np.testing.assert_array_equal(qp.b[0], qp.b[1])
    losses = qp.problem.loss_fn(qp.problem.params, data.test)
    assert losses.shape == (3,) and qp.problem.accuracy_fn is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mu=0.0), "mu=0.0 is invalid"),
        (dict(mu=2.0), r"mu=2.0 is invalid: it must be in \(0, beta\]"),
        (dict(beta=-1.0, mu=0.1), "beta=-1.0 is invalid"),
        (dict(delta=-0.1), "delta=-0.1 is invalid"),
        (dict(G=-1.0), "G=-1.0 is invalid"),
        (dict(G=float("nan")), "G=nan is invalid"),
        (dict(num_clients=1, delta=0.0, G=1.0), "num_clients=1 is invalid"),
        (dict(num_clients=0), "num_clients=0 is invalid"),
        (dict(dim=1), "dim=1 is invalid"),
        (dict(delta=0.6), r"delta=0.6 is infeasible.*\[0, 0.5\].*convex_clients=False"),
        (dict(delta=0.95, convex_clients=False), r"delta=0.95 is infeasible.*\[0, 0.9\]"),
    ],
)
def test_quadratic_validation(kwargs, match):
    args = dict(num_clients=2, dim=3, beta=1.0, delta=0.2, G=1.0, mu=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        syn.quadratic_problem(**args)


# ---------------------------------------------------------------------------------------
# Synthetic(α, β) and procedural clients (one static shape set: d = 60, C = 10)
# ---------------------------------------------------------------------------------------

SEED = 3
CAP = 200
PLAN = BatchPlan.fixed(batch_size=8, num_steps=2)
NUM_IDS = 1000


@pytest.fixture(scope="module")
def proc():
    return syn.procedural_synthetic(
        10**6, alpha=1.0, beta=1.0, seed=SEED, max_size=CAP, num_test_clients=50,
        test_per_client=10,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sab():
    return syn.synthetic_alpha_beta(8, alpha=1.0, beta=1.0, seed=SEED, max_size=CAP)


@pytest.fixture(scope="module")
def round_batches(proc):
    """One round's batches for 1000 sampled clients, generated twice (two visits)."""
    ids = jnp.asarray(np.random.default_rng(0).choice(10**6, NUM_IDS, replace=False), jnp.int32)
    keys = jr.split(jr.key(9), NUM_IDS)
    fn = jax.jit(jax.vmap(lambda data, i, k: data.client_batches(i, k, PLAN), (None, 0, 0)))
    first = fn(proc, ids, keys)
    second = fn(proc, ids, keys)
    return ids, keys, first, second


def test_synthetic_alpha_beta_structure(sab):
    counts = np.asarray(sab.counts)
    assert sab.num_clients == 8 and sab.max_count == counts.max()
    assert sab.examples["x"].dtype == jnp.float32
    assert sab.examples["x"].shape == (counts.sum(), 60)
    assert sab.examples["y"].dtype == jnp.int32 and sab.test["y"].dtype == jnp.int32
    # Totals floor(lognormal(4, 2)) + 50 >= 50, capped at CAP; 20% of each held out.
    assert 40 <= counts.min() and counts.max() <= CAP
    assert 0.15 < sab.test["y"].shape[0] / (counts.sum() + sab.test["y"].shape[0]) <= 0.2
    for y in (np.asarray(sab.examples["y"]), np.asarray(sab.test["y"])):
        assert y.min() >= 0 and y.max() < 10
    np.testing.assert_array_equal(np.asarray(sab.offsets), np.r_[0, np.cumsum(counts)[:-1]])


def test_materialised_equals_procedural_streams(sab, proc):
    # Same seed ⇒ same sizes (before the split), same models, same examples.
    totals = np.asarray(proc.counts[:8])
    n_test = np.floor(0.2 * totals).astype(int)
    np.testing.assert_array_equal(np.asarray(sab.counts), totals - n_test)
    test_offsets = np.r_[0, np.cumsum(n_test)[:-1]]
    for i in (0, 5):
        stream = proc.client_examples(i)
        mine = sab.client_examples(i)
        n_train = int(sab.counts[i])
        for k in ("x", "y"):
            np.testing.assert_array_equal(mine[k], stream[k][:n_train])
            held_out = np.asarray(sab.test[k][test_offsets[i] : test_offsets[i] + n_test[i]])
            np.testing.assert_array_equal(held_out, stream[k][n_train:])


def test_a_wide_dim_materialises_in_smaller_calls_with_the_same_numbers(monkeypatch):
    # dim = 597,137 with the fixed 4,096-example call needed ~300 GB at once and XLA aborted
    # the process (found by tests/test_fuzz.py); the call now shrinks to fit its budget.
    from scaffold_jax.data import synthetic_alpha_beta as sab_mod

    for dim, classes in ((60, 10), (1000, 10), (597_137, 10), (10**7, 100)):
        chunk = sab_mod._chunk_examples(dim, classes)
        assert chunk >= 1 and chunk & (chunk - 1) == 0 and chunk <= sab_mod._CHUNK
        assert chunk == 1 or chunk * 4 * 3 * dim * classes <= sab_mod._CHUNK_BYTES
    assert sab_mod._chunk_examples(60, 10) == sab_mod._CHUNK  # the default is unchanged
    assert sab_mod._chunk_examples(597_137, 10) == 1
    kw = dict(num_clients=3, alpha=1.0, beta=1.0, dim=20, sizes=37, seed=4)
    whole = syn.synthetic_alpha_beta(**kw)
    monkeypatch.setattr(sab_mod, "_CHUNK_BYTES", 1)  # one example per call
    assert sab_mod._chunk_examples(20, 10) == 1
    piecewise = syn.synthetic_alpha_beta(**kw)
    # The same examples up to float32 round-off (XLA lowers the normal draw a little
    # differently per call shape: last-bit differences in x), the same labels.
    for a, b in ((whole.examples, piecewise.examples), (whole.test, piecewise.test)):
        np.testing.assert_allclose(np.asarray(a["x"]), np.asarray(b["x"]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(a["y"]), np.asarray(b["y"]))


def test_generative_process_matches_the_paper():
    # One large client: x ~ N(v, diag(j^-1.2)), y = argmax(x W + b) for the client's model.
    data = syn.procedural_synthetic(
        1, alpha=1.0, beta=1.0, seed=5, sizes=4000, max_size=None, num_test_clients=0
    )
    assert data.test is None
    ex = data.client_examples(0)
    model = data.client_model(0)
    x = ex["x"].astype(np.float64)
    n = x.shape[0]
    var = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(x.var(axis=0), var, rtol=0.15)
    assert np.all(np.abs(x.mean(axis=0) - model["v"]) <= 5 * np.sqrt(var / n))
    logits = x @ model["W"].astype(np.float64) + model["b"]
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4  # float32 vs float64 may differ on near-ties
    np.testing.assert_array_equal(ex["y"][clear], logits.argmax(axis=1)[clear])
    assert clear.mean() > 0.99


def test_alpha_and_beta_are_standard_deviations():
    ids = np.arange(400)
    data = syn.procedural_synthetic(400, alpha=2.0, beta=0.5, sizes=1, num_test_clients=0)
    m = data.client_model(ids)
    assert m["W"].shape == (400, 60, 10) and m["v"].shape == (400, 60)
    # mean(W_k) ≈ u_k ~ N(0, α²) (+ noise of variance 1/600); mean(v_k) ≈ B_k ~ N(0, β²).
    np.testing.assert_allclose(m["W"].mean(axis=(1, 2)).std(), np.sqrt(4 + 1 / 600), rtol=0.15)
    np.testing.assert_allclose(m["v"].mean(axis=1).std(), np.sqrt(0.25 + 1 / 60), rtol=0.15)
    # b_k shares W_k's prior mean u_k.
    assert np.corrcoef(m["W"].mean(axis=(1, 2)), m["b"].mean(axis=1))[0, 1] > 0.9
    iid = syn.procedural_synthetic(400, alpha=2.0, beta=0.5, sizes=1, num_test_clients=0, iid=True)
    mi = iid.client_model(ids[:5])
    np.testing.assert_array_equal(mi["W"][0], mi["W"][4])
    np.testing.assert_array_equal(mi["b"][1], mi["b"][3])
    assert np.all(mi["v"] == mi["v"][:, :1])  # v_k = B_k · 1


def test_seeds_reproduce_and_differ():
    a = syn.synthetic_alpha_beta(3, 0.5, 0.5, seed=1, sizes=6, test_fraction=0.0)
    b = syn.synthetic_alpha_beta(3, 0.5, 0.5, seed=1, sizes=6, test_fraction=0.0)
    c = syn.synthetic_alpha_beta(3, 0.5, 0.5, seed=2, sizes=6, test_fraction=0.0)
    assert a.test is None and a.counts.tolist() == [6, 6, 6]
    np.testing.assert_array_equal(a.examples["x"], b.examples["x"])
    assert not np.allclose(a.examples["x"], c.examples["x"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=-1.0), "alpha=-1.0 is invalid"),
        (dict(beta=float("inf")), "beta=inf is invalid"),
        (dict(num_clients=0), "num_clients=0 is invalid"),
        (dict(sizes="zipf"), "sizes='zipf' is invalid"),
        (dict(sizes=0), "sizes=0 is invalid"),
        (dict(num_classes=1), "num_classes=1 is invalid"),
        (dict(test_fraction=1.0), "test_fraction=1.0 is invalid"),
        (dict(max_size=0), "max_size=0 is invalid"),
    ],
)
def test_synthetic_validation(kwargs, match):
    args = dict(num_clients=2, alpha=1.0, beta=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        syn.synthetic_alpha_beta(**args)


def test_procedural_million_clients(proc):
    counts = np.asarray(proc.counts)
    assert proc.num_clients == 10**6 and counts.shape == (10**6,) and counts.dtype == np.int32
    assert counts.min() >= 50 and counts.max() == CAP == proc.max_count
    # floor(exp(4 + 2z)) + 50 >= CAP  <=>  z >= (log(CAP - 50) - 4) / 2: the clipped tail.
    clipped = 0.5 * math.erfc((math.log(CAP - 50) - 4) / 2 / math.sqrt(2))
    np.testing.assert_allclose(np.mean(counts == CAP), clipped, atol=3e-3)
    assert proc.test["x"].shape == (500, 60) and proc.test["y"].dtype == jnp.int32
    assert proc.num_examples == int(counts.astype(np.int64).sum())
    # A procedural dataset is a pytree with only arrays as leaves (jit/vmap friendly).
    leaves = jax.tree.leaves(proc)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)


def test_procedural_batches_shapes_values_and_determinism(proc, round_batches):
    ids, _, (batches, mask), (batches2, mask2) = round_batches
    k, b = PLAN.shape(proc.max_count)
    assert batches["x"].shape == (NUM_IDS, k, b, 60) and batches["x"].dtype == jnp.float32
    assert batches["y"].shape == (NUM_IDS, k, b) and batches["y"].dtype == jnp.int32
    assert mask.shape == (NUM_IDS, k, b) and mask.dtype == jnp.float32
    # Two visits of the same clients with the same keys: identical.
    np.testing.assert_array_equal(batches["x"], batches2["x"])
    np.testing.assert_array_equal(batches["y"], batches2["y"])
    np.testing.assert_array_equal(mask, mask2)
    # Labels in range; pooled over clients every class occurs and none dominates.
    y = np.asarray(batches["y"])
    assert y.min() >= 0 and y.max() < 10
    freq = np.bincount(y.ravel(), minlength=10) / y.size
    assert freq.min() > 0.01 and freq.max() < 0.5
    # Every counts >= 50 > B = 8 here, so every slot is real.
    assert np.all(np.asarray(mask) == 1.0)
    # Different clients see different data (features of client 0 vs 1 differ).
    assert not np.allclose(batches["x"][0], batches["x"][1])


def test_procedural_batches_are_the_clients_own_examples(proc, round_batches):
    """vmapped round batches == single-client materialisation at in-range positions (equal up
    to float round-off: the materialisation runs op by op, the batches in one fused program,
    and XLA need not compile a transcendental the same way in both)."""
    ids, _, (batches, mask), _ = round_batches
    for row in (0, 17, 999):
        i = int(ids[row])
        ex = proc.client_examples(i)
        count = int(proc.counts[i])
        assert ex["x"].shape == (count, 60)
        bx, by = np.asarray(batches["x"][row]), np.asarray(batches["y"][row])
        for step in range(bx.shape[0]):
            # Recover each slot's position from its (unique) feature vector.
            close = np.isclose(bx[step][:, None, :], ex["x"][None, :, :], rtol=1e-6, atol=1e-7)
            match = np.all(close, axis=-1)  # [B, count]
            assert np.all(match.sum(axis=1) == 1), "every slot is exactly one of the examples"
            pos = match.argmax(axis=1)
            assert np.all((pos >= 0) & (pos < count))
            assert len(set(pos.tolist())) == len(pos)  # fixed plan: distinct within a step
            np.testing.assert_array_equal(by[step], ex["y"][pos])


def test_procedural_single_call_equals_vmapped_row(proc, round_batches):
    ids, keys, (batches, mask), _ = round_batches
    row = 17
    single = jax.jit(lambda data, i, k: data.client_batches(i, k, PLAN))
    sb, sm = single(proc, ids[row], keys[row])
    np.testing.assert_array_equal(sb["x"], batches["x"][row])
    np.testing.assert_array_equal(sb["y"], batches["y"][row])
    np.testing.assert_array_equal(sm, mask[row])


def test_procedural_test_set_is_held_out(proc):
    # Test examples are stream positions >= counts[i] of sampled clients: never trained on.
    rng = np.random.default_rng(SEED)
    test_ids = np.sort(rng.choice(10**6, size=50, replace=False))
    i = int(test_ids[3])
    js = jnp.asarray(int(proc.counts[i]) + np.arange(10), jnp.int32)
    ex = jax.jit(lambda data, c, j: data.examples_at(c, j))(proc, jnp.int32(i), js)
    np.testing.assert_array_equal(ex["x"], proc.test["x"][30:40])
    np.testing.assert_array_equal(ex["y"], proc.test["y"][30:40])


# ------------------------------------------------------------------ from the command line
def _read(out):
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), records


def test_the_quadratic_family_runs_from_the_command_line_with_its_constants(tmp_path, capsys):
    """`--dataset quadratic`: its options set beta, delta, G exactly (the summary records the
    constants the construction attains), it brings its own loss (a model is refused), and
    SCAFFOLD's test loss (the global objective) falls."""
    from scaffold_jax.cli import main

    out = tmp_path / "quad"
    argv = [
        "run", "--dataset", "quadratic", "--quad-beta", "1", "--quad-delta", "0.5",
        "--quad-G", "10", "--num-clients", "6", "--client-fraction", "1", "--local-steps", "5",
        "--client-lr", "0.1", "--rounds", "10", "--eval-every", "5", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    summary, records = _read(out)
    assert summary["beta"] == pytest.approx(1.0, rel=1e-5)
    assert summary["delta"] == pytest.approx(0.5, rel=1e-5)
    assert summary["G"] == pytest.approx(10.0, rel=1e-5)
    assert records[-1]["test_loss"] < 0.1 * records[0]["test_loss"]
    assert main([*argv[:-3], "--model", "mlp", "--out", str(tmp_path / "no")]) == 2
    assert "brings its own loss" in capsys.readouterr().err


@pytest.mark.slow  # command-line runs of ~9 s and minutes
@pytest.mark.parametrize("num_clients", [20_000, 1_000_000])
def test_procedural_synthetic_runs_from_the_command_line(tmp_path, num_clients):
    """Synthetic(alpha, beta) generated inside the round: N clients cost their counts only."""
    from scaffold_jax.cli import main

    out = tmp_path / "proc"
    argv = [
        "run", "--dataset", "procedural_synthetic", "--synth-iid", "--num-clients",
        str(num_clients), "--clients-per-round", "50", "--client-lr", "0.05", "--rounds", "4",
        "--eval-every", "2", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    summary, records = _read(out)
    assert summary["num_clients"] == num_clients
    assert records[-1]["round"] == 4 and records[-1]["test_accuracy"] > records[0]["test_accuracy"]
