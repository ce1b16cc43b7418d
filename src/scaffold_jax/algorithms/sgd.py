"""Large-batch SGD: the baseline of Karimireddy et al. 2020 (SCAFFOLD, ICML 2020).

Each sampled client computes ONE gradient at the server model x on all the data it drew
this round (with ``BatchPlan.full()`` or one epoch of a fraction plan: its whole local
data), and the server steps ``x ← x − η mean_i g_i``. One round is one step.

The client reports ``Δy_i = −η_l g_i`` and the server applies ``x ← x + η_g mean Δy_i``, so
η = η_l · η_g; with η_g = 1 (the paper's setting) the step size is η_l, and with K = 1
full-batch steps SGD, FedAvg and SCAFFOLD coincide exactly. A client sends Δy_i alone (its
``ClientOutput.message`` is empty).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from scaffold_jax.algorithms.common import (
    records_options,
    server_params,
    stateless_init,
    stateless_server_update,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.local import batch_grad, flatten_steps
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParams


@records_options
def sgd(loss_fn, server_optimizer: optax.GradientTransformation | str | None = None) -> Algorithm:
    """Large-batch SGD: one gradient per sampled client over all its ``[K, B]`` batches."""
    server_optimizer = transformation(server_optimizer)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        flat, flat_mask = flatten_steps(batches, mask)
        loss, grad = batch_grad(loss_fn, server_state.params, flat, flat_mask, key)
        output = ClientOutput(
            delta_params=optax.tree.scale(-hparams.client_lr, grad),
            weight=jnp.ones((), jnp.float32),
            metrics={"local_loss": loss, "local_steps": jnp.ones((), jnp.float32)},
            # One large-batch step: the statistics of its batch at x.
            model_state=None
            if model_state is None
            else model_state.advance(server_state.params, flat, flat_mask),
        )
        return client_state, output

    return Algorithm(
        name="sgd",
        init=stateless_init(server_optimizer),
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
    )


register("sgd", sgd, "SGD", default_plan="full", options=SERVER_OPTIMIZER, hparams=STEP_SIZES)
