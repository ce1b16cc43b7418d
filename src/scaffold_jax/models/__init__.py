"""Ready problems: flax models reduced to ``(params, per-example loss, accuracy)``.

Models take batches ``{"x": [B, ...], "y": [B]}``. Integer inputs (uint8 images kept on
device) are scaled to [0, 1] inside the step; float inputs are used as they are. (The
character model's integer inputs are character ids, not pixels: it embeds them.)
The engine only ever sees the params pytree and the pure functions (flax's functional API).
A flax module becomes a :class:`Problem` through :func:`classification_problem`
(:mod:`~scaffold_jax.models.problem`); the registered models are in ``mlp_cnn``,
``resnet`` and ``lstm``, built of the layers of :mod:`~scaffold_jax.models.layers`.

:data:`MODELS` names the models that configs and the command line can ask for
(``logreg``, ``mlp``, ``cnn``, ``resnet18``, ``char_lstm``). A new model is a function
returning a :class:`Problem` plus one line, ``MODELS.register("name", ModelSpec(build,
"Display name", {"option": Option(default, help, kind)}))``, in any module (a plugin,
:func:`scaffold_jax.registry.load_plugins`); :func:`build` makes it from a name.

Examples:
  >>> problem = build("mlp", (28, 28), 10, key=jax.random.key(0), options={"hidden_sizes": [32]})
  >>> problem.params["hidden_0"]["kernel"].shape  # [out, in]: see Dense
  (32, 784)
"""

# This module re-exports its submodules' names: users write scaffold_jax.models.<name> (and
# tests/ and benchmarks/ the private _pads and _images).
# ruff: noqa: F401
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from scaffold_jax.models.layers import Conv, Dense, _images, _pads, conv2d
from scaffold_jax.models.lstm import CharLSTM, char_lstm
from scaffold_jax.models.mlp_cnn import CNN, MLP, LogisticRegression, cnn, logistic_regression, mlp
from scaffold_jax.models.problem import (
    FLAX_CONV_COST,
    ModelTooLargeError,
    classification_problem,
    nnx_classification_problem,
)
from scaffold_jax.models.resnet import RESNET_NORMS, BasicBlock, ResNet18, resnet18
from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options
from scaffold_jax.types import STATE_POLICIES, Problem


class ModelSpec(NamedTuple):
    """A registered model.

    Attributes:
      build: ``build(input_shape, num_classes, *, key, **options) -> Problem``, where
        ``input_shape`` is the shape of ONE example and ``key`` seeds the initial params
        (a model that starts from fixed params, such as the zero-initialised logistic
        regression, ignores it). What a flax module then receives (uint8 ``[B, 28, 28]``
        for Fashion-MNIST): see :func:`classification_problem`; an example plugin:
        ``examples/small_cnn.py``.
      display_name: how tables and plots name the model.
      options: ``{name: Option}``, the options the model declares (the MLP's
        ``hidden_sizes``), passed to ``build`` as keywords (:attr:`Option.argument`, else
        the name). The config, the flags, the docs, sweeps and the run identity derive
        from these declarations.
      keeps_statistics: ``keeps_statistics(options) -> bool``: whether the model built
        with these option values keeps running statistics (for which ``state_policy``
        means something); None: it does exactly when it takes ``state_policy``.
    """

    build: Callable[..., Problem]
    display_name: str
    options: Mapping[str, Option] = {}
    keeps_statistics: Callable[[Mapping[str, Any]], bool] | None = None

    def statistics_with(self, options: Mapping[str, Any]) -> bool:
        """Whether the model built with ``options`` keeps running statistics."""
        if self.keeps_statistics is not None:
            return self.keeps_statistics(resolve_options(self.options, options))
        return "state_policy" in self.options


MODELS: Registry[ModelSpec] = Registry("model")
MODELS.register("logreg", ModelSpec(logistic_regression, "logistic regression"))
MODELS.register(
    "mlp",
    ModelSpec(
        mlp,
        "MLP",
        {"hidden_sizes": Option([256, 256], "MLP hidden layer widths", "ints", low=1)},
    ),
)
MODELS.register("cnn", ModelSpec(cnn, "CNN"))
MODELS.register(
    "resnet18",
    ModelSpec(
        resnet18,
        "ResNet-18",
        {
            "resnet_width": Option(
                64, "ResNet-18: channels of the first stage (even)", "int", low=2
            ),
            "resnet_norm": Option(
                "group",
                "ResNet-18: GroupNorm, or BatchNorm with running statistics (see --state-policy)",
                choices=RESNET_NORMS,
            ),
            "state_policy": Option(
                "average",
                "a model's running statistics (BatchNorm's): averaged over the sampled "
                "clients like the params, or kept by each client as its own (FedBN's "
                "statistics)",
                choices=STATE_POLICIES,
            ),
        },
        keeps_statistics=lambda options: options.get("resnet_norm") == "batch",
    ),
)
MODELS.register(
    "char_lstm",
    ModelSpec(
        char_lstm,
        "char LSTM",
        {
            "lstm_hidden": Option(256, "char LSTM: units of each LSTM layer", "int", low=1),
            "embed_dim": Option(8, "char LSTM: width of the character embedding", "int", low=1),
        },
    ),
)


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
      options: option values by name (a whole config's options table is fine): the model
        takes those it declares in :attr:`ModelSpec.options`; a declared one that is
        absent keeps the model's default.

    Raises:
      ValueError: an unknown name (the message lists the registered ones), or a model
        whose parameters alone need more memory than is available (the message names the
        options given, the bytes needed and those available).
      TypeError: ``options`` is not a mapping.
    """
    spec = MODELS[name]
    options = {} if options is None else options
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options must map config fields to values (e.g. config.to_dict()), got "
            f"{type(options).__name__}; model {name!r} takes {list(spec.options)}."
        )
    try:
        return spec.build(
            tuple(input_shape), num_classes, key=key, **factory_kwargs(spec.options, options)
        )
    except ModelTooLargeError as err:  # said with the settings that made it so large
        given = ", ".join(f"{n} = {options[n]!r}" for n in spec.options if n in options)
        raise ValueError(f"model = {name!r}{f' with {given}' if given else ''}: {err}") from None
