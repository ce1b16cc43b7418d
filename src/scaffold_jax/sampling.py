"""Client samplers: which S of the N clients take part in a round, and their registry.

A sampler is a pure function ``sample(key, round_index, num_clients, clients_per_round,
**options) -> ids`` returning S DISTINCT int32 client ids; it runs inside the compiled
round (``key`` is the round's sampling key, ``round_index`` a traced int32), so its
options are fixed for the program (Python values, not data). The engine checks the
first round's ids are distinct and in range (:func:`check_sampler`).

A sampler whose cohort size varies from round to round returns ``(ids, present)``
instead: M distinct ids, M fixed for the program (the shape of the round), and a bool
``[M]`` mask of the clients that take part. The engine runs all M rows (a fixed-size
program) but a row whose ``present`` is False contributes nothing: zero aggregation
weight, its client row and statistics written back unchanged, left out of the round's
metrics (its id reads -1 in ``client_ids``). :func:`poisson` is such a sampler.

A sampler that takes the keyword ``available`` (a bool ``[N]`` mask) draws only among the
available clients when the simulation has an availability model
(:mod:`scaffold_jax.participation`); :func:`uniform` and :func:`poisson` do, and a
simulation with an availability model refuses a sampler that does not.

A new sampler is a function plus one registration, ``SAMPLERS.register("name",
SamplerSpec(sample, {"option": Option(...)}))``, in any module (a plugin,
:func:`scaffold_jax.registry.load_plugins`); a config chooses it with ``sampler = "name"``
(``--sampler``), and its options are config keys like every other entry's.

Examples:
  >>> import jax
  >>> ids = make("uniform")(jax.random.key(0), 0, 10, 3)
  >>> ids.shape, ids.dtype, len(set(ids.tolist()))
  ((3,), dtype('int32'), 3)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.local import takes
from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options

#: ``sampler(key, round_index, num_clients, clients_per_round) -> int32 [S]``.
Sampler = Callable[[jax.Array, jax.Array, int, int], jax.Array]


def sample_clients(key: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """S distinct client ids, uniformly without replacement (int32 ``[S]``).

    Every S-subset of the N clients is equally likely. For S << N these are the ids of
    Floyd's algorithm (O(S²) work, no O(N) pass), computed in parallel rather than in a
    loop of S dependent steps (:func:`floyd_ids`); otherwise a permutation of all N ids.
    """
    n, s = num_clients, clients_per_round
    if s == n or s * s > 16 * n * max(1, n.bit_length()):
        return jr.permutation(key, n)[:s].astype(jnp.int32)
    last = jnp.arange(n - s, n, dtype=jnp.int32)  # t_i
    draws = jax.vmap(lambda k, t: jr.randint(k, (), 0, t + 1, dtype=jnp.int32))(
        jr.split(key, s), last
    )
    return floyd_ids(draws, n)


def floyd_ids(draws: jax.Array, num_clients: int) -> jax.Array:
    """The ids Floyd's algorithm chooses from its draws ``j_i`` in ``[0, t_i]`` (int32
    ``[S]``, t_i = N − S + i), with no loop whose length is data.

    Floyd's step i takes j_i unless an earlier step took it, in which case it takes t_i
    (which no earlier step can have taken). Step i "collides" exactly when

    * an earlier step drew the same j (j_k = j_i, k < i): if step k did not collide it
      took j_i, and if it did, j_i was taken before step k; or
    * the one earlier step k with t_k = j_i (k = j_i − (N − S), if 0 <= k < i) collided,
      so took t_k = j_i.

    So ``collided_i = repeat_i or collided_parent(i)``, pointers to earlier steps that
    ⌈log2 S⌉ pointer-doubling passes settle whatever the draws: the sequential
    algorithm's ids, bit for bit, from one [S, S] comparison and a fixed number of
    [S] gathers. On an accelerator this replaces S dependent steps, and any loop whose
    trip count is read back to the host each round, by a handful of kernels.
    """
    s = draws.shape[0]
    offset = num_clients - s
    step = jnp.arange(s, dtype=jnp.int32)
    earlier = step[None, :] < step[:, None]  # [i, k]: step k comes before step i
    collided = jnp.any(earlier & (draws[None, :] == draws[:, None]), axis=1)
    parent = draws - offset
    parent = jnp.where((parent >= 0) & (parent < step), parent, step)  # a root: itself
    for _ in range((s - 1).bit_length()):  # after m passes a step has seen 2^m of its chain
        collided = collided | collided[parent]
        parent = parent[parent]
    return jnp.where(collided, offset + step, draws)


def sample_available(key: jax.Array, available: jax.Array, width: int):
    """``width`` distinct ids, the available clients first in a uniformly random order:
    ``(ids, present)`` with ``present[j]`` whether ``ids[j]`` is available (the first
    ``min(width, #available)`` rows). O(N): one uniform score per client, the top
    ``width`` of the available ones' (ties among the unavailable fill the rest)."""
    scores = jnp.where(available, jr.uniform(key, available.shape), -1.0)
    _, ids = jax.lax.top_k(scores, width)
    ids = ids.astype(jnp.int32)
    return ids, available[ids]


def uniform(key, round_index, num_clients: int, clients_per_round: int, available=None):
    """The paper's sampler: S of N uniformly without replacement, fresh every round.

    With an availability mask (``available``, bool ``[N]``; see
    :mod:`scaffold_jax.participation.availability`): S of the available clients uniformly,
    or all of them when fewer than S are (``(ids, present)``; the other rows masked out).
    """
    del round_index  # the key is the round's already
    if available is not None:
        return sample_available(key, available, clients_per_round)
    return sample_clients(key, num_clients, clients_per_round)


class SamplerSpec(NamedTuple):
    """A registered client sampler.

    Attributes:
      sample: ``sample(key, round_index, num_clients, clients_per_round, **options) ->
        int32 [S]`` distinct ids.
      options: ``{name: Option}``, its declared options, passed as keywords
        (:attr:`~scaffold_jax.registry.Option.argument`, else the name).
      privacy: how a differential-privacy accountant sees its draws: ``"fixed_size"`` (S
        of N uniformly without replacement), ``"poisson"`` (each client independently
        with probability S/N), or None: no accountant covers it, and a private run
        refuses it (:mod:`scaffold_jax.privacy`).
    """

    sample: Callable[..., jax.Array]
    options: Mapping[str, Option] = {}
    privacy: str | None = None


#: The largest chance, per round, that a Poisson cohort overflows its bound that
#: :func:`poisson` accepts. A round that overflows runs with the first ``bound`` of the
#: drawn clients, which the privacy accounting does not cover; at 1e-9 a million-round run
#: meets one with probability 1e-3, and the default bound (:data:`POISSON_DEFAULT_OVERFLOW`)
#: is far below that.
POISSON_MAX_OVERFLOW = 1e-9

#: The per-round overflow probability the default bound of :func:`poisson` is sized for.
POISSON_DEFAULT_OVERFLOW = 1e-12


def poisson_overflow(num_clients: int, clients_per_round: int, bound: int) -> float:
    """P(Binomial(N, S/N) > bound): the chance a round's Poisson cohort overflows."""
    from scipy import stats  # jax's own dependency; imported here, on the host only

    return float(stats.binom.sf(bound, num_clients, clients_per_round / num_clients))


def poisson_bound(num_clients: int, clients_per_round: int, bound: int | None = None) -> int:
    """The width M of a Poisson round: ``bound`` checked, or (None) the smallest M whose
    per-round overflow probability is at most :data:`POISSON_DEFAULT_OVERFLOW`.

    Raises:
      ValueError: a bound whose overflow probability exceeds :data:`POISSON_MAX_OVERFLOW`,
        naming the smallest bound that is accepted.
    """
    from scipy import stats

    n, s = num_clients, clients_per_round
    if bound is None:
        return int(min(n, max(s, stats.binom.isf(POISSON_DEFAULT_OVERFLOW, n, s / n))))
    if bound < n and poisson_overflow(n, s, bound) > POISSON_MAX_OVERFLOW:
        least = int(min(n, stats.binom.isf(POISSON_MAX_OVERFLOW, n, s / n)))
        raise ValueError(
            f"poisson_bound = {bound} is too small for an expected cohort of S = {s} of "
            f"N = {n}: a round overflows it with probability "
            f"{poisson_overflow(n, s, bound):.1e} (> {POISSON_MAX_OVERFLOW:g}), and an "
            f"overflowing round would drop sampled clients. Use poisson_bound >= {least}, "
            "or leave it unset (the default bound)."
        )
    return int(min(bound, n))


def poisson(key, round_index, num_clients: int, clients_per_round: int, bound=None, available=None):
    """Poisson sampling: every client takes part independently with probability
    q = S/N (S: the expected cohort), the sampling that user-level DP's add/remove-one
    accounting assumes.

    The round has a fixed width M (:func:`poisson_bound`; about S + 7√S by default) and
    returns ``(ids, present)``: the cohort size k ~ Binomial(N, q) (the law of the number
    of independent successes) and, given k, a uniform k-subset (the first k of M distinct
    ids in a uniformly random order): together exactly the law of independent draws. The
    M − k other rows are masked out.

    With an availability mask (``available``, bool ``[N]``): each AVAILABLE client takes
    part with probability q: k ~ Binomial(#available, q) and a uniform k-subset of them.
    """
    del round_index
    width = poisson_bound(num_clients, clients_per_round, bound)
    count_key, ids_key, order_key = jr.split(key, 3)
    q = clients_per_round / num_clients
    if available is not None:
        ids, _ = sample_available(ids_key, available, width)
        count = jr.binomial(count_key, jnp.sum(available).astype(jnp.float32), q)
        return ids, jnp.arange(width) < count.astype(jnp.int32)
    count = jr.binomial(count_key, float(num_clients), q)
    # Floyd's output is a uniform subset but not in exchangeable order: shuffle it, so
    # its first k are a uniform k-subset.
    ids = jr.permutation(order_key, sample_clients(ids_key, num_clients, width))
    return ids, jnp.arange(width) < count.astype(jnp.int32)


SAMPLERS: Registry[SamplerSpec] = Registry("client sampler")
SAMPLERS.register("uniform", SamplerSpec(uniform, privacy="fixed_size"))
SAMPLERS.register(
    "poisson",
    SamplerSpec(
        poisson,
        privacy="poisson",
        options={
            "poisson_bound": Option(
                None,
                "the most clients a Poisson round holds (its fixed width; default: S + ~7 "
                "sqrt(S), overflowed with probability <= 1e-12 a round)",
                "int",
                low=1,
                argument="bound",
            )
        },
    ),
)

#: The sampler of a config or simulation that names none.
DEFAULT_SAMPLER = "uniform"


def make(name: str, options: Mapping[str, Any] | None = None) -> Sampler:
    """The registered sampler ``name`` with its options (given, else their defaults)."""
    spec = SAMPLERS[name]
    values = resolve_options(spec.options, options or {})
    sampler = functools.partial(spec.sample, **factory_kwargs(spec.options, values))
    sampler.privacy = spec.privacy  # read by privacy_sampling
    return sampler


def takes_availability(sampler: Sampler) -> bool:
    """Whether ``sampler`` draws among the available clients (takes ``available=``), which
    a simulation with an availability model needs."""
    return takes(sampler, "available")


def privacy_sampling(sampler: Sampler) -> str | None:
    """How a DP accountant sees ``sampler`` (:attr:`SamplerSpec.privacy`; the default
    :func:`uniform` is ``"fixed_size"``), None for a sampler no accountant covers."""
    if sampler is uniform:
        return "fixed_size"
    return getattr(sampler, "privacy", None)


def split_sample(sample: Any) -> tuple[jax.Array, jax.Array | None]:
    """A sampler's result as ``(ids, present)``; ``present`` is None when every row takes
    part (a sampler that returns the ids alone)."""
    if isinstance(sample, tuple):
        ids, present = sample
        return jnp.asarray(ids, jnp.int32), jnp.asarray(present)
    return jnp.asarray(sample, jnp.int32), None


def check_sampler(sampler: Sampler, num_clients: int, clients_per_round: int) -> None:
    """Raises ValueError unless the sampler's first rounds give S distinct ids in [0, N)
    (or ``(ids, present)``: distinct ids and a bool mask of their shape).

    Runs it eagerly on rounds 0 and 1 (cheap: S ids), before anything is compiled.
    """
    for round_index in (0, 1):
        ids, present = split_sample(
            sampler(jr.key(0), jnp.int32(round_index), num_clients, clients_per_round)
        )
        ids = np.asarray(ids)
        if present is not None:
            present = np.asarray(present)
            if present.dtype != np.bool_ or present.shape != ids.shape or ids.ndim != 1:
                raise ValueError(
                    f"the client sampler returned ids of shape {ids.shape} and a mask of "
                    f"{present.dtype} {present.shape}; a sampler returning (ids, present) "
                    "must give [M] integer ids and a bool [M] mask."
                )
            clients_per_round = ids.size
        if ids.shape != (clients_per_round,) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"the client sampler returned {ids.dtype} ids of shape {ids.shape}; it must "
                f"return S = {clients_per_round} integer client ids."
            )
        if ids.min() < 0 or ids.max() >= num_clients or len(set(ids.tolist())) != ids.size:
            raise ValueError(
                f"the client sampler returned ids {ids.tolist()[:10]} in round {round_index}; "
                f"it must return S = {clients_per_round} DISTINCT ids in [0, N = "
                f"{num_clients}) (a client's row is updated once per round). Fix the sampler "
                "or its options."
            )
