"""ResNet-18 with GroupNorm (or BatchNorm), the federated CIFAR model of Hsieh et al. (2020)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.models.layers import Conv, Dense, _check_shape, _images, _positive_int
from scaffold_jax.models.problem import classification_problem
from scaffold_jax.types import Problem

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
    and first strides (1, 2, 2, 2), global average pooling and a dense layer
    (:class:`Dense`) to the logits: 11,173,962 params at width 64 and 10 classes,
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
    _check_shape(input_shape, num_classes, "resnet18")
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
