"""Optimizers by name: the server (FedOpt), local and base (Mime) optimizers of a config.

Every optimizer here is an optax transformation WITHOUT a learning rate: the step size
stays a hyper-parameter (η_g on the server, η_l on a client), passed to the compiled round
as data, so it can be swept without recompiling. A step is always
``params ← params − lr · T(gradient)`` with ``T`` the transformation (``"sgd"``: none).

A config or the command line names one with a spec string ``NAME`` or
``NAME:PARAM=VALUE,PARAM=VALUE`` (``"adam:b2=0.99,eps=1e-3"``); :func:`parse` checks it and
:func:`build` makes the transformation. :data:`OPTIMIZERS` lists them, with their
parameters and defaults (``scaffold-jax run --help`` prints them):

- ``sgd``: none (plain SGD; on the server, FedAvg's ``x ← x + η_g Δx``).
- ``momentum``: ``optax.trace(decay=momentum)`` (heavy ball; FedAvgM on the server).
- ``adagrad``: ``optax.scale_by_rss`` (FedAdagrad).
- ``adam``: ``optax.scale_by_adam``: WITH bias correction, ε added outside the square root.
- ``fedadam``: the FedAdam of Reddi et al., "Adaptive Federated Optimization", ICLR 2021
  (https://arxiv.org/abs/2003.00295, Algorithm 2): NO bias correction,
  ``m ← β₁ m + (1 − β₁) g``, ``v ← β₂ v + (1 − β₂) g²``, ``u = m / (√v + τ)``, with
  ``m₋₁ = 0`` and ``v₋₁ = τ²`` (τ the "adaptivity", the paper's best values are 1e-3 and
  below). optax's Adam differs from it twice: its bias correction scales the first steps by
  ``1/(1 − β^t)``, and it starts ``v`` at 0 with ε outside the root, so its first step is
  ``≈ sign(g)`` for every coordinate, where the paper's,
  ``(1 − β₁) g / (√((1 − β₂) g² + β₂ τ²) + τ)``, is ``≈ sign(g)`` only where ``|g| ≫ τ``
  (with β₂ = 0.99) and damped to ``≈ g / (10 τ)`` where ``|g| ≪ τ``.
- ``yogi``: ``optax.scale_by_yogi`` (FedYogi; optax's form has bias correction too).

A plugin adds one with ``OPTIMIZERS.register("name", OptimizerSpec(build, params, help))``,
``params`` mapping each parameter to an :class:`~scaffold_jax.registry.Option` (its default
and range) or simply to its default.

Examples:
  >>> canonical("adam:eps=1e-3")
  'adam:eps=0.001'
  >>> build("sgd") is None
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.registry import Option, Registry
from scaffold_jax.types import FLOAT32_TINY


class OptimizerSpec(NamedTuple):
    """A registered optimizer.

    Attributes:
      build: ``build(**params) -> optax.GradientTransformation | None`` (None: plain SGD).
      params: its parameters, each an :class:`~scaffold_jax.registry.Option` (a number:
        the default of a float with no range).
      help: one line for ``--help`` and the docs.
    """

    build: Callable[..., optax.GradientTransformation | None]
    params: Mapping[str, Option | float]
    help: str

    @property
    def options(self) -> dict[str, Option]:
        return {
            k: v if isinstance(v, Option) else Option(float(v), k, "float")
            for k, v in self.params.items()
        }


class FedAdamState(NamedTuple):
    """The paper FedAdam's moments: ``m`` (first, from 0) and ``v`` (second, from τ²)."""

    m: Any
    v: Any


def scale_by_fedadam(b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3):
    """The FedAdam of Reddi et al. 2021 (Algorithm 2), as an optax transformation.

    No bias correction; ``u = m / (√v + τ)`` with ``m₋₁ = 0`` and ``v₋₁ = τ²``.

    Args:
      b1: β₁, the first moment's decay.
      b2: β₂, the second moment's decay.
      tau: τ, the adaptivity (> 0).
    """

    def init(params):
        zeros = optax.tree.zeros_like(params)
        return FedAdamState(m=zeros, v=optax.tree.full_like(params, tau * tau))

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda g, m: b1 * m + (1.0 - b1) * g, updates, state.m)
        v = jax.tree.map(lambda g, v: b2 * v + (1.0 - b2) * jnp.square(g), updates, state.v)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
        return out, FedAdamState(m=m, v=v)

    return optax.GradientTransformation(init, update)


def _decay(default: float, name: str) -> Option:
    # [0, 1): at 1 the average never forgets (momentum sums every gradient) and Adam's
    # bias correction 1 / (1 - b^t) divides by 0.
    return Option(
        default, f"{name}: decay rate", "float", low=0.0, high=math.nextafter(1.0, 0.0),
        what="a number in [0, 1)",
    )  # fmt: skip


def _floor(default: float, name: str = "eps") -> Option:
    # > 0, and a normal float32: the updates are float32, where 1e-50 is 0 and the floor
    # would divide by zero.
    return Option(
        default, f"{name}: numerical floor", "float", low=FLOAT32_TINY,
        what=f"a number > 0, at least {FLOAT32_TINY:.8g} (the smallest normal float32)",
    )  # fmt: skip


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
OPTIMIZERS.register("sgd", OptimizerSpec(lambda: None, {}, "plain SGD (no transformation)"))
OPTIMIZERS.register(
    "momentum",
    OptimizerSpec(
        lambda momentum: optax.trace(decay=momentum),
        {"momentum": _decay(0.9, "momentum")},
        "heavy-ball momentum, optax.trace (FedAvgM on the server)",
    ),
)
OPTIMIZERS.register(
    "adagrad",
    OptimizerSpec(
        lambda initial_accumulator, eps: optax.scale_by_rss(initial_accumulator, eps),
        {
            "initial_accumulator": Option(0.1, "initial accumulator", "float", low=0.0),
            "eps": _floor(1e-7),
        },  # fmt: skip
        "optax.scale_by_rss (FedAdagrad on the server)",
    ),
)
OPTIMIZERS.register(
    "adam",
    OptimizerSpec(
        lambda b1, b2, eps: optax.scale_by_adam(b1, b2, eps),
        {"b1": _decay(0.9, "b1"), "b2": _decay(0.999, "b2"), "eps": _floor(1e-8)},
        "optax.scale_by_adam: with bias correction, eps outside the square root",
    ),
)
OPTIMIZERS.register(
    "fedadam",
    OptimizerSpec(
        scale_by_fedadam,
        {"b1": _decay(0.9, "b1"), "b2": _decay(0.99, "b2"), "tau": _floor(1e-3, "tau")},
        "the paper's FedAdam (Reddi et al. 2021): no bias correction, v starts at tau^2",
    ),
)
OPTIMIZERS.register(
    "yogi",
    OptimizerSpec(
        lambda b1, b2, eps: optax.scale_by_yogi(b1, b2, eps),
        {"b1": _decay(0.9, "b1"), "b2": _decay(0.999, "b2"), "eps": _floor(1e-3)},
        "optax.scale_by_yogi (FedYogi on the server)",
    ),
)


def parse(spec: Any) -> tuple[str, dict[str, float]]:
    """``"NAME:PARAM=VALUE,..."`` → ``(name, {param: value})`` with every default filled in.

    Raises:
      ValueError: not a string, an unknown optimizer or parameter, a parameter given
        twice, or a value that is not a finite number in the parameter's range (the
        message lists what the optimizer takes, or the range).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"optimizer {spec!r} is invalid: give a name ({', '.join(OPTIMIZERS)}), "
            "optionally with parameters, e.g. 'adam:b2=0.99,eps=1e-3'."
        )
    name, _, rest = spec.strip().partition(":")
    declared = OPTIMIZERS[name.strip()].options  # unknown: the message lists the names
    values = {k: option.default for k, option in declared.items()}
    given: set[str] = set()
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, text = (s.strip() for s in item.partition("="))
        if key not in declared:
            takes = ", ".join(declared) or "no parameters"
            raise ValueError(
                f"optimizer {spec!r}: {name} has no parameter {key!r}; it takes {takes}."
            )
        if key in given:  # the last would silently win
            raise ValueError(f"optimizer {spec!r}: {key} is given twice; give it once.")
        given.add(key)
        try:
            value = float(text) if eq else float("nan")
        except ValueError:
            value = float("nan")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(
                f"optimizer {spec!r}: {key} = {text!r} is invalid; give a finite number, "
                f"e.g. {key}={declared[key].default:g}."
            )
        error = declared[key].error(key, value)
        if error is not None:
            raise ValueError(f"optimizer {spec!r}: {error}")
        values[key] = value
    return name.strip(), values


def canonical(spec: Any) -> str:
    """The spec's one spelling: the name, then the non-default parameters in the order
    the optimizer declares them (what run identities and records store)."""
    name, values = parse(spec)
    declared = OPTIMIZERS[name].options
    changed = [f"{k}={values[k]:g}" for k, o in declared.items() if values[k] != o.default]
    return name if not changed else f"{name}:{','.join(changed)}"


def build(spec: Any) -> optax.GradientTransformation | None:
    """The transformation a spec names (None for plain SGD); an optax transformation or
    None is returned as it is, so a factory's argument may be either."""
    if spec is None or isinstance(spec, optax.GradientTransformation):
        return spec
    name, values = parse(spec)
    built = OPTIMIZERS[name].build(**values)
    return None if built is None else standard_promotion(built)


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` traced under JAX's standard dtype promotion: optax's bias corrections raise a
    Python float to an int32 step count, which ``jax_numpy_dtype_promotion="strict"`` (a
    setting that catches mistakes in user code, and that our tests use) refuses."""

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def describe() -> str:
    """``name (param=default, ...)`` for every registered optimizer, for ``--help``."""
    parts = []
    for name, entry in OPTIMIZERS.items():
        args = ", ".join(f"{k}={o.default:g}" for k, o in entry.options.items())
        parts.append(f"{name} ({args})" if args else name)
    return "; ".join(parts)
