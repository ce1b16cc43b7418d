"""What the three kinds of participation model share: the registry entry and the bundle
the engine runs.

A participation model is built once per simulation from its registered factory and its
declared options; it is a frozen value whose methods are traced into the round (Python
values, not data: changing one recompiles, as changing S does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.registry import Option


def constants_key(key: jax.Array) -> jax.Array:
    """A key of the run that no round's key equals (the rounds fold in their index, which
    never reaches 2³² − 1): for what a participation model fixes per client for the whole
    run, such as a straggler's device speed or a client's device profile. Here, below the
    engine, so that a model can say on the host what the engine will draw."""
    return jr.fold_in(key, np.uint32(2**32 - 1))


class ModelSpec(NamedTuple):
    """A registered participation model.

    Attributes:
      build: ``build(**options) -> model``, or None for the entry that models nothing
        (every client always available, always finishing, never dropping: today's
        simulation, bitwise).
      options: ``{name: Option}``, its declared options, passed to ``build`` as keywords
        (:attr:`~scaffold_jax.registry.Option.argument`, else the name).
    """

    build: Callable[..., Any] | None
    options: Mapping[str, Option] = {}


class Participation(NamedTuple):
    """The participation models of a simulation (each None: the paper's idealised client).

    Attributes:
      availability: which clients can be sampled in a round
        (:mod:`scaffold_jax.participation.availability`); it may keep a state of its own in
        :attr:`SimState.participation <scaffold_jax.types.SimState>`.
      stragglers: how many of its planned local steps each sampled client completes
        (:mod:`scaffold_jax.participation.stragglers`).
      dropouts: which sampled clients' updates never reach the server
        (:mod:`scaffold_jax.participation.dropouts`).
      profiles: the clients' devices and the round's virtual clock, with its deadline
        and over-selection (:mod:`scaffold_jax.participation.clock`).
    """

    availability: Any = None
    stragglers: Any = None
    dropouts: Any = None
    profiles: Any = None

    @property
    def partial(self) -> bool:
        """Whether a round can end with fewer clients at the server than were sampled:
        what differential privacy's accounting and full-participation algorithms
        (Scaffnew) refuse."""
        late = self.profiles is not None and self.profiles.drops
        return self.availability is not None or self.dropouts is not None or late

    def sampled(self, clients_per_round: int) -> int:
        """How many clients a round samples: S, or ⌈f·S⌉ under the clock's over-selection."""
        if self.profiles is None:
            return clients_per_round
        return self.profiles.sampled(clients_per_round)

    def describe(self) -> list[str]:
        """The active models in words, for messages (``["availability = 'markov'", ...]``)."""
        return [f"{kind} = {model.name!r}" for kind, model in self._asdict().items() if model]


def per_client_uniform(key: jax.Array, ids: jax.Array) -> jax.Array:
    """One U[0, 1) draw per client id (float32 ``[S]``), from ``fold_in(key, id)``: what a
    client draws depends on its id, never on its position in the sampled set."""
    return jax.vmap(lambda i: jr.uniform(jr.fold_in(key, i)))(jnp.asarray(ids, jnp.int32))
