"""TensorFlow Datasets through ``tfds.data_source`` (no TensorFlow needed), and the
``.npz`` cache that :func:`load_tfds` writes and :func:`scaffold_jax.data.sources.load` reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scaffold_jax.data.sources_registry import DATASETS, Dataset, _check_labels, canonical_name

logger = logging.getLogger(__name__)

ENV_CACHE_DIR = "SCAFFOLD_JAX_CACHE_DIR"

# Bumped whenever the cache layout or the orientation convention changes, so an old cache
# file is ignored (and rewritten) instead of silently giving differently shaped data.
_CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    """``$SCAFFOLD_JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/scaffold_jax``, else
    ``~/.cache/scaffold_jax``."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "scaffold_jax"


def cache_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the ``.npz`` cache of dataset ``name`` lives."""
    name = canonical_name(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"{name.replace('/', '-')}.npz"


def _load_cache(path: Path, name: str) -> Dataset | None:
    """The cached dataset, or None when the file is absent, stale (older format) or
    unreadable (corrupt or truncated: a warning names it, and the caller rebuilds it)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != _CACHE_FORMAT or str(z["name"]) != name:
                logger.warning("ignoring stale cache %s (format or name mismatch)", path)
                return None
            train = {"x": z["train_x"], "y": z["train_y"]}
            test = {"x": z["test_x"], "y": z["test_y"]}
            origin, num_classes = str(z["origin"]), int(z["num_classes"])
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, zlib.error) as err:
        warnings.warn(
            f"ignoring the unreadable dataset cache {path} ({type(err).__name__}: {err}); it "
            "is rebuilt from the source.",
            stacklevel=2,
        )
        return None
    return Dataset(name, f"{path} (cache of {origin})", train, test, num_classes)


def _write_cache(path: Path, ds: Dataset) -> None:
    """Writes atomically (temporary file + rename): concurrent runs never read half a file.

    Uncompressed: loading is then a plain read (the arrays take their full size in memory
    either way, and decompressing would cost time on every load).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                format=np.int64(_CACHE_FORMAT),
                name=np.str_(ds.name),
                origin=np.str_(ds.source),
                num_classes=np.int64(ds.num_classes),
                train_x=ds.train["x"],
                train_y=ds.train["y"],
                test_x=ds.test["x"],
                test_y=ds.test["y"],
            )
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _read_source(source: Sequence[Any], chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Reads a whole TFDS data source into ``(images, labels)`` arrays.

    Records are fetched ``chunk`` at a time with ``__getitems__`` (ArrayRecord reads them
    in parallel) and written into preallocated arrays; only TFDS's own per-record image
    decoding remains per example (the files store each image as a PNG).
    """
    n = len(source)
    get_many = getattr(source, "__getitems__", None)
    x = y = None
    for start in range(0, n, chunk):
        keys = list(range(start, min(n, start + chunk)))
        records = get_many(keys) if get_many is not None else [source[k] for k in keys]
        if x is None:
            first = np.asarray(records[0]["image"])
            x = np.empty((n, *first.shape), dtype=np.uint8)
            y = np.empty((n,), dtype=np.int32)
        x[start : start + len(keys)] = np.stack([np.asarray(r["image"]) for r in records])
        y[start : start + len(keys)] = [int(r["label"]) for r in records]
    if x is None:
        raise ValueError(f"the TFDS data source {source!r} is empty.")
    return x, y


def load_tfds(
    name: str,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> Dataset:
    """Loads a dataset through ``tfds.data_source`` (no TensorFlow needed), with a cache.

    The first call reads both splits into numpy and writes them to
    ``<cache_dir>/<name>.npz``; later calls read that file and never touch TFDS.

    Args:
      name: one of :data:`DATASETS`, e.g. ``"emnist/balanced"`` or ``"cifar10"``.
      data_dir: the TFDS data dir (default: TFDS's, ``~/tensorflow_datasets``).
      cache_dir: the ``.npz`` cache folder (default :func:`default_cache_dir`).
      download: let TFDS download and prepare the dataset when it is not prepared yet
        (needs internet). When False, only an already prepared dataset is read. Offline,
        the download fails within seconds (:data:`DOWNLOAD_RETRIES`) and what it created
        in the TFDS data dir is removed, apart from completed download files.

    Returns:
      The :class:`Dataset`: grayscale images squeezed to ``[n, 28, 28]``, EMNIST images
      transposed upright, labels int32.

    Raises:
      FileNotFoundError: not cached, not prepared in ``data_dir``, and ``download`` False;
        or the download failed (offline).
      ImportError: tensorflow-datasets is not installed.
    """
    name = canonical_name(name)
    spec = DATASETS[name]
    path = cache_path(name, cache_dir)
    cached = _load_cache(path, name)
    if cached is not None:
        return cached
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            "reading TFDS datasets needs tensorflow-datasets: pip install 'scaffold-jax[data]'"
        ) from err
    data_dir = None if data_dir is None else os.fspath(Path(data_dir).expanduser())
    with _absl_quiet():  # TFDS warns about a missing dataset_info.json: it is missing
        builder = tfds.builder(name, data_dir=data_dir)
        prepared = builder.is_prepared()
    if not download and not prepared:
        raise FileNotFoundError(
            f"TFDS dataset {name} is not prepared in {builder.data_dir} and download=False."
        )
    # What a failed download leaves behind is removed: TFDS's empty dataset folder would
    # make every later load warn that its dataset_info.json is missing.
    root = Path(builder.data_dir_root)
    before = _download_paths(root, builder.name) if download and not prepared else None
    # Pass the splits explicitly: with split=None TFDS needs the split metadata up front,
    # which `tfds.testing.mock_data` does not provide.
    try:
        with _few_download_retries():
            train_src, test_src = tfds.data_source(
                name, split=["train", "test"], data_dir=data_dir, download=download
            )
    except Exception as err:
        if before is not None:
            _remove_new_paths(root, builder.name, before)
        if not download or isinstance(err, FileNotFoundError):
            raise
        if isinstance(err, ImportError):
            # A dependency TFDS needs only to download: tensorflow-datasets declares
            # importlib_resources for Python < 3.9 only, yet imports it on every Python.
            module = getattr(err, "name", None) or str(err)
            raise FileNotFoundError(
                f"TFDS could not download {name}: it needs the module {module}, which is not "
                f"installed ({err}); pip install {module} (the 'data' extra of scaffold-jax "
                "includes importlib_resources)."
            ) from err
        # Offline, TFDS fails in many ways (DNS errors, connection resets); the caller
        # gets "not found" with what went wrong.
        raise FileNotFoundError(
            f"TFDS could not download {name} ({type(err).__name__}: {err}); check the "
            "internet connection, or get the files another way (see scaffold_jax.data.sources)."
        ) from err
    splits = {}
    for split, src in (("train", train_src), ("test", test_src)):
        x, y = _read_source(src)
        if x.ndim == 4 and x.shape[-1] == 1:
            x = x[..., 0]  # grayscale: [n, 28, 28, 1] -> [n, 28, 28]
        if spec.transposed:
            x = np.ascontiguousarray(x.transpose(0, 2, 1))
        _check_labels(y, spec.num_classes, f"tfds:{name} {split}")
        splits[split] = {"x": x, "y": y}
    ds = Dataset(name, f"tfds:{name}", splits["train"], splits["test"], spec.num_classes)
    try:
        _write_cache(path, ds)
    except OSError as err:  # a read-only home must not make the data unusable
        logger.warning("could not write the cache %s: %s", path, err)
    return ds


#: Retries of a failed download request. TFDS's own 10, with its exponential backoff
#: (0.2 s doubling), wait 204 s before an offline download fails; 2 (0.4 s of waiting)
#: still ride out a transient error.
DOWNLOAD_RETRIES = 2


@contextlib.contextmanager
def _few_download_retries():
    """TFDS's download retries capped at :data:`DOWNLOAD_RETRIES`, then restored.

    TFDS reads its module constant ``MAX_RETRIES`` for every request; a TFDS without it is
    left as it is."""
    from tensorflow_datasets.core.download import downloader

    saved = getattr(downloader, "MAX_RETRIES", None)
    if saved is not None:
        downloader.MAX_RETRIES = min(saved, DOWNLOAD_RETRIES)
    try:
        yield
    finally:
        if saved is not None:
            downloader.MAX_RETRIES = saved


def _download_paths(root: Path, name: str) -> set[Path]:
    """The paths a TFDS download of dataset ``name`` writes in the data dir ``root``: the
    folder itself, and everything in its dataset folder and its ``downloads`` folder."""
    trees = [tree for tree in (root / name, root / "downloads") if tree.exists()]
    return {p for p in (root, *trees) if p.exists()} | {p for t in trees for p in t.rglob("*")}


def _remove_new_paths(root: Path, name: str, before: set[Path]) -> None:
    """Removes what a failed TFDS download of ``name`` created (paths not in ``before``).

    A completed download file is kept (a retry need not fetch it again), and so are the
    folders that hold one; TFDS's partial downloads (``*.tmp.*``) and every folder left
    empty go, and the dataset's ``.config`` metadata with them. A path that cannot be
    removed is left, with a warning: the download's own error matters more."""
    downloads = root / "downloads"
    for path in sorted(_download_paths(root, name) - before, key=lambda p: -len(p.parts)):
        inside = path.relative_to(downloads).parts if path.is_relative_to(downloads) else None
        finished = inside is not None and not any(".tmp." in part for part in inside)
        try:
            if path.is_dir() and not path.is_symlink():
                if not any(path.iterdir()):
                    path.rmdir()
            elif not finished:
                path.unlink()
        except OSError as err:
            logger.warning("could not remove %s after the failed download: %s", path, err)


@contextlib.contextmanager
def _absl_quiet():
    """absl's warnings (TFDS logs through it) held back to errors, then restored."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)
