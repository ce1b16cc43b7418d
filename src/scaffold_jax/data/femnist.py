"""Federated EMNIST (FEMNIST): one client per writer, from files the user already has.

Caldas et al. (2018), "LEAF: A Benchmark for Federated Settings", group the handwritten
digits and letters of NIST Special Database 19 by writer (EMNIST's 62 classes: labels
0-9 digits, 10-35 upper case, 36-61 lower case; LEAF's ``relabel_class``). Nothing here
downloads anything; two file formats are read:

* LEAF's JSON (``data/femnist/data/{train,test}/*.json`` after LEAF's ``preprocess.sh``,
  e.g. ``-s niid --sf 1.0 -k 0 -t sample``): every file is ``{"users": [...],
  "num_samples": [...], "user_data": {user: {"x": [[784 floats], ...], "y": [ints]}}}``;
  a writer's train and test examples are in files of the same name in ``train/`` and
  ``test/`` (LEAF's per-sample split). :func:`read_leaf_folder` reads one folder.
* TFF's HDF5 (``fed_emnist_train.h5`` / ``fed_emnist_test.h5``, or the
  ``fed_emnist_digitsonly_*`` pair with 10 classes; the files of
  ``tff.simulation.datasets.emnist.load_data`` before TFF moved to SQLite): a group
  ``examples`` with one sub-group per client id (``f0000_14``) holding ``pixels``
  ``[n, 28, 28]`` float32 and ``label`` ``[n]`` int; TFF's HDF5ClientData lists the
  clients sorted. Reading them needs ``h5py`` (``pip install 'scaffold-jax[femnist]'``).

**Orientation: no transpose.** LEAF builds its images from NIST's PNG files (``PIL``
image, 28x28 thumbnail, flattened row by row), not from the EMNIST IDX files that store
every image transposed, and TFF's files are LEAF's images reshaped to ``[28, 28]``: both
are already upright (MNIST orientation, the convention of :mod:`scaffold_jax.data.sources`).
A LEAF vector is reshaped row-major, ``x.reshape(28, 28)``.

**Pixel values.** Both store ``gray / 255`` with 1.0 for the white background and 0.0 for
the ink (TFF's documentation: "the value of 1.0 corresponds to the background"), the
inverse of MNIST. ``pixels="uint8"`` (default) returns MNIST-like uint8 images,
``round((1 - v) * 255)``: 0 background, 255 ink, exact for LEAF's ``k / 255`` values, as
the other image datasets of this package (models divide integer pixels by 255).
``pixels="float32"`` returns the stored values unchanged.

Clients keep their own test examples (a writer absent from the test files gets none);
test writers without training examples (LEAF's ``-t user`` split) are left out with a
warning. Reading LEAF's JSON is slow (gigabytes of text), so the result is cached as an
``.npz`` under the cache folder of :mod:`scaffold_jax.data.sources`, keyed by the files'
names, sizes and modification times and the parameters; ``min_examples`` is applied after
the cache.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from scaffold_jax.data import natural

NUM_CLASSES = 62
DIGITS_CLASSES = 10
IMAGE_SHAPE = (28, 28)
TFF_FILES = {
    False: ("fed_emnist_train.h5", "fed_emnist_test.h5"),
    True: ("fed_emnist_digitsonly_train.h5", "fed_emnist_digitsonly_test.h5"),
}
_BUILD_VERSION = 1


def convert_pixels(values: Any, pixels: str = "uint8", where: str = "") -> np.ndarray:
    """LEAF/TFF pixel values (floats in [0, 1], background 1.0) as returned by
    :func:`load`: ``"uint8"`` MNIST-like ``round((1 - v) * 255)``, ``"float32"`` unchanged.

    Raises:
      ValueError: a value outside [0, 1] or not finite; an unknown ``pixels``.
    """
    v = np.asarray(values, dtype=np.float32)
    if v.size:
        lo, hi = float(v.min()), float(v.max())
        if not (np.isfinite(lo) and np.isfinite(hi) and lo >= 0.0 and hi <= 1.0):
            raise ValueError(
                f"{where}: pixel values must be finite and in [0, 1] (LEAF's gray / 255), got "
                f"values in [{lo}, {hi}]."
            )
    if pixels == "float32":
        return v
    if pixels == "uint8":
        return np.rint((1.0 - v) * 255.0).astype(np.uint8)
    raise ValueError(f"pixels = {pixels!r} is unknown; use 'uint8' or 'float32'.")


def _labels(y: Any, num_classes: int, where: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"{where}: labels must be [n], got shape {y.shape}.")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not np.all(np.asarray(y, np.float64) == np.round(y)):
            raise ValueError(f"{where}: labels must be integers, got {y.dtype} values.")
    y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"{where}: labels must be in [0, {num_classes}), got [{y.min()}, {y.max()}]."
        )
    return y.astype(np.int32)


# --------------------------------------------------------------------------------------
# LEAF JSON
# --------------------------------------------------------------------------------------


def read_leaf_folder(
    folder: str | os.PathLike, pixels: str = "uint8", num_classes: int = NUM_CLASSES
) -> dict[str, dict]:
    """Every user's examples in the LEAF JSON files of ``folder`` (``*.json``, sorted).

    Returns:
      ``{user: {"x": [n, 28, 28], "y": int32 [n]}}``; a user found in several files gets
      their examples concatenated in file order.

    Raises:
      FileNotFoundError: no JSON file in ``folder``.
      ValueError: a file not in LEAF's format (the message names it).
    """
    folder = Path(folder)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no LEAF .json files.")
    out: dict[str, list[dict]] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON ({err}).") from err
        if not isinstance(data, dict) or "user_data" not in data or "users" not in data:
            raise ValueError(f"{path} is not a LEAF file: it lacks 'users' / 'user_data'.")
        for user in data["users"]:
            record = data["user_data"].get(user)
            if record is None:
                raise ValueError(f"{path}: user {user!r} is listed but has no user_data.")
            where = f"{path} user {user!r}"
            x = np.asarray(record["x"], dtype=np.float32)
            if x.size == 0:
                x = x.reshape(0, 28 * 28)
            if x.ndim != 2 or x.shape[1] != 28 * 28:
                raise ValueError(f"{where}: x must be [n, 784], got shape {x.shape}.")
            y = _labels(record["y"], num_classes, where)
            if len(y) != len(x):
                raise ValueError(f"{where}: {len(x)} images but {len(y)} labels.")
            # Row-major reshape: LEAF flattened each PIL image row by row (upright).
            images = convert_pixels(x.reshape(-1, *IMAGE_SHAPE), pixels, where)
            out.setdefault(str(user), []).append({"x": images, "y": y})
        del data
    return {u: _concat_parts(parts) for u, parts in out.items()}


def _concat_parts(parts: list[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("x", "y")}


def _leaf_dirs(data_dir: Path) -> tuple[Path, Path] | None:
    for root in (data_dir, data_dir / "data"):
        train, test = root / "train", root / "test"
        if train.is_dir() and any(train.glob("*.json")):
            return train, test
    return None


# --------------------------------------------------------------------------------------
# TFF HDF5
# --------------------------------------------------------------------------------------


def _h5py():
    try:
        import h5py
    except ImportError as err:
        raise ImportError(
            "reading TFF's FEMNIST .h5 files needs h5py: pip install 'scaffold-jax[femnist]' "
            "(or pip install h5py)."
        ) from err
    return h5py


def read_tff_h5(
    path: str | os.PathLike, pixels: str = "uint8", num_classes: int = NUM_CLASSES
) -> dict[str, dict]:
    """Every client's examples in one TFF HDF5 file (``examples/<id>/{pixels,label}``).

    Returns:
      ``{client_id: {"x": [n, 28, 28], "y": int32 [n]}}`` in sorted client order.
    """
    h5py = _h5py()
    path = Path(path)
    out = {}
    try:
        with h5py.File(path, "r") as f:
            if "examples" not in f:
                raise ValueError(f"{path} is not a TFF federated file: no 'examples' group.")
            group = f["examples"]
            for cid in sorted(group.keys()):
                where = f"{path} client {cid!r}"
                client = group[cid]
                if "pixels" not in client or "label" not in client:
                    raise ValueError(f"{where}: expected datasets 'pixels' and 'label'.")
                x = np.asarray(client["pixels"][()], dtype=np.float32)
                if x.ndim != 3 or x.shape[1:] != IMAGE_SHAPE:
                    raise ValueError(f"{where}: pixels must be [n, 28, 28], got {x.shape}.")
                y = _labels(client["label"][()], num_classes, where)
                if len(y) != len(x):
                    raise ValueError(f"{where}: {len(x)} images but {len(y)} labels.")
                out[str(cid)] = {"x": convert_pixels(x, pixels, where), "y": y}
    except FileNotFoundError:
        raise
    except OSError as err:  # h5py's own message names no file ("file signature not found")
        raise ValueError(
            f"{path} is not a readable HDF5 file ({err}): it is corrupt or truncated; "
            "replace it with TFF's file (download it again)."
        ) from err
    return out


def _tff_files(data_dir: Path, only_digits: bool | None) -> tuple[Path, Path, bool] | None:
    if data_dir.is_file():
        name = data_dir.name
        if "_train" not in name:
            raise ValueError(f"{data_dir}: give the *_train.h5 file (its *_test.h5 beside it).")
        return data_dir, data_dir.with_name(name.replace("_train", "_test")), "digitsonly" in name
    choices = [False, True] if only_digits is None else [bool(only_digits)]
    for digits in choices:
        train, test = (data_dir / n for n in TFF_FILES[digits])
        if train.is_file():
            return train, test, digits
    return None


# --------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------


def _fingerprint(files: Iterable[Path]) -> list:
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def load(
    data_dir: str | os.PathLike,
    *,
    format: str = "auto",
    only_digits: bool | None = None,
    pixels: str = "uint8",
    min_examples: int = 1,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> natural.ClientDataset:
    """FEMNIST by writer, each writer with their own test examples.

    Args:
      data_dir: a LEAF data folder (holding ``train/`` and ``test/`` with ``*.json``, or
        ``data/train`` ...), a folder with TFF's ``fed_emnist_train.h5`` and
        ``fed_emnist_test.h5`` (or the ``digitsonly`` pair), or the ``*_train.h5`` file.
      format: ``"auto"``, ``"leaf"`` or ``"tff"``.
      only_digits: TFF: read the digits-only pair (10 classes); None prefers the full one.
      pixels: ``"uint8"`` (MNIST-like, 0 background, 255 ink) or ``"float32"`` (as stored:
        1.0 background); see the module docstring.
      min_examples: drop writers with fewer training examples (>= 1).
      cache_dir: the cache folder (default :func:`scaffold_jax.data.sources.default_cache_dir`).
      use_cache: read and write the ``.npz`` cache.

    Returns:
      A :class:`~scaffold_jax.data.natural.ClientDataset`: ``x`` ``[n, 28, 28]`` upright,
      ``y`` int32, clients sorted by id, ``num_classes`` 62 (10 for digits only).

    Raises:
      FileNotFoundError: no FEMNIST files in ``data_dir``, or a training split without
        its test split (the message names the folder or file missing).
      ImportError: HDF5 files but no h5py.
      ValueError: malformed files (the message names the file).
    """
    if format not in ("auto", "leaf", "tff"):
        raise ValueError(f"format = {format!r} is unknown; use 'auto', 'leaf' or 'tff'.")
    if pixels not in ("uint8", "float32"):
        raise ValueError(f"pixels = {pixels!r} is unknown; use 'uint8' or 'float32'.")
    if isinstance(min_examples, bool) or int(min_examples) != min_examples or min_examples < 1:
        raise ValueError(f"min_examples = {min_examples!r} must be an integer >= 1.")
    data_dir = Path(data_dir).expanduser()
    if not data_dir.exists():
        raise FileNotFoundError(f"{data_dir} does not exist.")
    leaf = _leaf_dirs(data_dir) if format in ("auto", "leaf") and data_dir.is_dir() else None
    tff = _tff_files(data_dir, only_digits) if format in ("auto", "tff") and leaf is None else None
    if leaf is None and tff is None:
        raise FileNotFoundError(
            f"{data_dir} holds no FEMNIST files: expected LEAF's train/*.json and test/*.json "
            f"(data/femnist/data after LEAF's preprocess.sh) or TFF's {TFF_FILES[False][0]} "
            f"and {TFF_FILES[False][1]}."
        )
    if leaf is not None:
        kind, num_classes = "leaf", NUM_CLASSES
        train_src, test_src = leaf
        files = sorted(train_src.glob("*.json")) + sorted(test_src.glob("*.json"))
    else:
        train_src, test_src, digits = tff
        kind, num_classes = "tff", DIGITS_CLASSES if digits else NUM_CLASSES
        files = [p for p in (train_src, test_src) if p.is_file()]
    key = natural.digest(
        {"build": _BUILD_VERSION, "format": kind, "pixels": pixels, "num_classes": num_classes},
        _fingerprint(files),
    )
    if not (test_src.is_dir() if kind == "leaf" else test_src.is_file()):
        # Runs evaluate every writer on their own test examples: no silent empty test set.
        what = "LEAF's test/*.json" if kind == "leaf" else f"TFF's {test_src.name}"
        raise FileNotFoundError(
            f"{test_src} does not exist: FEMNIST's test split ({what}) belongs beside the "
            f"training split {train_src}. Put it there, or pass --data-dir (data_dir) a "
            "folder that holds both splits."
        )
    cache = natural.cache_file("femnist", key, cache_dir)
    ds = natural.load_clients(cache, key) if use_cache else None
    if ds is None:
        if kind == "leaf":
            train = read_leaf_folder(train_src, pixels, num_classes)
            test = read_leaf_folder(test_src, pixels, num_classes)
        else:
            train = read_tff_h5(train_src, pixels, num_classes)
            test = read_tff_h5(test_src, pixels, num_classes)
        if not test:
            raise ValueError(
                f"{test_src} holds no test writers: FEMNIST's test split must hold the "
                "writers' test examples; replace it with the one made with the training split."
            )
        ds = _combine(
            train,
            test,
            kind,
            f"{kind}:{train_src.parent if kind == 'leaf' else train_src}",
            num_classes,
            pixels,
        )
        if use_cache:
            natural.save_clients(cache, key, ds)
    keep = ds.train_counts >= int(min_examples)
    if not keep.any():
        raise ValueError(f"no writer has min_examples = {min_examples} training examples.")
    if not keep.all():
        ds = ds.select(keep)
    return ds._replace(
        info={
            **ds.info,
            "min_examples": int(min_examples),
            "dropped_min_examples": int((~keep).sum()),
        }
    )


def _combine(
    train: dict[str, dict],
    test: dict[str, dict],
    kind: str,
    source: str,
    num_classes: int,
    pixels: str,
) -> natural.ClientDataset:
    ids = sorted(u for u, d in train.items() if len(d["y"]) > 0)
    if not ids:
        raise ValueError(f"{source}: no writer has training examples.")
    test_only = sorted(set(test) - set(ids))
    if test_only:
        warnings.warn(
            f"{len(test_only)} FEMNIST test writers have no training examples (a LEAF split "
            f"by user, -t user?) and are left out, e.g. {test_only[:3]}; per-writer test "
            "examples need LEAF's -t sample split.",
            stacklevel=3,
        )
    dtype = np.uint8 if pixels == "uint8" else np.float32
    empty = {"x": np.zeros((0, *IMAGE_SHAPE), dtype), "y": np.zeros((0,), np.int32)}
    return natural.from_client_splits(
        "femnist",
        source,
        ids,
        [train[u] for u in ids],
        [test.get(u, empty) for u in ids],
        num_classes,
        {
            "format": kind,
            "pixels": pixels,
            "test_only_writers_dropped": len(test_only),
            "writers_without_test": sum(1 for u in ids if u not in test),
        },
    )


def _load(data_dir=None, **options) -> natural.ClientDataset:
    if data_dir is None:
        raise FileNotFoundError(
            "femnist needs data_dir (--data-dir): a LEAF data folder (with train/ and test/ "
            "JSON folders) or a folder with TFF's fed_emnist_train.h5 / fed_emnist_test.h5."
        )
    return load(data_dir, **options)


natural.NATURAL_DATASETS.register(
    "femnist",
    natural.NaturalSpec(
        _load,
        True,
        "federated EMNIST by writer (62 classes): LEAF JSON or TFF HDF5 files in data_dir",
        natural.MIN_CLIENT_EXAMPLES,
    ),
)
