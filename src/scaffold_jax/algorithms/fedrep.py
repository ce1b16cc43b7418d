"""FedRep and FedPer: a body φ shared by all clients, a head h_i of each client's own.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021. https://arxiv.org/abs/2102.07078 (Algorithm 1).
Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
Layers", arXiv 2019. https://arxiv.org/abs/1912.00818

The head (option ``head``) is a comma-separated list of path prefixes over the params'
leaves, a leaf's path being its keys joined by ``/`` (``output`` is every leaf of the
layer ``output``, ``output/kernel`` that leaf alone); ``auto`` (the default) is the
top-level entry ``output`` (every built-in classifier's last layer), or for a model
without one the last top-level entry in the params' flatten order. A prefix naming no
leaf is refused, and so, for FedRep, is a head covering every leaf. Body and head are
dicts ``{path: leaf}``. The client state is a :class:`PersonalState`: ``shared`` ``()``,
``own`` h_i (h_i⁰ = h⁰), kept at its new value by a client that trains and then drops.

- FedRep: a sampled client takes τ_h steps on h alone from h_i, φ = x_φ frozen, on the
  batches of ``draw(0)`` (``head_steps``, a whole number, default 2^24: all K, as is any
  τ_h ≥ K; step size ``head_lr``, where 0, the default, means η_l), then the K
  steps of the plan's batches on φ alone from x_φ, h frozen at its new value.
- FedPer: the K steps on (φ, h) jointly from (x_φ, h_i).

Both write h_i and send Δφ alone; the server steps x_φ ← x_φ + η_g · mean Δφ (or a
server optimizer's step on −mean Δφ), its head staying h⁰. p_i = (x_φ, h_i). Bytes: down
φ, up Δφ (``downlink`` and ``delta``); compression compresses Δφ and, under differential
privacy, only Δφ is private (h_i never leaves the client). The server keeps no trained
head: ``personal.global_model`` is False, so no ``local_*`` accuracy is reported. Not
asynchronous (FedBuff refuses them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.algorithms.common import (
    ServerState,
    init_server_optimizer,
    records_options,
    server_model_step,
    stateless_init,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.local import local_sgd
from scaffold_jax.registry import Option
from scaffold_jax.tree import weighted_mean
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParam, PersonalState

#: τ_h's default: every step of the run's plan, as a whole number that json, configs, a
#: sweep's grid and float32 all hold exactly (inf would not pass the configs' checks).
ALL_STEPS = 2**24

HPARAMS = {
    **STEP_SIZES,
    "head_steps": HParam(
        ALL_STEPS,
        "FedRep: head steps tau_h per round (default: all K)",
        allow_zero=True,
        integer=True,
    ),
    "head_lr": HParam(0.0, "FedRep: head step size (0: client_lr)", allow_zero=True),
}


def leaf_paths(params) -> list[str]:
    """Every leaf's path, its keys joined by ``/``, in flatten order."""

    def key(entry):
        return str(
            next((getattr(entry, a) for a in ("key", "name", "idx") if hasattr(entry, a)), entry)
        )

    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return ["/".join(key(e) for e in path) for path, _ in flat]


def head_paths(params, head: str = "auto", whole: bool = True) -> frozenset[str]:
    """The paths of the leaves ``head`` names (see the module docstring); ValueError for
    a prefix naming no leaf or, unless ``whole``, a head covering every leaf."""
    paths = leaf_paths(params)
    prefixes = [p.strip().strip("/") for p in str(head).split(",") if p.strip()]
    if prefixes == ["auto"]:
        tops = [p.split("/")[0] for p in paths]
        prefixes = ["output" if "output" in tops else tops[-1]] if tops else []

    def under(path, prefix):
        return path == prefix or path.startswith(prefix + "/")

    missing = [q for q in prefixes if not any(under(p, q) for p in paths)]
    chosen = frozenset(p for p in paths if any(under(p, q) for q in prefixes))
    if missing or not chosen:
        why = f"{', '.join(missing) or 'it'} names no leaf"
    elif chosen == set(paths) and not whole:
        why = "it covers every leaf, leaving FedRep no body to share"
    else:
        return chosen
    raise ValueError(
        f"head = {head!r} is refused: {why}; the params' leaves are {', '.join(paths)} "
        "(name some by path prefix, comma-separated)."
    )


def _personalized(loss_fn, head: str, server_optimizer, rep: bool) -> Algorithm:
    server_optimizer = transformation(server_optimizer)

    def parts(params):  # (body, head) as {path: leaf}
        chosen = head_paths(params, head, whole=not rep)
        flat = dict(zip(leaf_paths(params), jax.tree.leaves(params), strict=True))
        return (
            {p: a for p, a in flat.items() if p not in chosen},
            {p: a for p, a in flat.items() if p in chosen},
        )

    def join(params, *parts):
        new = {p: a for part in parts for p, a in part.items()}
        leaves = [
            new.get(p, a) for p, a in zip(leaf_paths(params), jax.tree.leaves(params), strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(params), leaves)

    def train(y, batches, mask, lr, names, key, stats):  # local SGD moving ``names`` alone
        def update(grads, state, params=None):
            paths = zip(leaf_paths(grads), jax.tree.leaves(grads), strict=True)
            kept = [g if p in names else jnp.zeros_like(g) for p, g in paths]
            return jax.tree.unflatten(jax.tree.structure(grads), kept), state

        optimizer = None if names is None else optax.GradientTransformation(lambda _: (), update)
        return local_sgd(loss_fn, y, batches, mask, lr, None, None, optimizer, key, stats)

    def init(params):
        server, _ = stateless_init(None)(params)
        body, own = parts(server.params)
        opt_state = init_server_optimizer(server_optimizer, body)
        return ServerState(server.params, opt_state), PersonalState((), own)

    def client_update(
        hparams, server_state, client_state, batches, mask, key, model_state=None, draw=None
    ):
        x = server_state.params
        body, _ = parts(x)
        y, names, stats = join(x, client_state.own), None, model_state
        if rep:
            if draw is None:
                raise TypeError("FedRep's client_update needs draw= (the engine passes it).")
            head_batches, head_mask = draw(0)
            steps = jnp.arange(head_mask.shape[0], dtype=jnp.float32) < hparams.head_steps
            steps = steps.reshape(steps.shape + (1,) * (head_mask.ndim - 1))
            lr = jnp.where(hparams.head_lr > 0, hparams.head_lr, hparams.client_lr)
            # A dropout loss's keys: below the draw streams' fold_in(key, 2^30 + s) and above
            # the body steps' fold_in(key, k), k < K (algorithms do not import the engine).
            head_key = jax.random.fold_in(key, (1 << 30) - 1)
            head_mask = head_mask * steps.astype(head_mask.dtype)
            y, info = train(y, head_batches, head_mask, lr, set(client_state.own), head_key, stats)
            stats, names = info.model_state, set(body)
        y, info = train(y, batches, mask, hparams.client_lr, names, key, stats)
        new_body, own = parts(y)
        metrics = {"local_loss": info.mean_loss, "local_steps": info.num_steps.astype(jnp.float32)}
        delta, weight = optax.tree.sub(new_body, body), jnp.ones((), jnp.float32)
        return PersonalState((), own), ClientOutput(delta, weight, metrics, {}, info.model_state)

    def server_update(hparams, state, outputs, total_weight):
        del total_weight
        body, _ = parts(state.params)
        delta = weighted_mean(outputs.delta_params, outputs.weight)
        body, opt_state = server_model_step(server_optimizer, hparams, body, state.opt_state, delta)
        return ServerState(join(state.params, body), opt_state)

    def personal(hparams, server_state, client_state, adapt):
        return join(server_state.params, client_state.own)

    personal.global_model = False  # x = (x_φ, h⁰): no model anyone trained
    return Algorithm(
        name="fedrep" if rep else "fedper",
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        hparams=HPARAMS if rep else STEP_SIZES,
        personal=personal,
        downlink=lambda state: parts(state.params)[0],
        delta=lambda params: parts(params)[0],
    )


@records_options
def fedrep(loss_fn, head: str = "auto", server_optimizer=None) -> Algorithm:
    """FedRep (see the module docstring): τ_h head steps, then K body steps; sends Δφ."""
    return _personalized(loss_fn, head, server_optimizer, rep=True)


@records_options
def fedper(loss_fn, head: str = "auto", server_optimizer=None) -> Algorithm:
    """FedPer (see the module docstring): K steps on body and head jointly; sends Δφ."""
    return _personalized(loss_fn, head, server_optimizer, rep=False)


HEAD = {
    "head": Option(
        "auto",
        "FedRep/FedPer: the head's leaves, comma-separated path prefixes "
        "(keys joined by /, e.g. output or output/kernel); auto: output, else the "
        "last top-level entry",
    )
}
register(
    "fedrep",
    fedrep,
    "FedRep",
    options={**HEAD, **SERVER_OPTIMIZER},
    hparams=HPARAMS,
    personalized=True,
)
register(
    "fedper",
    fedper,
    "FedPer",
    options={**HEAD, **SERVER_OPTIMIZER},
    hparams=STEP_SIZES,
    personalized=True,
)
