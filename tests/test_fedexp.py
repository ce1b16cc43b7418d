"""FedExP (Jhunjhunwala et al., ICLR 2023): the engine against a float64 per-client
reference loop (params and the reported η_g), η_g >= 1, extrapolation on heterogeneous
clients, FedAvg on identical ones, the average of the last two iterates, the command line."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, make_classification_clients, reference_grad

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS, fedexp
from scaffold_jax.cli import main
from scaffold_jax.sampling import sample_clients

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)  # 1..5 steps per client, padded


def _sim(problem, weighting="uniform", average_last_two=False, plan=PLAN, num_sampled=3):
    alg = fedexp(problem.loss_fn, average_last_two=average_last_two)
    return sj.Simulation(alg, problem, plan, num_sampled, weighting=weighting)


def test_it_is_registered_with_its_own_hyper_parameters_and_option():
    spec = ALGORITHMS["fedexp"]
    assert spec.display_name == "FedExP" and spec.default_plan == "fraction"
    assert list(spec.hparams) == ["client_lr", "fedexp_eps"]  # no server_lr: it is chosen
    assert spec.hparams["fedexp_eps"].default == 1e-3 and not spec.hparams["fedexp_eps"].allow_zero
    option = spec.options["average_last_two"]
    assert option.default is False and option.is_switch
    built = spec.build(lambda params, batch: jnp.zeros(()), average_last_two="true")
    assert built.name == "fedexp"


# ----------------------------------------------------------------------- reference loop
def reference_run(problem, data, plan, num_sampled, lr, eps, rounds, seed, weighting):
    """FedExP written out client by client in float64 numpy; only the documented
    randomness contract is shared with the engine (see tests/test_feddyn.py)."""
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    counts = np.asarray(data.counts)
    root = jr.key(seed)

    def sq(tree):
        return sum(float(np.sum(a**2)) for a in jax.tree.leaves(tree))

    server_lrs = []
    for r in range(rounds):
        sample_key, clients_key = jr.split(jr.fold_in(root, r))
        ids = np.asarray(sample_clients(sample_key, data.num_clients, num_sampled))
        deltas = []
        for i in ids:
            pos, mask = plan.positions(jr.fold_in(clients_key, int(i)), counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            y = jax.tree.map(np.copy, x)
            for k in range(len(pos)):
                if mask[k].sum() == 0:
                    continue
                batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
                grad = reference_grad(problem.loss_fn, y, batch, mask[k])
                y = jax.tree.map(lambda yy, g: yy - lr * g, y, grad)
            deltas.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
        w = np.ones(len(ids)) if weighting == "uniform" else counts[ids].astype(np.float64)
        p = w / w.sum()
        mean = jax.tree.map(lambda *d: sum(pi * di for pi, di in zip(p, d, strict=True)), *deltas)
        spread = sum(pi * sq(d) for pi, d in zip(p, deltas, strict=True))
        server_lr = max(1.0, spread / (2.0 * (sq(mean) + eps)))
        server_lrs.append(server_lr)
        x = jax.tree.map(lambda xx, m: xx + server_lr * m, x, mean)
    return x, np.asarray(server_lrs)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_engine_matches_per_client_reference_loop(weighting, small_data, small_problem):
    lr, eps, rounds, seed = 0.3, 1e-3, 5, 2
    result = _sim(small_problem, weighting).run(
        small_data, {"client_lr": lr, "fedexp_eps": eps}, num_rounds=rounds, seed=seed
    )
    x, server_lrs = reference_run(
        small_problem, small_data, PLAN, 3, lr, eps, rounds, seed, weighting
    )
    np.testing.assert_allclose(result.round_metrics["fedexp_server_lr"], server_lrs, rtol=1e-5)
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    # Heterogeneous clients: the server extrapolates in some rounds, and never shrinks.
    assert np.all(server_lrs >= 1.0) and np.max(server_lrs) > 1.2


def test_the_server_step_size_is_at_least_one():
    """Over many rounds and step sizes, including ones where the clients agree."""
    clients = make_classification_clients([4, 7, 5, 9, 6], seed=8, skew=False)
    data = sj.from_client_arrays(clients)
    problem = sj.models.logistic_regression((5,), 3)
    for lr in (0.01, 0.3, 3.0):
        result = _sim(problem, num_sampled=4).run(data, {"client_lr": lr}, num_rounds=10)
        assert np.all(result.round_metrics["fedexp_server_lr"] >= 1.0)


def test_on_identical_clients_it_is_fedavg(small_problem):
    """Equal updates Δ_i = Δ̄: Σ‖Δ_i‖² / (2S(‖Δ̄‖² + ε)) < 1/2, so η_g = 1 (FedAvg's step)."""
    one = make_classification_clients([8], seed=3)[0]
    data = sj.from_client_arrays([one] * 4)
    plan = sj.BatchPlan.full(3)  # full-batch steps: identical clients, identical updates
    result = _sim(small_problem, plan=plan).run(data, {"client_lr": 0.5}, num_rounds=4)
    np.testing.assert_array_equal(result.round_metrics["fedexp_server_lr"], 1.0)
    avg = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, plan, 3)
    other = avg.run(data, sj.hparams(client_lr=0.5), num_rounds=4).state.server.params
    assert_trees_close(result.state.server.params, other, rtol=1e-6)


def test_average_last_two_evaluates_the_mean_of_the_last_two_iterates(small_data, small_problem):
    hp = {"client_lr": 0.3}
    last = _sim(small_problem).run(small_data, hp, num_rounds=3, seed=1)
    mean = _sim(small_problem, average_last_two=True)
    averaged = mean.run(small_data, hp, num_rounds=3, seed=1)
    before = _sim(small_problem).run(small_data, hp, num_rounds=2, seed=1)
    # The iterates are the same; only the model evaluated differs.
    assert_trees_close(averaged.state.server.params, last.state.server.params, rtol=1e-6)
    assert_trees_close(averaged.state.server.previous, before.state.server.params, rtol=1e-6)
    expected = jax.tree.map(
        lambda a, b: (a + b) / 2, last.state.server.params, before.state.server.params
    )
    got = mean.algorithm.server_params(averaged.state.server)
    assert_trees_close(got, expected, rtol=1e-6)
    assert averaged.records[-1]["test_loss"] != last.records[-1]["test_loss"]


def test_a_server_optimizer_transforms_the_extrapolated_step(small_data, small_problem):
    """x ← x − η_g T(−Δ̄): with T = trace(0) (the identity) it is plain FedExP, with
    momentum it is not."""
    hp = {"client_lr": 0.3}
    plain = _sim(small_problem).run(small_data, hp, num_rounds=3, seed=1)

    def run(server_optimizer):
        alg = fedexp(small_problem.loss_fn, server_optimizer=server_optimizer)
        return sj.Simulation(alg, small_problem, PLAN, 3).run(small_data, hp, num_rounds=3, seed=1)

    same = run(optax.trace(0.0))
    assert_trees_close(same.state.server.params, plain.state.server.params, rtol=1e-6)
    np.testing.assert_allclose(
        same.round_metrics["fedexp_server_lr"], plain.round_metrics["fedexp_server_lr"]
    )
    other = run("momentum:momentum=0.9").state.server.params
    gap = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), other, plain.state.server.params)
    assert max(jax.tree.leaves(gap)) > 1e-3


@needs_fashion
def test_it_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    argv = [
        "run", "--algorithm", "fedexp", "--average-last-two", "--set", "fedexp_eps=0.01",
        "--dataset", "fashion_mnist", "--max-train-examples", "600",
        "--max-test-examples", "200", "--num-clients", "6", "--clients-per-round", "3",
        "--rounds", "4", "--eval-every", "2", "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == "fedexp" and saved["hparams"] == {"fedexp_eps": 0.01}
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2, 4]
    assert all(np.isfinite(r["test_loss"]) for r in records)
