"""The pooled datasets :func:`scaffold_jax.data.sources.load` knows (:data:`DATASETS`), the
:class:`Dataset` it returns and the check of its labels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from scaffold_jax.registry import Option, Registry


class DatasetSpec(NamedTuple):
    """A registered dataset: where :func:`~scaffold_jax.data.sources.load` looks for it and
    how it reads it.

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
