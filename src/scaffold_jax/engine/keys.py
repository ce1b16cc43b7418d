"""The round's randomness: every draw of a round comes from ``fold_in(key, round)`` split
into streams of their own, so what a client does depends on its id, never on its position
in the sampled set, on how the client axis is laid out, or on which other models (DP's
noise, participation) draw in the same round."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.participation.base import constants_key
from scaffold_jax.sampling import uniform


def client_keys(round_key: jax.Array, ids: jax.Array) -> jax.Array:
    """Per-client keys derived from the client id (``[S]`` keys)."""
    clients_key = jr.split(round_key)[1]
    return jax.vmap(lambda i: jr.fold_in(clients_key, i))(ids)


def shared_key(round_key: jax.Array) -> jax.Array:
    """The key every client of a round shares (``client_update``'s ``round_key=``, e.g.
    Scaffnew's number of local steps): the round key's third stream, after the two that
    ``split(round_key)`` gives the sampler and the clients (``split(k)[i]`` is
    ``fold_in(k, i)``), so it is independent of both."""
    return jr.fold_in(round_key, 2)


#: Where :func:`extra_batches_key`'s streams start: far above any step index the local
#: steps fold into a client's key (a dropout loss's ``fold_in(key, k)``, k < K).
_EXTRA_BATCHES = 1 << 30


def extra_batches_key(client_key: jax.Array, stream: int) -> jax.Array:
    """The key of a client's extra batches of stream ``stream`` in a round
    (``client_update``'s ``draw``): independent of the batches its key draws and of the
    per-step keys folded into it."""
    return jr.fold_in(client_key, _EXTRA_BATCHES + stream)


def round_key_and_ids(
    key, round_index, num_clients, clients_per_round, sampler=uniform, available=None
):
    """The round's key and its S client ids, drawn by ``sampler`` from the round key's
    first stream (:mod:`scaffold_jax.sampling`), among the ``available`` clients when a
    mask is given. A sampler of varying cohorts (or one drawing among the available) gives
    ``(ids, present)`` for the ids (see :func:`~scaffold_jax.sampling.split_sample`)."""
    round_key = jr.fold_in(key, round_index)
    extra = {} if available is None else {"available": available}
    ids = sampler(jr.split(round_key)[0], round_index, num_clients, clients_per_round, **extra)
    return round_key, (ids if isinstance(ids, tuple) else jnp.asarray(ids, jnp.int32))


def server_key(round_key: jax.Array) -> jax.Array:
    """The key of the server's own randomness in a round (``server_update``'s ``key=``,
    e.g. differential privacy's noise): the round key's fourth stream, independent of the
    sampler's, the clients' and :func:`shared_key`'s."""
    return jr.fold_in(round_key, 3)


#: The participation models' streams of :func:`participation_key`.
AVAILABILITY_STREAM, STRAGGLER_STREAM, DROPOUT_STREAM = 0, 1, 2


def participation_key(round_key: jax.Array, stream: int) -> jax.Array:
    """The key of a participation model's draws in a round (``stream``: availability 0,
    stragglers 1, dropouts 2): the round key's fifth stream, split by model, so none of
    them moves the sampler's, the clients', :func:`shared_key`'s or :func:`server_key`'s
    draws (a run without them is today's, bitwise)."""
    return jr.fold_in(jr.fold_in(round_key, 4), stream)


__all__ = [
    "client_keys",
    "constants_key",
    "extra_batches_key",
    "participation_key",
    "round_key_and_ids",
    "server_key",
    "shared_key",
]
