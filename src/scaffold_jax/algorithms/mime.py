"""Mime and MimeLite: a server optimizer's state applied, frozen, in every local step.

Karimireddy, Jaggi, Kale, Mohri, Reddi, Stich, Suresh, "Breaking the centralized barrier
for cross-device federated learning", NeurIPS 2021. https://arxiv.org/abs/2008.03606
(Algorithm 1: Mime and MimeLite).

A base optimizer B (an optax transformation WITHOUT a learning rate; default momentum,
``optax.trace(decay=0.9)``) keeps its state s on the server. Every round:

1. every sampled client computes its full-batch gradient at the server model, ∇f_i(x),
   over ALL its local examples whatever the batch plan, and sends it (one extra
   communication, before the local steps): the algorithm's ``pre_round`` pass. The server
   takes their mean ``c = mean_{i∈S} ∇f_i(x)`` (with ``weighting="num_examples"`` the same
   weights as the model average) and sends it back with x;
2. local steps from y = x with s FIXED (never updated on the client):
   Mime ``g = ∇f_i(y; ζ) − ∇f_i(x; ζ) + c`` (SVRG-style, the same minibatch ζ at y and at
   x: a second gradient per step), MimeLite ``g = ∇f_i(y; ζ)``; then
   ``u, _ = B.update(g, s)`` and ``y ← y − η_l u``;
3. server: ``x ← x + η_g mean_{i∈S} Δy_i`` and ``_, s = B.update(c, s)``: the base
   optimizer's state advances on the full-batch gradient at x, never on the local steps.

With B = ``"sgd"`` (no transformation) MimeLite is FedAvg; with K = 1 full-batch steps
and a base optimizer linear in g (momentum or none; not Adam), Mime's server model equals
MimeLite's (each Mime client steps along ``B(c)``, the mean of MimeLite's ``B(∇f_i(x))``).

An optional server optimizer (FedOpt) may transform the averaged update as for FedAvg; it
is a different thing from B, which the paper keeps at the server learning rate 1.

What a client sends: ∇f_i(x), as the message of the ``pre_round`` pass (before its local
steps), and then Δy_i alone (its ``ClientOutput.message`` is empty). Under differential
privacy each of the two is clipped to C/√2, so the pair stays within C
(:mod:`scaffold_jax.privacy`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax import optimizers
from scaffold_jax.algorithms.common import (
    init_server_optimizer,
    local_update,
    records_options,
    server_model_step,
    server_params,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, optimizer_option, register
from scaffold_jax.local import batch_grad
from scaffold_jax.tree import weighted_mean
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, FullDataPass, HParams, PyTree

#: The paper's base optimizer: heavy-ball momentum with β = 0.9.
DEFAULT_BASE = "momentum:momentum=0.9"


class MimeServerState(NamedTuple):
    """Attributes: params (x), base_state (s, the base optimizer's state), control (c,
    this round's mean full-batch gradient at x; zeros before round 1), opt_state (the
    optional server optimizer's, ``()`` without one)."""

    params: PyTree
    base_state: PyTree
    control: PyTree
    opt_state: PyTree


def frozen(base: optax.GradientTransformation, state: PyTree) -> optax.GradientTransformation:
    """``base`` applied with its state fixed at ``state``: ``update`` returns
    ``base.update(g, state)``'s direction and never advances anything."""

    def update(updates, unused_state, params=None):
        direction, _ = base.update(updates, state, params)
        return direction, unused_state

    return optax.GradientTransformation(lambda params: (), update)


def _mime(loss_fn, name, corrected, base_optimizer, server_optimizer) -> Algorithm:
    base = transformation(base_optimizer) or optax.identity()
    server_optimizer = transformation(server_optimizer)

    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        server = MimeServerState(
            params=params,
            base_state=base.init(params),
            control=optax.tree.zeros_like(params),
            opt_state=init_server_optimizer(server_optimizer, params),
        )
        return server, ()

    def full_gradient(server_state, client_state, batch, mask):
        _, grad = batch_grad(loss_fn, server_state.params, batch, mask)
        return client_state, grad

    def receive(server_state, mean_gradient):
        return server_state._replace(control=mean_gradient)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        x, c = server_state.params, server_state.control

        def svrg(y, batch, batch_mask, step_key):
            del y  # the same minibatch (and dropout key) at x as at y
            _, grad_x = batch_grad(loss_fn, x, batch, batch_mask, step_key)
            return optax.tree.sub(c, grad_x)

        _, output, _ = local_update(
            loss_fn,
            hparams,
            x,
            batches,
            mask,
            correction=svrg if corrected else None,
            optimizer=frozen(base, server_state.base_state),
            key=key,
            model_state=model_state,
        )
        return client_state, output

    def server_update(hparams: HParams, state, outputs: ClientOutput, total_weight):
        del total_weight
        params, opt_state = server_model_step(
            server_optimizer,
            hparams,
            state.params,
            state.opt_state,
            weighted_mean(outputs.delta_params, outputs.weight),
        )
        _, base_state = base.update(state.control, state.base_state, state.params)
        return state._replace(params=params, base_state=base_state, opt_state=opt_state)

    return Algorithm(
        name=name,
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        pre_round=FullDataPass(client=full_gradient, server=receive),
        # Down: x and the frozen s (Mime: and c, after the pre-round pass); up: ∇f_i(x)
        # (the pre-round pass's message) and Δy_i.
        downlink=(
            (lambda state: (state.params, state.base_state, state.control))
            if corrected
            else (lambda state: (state.params, state.base_state))
        ),
    )


@records_options
def mime(
    loss_fn,
    base_optimizer: optax.GradientTransformation | str | None = DEFAULT_BASE,
    server_optimizer: optax.GradientTransformation | str | None = None,
) -> Algorithm:
    """Mime: local steps along ``B(∇f_i(y; ζ) − ∇f_i(x; ζ) + c)`` with B's state frozen.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      base_optimizer: the base optimizer B: an optax transformation WITHOUT a learning
        rate, or its name (:mod:`scaffold_jax.optimizers`; default momentum 0.9; ``"sgd"``
        or None: none).
      server_optimizer: optional optax transformation (or name) on the averaged update,
        as for FedAvg.

    Examples:
      >>> import jax.numpy as jnp
      >>> alg = mime(lambda p, b: jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))
      >>> alg.name, alg.pre_round is not None
      ('mime', True)
    """
    return _mime(loss_fn, "mime", True, base_optimizer, server_optimizer)


@records_options
def mimelite(
    loss_fn,
    base_optimizer: optax.GradientTransformation | str | None = DEFAULT_BASE,
    server_optimizer: optax.GradientTransformation | str | None = None,
) -> Algorithm:
    """MimeLite: local steps along ``B(∇f_i(y; ζ))`` with B's state frozen (no SVRG
    correction, one gradient per step). Arguments as :func:`mime`."""
    return _mime(loss_fn, "mimelite", False, base_optimizer, server_optimizer)


_OPTIONS = {
    **SERVER_OPTIMIZER,
    "base_optimizer": optimizer_option(
        "base_optimizer", optimizers.canonical(DEFAULT_BASE), "Mime's base optimizer B"
    ),
}
_REFUSES = {
    "local_optimizer": "Mime's local steps already apply the base optimizer, frozen; set it "
    "with base_optimizer"
}
register("mime", mime, "Mime", options=_OPTIONS, refuses=_REFUSES, hparams=STEP_SIZES)
register("mimelite", mimelite, "MimeLite", options=_OPTIONS, refuses=_REFUSES, hparams=STEP_SIZES)
