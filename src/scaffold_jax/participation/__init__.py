"""Realistic participation: client availability, stragglers and dropouts.

Three kinds of model, each a registry of option-declaring entries like every other
vocabulary's (a plugin may add one):

- :mod:`~scaffold_jax.participation.availability`: which clients can be sampled in a
  round (``always``, ``cyclic``, ``markov``, ``trace``);
- :mod:`~scaffold_jax.participation.stragglers`: how many of its planned local steps a
  sampled client completes (``none``, ``uniform``, ``speed``);
- :mod:`~scaffold_jax.participation.dropouts`: which sampled clients' updates are lost
  (``none``, ``bernoulli``);
- :mod:`~scaffold_jax.participation.clock`: the clients' device profiles (``none``,
  ``lognormal``, ``file``) and the virtual clock of a round, with its deadline and
  over-selection, which drop the late.

All of them run inside the one compiled round as masks and counts (no Python per client):
an unavailable or dropped client is a masked row, a straggler a cut step mask. With the
defaults (``always``, ``none``, ``none``, ``none``) a run is today's, bitwise. A config
chooses them with ``availability``, ``stragglers``, ``dropouts`` and ``profiles``
(``--availability markov``...) and
their declared options; :func:`make` builds the :class:`Participation` a
:class:`~scaffold_jax.Simulation` takes (``participation=``).

Examples:
  >>> p = make(availability="markov", options={"availability_rate": 0.3})
  >>> p.availability.rate_on, p.stragglers, p.partial
  (0.3, None, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scaffold_jax.participation.availability import AVAILABILITY, load_trace
from scaffold_jax.participation.base import ModelSpec, Participation
from scaffold_jax.participation.clock import PROFILES, load_profiles
from scaffold_jax.participation.dropouts import DROPOUTS
from scaffold_jax.participation.stragglers import STRAGGLERS
from scaffold_jax.registry import Registry, factory_kwargs, resolve_options

#: The participation kinds: config field → registry.
KINDS: dict[str, Registry[ModelSpec]] = {
    "availability": AVAILABILITY,
    "stragglers": STRAGGLERS,
    "dropouts": DROPOUTS,
    "profiles": PROFILES,
}

#: Each kind's default entry: the paper's idealised client.
DEFAULTS = {"availability": "always", "stragglers": "none", "dropouts": "none", "profiles": "none"}


def build(kind: str, name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The model ``name`` of ``kind`` with its options (given, else their defaults); None
    for an entry that models nothing."""
    spec = KINDS[kind][name]
    if spec.build is None:
        return None
    values = resolve_options(spec.options, options or {})
    return spec.build(**factory_kwargs(spec.options, values))


def make(
    availability: str = "always",
    stragglers: str = "none",
    dropouts: str = "none",
    options: Mapping[str, Any] | None = None,
    profiles: str = "none",
) -> Participation:
    """The :class:`Participation` of the named models; ``options`` holds any of their
    declared options (each model takes its own)."""
    options = options or {}
    names = {
        "availability": availability, "stragglers": stragglers, "dropouts": dropouts,
        "profiles": profiles,
    }  # fmt: skip
    return Participation(**{kind: build(kind, name, options) for kind, name in names.items()})


__all__ = [
    "AVAILABILITY",
    "DEFAULTS",
    "DROPOUTS",
    "KINDS",
    "PROFILES",
    "STRAGGLERS",
    "ModelSpec",
    "Participation",
    "build",
    "load_profiles",
    "load_trace",
    "make",
]
