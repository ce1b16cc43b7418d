"""The algorithms, one module each, and the algorithm registry.

An entry of :data:`ALGORITHMS` (an :class:`AlgorithmSpec`) says how to build the algorithm
and what the layers above need to know about it without naming it: its display name, its
default batch plan, the factory options a config may set, and (from the algorithm itself)
its declared hyper-parameters. A new algorithm is its own module plus ONE :func:`register`
call; one defined outside the package registers itself when its module is imported (see
:mod:`scaffold_jax.registry`).

Examples:
  >>> from scaffold_jax import algorithms
  >>> spec = algorithms.ALGORITHMS["fedprox"]
  >>> spec.display_name, list(spec.hparams)
  ('FedProx', ['client_lr', 'server_lr', 'prox_mu'])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from scaffold_jax.algorithms.fedavg import fedavg
from scaffold_jax.algorithms.feddyn import feddyn
from scaffold_jax.algorithms.fednova import fednova
from scaffold_jax.algorithms.fedprox import fedprox
from scaffold_jax.algorithms.scaffold import (
    ScaffoldClientState,
    ScaffoldServerState,
    client_controls,
    option_name,
    scaffold,
)
from scaffold_jax.algorithms.sgd import sgd
from scaffold_jax.registry import Registry
from scaffold_jax.types import Algorithm, HParam


class Option(NamedTuple):
    """A factory option a config may set (a ``RunConfig`` field of the same name).

    Attributes:
      argument: the factory's keyword argument it is passed as.
      default: its default value.
      help: one line for ``--help``.
      choices: the allowed values, or None for any.
      normalize: maps a given value to its canonical form before it is checked (e.g.
        SCAFFOLD's option ``2`` to ``"II"``), or None.
    """

    argument: str
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    normalize: Callable[[Any], Any] | None = None

    def parse(self, value: Any) -> Any:
        """``value`` in its canonical form (unchanged without ``normalize``)."""
        return value if self.normalize is None else self.normalize(value)


class AlgorithmSpec(NamedTuple):
    """A registry entry: how to build an algorithm and what the layers above read.

    Attributes:
      factory: ``factory(loss_fn, **options) -> Algorithm``.
      display_name: how tables and plots name it ("SCAFFOLD").
      default_plan: the batch-plan kind a config uses when it sets none: ``"fraction"``
        (the paper's batches of 0.2 of the client's data) or ``"full"`` (one full-batch
        gradient, large-batch SGD).
      options: ``{config field: Option}``, the factory options a config may set.
    """

    factory: Callable[..., Algorithm]
    display_name: str
    default_plan: str = "fraction"
    options: Mapping[str, Option] = {}

    @property
    def hparams(self) -> Mapping[str, HParam]:
        """The hyper-parameters the algorithm declares (read from a built instance)."""
        return self.build(lambda params, batch: jnp.zeros(())).hparams

    def build(self, loss_fn, **options: Any) -> Algorithm:
        """The algorithm for ``loss_fn``; ``options`` are config fields of :attr:`options`
        (others are ignored, so one config serves every algorithm)."""
        kwargs = {opt.argument: options[k] for k, opt in self.options.items() if k in options}
        return self.factory(loss_fn, **kwargs)


ALGORITHMS: Registry[AlgorithmSpec] = Registry("algorithm")


def register(
    name: str,
    factory: Callable[..., Algorithm],
    display_name: str | None = None,
    default_plan: str = "fraction",
    options: Mapping[str, Option] | None = None,
    replace: bool = False,
) -> AlgorithmSpec:
    """Registers an algorithm factory under ``name`` (see :class:`AlgorithmSpec`)."""
    if default_plan not in ("fraction", "full"):
        raise ValueError(f"default_plan={default_plan!r} is unknown; use 'fraction' or 'full'.")
    spec = AlgorithmSpec(factory, display_name or name, default_plan, dict(options or {}))
    return ALGORITHMS.register(name, spec, replace=replace)


def make(name: str, loss_fn, **kwargs):
    """Builds a registered algorithm by name; ``kwargs`` go to its factory as they are."""
    return ALGORITHMS[name].factory(loss_fn, **kwargs)


register(
    "scaffold",
    scaffold,
    "SCAFFOLD",
    options={
        "scaffold_option": Option(
            "option",
            "II",
            "SCAFFOLD control update: II (the paper's default) or I",
            ("I", "II"),
            option_name,
        ),
        "control_dtype": Option(
            "control_dtype",
            "float32",
            "storage dtype of SCAFFOLD's client controls",
            ("float32", "bfloat16"),
        ),
    },
)
register("fedavg", fedavg, "FedAvg")
register("feddyn", feddyn, "FedDyn")
register("fednova", fednova, "FedNova")
register("fedprox", fedprox, "FedProx")
register("sgd", sgd, "SGD", default_plan="full")

__all__ = [
    "ALGORITHMS",
    "AlgorithmSpec",
    "Option",
    "ScaffoldClientState",
    "ScaffoldServerState",
    "client_controls",
    "fedavg",
    "feddyn",
    "fednova",
    "fedprox",
    "make",
    "register",
    "scaffold",
    "sgd",
]
