"""Ready problems: flax models reduced to ``(params, per-example loss, accuracy)``.

Models take batches ``{"x": [B, ...], "y": [B]}``. Integer inputs (uint8 images kept on
device) are scaled to [0, 1] inside the step; float inputs are used as they are. (The
character model's integer inputs are character ids, not pixels: it embeds them.)
The engine only ever sees the params pytree and the pure functions (flax's functional API).

:data:`MODELS` names the models that configs and the command line can ask for
(``logreg``, ``mlp``, ``cnn``, ``resnet18``, ``char_lstm``). A new model is a function
returning a :class:`Problem` plus one line, ``MODELS.register("name", ModelSpec(build,
"Display name", {"option": Option(default, help, kind)}))``, in any module (a plugin,
:func:`scaffold_jax.registry.load_plugins`); :func:`build` makes it from a name.

Examples:
  >>> problem = build("mlp", (28, 28), 10, key=jr.key(0), options={"hidden_sizes": [32]})
  >>> problem.params["hidden_0"]["kernel"].shape  # [out, in]: see Dense
  (32, 784)
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from scaffold_jax import resources
from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options
from scaffold_jax.types import STATE_POLICIES, Problem


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


def classification_problem(
    module: nn.Module,
    input_shape: Sequence[int],
    key,
    input_dtype=jnp.float32,
    train_arg: str | None = None,
    mask_arg: str | None = None,
    state_policy: str = "average",
) -> Problem:
    """Wraps a flax classifier into a :class:`Problem` with cross-entropy loss.

    What the module receives: ``x``, a batch ``[B, *input_shape]`` exactly as the data
    layer stores it, not converted, and ``train_arg`` when given. For the image datasets
    (``mnist``, ``fashion_mnist``, ``emnist/*``, ``femnist``) that is uint8 pixels
    ``[B, 28, 28]`` (0-255, no channel axis); for ``cifar10`` / ``cifar100`` uint8
    ``[B, 32, 32, 3]``; for ``shakespeare`` integer character ids ``[B, 80]``; for
    ``synthetic`` float32 features ``[B, 60]`` (``synth_dim``); arrays of your own
    (:func:`scaffold_jax.data.from_client_arrays`) keep their dtype and shape. So a
    convolutional module adds the channel axis and scales integer pixels itself, e.g.
    ``x[..., None].astype("float32") / 255`` (this module's ``logreg``, ``mlp`` and
    ``cnn`` do). ``input_shape`` is one example's shape, ``x.shape[1:]``.

    On CPU a module that uses flax's ``nn.Conv`` (2-D) gets a warning: its gradients
    inside the loop of local steps take XLA's slow convolution path, and a round takes
    longer, by the factor :data:`FLAX_CONV_COST`, than with :class:`Conv`, which takes
    the same arguments and makes the same params. A module with ``nn.Dropout`` but no
    ``train_arg`` gets one too: it is only ever called in inference mode.

    Args:
      module: a flax module mapping ``[B, *input_shape]`` to ``[B, num_classes]`` logits.
      input_shape: shape of ONE example (e.g. ``(28, 28)``).
      key: PRNG key for the initial params.
      input_dtype: dtype of the dummy batch the params are initialised from (an integer
        type for a model that embeds token ids).
      train_arg: the name of the module's boolean training-mode argument (e.g. ``"train"``
        for ``__call__(self, x, train)`` with ``nn.Dropout(rate, deterministic=not
        train)``), or None for a module without one. With it the loss takes a ``key``: the
        local steps call it in training mode with a fresh ``"dropout"`` key every step
        (:func:`scaffold_jax.local.takes_key`), evaluation without a key, in inference
        mode.
      mask_arg: the name of the module's argument that takes the ``[B]`` boolean mask of
        the real examples in training mode, for a module with BatchNorm (which it passes
        on as ``nn.BatchNorm(...)(h, mask=...)``, broadcast to ``h``'s shape), so that the
        padded slots of a client's batch (copies of its first example) stay out of the
        batch statistics. None: the module takes no mask, and a batch with padding
        (a client with fewer than B examples, an epoch's last batch) computes its
        statistics over the padded slots too.
      state_policy: for a module that keeps running statistics (BatchNorm's
        ``batch_stats``): ``"average"`` or ``"local"``
        (:data:`scaffold_jax.types.STATE_POLICIES`, :attr:`Problem.state_policy`).

    Every collection of ``module`` besides ``params`` (BatchNorm's ``batch_stats``) is the
    problem's :attr:`~Problem.model_state`: updated by every local step (flax's
    ``mutable=``), never differentiated, kept across clients as ``state_policy`` says,
    and used in evaluation (inference mode). Such a module needs ``train_arg``.

    Raises:
      ValueError: a module with running statistics but no ``train_arg``, or an unknown
        ``state_policy``.
      TypeError: the module's ``__call__`` requires an argument besides ``x`` (a
        training-mode switch) but no ``train_arg`` names it, or it takes no argument
        named ``train_arg``.
    """
    if state_policy not in STATE_POLICIES:
        raise ValueError(f"state_policy={state_policy!r} is unknown; use one of {STATE_POLICIES}.")
    variables, called = _init(module, input_shape, key, input_dtype, train_arg)
    name = type(module).__name__
    convs = [m for m in called if isinstance(m, nn.Conv) and _replaceable(m)]
    if convs and jax.default_backend() == "cpu":
        where = ", ".join("/".join(m.scope.path) for m in convs)
        warnings.warn(
            f"{name} uses flax's nn.Conv ({where}): on CPU its gradients inside the loop "
            f"of local steps take XLA's slow convolution path, and a round took "
            f"{FLAX_CONV_COST} as long as with scaffold_jax.models.Conv "
            "(benchmarks/bench_flax_conv.py), which takes the same arguments and makes "
            "the same params: use sj.models.Conv(features, kernel_size, ...) instead.",
            UserWarning,
            stacklevel=2,
        )
    dropouts = [m for m in called if isinstance(m, nn.Dropout) and m.rate > 0]
    if dropouts and train_arg is None:
        warnings.warn(
            f"{name} has nn.Dropout (rate {dropouts[0].rate}) but classification_problem "
            "got no train_arg, so the module is always called in inference mode and its "
            "dropout never acts: give train_arg='train' (the name of its training-mode "
            "argument, passed on as nn.Dropout(rate, deterministic=not train)).",
            UserWarning,
            stacklevel=2,
        )
    extra = sorted(k for k in variables if k != "params")
    if extra and train_arg is None:
        raise ValueError(
            f"{type(module).__name__} keeps running statistics ({', '.join(extra)}: "
            "BatchNorm's, for example), which the local steps update in training mode and "
            "evaluation reads in inference mode: give classification_problem(..., "
            "train_arg=...) the name of the module's training-mode argument (e.g. "
            "'train', passed on as nn.BatchNorm(use_running_average=not train)), and "
            "mask_arg=... for exact batch statistics. GroupNorm or LayerNorm need "
            "neither (the registered resnet18 uses GroupNorm)."
        )
    params = variables["params"]
    if not extra:

        def logits_of(params, x, key=None):
            if train_arg is None:
                return module.apply({"params": params}, x)
            if key is None:
                return module.apply({"params": params}, x, **{train_arg: False})
            return module.apply({"params": params}, x, **{train_arg: True}, rngs={"dropout": key})

        num_classes = getattr(module, "num_classes", None)
        return _classifier(params, logits_of, num_classes, stochastic=train_arg is not None)
    return _linen_stateful(
        module, params, {k: variables[k] for k in extra}, train_arg, mask_arg, state_policy
    )


#: What flax's ``nn.Conv`` costs in a model on CPU: a round's time against the same model
#: with :class:`Conv` (FedAvg and SCAFFOLD, S = 5, K = 10, B = 20, 28×28 images), measured
#: by ``benchmarks/bench_flax_conv.py`` on a busy 2-core VM (README, "Bringing your own
#: model"); :func:`classification_problem`'s warning quotes it.
FLAX_CONV_COST = "1.3-4.2× (one 3×3 convolution) to 9.4-11× (McMahan et al.'s CNN)"


def _init(module: nn.Module, input_shape, key, input_dtype, train_arg):
    """``module.init`` on a zero batch: ``(variables, the submodules called)``.

    A ``TypeError`` that the module's signature explains (a required argument besides
    ``x`` and no ``train_arg``; a ``train_arg`` it does not take) becomes one that says so.
    """
    called: list[nn.Module] = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            called.append(context.module)
        return next_fun(*args, **kwargs)

    mode = {} if train_arg is None else {train_arg: False}
    batch = jnp.zeros((1, *input_shape), input_dtype)
    try:
        # Shapes first (nothing allocated): a model that cannot fit is refused here rather
        # than by the allocator (an XLA "Check failed" abort under a memory limit).
        shapes = jax.eval_shape(lambda k: module.init(k, batch, **mode), key)
        _check_fits(type(module).__name__, shapes)
        with nn.intercept_methods(record):
            variables = module.init(key, batch, **mode)
    except TypeError as err:
        message = _call_mismatch(module, train_arg)
        if message is None:
            raise
        raise TypeError(message) from err
    return variables, called


class ModelTooLargeError(ValueError):
    """A model whose parameters alone need more memory than is available."""


#: Scratch memory of drawing one random weight, in multiples of its size: jax's threefry
#: bits for n values take 3n words (measured with XLA's memory analysis of a flax Dense's
#: init, and of jax.random.normal and truncated_normal alike).
_INIT_SCRATCH = 3


def _check_fits(name: str, shapes: Any) -> None:
    """Raises :class:`ModelTooLargeError` when initialising variables of ``shapes`` (from
    ``jax.eval_shape``) needs more than the memory available on the default device."""
    sizes = [math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes)]
    params = sum(sizes)
    needed = params + _INIT_SCRATCH * max(sizes, default=0)
    device = jax.devices()[0]
    available = resources.available_memory_bytes(device)
    if needed > available:
        values = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
        raise ModelTooLargeError(
            f"{name}'s {values} parameters need {needed} bytes "
            f"({resources.format_bytes(needed)}) of {device.platform} memory to be "
            f"initialised ({params} for their values, {_INIT_SCRATCH}x the largest weight's "
            f"for its random draw), more than the {available} bytes "
            f"({resources.format_bytes(available)}) available; use a smaller model."
        )


#: Argument names that are True in inference mode: not a ``train_arg``.
_INFERENCE_SWITCHES = ("deterministic", "use_running_average", "inference", "eval", "evaluate")


def _call_mismatch(module: nn.Module, train_arg: str | None) -> str | None:
    """Why ``module(x, **{train_arg: False})`` cannot be called, read from its
    ``__call__``'s signature, or None when the signature does not say."""
    try:
        every = list(inspect.signature(module.__call__).parameters.values())
    except (TypeError, ValueError):
        return None
    parameters = every[1:]  # the first is the batch
    name = type(module).__name__
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if train_arg is None:
        required = [p.name for p in parameters if p.default is p.empty and p.kind not in variadic]
        if not required:
            return None
        if required[0] in _INFERENCE_SWITCHES:
            return (
                f"{name}.__call__ requires {required[0]!r} besides the batch x, an "
                "inference-mode switch (True in evaluation), but classification_problem's "
                "train_arg names a training-mode one (True in the local steps): make "
                f"{name}.__call__ take `train: bool`, pass {required[0]}=not train on, and "
                "give classification_problem(..., train_arg='train')."
            )
        others = required[1:]
        return (
            f"{name}.__call__ requires {', '.join(map(repr, required))} besides the batch "
            f"x, and classification_problem passes only x unless train_arg names the "
            f"training-mode argument: give classification_problem(..., train_arg="
            f"{required[0]!r}) (the local steps then call it with {required[0]}=True and a "
            f"fresh 'dropout' key every step, evaluation with {required[0]}=False)"
            + (f", and give {', '.join(map(repr, others))} a default." if others else ".")
        )
    if train_arg in [p.name for p in parameters] or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    ):
        return None
    return (
        f"train_arg={train_arg!r}, but {name}.__call__ takes no argument {train_arg!r} (it "
        f"takes {', '.join(repr(p.name) for p in every)}): give the name of its "
        "training-mode argument, or train_arg=None for a module without one."
    )


def _replaceable(conv: nn.Conv) -> bool:
    """Whether :class:`Conv` computes what this ``nn.Conv`` does: 2-D, no dilation or
    groups, padding that :class:`Conv` takes."""

    def ones(value) -> bool:
        return value is None or (value == 1 if isinstance(value, int) else set(value) == {1})

    padding = conv.padding
    return (
        not isinstance(conv.kernel_size, int)
        and len(conv.kernel_size) == 2
        and conv.feature_group_count == 1
        and ones(conv.input_dilation)
        and ones(conv.kernel_dilation)
        and (not isinstance(padding, str) or padding.upper() in ("SAME", "VALID"))
    )


def _classifier(params, logits_of, num_classes, stochastic: bool = False) -> Problem:
    """The :class:`Problem` of ``logits_of(params, x, key=None) -> [B, C]``: per-example
    cross-entropy and correctness; a ``stochastic`` loss takes the step's ``key``."""

    def cross_entropy(params, batch, key=None):
        logits = logits_of(params, batch["x"], key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    def deterministic(params, batch):
        return cross_entropy(params, batch)

    def accuracy_fn(params, batch):
        logits = logits_of(params, batch["x"])
        return (jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32)

    return Problem(
        params=params,
        loss_fn=cross_entropy if stochastic else deterministic,
        accuracy_fn=accuracy_fn,
        num_classes=num_classes,
    )


def _linen_stateful(module, params, model_state, train_arg, mask_arg, state_policy):
    """The :class:`Problem` of a linen module with running statistics (see
    :func:`classification_problem`): training mode through ``mutable=``."""
    collections = list(model_state)

    def train(params, state, x, mask=None, key=None):
        kwargs = {train_arg: True}
        if mask_arg is not None and mask is not None:
            kwargs[mask_arg] = mask > 0
        # Dropout needs a key in training mode; a full-data pass (SCAFFOLD's option I and
        # warm start, Mime's full gradient) takes none and gets a fixed one.
        rngs = {"dropout": jax.random.key(0) if key is None else key}
        logits, new = module.apply(
            {"params": params, **state}, x, **kwargs, rngs=rngs, mutable=collections
        )
        return logits, dict(new)

    def infer(params, state, x):
        return module.apply({"params": params, **state}, x, **{train_arg: False})

    num_classes = getattr(module, "num_classes", None)
    return _stateful_classifier(params, model_state, train, infer, num_classes, state_policy)


def _stateful_classifier(params, initial, train, infer, num_classes, state_policy) -> Problem:
    """The :class:`Problem` of a classifier with running statistics, from ``train(params,
    state, x, mask, key) -> (logits, new_state)`` (training mode: batch statistics over
    the real examples of ``mask``) and ``infer(params, state, x) -> logits``."""

    # In training mode the outputs do not depend on the running statistics (BatchNorm
    # normalises with the batch's own): the initial ones stand in where none are given.
    def loss_fn(params, batch, key=None, mask=None, state=None):
        if state is None:
            logits, _ = train(params, initial, batch["x"], mask, key)
        else:
            logits = infer(params, state, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    def accuracy_fn(params, batch, state=None):
        if state is None:
            logits, _ = train(params, initial, batch["x"])
        else:
            logits = infer(params, state, batch["x"])
        return (jnp.argmax(logits, axis=-1) == batch["y"]).astype(jnp.float32)

    def update_state(params, state, batch, mask, key=None):
        return train(params, state, batch["x"], mask, key)[1]

    return Problem(
        params=params,
        loss_fn=loss_fn,
        accuracy_fn=accuracy_fn,
        num_classes=num_classes,
        model_state=initial,
        update_state=update_state,
        state_policy=state_policy,
    )


def nnx_classification_problem(
    model, num_classes: int | None = None, mask_arg: str | None = None,
    state_policy: str = "average",
) -> Problem:  # fmt: skip
    """A flax NNX classifier (``model(x) -> [B, num_classes]`` logits) as a
    :class:`Problem`: split ONCE into its graph and its ``nnx.Param`` state, which is the
    params pytree the engine carries; the loss merges them back inside the step.

    A model with BatchNorm keeps its ``nnx.BatchStat`` s as the problem's
    :attr:`~Problem.model_state` (see :func:`classification_problem`): the local steps run
    it in training mode (``model.train()``), evaluation in ``model.eval()``.

    Args:
      model: an ``nnx.Module`` whose state is ``nnx.Param`` s (and ``nnx.BatchStat`` s).
      num_classes: C, for the label check (read from ``model.num_classes`` when absent).
      mask_arg: the name of the model's argument that takes the ``[B]`` boolean mask of
        the real examples in training (passed on as ``nnx.BatchNorm(...)(h, mask=...)``),
        or None.
      state_policy: ``"average"`` or ``"local"``, for a model with BatchNorm.

    Raises:
      ValueError: the model has other state (an ``nnx.Rngs`` stream for dropout), which a
        Problem does not carry, or an unknown ``state_policy``.

    Examples:
      >>> from flax import nnx
      >>> problem = nnx_classification_problem(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), 3)
      >>> problem.loss_fn(problem.params, {"x": jnp.ones((2, 4)), "y": jnp.zeros(2, int)}).shape
      (2,)
    """
    from flax import nnx

    if state_policy not in STATE_POLICIES:
        raise ValueError(f"state_policy={state_policy!r} is unknown; use one of {STATE_POLICIES}.")
    graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            f"{type(model).__name__} keeps state besides its nnx.Param s and nnx.BatchStat s "
            "(an nnx.Rngs stream for dropout, for example), which nnx_classification_problem "
            "does not carry; use a linen module with classification_problem(..., "
            "train_arg=...) for dropout (it gets a fresh key every local step)."
        )
    if num_classes is None:
        num_classes = getattr(model, "num_classes", None)
    if not jax.tree.leaves(stats):

        def logits_of(params, x, key=None):
            del key  # deterministic: the model holds no rng stream
            return nnx.merge(graphdef, params, stats, rest)(x)

        return _classifier(params, logits_of, num_classes)

    def train(params, state, x, mask=None, key=None):
        del key  # no rng stream (refused above)
        # A copy: training mode writes the new statistics into the merged model's
        # variables, which must be this trace's own.
        model = nnx.merge(graphdef, params, state, rest, copy=True)
        model.train()
        kwargs = {} if mask_arg is None or mask is None else {mask_arg: mask > 0}
        return model(x, **kwargs), nnx.state(model, nnx.BatchStat)

    def infer(params, state, x):
        model = nnx.merge(graphdef, params, state, rest)
        model.eval()
        return model(x)

    return _stateful_classifier(params, stats, train, infer, num_classes, state_policy)


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
# Convolutional and recurrent models
# =====================================================================================
def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    """``(H, W, C)`` of one image example, ``(H, W)`` meaning one channel; anything else
    (a flattened ``(784,)`` vector, a channels-first ``(3, 32, 32)`` image) is refused."""
    shape = tuple(int(d) for d in input_shape)
    if len(shape) not in (2, 3) or min(shape, default=0) < 1:
        hint = (
            " It looks like a flattened image: keep the dataset's examples as images "
            "(e.g. (28, 28) or (32, 32, 3)), or use model 'mlp' or 'logreg', which take "
            "vectors."
            if len(shape) == 1
            else ""
        )
        raise ValueError(
            f"model {model!r} takes images of shape (H, W) or (H, W, C) per example, got "
            f"input_shape={shape}.{hint}"
        )
    if len(shape) == 3 and shape[0] <= 4 < shape[2]:
        raise ValueError(
            f"model {model!r} takes channels-last images (H, W, C), got input_shape={shape}, "
            f"which looks channels-first: transpose the examples to "
            f"{(shape[1], shape[2], shape[0])}."
        )
    return shape if len(shape) == 3 else (*shape, 1)


def _images(x: jax.Array, model: str) -> jax.Array:
    """A batch of images as ``[B, H, W, C]`` floats: a channel axis is added to
    ``[B, H, W]``; integer pixels are divided by 255 (as :func:`_features` does), float
    inputs are used as they are."""
    if x.ndim == 3:
        x = x[..., None]
    elif x.ndim != 4:
        raise ValueError(
            f"model {model!r} takes a batch of images [B, H, W] or [B, H, W, C], got an "
            f"array of shape {tuple(x.shape)}; keep the examples unflattened."
        )
    if jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.float32) * (1.0 / 255.0)
    return x


_NHWC = ("NHWC", "HWIO", "NHWC")


def _pads(spatial, kernel, strides, padding) -> tuple[tuple[int, int], ...]:
    """Explicit ``(low, high)`` padding per spatial axis for ``"SAME"``, ``"VALID"``, an
    int or a sequence of pairs (flax's conventions)."""
    if isinstance(padding, str):
        return tuple(jax.lax.padtype_to_pads(spatial, kernel, strides, padding))
    if isinstance(padding, int):
        return ((padding, padding),) * len(kernel)
    return tuple((int(lo), int(hi)) for lo, hi in padding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def conv2d(x: jax.Array, kernel: jax.Array, strides: tuple, pads: tuple) -> jax.Array:
    """A 2-D convolution (NHWC input, HWIO kernel) whose gradients are themselves
    convolutions in that layout.

    Why: XLA's CPU backend rewrites convolutions into the layout its fast kernels take
    only at the top level of a program; inside a ``while`` loop (every ``lax.scan`` of
    local steps, every ``lax.map`` over clients) the two gradients JAX's autodiff derives
    keep their transposed layouts and run as a naive loop nest, 13× slower than the same
    step called on its own (benchmarks/README.md, W4). Written here with explicit
    transposes, all three convolutions of a step run on the fast kernels wherever they
    are. Equal to ``lax.conv_general_dilated`` and its autodiff up to float rounding.

    Args:
      x: ``[N, H, W, C_in]``.
      kernel: ``[kh, kw, C_in, C_out]``.
      strides: ``(sh, sw)``.
      pads: ``((low, high), (low, high))``.
    """
    return jax.lax.conv_general_dilated(x, kernel, strides, pads, dimension_numbers=_NHWC)


def _conv2d_fwd(x, kernel, strides, pads):
    return conv2d(x, kernel, strides, pads), (x, kernel)


def _conv2d_bwd(strides, pads, residuals, dy):
    x, kernel = residuals
    kh, kw = kernel.shape[:2]
    spatial, window, out = x.shape[1:3], (kh, kw), dy.shape[1:3]
    # The rows (columns) past the last window, which the forward pass never read.
    extra = [
        n + lo + hi - k - (o - 1) * s
        for n, (lo, hi), k, o, s in zip(spatial, pads, window, out, strides, strict=True)
    ]
    # dx: dy dilated by the strides, convolved with the flipped kernel (in/out swapped).
    flipped = jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2)
    dx_pads = tuple(
        (k - 1 - lo, k - 1 - hi + e) for k, (lo, hi), e in zip(window, pads, extra, strict=True)
    )
    dx = jax.lax.conv_general_dilated(
        dy, flipped, (1, 1), dx_pads, lhs_dilation=strides, dimension_numbers=_NHWC
    )
    # dkernel[a, b, i, o] = Σ x_pad[n, y·s + a, x·s + b, i] dy[n, y, x, o]: a convolution
    # with C_in as the batch, N as the features and dy (dilated by the strides) as kernel.
    dk_pads = tuple((lo, hi - e) for (lo, hi), e in zip(pads, extra, strict=True))
    dk = jax.lax.conv_general_dilated(
        x.transpose(3, 1, 2, 0),
        dy.transpose(1, 2, 0, 3),
        (1, 1),
        dk_pads,
        rhs_dilation=strides,
        dimension_numbers=_NHWC,
    )
    return dx.astype(x.dtype), dk.transpose(1, 2, 0, 3).astype(kernel.dtype)


conv2d.defvjp(_conv2d_fwd, _conv2d_bwd)


class Conv(nn.Module):
    """``nn.Conv`` (2-D, NHWC, no dilation or groups) computed with :func:`conv2d`: the
    same params (``kernel`` ``[kh, kw, in, out]`` initialised LeCun-normal, ``bias``
    zeros) and outputs, with gradients that stay fast inside loops on CPU.

    Attributes:
      features: output channels.
      kernel_size: ``(kh, kw)``.
      strides: an int or ``(sh, sw)``.
      padding: ``"SAME"``, ``"VALID"``, an int or ``((low, high), (low, high))``.
      use_bias: whether to add a bias.
    """

    features: int
    kernel_size: tuple[int, int]
    strides: int | tuple[int, int] = 1
    padding: Any = "SAME"
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):
        window = tuple(self.kernel_size)
        strides = (self.strides,) * 2 if isinstance(self.strides, int) else tuple(self.strides)
        shape = (*window, x.shape[-1], self.features)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), shape, jnp.float32)
        pads = _pads(x.shape[1:3], window, strides, self.padding)
        y = conv2d(x, kernel.astype(x.dtype), strides, pads)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
            y = y + bias.reshape((1, 1, 1, self.features)).astype(y.dtype)
        return y


class CNN(nn.Module):
    """The CNN of McMahan et al. (2017), "Communication-Efficient Learning of Deep
    Networks from Decentralized Data" (their MNIST "CNN").

    Two 5x5 convolutions (32 then 64 channels, SAME padding, ReLU), each followed by a
    2x2 max-pool of stride 2, a dense layer of 512 (ReLU) and a dense layer to the
    logits: 1,663,370 params on 28x28x1 images and 10 classes, the count the paper gives.
    The same layers take 32x32x3 (CIFAR) images (the first dense layer then reads 8x8x64
    features). Convolutions are :class:`Conv` (``nn.Conv``'s params, kernels ``[h, w, in,
    out]``, with gradients that stay fast inside loops on CPU); the
    dense layers are this module's :class:`Dense` (kernels ``[out, in]``), fed the pooled
    features flattened in ``(H, W, C)`` order.

    Attributes:
      num_classes: number of classes.
      conv_features: channels of the two convolutions.
      hidden: width of the hidden dense layer.
    """

    num_classes: int
    conv_features: Sequence[int] = (32, 64)
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        h = _images(x, "cnn")
        for i, features in enumerate(self.conv_features):
            h = nn.relu(Conv(features, (5, 5), padding="SAME", name=f"conv_{i}")(h))
            h = nn.max_pool(h, (2, 2), strides=(2, 2))
        h = h.reshape((h.shape[0], -1))
        h = nn.relu(Dense(self.hidden, name="hidden")(h))
        return Dense(self.num_classes, name="output")(h)


RESNET_NORMS = ("group", "batch")


def _norm(kind: str, groups: int, name: str, train: bool, mask):
    """ResNet's normalisation layer as a function of ``h``: GroupNorm, or BatchNorm with
    batch statistics over the real examples of ``mask`` in training (running ones in
    inference; PyTorch's momentum 0.1 and epsilon)."""
    if kind == "group":
        return nn.GroupNorm(num_groups=groups, epsilon=1e-5, name=name)
    norm = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name)
    return lambda h: norm(h, mask=None if mask is None else mask[:, None, None, None])


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3 (stride) - norm - ReLU - conv3x3 - norm, plus the
    input (through a 1x1 conv and norm where the stride or width changes), ReLU."""

    features: int
    strides: int
    groups: int
    norm: str = "group"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        def norm(name):
            return _norm(self.norm, self.groups, name, train, mask)

        s = (self.strides, self.strides)
        h = Conv(self.features, (3, 3), s, padding=1, use_bias=False, name="conv_0")(x)
        h = nn.relu(norm("norm_0")(h))
        h = Conv(self.features, (3, 3), padding=1, use_bias=False, name="conv_1")(h)
        h = norm("norm_1")(h)
        if self.strides != 1 or x.shape[-1] != self.features:
            x = Conv(self.features, (1, 1), s, padding=0, use_bias=False, name="proj")(x)
            x = norm("proj_norm")(x)
        return nn.relu(h + x)


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images with GroupNorm in place of BatchNorm, the federated
    CIFAR model of Hsieh et al. (2020), "The Non-IID Data Quagmire of Decentralized
    Machine Learning" (also Reddi et al. 2021, "Adaptive Federated Optimization").

    CIFAR-style stem (a 3x3 convolution of ``width`` channels, stride 1, GN, ReLU; no
    max-pool), four stages of two :class:`BasicBlock` of widths ``width`` x (1, 2, 4, 8)
    and first strides (1, 2, 2, 2), global average pooling and a dense layer (this
    module's :class:`Dense`) to the logits: 11,173,962 params at width 64 and 10 classes,
    as the BatchNorm network it replaces. Choices:

    * every GroupNorm has **2 groups** (``num_groups=2``, whatever the layer's width), as
      in Hsieh et al. and Reddi et al.; ``epsilon=1e-5`` (PyTorch's default).
    * convolutions have no bias (a norm follows each); padding 1 on both sides of every
      3x3 convolution (PyTorch's, rather than flax's lopsided ``SAME`` at stride 2).
    * where the stride or width changes, the shortcut is a 1x1 convolution with
      GroupNorm (torchvision's "option B").

    No running statistics: the params are the whole state, which is what makes the model
    fit federated averaging. Other image sizes work too (the pooling is global).

    ``norm="batch"`` puts BatchNorm back (the network Hsieh et al. compare against): its
    running statistics are then the problem's model state, averaged or kept per client
    (:func:`resnet18`'s ``state_policy``).

    Attributes:
      num_classes: number of classes.
      width: channels of the stem and the first stage (64 in the paper).
      groups: GroupNorm groups per layer.
      norm: ``"group"`` or ``"batch"`` (:data:`RESNET_NORMS`).
    """

    num_classes: int
    width: int = 64
    groups: int = 2
    norm: str = "group"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = _images(x, "resnet18")
        h = Conv(self.width, (3, 3), padding=1, use_bias=False, name="stem")(h)
        h = nn.relu(_norm(self.norm, self.groups, "stem_norm", train, mask)(h))
        for stage, (multiple, strides) in enumerate(zip((1, 2, 4, 8), (1, 2, 2, 2), strict=True)):
            for block in range(2):
                h = BasicBlock(
                    self.width * multiple,
                    strides if block == 0 else 1,
                    self.groups,
                    self.norm,
                    name=f"stage_{stage}_block_{block}",
                )(h, train, mask)
        return Dense(self.num_classes, name="output")(jnp.mean(h, axis=(1, 2)))


class CharLSTM(nn.Module):
    """The next-character LSTM of LEAF's Shakespeare task (Caldas et al. 2018; also
    FedJAX, Reddi et al. 2021): an embedding of ``embed_dim`` (8), two LSTM layers of
    ``hidden`` (256) units, and a dense layer to the vocabulary.

    Takes ``[B, T]`` integer character ids in ``[0, num_classes)`` and returns the logits
    of the character after each window, read from the last time step: LEAF's task, one
    label per 80-character window (not the per-position sequence loss of TFF's variant).
    The vocabulary of the inputs is that of the labels, ``num_classes`` (LEAF's 80
    characters; 81 with an out-of-vocabulary id, 90 with FedJAX's table). Any integer
    dtype of ids works (uint8 saves memory); an id outside the vocabulary is not checked
    on device (JAX's gather returns NaN for it).
    The LSTM cells are flax's ``nn.OptimizedLSTMCell`` (kernels ``[in, out]``, gates
    i, f, g, o; zero initial state); the output layer is this module's :class:`Dense`.

    Attributes:
      num_classes: the vocabulary size.
      embed_dim: width of the character embedding.
      hidden: units of each LSTM layer.
      num_layers: number of stacked LSTM layers.
    """

    num_classes: int
    embed_dim: int = 8
    hidden: int = 256
    num_layers: int = 2

    @nn.compact
    def __call__(self, x):
        if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"model 'char_lstm' takes a batch of integer character ids [B, T], got an "
                f"array of shape {tuple(x.shape)} and dtype {x.dtype}."
            )
        h = nn.Embed(self.num_classes, self.embed_dim, name="embed")(x)
        for i in range(self.num_layers):
            # The zero state in the activations' dtype (the cell's default is float32).
            zeros = jnp.zeros((x.shape[0], self.hidden), h.dtype)
            cell = nn.OptimizedLSTMCell(self.hidden, name=f"lstm_{i}")
            h = nn.RNN(cell, name=f"rnn_{i}")(h, initial_carry=(zeros, zeros))
        return Dense(self.num_classes, name="output")(h[:, -1])


def _positive_int(name: str, value, *, even: bool = False) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < 1 or (even and number % 2):
        kind = "a positive even integer" if even else "a positive integer"
        raise ValueError(f"{name}={value!r} must be {kind}.")
    return number


def cnn(input_shape: Sequence[int], num_classes: int, *, key=None) -> Problem:
    """The CNN of McMahan et al. (2017) (see :class:`CNN`) for images ``(H, W)`` or
    ``(H, W, C)``, e.g. ``(28, 28)`` or ``(32, 32, 3)``.

    Examples:
      >>> problem = cnn((28, 28), 10, key=jr.key(0))
      >>> sum(a.size for a in jax.tree.leaves(problem.params))
      1663370
      >>> problem.params["conv_0"]["kernel"].shape, problem.params["hidden"]["kernel"].shape
      ((5, 5, 1, 32), (512, 3136))
    """
    _check_shape(input_shape, num_classes)
    _image_shape(input_shape, "cnn")
    return classification_problem(CNN(num_classes), input_shape, jr.key(0) if key is None else key)


def resnet18(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    key=None,
    resnet_width: int = 64,
    resnet_norm: str = "group",
    state_policy: str = "average",
) -> Problem:
    """ResNet-18 with GroupNorm (2 groups per layer; see :class:`ResNet18`) for images
    ``(H, W)`` or ``(H, W, C)``, e.g. CIFAR's ``(32, 32, 3)``, or with BatchNorm.

    Args:
      input_shape: shape of one image.
      num_classes: number of classes.
      key: PRNG key of the initial params (default ``jax.random.key(0)``).
      resnet_width: channels of the first stage (64: the paper's ResNet-18); the stages
        have 1, 2, 4 and 8 times as many. Even, for the 2 GroupNorm groups.
      resnet_norm: ``"group"`` (GroupNorm) or ``"batch"`` (BatchNorm, exact over each
        batch's real examples, with running statistics kept as ``state_policy`` says).
      state_policy: ``"average"`` or ``"local"`` (:attr:`Problem.state_policy`), for
        ``resnet_norm="batch"``.
    """
    _check_shape(input_shape, num_classes)
    _image_shape(input_shape, "resnet18")
    width = _positive_int("resnet_width", resnet_width, even=True)
    if resnet_norm not in RESNET_NORMS:
        raise ValueError(f"resnet_norm={resnet_norm!r} is unknown; use one of {RESNET_NORMS}.")
    module = ResNet18(num_classes, width=width, norm=resnet_norm)
    key = jr.key(0) if key is None else key
    if resnet_norm == "group":
        return classification_problem(module, input_shape, key)
    return classification_problem(
        module, input_shape, key, train_arg="train", mask_arg="mask", state_policy=state_policy
    )


def char_lstm(
    input_shape: Sequence[int],
    num_classes: int,
    *,
    key=None,
    lstm_hidden: int = 256,
    embed_dim: int = 8,
) -> Problem:
    """The next-character LSTM of LEAF's Shakespeare (see :class:`CharLSTM`): examples
    are windows of ``T`` character ids (``input_shape == (T,)``, LEAF's ``T`` is 80),
    labels the id of the next character; ``num_classes`` is the vocabulary size.

    Args:
      input_shape: ``(T,)``, the window length.
      num_classes: the vocabulary size (of both the inputs and the labels).
      key: PRNG key of the initial params (default ``jax.random.key(0)``).
      lstm_hidden: units of each of the two LSTM layers (256 in LEAF).
      embed_dim: width of the character embedding (8 in LEAF).
    """
    _check_shape(input_shape, num_classes)
    if len(input_shape) != 1:
        raise ValueError(
            f"model 'char_lstm' takes windows of character ids, input_shape=(T,), got "
            f"input_shape={tuple(input_shape)}."
        )
    module = CharLSTM(
        num_classes,
        embed_dim=_positive_int("embed_dim", embed_dim),
        hidden=_positive_int("lstm_hidden", lstm_hidden),
    )
    return classification_problem(
        module, input_shape, jr.key(0) if key is None else key, input_dtype=jnp.int32
    )


# =====================================================================================
# The registry
# =====================================================================================
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
