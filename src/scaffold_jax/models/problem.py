"""A flax classifier (linen or NNX) as a :class:`~scaffold_jax.types.Problem`, with the
checks made when it is initialised (its signature, its size against the memory)."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from scaffold_jax import resources
from scaffold_jax.types import STATE_POLICIES, Problem


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
    ``x[..., None].astype("float32") / 255`` (the registered ``logreg``, ``mlp`` and
    ``cnn`` do). ``input_shape`` is one example's shape, ``x.shape[1:]``.

    On CPU a module that uses flax's ``nn.Conv`` (2-D) gets a warning: its gradients
    inside the loop of local steps take XLA's slow convolution path, and a round takes
    longer, by the factor :data:`FLAX_CONV_COST`, than with
    :class:`~scaffold_jax.models.Conv`, which takes the same arguments and makes the same
    params. A module with ``nn.Dropout`` but no ``train_arg`` gets one too: it is only
    ever called in inference mode.

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
            stacklevel=2,
        )
    dropouts = [m for m in called if isinstance(m, nn.Dropout) and m.rate > 0]
    if dropouts and train_arg is None:
        warnings.warn(
            f"{name} has nn.Dropout (rate {dropouts[0].rate}) but classification_problem "
            "got no train_arg, so the module is always called in inference mode and its "
            "dropout never acts: give train_arg='train' (the name of its training-mode "
            "argument, passed on as nn.Dropout(rate, deterministic=not train)).",
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
    params, num_classes = variables["params"], getattr(module, "num_classes", None)
    if not extra:

        def logits_of(params, x, key=None):  # a key: training mode (dropout), else inference
            mode = {} if train_arg is None else {train_arg: key is not None}
            rngs = None if key is None else {"dropout": key}
            return module.apply({"params": params}, x, **mode, rngs=rngs)

        return _classifier(params, logits_of, num_classes, stochastic=train_arg is not None)
    state = {k: variables[k] for k in extra}
    return _linen_stateful(module, params, state, num_classes, train_arg, mask_arg, state_policy)


#: What flax's ``nn.Conv`` costs in a model on CPU: a round's time against the same model
#: with :class:`~scaffold_jax.models.Conv` (FedAvg and SCAFFOLD, S = 5, K = 10, B = 20,
#: 28×28 images), measured by ``benchmarks/bench_flax_conv.py`` on a busy 2-core VM
#: (README, "Bringing your own model"); :func:`classification_problem`'s warning quotes it.
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
    """Whether :class:`~scaffold_jax.models.Conv` computes what this ``nn.Conv`` does: 2-D,
    no dilation or groups, padding that it takes."""

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


def _linen_stateful(module, params, model_state, num_classes, train_arg, mask_arg, state_policy):
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

    return _stateful_classifier(params, model_state, train, infer, num_classes, state_policy)


def _stateful_classifier(params, initial, train, infer, num_classes, state_policy) -> Problem:
    """The :class:`Problem` of a classifier with running statistics, from ``train(params,
    state, x, mask, key) -> (logits, new_state)`` (training mode: batch statistics over
    the real examples of ``mask``) and ``infer(params, state, x) -> logits``."""

    # Without state, training mode, whose outputs do not depend on the running statistics
    # (BatchNorm normalises with the batch's own): the initial ones stand in.
    def logits_of(params, x, state, mask=None, key=None):
        if state is None:
            return train(params, initial, x, mask, key)[0]
        return infer(params, state, x)

    def loss_fn(params, batch, key=None, mask=None, state=None):
        logits = logits_of(params, batch["x"], state, mask, key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])

    def accuracy_fn(params, batch, state=None):
        logits = logits_of(params, batch["x"], state)
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
