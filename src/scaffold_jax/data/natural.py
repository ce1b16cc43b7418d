"""Naturally federated datasets: the clients come with the data.

Partitioners (:mod:`scaffold_jax.data.partition`) split ONE pooled dataset from its labels
alone. A naturally federated dataset already says which example belongs to whom (a
speaking role of a play, the writer of a character), and each client has its own held-out
test examples. :class:`ClientDataset` holds such data in host memory; the loaders are

* :func:`scaffold_jax.data.shakespeare.load`: LEAF's Shakespeare (Caldas et al. 2018), one
  client per speaking role, next-character prediction;
* :func:`scaffold_jax.data.femnist.load`: federated EMNIST by writer, from LEAF's JSON
  files or TFF's HDF5 files.

:data:`NATURAL_DATASETS` names them (``"shakespeare"``, ``"femnist"``) for configs and the
command line; :func:`load` looks a name up. From a :class:`ClientDataset`:

* :func:`to_federated` gives the :class:`~scaffold_jax.data.federated.FederatedData` of
  the training clients (their test examples pooled into its ``test``) and the per-client
  test arrays;
* :func:`as_dataset` gives the pooled :class:`~scaffold_jax.data.sources.Dataset` (train
  rows client by client) and :func:`client_indices` its natural partition, for code that
  works on a pooled dataset plus a partition (``from_partition``, ``partition.summary``).

Why ``natural`` is not a :data:`~scaffold_jax.data.partition.PARTITIONERS` entry: a
partitioner is called as ``split(labels, num_clients, seed=...)``; the clients of a natural
dataset cannot be recovered from its labels, and their number is the data's, not a
config's. Use :func:`client_indices` instead.

Caches: loaders that parse slow sources write an ``.npz`` under the cache folder of
:mod:`scaffold_jax.data.sources` (``$SCAFFOLD_JAX_CACHE_DIR``, else
``~/.cache/scaffold_jax``), named after the dataset and a digest of the source's content
and the parameters, written atomically; an unreadable cache file is ignored with a warning
and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from scaffold_jax.data import sources
from scaffold_jax.data.federated import FederatedData, from_partition
from scaffold_jax.registry import Option, Registry

logger = logging.getLogger(__name__)

# Bumped whenever the layout of the client caches changes: an old file is then ignored.
CACHE_FORMAT = 1


class ClientDataset(NamedTuple):
    """Examples of naturally federated clients, each with its own train and test split.

    The examples are flat arrays ordered client by client: client i's training examples
    are rows ``train_offsets[i] : train_offsets[i] + train_counts[i]`` of every leaf of
    ``train`` (likewise for ``test``).

    Attributes:
      name: the dataset, e.g. ``"shakespeare"``.
      source: where the examples came from (files, or a cache file "(cache of ...)").
      client_ids: N client names, e.g. ``"HAMLET__PRINCE_OF_DENMARK_HAM"``, ``"f0000_14"``.
      train: ``{"x": [n_train, ...], "y": [n_train]}``.
      train_counts: ``[N]`` int64, every entry >= 1.
      test: ``{"x": [n_test, ...], "y": [n_test]}`` (same trailing shapes and dtypes).
      test_counts: ``[N]`` int64 (0 for a client without test examples).
      num_classes: C; every label is in ``[0, C)``.
      info: how it was built (parameters, vocabulary, what was dropped).
    """

    name: str
    source: str
    client_ids: tuple[str, ...]
    train: dict
    train_counts: np.ndarray
    test: dict
    test_counts: np.ndarray
    num_classes: int
    info: dict

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    @property
    def train_offsets(self) -> np.ndarray:
        return _offsets(self.train_counts)

    @property
    def test_offsets(self) -> np.ndarray:
        return _offsets(self.test_counts)

    def train_client(self, i: int) -> dict:
        """Client ``i``'s training examples (views, no copy)."""
        start = int(self.train_offsets[i])
        return {k: v[start : start + int(self.train_counts[i])] for k, v in self.train.items()}

    def test_client(self, i: int) -> dict:
        """Client ``i``'s test examples (views, no copy; possibly empty)."""
        start = int(self.test_offsets[i])
        return {k: v[start : start + int(self.test_counts[i])] for k, v in self.test.items()}

    def client_tests(self) -> list[dict]:
        """Every client's test examples, in client order (views)."""
        return [self.test_client(i) for i in range(self.num_clients)]

    def index(self, client_id: str) -> int:
        """The position of ``client_id``."""
        try:
            return self.client_ids.index(client_id)
        except ValueError:
            raise KeyError(f"{self.name} has no client {client_id!r}.") from None

    def select(self, keep: Sequence[int] | np.ndarray) -> ClientDataset:
        """The clients at positions ``keep`` (a boolean mask or indices), in that order."""
        keep = np.asarray(keep)
        if keep.dtype == bool:
            keep = np.flatnonzero(keep)
        keep = keep.astype(np.int64)
        train_rows = _rows(self.train_offsets, self.train_counts, keep)
        test_rows = _rows(self.test_offsets, self.test_counts, keep)
        return self._replace(
            client_ids=tuple(self.client_ids[i] for i in keep),
            train={k: v[train_rows] for k, v in self.train.items()},
            train_counts=self.train_counts[keep],
            test={k: v[test_rows] for k, v in self.test.items()},
            test_counts=self.test_counts[keep],
        )

    def summary(self) -> str:
        """Clients and examples per client (min / median / max, total), train and test."""

        def stats(a: np.ndarray) -> str:
            if a.size == 0:
                return "none"
            return f"min {a.min()}, median {np.median(a):g}, max {a.max()}, total {a.sum()}"

        return (
            f"{self.name}: {self.num_clients} clients, {self.num_classes} classes\n"
            f"  train examples per client: {stats(self.train_counts)}\n"
            f"  test examples per client:  {stats(self.test_counts)}"
        )


class NaturalFederated(NamedTuple):
    """What :func:`to_federated` returns.

    Attributes:
      data: the training clients; ``data.test`` is every client's test examples pooled
        (None when no client has any).
      client_test: client i's own test examples, ``{"x", "y"}`` numpy arrays (views).
      num_classes: C (for Shakespeare: the vocabulary size).
      client_ids: N client names, in the order of ``data``'s clients.
    """

    data: FederatedData
    client_test: list[dict]
    num_classes: int
    client_ids: tuple[str, ...]


def to_federated(ds: ClientDataset) -> NaturalFederated:
    """The :class:`FederatedData` of ``ds``'s training clients, plus their own test arrays.

    Examples:
      >>> ds = from_client_splits("toy", "doc", ["a", "b"],
      ...     [{"x": np.zeros((2, 3)), "y": np.zeros(2, np.int32)},
      ...      {"x": np.ones((4, 3)), "y": np.ones(4, np.int32)}],
      ...     [{"x": np.zeros((1, 3)), "y": np.zeros(1, np.int32)},
      ...      {"x": np.ones((0, 3)), "y": np.ones(0, np.int32)}], num_classes=2)
      >>> fed = to_federated(ds)
      >>> fed.data.counts.tolist(), len(fed.data.test["y"]), len(fed.client_test[1]["y"])
      ([2, 4], 1, 0)
    """
    test = ds.test if int(ds.test_counts.sum()) > 0 else None
    data = from_partition(ds.train, client_indices(ds), test=test)
    return NaturalFederated(data, ds.client_tests(), int(ds.num_classes), ds.client_ids)


def client_indices(ds: ClientDataset) -> list[np.ndarray]:
    """The natural partition of the pooled training rows of ``ds`` (see
    :func:`as_dataset`): client i holds rows ``offsets[i] : offsets[i] + counts[i]``."""
    offsets = ds.train_offsets
    return [
        np.arange(o, o + c, dtype=np.int64)
        for o, c in zip(offsets.tolist(), ds.train_counts.tolist(), strict=True)
    ]


def as_dataset(ds: ClientDataset) -> sources.Dataset:
    """``ds`` pooled into a :class:`~scaffold_jax.data.sources.Dataset` (train rows client
    by client, test rows likewise); pair it with :func:`client_indices`."""
    return sources.Dataset(ds.name, ds.source, ds.train, ds.test, int(ds.num_classes))


def from_client_splits(
    name: str,
    source: str,
    client_ids: Sequence[str],
    train: Sequence[Mapping[str, np.ndarray]],
    test: Sequence[Mapping[str, np.ndarray]],
    num_classes: int,
    info: Mapping[str, Any] | None = None,
) -> ClientDataset:
    """A :class:`ClientDataset` from per-client ``{"x", "y"}`` arrays (train non-empty)."""
    if not (len(client_ids) == len(train) == len(test)):
        raise ValueError(
            f"{len(client_ids)} client ids, {len(train)} train and {len(test)} test splits: "
            "they must be equally many."
        )
    if len(set(client_ids)) != len(client_ids):
        raise ValueError("client ids must be distinct.")
    train_counts = np.asarray([len(t["y"]) for t in train], dtype=np.int64)
    test_counts = np.asarray([len(t["y"]) for t in test], dtype=np.int64)
    if train_counts.size and train_counts.min() == 0:
        bad = client_ids[int(np.argmin(train_counts))]
        raise ValueError(f"client {bad!r} has no training examples.")
    return ClientDataset(
        name,
        source,
        tuple(client_ids),
        _concat(train),
        train_counts,
        _concat(test),
        test_counts,
        int(num_classes),
        dict(info or {}),
    )


def _concat(parts: Sequence[Mapping[str, np.ndarray]]) -> dict:
    if not parts:
        return {"x": np.zeros((0,)), "y": np.zeros((0,), np.int32)}
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in parts[0]}


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _rows(offsets: np.ndarray, counts: np.ndarray, keep: np.ndarray) -> np.ndarray:
    if keep.size == 0:
        return np.zeros(0, np.int64)
    return np.concatenate(
        [np.arange(offsets[i], offsets[i] + counts[i], dtype=np.int64) for i in keep]
    )


# --------------------------------------------------------------------------------------
# Cache files
# --------------------------------------------------------------------------------------


def digest(*parts: Any) -> str:
    """A hex SHA-256 of JSON-able ``parts`` (parameters) and bytes (file contents)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, bytes | bytearray | memoryview):
            h.update(b"B")
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        else:
            text = json.dumps(part, sort_keys=True, default=str).encode()
            h.update(b"J")
            h.update(len(text).to_bytes(8, "little"))
            h.update(text)
    return h.hexdigest()


def cache_file(name: str, key: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache dir>/<name>-<key[:16]>.npz`` (the cache folder of :mod:`sources`)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else sources.default_cache_dir()
    return root / f"{name}-{key[:16]}.npz"


def write_npz(path: Path, arrays: Mapping[str, Any]) -> None:
    """Writes ``arrays`` uncompressed and atomically (temporary file + rename); an
    unwritable cache folder only logs a warning."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home must not make the data unusable
        logger.warning("could not write the cache %s: %s", path, err)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_npz(path: Path, key: str) -> dict | None:
    """The arrays of a cache file written with ``key``, or None when it is absent, stale
    (another format or key) or unreadable (a warning names it; the caller rebuilds)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != CACHE_FORMAT or str(z["key"]) != key:
                logger.warning("ignoring stale cache %s (format or key mismatch)", path)
                return None
            return {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, zlib.error) as err:
        warnings.warn(
            f"ignoring the unreadable dataset cache {path} ({type(err).__name__}: {err}); it "
            "is rebuilt from the source.",
            stacklevel=3,
        )
        return None


def save_clients(path: Path, key: str, ds: ClientDataset) -> None:
    """Caches a :class:`ClientDataset` (flat arrays, counts, ids, info as JSON)."""
    write_npz(
        path,
        {
            "format": np.int64(CACHE_FORMAT),
            "key": np.str_(key),
            "name": np.str_(ds.name),
            "origin": np.str_(ds.source),
            "num_classes": np.int64(ds.num_classes),
            "client_ids": np.asarray(ds.client_ids, dtype=np.str_),
            "train_x": ds.train["x"],
            "train_y": ds.train["y"],
            "train_counts": ds.train_counts,
            "test_x": ds.test["x"],
            "test_y": ds.test["y"],
            "test_counts": ds.test_counts,
            "info": np.str_(json.dumps(ds.info, default=str)),
        },
    )


def load_clients(path: Path, key: str) -> ClientDataset | None:
    """The :class:`ClientDataset` cached by :func:`save_clients`, or None."""
    z = read_npz(path, key)
    if z is None:
        return None
    return ClientDataset(
        str(z["name"]),
        f"{path} (cache of {z['origin']})",
        tuple(str(c) for c in z["client_ids"]),
        {"x": z["train_x"], "y": z["train_y"]},
        z["train_counts"].astype(np.int64),
        {"x": z["test_x"], "y": z["test_y"]},
        z["test_counts"].astype(np.int64),
        int(z["num_classes"]),
        json.loads(str(z["info"])),
    )


# --------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------


class NaturalSpec(NamedTuple):
    """A registered naturally federated dataset.

    Attributes:
      load: ``load(data_dir, *, cache_dir=None, **options) -> ClientDataset``; ``data_dir``
        is the folder or file the user gave (``--data-dir``), or None.
      needs_data_dir: the data cannot be found without ``data_dir``.
      description: one line for help texts.
      options: ``{name: Option}``, the loader's declared options, passed to ``load`` as
        keywords (:attr:`~scaffold_jax.registry.Option.argument`, else the name).
    """

    load: Callable[..., ClientDataset]
    needs_data_dir: bool
    description: str
    options: Mapping[str, Option] = {}


#: The option every built-in natural dataset declares: LEAF's minimum client size.
MIN_CLIENT_EXAMPLES = {
    "min_client_examples": Option(
        1,
        "natural datasets: drop clients with fewer training examples",
        "int",
        low=1,
        argument="min_examples",
    )
}

#: The naturally federated datasets; each registers itself in its own module
#: (:mod:`~scaffold_jax.data.shakespeare`, :mod:`~scaffold_jax.data.femnist`).
NATURAL_DATASETS: Registry[NaturalSpec] = Registry("naturally federated dataset")


def load(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    **params: Any,
) -> ClientDataset:
    """Loads the naturally federated dataset registered as ``name``.

    Args:
      name: one of :data:`NATURAL_DATASETS`.
      data_dir: its files (see each loader); None where the loader has a default.
      cache_dir: the cache folder (default :func:`~scaffold_jax.data.sources.default_cache_dir`).
      **params: the loader's own keyword arguments (e.g. Shakespeare's ``min_examples``).
    """
    spec = NATURAL_DATASETS[name]
    return spec.load(data_dir, cache_dir=cache_dir, **params)
