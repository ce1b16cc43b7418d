"""Tests of scaffold_jax.data.partition on real Fashion-MNIST labels and synthetic ones."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scaffold_jax.data import partition as P
from scaffold_jax.data import sources
from scaffold_jax.registry import factory_kwargs, resolve_options

FASHION_LABELS = Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")
FASHION_IMAGES = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
FASHION_TEST_LABELS = Path("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")


@pytest.fixture(scope="module")
def labels() -> np.ndarray:
    """The 60000 Fashion-MNIST training labels (6000 per class)."""
    if not FASHION_LABELS.is_file():
        pytest.skip(f"{FASHION_LABELS} is absent: `apt-get install dataset-fashion-mnist`")
    return sources.read_idx(FASHION_LABELS).astype(np.int32)


def synthetic_labels(n: int = 500, classes: int = 7, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, n)


# Every partitioner as f(labels, num_clients, seed) with typical settings.
PARTITIONERS = {
    "similarity0": lambda y, n, s: P.similarity_split(y, n, 0, s),
    "similarity10": lambda y, n, s: P.similarity_split(y, n, 10, s),
    "similarity100": lambda y, n, s: P.similarity_split(y, n, 100, s),
    "dirichlet0.1": lambda y, n, s: P.dirichlet_split(y, n, 0.1, s),
    "dirichlet10": lambda y, n, s: P.dirichlet_split(y, n, 10.0, s),
    "shards2": lambda y, n, s: P.shard_split(y, n, 2, s),
    "iid": lambda y, n, s: P.iid_split(len(y), n, s),
    "iid_lognormal": lambda y, n, s: P.iid_split(len(y), n, s, sizes="lognormal", sigma=1.0),
}


def assert_exact_cover(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    """Every example in exactly one client, no client empty (checked independently of
    P.check_partition, which is itself under test)."""
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 and p.ndim == 1 and len(p) >= 1 for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def total_variation(hist: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per-client TV distance between its label distribution and ``reference``."""
    q = hist / hist.sum(axis=1, keepdims=True)
    return 0.5 * np.abs(q - reference).sum(axis=1)


# ------------------------------------------------------------------ real labels


def test_similarity_0_is_label_sorted(labels):
    parts = P.similarity_split(labels, 100, 0, seed=0)
    s = P.summary(labels, parts, 10)
    assert s.labels_per_client.max() <= 2
    assert s.examples_per_client.tolist() == [600] * 100


def test_similarity_100_is_iid(labels):
    parts = P.similarity_split(labels, 100, 100, seed=0)
    s = P.summary(labels, parts, 10)
    tv = total_variation(s.label_histogram, np.full(10, 0.1))
    assert s.examples_per_client.tolist() == [600] * 100
    assert tv.max() < 0.3  # observed ~0.08 for 600 examples per client
    assert s.labels_per_client.min() == 10


def test_similarity_10_mixes_iid_and_sorted(labels):
    s = P.summary(labels, P.similarity_split(labels, 100, 10, seed=1), 10)
    # 540 label-sorted examples (one or two neighbouring labels) plus 60 i.i.d. ones: the
    # top two labels hold at least 90% but never everything.
    top2 = np.sort(s.label_histogram, axis=1)[:, -2:].sum(axis=1) / 600
    assert np.all(top2 >= 0.9) and np.all(top2 < 1.0)
    assert s.labels_per_client.min() >= 5


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_every_example_used_exactly_once_on_real_labels(labels, name):
    parts = PARTITIONERS[name](labels, 100, 0)
    assert_exact_cover(parts, len(labels), 100)
    P.check_partition(parts, len(labels))


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_deterministic_for_a_seed_and_different_across_seeds(name):
    y = synthetic_labels(2000, 10)
    f = PARTITIONERS[name]
    a, b, c = f(y, 20, 7), f(y, 20, 7), f(y, 20, 8)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert any(not np.array_equal(u, v) for u, v in zip(a, c, strict=True))


def test_dirichlet_small_alpha_is_more_skewed(labels):
    global_dist = np.full(10, 0.1)
    tv, distinct = {}, {}
    for alpha in (0.1, 100.0):
        s = P.summary(labels, P.dirichlet_split(labels, 100, alpha, seed=0), 10)
        tv[alpha] = total_variation(s.label_histogram, global_dist).mean()
        distinct[alpha] = s.labels_per_client.mean()
    # Observed: mean TV ~0.72 vs ~0.04, mean labels per client ~5 vs 10.
    assert tv[0.1] > 0.5 > 0.1 > tv[100.0]
    assert distinct[0.1] < 8 and distinct[100.0] == 10


def test_dirichlet_min_size(labels):
    parts = P.dirichlet_split(labels, 100, 0.1, seed=3, min_size=50)
    assert min(len(p) for p in parts) >= 50
    assert_exact_cover(parts, len(labels), 100)


@pytest.mark.parametrize("shards_per_client", [1, 2, 3])
def test_shards_give_at_most_shards_per_client_labels(labels, shards_per_client):
    parts = P.shard_split(labels, 100, shards_per_client, seed=0)
    s = P.summary(labels, parts, 10)
    assert s.labels_per_client.max() <= shards_per_client
    assert s.examples_per_client.tolist() == [600] * 100


def test_partition_feeds_from_partition(labels):
    """Client i of the FederatedData holds exactly the examples at the partition's row i."""
    from scaffold_jax.data.federated import from_partition

    if not FASHION_IMAGES.is_file():
        pytest.skip(f"{FASHION_IMAGES} is absent")
    x = sources.read_idx(FASHION_IMAGES)[:2000]
    y = sources.read_idx(FASHION_TEST_LABELS)[:2000].astype(np.int32)
    parts = P.dirichlet_split(y, 10, 0.5, seed=0)
    data = from_partition({"x": x, "y": y}, parts, test={"x": x[:5], "y": y[:5]})
    assert data.num_clients == 10
    assert np.asarray(data.counts).tolist() == [len(p) for p in parts]
    for i, rows in enumerate(parts):
        got = data.client_examples(i)
        np.testing.assert_array_equal(got["x"], x[rows])
        np.testing.assert_array_equal(got["y"], y[rows])


# ------------------------------------------------------------------ properties


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    clients_frac=st.floats(0.0, 1.0),
    classes=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    similarity=st.floats(0.0, 100.0),
)
def test_exact_cover_property(n, clients_frac, classes, seed, similarity):
    y = synthetic_labels(n, classes, seed)
    num_clients = max(1, int(clients_frac * n))
    assert_exact_cover(P.similarity_split(y, num_clients, similarity, seed), n, num_clients)
    assert_exact_cover(P.iid_split(n, num_clients, seed), n, num_clients)
    lognormal = P.iid_split(n, num_clients, seed, sizes="lognormal", sigma=3.0)
    assert_exact_cover(lognormal, n, num_clients)
    if num_clients * 2 <= n:
        assert_exact_cover(P.shard_split(y, num_clients, 2, seed), n, num_clients)
    if num_clients <= max(1, n // 20):  # feasible for a Dirichlet draw without many retries
        assert_exact_cover(P.dirichlet_split(y, num_clients, 1.0, seed), n, num_clients)


def test_similarity_split_sizes_are_balanced():
    y = synthetic_labels(1003, 5)
    for s in (0, 33.3, 100):
        sizes = [len(p) for p in P.similarity_split(y, 10, s, 0)]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003


# ------------------------------------------------------------------ the registry


@pytest.mark.parametrize("name", P.PARTITIONERS.names())
def test_every_registered_partitioner_covers_the_examples_with_its_defaults(name):
    spec = P.PARTITIONERS[name]
    y = synthetic_labels(n=400)
    params = factory_kwargs(spec.options, resolve_options(spec.options, {}))
    parts = spec.split(y, 10, seed=3, **params)
    assert_exact_cover(parts, len(y), 10)
    again = spec.split(y, 10, seed=3, **params)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_the_registered_partitioners_are_the_functions_of_the_module():
    y = synthetic_labels()
    for name, direct in [
        ("similarity", P.similarity_split(y, 5, 10, seed=1)),
        ("dirichlet", P.dirichlet_split(y, 5, 0.2, seed=1)),
        ("shards", P.shard_split(y, 5, 3, seed=1)),
        ("iid", P.iid_split(len(y), 5, 1)),
    ]:
        spec = P.PARTITIONERS[name]
        values = {"similarity": 10, "dirichlet_alpha": 0.2, "shards_per_client": 3}
        params = factory_kwargs(spec.options, {f: values[f] for f in spec.options})
        via_registry = spec.split(y, 5, seed=1, **params)
        assert all(np.array_equal(a, b) for a, b in zip(via_registry, direct, strict=True))
    assert P.DEFAULT_PARTITIONER in P.PARTITIONERS


# ------------------------------------------------------------------ bad inputs

ALL_WITH_LABELS = {
    "similarity": functools.partial(P.similarity_split, similarity=50, seed=0),
    "dirichlet": functools.partial(P.dirichlet_split, alpha=1.0, seed=0),
    "shards": functools.partial(P.shard_split, shards_per_client=1, seed=0),
    "iid": lambda y, num_clients: P.iid_split(len(y), num_clients, 0),
}


@pytest.mark.parametrize("name", list(ALL_WITH_LABELS))
def test_more_clients_than_examples(name):
    with pytest.raises(ValueError, match="more clients than examples") as err:
        ALL_WITH_LABELS[name](np.zeros(5, int), num_clients=6)
    assert "6" in str(err.value) and "5" in str(err.value)


@pytest.mark.parametrize("name", list(ALL_WITH_LABELS))
@pytest.mark.parametrize("num_clients", [0, -3])
def test_num_clients_below_one(name, num_clients):
    with pytest.raises(ValueError, match="num_clients"):
        ALL_WITH_LABELS[name](np.zeros(5, int), num_clients=num_clients)


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        P.dirichlet_split(synthetic_labels(), 5, alpha, seed=0)


@pytest.mark.parametrize("similarity", [-0.1, -50, 100.01, 1000, float("nan")])
def test_bad_similarity(similarity):
    with pytest.raises(ValueError, match="similarity"):
        P.similarity_split(synthetic_labels(), 5, similarity, seed=0)


def test_more_shards_than_examples():
    with pytest.raises(ValueError, match="more shards than examples"):
        P.shard_split(np.zeros(5, int), 3, shards_per_client=2)


def test_infeasible_dirichlet_fails_instead_of_looping():
    y = np.repeat([0, 1], 10)  # two classes; Dir(1e-3) gives each class to ~one client
    with pytest.raises(ValueError, match="no draw"):
        P.dirichlet_split(y, 10, 1e-3, seed=0)


def test_bad_iid_options():
    with pytest.raises(ValueError, match="sizes"):
        P.iid_split(10, 2, 0, sizes="zipf")
    with pytest.raises(ValueError, match="sigma"):
        P.iid_split(10, 2, 0, sizes="lognormal", sigma=-1.0)


def test_check_partition_catches_overlap_and_gaps():
    with pytest.raises(ValueError, match="1 examples are unassigned and 1 are assigned more"):
        P.check_partition([np.array([0, 1]), np.array([1, 3])], 4)


# ------------------------------------------------------------------ summary


def test_summary_by_hand():
    y = np.array([0, 0, 1, 2, 2, 2])
    s = P.summary(y, [np.array([0, 2]), np.array([1, 3, 4, 5])], num_classes=4)
    assert s.examples_per_client.tolist() == [2, 4]
    assert s.labels_per_client.tolist() == [2, 2]
    assert s.label_histogram.tolist() == [[1, 1, 0, 0], [1, 0, 3, 0]]
    text = str(s)
    assert "2 clients, 6 examples, 4 classes" in text
    assert "examples per client: min 2, median 3, max 4" in text
    assert "labels per client:   min 2, median 2, max 2" in text
