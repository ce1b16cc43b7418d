"""Stragglers: how many of its planned local steps each sampled client completes.

A client that runs out of time sends what it has: its update after K_i <= K steps. A
straggler model draws K_i for every sampled client every round; the engine cuts the
client's step mask after K_i steps, and the local loop already stops after a client's
last non-empty step, so a round costs what its slowest client's steps cost (clients of
similar K_i share a vmapped chunk). What each algorithm makes of unequal work is its
contract: FedNova normalises each update by the steps actually taken (its τ_i); SCAFFOLD
option II divides by them (c_i⁺ = c_i − c + (x − y_i)/(K_i η_l)); FedAvg, FedProx, FedDyn
and SCAFFOLD option I average the updates as they come (a short update counts as much as
a full one).

A model is a frozen value with ``steps(key, seed_key, ids, planned) -> int32 [S]``:
``planned`` the clients' planned steps (the batch plan's K, or E·⌈n_i/B⌉ under an epochs
plan), ``key`` the round's straggler key, ``seed_key`` a key of the run that does not
change with the round (for what is fixed per client, such as its speed). Every draw is
made from ``fold_in(key, client_id)``: a client's K_i never depends on its position in
the sampled set, and the configs of one seed in a sweep see the same K_i. A model may
also have ``check(most_steps)``, which raises ValueError when its options cannot mean
anything for a plan whose clients take at most ``most_steps`` local steps.

Registered (:data:`STRAGGLERS`; ``--stragglers``):

- ``none``: every client completes its K steps (the default).
- ``uniform``: K_i uniform on {k_min, ..., K} (``straggler_min_steps``; FedNova's
  experiments draw local work this way), fresh every round.
- ``speed``: a device speed s_i, fixed per client (uniform on ``[straggler_min_speed,
  1]``), times a per-round load factor uniform on ``[1 − straggler_jitter, 1]``:
  K_i = ⌈K · s_i · f⌉, at least 1. Slow devices are slow every round.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.participation.base import ModelSpec, per_client_uniform
from scaffold_jax.registry import Option, Registry


@dataclasses.dataclass(frozen=True)
class UniformSteps:
    """K_i uniform on {min(k_min, K), ..., K}, drawn every round."""

    min_steps: int = 1
    name: ClassVar[str] = "uniform"

    def check(self, most_steps: int) -> None:
        """Refuses k_min above the plan's most local steps: every client would complete all
        its steps (k_min is capped at K), and nothing would straggle."""
        if self.min_steps > most_steps:
            raise ValueError(
                f"straggler_min_steps = {self.min_steps} exceeds K = {most_steps}, the most "
                "local steps the plan gives a client: every client would complete all its "
                f"steps (k_min is capped at K), so none would straggle. Use "
                f"straggler_min_steps <= {most_steps}, or a plan of more local steps."
            )

    def steps(self, key, seed_key, ids, planned):
        del seed_key
        planned = jnp.asarray(planned, jnp.int32)
        low = jnp.minimum(self.min_steps, planned)
        u = per_client_uniform(key, ids)
        drawn = low + jnp.floor(u * (planned - low + 1).astype(jnp.float32)).astype(jnp.int32)
        return jnp.clip(drawn, low, planned)  # u < 1, but float rounding could reach K + 1


@dataclasses.dataclass(frozen=True)
class Speed:
    """K_i = ⌈K · s_i · f⌉: a fixed per-client speed times a per-round load factor."""

    min_speed: float = 0.2
    jitter: float = 0.5
    name: ClassVar[str] = "speed"

    def speeds(self, seed_key: jax.Array, ids: jax.Array) -> jax.Array:
        """The clients' fixed speeds s_i in ``[min_speed, 1]`` (float32 ``[S]``)."""
        u = per_client_uniform(jr.fold_in(seed_key, 1), ids)
        return self.min_speed + (1.0 - self.min_speed) * u

    def steps(self, key, seed_key, ids, planned):
        planned = jnp.asarray(planned, jnp.int32)
        factor = 1.0 - self.jitter * per_client_uniform(key, ids)
        work = jnp.ceil(planned.astype(jnp.float32) * self.speeds(seed_key, ids) * factor)
        return jnp.clip(work.astype(jnp.int32), jnp.minimum(1, planned), planned)


STRAGGLERS: Registry[ModelSpec] = Registry("straggler model")
STRAGGLERS.register("none", ModelSpec(None))
STRAGGLERS.register(
    "uniform",
    ModelSpec(
        UniformSteps,
        {
            "straggler_min_steps": Option(
                1, "uniform stragglers: the fewest local steps a client completes (k_min)",
                "int", low=1, argument="min_steps",
            ),
        },
    ),
)  # fmt: skip
STRAGGLERS.register(
    "speed",
    ModelSpec(
        Speed,
        {
            "straggler_min_speed": Option(
                0.2, "speed stragglers: the slowest device's fraction of the planned steps",
                "float", low=0.0, high=1.0, strict=True, argument="min_speed",
            ),
            "straggler_jitter": Option(
                0.5, "speed stragglers: a round's load factor is uniform on [1 - jitter, 1]",
                "float", low=0.0, high=1.0, argument="jitter",
            ),
        },
    ),
)  # fmt: skip
