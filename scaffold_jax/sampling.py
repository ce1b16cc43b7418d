"""Client samplers: which S of the N clients take part in a round, and their registry.

A sampler is a pure function ``sample(key, round_index, num_clients, clients_per_round,
**options) -> ids`` returning S DISTINCT int32 client ids; it runs inside the compiled
round (``key`` is the round's sampling key, ``round_index`` a traced int32), so its
options are fixed for the program (Python values, not data). The engine checks the
first round's ids are distinct and in range (:func:`check_sampler`).

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

from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options

#: ``sampler(key, round_index, num_clients, clients_per_round) -> int32 [S]``.
Sampler = Callable[[jax.Array, jax.Array, int, int], jax.Array]


def sample_clients(key: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """S distinct client ids, uniformly without replacement (int32 ``[S]``).

    Every S-subset of the N clients is equally likely. For S << N this uses Floyd's
    algorithm (O(S²) work, no O(N) pass; timings in benchmarks/README.md); otherwise a
    permutation of all N ids.
    """
    n, s = num_clients, clients_per_round
    if s == n or s * s > 16 * n * max(1, n.bit_length()):
        return jr.permutation(key, n)[:s].astype(jnp.int32)
    keys = jr.split(key, s)

    def add_one(i, chosen):
        # Floyd: draw j in [0, t]; take j unless already chosen, in which case take t
        # (which cannot be chosen yet). Each step keeps the chosen set uniform.
        t = n - s + i
        j = jr.randint(keys[i], (), 0, t + 1, dtype=jnp.int32)
        return chosen.at[i].set(jnp.where(jnp.any(chosen == j), t, j))

    return jax.lax.fori_loop(0, s, add_one, jnp.full((s,), -1, jnp.int32))


def uniform(key, round_index, num_clients: int, clients_per_round: int) -> jax.Array:
    """The paper's sampler: S of N uniformly without replacement, fresh every round."""
    del round_index  # the key is the round's already
    return sample_clients(key, num_clients, clients_per_round)


class SamplerSpec(NamedTuple):
    """A registered client sampler.

    Attributes:
      sample: ``sample(key, round_index, num_clients, clients_per_round, **options) ->
        int32 [S]`` distinct ids.
      options: ``{name: Option}``, its declared options, passed as keywords
        (:attr:`~scaffold_jax.registry.Option.argument`, else the name).
    """

    sample: Callable[..., jax.Array]
    options: Mapping[str, Option] = {}


SAMPLERS: Registry[SamplerSpec] = Registry("client sampler")
SAMPLERS.register("uniform", SamplerSpec(uniform))

#: The sampler of a config or simulation that names none.
DEFAULT_SAMPLER = "uniform"


def make(name: str, options: Mapping[str, Any] | None = None) -> Sampler:
    """The registered sampler ``name`` with its options (given, else their defaults)."""
    spec = SAMPLERS[name]
    values = resolve_options(spec.options, options or {})
    return functools.partial(spec.sample, **factory_kwargs(spec.options, values))


def check_sampler(sampler: Sampler, num_clients: int, clients_per_round: int) -> None:
    """Raises ValueError unless the sampler's first rounds give S distinct ids in [0, N).

    Runs it eagerly on rounds 0 and 1 (cheap: S ids), before anything is compiled.
    """
    for round_index in (0, 1):
        ids = np.asarray(sampler(jr.key(0), jnp.int32(round_index), num_clients, clients_per_round))
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
