"""Real image datasets as numpy arrays: IDX files, TFDS, and an ``.npz`` cache.

The federated experiments of Karimireddy et al. (2020), "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning" (ICML), use EMNIST (Cohen et al. 2017, "EMNIST: an
extension of MNIST to handwritten letters"). This module loads it, and its relatives
MNIST (LeCun et al. 1998), Fashion-MNIST (Xiao et al. 2017) and CIFAR-10 (Krizhevsky 2009),
into a :class:`Dataset` of uint8 images and int32 labels. Nothing here downloads anything
unless the caller says so (``allow_download=True``).

Where the data can come from, in the order :func:`load` looks:

1. an explicit ``data_dir`` holding IDX files (the MNIST file format, gzip or raw);
2. the folder named by the environment variable ``SCAFFOLD_JAX_DATA_DIR``;
3. system folders: Debian's ``dataset-fashion-mnist`` package installs Fashion-MNIST under
   ``/usr/share/datasets/fashion-mnist``;
4. the ``.npz`` cache that :func:`load_tfds` writes (default ``~/.cache/scaffold_jax``);
5. TensorFlow Datasets through ``tfds.data_source`` (no TensorFlow needed): a dataset
   already prepared in the TFDS data dir, or, with ``allow_download=True``, downloaded.

Orientation: every image this module returns is UPRIGHT, in MNIST orientation. The EMNIST
binaries from NIST store each image transposed (mirrored and rotated 90°), and TFDS
copies them unchanged (its EMNIST description says so), so both the IDX and the TFDS paths
transpose EMNIST images once on load, and the ``.npz`` cache stores them upright. Models
only ever see one orientation whichever source the data came from.

Labels: as the source gives them. EMNIST ``letters`` labels are 1..26 in the NIST files
and TFDS declares 37 classes for them; we keep TFDS's class counts for every dataset so
that a model's output size does not depend on where the data came from.

:data:`DATASETS` names the datasets :func:`load` knows, each with a :class:`DatasetSpec`
(its registry name is also its TFDS name). Another dataset that TFDS or IDX files provide
is one line, ``DATASETS.register("name", DatasetSpec(...))``, in any module (a plugin,
:func:`scaffold_jax.registry.load_plugins`).
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import math
import os
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options

logger = logging.getLogger(__name__)

ENV_DATA_DIR = "SCAFFOLD_JAX_DATA_DIR"
ENV_CACHE_DIR = "SCAFFOLD_JAX_CACHE_DIR"
NIST_EMNIST_URL = "https://www.nist.gov/itl/products-and-services/emnist-dataset"

# Bumped whenever the cache layout or the orientation convention changes, so an old cache
# file is ignored (and rewritten) instead of silently giving differently shaped data.
_CACHE_FORMAT = 1

# Folders that OS packages install datasets into (tests monkeypatch this).
SYSTEM_DIRS: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("/usr/share/datasets/fashion-mnist",),
}


class DatasetSpec(NamedTuple):
    """A registered dataset: where :func:`load` looks for it and how it reads it.

    Attributes:
      num_classes: C, as TFDS declares it (every label is in ``[0, C)``).
      idx_prefix: file-name prefix of its IDX files (``""`` for MNIST's own names); None:
        it has no IDX distribution (TFDS only).
      transposed: its images are stored transposed (EMNIST) in IDX files and in TFDS.
      subdirs: sub-folders of a data dir that may hold it, tried before the dir itself.
      loader: a dataset with a loader of its own (a plugin's ``.npz`` file, a CSV...):
        ``loader(data_dir, **options) -> Dataset``, called instead of the IDX/cache/TFDS
        search. None: the built-in search.
      options: ``{name: Option}``, the loader's declared options, passed to it as keywords.

    Examples:
      >>> def from_npz(data_dir, scale=1.0): ...
      >>> spec = DatasetSpec(10, loader=from_npz)  # then DATASETS.register("mine", spec)
    """

    num_classes: int
    idx_prefix: str | None = None
    transposed: bool = False
    subdirs: tuple[str, ...] = ()
    loader: Callable[..., Dataset] | None = None
    options: Mapping[str, Option] = {}


DATASETS: Registry[DatasetSpec] = Registry("dataset")
DATASETS.register("mnist", DatasetSpec(10, "", False, ("mnist",)))
DATASETS.register("fashion_mnist", DatasetSpec(10, "", False, ("fashion_mnist", "fashion-mnist")))
DATASETS.register("cifar10", DatasetSpec(10, None, False, ()))
DATASETS.register("cifar100", DatasetSpec(100, None, False, ()))


def _emnist(config: str, num_classes: int) -> DatasetSpec:
    """An EMNIST split: NIST's ``emnist-<config>-`` IDX files, images stored transposed."""
    # NIST's gzip.zip unpacks into gzip/.
    return DatasetSpec(
        num_classes, f"emnist-{config}-", True, (f"emnist-{config}", "emnist", "gzip")
    )


DATASETS.register("emnist/balanced", _emnist("balanced", 47))
DATASETS.register("emnist/byclass", _emnist("byclass", 62))
DATASETS.register("emnist/bymerge", _emnist("bymerge", 47))
DATASETS.register("emnist/digits", _emnist("digits", 10))
DATASETS.register("emnist/letters", _emnist("letters", 37))
DATASETS.register("emnist/mnist", _emnist("mnist", 10))


class Dataset(NamedTuple):
    """A labelled image dataset in host memory.

    Attributes:
      name: canonical name, e.g. ``"fashion_mnist"`` or ``"emnist/balanced"``.
      source: where the arrays came from: a folder of IDX files, ``"tfds:<name>"`` or an
        ``.npz`` cache path.
      train: ``{"x": uint8 [n, 28, 28] (cifar10: [n, 32, 32, 3]), "y": int32 [n]}``.
      test: the same for the held-out split.
      num_classes: number of classes C; every label is in ``[0, C)``.
    """

    name: str
    source: str
    train: dict
    test: dict
    num_classes: int


# --------------------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------------------

# IDX type codes (third magic byte) -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 24  # 16 MiB: bounds the transient copy while streaming into the array
_MAX_GZIP_RATIO = 1100  # above deflate's maximum expansion (~1032:1)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads one IDX file (the MNIST format), gzip-compressed or raw.

    Compression is detected from the gzip magic bytes, not from the file name. The data
    are streamed straight into the result array (no per-example Python loop, no second
    full-size copy).

    Args:
      path: the file.

    Returns:
      An array in native byte order with the shape the header declares.

    Raises:
      ValueError: bad magic number, unknown type code, or a payload whose size does not
        match the header exactly (truncated or over-long); the message names the path.
    """
    path = Path(path)
    with open(path, "rb") as raw:
        compressed = raw.read(2) == _GZIP_MAGIC
    if not compressed:
        with open(path, "rb") as f:
            return _read_idx_stream(f, path, compressed=False)
    try:
        with gzip.open(path, "rb") as f:
            return _read_idx_stream(f, path, compressed=True)
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        # A gzip stream cut short or corrupted: the same kind of error as a short raw file.
        raise ValueError(f"{path}: corrupt or truncated gzip stream ({err}).") from err


def _read_idx_stream(f: Any, path: Path, compressed: bool) -> np.ndarray:
    """Parses the header, then fills the array from the (decompressed) stream ``f``."""
    magic = f.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise ValueError(
            f"{path} is not an IDX file: magic number {magic.hex() or '(empty)'}; expected "
            "00 00 <type code> <ndim> with a type code in "
            f"{{{', '.join(f'0x{c:02X}' for c in _IDX_DTYPES)}}}."
        )
    dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
    dims_raw = f.read(4 * ndim)
    header_bytes = 4 + 4 * ndim
    if len(dims_raw) < 4 * ndim:
        raise ValueError(
            f"{path}: truncated IDX header: expected {header_bytes} header bytes, got "
            f"{4 + len(dims_raw)}."
        )
    shape = tuple(int(d) for d in np.frombuffer(dims_raw, dtype=">u4"))
    count = math.prod(shape)  # Python ints: a garbage header cannot overflow
    expected = header_bytes + count * dtype.itemsize
    # Check the size before allocating, so a garbage header cannot ask for terabytes.
    file_size = path.stat().st_size
    if not compressed and expected != file_size:
        kind = "truncated" if file_size < expected else "over-long"
        raise ValueError(
            f"{path}: {kind} IDX file: header {shape} {dtype.str} needs {expected} bytes, "
            f"the file has {file_size}."
        )
    if compressed and expected > _MAX_GZIP_RATIO * file_size + 1024:
        raise ValueError(
            f"{path}: IDX header {shape} {dtype.str} needs {expected} bytes, more than this "
            f"{file_size}-byte gzip file can hold (corrupt header or truncated file)."
        )
    out = np.empty(count, dtype=dtype)
    buf = memoryview(out).cast("B")
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got : got + _CHUNK])
        if not n:
            break
        got += n
    if got < len(buf):
        raise ValueError(
            f"{path}: truncated IDX file: header {shape} {dtype.str} needs {expected} bytes, "
            f"the file has {header_bytes + got}."
        )
    extra = 0
    while chunk := f.read(_CHUNK):
        extra += len(chunk)
    if extra:
        raise ValueError(
            f"{path}: over-long IDX file: header {shape} {dtype.str} needs {expected} bytes, "
            f"the file has {expected + extra}."
        )
    out = out.reshape(shape)
    return out if dtype.isnative or dtype.itemsize == 1 else out.astype(dtype.newbyteorder("="))


def _idx_candidates(prefix: str, split: str, kind: str) -> list[str]:
    """File names one IDX file may have (``kind`` is ``images-idx3`` or ``labels-idx1``)."""
    # MNIST / Fashion-MNIST call the test split t10k, the NIST EMNIST files call it test;
    # accept both, the distribution's own name first.
    if split == "train":
        splits = ("train",)
    else:
        splits = ("test", "t10k") if prefix.startswith("emnist") else ("t10k", "test")
    return [f"{prefix}{s}-{kind}-ubyte{ext}" for s in splits for ext in (".gz", "")]


def _find_idx_files(folder: Path, prefix: str) -> tuple[dict[str, Path] | None, list[str]]:
    """The four IDX files in ``folder``; ``(None, missing names)`` when any is absent."""
    found, missing = {}, []
    for split in ("train", "test"):
        for kind in ("images-idx3", "labels-idx1"):
            names = _idx_candidates(prefix, split, kind)
            hit = next((folder / n for n in names if (folder / n).is_file()), None)
            if hit is None:
                missing.append(" or ".join(f"{n}[.gz]" for n in names[1::2]))
            else:
                found[f"{split}-{kind}"] = hit
    return (found if not missing else None), missing


def load_idx_folder(
    folder: str | os.PathLike,
    name: str,
    num_classes: int,
    transpose: bool = False,
    prefix: str | None = None,
) -> Dataset:
    """Loads a dataset from the four standard IDX files in one folder.

    The files are ``{prefix}train-images-idx3-ubyte``, ``{prefix}train-labels-idx1-ubyte``
    and the test pair named ``t10k-...`` (MNIST, Fashion-MNIST) or ``test-...`` (EMNIST),
    each optionally gzipped (``.gz``).

    Args:
      folder: the folder.
      name: the dataset name, e.g. ``"fashion_mnist"`` or ``"emnist/balanced"``.
      num_classes: C; every label must be in ``[0, C)``.
      transpose: swap the two image axes (the NIST EMNIST files store images transposed).
      prefix: file-name prefix; default ``"emnist-<config>-"`` for ``emnist/<config>``
        names and ``""`` otherwise.

    Returns:
      The :class:`Dataset`, ``source`` being the folder.

    Raises:
      FileNotFoundError: a file is missing (the message lists which).
      ValueError: a malformed file, image and label counts that differ, or a label
        outside ``[0, num_classes)``.
    """
    folder = Path(folder)
    if prefix is None:
        prefix = f"emnist-{name.split('/', 1)[1]}-" if name.startswith("emnist/") else ""
    files, missing = _find_idx_files(folder, prefix)
    if files is None:
        raise FileNotFoundError(
            f"{folder} lacks the IDX files of {name}: missing {', '.join(missing)} "
            "(gzipped or raw)."
        )
    splits = {}
    for split in ("train", "test"):
        images_path = files[f"{split}-images-idx3"]
        labels_path = files[f"{split}-labels-idx1"]
        x, y = read_idx(images_path), read_idx(labels_path)
        if x.ndim != 3 or x.dtype != np.uint8:
            raise ValueError(
                f"{images_path}: expected uint8 images [n, rows, cols], got {x.dtype} {x.shape}."
            )
        if y.ndim != 1:
            raise ValueError(f"{labels_path}: expected labels [n], got shape {y.shape}.")
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{images_path} holds {x.shape[0]} images but {labels_path} holds "
                f"{y.shape[0]} labels; they must match."
            )
        _check_labels(y, num_classes, str(labels_path))
        if transpose:
            x = np.ascontiguousarray(x.transpose(0, 2, 1))
        splits[split] = {"x": x, "y": y.astype(np.int32)}
    return Dataset(name, str(folder), splits["train"], splits["test"], int(num_classes))


def _check_labels(y: np.ndarray, num_classes: int, where: str) -> None:
    if not np.issubdtype(y.dtype, np.integer):
        # Converting them to int32 would silently truncate 1.7 to 1.
        odd = np.flatnonzero(np.asarray(y, np.float64) != np.round(y)) if y.size else []
        i = int(odd[0]) if len(odd) else 0
        example = f" (label {y[i].item()!r} at index {i})" if y.size else ""
        raise ValueError(
            f"{where}: labels must be integer class indices, got {y.dtype} values{example}; "
            "store them as integers (IDX type code 0x08, unsigned bytes)."
        )
    if y.size == 0:
        return
    bad = (y < 0) | (y >= num_classes)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{where}: label {y[i]} at index {i} is outside [0, {num_classes}) "
            f"({int(bad.sum())} labels out of range)."
        )


# --------------------------------------------------------------------------------------
# TFDS and the npz cache
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# The one entry point
# --------------------------------------------------------------------------------------


def canonical_name(name: str) -> str:
    """``"Fashion-MNIST"`` -> ``"fashion_mnist"``, ``"emnist-balanced"`` -> ``"emnist/balanced"``.

    A name registered as it is (a plugin's dataset) is kept unchanged.

    Raises:
      ValueError: an unknown dataset.
    """
    if isinstance(name, str) and name in DATASETS:
        return name
    key = (
        name.strip()
        .lower()
        .replace("fashion-mnist", "fashion_mnist")
        .replace("cifar-10", "cifar10")
    )
    if key.startswith("emnist-") or key.startswith("emnist_"):
        key = "emnist/" + key[len("emnist-") :]
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}.")
    return key


def _idx_folders(root: Path, spec: DatasetSpec) -> Iterable[Path]:
    """A data dir's dataset-named sub-folders first (a root that holds several datasets
    must not serve MNIST files for Fashion-MNIST), then the folder itself."""
    for sub in spec.subdirs:
        yield root / sub
    yield root


def load(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    tfds_data_dir: str | os.PathLike | None = None,
    allow_download: bool = False,
    options: Mapping[str, Any] | None = None,
) -> Dataset:
    """Loads a dataset from wherever it already is; downloads only when allowed.

    A dataset registered with a loader of its own (:attr:`DatasetSpec.loader`) is that
    loader's: ``loader(data_dir, **options)``, its declared options completed with their
    defaults.

    A given ``data_dir`` is the one place looked at: its IDX files are loaded, or a
    FileNotFoundError names the folder and the files it lacks (never another copy from
    elsewhere). Without it, looks in order in: ``$SCAFFOLD_JAX_DATA_DIR``, the system
    folders (:data:`SYSTEM_DIRS`, e.g. Debian's ``/usr/share/datasets/fashion-mnist``), the
    ``.npz`` cache, a TFDS dataset already prepared in ``tfds_data_dir``, and finally (only
    with ``allow_download=True``) a TFDS download. In ``data_dir`` and the env folder the
    sub-folders named after the dataset (e.g. ``fashion-mnist/``, ``gzip/`` for NIST's
    EMNIST zip) are tried before the folder itself. An env or system folder without the
    files does not stop the search (the error lists it if nothing else has the data); a
    folder WITH the files but a malformed one raises at once. EMNIST images come back
    upright.

    Args:
      name: one of :data:`DATASETS` (aliases such as ``"fashion-mnist"`` are accepted).
      data_dir: a folder of IDX files.
      cache_dir: the ``.npz`` cache folder (default :func:`default_cache_dir`).
      tfds_data_dir: the TFDS data dir (default TFDS's own).
      allow_download: let TFDS download the dataset (needs internet).
      options: the values of the dataset's declared options (a loader's own).

    Returns:
      The :class:`Dataset`; its ``source`` says where it came from.

    Raises:
      FileNotFoundError: a given ``data_dir`` without the files (the message names the
        folder and the files), or nothing had the data (the message lists every place
        looked at and how to get the data).
      ValueError: an unknown name, or files that exist but are malformed.
    """
    name = canonical_name(name)
    spec = DATASETS[name]
    if spec.loader is not None:
        values = resolve_options(spec.options, options or {})
        return spec.loader(data_dir, **factory_kwargs(spec.options, values))
    looked: list[str] = []
    if data_dir is not None:
        # Given explicitly, it is used or refused: a folder without the files (a typo, a
        # half-copied download) must not silently load another copy from elsewhere.
        return _load_data_dir(name, spec, Path(data_dir).expanduser())

    env_dir = os.environ.get(ENV_DATA_DIR) or None
    folders: list[tuple[str, Path | None]] = []  # in search order; None: not configured
    for label, root, unset in (
        ("data_dir", data_dir, "not given"),
        (f"${ENV_DATA_DIR}", env_dir, "not set"),
    ):
        if root is None:
            folders.append((f"{label} ({unset})", None))
        else:
            folders += [(label, f) for f in _idx_folders(Path(root).expanduser(), spec)]
    folders += [("system folder", Path(d)) for d in SYSTEM_DIRS.get(name, ())]
    if spec.idx_prefix is not None:
        for label, folder in folders:
            if folder is None:
                looked.append(label)
                continue
            files, missing = _find_idx_files(folder, spec.idx_prefix)
            if files is None:
                why = "does not exist" if not folder.is_dir() else f"no {missing[0]}"
                looked.append(f"{label} {folder} ({why})")
                continue
            # Malformed files raise here on purpose: better than silently using other data.
            return load_idx_folder(
                folder, name, spec.num_classes, spec.transposed, prefix=spec.idx_prefix
            )
    else:
        looked.extend(
            f"{label} {f} (no IDX distribution for {name})" if f else label for label, f in folders
        )

    path = cache_path(name, cache_dir)
    cached = _load_cache(path, name)
    if cached is not None:
        return cached
    looked.append(f"npz cache {path} ({'stale, ignored' if path.is_file() else 'absent'})")

    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        looked.append("TFDS (tensorflow-datasets is not installed)")
    else:
        try:
            return load_tfds(name, tfds_data_dir, cache_dir, download=allow_download)
        except FileNotFoundError as err:
            looked.append(f"TFDS ({err})")
    raise DatasetNotFoundError(name, spec, looked, allow_download)


def _load_data_dir(name: str, spec: DatasetSpec, root: Path) -> Dataset:
    """The dataset from the IDX files in ``root`` (or its dataset-named sub-folders).

    Raises:
      FileNotFoundError: ``root`` is not a folder, the dataset has no IDX distribution,
        or no candidate folder holds all four files (naming the files missing from the
        one that holds the most of them).
    """
    unset = f"or leave data_dir unset to search ${ENV_DATA_DIR}, the system folders and the cache"
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(
            f"data_dir {root} {what}; pass the folder that holds the IDX files of {name}, {unset}."
        )
    if spec.idx_prefix is None:
        raise FileNotFoundError(
            f"data_dir {root} was given, but {name} has no IDX files to read from a folder; "
            "leave data_dir unset to load it from the .npz cache or TFDS (download=True / "
            "--download fetches it)."
        )
    closest = None  # (folder, missing names) of the candidate with the most files
    for folder in _idx_folders(root, spec):
        files, missing = _find_idx_files(folder, spec.idx_prefix)
        if files is not None:
            return load_idx_folder(
                folder, name, spec.num_classes, spec.transposed, prefix=spec.idx_prefix
            )
        if folder.is_dir() and (closest is None or len(missing) <= len(closest[1])):
            closest = (folder, missing)
    folder, missing = closest
    lead = f"data_dir {root}" if folder == root else f"data_dir {root} (its sub-folder {folder})"
    others = [str(f) for f in _idx_folders(root, spec) if f != folder]
    also = f" (also looked in {', '.join(others)})" if others else ""
    raise FileNotFoundError(
        f"{lead} lacks the IDX files of {name}: missing {', '.join(missing)} (gzipped or "
        f"raw){also}; put them there, {unset}."
    )


class DatasetNotFoundError(FileNotFoundError):
    """No place had the dataset. ``str(err)`` lists every place looked at and the ways to
    get the data in the API's terms (``allow_download=True``, ``data_dir=...``);
    :meth:`for_cli` says the same in the command line's (``--download``, ``--data-dir``)."""

    def __init__(self, name: str, spec: DatasetSpec, looked: list[str], allow_download: bool):
        self.details = (name, spec, list(looked), allow_download)
        super().__init__(_not_found_message(*self.details, cli=False))

    def for_cli(self) -> str:
        return _not_found_message(*self.details, cli=True)


def _not_found_message(
    name: str, spec: DatasetSpec, looked: list[str], allow_download: bool, cli: bool
) -> str:
    data_dir = "--data-dir" if cli else "data_dir=..."
    lines = [f"could not find the {name} dataset. Looked in:"]
    lines += [f"  - {place}" for place in looked]
    # Only the ways that apply to this dataset, numbered.
    ways = []
    if spec.idx_prefix is not None:
        files = ", ".join(
            _idx_candidates(spec.idx_prefix, split, kind)[0]
            for split in ("train", "test")
            for kind in ("images-idx3", "labels-idx1")
        )
        apt = (
            "`apt-get install dataset-fashion-mnist` (installs /usr/share/datasets/"
            "fashion-mnist), or "
            if name == "fashion_mnist"
            else ""
        )
        ways.append(
            f"{apt}place the IDX files ({files}) in a folder and pass it as {data_dir} or "
            f"set {ENV_DATA_DIR}"
        )
    ways.append(
        "go online and let TFDS download it: "
        + ("--download" if cli else "load(..., allow_download=True)")
        + (" (download was not allowed this time)" if not allow_download else "")
    )
    if name.startswith("emnist/"):
        ways.append(
            f"download gzip.zip from {NIST_EMNIST_URL}, unzip it into a folder (it unpacks "
            f"into gzip/) and pass that folder as {data_dir}"
        )
    lines.append("Ways to get it:" if len(ways) > 1 else "The way to get it:")
    lines += [f"  ({i}) {way}{'.' if i == len(ways) else ';'}" for i, way in enumerate(ways, 1)]
    return "\n".join(lines)
