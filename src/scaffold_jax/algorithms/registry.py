"""The algorithm registry: :data:`ALGORITHMS`, its entries and the options they share.

Every algorithm, built-in or a plugin's, ends its module with :func:`register`; the
package imports the built-in modules in the order their entries are listed (see
:mod:`scaffold_jax.algorithms`). This module imports none of them, so each can import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from scaffold_jax import optimizers
from scaffold_jax.registry import ConfigError, Option, Registry, factory_kwargs
from scaffold_jax.types import Algorithm, HParam


class AlgorithmSpec(NamedTuple):
    """A registry entry: how to build an algorithm and what the layers above read.

    Attributes:
      factory: ``factory(loss_fn, **options) -> Algorithm``.
      display_name: how tables and plots name it ("SCAFFOLD").
      default_plan: the batch-plan kind a config uses when it sets none: ``"fraction"``
        (the paper's batches of 0.2 of the client's data) or ``"full"`` (one full-batch
        gradient, large-batch SGD).
      options: ``{name: Option}``, the factory options it declares
        (:class:`~scaffold_jax.registry.Option`, passed as the keyword
        :attr:`~scaffold_jax.registry.Option.argument`, else the name).
      refuses: ``{config field: why}`` for options of other algorithms this one does not
        take for a reason worth telling (SCAFFOLD and a local optimizer); a config that
        sets one gets the reason.
      name: the registry key; an algorithm built here is given it as its ``name`` ("":
        the factory's own name is kept).
      declared_hparams: the hyper-parameters the factory's algorithms declare, known
        without building one: a mapping, or for a factory whose options change them a
        function of the factory's keyword options (FedDyn's server optimizer adds
        ``server_lr``). None (a plugin that declares none): read from an instance built
        with the default options and a loss that is never called.
      personalized: whether it trains a model per client
        (:attr:`~scaffold_jax.types.Algorithm.personal`): its runs need every client's
        own test data, where the personal models are evaluated.
      asynchronous: whether its asynchronous contract is written (the manual's page “The
        network model”: what a stale update does to its server state), so that FedBuff
        (:mod:`scaffold_jax.engine.buffered`) may run it.
    """

    factory: Callable[..., Algorithm]
    display_name: str
    default_plan: str = "fraction"
    options: Mapping[str, Option] = {}
    refuses: Mapping[str, str] = {}
    name: str = ""
    declared_hparams: Mapping[str, HParam] | Callable[..., Mapping[str, HParam]] | None = None
    asynchronous: bool = False
    personalized: bool = False

    @property
    def hparams(self) -> Mapping[str, HParam]:
        """The hyper-parameters the algorithm declares with its default options."""
        return self.hparams_for({})

    def hparams_for(self, options: Mapping[str, Any]) -> Mapping[str, HParam]:
        """The hyper-parameters the algorithm built with ``options`` (config fields of
        :attr:`options`, the rest at their defaults) declares."""
        declared = self.declared_hparams
        if callable(declared):
            return declared(**factory_kwargs(self.options, options))
        if declared is not None:
            return declared
        return self.build(lambda params, batch: jnp.zeros(()), **options).hparams

    def build(self, loss_fn, **options: Any) -> Algorithm:
        """The algorithm for ``loss_fn``, named by its registry key; ``options`` are config
        fields of :attr:`options` (others are ignored, so one config serves every
        algorithm).

        Raises:
          ValueError: the built algorithm does not declare the :attr:`declared_hparams`.
        """
        algorithm = self.named(self.factory(loss_fn, **factory_kwargs(self.options, options)))
        if callable(self.declared_hparams):
            self._check_declared(algorithm, self.hparams_for(options))
        return algorithm

    def named(self, algorithm: Algorithm) -> Algorithm:
        """``algorithm`` (built by :attr:`factory`) with its registry key as its name,
        checked against :attr:`declared_hparams`."""
        if not isinstance(algorithm, Algorithm):
            factory = f"{self.factory.__module__}.{getattr(self.factory, '__qualname__', '?')}"
            raise ConfigError(
                f"algorithm {self.name!r}: its factory {factory} returned "
                f"{type(algorithm).__name__}, not an Algorithm; make it return one."
            )
        if not callable(self.declared_hparams):
            self._check_declared(algorithm, self.declared_hparams)
        return algorithm._replace(name=self.name) if self.name else algorithm

    def _check_declared(self, algorithm: Algorithm, declared) -> None:
        if declared is not None and set(algorithm.hparams) != set(declared):
            raise ValueError(
                f"algorithm {self.name or algorithm.name!r} was registered declaring the "
                f"hyper-parameters {', '.join(declared) or 'none'}, but its factory built one "
                f"declaring {', '.join(algorithm.hparams) or 'none'}; make register(..., "
                "hparams=) match what the factory declares, or leave it out."
            )


ALGORITHMS: Registry[AlgorithmSpec] = Registry("algorithm")


def register(
    name: str,
    factory: Callable[..., Algorithm],
    display_name: str | None = None,
    default_plan: str = "fraction",
    options: Mapping[str, Option] | None = None,
    replace: bool = False,
    refuses: Mapping[str, str] | None = None,
    hparams: Mapping[str, HParam] | Callable[..., Mapping[str, HParam]] | None = None,
    asynchronous: bool = False,
    personalized: bool = False,
) -> AlgorithmSpec:
    """Registers an algorithm factory under ``name`` (see :class:`AlgorithmSpec`).

    ``hparams``: the hyper-parameters the factory's algorithms declare, or a function of
    the factory's keyword options giving them; the registry then knows them without
    building an algorithm, and checks them against every algorithm it builds.
    """
    if default_plan not in ("fraction", "full"):
        raise ValueError(f"default_plan={default_plan!r} is unknown; use 'fraction' or 'full'.")
    spec = AlgorithmSpec(
        factory,
        display_name or name,
        default_plan,
        dict(options or {}),
        dict(refuses or {}),
        name,
        hparams if hparams is None or callable(hparams) else dict(hparams),
        asynchronous,
        personalized,
    )
    return ALGORITHMS.register(name, spec, replace=replace)


def optimizer_option(argument: str, default: str, what: str) -> Option:
    """A factory option naming an optimizer of :mod:`scaffold_jax.optimizers` by spec
    (``"adam:b2=0.99"``), stored in its canonical spelling."""
    return Option(
        default,
        f"{what}: NAME or NAME:PARAM=VALUE,... with NAME one of {optimizers.describe()}",
        argument=argument,
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
    """Builds a registered algorithm by name (and named by it); ``kwargs`` go to its
    factory as they are."""
    spec = ALGORITHMS[name]
    return spec.named(spec.factory(loss_fn, **kwargs))
