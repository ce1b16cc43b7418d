"""Synthetic(α, β) of Li et al. (FedProx) (see :mod:`scaffold_jax.data.synthetic`):
materialised (:func:`synthetic_alpha_beta`) or generated inside the round
(:class:`ProceduralSynthetic`, built by :func:`procedural_synthetic`), and the argument
checks the quadratics share.

Randomness (Synthetic and procedural). One root ``key = jax.random.key(seed)`` is cut
into independent streams with ``fold_in`` by a stream tag, so adding clients or examples
never shifts anyone else's numbers:

* sizes:   ``n_i    from fold_in(fold_in(key, 0), i)``
* model:   ``(u, W, b, B, v)_i from fold_in(fold_in(key, 1), i)``
* data:    ``x_ij   from fold_in(fold_in(seed_key, i), j)``, ``seed_key = fold_in(key, 2)``
* iid:     the shared (W, b) from ``fold_in(key, 3)``

Labels are ``argmax`` of float32 logits, so two differently compiled programs can in
principle disagree on an exact near-tie (a logit gap within float32 rounding,
probability ~1e-7 per example); features are bit-identical.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax import resources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData

Examples = Any

_SIZES, _MODEL, _DATA, _IID = 0, 1, 2, 3  # stream tags folded into the root key
_LOGNORMAL_MEAN, _LOGNORMAL_SIGMA, _MIN_SIZE = 4.0, 2.0, 50  # FedProx / LEAF code
_CHUNK = 4096  # examples per compiled materialisation call (one compile for any size)
_CHUNK_BYTES = 64 * 2**20  # working set of one call: each example recomputes its client's W


def _chunk_examples(dim: int, num_classes: int) -> int:
    """Examples per materialisation call: ``_CHUNK``, or fewer (a power of two, >= 1) when
    the call's working set, ~3 copies of a [d, C] model plus [d] vectors per example,
    would pass ``_CHUNK_BYTES`` (a wide ``dim`` otherwise needs hundreds of GB at once;
    the smaller calls' features equal the default's up to float32 round-off)."""
    per_example = 4 * (3 * dim * num_classes + 4 * dim + 2 * num_classes)
    fits = max(1, _CHUNK_BYTES // per_example)
    return min(_CHUNK, 1 << (fits.bit_length() - 1))


def _feature_std(dim: int) -> jax.Array:
    """Standard deviations ``sqrt(Σ_jj) = j^-0.6`` of the diagonal covariance, j = 1..d."""
    return jnp.arange(1, dim + 1, dtype=jnp.float32) ** -0.6


def _client_model(
    key: jax.Array,
    client_id: jax.Array,
    alpha: jax.Array,
    beta: jax.Array,
    *,
    dim: int,
    num_classes: int,
    iid: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Client ``client_id``'s ``(W [d, C], b [C], v [d])`` from ``fold_in(model_root, i)``.

    One normal draw of ``2 + dC + C + d`` numbers laid out as ``(u, B, W, b, v)`` — one
    draw, not five: every separate ``jr.normal`` adds about a second of XLA compile time
    on a CPU.
    """
    k = jr.fold_in(jr.fold_in(key, _MODEL), client_id)
    dc = dim * num_classes
    draw = jr.normal(k, (2 + dc + num_classes + dim,))
    u, big_b = alpha * draw[0], beta * draw[1]
    if iid:
        # Synthetic-IID (FedProx code): one global (W, b) ~ N(0, 1); x centred at B_k·1.
        shared = jr.normal(jr.fold_in(key, _IID), (dc + num_classes,))
        w = shared[:dc].reshape(dim, num_classes)
        b = shared[dc:]
        v = jnp.full((dim,), big_b)
    else:
        w = u + draw[2 : 2 + dc].reshape(dim, num_classes)
        b = u + draw[2 + dc : 2 + dc + num_classes]
        v = big_b + draw[2 + dc + num_classes :]
    return w, b, v


def _examples(
    key: jax.Array,
    client_id: jax.Array,
    js: jax.Array,
    model: tuple[jax.Array, jax.Array, jax.Array],
) -> dict[str, jax.Array]:
    """Examples ``js`` ([n] int32) of one client with the given model: ``{"x", "y"}``."""
    w, b, v = model
    client_key = jr.fold_in(jr.fold_in(key, _DATA), client_id)
    std = _feature_std(v.shape[-1])
    z = jax.vmap(lambda j: jr.normal(jr.fold_in(client_key, j), v.shape))(js)
    x = v[None, :] + std[None, :] * z
    # An explicit product-and-sum rather than a dot, which XLA may lower differently per
    # program (or run in TF32 on GPUs): labels should not depend on how a client is batched.
    logits = jnp.sum(x[:, :, None] * w[None, :, :], axis=1) + b[None, :]
    return {"x": x, "y": jnp.argmax(logits, axis=-1).astype(jnp.int32)}


def _generate(key, alpha, beta, client_id, js, *, dim, num_classes, iid):
    model = _client_model(key, client_id, alpha, beta, dim=dim, num_classes=num_classes, iid=iid)
    return _examples(key, client_id, js, model)


_STATIC = ("dim", "num_classes", "iid")


@jax.jit
def _size_normals(key: jax.Array, ids: jax.Array) -> jax.Array:
    return jax.vmap(lambda i: jr.normal(jr.fold_in(jr.fold_in(key, _SIZES), i)))(ids)


def _client_sizes(key: jax.Array, num_clients: int, sizes: str | int, max_size: int | None):
    """Total examples per client (numpy int64): ``floor(lognormal(4, 2)) + 50`` or fixed."""
    if isinstance(sizes, str):
        z = np.asarray(_size_normals(key, jnp.arange(num_clients, dtype=jnp.int32)), np.float64)
        # Cap the exponent so a freak draw cannot overflow the int32 counts.
        log_n = np.minimum(_LOGNORMAL_MEAN + _LOGNORMAL_SIGMA * z, 30 * math.log(2))
        n = np.floor(np.exp(log_n)).astype(np.int64) + _MIN_SIZE
    else:
        n = np.full(num_clients, int(sizes), np.int64)
    if max_size is not None:
        n = np.minimum(n, int(max_size))
    return n


@functools.partial(jax.jit, static_argnames=_STATIC)
def _materialise_chunk(key, alpha, beta, client_ids, js, *, dim, num_classes, iid):
    """Examples for flat (client_id, j) pairs [n]: each client's model is recomputed from
    its own key, so the numbers equal those of the per-client (procedural) path."""

    def one(i, j):
        ex = _generate(key, alpha, beta, i, j[None], dim=dim, num_classes=num_classes, iid=iid)
        return jax.tree.map(lambda a: a[0], ex)

    return jax.vmap(one)(client_ids, js)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _models(key, alpha, beta, client_ids, *, dim, num_classes, iid):
    """The models of clients ``client_ids`` ([n]): ``(W [n, d, C], b [n, C], v [n, d])``."""
    kw = dict(dim=dim, num_classes=num_classes, iid=iid)
    return jax.vmap(lambda i: _client_model(key, i, alpha, beta, **kw))(client_ids)


def _materialise(key, alpha, beta, client_ids, js, *, dim, num_classes, iid) -> dict:
    """Numpy examples for flat ``(client_ids, js)``, generated in fixed-size chunks."""
    total, chunk = len(client_ids), _chunk_examples(dim, num_classes)
    out = {"x": np.empty((total, dim), np.float32), "y": np.empty(total, np.int32)}
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        ids = np.zeros(chunk, np.int32)
        pos = np.zeros(chunk, np.int32)
        ids[: stop - start] = client_ids[start:stop]
        pos[: stop - start] = js[start:stop]
        ex = _materialise_chunk(
            key, alpha, beta, jnp.asarray(ids), jnp.asarray(pos),
            dim=dim, num_classes=num_classes, iid=iid,
        )  # fmt: skip
        for name in out:
            out[name][start:stop] = np.asarray(ex[name])[: stop - start]
    return out


def check_int(name: str, value: Any, low: int, why: str = "") -> int:
    """``int(value)``; ValueError unless it is an integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or int(value) != value or value < low:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {low}{why}.")
    return int(value)


def check_finite(name: str, value: float) -> float:
    """``float(value)``; ValueError unless it is finite."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number.")
    return value


def check_host_memory(needed: int, what: str, holds: str, fix: str) -> None:
    """ValueError when building data needs more host memory than is available."""
    available = resources.available_memory_bytes(jax.devices("cpu")[0])
    if needed > available:
        # (an absurd size, dim = 10**400, is beyond format_bytes' float)
        size = f"{needed} bytes ({resources.format_bytes(needed)})" if needed < 2**100 else (
            "more than 2**100 bytes"
        )  # fmt: skip
        raise ValueError(
            f"{what} needs {size} of host memory for {holds}, more than the {available} bytes "
            f"({resources.format_bytes(available)}) available; {fix}."
        )


def _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size):
    check_int("num_clients", num_clients, 1)
    for name, value in (("alpha", alpha), ("beta", beta)):
        value = check_finite(name, value)
        if value < 0:
            raise ValueError(f"{name}={value} is invalid: it must be >= 0 (a standard deviation).")
    check_int("dim", dim, 1, " (the paper: 60)")
    check_int("num_classes", num_classes, 2, " (paper: 10)")
    if sizes != "powerlaw" and (isinstance(sizes, str | bool) or int(sizes) != sizes or sizes < 1):
        raise ValueError(f"sizes={sizes!r} is invalid: use 'powerlaw' or an integer >= 1.")
    if max_size is not None and (
        isinstance(max_size, bool) or int(max_size) != max_size or max_size < 1
    ):
        raise ValueError(f"max_size={max_size!r} is invalid: it must be None or an integer >= 1.")


def synthetic_alpha_beta(
    num_clients: int,
    alpha: float,
    beta: float,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    sizes: str | int = "powerlaw",
    test_fraction: float = 0.2,
    *,
    iid: bool = False,
    max_size: int | None = None,
) -> FederatedData:
    """Synthetic(α, β) of Li et al. (FedProx) as a device-resident :class:`FederatedData`.

    Client i draws ``n_i`` examples (``floor(lognormal(4, 2)) + 50`` for "powerlaw", as the
    FedProx/LEAF code; or ``sizes`` each), then holds out ``floor(test_fraction · n_i)`` of
    them: its training examples are the stream indices ``j < n_train_i``, its test examples
    ``n_train_i <= j < n_i`` — the same distribution, never trained on. ``data.test`` pools
    all clients' held-out examples (so it weights clients by size, like the paper's pooled
    test accuracy).

    The examples are exactly those of ``procedural_synthetic(..., seed=seed)`` with the same
    α, β, d, C, iid: client i's training rows are its procedural examples ``0..n_train_i−1``.

    Args:
      num_clients: N >= 1 (the paper: 30).
      alpha: α >= 0, the std of the model prior (how much clients' labelling differs).
      beta: β >= 0, the std of the input prior (how much clients' inputs differ).
      dim: input dimension d (60 in the paper).
      num_classes: C (10 in the paper).
      seed: the root key's seed.
      sizes: "powerlaw" or a fixed number of examples per client (before the split).
      test_fraction: fraction held out per client, in [0, 1); 0 gives ``test=None``.
      iid: the Synthetic-IID variant (shared W, b; v_k = B_k·1).
      max_size: optional cap on n_i (the lognormal tail reaches 10⁴–10⁵).

    Returns:
      ``FederatedData`` with examples ``{"x": float32 [n, d], "y": int32 [n]}``.

    Examples:
      >>> data = synthetic_alpha_beta(num_clients=3, alpha=1.0, beta=1.0, sizes=10)
      >>> data.counts.tolist(), data.examples["x"].shape, int(data.test["y"].shape[0])
      ([8, 8, 8], (24, 60), 6)
    """
    _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size)
    test_fraction = check_finite("test_fraction", test_fraction)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} is invalid: it must be in [0, 1).")
    n, dim, num_classes = int(num_clients), int(dim), int(num_classes)
    key = jr.key(seed)
    check_host_memory(  # before the sizes are drawn: every client holds >= 1 example
        n * (4 * dim + 4 + 64), f"num_clients={n} with dim={dim!r}",
        f"at least {n} examples of {dim} float32 features",
        "use fewer clients (or procedural_synthetic, which keeps none)",
    )  # fmt: skip
    totals = _client_sizes(key, n, sizes, max_size)
    check_host_memory(
        int(totals.sum()) * (4 * dim + 4), f"dim={dim!r} with num_clients={n}",
        f"{int(totals.sum())} examples of {dim} float32 features",
        "use a smaller dim or fewer clients (or procedural_synthetic, which keeps none)",
    )  # fmt: skip
    n_test = np.floor(test_fraction * totals).astype(np.int64)
    n_train = totals - n_test  # >= 1 because test_fraction < 1 and totals >= 1

    def flat(counts: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.repeat(np.arange(n, dtype=np.int32), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        js = np.arange(int(counts.sum())) - np.repeat(starts, counts) + np.repeat(first, counts)
        return ids, js.astype(np.int32)

    a, b = jnp.float32(alpha), jnp.float32(beta)
    kw = dict(dim=dim, num_classes=num_classes, iid=bool(iid))
    train = _materialise(key, a, b, *flat(n_train, np.zeros(n, np.int64)), **kw)
    test = None
    if n_test.sum() > 0:
        test = jax.tree.map(jnp.asarray, _materialise(key, a, b, *flat(n_test, n_train), **kw))
    offsets = np.concatenate([[0], np.cumsum(n_train)[:-1]])
    return FederatedData(
        examples=jax.tree.map(jnp.asarray, train),
        offsets=jnp.asarray(offsets, jnp.int32),
        counts=jnp.asarray(n_train, jnp.int32),
        test=test,
        num_clients=n,
        max_count=int(n_train.max()),
    )


@flax.struct.dataclass
class ProceduralSynthetic:
    """Synthetic(α, β) clients generated on the fly: 10⁶ clients, no data memory.

    Implements the dataset protocol of :class:`~scaffold_jax.data.federated.FederatedData`
    (``num_clients``, ``counts``, ``max_count``, ``test``, ``client_batches``). Example j of
    client i is a pure function of ``(key, i, j)``: its features come from
    ``fold_in(fold_in(seed_key, i), j)`` and its label from client i's model, itself drawn
    from ``fold_in(model_root, i)`` (see the module docstring). So a client's data are the
    same on every visit, under any vmap/jit/sharding, and equal to
    :meth:`client_examples`. Build it with :func:`procedural_synthetic`.

    Attributes:
      key: the root key (typed, ``jax.random.key(seed)``).
      alpha: float32 scalar α (a leaf: changing it does not recompile).
      beta: float32 scalar β.
      counts: ``[N]`` int32 training examples per client (positions ``0..counts[i]−1``).
      test: ``{"x": [T, d], "y": [T]}`` held-out examples (see :func:`procedural_synthetic`).
      num_clients: N (static).
      max_count: max_i counts[i] (static; the padded width of a round's batches).
      dim: input dimension d (static).
      num_classes: C (static).
      iid: Synthetic-IID variant (static).
    """

    key: jax.Array
    alpha: jax.Array
    beta: jax.Array
    counts: jax.Array
    test: Examples | None
    num_clients: int = flax.struct.field(pytree_node=False)
    max_count: int = flax.struct.field(pytree_node=False)
    dim: int = flax.struct.field(pytree_node=False)
    num_classes: int = flax.struct.field(pytree_node=False)
    iid: bool = flax.struct.field(pytree_node=False)

    @property
    def _static(self) -> dict[str, Any]:
        return dict(dim=self.dim, num_classes=self.num_classes, iid=self.iid)

    def examples_at(self, client_id: jax.Array, js: jax.Array) -> dict[str, jax.Array]:
        """Examples ``js`` (``[n]`` int) of client ``client_id``: ``{"x": [n, d], "y": [n]}``.

        Jittable and vmappable over ``client_id``; no bound check on ``js`` (indices at or
        beyond ``counts[i]`` are that client's held-out stream).
        """
        js = jnp.asarray(js, jnp.int32)
        return _generate(self.key, self.alpha, self.beta, client_id, js, **self._static)

    def client_batches(
        self, client_id: jax.Array, key: jax.Array, plan: BatchPlan
    ) -> tuple[Examples, jax.Array]:
        """Batches ``[K, B, ...]`` and mask ``[K, B]`` for one client (vmap over clients).

        Positions come from ``plan.positions(key, counts[i], max_count)`` exactly as for
        :class:`FederatedData`; the examples at those positions are then generated. Padded
        slots generate an example too (position 0) and are masked out.
        """
        count = self.counts[client_id]
        pos, mask = plan.positions(key, count, self.max_count)
        ex = self.examples_at(client_id, pos.reshape(-1))
        return jax.tree.map(lambda a: a.reshape(pos.shape + a.shape[1:]), ex), mask

    def client_examples(self, client_id: int) -> dict[str, np.ndarray]:
        """Client ``client_id``'s ``counts[i]`` training examples as numpy (for inspection)."""
        count = int(self.counts[client_id])
        ids = np.full(count, int(client_id), np.int32)
        js = np.arange(count, dtype=np.int32)
        return _materialise(self.key, self.alpha, self.beta, ids, js, **self._static)

    def client_model(self, client_id: int | np.ndarray) -> dict[str, np.ndarray]:
        """Client model(s) ``{"W": [..., d, C], "b": [..., C], "v": [..., d]}`` as numpy.

        ``client_id`` may be an int or an array of ids (vectorised).
        """
        ids = np.asarray(client_id, np.int32)
        w, b, v = _models(self.key, self.alpha, self.beta, ids.reshape(-1), **self._static)
        return {
            name: np.asarray(a).reshape(ids.shape + a.shape[1:])
            for name, a in (("W", w), ("b", b), ("v", v))
        }

    @property
    def num_examples(self) -> int:
        """Total training examples over all clients."""
        return int(np.asarray(self.counts, np.int64).sum())


def procedural_synthetic(
    num_clients: int,
    alpha: float,
    beta: float,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    sizes: str | int = "powerlaw",
    *,
    max_size: int | None = 1000,
    num_test_clients: int = 100,
    test_per_client: int = 20,
    iid: bool = False,
) -> ProceduralSynthetic:
    """Builds :class:`ProceduralSynthetic` clients (Synthetic(α, β) generated on the fly).

    ``counts`` are drawn procedurally per client id (the same "powerlaw" or fixed sizes as
    :func:`synthetic_alpha_beta`) and materialised as an ``[N]`` int32 array (four bytes
    per client) because the engine reads ``counts[ids]`` for weighting. They are capped at
    ``max_size`` (default 1000; ``None`` for no cap): ``max_count`` is the padded width of
    every round's batches, and over a million clients the uncapped lognormal(4, 2) tail
    reaches sizes of the order of the number of clients; the cap clips that tail only.

    A single global model fits Synthetic(α, β) well only for few clients: every client's
    W_k carries independent N(0, 1) entries (whatever α), so with thousands of clients the
    pooled labels are close to unpredictable from x (even a centralised logistic regression
    does little better than chance; benchmarks/README.md has the accuracies). For a
    learnable many-client task use ``iid=True``, which keeps the input heterogeneity (β).

    Test set: ``num_test_clients`` distinct clients chosen at random (numpy, from ``seed``)
    each contribute ``test_per_client`` examples from their stream positions
    ``counts[i] .. counts[i] + test_per_client − 1``, which no round ever draws; generated
    once, as concrete arrays.

    Args:
      num_clients: N >= 1 (10⁶ is fine).
      alpha: α >= 0 (std of the model prior).
      beta: β >= 0 (std of the input prior).
      dim: d (60 in the paper).
      num_classes: C (10 in the paper).
      seed: root key seed; same seed ⇒ same clients as :func:`synthetic_alpha_beta`.
      sizes: "powerlaw" or a fixed number of training examples per client.
      max_size: cap on a client's training examples, or None.
      num_test_clients: clients in the test set (at most N; 0 gives ``test=None``).
      test_per_client: held-out examples per test client.
      iid: the Synthetic-IID variant.

    Returns:
      A :class:`ProceduralSynthetic`.

    Examples:
      >>> data = procedural_synthetic(10**6, alpha=1.0, beta=1.0, sizes=20)
      >>> data.num_clients, data.counts.shape, data.test["x"].shape
      (1000000, (1000000,), (2000, 60))
    """
    _validate_synthetic(num_clients, alpha, beta, dim, num_classes, sizes, max_size)
    check_int("num_test_clients", num_test_clients, 0)
    check_int("test_per_client", test_per_client, 0)
    n = int(num_clients)
    key = jr.key(seed)
    check_host_memory(  # the per-client sizes (drawn as float64 normals, kept as int32)
        n * 36, f"num_clients={n}", "the clients' sizes", "use fewer clients"
    )
    counts = _client_sizes(key, n, sizes, max_size)
    data = ProceduralSynthetic(
        key=key,
        alpha=jnp.float32(alpha),
        beta=jnp.float32(beta),
        counts=jnp.asarray(counts, jnp.int32),
        test=None,
        num_clients=n,
        max_count=int(counts.max()),
        dim=int(dim),
        num_classes=int(num_classes),
        iid=bool(iid),
    )
    num_test_clients = min(int(num_test_clients), n)
    if num_test_clients > 0 and test_per_client > 0:
        rng = np.random.default_rng(seed)
        test_ids = np.sort(rng.choice(n, size=num_test_clients, replace=False)).astype(np.int32)
        ids = np.repeat(test_ids, int(test_per_client))
        js = (counts[ids] + np.tile(np.arange(int(test_per_client)), num_test_clients)).astype(
            np.int32
        )
        test = _materialise(key, data.alpha, data.beta, ids, js, **data._static)
        data = data.replace(test=jax.tree.map(jnp.asarray, test))
    return data
