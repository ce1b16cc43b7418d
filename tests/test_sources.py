"""Tests of scaffold_jax.data.sources: IDX reading, folder loading, TFDS (mocked), cache."""

from __future__ import annotations

import functools
import gzip
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from scaffold_jax.data import sources

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not FASHION_DIR.is_dir(),
    reason=f"{FASHION_DIR} is absent: `apt-get install dataset-fashion-mnist` (CI installs it)",
)

# Computed once from the Debian dataset-fashion-mnist files (the Zalando release).
TRAIN_X100_SUM = 5688570  # train x[:100].sum() as int64
TRAIN_X100_WEIGHTED = 2305122327  # sum of x[:100] * (row * 28 + col): catches a transpose
TEST_X100_SUM = 5854180
TRAIN_Y1000_COUNTS = [107, 104, 86, 92, 95, 100, 100, 115, 102, 99]
TEST_Y1000_COUNTS = [107, 105, 111, 93, 115, 87, 97, 95, 95, 95]
TRAIN_Y_FIRST = [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]  # ankle boot, T-shirt, T-shirt, dress, ...


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No test may see the user's env var, cache or TFDS data dir."""
    monkeypatch.delenv(sources.ENV_DATA_DIR, raising=False)
    monkeypatch.setenv(sources.ENV_CACHE_DIR, str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def fashion() -> sources.Dataset:
    if not FASHION_DIR.is_dir():
        pytest.skip(f"{FASHION_DIR} is absent: `apt-get install dataset-fashion-mnist`")
    return sources.load_idx_folder(FASHION_DIR, "fashion_mnist", 10)


def write_idx(path: Path, array: np.ndarray, compress: bool = True, code: int = 0x08) -> Path:
    """Writes an IDX file (big-endian payload); gzip by content when ``compress``."""
    dtype = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    payload = header + np.asarray(array, dtype[code]).tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


def write_folder(folder: Path, prefix: str, train, test, test_split: str = "test") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, (x, y) in (("train", train), (test_split, test)):
        write_idx(folder / f"{prefix}{split}-images-idx3-ubyte.gz", x)
        write_idx(folder / f"{prefix}{split}-labels-idx1-ubyte.gz", y)
    return folder


def small_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


# ------------------------------------------------------------------ real Fashion-MNIST


@needs_fashion
def test_fashion_mnist_shapes_dtypes_and_checksums(fashion):
    tr, te = fashion.train, fashion.test
    assert tr["x"].shape == (60000, 28, 28) and tr["x"].dtype == np.uint8
    assert te["x"].shape == (10000, 28, 28) and te["x"].dtype == np.uint8
    assert tr["y"].shape == (60000,) and tr["y"].dtype == np.int32
    assert te["y"].shape == (10000,) and te["y"].dtype == np.int32
    assert fashion.num_classes == 10
    for y in (tr["y"], te["y"]):
        assert y.min() >= 0 and y.max() < 10
    assert int(tr["x"][:100].sum(dtype=np.int64)) == TRAIN_X100_SUM
    weights = np.arange(28 * 28, dtype=np.int64).reshape(28, 28)
    assert int((tr["x"][:100].astype(np.int64) * weights).sum()) == TRAIN_X100_WEIGHTED
    assert int(te["x"][:100].sum(dtype=np.int64)) == TEST_X100_SUM
    assert np.bincount(tr["y"][:1000], minlength=10).tolist() == TRAIN_Y1000_COUNTS
    assert np.bincount(te["y"][:1000], minlength=10).tolist() == TEST_Y1000_COUNTS
    assert np.bincount(tr["y"]).tolist() == [6000] * 10
    assert tr["y"][:10].tolist() == TRAIN_Y_FIRST


@needs_fashion
def test_load_finds_the_debian_folder(fashion, tmp_path):
    ds = sources.load("fashion-mnist", cache_dir=tmp_path)
    assert ds.name == "fashion_mnist" and ds.source == str(FASHION_DIR)
    np.testing.assert_array_equal(ds.train["y"], fashion.train["y"])
    assert not list(tmp_path.iterdir())  # IDX data is not copied into the cache


@needs_fashion
def test_gzip_and_raw_read_identically(tmp_path):
    gz = FASHION_DIR / "t10k-images-idx3-ubyte.gz"
    # Detection is by content: raw bytes under a .gz name, gzip bytes under a bare name.
    raw = tmp_path / "raw-named.gz"
    raw.write_bytes(gzip.decompress(gz.read_bytes()))
    renamed = tmp_path / "gzip-named-raw"
    shutil.copyfile(gz, renamed)
    a, b, c = sources.read_idx(gz), sources.read_idx(raw), sources.read_idx(renamed)
    assert a.shape == (10000, 28, 28)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


@needs_fashion
def test_data_dir_and_env_var_take_precedence(fashion, tmp_path, monkeypatch):
    copy = tmp_path / "mine" / "fashion-mnist"  # a dataset-named sub-folder of the root
    copy.mkdir(parents=True)
    for f in FASHION_DIR.iterdir():
        (copy / f.name).symlink_to(f)
    assert sources.load("fashion_mnist", data_dir=tmp_path / "mine").source == str(copy)
    monkeypatch.setenv(sources.ENV_DATA_DIR, str(copy))
    assert sources.load("fashion_mnist").source == str(copy)


# ------------------------------------------------------------------ IDX format errors


def test_read_idx_multibyte_dtype_is_native(tmp_path):
    a = np.arange(-6, 6, dtype=np.int32).reshape(3, 4) * 100000
    out = sources.read_idx(write_idx(tmp_path / "a", a, code=0x0C))
    assert out.dtype == np.int32 and out.dtype.isnative
    np.testing.assert_array_equal(out, a)
    f = sources.read_idx(write_idx(tmp_path / "f", a.astype(np.float32), code=0x0D))
    np.testing.assert_array_equal(f, a.astype(np.float32))


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_file_is_an_error(tmp_path, compress):
    x, _ = small_images(5)
    good = tmp_path / "good"
    write_idx(good, x, compress=False)
    data = good.read_bytes()[:-10]
    bad = tmp_path / "truncated"
    bad.write_bytes(gzip.compress(data) if compress else data)
    expected = 16 + 5 * 28 * 28
    with pytest.raises(ValueError, match="truncated") as err:
        sources.read_idx(bad)
    msg = str(err.value)
    assert str(bad) in msg and str(expected) in msg and str(expected - 10) in msg


@pytest.mark.parametrize("compress", [False, True])
def test_over_long_file_is_an_error(tmp_path, compress):
    x, _ = small_images(5)
    good = write_idx(tmp_path / "good", x, compress=False)
    data = good.read_bytes() + b"\x00" * 7
    bad = tmp_path / "long"
    bad.write_bytes(gzip.compress(data) if compress else data)
    expected = 16 + 5 * 28 * 28
    with pytest.raises(ValueError, match="over-long") as err:
        sources.read_idx(bad)
    assert str(bad) in str(err.value) and str(expected + 7) in str(err.value)


def test_cut_gzip_stream_is_an_error(tmp_path):
    x, _ = small_images(50)
    gz = write_idx(tmp_path / "x.gz", x)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gz.read_bytes()[: len(gz.read_bytes()) // 2])
    with pytest.raises(ValueError, match="cut.gz"):
        sources.read_idx(cut)


@pytest.mark.parametrize("compress", [False, True])
def test_absurd_header_fails_before_allocating(tmp_path, compress):
    header = bytes([0, 0, 0x0E, 3]) + np.asarray([2**32 - 1] * 3, ">u4").tobytes()
    path = tmp_path / "absurd"
    payload = header + b"\x00" * 64
    path.write_bytes(gzip.compress(payload) if compress else payload)
    with pytest.raises(ValueError, match="needs 633825299671392843082401579016 bytes"):
        sources.read_idx(path)


@pytest.mark.parametrize(
    "magic", [b"\x01\x00\x08\x03", b"\x00\x00\x07\x03", b"\x1f\x00\x08\x01", b"\x00\x00"]
)
def test_wrong_magic_is_an_error(tmp_path, magic):
    path = tmp_path / "bad-magic"
    path.write_bytes(magic + np.asarray([2], ">u4").tobytes() + b"\x00\x00")
    with pytest.raises(ValueError, match="not an IDX file") as err:
        sources.read_idx(path)
    assert str(path) in str(err.value)


def test_labels_out_of_range_is_an_error(tmp_path):
    x, y = small_images(6)
    y[4] = 10
    folder = write_folder(tmp_path / "d", "", (x, y), small_images(3, 1), test_split="t10k")
    with pytest.raises(ValueError, match="label 10 at index 4") as err:
        sources.load_idx_folder(folder, "mnist", 10)
    assert "train-labels-idx1-ubyte" in str(err.value)


def test_image_label_count_mismatch_is_an_error(tmp_path):
    x, y = small_images(6)
    folder = write_folder(tmp_path / "d", "", (x, y[:5]), small_images(3, 1), test_split="t10k")
    with pytest.raises(ValueError, match="6 images.*5 labels"):
        sources.load_idx_folder(folder, "mnist", 10)


def test_missing_file_in_folder_is_file_not_found(tmp_path):
    folder = write_folder(tmp_path / "d", "", small_images(4), small_images(3, 1), "t10k")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        sources.load_idx_folder(folder, "mnist", 10)


# ------------------------------------------------------------------ EMNIST orientation


def test_emnist_idx_files_come_back_transposed(tmp_path):
    rng = np.random.default_rng(3)
    stored = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = np.arange(7) * 6  # up to 36 < 47
    test_x, test_y = stored[:3], labels[:3]
    # NIST's gzip.zip unpacks into gzip/; load() looks there under the data dir.
    write_folder(tmp_path / "gzip", "emnist-balanced-", (stored, labels), (test_x, test_y))
    ds = sources.load("emnist/balanced", data_dir=tmp_path, cache_dir=tmp_path / "c")
    assert ds.num_classes == 47 and ds.source == str(tmp_path / "gzip")
    np.testing.assert_array_equal(ds.train["x"], stored.transpose(0, 2, 1))
    np.testing.assert_array_equal(ds.test["x"], test_x.transpose(0, 2, 1))
    np.testing.assert_array_equal(ds.train["y"], labels)
    assert ds.train["x"].flags.c_contiguous
    as_stored = sources.load_idx_folder(tmp_path / "gzip", "emnist/balanced", 47)
    np.testing.assert_array_equal(as_stored.train["x"], stored)


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="unknown dataset 'emnist/nope'.*emnist/balanced"):
        sources.load("emnist/nope")


# ------------------------------------------------------------------ nothing found


def test_nothing_found_lists_every_place_and_every_remedy(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "SYSTEM_DIRS", {"fashion_mnist": (str(tmp_path / "sys"),)})
    monkeypatch.setenv(sources.ENV_DATA_DIR, str(tmp_path / "env"))
    with pytest.raises(FileNotFoundError) as err:
        sources.load("fashion_mnist", cache_dir=tmp_path / "cache", tfds_data_dir=tmp_path / "tfds")
    msg = str(err.value)
    assert "data_dir (not given)" in msg and str(tmp_path / "env") in msg
    assert str(tmp_path / "sys") in msg and str(tmp_path / "cache" / "fashion_mnist.npz") in msg
    assert "TFDS (" in msg and "not prepared" in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "SCAFFOLD_JAX_DATA_DIR" in msg and "data_dir=..." in msg
    assert "allow_download=True" in msg and "--download" not in msg  # the API's terms
    # Only what applies to Fashion-MNIST: no EMNIST step.
    assert sources.NIST_EMNIST_URL not in msg and "not applicable" not in msg
    assert "(1) `apt-get install" in msg and "(2) go online" in msg and "(3)" not in msg
    # The command line says the same in its own terms.
    cli = err.value.for_cli()
    assert "--download" in cli and "--data-dir" in cli and "allow_download" not in cli
    assert cli.replace("--download", "").replace("--data-dir", "") == msg.replace(
        "load(..., allow_download=True)", ""
    ).replace("data_dir=...", "")


def test_a_missing_dataset_lists_only_the_ways_that_apply_to_it(tmp_path, monkeypatch):
    """EMNIST's NIST download for EMNIST alone; IDX files only for a dataset that has them
    (a step marked "not applicable" was listed for every other dataset)."""
    monkeypatch.setattr(sources, "SYSTEM_DIRS", {})
    monkeypatch.delenv(sources.ENV_DATA_DIR, raising=False)
    messages = {}
    for name in ("emnist/balanced", "fashion_mnist", "cifar10"):
        with pytest.raises(FileNotFoundError) as err:
            sources.load(name, cache_dir=tmp_path / "cache", tfds_data_dir=tmp_path / "tfds")
        messages[name] = err.value.for_cli()
    for msg in messages.values():
        assert "not applicable" not in msg and "no IDX distribution" not in msg
    emnist, fashion, cifar = messages.values()
    assert "(1) place the IDX files (emnist-balanced-train-images-idx3-ubyte" in emnist
    assert "(2) go online and let TFDS download it: --download" in emnist
    assert f"(3) download gzip.zip from {sources.NIST_EMNIST_URL}" in emnist
    assert emnist.endswith("pass that folder as --data-dir.")
    assert sources.NIST_EMNIST_URL not in fashion and "(3)" not in fashion
    assert fashion.endswith("(2) go online and let TFDS download it: --download (download was "
                            "not allowed this time).")  # fmt: skip
    assert "IDX" not in cifar and "(2)" not in cifar
    assert cifar.endswith(
        "The way to get it:\n  (1) go online and let TFDS download it: --download (download "
        "was not allowed this time)."
    )


def test_a_missing_dataset_tells_cli_users_the_flag_and_no_absl_warning(tmp_path, capfd):
    pytest.importorskip("tensorflow_datasets")
    from scaffold_jax.cli import main

    out = tmp_path / "run"
    argv = ["run", "--dataset", "cifar10", "--out", str(out), "--quiet"]
    env = {"TFDS_DATA_DIR": str(tmp_path / "tfds"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setattr(sources, "default_cache_dir", lambda: tmp_path / "cache")
        assert main(argv) == 1
    err = capfd.readouterr().err
    assert "could not find the cifar10 dataset" in err
    assert "let TFDS download it: --download (download was not allowed" in err
    assert "allow_download" not in err and "WARNING:absl" not in err
    assert "dataset_info.json" not in err


# ------------------------------------------------------------------ TFDS (mocked) and cache


def _mock_tfds(num_examples: int):
    """``tfds.testing.mock_data`` with a working ``__getitems__``.

    In tfds 4.9.10 the mock assigns ``__getitems__`` as a plain ``functools.partial`` on a
    MagicMock; MagicMock binds only the dunders it knows and ``__getitems__`` is not one
    of them, so every bulk read fails with "missing 1 required positional argument:
    'record_keys'". This subclass binds the partial to the mock, so the production code
    runs its real bulk-read path against the mock.
    """
    tfds = pytest.importorskip("tensorflow_datasets")

    class _BulkReadableMock(tfds.testing.PickableDataSourceMock):
        def __setattr__(self, name, value):
            if name == "__getitems__" and isinstance(value, functools.partial) and not value.args:
                value = functools.partial(value.func, self, **value.keywords)
            super().__setattr__(name, value)

    return tfds, tfds.testing.mock_data(
        num_examples=num_examples, mock_array_record_data_source=_BulkReadableMock()
    )


def test_tfds_emnist_through_load_then_cache(tmp_path):
    tfds, mocked = _mock_tfds(num_examples=11)
    cache = tmp_path / "cache"
    with mocked:
        with pytest.raises(FileNotFoundError, match="allow_download=True"):
            sources.load("emnist/balanced", cache_dir=cache)  # not prepared, no download
        assert not cache.exists()
        ds = sources.load("emnist/balanced", cache_dir=cache, allow_download=True)
        raw = tfds.data_source("emnist/balanced", split="train")
        raw_x = np.stack([raw[i]["image"] for i in range(len(raw))])
        raw_y = np.asarray([raw[i]["label"] for i in range(len(raw))])
    assert ds.source == "tfds:emnist/balanced" and ds.num_classes == 47
    for split in (ds.train, ds.test):
        assert split["x"].shape == (11, 28, 28) and split["x"].dtype == np.uint8
        assert split["y"].shape == (11,) and split["y"].dtype == np.int32
        assert split["y"].min() >= 0 and split["y"].max() < 47
    # TFDS EMNIST images are stored transposed, like the NIST files: we return them upright.
    np.testing.assert_array_equal(ds.train["x"], raw_x[..., 0].transpose(0, 2, 1))
    np.testing.assert_array_equal(ds.train["y"], raw_y)
    npz = cache / "emnist-balanced.npz"
    assert npz.is_file()
    # Outside the mock TFDS has no data at all, and load() reads the cache without even
    # importing TFDS (users without tensorflow-datasets): these can only come from the cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "tensorflow_datasets", None)  # `import` now fails
        again = sources.load("emnist-balanced", cache_dir=cache)
    direct = sources.load_tfds("emnist/balanced", cache_dir=cache)
    for other in (again, direct):
        assert str(npz) in other.source and other.num_classes == 47
        np.testing.assert_array_equal(other.train["x"], ds.train["x"])
        np.testing.assert_array_equal(other.test["y"], ds.test["y"])


def test_tfds_mnist_upright_and_cifar10_rgb(tmp_path):
    tfds, mocked = _mock_tfds(num_examples=5)
    with mocked:
        mnist = sources.load_tfds("mnist", cache_dir=tmp_path, download=True)
        raw = tfds.data_source("mnist", split="test")
        np.testing.assert_array_equal(mnist.test["x"][2], raw[2]["image"][..., 0])
        cifar = sources.load("cifar10", cache_dir=tmp_path, allow_download=True)
    assert mnist.train["x"].shape == (5, 28, 28)
    assert cifar.train["x"].shape == (5, 32, 32, 3) and cifar.train["x"].dtype == np.uint8
    assert (tmp_path / "mnist.npz").is_file() and (tmp_path / "cifar10.npz").is_file()


def test_stale_cache_is_ignored(tmp_path):
    path = sources.cache_path("mnist", tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x, y = np.zeros((1, 28, 28), np.uint8), np.zeros(1, np.int32)
    fields = dict(train_x=x, train_y=y, test_x=x, test_y=y, num_classes=10, origin="old")
    np.savez(path, format=0, name="mnist", **fields)  # format 0: an older layout
    with pytest.raises(FileNotFoundError, match=r"npz cache .*mnist.npz \(stale, ignored\)"):
        sources.load("mnist", cache_dir=tmp_path, tfds_data_dir=tmp_path / "tfds")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_cache_is_rebuilt_with_a_warning(tmp_path, damage):
    path = sources.cache_path("mnist", tmp_path)
    with _mock_tfds(num_examples=5)[1]:
        first = sources.load_tfds("mnist", cache_dir=tmp_path, download=True)
    good = path.read_bytes()
    path.write_bytes(b"not a zip file" if damage == "garbage" else good[: len(good) // 2])
    with pytest.warns(UserWarning, match=rf"unreadable dataset cache {re.escape(str(path))}"):
        assert sources._load_cache(path, "mnist") is None  # treated as absent
    mocked = _mock_tfds(num_examples=5)[1]
    with mocked, pytest.warns(UserWarning, match="it is rebuilt from the source") as caught:
        again = sources.load_tfds("mnist", cache_dir=tmp_path, download=True)
    ours = [w for w in caught if "dataset cache" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]  # warned once, naming the file
    assert again.source == "tfds:mnist"  # rebuilt from TFDS...
    np.testing.assert_array_equal(again.train["x"], first.train["x"])
    cached = sources._load_cache(path, "mnist")  # ...and rewritten: readable again
    assert cached is not None and str(path) in cached.source


def test_a_failed_download_says_not_found_with_every_way_to_get_the_data(tmp_path, monkeypatch):
    """Offline, TFDS's download fails with whatever its transport raises; load() reports
    it among the places looked, blaming the connection."""
    tfds = pytest.importorskip("tensorflow_datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'storage.googleapis.com'")

    monkeypatch.setattr(tfds, "data_source", offline)
    with pytest.raises(FileNotFoundError) as info:
        sources.load(
            "emnist/balanced", cache_dir=tmp_path, tfds_data_dir=tmp_path, allow_download=True
        )
    msg = str(info.value)
    assert "could not download emnist/balanced (ConnectionError: Failed to resolve" in msg
    assert "check the internet connection" in msg
    assert sources.NIST_EMNIST_URL in msg  # the other ways are still listed


def test_an_offline_download_fails_fast_and_leaves_no_tfds_folder(tmp_path, monkeypatch):
    """TFDS's real download path, with every host lookup failing as it does offline (no
    request leaves the machine): the retries are capped (TFDS's own 10 waited 204 s), and
    the folders TFDS made for the failed download are gone, so later loads do not warn
    about a dataset folder without its dataset_info.json."""
    import socket
    import time

    pytest.importorskip("tensorflow_datasets")
    lookups = []

    def no_dns(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    tfds_dir = tmp_path / "tfds"
    tfds_dir.mkdir()
    (tfds_dir / "cifar10").mkdir()  # another dataset's folder is left alone
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        sources.load("mnist", cache_dir=tmp_path / "cache", tfds_data_dir=tfds_dir,
                      allow_download=True)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert "could not download mnist" in str(info.value)
    assert "check the internet connection" in str(info.value)
    hosts = set(lookups)
    assert hosts, "the download never reached the network layer"
    # One attempt and DOWNLOAD_RETRIES retries per host, not TFDS's 11.
    assert len(lookups) <= (1 + sources.DOWNLOAD_RETRIES) * len(hosts) * 4  # 4 files
    assert elapsed < 30, f"the offline failure took {elapsed:.0f} s"
    assert sorted(p.name for p in tfds_dir.iterdir()) == ["cifar10"]
    # TFDS's own setting is restored for everyone else.
    from tensorflow_datasets.core.download import downloader

    assert downloader.MAX_RETRIES == 10


def test_a_failed_download_keeps_what_it_had_finished(tmp_path):
    """A completed download file survives the cleanup (a retry need not fetch it again);
    a partial one (TFDS's ``*.tmp.*``), empty folders and the dataset's ``.config`` go, and
    what was there before stays. A data dir the download created goes too when empty."""
    root = tmp_path / "tfds"
    downloads = root / "downloads"
    (root / "mnist").mkdir(parents=True)
    (root / "mnist" / "old.txt").write_text("before")
    before = sources._download_paths(root, "mnist")
    (root / "mnist" / ".config").mkdir()
    (root / "mnist" / ".config" / "metadata.json").write_text("{}")
    (root / "mnist" / "3.0.1").mkdir()
    done = downloads / "mnist" / "train-images.gz"
    partial = downloads / "mnist" / "test-images.gz.tmp.0123" / "test-images.gz"
    partial.parent.mkdir(parents=True)
    done.write_bytes(b"finished")
    partial.write_bytes(b"half")
    (downloads / "extracted").mkdir()
    sources._remove_new_paths(root, "mnist", before)
    assert sources._download_paths(root, "mnist") == {
        root,
        root / "mnist",
        root / "mnist" / "old.txt",
        downloads,
        downloads / "mnist",
        done,
    }
    fresh = tmp_path / "fresh"  # a data dir that did not exist: nothing of it is left
    (fresh / "downloads" / "extracted").mkdir(parents=True)
    sources._remove_new_paths(fresh, "mnist", set())
    assert not fresh.exists()


def test_a_missing_download_dependency_is_named_not_the_network(tmp_path, monkeypatch):
    """tensorflow-datasets imports importlib_resources to download on every Python but
    declares it for Python < 3.9 only: the message names the module and the fix."""
    tfds = pytest.importorskip("tensorflow_datasets")

    def missing(*args, **kwargs):
        raise ModuleNotFoundError(
            "No module named 'importlib_resources'", name="importlib_resources"
        )

    monkeypatch.setattr(tfds, "data_source", missing)
    with pytest.raises(FileNotFoundError) as info:
        sources.load("cifar10", cache_dir=tmp_path, tfds_data_dir=tmp_path, allow_download=True)
    msg = str(info.value)
    assert "it needs the module importlib_resources, which is not installed" in msg
    assert "pip install importlib_resources" in msg and "internet" not in msg


@pytest.mark.slow  # compiles the CNN (~12 s); cifar10 through TFDS's mock data stays
def test_tfds_cifar100_then_a_dirichlet_split_trains_the_cnn(tmp_path):
    """CIFAR-100 through TFDS (mocked: the real one needs the network), split with the
    Dirichlet partitioner, trained with the CNN on 32×32×3 images for one round."""
    from scaffold_jax import experiments

    _, mocked = _mock_tfds(num_examples=40)
    with mocked:
        cifar = sources.load("cifar100", cache_dir=tmp_path, allow_download=True)
    assert cifar.num_classes == 100 and cifar.train["x"].shape == (40, 32, 32, 3)
    assert cifar.train["y"].max() < 100
    config = experiments.RunConfig(
        dataset="cifar100", model="cnn", partition="dirichlet", dirichlet_alpha=0.5,
        num_clients=4, clients_per_round=2, batch_plan="fixed", batch_size=4, local_steps=1,
        rounds=1, eval_every=1, client_lr=0.01,
    )  # fmt: skip
    summary = experiments.run(config, tmp_path / "run", quiet=True, dataset=cifar)
    assert summary["status"] == "finished" and summary["partition"]["kind"] == "dirichlet"
    assert summary["num_classes"] == 100
