"""Aggregation weightings: how much each client counts, and their registry.

A weighting is a pure function ``weigh(counts, **options) -> p`` that gives each of the N
clients a weight ``p_i > 0`` from its number of training examples (``counts``: float32
``[N]``; traced inside the compiled round). The server averages the round's S clients with
weights ``p_i`` (and the stateful algorithms normalise by ``Σ_j p_j`` over all N clients:
SCAFFOLD's ``c = Σ p_i c_i / Σ p_j``), and the training objective the engine reports is
``Σ_i p_i f_i / Σ_j p_j``.

* ``uniform``: ``p_i = 1`` (the paper's 1/|S| averaging; the objective is the mean of the
  clients' losses);
* ``num_examples``: ``p_i = n_i`` (FedAvg's weighting; the objective is the mean over all
  examples).

A new weighting is a function plus one registration, ``WEIGHTINGS.register("name",
WeightingSpec(weigh, "description", {"option": Option(...)}))``, in any module (a plugin);
a config chooses it with ``weighting = "name"`` and its options are config keys.

Examples:
  >>> import jax.numpy as jnp
  >>> make("num_examples")(jnp.asarray([2.0, 6.0])).tolist()
  [2.0, 6.0]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options

#: ``weigh(counts [N] float32) -> [N] float32`` client weights.
Weighting = Callable[[jax.Array], jax.Array]


class WeightingSpec(NamedTuple):
    """A registered weighting.

    Attributes:
      weigh: ``weigh(counts, **options) -> [N]`` positive weights (traceable).
      description: one line for help texts.
      options: ``{name: Option}``, its declared options, passed as keywords.
      equal: every client counts the same whatever its size (the engine then needs no
        ``[N]`` weight vector: a million procedural clients cost nothing here).
    """

    weigh: Callable[..., jax.Array]
    description: str
    options: Mapping[str, Option] = {}
    equal: bool = False


WEIGHTINGS: Registry[WeightingSpec] = Registry("weighting")


def _ones(counts: jax.Array) -> jax.Array:
    # A function of this package, not jnp.ones_like itself: a run's identity records the
    # code of chosen entries defined outside scaffold_jax (a plugin's), and jax's own
    # file would have made any jax upgrade refuse every resume.
    return jnp.ones_like(counts)


WEIGHTINGS.register(
    "uniform",
    WeightingSpec(_ones, "every client counts the same (the paper's 1/|S| averaging)", equal=True),
)
WEIGHTINGS.register(
    "num_examples",
    WeightingSpec(lambda counts: counts, "each client counts its number of examples n_i"),
)


def make(name: str, options: Mapping[str, Any] | None = None) -> Weighting:
    """The registered weighting ``name`` with its options (given, else their defaults)."""
    spec = WEIGHTINGS[name]
    values = resolve_options(spec.options, options or {})
    return functools.partial(spec.weigh, **factory_kwargs(spec.options, values))
