"""FedBuff's in-flight table (:class:`InFlight`, in :attr:`SimState.inflight
<scaffold_jax.types.SimState>`): the M clients training at any time, what the first step
fills it with, and the running totals a FedBuff state says itself. The server step that
reads and writes it is :mod:`scaffold_jax.engine.buffered`."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.sampling import sample_available
from scaffold_jax.types import ClientOutput, PyTree, SimState


class InFlight(NamedTuple):
    """The in-flight table: ``[M]`` slots, each a client training since ``start`` from the
    model of ``version``, whose upload is due at ``finish`` with ``outputs`` (its Δy_i and
    message), its new client row ``rows`` and its model's running statistics ``stats``
    (None without them). ``active``: a client holds the slot (an availability model may
    leave none to start); ``reported``: its upload will count (not dropped, not timed
    out). ``now``: the virtual time of the last step; ``downloads`` / ``uploads``: the
    clients started and the uploads counted so far (the byte accounting's totals)."""

    ids: jax.Array
    version: jax.Array
    start: jax.Array
    finish: jax.Array
    outputs: ClientOutput
    rows: PyTree
    now: jax.Array
    active: jax.Array
    reported: jax.Array
    stats: PyTree
    downloads: jax.Array
    uploads: jax.Array


def initial_inflight(algorithm, params, client_row, concurrency: int, stats=None) -> InFlight:
    """An empty table of ``concurrency`` slots (filled by the first step); ``stats``: the
    model's running statistics of one client, for a model that keeps them."""

    def zeros(tree, dtype=None):
        return jax.tree.map(
            lambda a: jnp.zeros((concurrency, *jnp.shape(a)), dtype or jnp.result_type(a)), tree
        )

    like = {} if algorithm.uplink is None else algorithm.uplink(params)
    outputs = ClientOutput(
        zeros(params, jnp.float32), jnp.zeros((concurrency,), jnp.float32), {},
        zeros(like, jnp.float32),
    )  # fmt: skip
    slots = jnp.zeros((concurrency,), jnp.int32)
    never = jnp.zeros((concurrency,), bool)
    return InFlight(
        ids=slots, version=slots, start=slots.astype(jnp.float32),
        finish=slots.astype(jnp.float32), outputs=outputs, rows=zeros(client_row),
        now=jnp.zeros((), jnp.float32), active=never, reported=never,
        stats=None if stats is None else zeros(stats), downloads=jnp.zeros((), jnp.int32),
        uploads=jnp.zeros((), jnp.int32),
    )  # fmt: skip


def running_totals(execution, state: SimState) -> dict[str, float]:
    """The running totals of the records (``scaffold_jax.loop.RUNNING_TOTALS``) that a
    FedBuff state says itself after t steps: the clients started (downloaded) and the
    uploads counted, from its own counters, and the clock's ``now`` seconds. ``{}`` at
    t = 0. A run continuing a state it did not return reads them here."""
    del execution
    if int(state.round) == 0:
        return {}
    table = state.inflight
    return {
        "downloads": float(table.downloads),
        "uploads": float(table.uploads),
        "round_duration": float(table.now),
    }


def start_key(key: jax.Array) -> jax.Array:
    """The key of the first M clients' draw and work: a key of the run that no step's key
    (``fold_in(key, step)``) equals."""
    return jr.fold_in(key, np.uint32(2**32 - 2))


def initial_clients(key: jax.Array, num_clients: int, concurrency: int, available=None):
    """The M clients in flight at time 0, uniformly without replacement among the
    ``available`` ones (bool ``[N]``; None: all): ``(ids, present)``, int32 and bool
    ``[M]`` (``present`` false for a slot no available client is left for)."""
    if available is None:
        available = jnp.ones((num_clients,), bool)
    return sample_available(start_key(key), available, concurrency)
