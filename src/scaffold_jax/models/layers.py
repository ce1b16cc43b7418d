"""The layers the models share, :class:`Dense` (kernels ``[out, in]``) and :class:`Conv`
(fast gradients inside loops on CPU), and the checks of their inputs' shapes."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def _features(x: jax.Array) -> jax.Array:
    """Flattens an example to float32 features; integer pixels are divided by 255."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        x = x.astype(jnp.float32) * (1.0 / 255.0)
    return x.astype(jnp.float32).reshape((x.shape[0], -1))


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
        init = lambda key, shape: nn.initializers.lecun_normal()(key, shape).T
        kernel = self.param("kernel", init, (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        # Contract x's last axis with the kernel's input axis (its minor one).
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())))
        return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def _check_shape(input_shape: Sequence[int], num_classes: int, images: str | None = None):
    """Refuses an empty example or fewer than 2 classes; for ``images`` (the name of a model
    of images), one example must be an image ``(H, W, C)``, ``(H, W)`` meaning one channel:
    anything else (a flattened ``(784,)`` vector, a channels-first image) is refused."""
    if len(input_shape) == 0 or math.prod(input_shape) < 1:
        raise ValueError(f"input_shape={tuple(input_shape)} must describe a non-empty example.")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes={num_classes} must be >= 2.")
    if images is None:
        return
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
            f"model {images!r} takes images of shape (H, W) or (H, W, C) per example, got "
            f"input_shape={shape}.{hint}"
        )
    if len(shape) == 3 and shape[0] <= 4 < shape[2]:
        raise ValueError(
            f"model {images!r} takes channels-last images (H, W, C), got input_shape={shape}, "
            f"which looks channels-first: transpose the examples to "
            f"{(shape[1], shape[2], shape[0])}."
        )


def _positive_int(name: str, value, *, even: bool = False) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < 1 or (even and number % 2):
        kind = "a positive even integer" if even else "a positive integer"
        raise ValueError(f"{name}={value!r} must be {kind}.")
    return number


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
