"""APFL (Deng, Kamani, Mahdavi 2020): the engine against a plain per-client float64
loop (fixed and adaptive α, with dropouts), x's trajectory equal to FedAvg's bitwise, the
α = 0 identity, α_i kept in [0, 1], empty steps, and the registry entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from personal_reference import add, grad, row, run, simulation, to64, vdot

import scaffold_jax as sj
from scaffold_jax.algorithms import ALGORITHMS, apfl
from scaffold_jax.types import PersonalState, resolve_hparams

LR = 0.3
RATE = 0.4  # dropouts: a client that trains and then drops keeps its new v_i and alpha_i


@pytest.fixture(scope="module")
def sims(small_problem):
    """One simulation per variant, shared by the tests (α and η_α are data: one compile)."""
    return {
        adaptive: simulation(apfl(small_problem.loss_fn, adaptive=adaptive), small_problem, RATE)
        for adaptive in (False, True)
    }


@pytest.fixture(scope="module")
def fedavg_run(small_data, small_problem):
    sim = simulation(sj.fedavg(small_problem.loss_fn), small_problem, RATE)
    return sim.run(small_data, sj.hparams(client_lr=LR), num_rounds=ROUNDS, seed=SEED)


ROUNDS, SEED = 5, 7


def assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(w))


def test_it_is_registered_with_its_hyper_parameters_and_option():
    spec = ALGORITHMS["apfl"]
    assert spec.display_name == "APFL" and not spec.asynchronous
    assert list(spec.hparams) == ["client_lr", "server_lr", "apfl_alpha", "apfl_alpha_lr"]
    assert spec.hparams["apfl_alpha"].maximum == 1.0 and spec.hparams["apfl_alpha"].allow_zero
    assert spec.options["apfl_adaptive"].kind == "bool"
    assert spec.build(lambda p, b: jnp.zeros(()), apfl_adaptive=True).options["adaptive"]
    alg = apfl(lambda p, b: jnp.zeros(()))
    with pytest.raises(ValueError, match="apfl_alpha=1.5 is invalid"):
        resolve_hparams(alg, sj.hparams(client_lr=0.1, apfl_alpha=1.5))


def reference(data, problem, alpha0, alpha_lr, adaptive, rounds, seed, dropout_rate):
    """APFL's local work written out per client: v_i and α_i (None until it trains) in
    Python lists, float64 numpy."""
    n = data.num_clients
    v = [to64(problem.params) for _ in range(n)]
    alpha = [None] * n

    def client_work(i, x, batches, draw):
        del draw
        w, vi = x, v[i]
        a = alpha0 if (alpha[i] is None or not adaptive) else alpha[i]
        for batch in batches:
            if batch[2].sum() == 0:
                continue  # an empty (padded) step
            mixed = add(jax.tree.map(lambda t: a * t, vi), jax.tree.map(lambda t: (1 - a) * t, w))
            g_w, g_mixed = grad(w, batch), grad(mixed, batch)
            new_a = a
            if adaptive:
                new_a = min(max(a - alpha_lr * vdot(add(vi, w, -1.0), g_mixed), 0.0), 1.0)
            vi = add(vi, g_mixed, -LR * a)
            w = add(w, g_w, -LR)
            a = new_a
        v[i], alpha[i] = vi, a
        return add(w, x, -1.0)

    x, ids, dropped = run(data, problem.params, rounds, seed, client_work,
                          dropout_rate=dropout_rate)  # fmt: skip
    return x, v, alpha, ids, dropped


@pytest.mark.parametrize(
    ("adaptive", "alpha_lr"), [(False, 0.0), (True, 0.0), (True, 2.0)],
    ids=["fixed", "adaptive-default-lr", "adaptive-clipped"],
)  # fmt: skip
def test_engine_matches_per_client_reference_loop(
    adaptive, alpha_lr, sims, fedavg_run, small_data, small_problem
):
    alpha0 = 0.4
    sim = sims[adaptive]
    alg = sim.algorithm
    given = {"client_lr": LR, "apfl_alpha": alpha0, "apfl_alpha_lr": alpha_lr}
    result = sim.run(small_data, given, num_rounds=ROUNDS, seed=SEED)
    effective_lr = alpha_lr if alpha_lr > 0 else LR  # 0 means eta_l
    x, v, alpha, ids, dropped = reference(
        small_data, small_problem, alpha0, effective_lr, adaptive, ROUNDS, SEED, RATE
    )
    np.testing.assert_array_equal(result.client_ids, ids)
    # x's trajectory is FedAvg's, bitwise, whatever alpha does (w never reads v or alpha).
    assert_bitwise(result.state.server.params, fedavg_run.state.server.params)
    # Some client trained and dropped in a round (it keeps its new v_i, alpha_i), some
    # client never trained (it keeps v_i = x0 and the "not trained" alpha_i = -1).
    assert dropped.any() and not dropped.all()
    assert len(set(ids.ravel())) < small_data.num_clients
    clients = result.state.clients
    assert isinstance(clients, PersonalState) and clients.shared == ()
    v_table, alpha_table = clients.own
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    assert_trees_close(v_table, jax.tree.map(lambda *r: np.stack(r), *v), rtol=1e-5, atol=1e-6)
    stored = np.array([-1.0 if a is None else a for a in alpha])
    np.testing.assert_allclose(np.asarray(alpha_table), stored, rtol=1e-5, atol=1e-6)
    trained = np.array([a is not None for a in alpha])
    assert np.all((stored[trained] >= 0) & (stored[trained] <= 1))
    if adaptive:
        assert np.any(np.abs(stored[trained] - alpha0) > 1e-3)  # alpha_i moved
    if alpha_lr == 2.0:
        assert np.any((stored[trained] == 0.0) | (stored[trained] == 1.0))  # clipped
    # p_i = alpha_i v_i + (1 - alpha_i) x, alpha_i = alpha0 for a client never trained.
    hp = sim.resolve_hparams(given)
    for i in range(small_data.num_clients):
        a = alpha0 if (alpha[i] is None or not adaptive) else alpha[i]
        expected = add(jax.tree.map(lambda t, a=a: a * t, v[i]),
                       jax.tree.map(lambda t, a=a: (1 - a) * t, x))  # fmt: skip
        mine = alg.personal(hp, result.state.server, row(clients, i), None)
        assert_trees_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_alpha_zero_fixed_keeps_v_at_x0_and_p_at_x(sims, fedavg_run, small_data, small_problem):
    sim = sims[False]
    given = {"client_lr": LR, "apfl_alpha": 0.0}
    mine = sim.run(small_data, given, num_rounds=ROUNDS, seed=SEED)
    x = mine.state.server.params
    assert_bitwise(x, fedavg_run.state.server.params)
    x0 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), small_problem.params)
    v_table, _ = mine.state.clients.own
    hp = sim.resolve_hparams(given)
    for i in range(small_data.num_clients):
        assert_bitwise(row(v_table, i), x0)
        assert_bitwise(sim.algorithm.personal(hp, mine.state.server, row(mine.state.clients, i),
                                              None), x)  # fmt: skip


def test_empty_steps_change_nothing(small_data, small_problem):
    alg = apfl(small_problem.loss_fn, adaptive=True)
    server, client = alg.init(small_problem.params)
    shifted = jax.tree.map(lambda a: a + 0.5, client.own[0])
    client = PersonalState((), (shifted, jnp.float32(0.3)))
    batches, mask = small_data.client_batches(jnp.int32(3), jax.random.key(0), PLAN_FULL)
    hp = resolve_hparams(alg, {"client_lr": 0.5, "apfl_alpha_lr": 1.0})
    new, out = alg.client_update(hp, server, client, batches, jnp.zeros_like(mask), None)
    assert_trees_close(new, client, rtol=0, atol=0)
    assert all(float(jnp.max(jnp.abs(d))) == 0 for d in jax.tree.leaves(out.delta_params))
    assert float(out.metrics["local_steps"]) == 0
    # ... while the same steps with their examples move all three.
    new, out = alg.client_update(hp, server, client, batches, mask, None)
    assert float(out.metrics["local_steps"]) == 2 and float(new.own[1]) != 0.3


PLAN_FULL = sj.BatchPlan.full(2)
