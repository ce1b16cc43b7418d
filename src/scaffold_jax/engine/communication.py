"""Communication accounting: the bytes each client receives and sends per round.

Every algorithm states what its clients download (:attr:`Algorithm.downlink
<scaffold_jax.types.Algorithm.downlink>`, a function of the server state; default the
model x) and what they upload besides Δy_i (:attr:`Algorithm.uplink
<scaffold_jax.types.Algorithm.uplink>`, the structure of its ``ClientOutput.message``; a
``pre_round`` pass's message too); Δy_i covers the params :attr:`Algorithm.delta
<scaffold_jax.types.Algorithm.delta>` names (all of them by default; FedRep's body
alone). The bytes are derived from those pytrees' shapes and dtypes with
``jax.eval_shape`` (nothing is allocated), never typed by hand; a message
transform that changes what is sent (compression) states its own sizes
(:attr:`MessageTransform.sizes <scaffold_jax.messages.MessageTransform.sizes>`).

The compiled round counts, per round, the clients that downloaded (those who took part,
a dropped client included: it downloaded and trained, its upload was lost) and those that
uploaded (those who reported); the host multiplies the counts by the per-client bytes
(:func:`traffic`) in exact integer arithmetic, so the totals are exact at any scale
(float32 bytes would not be past 16 MiB). Records carry ``bytes_down``/``bytes_up``
(means per round since the previous record) and ``bytes_down_total``/``bytes_up_total``
(cumulative over the run's rounds, a resumed run continuing its checkpoint's; see
:func:`byte_fields`).

Expected, for P float32 parameters and no compression, per participant (the manual's page
“The network model”):
FedAvg/FedProx down 4P, up 4P; SCAFFOLD 8P/8P; MimeLite 8P/8P (momentum's s; Mime also
receives c: 12P down); FedNova up 4P + 4 (its τ_i).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaffold_jax.messages import uplink_like
from scaffold_jax.tree import tree_bytes
from scaffold_jax.types import Algorithm, PyTree

#: The round metrics the engine reports for the accounting: clients that downloaded and
#: clients that uploaded, per round.
COUNTS = ("downloads", "uploads")


class Traffic(NamedTuple):
    """Bytes per participating client and round.

    Attributes:
      down: what a client that takes part receives (:attr:`Algorithm.downlink`).
      up: what a client that reports sends with its update: Δy_i and its message entries,
        at their sizes after the message transforms (compressed where compressed).
      pre_round: what a client sends in the ``pre_round`` pass (Mime's ∇f_i(x)) before
        its local work: sent by a client that drops afterwards too. 0 without one.
      entries: ``up`` by entry (``"delta_params"`` and the message's names).
    """

    down: int
    up: int
    pre_round: int
    entries: dict[str, int]


def traffic(
    algorithm: Algorithm, params: PyTree, hparams: Mapping[str, Any] | None = None
) -> Traffic:
    """The bytes a participating client receives and sends per round (:class:`Traffic`),
    with one config's ``hparams`` (plain numbers; a compressor's bits or fraction)."""
    server, _ = jax.eval_shape(algorithm.init, params)
    downlink = algorithm.downlink or algorithm.server_params
    down = tree_bytes(jax.eval_shape(downlink, server))
    like = uplink_like(algorithm, params)
    sizes = getattr(algorithm.messages, "sizes", None)
    if sizes is None:
        entries = {name: tree_bytes(tree) for name, tree in like.items()}
    else:
        entries = {name: int(n) for name, n in sizes(like, dict(hparams or {})).items()}
    pre_round = 0
    if algorithm.pre_round is not None:
        sends = algorithm.pre_round.sends
        if sends is None:  # a float32 gradient per parameter, whatever Δy_i covers
            sends = lambda p: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)  # noqa: E731
        pre_round = tree_bytes(jax.eval_shape(sends, params))
    return Traffic(down, sum(entries.values()), pre_round, entries)


def uplink_bytes(algorithm: Algorithm, params: PyTree, hparams) -> jax.Array:
    """:attr:`Traffic.up` in the program: the bytes a reporting client sends with one
    config's traced ``hparams`` (a compressor's bits or fraction), float32, the same sizes
    :func:`traffic` counts exactly on the host (what the virtual clock times)."""
    sizes = algorithm.messages.sizes(uplink_like(algorithm, params), hparams)
    return sum(jnp.asarray(n, jnp.float32) for n in sizes.values())


def check_uplink(algorithm: Algorithm, params: PyTree, message: PyTree) -> None:
    """Raises ValueError when a client's ``ClientOutput.message`` (one client's, traced)
    is not the structure its algorithm states in ``uplink`` (the accounting and the
    compression would count or compress something else)."""
    stated = uplink_like(algorithm, params)
    del stated["delta_params"]
    made = {} if message is None else message

    def structure(tree):
        return jax.tree.map(lambda a: (tuple(jnp.shape(a)), str(jnp.result_type(a))), tree)

    if not isinstance(made, Mapping) or structure(dict(made)) != structure(stated):
        raise ValueError(
            f"{algorithm.name}'s clients send the message {structure(made)}, but the "
            f"algorithm states uplink = {structure(stated)}: set Algorithm.uplink to a "
            "function of the params returning the structure of ClientOutput.message "
            "(communication accounting and compression read it)."
        )


def with_bytes(entry: dict[str, Any], per_client: Traffic) -> dict[str, Any]:
    """``entry`` (a record) with the driver's counts replaced by :func:`byte_fields`."""
    counts = {k: entry.pop(k) for k in [*COUNTS, *(f"{c}_total" for c in COUNTS)] if k in entry}
    entry.update(byte_fields(counts, per_client))
    return entry


def byte_fields(values: Mapping[str, Any], per_client: Traffic) -> dict[str, float]:
    """A record's bytes from the driver's counts (``downloads``/``uploads``: means per
    round since the previous record; ``downloads_total``/``uploads_total``: cumulative):
    ``bytes_down``, ``bytes_up`` and their ``_total`` s. Counts of a config that diverged
    (NaN) give NaN."""
    out: dict[str, float] = {}
    for suffix in ("", "_total"):
        downloads, uploads = values.get("downloads" + suffix), values.get("uploads" + suffix)
        if downloads is None or uploads is None:
            continue
        downloads, uploads = float(downloads), float(uploads)
        down = downloads * per_client.down
        up = uploads * per_client.up + downloads * per_client.pre_round
        if suffix and math.isfinite(down) and math.isfinite(up):  # whole counts: exact ints
            downloads, uploads = round(downloads), round(uploads)
            down = downloads * per_client.down
            up = uploads * per_client.up + downloads * per_client.pre_round
        out["bytes_down" + suffix], out["bytes_up" + suffix] = down, up
    return out
