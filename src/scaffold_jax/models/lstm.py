"""The next-character LSTM of LEAF's Shakespeare task."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.models.layers import Dense, _check_shape, _positive_int
from scaffold_jax.models.problem import classification_problem
from scaffold_jax.types import Problem


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
    i, f, g, o; zero initial state); the output layer is :class:`Dense`.

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
