"""Per-FedAvg (FO): personalization as model-agnostic meta-learning, first-order variant.

Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020 (Algorithm 1, first-order
Per-FedAvg (FO)). https://arxiv.org/abs/2002.07948

x is trained so that ONE gradient step of size α on a client's data makes a good model
for that client. A sampled client sets w = x and, for each of its K steps, with two
independent batches b (the plan's) and b' (``client_update``'s ``draw(0)``)::

    w' = w − α ∇f_i(w; b)
    w  ← w − β ∇f_i(w'; b')

β being the client step size η_l (``client_lr``). The FO variant drops the Hessian term
of the meta-gradient (``(I − α ∇²f_i(w)) ∇f_i(w')``); the Hessian-free variant is not
implemented. The client sends Δw = w − x alone and the server steps as FedAvg's; it keeps
no client state (``()``). The personal model p_i is x after ONE adaptation step of size α
on one batch of D_i of the run's batch size, drawn from the evaluation's key (the
fine-tuning evaluation with F = 1 and η_ft = α). ``local_loss`` is the mean over steps of
f_i(w; b).

Hyper-parameter: ``perfedavg_alpha`` α ≥ 0 (default 0.01, our choice: tune it); with
α = 0, w' = w and the local steps are FedAvg's on the batches b', and p_i = x. Not
asynchronous (FedBuff refuses it); a model with running statistics (BatchNorm) is
refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from jax.random import fold_in

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
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParam

_SECOND = (1 << 30) - 1

HPARAMS = {
    **STEP_SIZES,
    "perfedavg_alpha": HParam(0.01, "Per-FedAvg: adaptation step size alpha (the meta step "
                              "beta is client_lr)", allow_zero=True),
}  # fmt: skip


@records_options
def perfedavg(loss_fn, server_optimizer=None) -> Algorithm:
    """Per-FedAvg (FO) (see the module docstring).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: as in :func:`~scaffold_jax.algorithms.fedavg.fedavg`.
    """
    server_optimizer = transformation(server_optimizer)

    def client_update(hparams, server_state, client_state, batches, mask, key, draw=None):
        if draw is None:
            raise TypeError("Per-FedAvg's client_update needs draw= (the engine passes it).")
        second, second_mask = draw(0)
        x = server_state.params
        alpha, beta = hparams.perfedavg_alpha, hparams.client_lr
        # A dropout loss's keys: step k's fold_in(key, k) for b (as local_sgd's), and for b'
        # those of a stream of their own (far above any step index k < K).
        key_of = step_keys(loss_fn, key)
        key_of_second = step_keys(loss_fn, None if key is None else fold_in(key, _SECOND))

        def step(k, carry):
            w, loss_sum = carry
            loss, grad = batch_grad(loss_fn, w, index(batches, k), index(mask, k), key_of(k))
            adapted = optax.tree.add_scale(w, -alpha, grad)
            _, meta = batch_grad(
                loss_fn, adapted, index(second, k), index(second_mask, k), key_of_second(k)
            )
            return optax.tree.add_scale(w, -beta, meta), loss_sum + loss.astype(jnp.float32)

        active = active_steps(mask) & active_steps(second_mask)
        w, loss_sum = masked_steps(step, (x, jnp.float32(0.0)), active)
        steps = jnp.sum(active).astype(jnp.float32)
        output = ClientOutput(
            delta_params=optax.tree.sub(w, x),
            weight=jnp.ones((), jnp.float32),
            metrics={"local_loss": loss_sum / jnp.maximum(steps, 1.0), "local_steps": steps},
        )
        return client_state, output

    def personal(hparams, server_state, client_state, adapt):
        return adapt(server_state.params, 1, hparams.perfedavg_alpha)

    return Algorithm(
        name="perfedavg",
        init=stateless_init(server_optimizer),
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
        hparams=HPARAMS,
        personal=personal,
    )


register(
    "perfedavg", perfedavg, "Per-FedAvg (FO)", options=SERVER_OPTIMIZER,
    refuses={"local_optimizer": "Per-FedAvg's steps are the paper's plain gradient steps"},
    hparams=HPARAMS,
    personalized=True,
)  # fmt: skip
