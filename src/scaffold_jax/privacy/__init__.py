"""User-level differential privacy: a wrapper any algorithm takes, and its accountant.

:func:`private` wraps an algorithm (clipping every client's whole message, Gaussian noise
on the sum, adaptive clipping); :mod:`scaffold_jax.privacy.accounting` composes the rounds
with dp-accounting's PLD or RDP accountant (the optional extra ``privacy``:
``pip install 'scaffold-jax[privacy]'``) and calibrates the noise for a target ε.

A config chooses a mechanism by name (``privacy = "gaussian"``, ``--privacy``; any
``--dp-*`` flag chooses it too) from :data:`MECHANISMS`, whose entries declare their
options and hyper-parameters like every other registry's; a plugin may add one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from scaffold_jax.privacy import accounting
from scaffold_jax.privacy.mechanism import (
    DEFAULT_COUNT_NOISE,
    HPARAMS,
    PrivateServerState,
    private,
)
from scaffold_jax.registry import Option, Registry, factory_kwargs
from scaffold_jax.types import Algorithm, HParam


class MechanismSpec(NamedTuple):
    """A registered privacy mechanism.

    Attributes:
      wrap: ``wrap(algorithm, **options) -> Algorithm``, the private algorithm.
      hparams: the hyper-parameters the wrapped algorithm adds (sweepable data).
      options: ``{name: Option}``: the wrapper's options, passed as keywords (their
        ``argument``), and the run-level settings the config resolves itself
        (``dp_epsilon``, ``dp_adaptive_quantile``: ``argument="-"``, never passed).
    """

    wrap: Callable[..., Algorithm]
    hparams: Mapping[str, HParam]
    options: Mapping[str, Option] = {}


MECHANISMS: Registry[MechanismSpec] = Registry("privacy mechanism")
MECHANISMS.register(
    "gaussian",
    MechanismSpec(
        private,
        HPARAMS,
        {
            "dp_epsilon": Option(
                None,
                "target epsilon: calibrates dp_noise_multiplier for the planned rounds "
                "(instead of giving it)",
                "float",
                low=0.0,
                strict=True,
                argument="-",
                tradeoff=True,
            ),
            "dp_delta": Option(
                None,
                "delta of the reported epsilon (default N^-1.1, below 1/N)",
                "float",
                low=0.0,
                high=1.0,
                strict=True,
                what="a number in (0, 1)",
                argument="delta",
            ),
            "dp_accountant": Option(
                None,
                "privacy accountant (default: pld for Poisson sampling, rdp for fixed-size)",
                "str",
                choices=accounting.ACCOUNTANTS,
                argument="accountant",
            ),
            "dp_count_noise": Option(
                DEFAULT_COUNT_NOISE,
                "adaptive clipping: noise std on the count of unclipped clients, as a "
                "fraction of the expected cohort S (Andrew et al.: 1/20)",
                "float",
                low=0.0,
                strict=True,
                argument="count_noise",
            ),
            "dp_adaptive_quantile": Option(
                None,
                "adaptive clipping on: the target quantile gamma of the clients' message "
                "norms (sets dp_target_quantile; dp_clip_lr defaults to 0.2)",
                "float",
                low=0.0,
                high=1.0,
                argument="-",
            ),
        },
    ),
)


def wrap(algorithm: Algorithm, mechanism: str, options: Mapping[str, Any]) -> Algorithm:
    """The registered ``mechanism``'s private algorithm with a config's options by their
    keys, less the run-level settings it resolves itself (``argument="-"``): privacy's
    ``wrap`` in :data:`scaffold_jax.wrappers.WRAPPERS`."""
    spec = MECHANISMS[mechanism]
    passed = {k: v for k, v in options.items() if spec.options[k].argument != "-"}
    return spec.wrap(algorithm, **factory_kwargs(spec.options, passed))


#: The adaptive clip norm's geometric step when ``dp_adaptive_quantile`` turns it on
#: (Andrew et al.'s η_C).
ADAPTIVE_CLIP_LR = 0.2

__all__ = [
    "ADAPTIVE_CLIP_LR",
    "HPARAMS",
    "MECHANISMS",
    "MechanismSpec",
    "PrivateServerState",
    "accounting",
    "private",
    "wrap",
]
