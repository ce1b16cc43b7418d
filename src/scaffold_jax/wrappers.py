"""The wrappers: what any algorithm may be wrapped by, in one table (:data:`WRAPPERS`).

A wrapper takes an :class:`~scaffold_jax.types.Algorithm` and returns one (its clients'
messages transformed, hyper-parameters and options added): uplink compression
(:mod:`scaffold_jax.compression`, ``compressed(algorithm, ...)``) and user-level
differential privacy (:mod:`scaffold_jax.privacy`, ``private(algorithm, ...)``). A config
chooses each by one field (``compression = "qsgd"``, ``privacy = "gaussian"``), from its
own registry of kinds, or turns it off (``"none"``, None).

The table's order is the order they are applied in, innermost first:
:func:`scaffold_jax.experiments.resolve.make_algorithm` builds
``private(robustly_aggregated(compressed(attacked(algorithm))))``: a malicious client
attacks its message, each client compresses what it sends, the server aggregates
robustly; differential privacy clips what is sent (and refuses a robust aggregator). The
layers above read everything else from the table too: the config fields' help, the
registries whose entries declare options and hyper-parameters (``OPTION_OWNERS``,
``docs/config.md``), the ``--help`` groups, a run's chosen entries and the hyper-parameters
its wrappers add. They list the wrappers outermost first (:func:`outermost_first`:
privacy, then communication, as ``--help`` and ``docs/config.md`` always have).

Pairwise rules between wrappers stay with the wrapper that refuses: ``compressed`` refuses
an algorithm that is private already (``compressed(private(...))``: compressing after the
clip would break the noise's calibration; :mod:`scaffold_jax.compression` says why).

A new wrapper (personalization, robust aggregation...) is a package of its own that
provides ``wrap(algorithm, kind, options)`` and a registry of kinds, one
``WRAPPERS.register`` line below, at its place in the order, and its config field in
:class:`~scaffold_jax.experiments.schema.ConfigFields` (``_wrapper_field``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from scaffold_jax import compression, privacy, robust
from scaffold_jax.registry import Registry
from scaffold_jax.types import Algorithm, HParam


class WrapperSpec(NamedTuple):
    """A registered wrapper.

    Attributes:
      field: the config field that chooses its kind (``"compression"``).
      kinds: the registry of its kinds, whose entries declare their ``options`` and
        ``hparams`` (:data:`~scaffold_jax.compression.COMPRESSORS`).
      off: the field's value that wraps nothing (its default: ``"none"``, None).
      wrap: ``wrap(algorithm, kind, options) -> Algorithm``, with ``options`` the chosen
        kind's declared options as the config resolves them (given or at their defaults).
      group: the ``--help`` group of the field and of the options and hyper-parameters
        its kinds declare.
      help: one line on what it does (the config field's help).
    """

    field: str
    kinds: Registry
    off: str | None
    wrap: Callable[[Algorithm, str, Mapping[str, Any]], Algorithm]
    group: str
    help: str


#: The wrappers, by name (their config field), in the order they are applied.
WRAPPERS: Registry[WrapperSpec] = Registry("wrapper")
WRAPPERS.register("attack", WrapperSpec(
    "attack", robust.ATTACKS, "none", robust.wrap_attack, "robustness",
    "Byzantine clients: none, signflip, gaussian, alie, ipm, labelflip (a fraction "
    "byzantine_fraction of the clients, fixed for the run, attacks)"))  # fmt: skip
WRAPPERS.register("compression", WrapperSpec(
    "compression", compression.COMPRESSORS, "none", compression.wrap, "communication",
    "compression of the clients' uplink: none, qsgd (compress_bits), topk and signef "
    "(with error feedback), randk (compress_fraction)"))  # fmt: skip
WRAPPERS.register("aggregator", WrapperSpec(
    "aggregator", robust.AGGREGATORS, "mean", robust.wrap_aggregator, "robustness",
    "the server's aggregation of the reporting messages: mean, median, trimmed_mean, krum, "
    "multikrum, geomed, cclip (bucket_size: over means of random buckets)"))  # fmt: skip
WRAPPERS.register("privacy", WrapperSpec(
    "privacy", privacy.MECHANISMS, None, privacy.wrap, "privacy",
    "user-level differential privacy: gaussian (each client's whole message clipped to "
    "dp_clip, Gaussian noise on the sum; any --dp-* setting chooses it)"))  # fmt: skip


def outermost_first() -> list[WrapperSpec]:
    """The wrappers as the layers above list them: the reverse of the table's order."""
    return [spec for _, spec in reversed(WRAPPERS.items())]


def turned_off() -> dict[str, Any]:
    """``{field: off}``: the config values that choose no wrapper (the plain algorithm)."""
    return {spec.field: spec.off for spec in outermost_first()}


def chosen_hparams(config: Any, strict: bool = True) -> dict[str, HParam]:
    """The hyper-parameters the wrappers ``config`` chooses add (a privacy mechanism's
    noise and clip, a compressor's bits), outermost first. A wrapper turned off adds none;
    an unknown kind raises ValueError (the registry's message), or adds none when not
    ``strict`` (validation says it is unknown)."""
    out: dict[str, HParam] = {}
    for spec in outermost_first():
        kind = getattr(config, spec.field)
        if kind in spec.kinds or (strict and kind != spec.off):
            out.update(spec.kinds[kind].hparams)
    return out


__all__ = ["WRAPPERS", "WrapperSpec", "chosen_hparams", "outermost_first", "turned_off"]
