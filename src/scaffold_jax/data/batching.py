"""Batch plans: which of a client's examples each of its K local steps sees.

A plan is static (it fixes the shapes ``[K, B]`` of a round's batches). For one client it
turns ``(key, count)`` into positions ``[K, B]`` in ``[0, count)`` and a mask ``[K, B]``;
slots beyond a client's data are masked to 0 and contribute nothing. A step whose mask is
all zero is skipped entirely (that is how clients of unequal size take different numbers of
steps under ``epochs`` and ``fraction`` plans).

Plans:
  * ``fixed(batch_size, num_steps)``: K steps; each draws ``min(B, n_i)`` distinct examples
    uniformly at random (steps are independent of each other).
  * ``epochs(batch_size, num_epochs)``: each epoch is a fresh permutation of the client's
    data cut into ``ceil(n_i / B)`` batches (the last one short), so client i takes
    ``num_epochs * ceil(n_i / B)`` steps; K is the maximum over clients.
  * ``fraction(fraction, num_epochs)``: the paper's plan. Each epoch is a permutation cut
    into ``round(1 / fraction)`` near-equal batches (0.2 ⇒ 5 steps per epoch), so every
    client takes the same K = epochs × steps-per-epoch, with batch size ≈ fraction × n_i.
  * ``full(num_steps)``: every step uses all of the client's data (full-batch gradients,
    no randomness).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.registry import Option, Registry

_KINDS = ("fixed", "epochs", "fraction", "full")

#: The most local steps K a plan may give a client in one round. A round's batches
#: ``[S, K, B, ...]`` and its per-step metrics are built in memory, and its K steps run as
#: one scan: 10**9 steps would fail deep inside XLA (out of memory) instead of here.
MAX_LOCAL_STEPS = 100_000
#: The largest batch (a client's example positions are int32; no client holds more).
MAX_BATCH_SIZE = 2**30
_TOO_MANY = f"at most {MAX_LOCAL_STEPS} local steps per round are allowed (a round's batches "
_TOO_MANY += "[S, K, B, ...] are built in memory)"


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """A static description of the local steps. Build it with the constructors below."""

    kind: str
    batch_size: int = 0
    num_steps: int = 0
    num_epochs: int = 0
    fraction: float = 0.0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"BatchPlan kind {self.kind!r} is unknown; use one of {_KINDS}.")
        if self.kind in ("fixed", "full") and self.num_steps < 1:
            raise ValueError(f"num_local_steps (K) = {self.num_steps} is invalid: it must be >= 1.")
        if self.kind in ("fixed", "epochs") and self.batch_size < 1:
            raise ValueError(f"batch_size = {self.batch_size} is invalid: it must be >= 1.")
        if self.kind in ("fixed", "epochs") and self.batch_size > MAX_BATCH_SIZE:
            # Positions in a client's data are int32 (count + batch must not overflow).
            raise ValueError(
                f"batch_size = {self.batch_size} is invalid: at most {MAX_BATCH_SIZE} examples "
                "a batch are allowed (a client's positions are int32); use a smaller batch."
            )
        if self.kind in ("epochs", "fraction") and self.num_epochs < 1:
            raise ValueError(f"num_epochs = {self.num_epochs} is invalid: it must be >= 1.")
        if self.kind == "fraction" and not 0.0 < self.fraction <= 1.0:
            raise ValueError(
                f"batch fraction = {self.fraction} is invalid: it must be in (0, 1]; "
                "the paper uses 0.2 (5 steps per epoch)."
            )
        if self.kind in ("fixed", "full") and self.num_steps > MAX_LOCAL_STEPS:
            raise ValueError(
                f"num_local_steps (K) = {self.num_steps} is invalid: {_TOO_MANY}; use fewer."
            )
        if self.kind == "epochs" and self.num_epochs > MAX_LOCAL_STEPS:
            # Every epoch is at least one step, whatever the data.
            raise ValueError(
                f"num_epochs = {self.num_epochs} is invalid: it makes K >= {self.num_epochs} "
                f"local steps per round; {_TOO_MANY}. Use fewer epochs."
            )
        if self.kind == "fraction":
            per_epoch = 1.0 / self.fraction  # inf for the smallest subnormal fraction
            num_steps = self.num_epochs * round(per_epoch) if per_epoch < 1e300 else math.inf
            if num_steps > MAX_LOCAL_STEPS:
                steps = f"= {num_steps}" if per_epoch < 1e300 else "> 1e300"
                raise ValueError(
                    f"batch fraction = {self.fraction} with num_epochs = {self.num_epochs} makes "
                    f"K {steps} local steps per round (num_epochs * round(1 / fraction)); "
                    f"{_TOO_MANY}. Use a larger fraction or fewer epochs."
                )

    @classmethod
    def fixed(cls, batch_size: int, num_steps: int) -> BatchPlan:
        return cls(
            "fixed",
            batch_size=_integer("batch_size", batch_size),
            num_steps=_integer("num_local_steps (K)", num_steps),
        )

    @classmethod
    def epochs(cls, batch_size: int, num_epochs: int) -> BatchPlan:
        return cls(
            "epochs",
            batch_size=_integer("batch_size", batch_size),
            num_epochs=_integer("num_epochs", num_epochs),
        )

    @classmethod
    def fraction_of_data(cls, fraction: float, num_epochs: int) -> BatchPlan:
        return cls(
            "fraction", fraction=float(fraction), num_epochs=_integer("num_epochs", num_epochs)
        )

    @classmethod
    def full(cls, num_steps: int = 1) -> BatchPlan:
        return cls("full", num_steps=_integer("num_local_steps (K)", num_steps))

    @property
    def steps_per_epoch_fraction(self) -> int:
        return max(1, round(1.0 / self.fraction))

    def shape(self, max_count: int) -> tuple[int, int]:
        """``(K, B)`` of the padded batches for clients of at most ``max_count`` examples."""
        if self.kind == "fixed":
            return self.num_steps, min(self.batch_size, max_count)
        if self.kind == "epochs":
            num_steps = self.num_epochs * math.ceil(max_count / self.batch_size)
            if num_steps > MAX_LOCAL_STEPS:  # the one plan whose K depends on the data
                raise ValueError(
                    f"batch_size = {self.batch_size} with num_epochs = {self.num_epochs} makes "
                    f"K = {num_steps} local steps per round for the largest client "
                    f"({max_count} examples: num_epochs * ceil(n / batch_size)); {_TOO_MANY}. "
                    "Use a larger batch_size or fewer epochs."
                )
            return num_steps, min(self.batch_size, max_count)
        if self.kind == "fraction":
            spe = self.steps_per_epoch_fraction
            return self.num_epochs * spe, math.ceil(max_count / spe)
        return self.num_steps, max_count

    @property
    def steps_vary(self) -> bool:
        """Whether clients of different sizes take different numbers of steps (only an
        ``epochs`` plan: E · ceil(n_i / B))."""
        return self.kind == "epochs"

    def local_steps(self, count: jax.Array) -> jax.Array:
        """The number of steps up to a client's last non-empty one, for ``count`` examples
        (int32, traceable): E · ceil(n_i / B) under an ``epochs`` plan, K otherwise."""
        count = jnp.asarray(count, jnp.int32)
        if self.kind == "epochs":
            return self.num_epochs * ((count + self.batch_size - 1) // self.batch_size)
        return jnp.full(jnp.shape(count), self.shape(1)[0], jnp.int32)

    def examples(self, count: jax.Array, steps: jax.Array) -> jax.Array:
        """The examples a client of ``count`` examples processes in its first ``steps``
        local steps (int32, traceable): what its device works through (a virtual clock's
        compute time, :mod:`scaffold_jax.participation.clock`)."""
        count = jnp.asarray(count, jnp.int32)
        steps = jnp.asarray(steps, jnp.int32)
        if self.kind == "fixed":
            return steps * jnp.minimum(self.batch_size, count)
        if self.kind == "full":
            return steps * count
        if self.kind == "epochs":
            per_epoch = jnp.maximum((count + self.batch_size - 1) // self.batch_size, 1)
            done, within = steps // per_epoch, steps % per_epoch
            return done * count + jnp.minimum(within * self.batch_size, count)
        spe = self.steps_per_epoch_fraction
        done, within = steps // spe, steps % spe
        return done * count + (within * count) // spe

    def positions(
        self, key: jax.Array, count: jax.Array, max_count: int
    ) -> tuple[jax.Array, jax.Array]:
        """Positions ``[K, B]`` (int32, in ``[0, count)``) and mask ``[K, B]`` (float32).

        Args:
          key: the client's key for this round.
          count: the client's number of examples n_i (int32 scalar, may be traced).
          max_count: static upper bound on ``count`` (the padded width).
        """
        num_steps, width = self.shape(max_count)
        slots = jnp.arange(width)
        count = jnp.asarray(count, jnp.int32)
        if self.kind == "full":
            pos = jnp.broadcast_to(
                jnp.minimum(slots, jnp.maximum(count - 1, 0)), (num_steps, width)
            )
            mask = jnp.broadcast_to(slots < count, (num_steps, width))
            return pos.astype(jnp.int32), mask.astype(jnp.float32)
        if self.kind == "fixed":
            pos = _permutations(key, count, max_count, num_steps, width)  # [K, B]
            mask = jnp.broadcast_to(slots < count, (num_steps, width))
            # Padded slots point at the client's own first example, never at a neighbour's
            # rows: a masked slot is multiplied by 0, and NaN * 0 would still be NaN.
            return jnp.where(mask, pos, 0), mask.astype(jnp.float32)
        if self.kind == "epochs":
            perms = _permutations(key, count, max_count, self.num_epochs)  # [E, max_count]
            batch = self.batch_size
            steps_per_epoch = (count + batch - 1) // batch  # per client, traced
            t = jnp.arange(num_steps)
            epoch = t // jnp.maximum(steps_per_epoch, 1)
            within = t % jnp.maximum(steps_per_epoch, 1)
            start = within * batch  # [K]
            idx = start[:, None] + slots[None, :]  # [K, B]
            valid = (idx < count) & (epoch < self.num_epochs)[:, None]
            epoch = jnp.minimum(epoch, self.num_epochs - 1)
            pos = perms[epoch[:, None], jnp.minimum(idx, max_count - 1)]
            return jnp.where(valid, pos, 0).astype(jnp.int32), valid.astype(jnp.float32)
        # fraction: epoch e, batch j covers [floor(j n / s), floor((j + 1) n / s)).
        spe = self.steps_per_epoch_fraction
        perms = _permutations(key, count, max_count, self.num_epochs)
        t = jnp.arange(num_steps)
        epoch, j = t // spe, t % spe
        start = (j * count) // spe
        stop = ((j + 1) * count) // spe
        idx = start[:, None] + slots[None, :]
        valid = idx < stop[:, None]
        pos = perms[epoch[:, None], jnp.minimum(idx, max_count - 1)]
        return jnp.where(valid, pos, 0).astype(jnp.int32), valid.astype(jnp.float32)


def _integer(name: str, value) -> int:
    """``value`` as an int; a fractional value is an error, not a silent truncation."""
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(f"{name} = {value!r} is invalid: it must be a whole number.")
    return int(value)


class PlanSpec(NamedTuple):
    """A registered batch plan a config names (``batch_plan``).

    Attributes:
      make: ``make(**options) -> BatchPlan``.
      description: one line for help texts.
      options: ``{name: Option}``, its declared options (an option without a default is
        required).
    """

    make: Callable[..., BatchPlan]
    description: str
    options: Mapping[str, Option]


_EPOCHS = Option(1, "local epochs (fraction / epochs plans)", "int", low=1)
_STEPS = Option(1, "local steps K (fixed / full plans)", "int", low=1)
_BATCH = Option(None, "batch size B (fixed / epochs plans)", "int", low=1)

#: The batch plans a config may name; with ``batch_plan`` unset the config infers one from
#: the options it gives (see :meth:`scaffold_jax.experiments.RunConfig.resolved_plan_kind`).
PLANS: Registry[PlanSpec] = Registry("batch plan")
PLANS.register("fraction", PlanSpec(
    lambda batch_fraction, local_epochs: BatchPlan.fraction_of_data(batch_fraction, local_epochs),
    "batches of a fraction of the client's data, for E epochs (the paper's local methods)",
    {"batch_fraction": Option(0.2, "batch as a fraction of the client's data (0.2 = 5 steps "
                              "per epoch)", "float", low=0.0, high=1.0, strict=True,
                              what="in (0, 1] (the paper uses 0.2)"),
     "local_epochs": _EPOCHS},
))  # fmt: skip
PLANS.register("epochs", PlanSpec(
    lambda batch_size, local_epochs: BatchPlan.epochs(batch_size, local_epochs),
    "batches of B examples for E epochs (clients of different sizes take different K)",
    {"batch_size": _BATCH, "local_epochs": _EPOCHS},
))  # fmt: skip
PLANS.register("fixed", PlanSpec(
    lambda batch_size, local_steps: BatchPlan.fixed(batch_size, local_steps),
    "K steps of B examples",
    {"batch_size": _BATCH, "local_steps": Option(None, _STEPS.help, "int", low=1)},
))  # fmt: skip
PLANS.register("full", PlanSpec(
    lambda local_steps: BatchPlan.full(local_steps),
    "K full-batch steps on the client's data (the paper's SGD: K = 1)",
    {"local_steps": _STEPS},
))  # fmt: skip


def _permutations(
    key: jax.Array, count: jax.Array, max_count: int, num: int, width: int | None = None
) -> jax.Array:
    """``num`` independent permutations; the first ``count`` entries of each row are a
    uniformly random permutation of ``[0, count)`` (padding sorts to the end).

    Only the first ``width`` entries of each row are returned (default: all ``max_count``).
    They are the indices of the ``width`` smallest of ``max_count`` uniforms, taken with
    ``lax.top_k`` on the negated uniforms: the same values, in the same order, as a stable
    ``argsort(u)[:, :width]`` (top_k puts the lower index first on ties, as a stable sort
    does), but a partial selection instead of a full comparator sort: much cheaper for a
    fixed plan's few slots out of a client's examples, and cheaper even for a whole
    permutation (the figures are in benchmarks/README.md).
    """
    width = max_count if width is None else width
    u = jr.uniform(key, (num, max_count))
    u = jnp.where(jnp.arange(max_count) < count, u, 2.0)
    return jax.lax.top_k(-u, width)[1].astype(jnp.int32)
