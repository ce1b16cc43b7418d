"""pFedMe (T. Dinh, Tran, Nguyen 2020): the engine against a plain per-client float64
loop (with dropouts and a server mixing β < 1), the empty steps, β's range, and a sweep
over the inner steps J as one program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close
from personal_reference import add, grad, max_abs_diff, row, run, simulation, to64

import scaffold_jax as sj
from scaffold_jax.algorithms import ALGORITHMS, pfedme
from scaffold_jax.sweep import grid, sweep
from scaffold_jax.types import PersonalState, resolve_hparams

LR, RATE, ROUNDS, SEED = 0.2, 0.4, 4, 2


@pytest.fixture(scope="module")
def sim(small_problem):
    return simulation(pfedme(small_problem.loss_fn), small_problem, RATE)


def test_it_is_registered_with_its_hyper_parameters():
    spec = ALGORITHMS["pfedme"]
    assert spec.display_name == "pFedMe" and not spec.asynchronous
    assert list(spec.hparams) == [
        "client_lr", "server_lr", "pfedme_lambda", "pfedme_inner_lr", "pfedme_inner_steps",
    ]  # fmt: skip
    assert spec.hparams["pfedme_inner_steps"].integer
    alg = pfedme(lambda p, b: jnp.zeros(()))
    # beta (server_lr) in (0, 1]; lambda > 0; J a whole number >= 1.
    for bad, match in [
        ({"server_lr": 1.5}, "server_lr=1.5 is invalid.*<= 1"),
        ({"pfedme_lambda": 0.0}, "pfedme_lambda=0 is invalid"),
        ({"pfedme_inner_steps": 0.0}, "pfedme_inner_steps=0 is invalid"),
        ({"pfedme_inner_steps": 2.5}, "pfedme_inner_steps=2.5 is invalid"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_hparams(alg, {"client_lr": 0.1, **bad})


def reference(data, problem, lam, inner_lr, inner_steps, beta, rounds, seed, rate):
    """pFedMe's local work written out per client (θ_i in a Python list), float64."""
    theta = [to64(problem.params) for _ in range(data.num_clients)]

    def client_work(i, x, batches, draw):
        del draw
        w = th = x  # theta starts from x every round
        for batch in batches:
            if batch[2].sum() == 0:
                continue  # an empty (padded) step
            for _ in range(inner_steps):
                th = add(th, add(grad(th, batch), add(th, w, -1.0), lam), -inner_lr)
            w = add(w, add(w, th, -1.0), -LR * lam)
        theta[i] = th
        return add(w, x, -1.0)

    x, ids, dropped = run(data, problem.params, rounds, seed, client_work, server_lr=beta,
                          dropout_rate=rate)  # fmt: skip
    return x, theta, ids, dropped


@pytest.mark.parametrize(
    ("inner_lr", "inner_steps", "beta"), [(0.05, 3, 0.7), (0.0, 1, 1.0)],
    ids=["J3-beta0.7", "J1-default-inner-lr"],
)  # fmt: skip
def test_engine_matches_per_client_reference_loop(
    inner_lr, inner_steps, beta, sim, small_data, small_problem
):
    lam = 2.0
    given = {"client_lr": LR, "server_lr": beta, "pfedme_lambda": lam,
             "pfedme_inner_lr": inner_lr, "pfedme_inner_steps": inner_steps}  # fmt: skip
    result = sim.run(small_data, given, num_rounds=ROUNDS, seed=SEED)
    x, theta, ids, dropped = reference(
        small_data, small_problem, lam, inner_lr or LR, inner_steps, beta, ROUNDS, SEED, RATE
    )
    np.testing.assert_array_equal(result.client_ids, ids)
    assert dropped.any() and not dropped.all()  # a client trained, dropped, kept its theta_i
    assert len(set(ids.ravel())) < small_data.num_clients  # one never trained: theta_i = x0
    clients = result.state.clients
    assert isinstance(clients, PersonalState) and clients.shared == ()
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    table = jax.tree.map(lambda *r: np.stack(r), *theta)
    assert_trees_close(clients.own, table, rtol=1e-5, atol=1e-6)
    hp = sim.resolve_hparams(given)
    for i in range(small_data.num_clients):  # p_i = theta_i
        mine = sim.algorithm.personal(hp, result.state.server, row(clients, i), None)
        assert_trees_close(mine, theta[i], rtol=1e-5, atol=1e-6)
    x0 = to64(small_problem.params)
    assert max_abs_diff(x, x0) > 1e-3  # x moved


def test_empty_steps_change_nothing(small_data, small_problem):
    alg = pfedme(small_problem.loss_fn)
    server, client = alg.init(small_problem.params)
    plan = sj.BatchPlan.full(2)
    batches, mask = small_data.client_batches(jnp.int32(3), jax.random.key(0), plan)
    hp = resolve_hparams(alg, {"client_lr": 0.1, "pfedme_lambda": 2.0})
    shifted = PersonalState((), jax.tree.map(lambda a: a + 0.5, client.own))
    new, out = alg.client_update(hp, server, shifted, batches, jnp.zeros_like(mask), None)
    # theta starts from x every round: with no step it is x, and w = x (delta 0).
    assert_trees_close(new.own, server.params, rtol=0, atol=0)
    assert all(float(jnp.max(jnp.abs(d))) == 0 for d in jax.tree.leaves(out.delta_params))
    assert float(out.metrics["local_steps"]) == 0
    new, out = alg.client_update(hp, server, shifted, batches, mask, None)
    assert float(out.metrics["local_steps"]) == 2
    assert any(float(jnp.max(jnp.abs(d))) > 0 for d in jax.tree.leaves(out.delta_params))


@pytest.mark.slow
def test_a_sweep_over_inner_steps_equals_the_single_runs(sim, small_data):
    hp, seeds, _ = grid(client_lr=LR, pfedme_lambda=2.0, pfedme_inner_steps=[1, 4], seeds=[0])
    result = sweep(sim, small_data, hp, seeds, num_rounds=3, eval_every=3)
    assert [c["pfedme_inner_steps"] for c in result.configs] == [1, 4]
    for j, config in enumerate(result.configs):
        alone = sim.run(small_data, {"client_lr": LR, "pfedme_lambda": 2.0,
                                     "pfedme_inner_steps": config["pfedme_inner_steps"]},
                        num_rounds=3, eval_every=3, seed=0)  # fmt: skip
        server = jax.tree.map(lambda a, j=j: a[j], result.server_states)
        assert_trees_close(server.params, alone.state.server.params, rtol=1e-5)
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)
