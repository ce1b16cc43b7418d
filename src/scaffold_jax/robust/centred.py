"""An aggregator's own server state: centered clipping starts each round from the previous
round's aggregate, so it lives beside the algorithm's server state
(:class:`CentredServerState`), checkpointed and resumed with it.

:func:`with_centre` wraps an algorithm so that every function that reads the server state
reads its ``inner`` part, and the message transform ``apply(outputs, context, centre) ->
(outputs, released)`` releases the new centre (``released["robust_centre"]``) that the
server update stores after the algorithm's own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaffold_jax.local import takes
from scaffold_jax.messages import MessageTransform, uplink_like
from scaffold_jax.types import Algorithm, FullDataPass, ServerOutput


class CentredServerState(NamedTuple):
    """Attributes: inner (the algorithm's server state), centre (``[D]`` float32: the
    previous round's aggregate of the clients' whole messages, before η_g or any server
    optimizer; zeros before the first round), pass_centre (the same for the message of a
    pre-round pass, Mime's full-batch gradient; None without one)."""

    inner: Any
    centre: jax.Array
    pass_centre: jax.Array | None = None


def _inner_first(fn: Callable, position: int = 0) -> Callable:
    """``fn`` called with its ``position``-th argument's ``inner`` part (its signature
    kept, so the engine passes it what it passed ``fn``)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = list(args)
        args[position] = args[position].inner
        return fn(*args, **kwargs)

    return wrapped


def _width(tree) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def _centred_pass(full_pass: FullDataPass | None) -> FullDataPass | None:
    """A pre-round pass on the inner state whose aggregate (released by the robust
    transform on it) becomes the next round's ``pass_centre``."""
    if full_pass is None:
        return None

    def server(state, mean, released):
        received = full_pass.server(state.inner, mean)
        return state._replace(inner=received, pass_centre=released["robust_centre"])

    return full_pass._replace(client=_inner_first(full_pass.client), server=server)


def with_centre(algorithm: Algorithm, apply: Callable, **changes) -> Algorithm:
    """``algorithm`` with a :class:`CentredServerState` and the robust transform ``apply``
    last in its message pipeline (``changes``: the wrapper's other fields)."""
    inner = algorithm
    pre_round = _centred_pass(changes.pop("pre_round", inner.pre_round))

    def init(params):
        server, client = inner.init(params)
        centre = jnp.zeros(_width(uplink_like(inner, params)), jnp.float32)
        pass_centre = None
        if inner.pre_round is not None:
            sends = inner.pre_round.sends or (lambda params: params)
            pass_centre = jnp.zeros(_width(jax.eval_shape(sends, params)), jnp.float32)
        return CentredServerState(server, centre, pass_centre), client

    def transform(outputs, states, context):
        released = {}
        if inner.messages is not None:
            inner_context = context._replace(server=context.server.inner)
            outputs, states, released = inner.messages.apply(outputs, states, inner_context)
        outputs, out = apply(outputs, context, context.server.centre)
        metrics = {**released.get("metrics", {}), **out.get("metrics", {})}
        return outputs, states, {**released, **out, "metrics": metrics}

    def server_update(hparams, state, outputs, total_weight, cohort_size=None, key=None,
                      released=None):  # fmt: skip
        given = {"cohort_size": cohort_size, "key": key, "released": released}
        extra = {k: v for k, v in given.items() if takes(inner.server_update, k)}
        result = inner.server_update(hparams, state.inner, outputs, total_weight, **extra)
        new, metrics = result if isinstance(result, ServerOutput) else (result, {})
        return ServerOutput(state._replace(inner=new, centre=released["robust_centre"]), metrics)

    personal = None
    if inner.personal is not None:
        personal = _inner_first(inner.personal, 1)
        personal.global_model = getattr(inner.personal, "global_model", True)
    sync = (
        None if inner.client_sync is None else _inner_first(_inner_first(inner.client_sync, 1), 2)
    )
    return inner._replace(
        init=init,
        client_update=_inner_first(inner.client_update, 1),
        server_update=server_update,
        server_params=lambda state: inner.server_params(state.inner),
        downlink=None if inner.downlink is None else lambda state: inner.downlink(state.inner),
        pre_round=pre_round,
        client_sync=sync,
        personal=personal,
        messages=MessageTransform(
            (lambda params: None) if inner.messages is None else inner.messages.init,
            transform,
            None if inner.messages is None else inner.messages.sizes,
        ),
        **changes,
    )
