"""The federated data of a run, assembled from what a config names.

Three kinds of dataset a config may name, each a registry of its own:

* pooled (:data:`~scaffold_jax.data.sources.DATASETS`): examples read (IDX, cache, TFDS, or
  the entry's own loader), optionally subset, split over N clients by a registered
  partitioner (:data:`~scaffold_jax.data.partition.PARTITIONERS`), optionally with a
  held-out test set per client;
* naturally federated (:data:`~scaffold_jax.data.natural.NATURAL_DATASETS`): N of its
  clients, drawn with the data seed, each with its own test split;
* synthetic families (:data:`~scaffold_jax.data.synthetic.FAMILIES`): generated for N
  clients from the data seed (quadratics bring their own problem).

:func:`assemble` does all of it from plain values (the experiment layer passes a
config's), so the data layer never reads a config.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from scaffold_jax.data import natural, partition, sources, synthetic
from scaffold_jax.data.federated import from_partition, with_client_tests
from scaffold_jax.registry import ConfigError, factory_kwargs, resolve_options
from scaffold_jax.types import Problem


class Assembled(NamedTuple):
    """A run's data.

    Attributes:
      data: the federated data (``FederatedData`` or a procedural dataset).
      example_shape: the shape of one example's input, for the model (None: the family
        brings its :attr:`problem`).
      num_classes: C, or None.
      problem: the data's own problem (a quadratic family's), or None.
      dataset: the pooled :class:`~scaffold_jax.data.sources.Dataset` the clients were cut
        from (None for a synthetic family).
      info: what the run's summary says about the data.
    """

    data: Any
    example_shape: tuple[int, ...] | None
    num_classes: int | None
    problem: Problem | None
    dataset: sources.Dataset | None
    info: dict[str, Any]


def kind_of(name: Any) -> str | None:
    """``"pooled"``, ``"natural"``, ``"synthetic"``, or None for an unknown name."""
    if not isinstance(name, str):
        return None
    if name in natural.NATURAL_DATASETS:
        return "natural"
    if name in synthetic.FAMILIES:
        return "synthetic"
    try:
        sources.canonical_name(name)
    except ValueError:
        return None
    return "pooled"


def dataset_slug(name: str) -> str:
    """A dataset as a folder name (the default output folders): its registered name,
    aliases resolved, for every kind (pooled, natural, synthetic, a plugin's), ``/`` and
    any other character unsafe in a path as ``-``.

    Examples:
      >>> dataset_slug("Fashion-MNIST"), dataset_slug("emnist/balanced")
      ('fashion_mnist', 'emnist-balanced')
      >>> dataset_slug("shakespeare"), dataset_slug("procedural_synthetic")
      ('shakespeare', 'procedural_synthetic')

    Raises:
      ValueError: a name no registry knows.
    """
    kind = kind_of(name)
    if kind is None:
        known = [*sources.DATASETS, *natural.NATURAL_DATASETS, *synthetic.FAMILIES]
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(known)}.")
    registered = sources.canonical_name(name) if kind == "pooled" else name
    return re.sub(r"[^\w.-]+", "-", registered)


def subset_dataset(
    dataset: sources.Dataset,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
    seed: int = 0,
) -> sources.Dataset:
    """A random subset of a dataset's splits (``numpy.random.default_rng(seed)``), kept in
    the original order; ``None`` keeps a split whole."""
    rng = np.random.default_rng(seed)

    def subset(split: dict, limit: int | None) -> dict:
        keep = _subset_rows(len(split["y"]), limit, rng)
        return split if keep is None else {k: np.asarray(v)[keep] for k, v in split.items()}

    return dataset._replace(
        train=subset(dataset.train, max_train_examples),
        test=subset(dataset.test, max_test_examples),
    )


def _subset_rows(n: int, limit: int | None, rng: np.random.Generator) -> np.ndarray | None:
    """The sorted rows of a random subset of ``limit`` of ``n`` rows (None: keep all; no
    draw is made then, so the next split's draw is unchanged)."""
    if limit is None or limit >= n:
        return None
    return np.sort(rng.choice(n, size=int(limit), replace=False))


def load(
    name: str,
    data_dir: str | None = None,
    options: Mapping[str, Any] | None = None,
    download: bool = False,
) -> sources.Dataset | natural.ClientDataset:
    """A pooled or natural dataset as read, before any subset, split or draw of clients.

    Raises:
      FileNotFoundError: the dataset is nowhere to be found.
    """
    if kind_of(name) == "natural":
        spec = natural.NATURAL_DATASETS[name]
        values = resolve_options(spec.options, options or {})
        return natural.load(name, data_dir, **factory_kwargs(spec.options, values))
    return sources.load(name, data_dir, allow_download=download, options=options)


def natural_clients(
    clients: natural.ClientDataset,
    name: str,
    num_clients: int,
    seed: int,
    max_test_examples: int | None = None,
):
    """``(pooled dataset, partition, client tests, clients available)`` of a naturally
    federated dataset: ``num_clients`` of its clients, drawn with ``seed`` (all of them
    when it has exactly that many), each with its own test examples, which pooled are the
    test set.

    ``max_test_examples`` draws that many of the pooled test examples (with ``seed``, as
    :func:`subset_dataset` draws a test subset), and each client's test examples are its
    own among them (possibly none): the per-client metrics evaluate the same examples as
    the test metrics, not every client's whole test split (Shakespeare's 600 roles hold
    373,000 test windows, an hour of evaluation on a CPU).

    Raises:
      ConfigError: ``num_clients`` above the number of clients the data has.
    """
    available = clients.num_clients
    if num_clients > available:
        raise ConfigError(
            f"num_clients = {num_clients} is invalid: {name} has {available} clients (after "
            f"its options); it must be at most {available}."
        )
    if num_clients < available:
        rng = np.random.default_rng(seed)
        clients = clients.select(np.sort(rng.choice(available, num_clients, replace=False)))
    dataset = natural.as_dataset(clients)
    keep = _subset_rows(len(dataset.test["y"]), max_test_examples, np.random.default_rng(seed))
    if keep is None:
        return dataset, natural.client_indices(clients), clients.client_tests(), available
    test = {k: np.asarray(v)[keep] for k, v in dataset.test.items()}
    owner = np.repeat(np.arange(num_clients), clients.test_counts)[keep]
    ends = np.cumsum(np.bincount(owner, minlength=num_clients)).tolist()
    starts = [0, *ends[:-1]]
    tests = [{k: v[a:b] for k, v in test.items()} for a, b in zip(starts, ends, strict=True)]
    return dataset._replace(test=test), natural.client_indices(clients), tests, available


def assemble(
    name: str,
    *,
    num_clients: int,
    seed: int,
    options: Mapping[str, Any] | None = None,
    partitioner: str | None = None,
    data_dir: str | None = None,
    download: bool = False,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
    local_test_fraction: float | None = None,
    loaded: sources.Dataset | natural.ClientDataset | None = None,
) -> Assembled:
    """The federated data a config names.

    Args:
      name: a pooled, natural or synthetic dataset (:func:`kind_of`).
      num_clients: N.
      seed: the data seed (subsets, split, held-out tests, natural draw, generation).
      options: the values of the options of the dataset and of the partitioner (each
        takes those it declares; defaults fill in the rest).
      partitioner: a pooled dataset's partitioner.
      data_dir, download: where to read it (see :func:`load`).
      max_train_examples, max_test_examples: random subsets (pooled; natural: test only,
        the clients' own test examples among them, see :func:`natural_clients`).
      local_test_fraction: a pooled dataset's per-client held-out fraction.
      loaded: the dataset as :func:`load` returned it (skips reading it again).
    """
    options = dict(options or {})
    kind = kind_of(name)
    if kind == "synthetic":
        spec = synthetic.FAMILIES[name]
        values = resolve_options(spec.options, options)
        family = spec.build(num_clients, seed, **factory_kwargs(spec.options, values))
        info = {
            "dataset": name,
            "dataset_source": "synthetic",
            "num_classes": family.num_classes,
            "partition": {"kind": "synthetic", **values},
            "num_clients": int(family.data.num_clients),
            **family.info,
        }
        return Assembled(family.data, family.example_shape, family.num_classes,
                         family.problem, None, info)  # fmt: skip
    if loaded is None:
        loaded = load(name, data_dir, options, download)
    client_tests = None
    if kind == "natural":
        dataset, parts, client_tests, available = natural_clients(
            loaded, name, num_clients, seed, max_test_examples
        )
        spec = natural.NATURAL_DATASETS[name]
        split = {"kind": "natural", "clients_available": available,
                 **resolve_options(spec.options, options)}  # fmt: skip
    else:
        dataset = subset_dataset(loaded, max_train_examples, max_test_examples, seed)
        if num_clients > len(dataset.train["y"]):
            raise ConfigError(
                f"num_clients = {num_clients} is invalid: the training set has only "
                f"{len(dataset.train['y'])} examples; it must be at most that."
            )
        spec = partition.PARTITIONERS[partitioner or partition.DEFAULT_PARTITIONER]
        args = factory_kwargs(spec.options, resolve_options(spec.options, options))
        parts = spec.split(dataset.train["y"], num_clients, seed=seed, **args)
        split = {"kind": partitioner or partition.DEFAULT_PARTITIONER, **args}
        if local_test_fraction is not None:
            parts, held = partition.local_test_split(parts, local_test_fraction, seed)
            client_tests = [{k: np.asarray(v)[ix] for k, v in dataset.train.items()} for ix in held]
    data = from_partition(dataset.train, parts, test=dataset.test)
    if client_tests is not None:
        data = with_client_tests(data, client_tests)
    info = {
        "dataset": dataset.name,
        "dataset_source": dataset.source,
        "num_train_examples": int(data.num_examples),
        "num_test_examples": int(len(dataset.test["y"])),
        "num_classes": int(dataset.num_classes),
        "partition": split,
        "labels_per_client_median": float(
            np.median(
                partition.summary(dataset.train["y"], parts, dataset.num_classes).labels_per_client
            )
        ),
        "num_clients": int(data.num_clients),
    }
    shape = tuple(np.shape(dataset.train["x"])[1:])
    return Assembled(data, shape, dataset.num_classes, None, dataset, info)
