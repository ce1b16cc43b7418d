"""FedProx: local steps on a proximally regularised objective.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020. https://arxiv.org/abs/1812.06127

Client i minimises ``f_i(y) + (μ/2)‖y − x‖²`` with K SGD steps; the server averages as
FedAvg does, and a client sends Δy_i alone (its ``ClientOutput.message`` is empty). μ is
the declared hyper-parameter ``prox_mu`` (default 1, as the SCAFFOLD paper fixes it).
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
from scaffold_jax.types import STEP_SIZES, Algorithm, HParam, HParams

HPARAMS = {
    **STEP_SIZES,
    "prox_mu": HParam(1.0, "FedProx proximal weight mu (the paper fixes 1)", allow_zero=True),
}


@records_options
def fedprox(
    loss_fn,
    server_optimizer: optax.GradientTransformation | str | None = None,
    local_optimizer: optax.GradientTransformation | str | None = None,
) -> Algorithm:
    """FedProx: the local gradient is ``g + μ (y − x)``.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: as in :func:`~scaffold_jax.algorithms.fedavg.fedavg`.
      local_optimizer: as in :func:`~scaffold_jax.algorithms.fedavg.fedavg`; it transforms
        the proximal gradient ``g + μ (y − x)``.
    """
    server_optimizer = transformation(server_optimizer)
    local_optimizer = transformation(local_optimizer)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        x = server_state.params

        def proximal(y, batch, batch_mask, step_key):
            del batch, batch_mask, step_key
            return optax.tree.scale(hparams.prox_mu, optax.tree.sub(y, x))

        _, output, _ = local_update(
            loss_fn,
            hparams,
            x,
            batches,
            mask,
            proximal,
            optimizer=local_optimizer,
            key=key,
            model_state=model_state,
        )
        return client_state, output

    return Algorithm(
        name="fedprox",
        init=stateless_init(server_optimizer),
        client_update=client_update,
        server_update=stateless_server_update(server_optimizer),
        server_params=server_params,
        hparams=HPARAMS,
    )


register(
    "fedprox", fedprox, "FedProx", options={**SERVER_OPTIMIZER, **LOCAL_OPTIMIZER},
    hparams=HPARAMS, asynchronous=True,  # FedBuff: its server is FedAvg's
)  # fmt: skip
