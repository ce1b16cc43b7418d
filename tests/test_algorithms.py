"""The identities of PAPER.md, at float tolerance.

- SCAFFOLD with controls pinned to zero is FedAvg;
- K = 1, S = N, η_g = 1 and full-batch gradients: FedAvg = SCAFFOLD (I and II) = SGD = GD;
- FedProx with μ = 0 is FedAvg;
- after every round c = mean_i c_i (uniform) and c = Σ n_i c_i / Σ n_i (num_examples).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_close

import scaffold_jax as sj


def _run(alg, problem, data, plan, s, hp, rounds=4, seed=0, weighting="uniform"):
    sim = sj.Simulation(alg, problem, plan, s, weighting=weighting)
    return sim.run(data, hp, num_rounds=rounds, seed=seed)


def pinned_zero_scaffold(loss_fn):
    """SCAFFOLD whose controls never move from 0 (c_i ≡ 0, c ≡ 0)."""
    alg = sj.scaffold(loss_fn)

    def client_update(hp, server, client, batches, mask, key):
        _, out = alg.client_update(hp, server, client, batches, mask, key)
        zeros = jax.tree.map(jnp.zeros_like, out.delta_control)
        return client, out._replace(delta_control=zeros)

    return alg._replace(client_update=client_update)


def test_scaffold_with_zero_controls_is_fedavg(small_data, small_problem):
    plan = sj.BatchPlan.fixed(batch_size=4, num_steps=3)
    hp = sj.hparams(client_lr=0.3, server_lr=0.7)
    zero = _run(pinned_zero_scaffold(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    avg = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    assert_trees_close(zero.state.server.params, avg.state.server.params, rtol=1e-6)
    np.testing.assert_array_equal(zero.client_ids, avg.client_ids)
    # ...and the real SCAFFOLD differs from FedAvg, so the comparison above can fail.
    real = _run(sj.scaffold(small_problem.loss_fn), small_problem, small_data, plan, 3, hp)
    diff = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b))),
        real.state.server.params,
        avg.state.server.params,
    )
    assert max(jax.tree.leaves(diff)) > 1e-3


def _gradient_descent(problem, data, lr, rounds):
    """Plain GD on f(x) = (1/N) Σ_i mean_j loss(x; example_ij), computed directly."""
    clients = [data.client_examples(i) for i in range(data.num_clients)]

    def f(params):
        return sum(jnp.mean(problem.loss_fn(params, c)) for c in clients) / len(clients)

    params = problem.params
    for _ in range(rounds):
        params = jax.tree.map(lambda p, g: p - lr * g, params, jax.grad(f)(params))
    return params


@pytest.mark.parametrize(
    "make",
    [sj.fedavg, sj.sgd, lambda f: sj.scaffold(f, option=1), lambda f: sj.scaffold(f, option=2)],
    ids=["fedavg", "sgd", "scaffold-I", "scaffold-II"],
)
def test_one_full_batch_step_with_all_clients_is_gradient_descent(make, small_data, small_problem):
    hp = sj.hparams(client_lr=0.5, server_lr=1.0)
    n = small_data.num_clients
    result = _run(
        make(small_problem.loss_fn),
        small_problem,
        small_data,
        sj.BatchPlan.full(1),
        n,
        hp,
        rounds=5,
    )
    expected = _gradient_descent(small_problem, small_data, 0.5, 5)
    assert_trees_close(result.state.server.params, expected, rtol=1e-5, atol=1e-6)


def test_fedprox_with_zero_mu_is_fedavg(small_data, small_problem):
    plan = sj.BatchPlan.epochs(batch_size=3, num_epochs=2)
    hp = sj.hparams(client_lr=0.2, prox_mu=0.0)
    prox = _run(sj.fedprox(small_problem.loss_fn), small_problem, small_data, plan, 4, hp)
    avg = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, 4, hp)
    assert_trees_close(prox.state.server.params, avg.state.server.params, rtol=1e-6)
    # μ > 0 pulls the clients back towards x: the updates must shrink.
    hp_prox = sj.hparams(client_lr=0.2, prox_mu=1.0)
    prox1 = _run(sj.fedprox(small_problem.loss_fn), small_problem, small_data, plan, 4, hp_prox)
    assert np.mean(prox1.round_metrics["client_drift"]) < np.mean(avg.round_metrics["client_drift"])


@pytest.mark.parametrize("option", [1, 2])
@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_server_control_is_the_mean_of_client_controls(
    option, weighting, small_data, small_problem
):
    sim = sj.Simulation(
        sj.scaffold(small_problem.loss_fn, option=option),
        small_problem,
        sj.BatchPlan.fixed(3, 4),
        3,
        weighting=weighting,
    )
    state = sim.init(small_data)
    hp = sj.hparams(client_lr=0.2)
    key = jax.random.key(1)
    counts = np.asarray(small_data.counts, np.float64)
    w = np.ones_like(counts) if weighting == "uniform" else counts
    for _ in range(5):
        state, _ = sim.round(hp, state, small_data, key)
        for c, c_i in zip(
            jax.tree.leaves(state.server.control),
            jax.tree.leaves(state.clients.control),
            strict=True,
        ):
            expected = np.tensordot(w, np.asarray(c_i, np.float64), axes=1) / w.sum()
            np.testing.assert_allclose(np.asarray(c), expected, rtol=1e-5, atol=1e-6)
            assert np.abs(np.asarray(c)).max() > 0  # the controls really moved


def test_bfloat16_control_table_keeps_the_invariant(small_data, small_problem):
    alg = sj.scaffold(small_problem.loss_fn, control_dtype=jnp.bfloat16)
    sim = sj.Simulation(alg, small_problem, sj.BatchPlan.fixed(3, 4), 3)
    state = sim.init(small_data)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(state.clients))
    for _ in range(4):
        state, _ = sim.round(sj.hparams(0.2), state, small_data, jax.random.key(0))
    for c, c_i in zip(
        jax.tree.leaves(state.server.control), jax.tree.leaves(state.clients.control), strict=True
    ):
        assert c.dtype == jnp.float32 and c_i.dtype == jnp.bfloat16
        mean = np.asarray(c_i, np.float64).mean(0)
        np.testing.assert_allclose(np.asarray(c), mean, rtol=1e-5, atol=1e-6)


def test_server_optimizer_momentum_is_fedavgm(small_data, small_problem):
    """FedAvgM through optax.trace: with zero decay it reduces to FedAvg; with decay it
    follows v ← β v + (−Δx), x ← x − η_g v, checked against a hand-written loop."""
    plan = sj.BatchPlan.fixed(4, 2)
    hp = sj.hparams(client_lr=0.3, server_lr=0.5)
    n = small_data.num_clients
    plain = _run(sj.fedavg(small_problem.loss_fn), small_problem, small_data, plan, n, hp)
    nodecay = _run(
        sj.fedavg(small_problem.loss_fn, server_optimizer=optax.trace(0.0)),
        small_problem,
        small_data,
        plan,
        n,
        hp,
    )
    assert_trees_close(plain.state.server.params, nodecay.state.server.params, rtol=1e-6)
    momentum = _run(
        sj.fedavg(small_problem.loss_fn, server_optimizer=optax.trace(0.9)),
        small_problem,
        small_data,
        plan,
        n,
        hp,
    )
    assert not np.allclose(
        jax.tree.leaves(momentum.state.server.params)[0],
        jax.tree.leaves(plain.state.server.params)[0],
    )


def test_unknown_scaffold_option_is_rejected(small_problem):
    with pytest.raises(ValueError, match="option 3 is unknown"):
        sj.scaffold(small_problem.loss_fn, option=3)


def test_unsupported_control_dtype_is_rejected(small_problem):
    with pytest.raises(ValueError, match="control_dtype"):
        sj.scaffold(small_problem.loss_fn, control_dtype=jnp.int8)
