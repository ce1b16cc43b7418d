"""An example model plugin: a small CNN with two declared options, registered as
``small_cnn`` for configs and the command line.

    scaffold-jax run --plugin examples/small_cnn.py --model small_cnn \\
        --cnn-channels 16 32 --cnn-dropout 0.25 --dataset fashion_mnist --rounds 50
    scaffold-jax sweep --plugin examples/small_cnn.py --model small_cnn \\
        --grid cnn_dropout=0,0.25 --seeds 0 1 --rounds 50

(or ``plugins = ["examples/small_cnn.py"]``, ``model = "small_cnn"`` in a config file).
Importing this file registers the model; what it shows:

* the batch the module receives is ``x`` as the data layer stores it: uint8 pixels
  ``[B, 28, 28]`` for Fashion-MNIST / MNIST / EMNIST, uint8 ``[B, 32, 32, 3]`` for
  CIFAR-10, so the module adds the channel axis and scales the pixels itself;
* its convolutions are ``sj.models.Conv``, not flax's ``nn.Conv`` (the same arguments and
  params): inside the loop of local steps on CPU ``nn.Conv``'s gradients take XLA's slow
  path (``sj.models.FLAX_CONV_COST``; ``classification_problem`` warns);
* dropout needs a training-mode argument, named to ``classification_problem`` as
  ``train_arg``: the local steps call the module with ``train=True`` and a fresh
  ``"dropout"`` key every step, evaluation with ``train=False``;
* each declared ``Option`` becomes a config key, a flag (``cnn_channels`` is
  ``--cnn-channels``), an axis of ``sweep --grid`` when it is a number, a line of
  ``--help`` and part of the run's identity; ``build`` takes it as a keyword.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

import scaffold_jax as sj
from scaffold_jax.registry import Option


class SmallCNN(nn.Module):
    """3×3 convolutions (ReLU, each followed by a 2×2 max-pool), dropout, a dense layer to
    the logits."""

    num_classes: int
    channels: Sequence[int] = (16,)
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = False):
        if x.ndim == 3:  # [B, H, W] images: one channel
            x = x[..., None]
        if jnp.issubdtype(x.dtype, jnp.integer):  # uint8 pixels 0-255
            x = x.astype(jnp.float32) / 255.0
        for i, features in enumerate(self.channels):
            x = nn.relu(sj.models.Conv(features, (3, 3), name=f"conv_{i}")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="output")(x)


def small_cnn(input_shape, num_classes, *, key, cnn_channels=(16,), cnn_dropout=0.0):
    """The model ``small_cnn`` as a :class:`scaffold_jax.Problem`: ``input_shape`` is one
    example's shape (``(28, 28)``), ``key`` seeds the initial params, the declared options
    arrive as keywords."""
    module = SmallCNN(num_classes, tuple(cnn_channels), float(cnn_dropout))
    return sj.models.classification_problem(module, input_shape, key, train_arg="train")


sj.models.MODELS.register(
    "small_cnn",
    sj.models.ModelSpec(
        small_cnn,
        "small CNN",
        {
            "cnn_channels": Option(
                [16], "small_cnn: channels of each 3x3 convolution", "ints", low=1
            ),
            "cnn_dropout": Option(
                0.0, "small_cnn: dropout rate before the output layer", "float", low=0.0, high=0.9
            ),
        },
    ),
)
