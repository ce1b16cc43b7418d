"""pFedMe: personalized models through Moreau envelopes.

T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS
2020 (Algorithm 1). https://arxiv.org/abs/2006.08848

Client i's personal model θ_i approximately minimises ``f_i(θ) + (λ/2)‖θ − w‖²``, w its
local copy of x. A sampled client sets w = x and θ = x and, for each of its K steps with
batch b, takes J inner steps ``θ ← θ − η_in (∇f_i(θ; b) + λ (θ − w))`` (θ carries over
from step to step), then ``w ← w − η_l λ (w − θ)``. It writes θ_i = θ and sends Δw = w − x
alone; the server mixes ``x ← x + β · mean Δw`` = (1 − β) x + β · mean w, β the server
step size η_g (``server_lr``, in (0, 1]; with a server optimizer, its step on −mean Δw).
The client state is a :class:`PersonalState`: ``shared`` ``()``, ``own`` θ_i (θ_i⁰ = x⁰),
kept at its new value by a client that trains and then drops; θ_i never leaves the
client, so its bytes are FedAvg's and under differential privacy only Δw is private.
p_i = θ_i. ``local_loss`` is the mean over steps of f_i(θ; b) at θ before the step's
inner steps.

Hyper-parameters: ``pfedme_lambda`` λ > 0 (default 15, the paper's value for MNIST);
``pfedme_inner_lr`` η_in, where 0 (the default) means η_l; ``pfedme_inner_steps`` J, a
whole number ≥ 1 (default 5, the paper's). J is a hyper-parameter rather than a factory
option so that a sweep over it is one program: the inner loop is a ``while_loop`` whose
bound is the traced J, which costs nothing when J is the same for every client (it is
per config), and a sweep over J runs each config's loop to the largest J with the steps
past its own masked. Not asynchronous (FedBuff refuses it); a model with running
statistics (BatchNorm) is refused, since θ_i would need statistics of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.algorithms._steps import active_steps, index, masked_steps, step_keys
from scaffold_jax.algorithms.common import (
    records_options,
    server_params,
    stateless_init,
    stateless_server_update,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.local import batch_grad
from scaffold_jax.types import Algorithm, ClientOutput, HParam, PersonalState

HPARAMS = {
    "client_lr": HParam(None, "client (local) step size eta_l"),
    "server_lr": HParam(1.0, "server step size eta_g; pFedMe's mixing beta, in (0, 1]",
                        maximum=1.0),
    "pfedme_lambda": HParam(15.0, "pFedMe: weight lambda of the personal model's pull to w"),
    "pfedme_inner_lr": HParam(0.0, "pFedMe: inner step size eta_in (0: client_lr)",
                              allow_zero=True),
    "pfedme_inner_steps": HParam(5.0, "pFedMe: inner steps J on theta per local step",
                                 minimum=1.0, integer=True),
}  # fmt: skip


@records_options
def pfedme(loss_fn, server_optimizer=None) -> Algorithm:
    """pFedMe (see the module docstring).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: as in :func:`~scaffold_jax.algorithms.fedavg.fedavg`.
    """
    server_optimizer = transformation(server_optimizer)
    init_stateless = stateless_init(server_optimizer)

    def init(params):
        server, _ = init_stateless(params)
        return server, PersonalState((), server.params)

    def client_update(hparams, server_state, client_state, batches, mask, key):
        del client_state  # θ starts from x every round
        x = server_state.params
        lam, lr = hparams.pfedme_lambda, hparams.client_lr
        inner_lr = jnp.where(hparams.pfedme_inner_lr > 0, hparams.pfedme_inner_lr, lr)
        inner_steps = hparams.pfedme_inner_steps.astype(jnp.int32)
        key_of = step_keys(loss_fn, key)

        def step(k, carry):
            w, theta, loss_sum = carry
            batch, batch_mask = index(batches, k), index(mask, k)

            def inner(state):
                j, theta, first = state
                loss, grad = batch_grad(loss_fn, theta, batch, batch_mask, key_of(k))
                grad = optax.tree.add_scale(grad, lam, optax.tree.sub(theta, w))
                first = jnp.where(j == 0, loss.astype(jnp.float32), first)
                return j + 1, optax.tree.add_scale(theta, -inner_lr, grad), first

            start = (jnp.zeros((), jnp.int32), theta, jnp.float32(0.0))
            _, theta, loss = jax.lax.while_loop(lambda s: s[0] < inner_steps, inner, start)
            w = optax.tree.add_scale(w, -lr * lam, optax.tree.sub(w, theta))
            return w, theta, loss_sum + loss

        active = active_steps(mask)
        w, theta, loss_sum = masked_steps(step, (x, x, jnp.float32(0.0)), active)
        steps = jnp.sum(active).astype(jnp.float32)
        output = ClientOutput(
            delta_params=optax.tree.sub(w, x),
            weight=jnp.ones((), jnp.float32),
            metrics={"local_loss": loss_sum / jnp.maximum(steps, 1.0), "local_steps": steps},
        )
        return PersonalState((), theta), output

    return Algorithm(
        name="pfedme",
        init=init,
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
        hparams=HPARAMS,
        personal=lambda hparams, server_state, client_state, adapt: client_state.own,
    )


register(
    "pfedme", pfedme, "pFedMe", options=SERVER_OPTIMIZER,
    refuses={"local_optimizer": "pFedMe's inner and outer steps are the paper's plain "
                                "gradient steps"},
    hparams=HPARAMS,
    personalized=True,
)  # fmt: skip
