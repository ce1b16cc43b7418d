"""Scaffnew (ProxSkip, Mishchenko et al., ICML 2022): the engine against a float64
per-client reference loop (K ~ Geometric(p) drawn from the round key), the invariant
Σ_i h_i = 0, its reductions to FedAvg, full participation, a sweep over p and the command
line."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import (
    assert_trees_close,
    make_classification_clients,
    quadratic_clients,
    reference_grad,
)

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS, scaffnew
from scaffold_jax.cli import main
from scaffold_jax.sampling import sample_clients
from scaffold_jax.sweep import grid, sweep

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
NUM_STEPS = 4  # the plan's K: the bound of the drawn K
PLAN = sj.BatchPlan.fixed(batch_size=3, num_steps=NUM_STEPS)


@pytest.fixture(scope="module")
def four_clients():
    """4 clients of unequal sizes (one smaller than a batch) with label skew."""
    clients = make_classification_clients([6, 9, 2, 8], seed=4)
    test = make_classification_clients([30], seed=5, skew=False)[0]
    return sj.from_client_arrays(clients, test=test)


def _sim(problem, num_sampled=4, plan=PLAN, weighting="uniform"):
    return sj.Simulation(scaffnew(problem.loss_fn), problem, plan, num_sampled, weighting=weighting)


def test_it_is_registered_with_its_own_hyper_parameters():
    spec = ALGORITHMS["scaffnew"]
    assert spec.display_name == "Scaffnew" and spec.default_plan == "fraction"
    assert list(spec.hparams) == ["client_lr", "comm_prob"]  # no server_lr
    p = spec.hparams["comm_prob"]
    assert p.default == 0.2 and p.maximum == 1.0 and not p.allow_zero
    assert "(1-p)^K_plan" in p.help  # the truncation is stated where the flag is
    assert spec.build(lambda params, batch: jnp.zeros(())).name == "scaffnew"


# ----------------------------------------------------------------------- reference loop
def reference_run(problem, data, plan, lr, p, rounds, seed):
    """Scaffnew written out client by client in float64 numpy: x, the h_i, K local steps,
    the shifted average and the control update. Only the documented randomness contract is
    shared with the engine: round key fold_in(root, r), split into (sample key, clients
    key), client key fold_in(clients key, id), the shared key fold_in(round key, 2) whose
    float32 uniform u gives K = 1 + floor(log u / log(1 − p)), truncated at the plan's K."""
    n = data.num_clients
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    h = [jax.tree.map(np.zeros_like, x) for _ in range(n)]
    counts = np.asarray(data.counts)
    root = jr.key(seed)
    tiny = np.finfo(np.float32).tiny
    drawn = []
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, n, n))
        u = float(jr.uniform(jr.fold_in(round_key, 2), (), jnp.float32, minval=tiny))
        k_round = min(1 + int(np.floor(np.log(u) / np.log1p(-p))), plan.num_steps)
        drawn.append(k_round)
        x_hat, shifted = {}, []
        for i in ids:
            pos, mask = plan.positions(jr.fold_in(clients_key, int(i)), counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            y = jax.tree.map(np.copy, x)
            for k in range(k_round):
                batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
                grad = reference_grad(problem.loss_fn, y, batch, mask[k])
                y = jax.tree.map(lambda yy, g, hh: yy - lr * (g - hh), y, grad, h[i])
            x_hat[int(i)] = y
            shifted.append(jax.tree.map(lambda yy, hh: yy - (lr / p) * hh, y, h[i]))
        x = jax.tree.map(lambda *v: sum(v) / len(v), *shifted)
        for i in ids:
            h[i] = jax.tree.map(lambda hh, xx, yy: hh + (p / lr) * (xx - yy), h[i], x, x_hat[i])
    return x, h, np.asarray(drawn)


def test_engine_matches_per_client_reference_loop(four_clients):
    lr, p, rounds, seed = 0.2, 0.3, 8, 3
    problem = sj.models.logistic_regression((5,), 3, zero_init=False, key=jr.key(3))
    result = _sim(problem).run(
        four_clients, {"client_lr": lr, "comm_prob": p}, num_rounds=rounds, seed=seed
    )
    p32 = float(np.float32(p))  # the value the program computes with
    x, h, drawn = reference_run(problem, four_clients, PLAN, lr, p32, rounds, seed)
    # The drawn K vary, some are truncated at the plan's K, and they are the steps taken.
    assert len(set(drawn.tolist())) >= 3 and NUM_STEPS in drawn
    np.testing.assert_array_equal(result.round_metrics["local_steps"], drawn)
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    table = jax.tree.map(lambda *rows: np.stack(rows), *h)
    assert_trees_close(result.state.clients.control, table, rtol=1e-5, atol=1e-5)
    assert float(np.max(np.abs(jax.tree.leaves(table)[0]))) > 1e-2  # h is not trivially 0


def test_the_controls_sum_to_zero_after_every_round():
    data, problem, _ = quadratic_clients(num_clients=5, dim=4)
    sim = _sim(problem, num_sampled=5, plan=sj.BatchPlan.full(8))
    hp = sim.resolve_hparams({"client_lr": 0.3, "comm_prob": 0.25})
    state, key = sim.init(data), jr.key(1)
    for _ in range(6):
        state, _ = sim.round(hp, state, data, key)
        h = np.asarray(state.clients.control["x"], np.float64)
        assert np.max(np.abs(h.sum(axis=0))) < 1e-5 * np.max(np.abs(h))
    assert np.max(np.abs(h)) > 0.1


def test_it_converges_to_the_optimum_without_client_drift():
    """Full-batch local steps: Scaffnew's fixed point is x* (FedAvg's is not)."""
    data, problem, x_star = quadratic_clients(num_clients=4, dim=3)
    plan = sj.BatchPlan.full(30)
    result = _sim(problem, plan=plan).run(
        data, {"client_lr": 0.2, "comm_prob": 0.3}, num_rounds=80, seed=0
    )
    np.testing.assert_allclose(result.state.server.params["x"], x_star, rtol=1e-4, atol=1e-4)
    avg = sj.Simulation(sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.full(5), 4)
    drift = avg.run(data, sj.hparams(client_lr=0.2), num_rounds=80).state.server.params["x"]
    assert np.max(np.abs(drift - x_star)) > 1e-2


# ----------------------------------------------------------------------- reductions
def test_with_p_one_it_is_one_step_fedavg(four_clients, small_problem):
    """p = 1: K = 1 and every client's shifted model is x − γ g_i (its h_i cancels)."""
    plan = sj.BatchPlan.fixed(batch_size=3, num_steps=1)
    new = _sim(small_problem, plan=plan).run(
        four_clients, {"client_lr": 0.3, "comm_prob": 1.0}, num_rounds=5, seed=2
    )
    avg = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, plan, 4)
    old = avg.run(four_clients, sj.hparams(client_lr=0.3), num_rounds=5, seed=2)
    assert_trees_close(new.state.server.params, old.state.server.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new.round_metrics["local_steps"], 1.0)


def test_with_zero_controls_and_a_fixed_k_it_is_fedavg(four_clients, small_problem):
    """The contract's identity: h ≡ 0 (no control update) and K fixed at the plan's K (a p
    so small that every draw is truncated) is FedAvg with uniform weights."""
    alg = scaffnew(small_problem.loss_fn)._replace(client_sync=None)
    sim = sj.Simulation(alg, small_problem, PLAN, 4)
    new = sim.run(four_clients, {"client_lr": 0.3, "comm_prob": 1e-6}, num_rounds=4, seed=5)
    np.testing.assert_array_equal(new.round_metrics["local_steps"], NUM_STEPS)
    avg = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, PLAN, 4)
    old = avg.run(four_clients, sj.hparams(client_lr=0.3), num_rounds=4, seed=5)
    assert_trees_close(new.state.server.params, old.state.server.params, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- refused set-ups
def test_partial_participation_and_data_size_weights_are_refused(four_clients, small_problem):
    hp = {"client_lr": 0.1}
    with pytest.raises(ValueError, match=r"S = N.*Set clients_per_round = N.*--client-fraction 1"):
        _sim(small_problem, num_sampled=3).run(four_clients, hp, num_rounds=1)
    with pytest.raises(ValueError, match="weighting='num_examples'.*use weighting='uniform'"):
        _sim(small_problem, weighting="num_examples").run(four_clients, hp, num_rounds=1)
    with pytest.raises(ValueError, match="another server step breaks that"):
        scaffnew(small_problem.loss_fn, server_optimizer="momentum")


def test_a_probability_above_one_is_refused(four_clients, small_problem):
    sim = _sim(small_problem)
    with pytest.raises(ValueError, match=r"comm_prob=1.5 is invalid: .*> 0 and <= 1"):
        sim.resolve_hparams({"client_lr": 0.1, "comm_prob": 1.5})
    with pytest.raises(ValueError, match=r"comm_prob=0 is invalid"):
        sim.resolve_hparams({"client_lr": 0.1, "comm_prob": 0.0})
    assert float(sim.resolve_hparams({"client_lr": 0.1, "comm_prob": 1.0}).comm_prob) == 1.0


# ----------------------------------------------------------------------- sweeps
def test_a_sweep_over_p_equals_the_single_runs_and_freezes_a_diverged_config():
    """comm_prob is traced (one program for every p); a config that diverges keeps its
    last finite state, client controls (updated after aggregation) included."""
    data, problem, _ = quadratic_clients(num_clients=4, dim=3)
    sim = _sim(problem, plan=sj.BatchPlan.full(10))
    hp, seeds, _ = grid(client_lr=[0.1, 1e3], comm_prob=[0.2, 0.5], seeds=[0])
    result = sweep(sim, data, hp, seeds, num_rounds=6, eval_every=3, keep_client_states=True)
    # The large step size with p = 0.2 (long rounds) overflows after a few rounds, when the
    # controls have moved.
    assert result.diverged_round[[0, 1, 3]].tolist() == [-1, -1, -1]
    assert result.diverged_round[2] >= 3
    for j, config in enumerate(result.configs):
        diverged = result.diverged_round[j]
        alone = sim.run(
            data,
            {"client_lr": config["client_lr"], "comm_prob": config["comm_prob"]},
            num_rounds=6 if diverged < 0 else diverged - 1,
            seed=config["seed"],
        )
        x, table = result.server_states.params["x"][j], result.client_states.control["x"][j]
        np.testing.assert_allclose(x, alone.state.server.params["x"], rtol=1e-5)
        np.testing.assert_allclose(table, alone.state.clients.control["x"], rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(table)) and np.max(np.abs(table)) > 0
        if diverged < 0:
            np.testing.assert_array_equal(
                result.round_metrics["local_steps"][j], alone.round_metrics["local_steps"]
            )


# ----------------------------------------------------------------------- command line
@needs_fashion
def test_the_command_line_refuses_partial_participation(tmp_path, capsys):
    argv = ["run", "--algorithm", "scaffnew", "--dataset", "fashion_mnist", "--rounds", "1"]
    code = main([*argv, "--max-train-examples", "200", "--max-test-examples", "50",
                 "--num-clients", "4", "--out", str(tmp_path / "o"), "--quiet"])  # fmt: skip
    assert code != 0
    assert "--client-fraction 1" in capsys.readouterr().err


@needs_fashion
def test_it_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    argv = [
        "run", "--algorithm", "scaffnew", "--set", "comm_prob=0.3", "--client-lr", "0.05",
        "--dataset", "fashion_mnist", "--max-train-examples", "600",
        "--max-test-examples", "200", "--num-clients", "6", "--client-fraction", "1",
        "--batch-plan", "fixed", "--local-steps", "12", "--batch-size", "10",
        "--rounds", "4", "--eval-every", "2", "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == "scaffnew" and saved["hparams"] == {"comm_prob": 0.3}
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2, 4]
    assert all(np.isfinite(r["test_loss"]) for r in records)
