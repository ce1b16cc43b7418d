"""Per-client evaluation: every client's own test examples, the mean, the example-weighted
mean, the spread and the worst 10% of client accuracies, against a per-client loop; the
held-out split of partitioned clients; the metrics in a run's records."""

import jax
import numpy as np
import pytest
from conftest import make_classification_clients

import scaffold_jax as sj
from scaffold_jax.data import partition
from scaffold_jax.data.federated import with_client_tests
from scaffold_jax.engine import client_metrics


@pytest.fixture(scope="module")
def setup():
    train = make_classification_clients([6, 9, 4, 12, 7, 5, 8, 10, 3, 11, 6, 9])
    # Unequal test sizes, one client without any: it must not count.
    sizes = [5, 1, 7, 0, 3, 9, 2, 6, 4, 8, 3, 5]
    tests = [make_classification_clients([max(n, 1)], seed=10 + i)[0] for i, n in enumerate(sizes)]
    tests = [jax.tree.map(lambda a, n=n: a[:n], t) for t, n in zip(tests, sizes, strict=True)]
    data = with_client_tests(sj.from_client_arrays(train), tests)
    problem = sj.models.logistic_regression((5,), 3, zero_init=False, key=jax.random.key(4))
    sim = sj.Simulation(sj.fedavg(problem.loss_fn), problem, sj.BatchPlan.full(1), 3,
                        eval_batch_size=7)  # fmt: skip
    return sim, data, tests, problem


def test_per_client_metrics_equal_a_per_client_loop(setup):
    sim, data, tests, problem = setup
    got = {k: float(v) for k, v in jax.jit(lambda p: client_metrics(sim, p, data))(
        problem.params).items()}  # fmt: skip
    accuracies, hits, total = [], 0.0, 0
    for t in tests:
        if len(t["y"]) == 0:
            continue
        correct = np.asarray(problem.accuracy_fn(problem.params, t), np.float64)
        accuracies.append(correct.mean())
        hits, total = hits + correct.sum(), total + len(correct)
    accuracies = np.array(accuracies)
    worst = np.sort(accuracies)[: int(np.ceil(0.1 * len(accuracies)))]  # 11 clients -> 2
    assert len(worst) == 2
    np.testing.assert_allclose(got["client_accuracy_mean"], accuracies.mean(), rtol=1e-6)
    np.testing.assert_allclose(got["client_accuracy_weighted"], hits / total, rtol=1e-6)
    np.testing.assert_allclose(got["client_accuracy_std"], accuracies.std(), rtol=1e-5)
    np.testing.assert_allclose(got["client_accuracy_worst10"], worst.mean(), rtol=1e-6)
    assert got["client_accuracy_std"] > 0.05  # the clients differ: not a degenerate check


def test_a_run_records_them_and_data_without_client_tests_has_none(setup):
    sim, data, _, _ = setup
    result = sim.run(data, sj.hparams(client_lr=0.5), num_rounds=2, eval_every=2)
    assert {"client_accuracy_mean", "client_accuracy_worst10"} <= set(result.records[-1])
    plain = sj.from_client_arrays(make_classification_clients([4, 5, 6]))
    assert client_metrics(sim, sim.problem.params, plain) == {}


def test_hold_out_splits_every_client_and_keeps_one_training_example():
    parts = [np.arange(0, 10), np.arange(10, 11), np.arange(11, 16)]
    train, test = partition.hold_out(parts, 0.2, seed=1)
    assert [len(t) for t in test] == [2, 0, 1]
    for whole, a, b in zip(parts, train, test, strict=True):
        assert sorted([*a, *b]) == list(whole) and not set(a) & set(b) and len(a) >= 1
    again = partition.hold_out(parts, 0.2, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(test, again[1], strict=True))
    with pytest.raises(ValueError, match="client_holdout = 1.0 is invalid"):
        partition.hold_out(parts, 1.0)


def test_with_client_tests_refuses_a_wrong_number_of_splits(setup):
    _, data, tests, _ = setup
    with pytest.raises(ValueError, match="11 client test splits for 12 clients"):
        with_client_tests(data, tests[:-1])
