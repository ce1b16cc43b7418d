"""The round's axes: the sampled clients (one ``vmap``, or chunks of them under ``lax.map``),
a sweep's configs (vmapped, or one after another) and the rounds (a ``lax.scan``).

The phases of a round (:mod:`scaffold_jax.engine.phases`) are written for one config; these
are what is applied around them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from scaffold_jax.local import CLIENT_AXIS
from scaffold_jax.types import PyTree


def over_clients(fn: Callable, args: PyTree, chunk: int | None, active: jax.Array | None = None):
    """``fn`` over the leading client axis of ``args``: one ``vmap`` (named
    :data:`~scaffold_jax.local.CLIENT_AXIS`), or a ``lax.map`` over chunks of ``chunk``
    clients, each chunk one such vmap (None: all at once).

    ``active`` (bool, one per client): a chunk with no active client is skipped and gives
    zeros (a Poisson round's padding: the caller discards those rows). Only chunks skip:
    one vmap over all clients runs them all."""
    vmapped = jax.vmap(fn, axis_name=CLIENT_AXIS)
    if chunk is None:
        return vmapped(*args)

    def each(body):
        if active is None:
            return lambda a: body(*a)

        def run(a):
            chunk_args, chunk_active = a
            zeros = jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(body, *chunk_args)
            )
            return jax.lax.cond(jnp.any(chunk_active), lambda: body(*chunk_args), lambda: zeros)

        return run

    mapped = args if active is None else (args, active)
    if chunk == 1:
        # Not chunks of one: that vmaps the body over an axis of one, whose batched dots
        # and convolutions XLA's CPU backend runs slower than the plain ones.
        return jax.lax.map(each(fn), mapped)
    # lax.map(batch_size=) would vmap the chunks without the axis name: chunk by hand.
    num = jax.tree.leaves(args)[0].shape[0]
    whole = num - num % chunk
    head = jax.tree.map(lambda a: a[:whole].reshape(whole // chunk, chunk, *a.shape[1:]), mapped)
    out = jax.lax.map(each(vmapped), head)
    out = jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), out)
    if whole == num:
        return out
    tail = each(vmapped)(jax.tree.map(lambda a: a[whole:], mapped))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)


def repeat_rounds(step: Callable, carry: PyTree, num_rounds: int, stop=None):
    """``num_rounds`` applications of ``step: carry -> (carry, metrics)``, metrics stacked
    on a leading ``[num_rounds]`` axis: a ``lax.scan``.

    With ``stop`` (a traced int <= ``num_rounds``) a ``lax.while_loop`` runs the first
    ``stop`` rounds only, writing each round's metrics into a ``[num_rounds]`` buffer
    (rows from ``stop`` on stay zero), so one compiled program serves blocks of any length
    up to ``num_rounds``: a run whose evaluation period does not divide its rounds, or
    whose checkpoints fall between evaluations, compiles once.
    """
    if stop is None:
        return jax.lax.scan(lambda c, _: step(c), carry, None, length=num_rounds)
    like = jax.eval_shape(step, carry)[1]
    buffer = jax.tree.map(lambda s: jnp.zeros((num_rounds, *s.shape), s.dtype), like)

    def body(loop):
        i, carry, buffer = loop
        carry, metrics = step(carry)
        write = lambda b, m: jax.lax.dynamic_update_index_in_dim(b, m, i, 0)  # noqa: E731
        return i + 1, carry, jax.tree.map(write, buffer, metrics)

    start = (jnp.zeros((), jnp.int32), carry, buffer)
    _, carry, buffer = jax.lax.while_loop(lambda loop: loop[0] < stop, body, start)
    return carry, buffer


def at_once(fn: Callable, in_axes: Any = 0) -> Callable:
    """``fn`` itself: a round of one config (see :func:`over_configs`)."""
    del in_axes
    return fn


def over_configs(configs: int, fn: Callable, in_axes: Any = 0) -> Callable:
    """``fn`` vmapped over a group's leading ``[M]`` config axis (``Simulation.round_fn``
    with ``configs``); what is not per config is closed over or given ``in_axes`` None.
    (``axis_size``: an algorithm without client state has an empty table.)"""
    return jax.vmap(fn, in_axes=in_axes, axis_size=configs)


def one_after_another(fn: Callable) -> Callable:
    """``fn`` mapped (``lax.map``) over the leading axis of every argument: a vmap that
    runs one slice at a time (a sweep's configs or seeds, see
    :meth:`Simulation.configs_one_at_a_time`)."""
    return lambda *args: jax.lax.map(lambda xs: fn(*xs), args)


def swap_leading(configs: int | None, tree: PyTree) -> PyTree:
    """``[M, S, ...]`` ↔ ``[S, M, ...]`` for a group of configs (nothing for one config)."""
    if not configs or tree is None:
        return tree
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), tree)
