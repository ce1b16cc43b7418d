"""Tests of scaffold_jax.data.femnist: LEAF JSON and TFF HDF5 files written in tmp_path."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from scaffold_jax.data import femnist, natural, sources


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No test may read or write the user's cache."""
    monkeypatch.setenv(sources.ENV_CACHE_DIR, str(tmp_path / "default-cache"))


def make_writers(sizes, seed=0):
    """Writers' images as LEAF stores them: ``k / 255`` floats, 1.0 = white background.

    Every image carries an asymmetric mark (ink in the top-left corner, a bar along the
    top row), so a transpose or a flip would be seen.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for w, (n_train, n_test) in sizes.items():
        splits = {}
        for split, n in (("train", n_train), ("test", n_test)):
            k = rng.integers(200, 256, size=(n, 28, 28))  # light background
            k[:, 0, :10] = 0  # ink: a bar along the top row, left half
            k[:, 1:6, 0] = rng.integers(0, 50, size=(n, 5))  # and down the left edge
            splits[split] = (k.astype(np.int64), rng.integers(0, 62, size=n).astype(np.int64))
        out[w] = splits
    return out


WRITERS = {"f0001_07": (5, 2), "f0000_14": (3, 1), "f0002_33": (4, 0)}


def write_leaf(root: Path, writers, files=2, extra_test=None) -> Path:
    """LEAF's layout: ``train/*.json`` and ``test/*.json``, writers spread over files."""
    names = list(writers)
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for f in range(files):
            users = names[f::files]
            user_data, num = {}, []
            for u in users:
                k, y = writers[u][split]
                if len(y) == 0:
                    continue
                user_data[u] = {"x": (k.reshape(len(y), 784) / 255.0).tolist(), "y": y.tolist()}
                num.append(len(y))
            if split == "test" and f == 0 and extra_test:
                for u, (k, y) in extra_test.items():
                    user_data[u] = {"x": (k.reshape(len(y), 784) / 255.0).tolist(), "y": y.tolist()}
                    num.append(len(y))
            body = {"users": list(user_data), "num_samples": num, "user_data": user_data}
            (root / split / f"all_data_{f}_niid_0_keep_0_{split}_8.json").write_text(
                json.dumps(body)
            )
    return root


def check_clients(ds, writers, pixels="uint8"):
    assert ds.client_ids == tuple(sorted(writers))  # sorted, as TFF lists them
    for i, w in enumerate(ds.client_ids):
        for split, got in (("train", ds.train_client(i)), ("test", ds.test_client(i))):
            k, y = writers[w][split]
            np.testing.assert_array_equal(got["y"], y)
            assert got["y"].dtype == np.int32
            if pixels == "uint8":
                assert got["x"].dtype == np.uint8
                np.testing.assert_array_equal(got["x"], 255 - k)  # MNIST-like: ink high
            else:
                assert got["x"].dtype == np.float32
                np.testing.assert_allclose(got["x"], k / 255.0, rtol=0, atol=1e-7)
            if len(y):
                # Upright: the ink bar is along the top row, the left edge below it.
                x = got["x"].astype(np.float64)
                ink = x if pixels == "uint8" else 255 * (1 - x)
                assert (ink[:, 0, :10] == 255).all()
                assert ink[:, 0, :10].mean() > ink[:, :10, 0].mean() - 1e-9


def test_leaf_json_round_trip(tmp_path):
    writers = make_writers(WRITERS)
    root = write_leaf(tmp_path / "leaf", writers)
    ds = femnist.load(root, cache_dir=tmp_path / "c")
    assert ds.name == "femnist" and ds.num_classes == 62 and ds.info["format"] == "leaf"
    assert ds.train["x"].shape[1:] == (28, 28)
    check_clients(ds, writers)
    assert ds.test_counts.tolist() == [1, 2, 0]  # f0000_14, f0001_07, f0002_33 (none)


def test_leaf_json_float_pixels_and_data_subfolder(tmp_path):
    writers = make_writers(WRITERS, seed=1)
    write_leaf(tmp_path / "femnist" / "data", writers, files=1)
    ds = femnist.load(tmp_path / "femnist", pixels="float32", cache_dir=tmp_path / "c")
    check_clients(ds, writers, pixels="float32")


def test_leaf_test_only_writers_are_left_out_with_a_warning(tmp_path):
    writers = make_writers(WRITERS)
    extra = make_writers({"f0999_00": (0, 3)})["f0999_00"]["test"]
    root = write_leaf(tmp_path / "leaf", writers, extra_test={"f0999_00": extra})
    with pytest.warns(UserWarning, match="no training examples"):
        ds = femnist.load(root, cache_dir=tmp_path / "c")
    assert "f0999_00" not in ds.client_ids and ds.info["test_only_writers_dropped"] == 1


def test_leaf_malformed_files(tmp_path):
    root = tmp_path / "bad"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    body = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.5] * 783], "y": [1]}}}
    (root / "train" / "a.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"\[n, 784\]"):
        femnist.load(root, use_cache=False)
    body["user_data"]["u"]["x"] = [[1.5] * 784]
    (root / "train" / "a.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        femnist.load(root, use_cache=False)
    body["user_data"]["u"] = {"x": [[0.5] * 784], "y": [62]}
    (root / "train" / "a.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match=r"\[0, 62\)"):
        femnist.load(root, use_cache=False)
    with pytest.raises(FileNotFoundError, match="no FEMNIST files"):
        femnist.load(tmp_path)


def test_cache_round_trip_and_min_examples(tmp_path):
    writers = make_writers(WRITERS)
    root = write_leaf(tmp_path / "leaf", writers)
    first = femnist.load(root)
    (cache,) = (tmp_path / "default-cache").glob("femnist-*.npz")
    second = femnist.load(root)
    assert "cache of" in second.source and str(cache) in second.source
    check_clients(second, writers)
    np.testing.assert_array_equal(first.train["x"], second.train["x"])
    kept = femnist.load(root, min_examples=4)
    assert kept.client_ids == ("f0001_07", "f0002_33") and kept.info["dropped_min_examples"] == 1
    check_clients(kept, {w: writers[w] for w in kept.client_ids})


def test_to_federated_and_registry(tmp_path):
    writers = make_writers(WRITERS)
    root = write_leaf(tmp_path / "leaf", writers)
    ds = natural.load("femnist", root, cache_dir=tmp_path / "c")
    fed = natural.to_federated(ds)
    assert fed.num_classes == 62 and fed.client_ids == ds.client_ids
    assert fed.data.counts.tolist() == [3, 5, 4]
    assert int(fed.data.test["y"].shape[0]) == 3
    for i in range(3):
        np.testing.assert_array_equal(fed.data.client_examples(i)["x"], ds.train_client(i)["x"])
        np.testing.assert_array_equal(fed.client_test[i]["y"], ds.test_client(i)["y"])
    assert [len(p) for p in natural.client_indices(ds)] == [3, 5, 4]
    with pytest.raises(FileNotFoundError, match="data_dir"):
        natural.load("femnist")
    with pytest.raises(ValueError, match="unknown"):
        natural.load("femnist_v2", root)


# --------------------------------------------------------------------------------------
# TFF HDF5
# --------------------------------------------------------------------------------------


def write_tff(folder: Path, writers, prefix="fed_emnist", label_shape=()) -> Path:
    h5py = pytest.importorskip("h5py")
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        with h5py.File(folder / f"{prefix}_{split}.h5", "w") as f:
            group = f.create_group("examples")
            for w, splits in writers.items():
                k, y = splits[split]
                client = group.create_group(w)
                client.create_dataset("pixels", data=(k / 255.0).astype(np.float32))
                client.create_dataset("label", data=y.astype(np.int32).reshape(-1, *label_shape))
    return folder


def test_tff_h5_round_trip(tmp_path):
    writers = make_writers(WRITERS, seed=2)
    folder = write_tff(tmp_path / "tff", writers)
    ds = femnist.load(folder, cache_dir=tmp_path / "c")
    assert ds.info["format"] == "tff" and ds.num_classes == 62
    check_clients(ds, writers)
    raw = femnist.read_tff_h5(folder / "fed_emnist_train.h5", pixels="float32")
    assert list(raw) == sorted(writers)
    k, _ = writers["f0000_14"]["train"]
    np.testing.assert_array_equal(raw["f0000_14"]["x"], (k / 255.0).astype(np.float32))


def test_tff_h5_digits_only_file_and_label_column(tmp_path):
    writers = make_writers(WRITERS, seed=3)
    for w in writers.values():
        for split in ("train", "test"):
            k, y = w[split]
            w[split] = (k, y % 10)
    folder = write_tff(tmp_path / "tff", writers, prefix="fed_emnist_digitsonly", label_shape=(1,))
    ds = femnist.load(folder / "fed_emnist_digitsonly_train.h5", cache_dir=tmp_path / "c")
    assert ds.num_classes == 10
    check_clients(ds, writers)
    again = femnist.load(folder, only_digits=True, cache_dir=tmp_path / "c")
    assert "cache of" in again.source and again.client_ids == ds.client_ids


def test_tff_h5_malformed(tmp_path):
    h5py = pytest.importorskip("h5py")
    (tmp_path / "t").mkdir()
    with h5py.File(tmp_path / "t" / "fed_emnist_train.h5", "w") as f:
        f.create_group("examples").create_group("w").create_dataset(
            "pixels", data=np.zeros((2, 28, 27), np.float32)
        )
        f["examples/w"].create_dataset("label", data=np.zeros(2, np.int32))
    shutil.copyfile(tmp_path / "t" / "fed_emnist_train.h5", tmp_path / "t" / "fed_emnist_test.h5")
    with pytest.raises(ValueError, match=r"\[n, 28, 28\]"):
        femnist.load(tmp_path / "t", use_cache=False)


def test_without_h5py_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "h5py", None)
    (tmp_path / "fed_emnist_train.h5").write_bytes(b"")
    (tmp_path / "fed_emnist_test.h5").write_bytes(b"")
    with pytest.raises(ImportError, match=r"scaffold-jax\[femnist\]"):
        femnist.load(tmp_path, use_cache=False)
