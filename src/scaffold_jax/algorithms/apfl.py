"""APFL: Adaptive Personalized Federated Learning, with a fixed or a learned mixing α_i.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv 2003.13461
(Algorithm 1). https://arxiv.org/abs/2003.13461

Client i keeps a local model v_i (v_i⁰ = x⁰) and a mixing weight α_i; its personal model
is p_i = α_i v_i + (1 − α_i) x. A sampled client sets w = x and, for each of its K steps,
with ONE batch b and every gradient at the pre-step values (w, v, α), updates at once::

    w ← w − η_l ∇f_i(w; b)
    v ← v − η_l α ∇f_i(α v + (1 − α) w; b)            (the gradient with respect to v)
    α ← clip(α − η_α ⟨v − w, ∇f_i(α v + (1 − α) w; b)⟩, 0, 1)    (``apfl_adaptive`` only)

It sends Δw = w − x alone (the server steps as FedAvg's), and writes v_i and α_i. Since w
never reads v or α, the trajectory of x is FedAvg's bitwise for any α; with α = 0, not
adaptive, v_i = x⁰ forever and p_i = x. The client state is a :class:`PersonalState`:
``shared`` ``()``, ``own`` ``(v_i, α_i)``, kept at its new value by a client that trains
and then drops (its upload alone is lost); v_i and α_i never leave the client, so its
bytes are FedAvg's and under differential privacy only Δw is private.

Hyper-parameters: ``apfl_alpha`` α ∈ [0, 1], the initial α_i (and every α_i when not
adaptive; default 0.25, one of the paper's values); ``apfl_alpha_lr`` η_α, where 0 (the
default) means η_l, so that a sweep over client_lr moves both. Since ``init`` sees no
hyper-parameter, a client that has not trained yet holds α_i = −1, read as ``apfl_alpha``
(a sweep over it stays one program). Not asynchronous (FedBuff refuses it); a model with
running statistics (BatchNorm) is refused, since v_i would need statistics of its own.
"""

from __future__ import annotations

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
from scaffold_jax.registry import Option
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParam, PersonalState

HPARAMS = {
    **STEP_SIZES,
    "apfl_alpha": HParam(0.25, "APFL: mixing weight alpha of v_i, its initial value when "
                         "adaptive", allow_zero=True, maximum=1.0),
    "apfl_alpha_lr": HParam(0.0, "APFL: step size eta_alpha of the adaptive alpha_i "
                            "(0: client_lr)", allow_zero=True),
}  # fmt: skip


def mixing(hparams, alpha_i):
    """α_i as stored, or ``apfl_alpha`` for a client that has not trained (α_i < 0)."""
    return jnp.where(alpha_i < 0, hparams.apfl_alpha, alpha_i).astype(jnp.float32)


@records_options
def apfl(loss_fn, server_optimizer=None, adaptive: bool = False) -> Algorithm:
    """APFL (see the module docstring).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: as in :func:`~scaffold_jax.algorithms.fedavg.fedavg`.
      adaptive: learn each α_i (the paper's adaptive APFL); False: α_i = ``apfl_alpha``.
    """
    server_optimizer = transformation(server_optimizer)
    init_stateless = stateless_init(server_optimizer)

    def init(params):
        server, _ = init_stateless(params)
        return server, PersonalState((), (server.params, jnp.float32(-1.0)))

    def client_update(hparams, server_state, client_state, batches, mask, key):
        x = server_state.params
        v, alpha = client_state.own
        alpha = mixing(hparams, alpha) if adaptive else hparams.apfl_alpha
        lr = hparams.client_lr
        alpha_lr = jnp.where(hparams.apfl_alpha_lr > 0, hparams.apfl_alpha_lr, lr)
        key_of = step_keys(loss_fn, key)

        def step(k, carry):
            w, v, alpha, loss_sum = carry
            batch, batch_mask = index(batches, k), index(mask, k)
            loss, grad = batch_grad(loss_fn, w, batch, batch_mask, key_of(k))
            mixed = optax.tree.add(optax.tree.scale(alpha, v), optax.tree.scale(1 - alpha, w))
            _, grad_mixed = batch_grad(loss_fn, mixed, batch, batch_mask, key_of(k))
            if adaptive:
                slope = optax.tree.vdot(optax.tree.sub(v, w), grad_mixed)
                new_alpha = jnp.clip(alpha - alpha_lr * slope, 0.0, 1.0)
            else:
                new_alpha = alpha
            v = optax.tree.add_scale(v, -lr * alpha, grad_mixed)
            w = optax.tree.add_scale(w, -lr, grad)
            return w, v, new_alpha, loss_sum + loss.astype(jnp.float32)

        active = active_steps(mask)
        w, v, alpha, loss_sum = masked_steps(step, (x, v, alpha, jnp.float32(0.0)), active)
        steps = jnp.sum(active).astype(jnp.float32)
        output = ClientOutput(
            delta_params=optax.tree.sub(w, x),
            weight=jnp.ones((), jnp.float32),
            metrics={"local_loss": loss_sum / jnp.maximum(steps, 1.0), "local_steps": steps},
        )
        return PersonalState((), (v, jnp.asarray(alpha, jnp.float32))), output

    def personal(hparams, server_state, client_state, adapt):
        del adapt
        v, alpha = client_state.own
        alpha = mixing(hparams, alpha) if adaptive else hparams.apfl_alpha
        x = server_state.params
        return optax.tree.add(optax.tree.scale(alpha, v), optax.tree.scale(1 - alpha, x))

    return Algorithm(
        name="apfl",
        init=init,
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
        hparams=HPARAMS,
        personal=personal,
    )


register(
    "apfl", apfl, "APFL",
    options={
        **SERVER_OPTIMIZER,
        "apfl_adaptive": Option(False, "APFL: learn each client's mixing weight alpha_i",
                                "bool", argument="adaptive"),
    },
    refuses={"local_optimizer": "APFL's local steps are the paper's plain SGD steps on w "
                                "and v"},
    hparams=HPARAMS,
    personalized=True,
)  # fmt: skip
