"""FedAvg: Federated Averaging.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017. https://arxiv.org/abs/1602.05629

With two step sizes (η_l local, η_g global) as in Karimireddy et al. 2020, and optionally an
optax server optimizer on the pseudo-gradient −Δx (Reddi et al. 2021,
https://arxiv.org/abs/2003.00295): FedAvgM, FedAdam, FedYogi, and optionally a local
optax optimizer (momentum, Adam) whose state starts fresh every round. A client sends Δy_i
alone (its ``ClientOutput.message`` is empty).
"""

from __future__ import annotations

import optax

from scaffold_jax.algorithms.common import (
    local_update,
    records_options,
    server_params,
    stateless_init,
    stateless_server_update,
    transformation,
)
from scaffold_jax.algorithms.registry import LOCAL_OPTIMIZER, SERVER_OPTIMIZER, register
from scaffold_jax.types import STEP_SIZES, Algorithm, HParams


@records_options
def fedavg(
    loss_fn,
    server_optimizer: optax.GradientTransformation | str | None = None,
    local_optimizer: optax.GradientTransformation | str | None = None,
) -> Algorithm:
    """FedAvg: K local SGD steps per client, then ``x ← x + η_g · mean Δy_i``.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: optional optax transformation WITHOUT a learning rate, applied to
        ``−Δx`` (e.g. ``optax.trace(0.9)`` for FedAvgM), or its name
        (:mod:`scaffold_jax.optimizers`); the step is scaled by η_g.
      local_optimizer: optional optax transformation WITHOUT a learning rate (or its name,
        e.g. ``"momentum"``, ``"adam"``) applied to every local gradient, ``y ← y − η_l
        T(g)``; its state starts fresh every round (nothing is kept on the client).

    Examples:
      >>> import jax.numpy as jnp
      >>> alg = fedavg(lambda p, b: jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))
      >>> alg.name
      'fedavg'
    """

    server_optimizer = transformation(server_optimizer)
    local_optimizer = transformation(local_optimizer)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        # The batches already carry the client's randomness; the key is for a loss that
        # takes one (dropout).
        _, output, _ = local_update(
            loss_fn, hparams, server_state.params, batches, mask, optimizer=local_optimizer,
            key=key, model_state=model_state,
        )  # fmt: skip
        return client_state, output

    return Algorithm(
        name="fedavg",
        init=stateless_init(server_optimizer),
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
    )


register(
    "fedavg", fedavg, "FedAvg", options={**SERVER_OPTIMIZER, **LOCAL_OPTIMIZER},
    hparams=STEP_SIZES, asynchronous=True,  # FedBuff: Δy weighted by staleness
)  # fmt: skip
