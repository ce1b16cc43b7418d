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

from scaffold_jax import optimizers
from scaffold_jax.algorithms.fedavg import fedavg
from scaffold_jax.algorithms.feddyn import feddyn
from scaffold_jax.algorithms.fednova import fednova
from scaffold_jax.algorithms.fedprox import fedprox
from scaffold_jax.algorithms.mime import DEFAULT_BASE, mime, mimelite
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
        """``value`` in its canonical form (unchanged without ``normalize``).

        Raises:
          ValueError: ``normalize`` refuses the value (the message says why).
        """
        return value if self.normalize is None else self.normalize(value)

    @property
    def is_switch(self) -> bool:
        """Whether it is an on/off option (the command line gives it as a bare flag)."""
        return self.choices == (False, True)


class AlgorithmSpec(NamedTuple):
    """A registry entry: how to build an algorithm and what the layers above read.

    Attributes:
      factory: ``factory(loss_fn, **options) -> Algorithm``.
      display_name: how tables and plots name it ("SCAFFOLD").
      default_plan: the batch-plan kind a config uses when it sets none: ``"fraction"``
        (the paper's batches of 0.2 of the client's data) or ``"full"`` (one full-batch
        gradient, large-batch SGD).
      options: ``{config field: Option}``, the factory options a config may set.
      refuses: ``{config field: why}`` for options of other algorithms this one does not
        take for a reason worth telling (SCAFFOLD and a local optimizer); a config that
        sets one gets the reason.
    """

    factory: Callable[..., Algorithm]
    display_name: str
    default_plan: str = "fraction"
    options: Mapping[str, Option] = {}
    refuses: Mapping[str, str] = {}

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
    refuses: Mapping[str, str] | None = None,
) -> AlgorithmSpec:
    """Registers an algorithm factory under ``name`` (see :class:`AlgorithmSpec`)."""
    if default_plan not in ("fraction", "full"):
        raise ValueError(f"default_plan={default_plan!r} is unknown; use 'fraction' or 'full'.")
    spec = AlgorithmSpec(
        factory, display_name or name, default_plan, dict(options or {}), dict(refuses or {})
    )
    return ALGORITHMS.register(name, spec, replace=replace)


def optimizer_option(argument: str, default: str, what: str) -> Option:
    """A factory option naming an optimizer of :mod:`scaffold_jax.optimizers` by spec
    (``"adam:b2=0.99"``), stored in its canonical spelling."""
    return Option(
        argument,
        default,
        f"{what}: NAME or NAME:PARAM=VALUE,... with NAME one of {optimizers.describe()}",
        normalize=optimizers.canonical,
    )


#: FedOpt (Reddi et al. 2021): every built-in algorithm takes a server optimizer.
SERVER_OPTIMIZER = {
    "server_optimizer": optimizer_option(
        "server_optimizer", "sgd", "server optimizer on the pseudo-gradient -mean(dy)"
    )
}
#: A local optimizer, state fresh every round (FedAvg and FedProx).
LOCAL_OPTIMIZER = {
    "local_optimizer": optimizer_option(
        "local_optimizer", "sgd", "local (client) optimizer, state fresh every round"
    )
}


def make(name: str, loss_fn, **kwargs):
    """Builds a registered algorithm by name; ``kwargs`` go to its factory as they are."""
    return ALGORITHMS[name].factory(loss_fn, **kwargs)


register(
    "scaffold",
    scaffold,
    "SCAFFOLD",
    options={
        **SERVER_OPTIMIZER,
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
        "warm_controls": Option(
            "warm_controls",
            False,
            "SCAFFOLD: start every c_i at its full-batch gradient at x0 (one pass over all "
            "data) instead of 0",
            (False, True),
            lambda v: _switch("warm_controls", v),
        ),
    },
    refuses={
        "local_optimizer": "SCAFFOLD's correction c - c_i is defined for plain SGD local "
        "steps; momentum or Adam around the corrected gradient changes what the controls "
        "estimate (a known cause of failed SCAFFOLD reproductions). Use plain SGD, or "
        "fedavg / fedprox with a local optimizer",
    },
)
register("fedavg", fedavg, "FedAvg", options={**SERVER_OPTIMIZER, **LOCAL_OPTIMIZER})
register("feddyn", feddyn, "FedDyn", options=SERVER_OPTIMIZER)
register(
    "fednova",
    fednova,
    "FedNova",
    options=SERVER_OPTIMIZER,
    refuses={
        "local_optimizer": "FedNova's normalisation here is that of vanilla local SGD (the "
        "paper's a_i = tau_i); with momentum its weights differ"
    },
)
register("fedprox", fedprox, "FedProx", options={**SERVER_OPTIMIZER, **LOCAL_OPTIMIZER})
_BASE = {
    **SERVER_OPTIMIZER,
    "base_optimizer": optimizer_option(
        "base_optimizer", optimizers.canonical(DEFAULT_BASE), "Mime's base optimizer B"
    ),
}
_MIME_REFUSES = {
    "local_optimizer": "Mime's local steps already apply the base optimizer, frozen; set it "
    "with base_optimizer"
}
register("mime", mime, "Mime", options=_BASE, refuses=_MIME_REFUSES)
register("mimelite", mimelite, "MimeLite", options=_BASE, refuses=_MIME_REFUSES)
register("sgd", sgd, "SGD", default_plan="full", options=SERVER_OPTIMIZER)


def _switch(name: str, value: Any) -> Any:
    """An on/off option's value as a bool (``true``/``false``, ``1``/``0``, ``yes``/``no``
    as text); other values are returned as they are, for the choices check to refuse."""
    if isinstance(value, str):
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
            value.strip().lower(), value
        )
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return value


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
    "mime",
    "mimelite",
    "register",
    "scaffold",
    "sgd",
]
