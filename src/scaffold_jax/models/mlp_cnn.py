"""The dense and convolutional models: logistic regression and the MLP of the paper's
Tables 3 and 5, and the CNN of McMahan et al. (2017)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.models.layers import Conv, Dense, _check_shape, _features, _images
from scaffold_jax.models.problem import classification_problem
from scaffold_jax.types import Problem


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


class CNN(nn.Module):
    """The CNN of McMahan et al. (2017), "Communication-Efficient Learning of Deep
    Networks from Decentralized Data" (their MNIST "CNN").

    Two 5x5 convolutions (32 then 64 channels, SAME padding, ReLU), each followed by a
    2x2 max-pool of stride 2, a dense layer of 512 (ReLU) and a dense layer to the
    logits: 1,663,370 params on 28x28x1 images and 10 classes, the count the paper gives.
    The same layers take 32x32x3 (CIFAR) images (the first dense layer then reads 8x8x64
    features). Convolutions are :class:`Conv` (``nn.Conv``'s params, kernels ``[h, w, in,
    out]``, with gradients that stay fast inside loops on CPU); the dense layers are
    :class:`Dense` (kernels ``[out, in]``), fed the pooled features flattened in
    ``(H, W, C)`` order.

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
    _check_shape(input_shape, num_classes, "cnn")
    return classification_problem(CNN(num_classes), input_shape, jr.key(0) if key is None else key)
