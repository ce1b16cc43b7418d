"""Partitioners: which client holds which examples.

Every partitioner takes the labels (or just the number of examples) of a pool of examples
and returns ``client_indices``: a list of N int64 arrays, client i's example indices,
sorted ascending. Every example goes to exactly one client, every client gets at least one
example, and the result is a deterministic function of ``seed`` (all randomness comes from
``np.random.default_rng(seed)``). Feed the result to
:func:`scaffold_jax.data.federated.from_partition`.

* :func:`similarity_split`: the "s% similarity" split of Karimireddy et al. (2020),
  "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning" (ICML), Section 7,
  following Hsu et al. (2019): each client gets s% of its data i.i.d. and the rest from
  the data sorted by label. s = 0 is maximally label-skewed, s = 100 is i.i.d.
* :func:`dirichlet_split`: label skew with Dirichlet(α) class proportions, Hsu, Qi and
  Brown (2019), "Measuring the Effects of Non-Identical Data Distribution for Federated
  Visual Classification", in the per-class form common in code (Yurochkin et al. 2019;
  Wang et al. 2020, FedMA).
* :func:`shard_split`: label shards, McMahan et al. (2017), "Communication-Efficient
  Learning of Deep Networks from Decentralized Data" (AISTATS), the pathological non-IID
  MNIST split.
* :func:`iid_split`: i.i.d., with equal or log-normal client sizes.

:func:`summary` describes a partition (sizes, labels per client, label histograms).

:data:`PARTITIONERS` names them for configs and the command line (``similarity``,
``dirichlet``, ``shards``, ``iid``). A new partitioner is a ``split`` function plus one
registration, ``PARTITIONERS.register("name", PartitionerSpec(split, {"option":
Option(...)}))``, in any module (a plugin, :func:`scaffold_jax.registry.load_plugins`).

Examples:
  >>> spec = PARTITIONERS["dirichlet"]
  >>> spec.options["dirichlet_alpha"].default, spec.options["dirichlet_alpha"].argument
  (0.5, 'alpha')
  >>> parts = spec.split(np.arange(40) % 4, 5, seed=0, alpha=1.0)
  >>> len(parts), sum(len(p) for p in parts)
  (5, 40)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from scaffold_jax.registry import Option, Registry

# Dirichlet splits are resampled until every client has min_size examples; this bounds the
# retries so an infeasible request fails with a message instead of spinning forever.
_MAX_DIRICHLET_DRAWS = 1000


def _check_labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {labels.shape}.")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}.")
    return labels


def _check_num_clients(num_clients: int, num_examples: int) -> int:
    if isinstance(num_clients, bool) or int(num_clients) != num_clients:
        raise ValueError(f"num_clients must be an integer, got {num_clients!r}.")
    num_clients = int(num_clients)
    if num_clients < 1:
        raise ValueError(f"num_clients = {num_clients} is invalid: it must be >= 1.")
    if num_clients > num_examples:
        raise ValueError(
            f"more clients than examples: num_clients = {num_clients} but only "
            f"{num_examples} examples; every client needs at least one."
        )
    return num_clients


def _finish(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Sorted int64 index arrays: a canonical form, independent of how they were built."""
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _balanced_sizes(total: int, num_parts: int) -> np.ndarray:
    """``num_parts`` sizes summing to ``total`` that differ by at most one (largest first)."""
    q, r = divmod(total, num_parts)
    return np.full(num_parts, q, dtype=np.int64) + (np.arange(num_parts) < r)


def similarity_split(
    labels: np.ndarray | Sequence[int], num_clients: int, similarity: float, seed: int
) -> list[np.ndarray]:
    """The paper's "s% similarity" split (Karimireddy et al. 2020, after Hsu et al. 2019).

    A random ``s%`` of the examples is shuffled and dealt evenly to the clients (the i.i.d.
    part); the other ``(100 - s)%`` is sorted by label and cut into contiguous chunks, one
    per client (the label-sorted part). So each client holds about ``s%`` i.i.d. data and
    ``(100 - s)%`` data from one or two neighbouring labels. Client sizes differ by at
    most one example: the i.i.d. shares are dealt as evenly as possible and the
    label-sorted chunk sizes make up each client's total. Within a label, the sorted part
    is in random order, so which examples of a label a client gets is random too.

    With ``s = 0``, 100 clients and 10 equally frequent labels, every client holds
    examples of at most 2 labels (exactly 1 when the class size is a multiple of the
    client size, as for MNIST-like data with 6000 per class and 600 per client).

    Args:
      labels: ``[n]`` integer labels.
      num_clients: N.
      similarity: s, a percentage in ``[0, 100]`` (not a fraction: 10 means 10%).
      seed: seed of ``np.random.default_rng``.

    Returns:
      N sorted int64 index arrays.

    Raises:
      ValueError: s outside ``[0, 100]``, ``num_clients < 1`` or more clients than examples.
    """
    labels = _check_labels(labels)
    n = labels.shape[0]
    num_clients = _check_num_clients(num_clients, n)
    s = float(similarity)
    if not (math.isfinite(s) and 0.0 <= s <= 100.0):
        raise ValueError(
            f"similarity = {similarity!r} is invalid: it is a percentage in [0, 100] "
            "(0 = label-sorted, 100 = i.i.d.)."
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    n_iid = int(round(n * s / 100.0))
    iid, rest = perm[:n_iid], perm[n_iid:]
    # Stable sort of randomly ordered examples: sorted by label, random within a label.
    rest = rest[np.argsort(labels[rest], kind="stable")]
    iid_sizes = _balanced_sizes(n_iid, num_clients)
    # Each client's label-sorted share tops it up to a balanced total; the shares are
    # non-negative because both size vectors put their extra examples on the first clients.
    sorted_sizes = _balanced_sizes(n, num_clients) - iid_sizes
    iid_parts = np.split(iid, np.cumsum(iid_sizes)[:-1])
    sorted_parts = np.split(rest, np.cumsum(sorted_sizes)[:-1])
    return _finish([np.concatenate(pair) for pair in zip(iid_parts, sorted_parts, strict=True)])


def dirichlet_split(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Dirichlet label skew (Hsu et al. 2019), in the per-class form common in code.

    For every class k, proportions ``p_k ~ Dir(alpha * 1_N)`` over the N clients are
    drawn and the (shuffled) examples of class k are cut at ``cumsum(p_k) * n_k``. Small
    alpha gives each client few classes (and unequal sizes); alpha -> infinity tends to
    i.i.d. The whole draw is repeated until every client holds at least ``min_size``
    examples (as in the reference implementations). Hsu et al. describe the transposed
    form (per-client class proportions ``q_i ~ Dir(alpha p)``); both skew labels the same
    way in expectation, and this one assigns every example exactly once by construction.

    Args:
      labels: ``[n]`` integer labels.
      num_clients: N.
      alpha: concentration, finite and > 0.
      seed: seed of ``np.random.default_rng``.
      min_size: the fewest examples a client may hold (>= 1).

    Returns:
      N sorted int64 index arrays.

    Raises:
      ValueError: bad alpha or min_size, ``num_clients < 1``, more clients than examples,
        or no draw in 1000 satisfying ``min_size``.
    """
    labels = _check_labels(labels)
    n = labels.shape[0]
    num_clients = _check_num_clients(num_clients, n)
    a = float(alpha)
    if not (math.isfinite(a) and a > 0.0):
        raise ValueError(f"alpha = {alpha!r} is invalid: it must be finite and > 0.")
    if int(min_size) < 1:
        raise ValueError(f"min_size = {min_size} is invalid: it must be >= 1.")
    if num_clients * int(min_size) > n:
        raise ValueError(
            f"num_clients * min_size = {num_clients} * {min_size} exceeds the {n} examples."
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    for _ in range(_MAX_DIRICHLET_DRAWS):
        owner = np.empty(n, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, a))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            # Client j gets positions cuts[j-1]:cuts[j]; a vectorised "which chunk" lookup.
            owner[idx] = np.searchsorted(cuts, np.arange(len(idx)), side="right")
        sizes = np.bincount(owner, minlength=num_clients)
        if sizes.min() >= min_size:
            order = np.argsort(owner, kind="stable")
            return _finish(np.split(order, np.cumsum(sizes)[:-1]))
    raise ValueError(
        f"dirichlet_split: no draw in {_MAX_DIRICHLET_DRAWS} gave every one of the "
        f"{num_clients} clients >= {min_size} examples with alpha = {a}; use a larger "
        "alpha, fewer clients or a smaller min_size."
    )


def shard_split(
    labels: np.ndarray | Sequence[int],
    num_clients: int,
    shards_per_client: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Label shards (McMahan et al. 2017): sort by label, cut into ``N * shards_per_client``
    near-equal shards, give each client ``shards_per_client`` shards at random.

    A shard holds one label unless it straddles a class boundary, so a client holds at most
    ``shards_per_client`` labels when every class size is a multiple of the shard size
    (e.g. Fashion-MNIST, 100 clients, 2 shards each: 200 shards of 300) and at most
    ``2 * shards_per_client`` otherwise.

    Args:
      labels: ``[n]`` integer labels.
      num_clients: N.
      shards_per_client: shards per client (>= 1).
      seed: seed of ``np.random.default_rng`` (it has a default only because Python
        needs one after ``shards_per_client``'s).

    Returns:
      N sorted int64 index arrays.

    Raises:
      ValueError: ``shards_per_client < 1``, ``num_clients < 1``, or more clients (or
        shards) than examples.
    """
    labels = _check_labels(labels)
    n = labels.shape[0]
    num_clients = _check_num_clients(num_clients, n)
    if int(shards_per_client) < 1:
        raise ValueError(f"shards_per_client = {shards_per_client} is invalid: it must be >= 1.")
    num_shards = num_clients * int(shards_per_client)
    if num_shards > n:
        raise ValueError(
            f"more shards than examples: {num_clients} clients * {shards_per_client} shards "
            f"= {num_shards} shards but only {n} examples."
        )
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    ordered = perm[np.argsort(labels[perm], kind="stable")]  # by label, random within
    shards = np.split(ordered, np.cumsum(_balanced_sizes(n, num_shards))[:-1])
    owner_of = rng.permutation(num_shards).reshape(num_clients, int(shards_per_client))
    return _finish([np.concatenate([shards[j] for j in row]) for row in owner_of])


def iid_split(
    num_examples: int,
    num_clients: int,
    seed: int,
    sizes: str = "equal",
    sigma: float = 0.3,
) -> list[np.ndarray]:
    """I.i.d. split, with equal or log-normally unbalanced client sizes.

    ``sizes="equal"``: a random permutation cut into N parts differing by at most one.
    ``sizes="lognormal"``: client weights ``w_i ~ LogNormal(0, sigma)``; client i gets
    ``1 + (n - N) w_i / sum(w)`` examples, rounded so the sizes sum to n (largest
    remainders first). Every client keeps at least one example. sigma = 0 gives equal
    sizes; the default 0.3 is a mild imbalance (max/min around 3 for 100 clients).

    Args:
      num_examples: n.
      num_clients: N.
      seed: seed of ``np.random.default_rng``.
      sizes: ``"equal"`` or ``"lognormal"``.
      sigma: log-normal shape (>= 0), used with ``sizes="lognormal"``.

    Returns:
      N sorted int64 index arrays.

    Raises:
      ValueError: an unknown ``sizes``, a bad sigma, ``num_clients < 1`` or more clients
        than examples.
    """
    n = int(num_examples)
    if n < 0 or n != num_examples:
        raise ValueError(f"num_examples = {num_examples!r} must be a non-negative integer.")
    num_clients = _check_num_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    if sizes == "equal":
        counts = _balanced_sizes(n, num_clients)
    elif sizes == "lognormal":
        sg = float(sigma)
        if not (math.isfinite(sg) and sg >= 0.0):
            raise ValueError(f"sigma = {sigma!r} is invalid: it must be finite and >= 0.")
        w = rng.lognormal(mean=0.0, sigma=sg, size=num_clients)
        share = (n - num_clients) * w / w.sum()
        counts = 1 + np.floor(share).astype(np.int64)
        short = n - int(counts.sum())  # < num_clients, handed out by largest remainder
        counts[np.argsort(-(share - np.floor(share)), kind="stable")[:short]] += 1
    else:
        raise ValueError(f"sizes = {sizes!r} is unknown; use 'equal' or 'lognormal'.")
    perm = rng.permutation(n)
    return _finish(np.split(perm, np.cumsum(counts)[:-1]))


def _iid_split_of_labels(
    labels: np.ndarray | Sequence[int], num_clients: int, seed: int
) -> list[np.ndarray]:
    """:func:`iid_split` in the registry's form: it needs only how many labels there are."""
    return iid_split(len(labels), num_clients, seed)


class PartitionerSpec(NamedTuple):
    """A registered partitioner.

    Attributes:
      split: ``split(labels, num_clients, *, seed, **options) -> client_indices`` (N sorted
        int64 index arrays, as the functions of this module return).
      options: ``{name: Option}``, the options it declares, passed to ``split`` as
        keywords (:attr:`~scaffold_jax.registry.Option.argument`, else the name), e.g.
        ``{"dirichlet_alpha": Option(0.5, ..., argument="alpha")}``. A config that sets one
        of these and names no partitioner gets this one; one left unset takes its default.
    """

    split: Callable[..., list[np.ndarray]]
    options: Mapping[str, Option] = {}


PARTITIONERS: Registry[PartitionerSpec] = Registry("partitioner")
PARTITIONERS.register(
    "similarity",
    PartitionerSpec(
        similarity_split,
        {
            "similarity": Option(
                0.0,
                "similarity split: percent of i.i.d. data per client",
                "float",
                low=0.0,
                high=100.0,
                what="a percentage in [0, 100] (0 = label-sorted, 100 = i.i.d.)",
            )
        },
    ),
)
PARTITIONERS.register(
    "dirichlet",
    PartitionerSpec(
        dirichlet_split,
        {
            "dirichlet_alpha": Option(
                0.5,
                "Dirichlet label-skew concentration",
                "float",
                low=0.0,
                strict=True,
                argument="alpha",
                what="finite and > 0",
            )
        },  # fmt: skip
    ),
)
PARTITIONERS.register(
    "shards",
    PartitionerSpec(
        shard_split, {"shards_per_client": Option(2, "label shards per client", "int", low=1)}
    ),
)
PARTITIONERS.register("iid", PartitionerSpec(_iid_split_of_labels))

# The partitioner of a config that names none and sets none of the partitioners' fields:
# the paper's s% similarity split (at s = 0, its default).
DEFAULT_PARTITIONER = "similarity"


def check_partition(client_indices: Sequence[np.ndarray], num_examples: int) -> None:
    """Raises ValueError unless every example in ``[0, num_examples)`` is assigned to
    exactly one client and no client is empty."""
    sizes = [len(ix) for ix in client_indices]
    if not sizes or min(sizes) == 0:
        raise ValueError("the partition has no clients or an empty client.")
    for i, ix in enumerate(client_indices):
        ix = np.asarray(ix)
        if not np.issubdtype(ix.dtype, np.integer):  # np.int64(...) would truncate 2.7 to 2
            raise ValueError(
                f"client {i}'s partition indices are {ix.dtype} values (e.g. "
                f"{ix.flat[0].item()!r}); indices must be integers."
            )
    flat = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in client_indices])
    if flat.size and (flat.min() < 0 or flat.max() >= num_examples):
        raise ValueError(f"the partition holds indices outside [0, {num_examples}).")
    uses = np.bincount(flat, minlength=num_examples)
    if np.any(uses != 1):
        raise ValueError(
            f"{int((uses == 0).sum())} examples are unassigned and "
            f"{int((uses > 1).sum())} are assigned more than once."
        )


class PartitionSummary(NamedTuple):
    """What a partition looks like.

    Attributes:
      examples_per_client: ``[N]`` client sizes.
      labels_per_client: ``[N]`` number of distinct labels each client holds.
      label_histogram: ``[N, C]`` example counts per client and label.
    """

    examples_per_client: np.ndarray
    labels_per_client: np.ndarray
    label_histogram: np.ndarray

    def format(self) -> str:
        """One line each for sizes and labels per client: min / median / max."""

        def stats(a: np.ndarray) -> str:
            return f"min {a.min()}, median {np.median(a):g}, max {a.max()}"

        n_clients, n_classes = self.label_histogram.shape
        return (
            f"{n_clients} clients, {int(self.examples_per_client.sum())} examples, "
            f"{n_classes} classes\n"
            f"  examples per client: {stats(self.examples_per_client)}\n"
            f"  labels per client:   {stats(self.labels_per_client)}"
        )

    def __str__(self) -> str:
        return self.format()


def summary(
    labels: np.ndarray | Sequence[int],
    client_indices: Sequence[np.ndarray],
    num_classes: int,
) -> PartitionSummary:
    """Sizes, distinct labels and label histograms of a partition.

    Args:
      labels: ``[n]`` integer labels in ``[0, num_classes)``.
      client_indices: the partition (N index arrays).
      num_classes: C.

    Returns:
      A :class:`PartitionSummary`; ``print`` it for min / median / max.
    """
    labels = _check_labels(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}).")
    if len(client_indices) == 0:
        raise ValueError("the partition has no clients.")
    sizes = np.asarray([len(ix) for ix in client_indices], dtype=np.int64)
    client_of = np.repeat(np.arange(len(client_indices)), sizes)
    flat = np.concatenate([np.asarray(ix, dtype=np.int64) for ix in client_indices])
    hist = np.bincount(
        client_of * num_classes + labels[flat], minlength=len(client_indices) * num_classes
    ).reshape(len(client_indices), num_classes)
    return PartitionSummary(sizes, (hist > 0).sum(axis=1), hist)


def local_test_split(
    client_indices: Sequence[np.ndarray], fraction: float, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Splits every client's examples into its training and its own test examples.

    Client i (its position in ``client_indices``) holds out t_i = ⌊round(ρ n_i, 9)⌋ of
    its n_i examples, at least 1 where n_i ≥ 2 and at most n_i − 1 (none where n_i = 1):
    the first t_i entries of a permutation seeded by ``(seed, i)``. The rest, in its
    original order, is what the client trains on. A client's split depends on its own
    examples and id only: adding clients changes no other client's.

    Raises:
      ValueError: ``fraction`` outside (0, 1).
    """
    if not 0.0 < float(fraction) < 1.0:
        raise ValueError(
            f"local_test_fraction = {fraction!r} is invalid: it must be a fraction in (0, 1), "
            "e.g. 0.2 to evaluate every client on a fifth of its examples."
        )
    train, test = [], []
    for client, ix in enumerate(client_indices):
        ix = np.asarray(ix)
        n = len(ix)
        held = min(max(math.floor(round(float(fraction) * n, 9)), 1), n - 1) if n >= 2 else 0
        order = np.random.default_rng([seed, client]).permutation(n)
        test.append(ix[order[:held]])
        train.append(ix[np.sort(order[held:])])
    return train, test
