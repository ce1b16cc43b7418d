"""Ready problems: flax models reduced to ``(params, per-example loss, accuracy)``.

Models take batches ``{"x": [B, ...], "y": [B]}``. Integer inputs (uint8 images kept on
device) are scaled to [0, 1] inside the step; float inputs are used as they are.
The engine only ever sees the params pytree and the pure functions (flax's functional API).

:data:`MODELS` names the models that configs and the command line can ask for
(``logreg``, ``mlp``). A new model is a function returning a :class:`Problem` plus one
line, ``MODELS.register("name", ModelSpec(build, "Display name", options))``, in any module
(a plugin, :func:`scaffold_jax.registry.load_plugins`); :func:`build` makes it from a name.

Examples:
  >>> problem = build("mlp", (28, 28), 10, key=jr.key(0), options={"hidden_sizes": [32]})
  >>> problem.params["hidden_0"]["kernel"].shape  # [out, in]: see Dense
  (32, 784)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from scaffold_jax.registry import Registry
from scaffold_jax.types import Problem


def _features(x: jax.Array) -> jax.Array:
    """Flattens an example to float32 features; integer pixels are divided by 255."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.float32) * (1.0 / 255.0)
    return x.astype(jnp.float32).reshape((x.shape[0], -1))


def _transposed(init: Callable) -> Callable:
    """``init`` for an ``[in, out]`` kernel, returned ``[out, in]``: the same numbers
    flax's ``nn.Dense`` starts from, in this module's layout."""
    return lambda key, shape: init(key, shape).T


class Dense(nn.Module):
    """A dense layer whose kernel is stored ``[out, in]`` (equinox's ``Linear`` layout).

    The model owns its layout; the local solver takes params as they are. Why ``[out,
    in]``: the gradient of ``x · Wᵀ`` is ``δᵀ x``, which comes out ``[out, in]`` with the
    wide input axis minor. Vmapped over clients, flax's ``[in, out]`` kernel makes it a
    batched matmul whose minor axis is ``out`` (10 classes for a logistic regression), a
    narrow, poorly vectorised GEMM (the speed-up is measured in benchmarks/README.md).
    Initialised as ``nn.Dense`` is (LeCun normal over the fan-in, zero bias), from the
    same key: a model seeded alike starts from the same numbers, transposed.

    Attributes:
      features: the output width.
    """

    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel", _transposed(nn.initializers.lecun_normal()), (x.shape[-1], self.features)
        )
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        # Contract x's last axis with the kernel's input axis (its minor one).
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
        return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one dense layer to the class logits."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        return Dense(self.num_classes, name="linear")(_features(x))


class MLP(nn.Module):
    """Fully connected network with ReLU hidden layers (the paper's "2-layer" network)."""

    hidden_sizes: Sequence[int]
    num_classes: int

    @nn.compact
    def __call__(self, x):
        h = _features(x)
        for i, width in enumerate(self.hidden_sizes):
            h = nn.relu(Dense(width, name=f"hidden_{i}")(h))
        return Dense(self.num_classes, name="output")(h)


def classification_problem(module: nn.Module, input_shape: Sequence[int], key) -> Problem:
    """Wraps a flax classifier into a :class:`Problem` with cross-entropy loss.

    Args:
      module: a flax module mapping ``[B, *input_shape]`` to ``[B, num_classes]`` logits.
      input_shape: shape of ONE example (e.g. ``(28, 28)``).
      key: PRNG key for the initial params.
    """
    params = module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    def loss_fn(params, batch):
        logits = module.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    def accuracy_fn(params, batch):
        logits = module.apply({"params": params}, batch["x"])
        return (jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32)

    return Problem(
        params=params,
        loss_fn=loss_fn,
        accuracy_fn=accuracy_fn,
        num_classes=getattr(module, "num_classes", None),
    )


def logistic_regression(
    input_shape: Sequence[int], num_classes: int, key=None, zero_init: bool = True
) -> Problem:
    """Multinomial logistic regression (the paper's Table 3 model).

    Args:
      input_shape: shape of one example, e.g. ``(28, 28)``.
      num_classes: number of classes.
      key: PRNG key (default ``jax.random.key(0)``).
      zero_init: start from all-zero weights (a convex problem; the usual choice, and it
        makes runs independent of the init seed).

    Examples:
      >>> problem = logistic_regression((28, 28), 10)
      >>> problem.params["linear"]["kernel"].shape  # [out, in]: see Dense
      (10, 784)
    """
    _check_shape(input_shape, num_classes)
    problem = classification_problem(
        LogisticRegression(num_classes), input_shape, jr.key(0) if key is None else key
    )
    if zero_init:
        problem = problem._replace(params=jax.tree.map(jnp.zeros_like, problem.params))
    return problem


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden_sizes: Sequence[int] = (256, 256), key=None
) -> Problem:
    """The 2-layer fully connected network of the paper's Table 5.

    The paper does not state the hidden sizes; the default (256, 256) is our choice and
    is a parameter.
    """
    _check_shape(input_shape, num_classes)
    if not hidden_sizes or any(int(h) < 1 for h in hidden_sizes):
        raise ValueError(f"hidden_sizes={tuple(hidden_sizes)} must be positive integers.")
    return classification_problem(
        MLP(tuple(int(h) for h in hidden_sizes), num_classes),
        input_shape,
        jr.key(0) if key is None else key,
    )


def _check_shape(input_shape, num_classes) -> None:
    if len(input_shape) == 0 or math.prod(input_shape) < 1:
        raise ValueError(f"input_shape={tuple(input_shape)} must describe a non-empty example.")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes={num_classes} must be >= 2.")


# =====================================================================================
# The registry
# =====================================================================================
class ModelSpec(NamedTuple):
    """A registered model.

    Attributes:
      build: ``build(input_shape, num_classes, *, key, **options) -> Problem``, where
        ``input_shape`` is the shape of ONE example and ``key`` seeds the initial params
        (a model that starts from fixed params, such as the zero-initialised logistic
        regression, ignores it).
      display_name: how tables and plots name the model.
      options: the config fields the model takes (e.g. ``RunConfig.hidden_sizes``), passed
        to ``build`` as keywords of the same names.
    """

    build: Callable[..., Problem]
    display_name: str
    options: tuple[str, ...] = ()


MODELS: Registry[ModelSpec] = Registry("model")
MODELS.register("logreg", ModelSpec(logistic_regression, "logistic regression"))
MODELS.register("mlp", ModelSpec(mlp, "MLP", ("hidden_sizes",)))


def build(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    key: jax.Array,
    options: Mapping[str, Any] | None = None,
) -> Problem:
    """The model registered as ``name``, as a :class:`Problem`.

    Args:
      name: a name in :data:`MODELS`.
      input_shape: shape of one example, e.g. ``(28, 28)``.
      num_classes: number of classes.
      key: PRNG key of the initial params.
      options: config fields by name (a whole config's, e.g. ``config.to_dict()``, is
        fine): the model takes those it declares in :attr:`ModelSpec.options`; a declared
        one that is absent keeps the model's default.

    Raises:
      ValueError: an unknown name (the message lists the registered ones).
      TypeError: ``options`` is not a mapping.
    """
    spec = MODELS[name]
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options must map config fields to values (e.g. config.to_dict()), got "
            f"{type(options).__name__}; model {name!r} takes {list(spec.options)}."
        )
    taken = {field: options[field] for field in spec.options if field in options}
    return spec.build(tuple(input_shape), num_classes, key=key, **taken)
