"""The message pipeline: what the clients send passes through an ordered chain of message
transforms between their local work and the server's aggregation.

A :class:`MessageTransform` is a pair of pure functions, as an optax transformation is:

* ``init(params) -> state``: one client's state (a pytree, or None for a transform that
  keeps none). The engine keeps the chain's states as a table with a leading ``[N]``
  client axis in :attr:`SimState.messages <scaffold_jax.types.SimState.messages>`, beside
  the algorithm's client table: gathered for the sampled clients, written back after the
  round (a client that did not report keeps its row), checkpointed and laid out with it.
* ``apply(outputs, states, context) -> (outputs, states, released)``: the round's
  :class:`~scaffold_jax.types.ClientOutput` rows (``[S, ...]``: ``delta_params``,
  ``message``, and ``weight``, 0 for a client that does not report) and their states in,
  the rows the server aggregates out, with the new states and ``released``, a dict of
  values the server may read beside the rows (the algorithm's ``server_update`` gets it
  as ``released=`` when it has that parameter); its ``"metrics"`` entry, a dict of
  scalars, joins the round's metrics (the Byzantine clients' counts).

:func:`chain` composes transforms, applied in order. An algorithm names its chain in
:attr:`Algorithm.messages <scaffold_jax.types.Algorithm.messages>`; differential privacy
(:func:`scaffold_jax.privacy.private`) adds its clipping and noise there. A new transform
is a module of its own: nothing in the round changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaffold_jax.types import Algorithm, ClientOutput, HParams, PyTree


class MessageContext(NamedTuple):
    """What a transform may read of the round besides the messages.

    Attributes:
      hparams: the config's hyper-parameters.
      server: the algorithm's server state the clients started from (after a pre-round
        pass), e.g. a private algorithm's adaptive clip norm.
      cohort_size: the round's expected cohort S (float32): differential privacy divides
        by it, never by the realised count.
      key: the server's key of the round (:func:`scaffold_jax.engine.server_key`).
      ids: the ``[S]`` ids of the rows (−1 for a varying cohort's empty slots).
      run_key: a key constant for the whole run (the Byzantine clients' set is drawn
        from it); None where the execution mode gives none (FedBuff).
      num_clients: N.
    """

    hparams: HParams
    server: PyTree
    cohort_size: jax.Array
    key: jax.Array
    ids: jax.Array | None = None
    run_key: jax.Array | None = None
    num_clients: int | None = None


class MessageTransform(NamedTuple):
    """A transform of the clients' messages (see the module docstring).

    ``sizes(like, hparams) -> {entry: bytes}``, optional: the bytes a client sends of each
    uplink entry after the transform (a compressor's), given the entries' uncompressed
    structure (``{"delta_params": ..., **message}`` of ``ShapeDtypeStruct`` s) and one
    config's hyper-parameters as plain numbers. None: the transform sends what it gets
    (:mod:`scaffold_jax.engine.communication` counts the entries' own bytes)."""

    init: Callable[[PyTree], PyTree]
    apply: Callable[
        [ClientOutput, PyTree, MessageContext], tuple[ClientOutput, PyTree, dict[str, Any]]
    ]
    sizes: Callable[[Mapping[str, PyTree], Mapping[str, float]], Mapping[str, int]] | None = None


def uplink_like(algorithm: Algorithm, params: PyTree) -> dict[str, PyTree]:
    """The structure of what a reporting client sends: ``{"delta_params": ..., **message}``
    as ``ShapeDtypeStruct`` s (Δy_i is float32, as the local steps compute it, over the
    params :attr:`Algorithm.delta <scaffold_jax.types.Algorithm.delta>` names: all of
    them by default)."""
    covered = algorithm.delta or (lambda p: p)
    like = jax.eval_shape(
        lambda p: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), covered(p)), params
    )
    message = {} if algorithm.uplink is None else jax.eval_shape(algorithm.uplink, params)
    return {"delta_params": like, **dict(message)}


def stateless(apply: Callable[[ClientOutput, MessageContext], tuple]) -> MessageTransform:
    """A transform that keeps no per-client state, from ``apply(outputs, context) ->
    (outputs, released)``."""

    def apply_with_state(outputs, states, context):
        outputs, released = apply(outputs, context)
        return outputs, states, released

    return MessageTransform(lambda params: None, apply_with_state)


def chain(*transforms: MessageTransform | None) -> MessageTransform | None:
    """The transforms applied one after another (None entries skipped; None if none is
    left). The chain's state is the tuple of its transforms' states, None when no
    transform keeps any, so that a stateless chain adds nothing to the simulation state."""
    transforms = tuple(t for t in transforms if t is not None)
    if not transforms:
        return None
    if len(transforms) == 1:
        return transforms[0]

    def init(params):
        states = tuple(t.init(params) for t in transforms)
        return None if all(s is None for s in states) else states

    def apply(outputs, states, context):
        new_states, released = [], {}
        for i, transform in enumerate(transforms):
            outputs, state, out = transform.apply(
                outputs, None if states is None else states[i], context
            )
            new_states.append(state)
            for name, value in out.items():  # the transforms' records add up
                released[name] = {**released.get(name, {}), **value} if name == "metrics" else value
        return outputs, (None if states is None else tuple(new_states)), released

    # What is sent is the last size-changing transform's (compression, say): the others
    # (differential privacy's clipping) change values, not sizes.
    sized = [t.sizes for t in transforms if t.sizes is not None]
    return MessageTransform(init, apply, sized[-1] if sized else None)
