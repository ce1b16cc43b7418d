"""Per-FedAvg (FO) (Fallah, Mokhtari, Ozdaglar 2020): the engine against a plain
per-client float64 loop (two independent batch streams, with dropouts), p_i as one
adaptation step of size α, the empty steps and the registry entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_close, make_classification_clients
from personal_reference import add, client_batches, grad, max_abs_diff, run, simulation, to64

import scaffold_jax as sj
from scaffold_jax.algorithms import ALGORITHMS, perfedavg
from scaffold_jax.data.federated import with_client_tests
from scaffold_jax.engine.personal import Personalization
from scaffold_jax.types import resolve_hparams

LR, RATE, ROUNDS, SEED = 0.3, 0.4, 4, 2


def test_it_is_registered_with_its_hyper_parameters():
    spec = ALGORITHMS["perfedavg"]
    assert spec.display_name == "Per-FedAvg (FO)" and not spec.asynchronous
    assert list(spec.hparams) == ["client_lr", "server_lr", "perfedavg_alpha"]
    assert spec.hparams["perfedavg_alpha"].allow_zero
    alg = perfedavg(lambda p, b: jnp.zeros(()))
    with pytest.raises(TypeError, match="needs draw="):
        alg.client_update(resolve_hparams(alg, {"client_lr": 0.1}), None, (), None, None, None)


def reference(data, problem, alpha, rounds, seed, rate):
    """Per-FedAvg (FO)'s local work written out per client, float64: step k takes b, the
    plan's k-th batch, and b', the k-th batch of the client's extra stream 0."""

    def client_work(i, x, batches, draw):
        w = x
        for b, b2 in zip(batches, draw(0), strict=True):
            if b[2].sum() == 0 or b2[2].sum() == 0:
                continue  # an empty (padded) step
            adapted = add(w, grad(w, b), -alpha)
            w = add(w, grad(adapted, b2), -LR)
        return add(w, x, -1.0)

    return run(data, problem.params, rounds, seed, client_work, dropout_rate=rate)


def test_engine_matches_per_client_reference_loop(small_data, small_problem):
    alpha = 0.2
    alg = perfedavg(small_problem.loss_fn)
    sim = simulation(alg, small_problem, RATE)
    given = {"client_lr": LR, "perfedavg_alpha": alpha}
    result = sim.run(small_data, given, num_rounds=ROUNDS, seed=SEED)
    x, ids, dropped = reference(small_data, small_problem, alpha, ROUNDS, SEED, RATE)
    np.testing.assert_array_equal(result.client_ids, ids)
    assert dropped.any() and not dropped.all()
    assert result.state.clients == ()  # no client state
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    x0 = to64(small_problem.params)
    assert max_abs_diff(x, x0) > 1e-3  # x moved
    # p_i is one adaptation step of size alpha from x, taken by the evaluator's adapt.
    hp = sim.resolve_hparams(given)
    batch = client_batches(small_data, 3, jax.random.key(9))[0]
    calls = []

    def adapt(params, steps, lr):
        calls.append((steps, float(lr)))
        return add(to64(params), grad(to64(params), batch), -float(lr))

    p = alg.personal(hp, result.state.server, (), adapt)
    assert calls == [(1, pytest.approx(alpha))]
    assert_trees_close(p, add(x, grad(x, batch), -alpha), rtol=1e-5, atol=1e-6)


def test_empty_steps_change_nothing(small_data, small_problem):
    alg = perfedavg(small_problem.loss_fn)
    server, client = alg.init(small_problem.params)
    plan = sj.BatchPlan.full(2)
    batches, mask = small_data.client_batches(jnp.int32(3), jax.random.key(0), plan)
    hp = resolve_hparams(alg, {"client_lr": 0.1, "perfedavg_alpha": 0.1})
    empty = lambda stream: (batches, jnp.zeros_like(mask))
    _, out = alg.client_update(hp, server, client, batches, jnp.zeros_like(mask), None, draw=empty)
    assert all(float(jnp.max(jnp.abs(d))) == 0 for d in jax.tree.leaves(out.delta_params))
    assert float(out.metrics["local_steps"]) == 0
    full = lambda stream: (batches, mask)
    _, out = alg.client_update(hp, server, client, batches, mask, None, draw=full)
    assert float(out.metrics["local_steps"]) == 2
    assert any(float(jnp.max(jnp.abs(d))) > 0 for d in jax.tree.leaves(out.delta_params))


def test_its_personal_records_are_fedavgs_finetuned_one_step_of_alpha(small_problem):
    """p_i is the fine-tuning evaluation with F = 1 and eta_ft = alpha (PERSONAL.md §5),
    through the engine's evaluator, at the same server state."""
    train = make_classification_clients([6, 9, 4, 12, 7])
    tests = [make_classification_clients([4], seed=10 + i)[0] for i in range(5)]
    data = with_client_tests(sj.from_client_arrays(train), tests)
    plan, alpha, key = sj.BatchPlan.fixed(batch_size=3, num_steps=2), 0.2, jax.random.key(1)
    mine = sj.Simulation(perfedavg(small_problem.loss_fn), small_problem, plan, 3)
    hp = mine.resolve_hparams({"client_lr": LR, "perfedavg_alpha": alpha})
    state = mine.init(data)
    metrics, clients = jax.jit(mine.evaluate_clients_fn)(hp, state, data, key)
    tuned = Personalization(finetune_steps=1, finetune_lr=alpha)
    fedavg = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, plan, 3,
                           personalization=tuned)  # fmt: skip
    theirs, their_clients = jax.jit(fedavg.evaluate_clients_fn)(
        sj.hparams(client_lr=LR), state, data, key
    )
    assert metrics.keys() == theirs.keys()
    for name in metrics:
        np.testing.assert_array_equal(metrics[name], theirs[name], err_msg=name)
    np.testing.assert_array_equal(clients["personal"], their_clients["personal"])
    assert float(metrics["personal_loss_mean"]) != float(metrics["local_loss_mean"])  # p_i != x
