"""Compression of the clients' uplink messages, as a message transform (what each
compressor sends and costs: the manual's page “The network model”).

A :class:`Compressor` acts on ONE leaf of ONE client's message, flattened to a float32
vector: ``apply(v, key, residual, hparams) -> (sent, residual)`` and ``bits(size,
hparams) -> int``, what the sent leaf costs. Registered by name in :data:`COMPRESSORS`
(one module each: ``qsgd``, ``topk``, ``randk``, ``signef``; a plugin registers its own),
each entry declaring its hyper-parameters (``compress_bits``, ``compress_fraction``:
sweepable data, like a step size) and options.

:func:`compressed` wraps an algorithm: its clients' Δy_i (and, with ``entries="all"``,
every entry of their ``ClientOutput.message``: SCAFFOLD's Δc_i, FedNova's τ_i) are
compressed, leaf by leaf, before the server aggregates them, and the server uses what was
sent where it used the exact values. A compressor with error feedback (``topk``,
``signef``) keeps a residual e_i per client and leaf in the message transforms' client
table (:attr:`SimState.messages <scaffold_jax.types.SimState.messages>`: checkpointed,
sharded like the clients' rows): u = v + e_i is compressed, e_i ← u − sent. A client
that does not report (not sampled, unavailable, dropped after training: its upload
never happened) keeps its e_i.

For SCAFFOLD with Δc_i compressed the server's c moves by the compressed Δc_i while each
client keeps its exact c_i⁺, so c = mean c_i no longer holds exactly (it holds in
expectation for an unbiased compressor).

Mime's pre-round message (∇f_i(x)) is sent uncompressed. With differential privacy the
order is ``private(compressed(algorithm, c))``: each client compresses, then clips what
it sends, and the server adds the noise to the sum of the clipped, compressed messages.
Clipping scales a message, so it costs the compressed bytes; the sensitivity is the clip
norm whatever the compressor did (an error-feedback residual stays on the client, never
released). The other order is refused (:func:`compressed` says why).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.compression.fraction import fraction_count
from scaffold_jax.messages import MessageTransform, chain, uplink_like
from scaffold_jax.registry import Option, Registry, factory_kwargs
from scaffold_jax.tree import decode_storage, encode_storage, tree_bytes
from scaffold_jax.types import Algorithm, HParam, PyTree

#: Which uplink entries a compressor compresses (``compress_entries``): every entry (Δy and
#: the message's), or the entries named, comma-separated (``delta_params`` is Δy).
ALL = "all"

#: The message transforms' key stream of compression (folded into the round's server
#: key, so that its draws are independent of differential privacy's noise).
_STREAM = 0x636F  # "co"


class Compressor(NamedTuple):
    """A compressor of one client's leaf (see the module docstring).

    Attributes:
      apply: ``apply(v, key, residual, hparams) -> (sent, residual)``: ``v`` float32
        ``[n]``, ``residual`` float32 ``[n]`` (None without error feedback; return None).
      bits: ``bits(size, hparams) -> int``, the bits a sent leaf of ``size`` entries
        costs, with one config's hyper-parameters as plain floats (an exact int), or as
        the program's traced values (float32: the virtual clock times what is sent; see
        :func:`whole`).
      error_feedback: whether it keeps a residual per client and leaf.
    """

    apply: Callable[..., tuple[jax.Array, jax.Array | None]]
    bits: Callable[[int, Mapping[str, float]], int]
    error_feedback: bool = False


class CompressorSpec(NamedTuple):
    """A registered compressor: the :class:`Compressor`, the hyper-parameters it reads
    (``{name: HParam}``) and one line of help."""

    compressor: Compressor | None
    hparams: Mapping[str, HParam]
    help: str = ""
    options: Mapping[str, Option] = {}


COMPRESSORS: Registry[CompressorSpec] = Registry("compressor")

#: The options every compressor takes (config keys).
OPTIONS = {
    "compress_entries": Option(
        "all",
        "which uplink entries are compressed: all (Δy and every message entry, e.g. "
        "SCAFFOLD's Δc), or names, comma-separated: delta_params (Δy), delta_control, ...",
        "str",
        argument="entries",
    ),
    "compress_residual_dtype": Option(
        "float32",
        "storage of an error-feedback residual (topk, signef): float32, or bfloat16 to "
        "halve its client table",
        "str",
        choices=("float32", "bfloat16"),
        argument="residual_dtype",
    ),
}


def compressed(
    algorithm: Algorithm, compressor: str, entries: str = "all", residual_dtype: str = "float32"
) -> Algorithm:
    """``algorithm`` with its clients' uplink compressed by the registered ``compressor``
    (see the module docstring); ``"none"`` returns it unchanged."""
    spec = COMPRESSORS[compressor]
    if spec.compressor is None:
        return algorithm
    names = chosen_entries(algorithm, entries)
    if "privacy" in algorithm.options:
        raise ValueError(
            f"compressed(private(...), {compressor!r}) is refused: compressing after the "
            "clip can raise a message's norm above the clip norm the noise is calibrated to "
            "(qsgd and randk scale entries up; topk and signef add their residuals). "
            "Compress first and make that private: private(compressed(algorithm, "
            f"{compressor!r})), which clips what is sent (the command line builds it so)."
        )
    if residual_dtype not in ("float32", "bfloat16"):
        raise ValueError(
            f"compress_residual_dtype = {residual_dtype!r} is invalid: use float32 or bfloat16."
        )
    transform = compression(spec.compressor, algorithm, names, residual_dtype)
    options = {
        **algorithm.options,
        "compression": {
            "compressor": compressor,
            "entries": list(names),
            "residual_dtype": residual_dtype,
        },
    }
    return algorithm._replace(
        messages=chain(algorithm.messages, transform),
        hparams={**algorithm.hparams, **spec.hparams},
        options=options,
    )


def wrap(algorithm: Algorithm, compressor: str, options: Mapping[str, Any]) -> Algorithm:
    """:func:`compressed` with a config's options (``compress_entries``...) by their keys:
    compression's ``wrap`` in :data:`scaffold_jax.wrappers.WRAPPERS`."""
    declared = COMPRESSORS[compressor].options
    return compressed(algorithm, compressor, **factory_kwargs(declared, options))


def chosen_entries(algorithm: Algorithm, entries: str) -> tuple[str, ...]:
    """The uplink entries ``compress_entries`` names for ``algorithm`` (``"all"``: every
    one); ValueError for a name its clients do not send. (``uplink``'s names must not
    depend on the params: it is called with ``{}`` here.)"""
    sent = ["delta_params", *({} if algorithm.uplink is None else algorithm.uplink({}))]
    if not isinstance(entries, str) or not entries.strip():
        raise ValueError(
            f"compress_entries = {entries!r} is invalid: use all, or entry names "
            f"comma-separated ({algorithm.name} sends {', '.join(sent)})."
        )
    if entries.strip() == ALL:
        return tuple(sent)
    names = tuple(dict.fromkeys(n.strip() for n in entries.split(",")))
    unknown = [n for n in names if n not in sent]
    if unknown:
        raise ValueError(
            f"compress_entries names {', '.join(unknown)}, which {algorithm.name}'s clients "
            f"do not send: they send {', '.join(sent)} (or use all)."
        )
    return names


def compression(
    compressor: Compressor, algorithm: Algorithm, names: tuple[str, ...], residual_dtype: str
) -> MessageTransform:
    """The message transform of :func:`compressed` for the uplink entries ``names``."""

    def chosen(like: Mapping[str, PyTree]) -> list[str]:
        return [name for name in like if name in names]

    def init(params):
        if not compressor.error_feedback:
            return None
        like = uplink_like(algorithm, params)
        zeros = {
            name: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), like[name])
            for name in chosen(like)
        }
        return encode_storage(zeros, residual_dtype)

    def one_client(sent, residual, key, hparams):
        leaves, tree = jax.tree.flatten(sent)
        stored = None if residual is None else jax.tree.leaves(residual)
        new_leaves, new_residual = [], []
        for i, leaf in enumerate(leaves):
            e = None if stored is None else decode_storage(stored[i]).reshape(-1)
            v = jnp.asarray(leaf, jnp.float32).reshape(-1)
            out, e = compressor.apply(v, jr.fold_in(key, i), e, hparams)
            new_leaves.append(out.reshape(jnp.shape(leaf)).astype(jnp.result_type(leaf)))
            if e is not None:
                new_residual.append(encode_storage(e.reshape(jnp.shape(leaf)), residual_dtype))
        sent = jax.tree.unflatten(tree, new_leaves)
        if residual is None:
            return sent, None
        return sent, jax.tree.unflatten(jax.tree.structure(residual), new_residual)

    def apply(outputs, states, context):
        entries_now = {"delta_params": outputs.delta_params, **dict(outputs.message or {})}
        names = chosen(entries_now)
        picked = {name: entries_now[name] for name in names}
        count = jax.tree.leaves(outputs.weight)[0].shape[0]
        keys = jr.split(jr.fold_in(context.key, _STREAM), count)
        sent, residual = jax.vmap(one_client, in_axes=(0, 0, 0, None))(
            picked, states, keys, context.hparams
        )
        entries_now.update(sent)
        message = {k: v for k, v in entries_now.items() if k != "delta_params"}
        out = outputs._replace(
            delta_params=entries_now["delta_params"],
            message=message if outputs.message is not None else outputs.message,
        )
        return out, residual, {}

    def sizes(like, hparams):
        names = chosen(like)
        out = {}
        for name, tree in like.items():
            leaves = jax.tree.leaves(tree)
            if name in names:
                bits = [compressor.bits(math.prod(s.shape), hparams) for s in leaves]
                out[name] = sum(jnp.ceil(b / 8) if isinstance(b, jax.Array) else -(-b // 8)
                                for b in bits)  # fmt: skip
            else:
                out[name] = tree_bytes(tree)
        return out

    return MessageTransform(init, apply, sizes)


def whole(value):
    """A count for :attr:`Compressor.bits`: an exact Python int on the host, float32 in the
    program (a traced count times bits per entry can pass int32)."""
    return value.astype(jnp.float32) if isinstance(value, jax.Array) else int(value)


def register(name: str, compressor: Compressor | None, hparams: Mapping[str, HParam], help: str):
    """Registers a compressor under ``name`` (re-registering a name replaces it)."""
    return COMPRESSORS.register(
        name, CompressorSpec(compressor, dict(hparams), help, OPTIONS), replace=True
    )


register("none", None, {}, "no compression (the exact messages; bitwise the plain run)")

from scaffold_jax.compression import qsgd, randk, signef, topk  # noqa: E402, F401  (register)

__all__ = [
    "COMPRESSORS",
    "ALL",
    "Compressor",
    "CompressorSpec",
    "compressed",
    "chosen_entries",
    "compression",
    "fraction_count",
    "register",
    "whole",
    "wrap",
]
