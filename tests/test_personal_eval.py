"""Every client's own model on its own test data (engine/personal.py): the records
against a plain per-client numpy loop, fine-tuning against plain float64 SGD, the fixed
sample of evaluated clients, the held-out split, personal.csv and the refusals."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_classification_clients

import scaffold_jax as sj
from scaffold_jax.data import partition
from scaffold_jax.data.federated import with_client_tests
from scaffold_jax.engine.personal import EVAL_STREAM, Personalization

PLAN = sj.BatchPlan.fixed(batch_size=3, num_steps=2)
LR = 0.5


@pytest.fixture(scope="module")
def setup():
    train = make_classification_clients([6, 9, 4, 12, 7, 5, 8, 10, 3, 11, 6, 9])
    # Unequal test sizes, one client without any: it must not count.
    sizes = [5, 1, 7, 0, 3, 9, 2, 6, 4, 8, 3, 5]
    tests = [make_classification_clients([max(n, 1)], seed=10 + i)[0] for i, n in enumerate(sizes)]
    tests = [jax.tree.map(lambda a, n=n: a[:n], t) for t, n in zip(tests, sizes, strict=True)]
    data = with_client_tests(sj.from_client_arrays(train), tests)
    problem = sj.models.logistic_regression((5,), 3, zero_init=False, key=jax.random.key(4))
    return data, train, tests, problem


def simulation(problem, personalization=None, eval_batch_size=7):
    return sj.Simulation(sj.fedavg(problem.loss_fn), problem, PLAN, 3,
                         eval_batch_size=eval_batch_size,
                         personalization=personalization)  # fmt: skip


def summary(accuracy, losses, counts):
    """The records of PERSONAL.md §0 from per-client values, in float64."""
    has = counts > 0
    a, w = accuracy[has], counts[has]
    worst = np.sort(a)[: int(np.ceil(0.1 * len(a)))]
    return {
        "accuracy_mean": a.mean(), "accuracy_weighted": (a * w).sum() / w.sum(),
        "accuracy_std": a.std(), "accuracy_worst10": worst.mean(), "accuracy_min": a.min(),
        "loss_mean": losses[has].mean(),
    }  # fmt: skip


def per_client(problem, params_of, tests):
    accuracy, losses = [], []
    for i, t in enumerate(tests):
        if len(t["y"]) == 0:
            accuracy.append(np.nan), losses.append(np.nan)
            continue
        params = params_of(i)
        accuracy.append(np.mean(np.asarray(problem.accuracy_fn(params, t), np.float64)))
        losses.append(np.mean(np.asarray(problem.loss_fn(params, t), np.float64)))
    return np.array(accuracy), np.array(losses)


def sgd64(problem, params, batches, mask, lr):
    """Plain float64 SGD on masked batches (the fine-tuning's reference)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    w, b = p["linear"]["kernel"].T, p["linear"]["bias"]  # kernel [out, in]
    for k in range(mask.shape[0]):
        x = np.asarray(batches["x"][k], np.float64).reshape(mask.shape[1], -1)
        y, m = np.asarray(batches["y"][k]), np.asarray(mask[k], np.float64)
        if m.sum() == 0:
            continue
        logits = x @ w + b
        prob = np.exp(logits - logits.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        prob[np.arange(len(y)), y] -= 1.0
        g = prob * (m / m.sum())[:, None]
        w, b = w - lr * x.T @ g, b - lr * g.sum(0)
    return {"linear": {"kernel": w.T.astype(np.float32), "bias": b.astype(np.float32)}}


def test_global_algorithm_records_equal_a_per_client_loop(setup):
    data, _, tests, problem = setup
    sim = simulation(problem)
    state = sim.init(data)
    key = jax.random.key(3)
    metrics, clients = jax.jit(sim.evaluate_clients_fn)(
        sj.hparams(client_lr=LR), state, data, key)  # fmt: skip
    accuracy, losses = per_client(problem, lambda i: problem.params, tests)
    counts = np.array([len(t["y"]) for t in tests])
    expected = summary(accuracy, losses, counts)
    for prefix in ("local", "personal"):
        for name, value in expected.items():
            np.testing.assert_allclose(metrics[f"{prefix}_{name}"], value, rtol=1e-5, err_msg=name)
    assert metrics["personal_gain_fraction"] == 0.0  # p_i = x: nobody gains
    assert expected["accuracy_std"] > 0.05  # the clients differ: not a degenerate check
    np.testing.assert_array_equal(clients["n_test"], counts)
    assert np.isnan(clients["personal"][3]) and np.isnan(clients["global"][3])


def test_finetuning_is_plain_sgd_from_x_on_the_evaluation_keys_batches(setup):
    data, _, tests, problem = setup
    steps = 5  # more than the plan's K = 2: three draws of the plan
    sim = simulation(problem, Personalization(finetune_steps=steps, finetune_lr=0.3))
    state = sim.init(data)
    key = jax.random.key(3)
    metrics, clients = jax.jit(sim.evaluate_clients_fn)(
        sj.hparams(client_lr=LR), state, data, key)  # fmt: skip
    round_key = jax.random.fold_in(jax.random.fold_in(key, EVAL_STREAM), 0)

    def tuned(i):
        client_key = jax.random.fold_in(round_key, i)
        keys = [client_key, jax.random.fold_in(client_key, 1), jax.random.fold_in(client_key, 2)]
        draws = [data.client_batches(jnp.int32(i), k, PLAN) for k in keys]
        batches = jax.tree.map(lambda *a: np.concatenate(a)[:steps], *[d[0] for d in draws])
        mask = np.concatenate([np.asarray(d[1]) for d in draws])[:steps]
        return sgd64(problem, problem.params, batches, mask, 0.3)

    accuracy, losses = per_client(problem, tuned, tests)
    counts = np.array([len(t["y"]) for t in tests])
    for name, value in summary(accuracy, losses, counts).items():
        np.testing.assert_allclose(metrics[f"personal_{name}"], value, rtol=1e-4, err_msg=name)
    has = counts > 0
    np.testing.assert_allclose(clients["personal"][has], accuracy[has], rtol=1e-6)
    global_accuracy, _ = per_client(problem, lambda i: problem.params, tests)
    gain = np.mean(accuracy[has] > global_accuracy[has])
    np.testing.assert_allclose(metrics["personal_gain_fraction"], gain, rtol=1e-6)
    assert 0 < gain  # fine-tuning moved someone


def test_chunking_and_the_fixed_sample(setup):
    data, _, _, problem = setup
    hp, key = sj.hparams(client_lr=LR), jax.random.key(3)
    tuned = Personalization(finetune_steps=2)
    state = simulation(problem).init(data)
    whole, _ = simulation(problem, tuned, eval_batch_size=10_000).evaluate_clients(
        hp, state, data, key
    )
    chunked, _ = simulation(problem, tuned, eval_batch_size=9).evaluate_clients(
        hp, state, data, key
    )
    for name in whole:  # chunks of one client (9 // 9) and of all: the same numbers
        np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-6, err_msg=name)
    sample = simulation(problem, Personalization(clients=5))
    _, first = sample.evaluate_clients(hp, state, data, key)
    later = state._replace(round=jnp.int32(7))
    _, again = sample.evaluate_clients(hp, later, data, key)
    ids = np.asarray(first["client"])
    assert len(set(ids.tolist())) == 5 and list(ids) == sorted(ids)
    np.testing.assert_array_equal(ids, again["client"])  # drawn once: every evaluation's


@pytest.mark.slow
def test_a_run_records_them_and_the_cli_writes_personal_csv(setup, tmp_path):
    data, _, _, problem = setup
    sim = simulation(problem, Personalization(finetune_steps=2))
    result = sim.run(data, sj.hparams(client_lr=LR), num_rounds=2, eval_every=2)
    last = result.records[-1]
    assert {"local_accuracy_mean", "personal_accuracy_worst10", "personal_gain_fraction"} <= set(
        last
    )
    np.testing.assert_allclose(np.nanmean(result.clients["personal"]),
                               last["personal_accuracy_mean"], rtol=1e-6)  # fmt: skip
    plain = sj.from_client_arrays(make_classification_clients([4, 5, 6]))
    assert "local_accuracy_mean" not in simulation(problem).run(
        plain, sj.hparams(client_lr=LR), num_rounds=1, eval_every=1).records[-1]  # fmt: skip
    from scaffold_jax.cli import main

    out = tmp_path / "run"
    main([
        "run", "--dataset", "fashion_mnist", "--num-clients", "10", "--clients-per-round", "3",
        "--rounds", "2", "--eval-every", "2", "--client-lr", "0.1", "--local-test-fraction", "0.25",
        "--finetune-steps", "1", "--max-train-examples", "400", "--max-test-examples", "100",
        "--model", "logreg", "--quiet", "--out", str(out)])  # fmt: skip
    rows = list(csv.DictReader(open(out / "personal.csv")))
    assert len(rows) == 10 and {r["series"] for r in rows} == {"scaffold"}
    assert all(int(r["n_test"]) == 10 and int(r["n_train"]) == 30 for r in rows)


def test_personal_options_without_client_tests_are_refused(capsys):
    from scaffold_jax.cli import main

    code = main(["run", "--dataset", "fashion_mnist", "--finetune-steps", "2", "--rounds", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "finetune_steps = 2 evaluates every client's own model" in err
    assert "set local_test_fraction" in err


def test_the_local_test_split_follows_the_contract():
    parts = [np.arange(0, 10), np.arange(10, 11), np.arange(11, 16), np.arange(16, 18)]
    train, test = partition.local_test_split(parts, 0.2, seed=1)
    # floor(round(0.2 n, 9)): 2 of 10, none of 1, 1 of 5, and at least 1 of 2.
    assert [len(t) for t in test] == [2, 0, 1, 1]
    for i, (whole, a, b) in enumerate(zip(parts, train, test, strict=True)):
        order = np.random.default_rng([1, i]).permutation(len(whole))
        np.testing.assert_array_equal(b, whole[order[: len(b)]])  # the permutation's first
        assert list(a) == sorted(a) and sorted([*a, *b]) == list(whole) and len(a) >= 1
    # A client's split is its own: one more client changes no other's.
    _, more = partition.local_test_split([*parts, np.arange(18, 30)], 0.2, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(test, more, strict=False))
    # 0.3 of 10 is 3 (float 0.3 * 10 = 3.0000000000000004: rounded to 9 digits first).
    assert len(partition.local_test_split([np.arange(10)], 0.3)[1][0]) == 3
    with pytest.raises(ValueError, match="local_test_fraction = 1.0 is invalid"):
        partition.local_test_split(parts, 1.0)


def test_with_client_tests_refuses_a_wrong_number_of_splits(setup):
    data, _, tests, _ = setup
    with pytest.raises(ValueError, match="11 client test splits for 12 clients"):
        with_client_tests(data, tests[:-1])


def test_a_sweeps_configs_equal_their_single_runs(setup):
    from scaffold_jax.sweep import grid

    data, _, _, problem = setup
    sim = simulation(problem, Personalization(finetune_steps=2))
    hp, seeds, _ = grid(client_lr=[0.1, 0.5], seeds=[0, 1])
    swept = sj.loop.sweep(sim, data, hp, seeds, num_rounds=2, eval_every=2)
    for j, (lr, seed) in enumerate(zip(np.asarray(hp.client_lr), seeds, strict=True)):
        alone = sim.run(data, sj.hparams(client_lr=float(lr)), num_rounds=2, eval_every=2,
                        seed=int(seed)).records[-1]  # fmt: skip
        for name in ("personal_accuracy_mean", "local_loss_mean", "personal_gain_fraction"):
            np.testing.assert_allclose(swept.records[j][-1][name], alone[name], rtol=1e-6)


def test_under_privacy_only_the_upload_is_private(setup):
    """Ditto inside the DP wrapper: x moves by at most the clipped, noiseless mean, while
    each trained client's v_i moves freely (its personal model never leaves it), and the
    personal model read through the wrapper is v_i."""
    data, _, _, problem = setup
    private = sj.privacy.private(sj.algorithms.make("ditto", problem.loss_fn))
    sim = sj.Simulation(private, problem, PLAN, 3)
    hp = {"client_lr": LR, "dp_noise_multiplier": 0.0, "dp_clip": 1e-3}
    result = sim.run(data, hp, num_rounds=2, eval_every=2, seed=0)
    x = result.state.server.inner.params
    moved_x = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(x), jax.tree.leaves(problem.params), strict=True))  # fmt: skip
    v = result.state.clients.own
    moved_v = max(float(np.abs(a - b[None]).max()) for a, b in zip(
        jax.tree.leaves(v), jax.tree.leaves(problem.params), strict=True))  # fmt: skip
    assert 0 < moved_x <= 2e-3 + 1e-6 and moved_v > 50 * moved_x
    row = jax.tree.map(lambda a: a[0], result.state.clients)
    p = private.personal(sim.resolve_hparams(hp), result.state.server, row, None)
    assert all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(p), jax.tree.leaves(row.own), strict=True))  # fmt: skip
    assert "personal_accuracy_mean" in result.records[-1]
