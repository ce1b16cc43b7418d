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

import gzip
import math
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from scaffold_jax.data.sources_registry import (
    DATASETS,
    Dataset,
    DatasetSpec,
    _check_labels,
    canonical_name,
)
from scaffold_jax.data.sources_tfds import DOWNLOAD_RETRIES as DOWNLOAD_RETRIES
from scaffold_jax.data.sources_tfds import ENV_CACHE_DIR as ENV_CACHE_DIR
from scaffold_jax.data.sources_tfds import _download_paths as _download_paths
from scaffold_jax.data.sources_tfds import _load_cache, cache_path, load_tfds
from scaffold_jax.data.sources_tfds import _remove_new_paths as _remove_new_paths
from scaffold_jax.data.sources_tfds import default_cache_dir as default_cache_dir
from scaffold_jax.registry import factory_kwargs, resolve_options

ENV_DATA_DIR = "SCAFFOLD_JAX_DATA_DIR"
NIST_EMNIST_URL = "https://www.nist.gov/itl/products-and-services/emnist-dataset"

# Folders that OS packages install datasets into (tests monkeypatch this).
SYSTEM_DIRS: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("/usr/share/datasets/fashion-mnist",),
}


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
    if data_dir is not None:
        # Given explicitly, it is used or refused: a folder without the files (a typo, a
        # half-copied download) must not silently load another copy from elsewhere.
        return _load_data_dir(name, spec, Path(data_dir).expanduser())

    env_dir = os.environ.get(ENV_DATA_DIR)
    folders: list[tuple[str, Path | None]] = [("data_dir (not given)", None)]  # None: unset
    if env_dir:
        folders += [(f"${ENV_DATA_DIR}", f) for f in _idx_folders(Path(env_dir).expanduser(), spec)]
    else:
        folders.append((f"${ENV_DATA_DIR} (not set)", None))
    folders += [("system folder", Path(d)) for d in SYSTEM_DIRS.get(name, ())]
    looked: list[str] = []
    for label, folder in folders:
        if folder is None or spec.idx_prefix is None:
            looked.append(f"{label} {folder} (no IDX distribution for {name})" if folder else label)
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
