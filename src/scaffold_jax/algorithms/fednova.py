"""FedNova: normalised averaging of the local updates.

Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020. https://arxiv.org/abs/2007.07481

Vanilla local SGD on the clients (as FedAvg). Client i takes its own number of steps τ_i
(with an epochs plan and unequal client sizes τ_i differs per client; padded steps do not
count). The server normalises each update by it, d_i = (x − y_i) / (η_l τ_i), and steps
with the effective number of steps τ_eff = Σ_{i∈S} p_i τ_i:
``x ← x − η_g τ_eff η_l Σ_{i∈S} p_i d_i``, with p_i = 1/|S| (uniform) or n_i / Σ_{j∈S} n_j
(``weighting="num_examples"``). FedAvg averages Δy_i = y_i − x directly, which weights a
client by how many steps it took and so converges to the optimum of an objective weighted
by τ_i; FedNova removes that inconsistency. When every τ_i = K, FedNova equals FedAvg.

η_l cancels: ``τ_eff η_l Σ p_i d_i = −τ_eff Σ p_i Δy_i / τ_i``, which is what is computed
(nothing is divided by η_l). A client that took no step (τ_i = 0: it drew no data) has
Δy_i = 0 and contributes nothing to the sum (no division by zero); it still counts in the
weights p_i, as the contract's weights over S say, and adds p_i · 0 to τ_eff.

With an optax server optimizer (FedOpt, Reddi et al. 2021), the pseudo-gradient is
``τ_eff η_l Σ p_i d_i`` and η_g scales the transformation's output, as in FedAvg.

What a client sends: Δy_i and ``ClientOutput.message = {"local_steps": τ_i}`` (the solver's
``LocalResult.num_steps``, as float32), which is all the server reads. τ_i is also in the
client's metrics, as for every algorithm, for the round records. So ``delta_params`` stays
the plain Δy_i that every algorithm sends, and the engine's per-round ``client_drift``
(mean ‖Δy_i‖) keeps its meaning for FedNova too.

Not for differential privacy (``Algorithm.linear_aggregate`` is False): the server divides
each Δy_i by that client's own τ_i before summing, which a noised sum of the messages
cannot give (:mod:`scaffold_jax.privacy`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.algorithms.common import (
    ServerState,
    local_update,
    records_options,
    server_model_step,
    server_params,
    stateless_init,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.tree import weighted_sum
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParams, PyTree

#: The name of τ_i (float32) in a client's message to the server.
LOCAL_STEPS = "local_steps"


def normalized_delta(outputs: ClientOutput) -> PyTree:
    """FedNova's aggregate ``τ_eff Σ_{i∈S} p_i Δy_i / τ_i`` (= −τ_eff η_l Σ p_i d_i).

    Args:
      outputs: the sampled clients' outputs with a leading [S] axis; ``weight`` holds 1 or
        n_i (the engine's weighting), ``message["local_steps"]`` holds τ_i.

    Returns:
      The server model's change Δx before η_g (a pytree like the params, float32). A
      client with τ_i = 0 contributes nothing; if every weight is 0 the change is 0.
    """
    tau = outputs.message[LOCAL_STEPS].astype(jnp.float32)
    weight = outputs.weight.astype(jnp.float32)
    total = jnp.sum(weight)
    p = jnp.where(total > 0, weight / jnp.where(total > 0, total, 1.0), 0.0)
    tau_eff = jnp.sum(p * tau)
    inv_tau = jnp.where(tau > 0, 1.0 / jnp.maximum(tau, 1.0), 0.0)
    return weighted_sum(outputs.delta_params, tau_eff * p * inv_tau)


@records_options
def fednova(
    loss_fn, server_optimizer: optax.GradientTransformation | str | None = None
) -> Algorithm:
    """FedNova: local SGD, then ``x ← x + η_g τ_eff Σ_{i∈S} p_i Δy_i / τ_i``.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: optional optax transformation WITHOUT a learning rate, applied to
        the pseudo-gradient ``τ_eff η_l Σ p_i d_i`` (e.g. ``optax.trace(0.9)``); the step
        is scaled by η_g.

    Examples:
      >>> import jax.numpy as jnp
      >>> alg = fednova(lambda p, b: jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))
      >>> alg.name, list(alg.hparams)
      ('fednova', ['client_lr', 'server_lr'])
    """
    server_optimizer = transformation(server_optimizer)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        _, output, info = local_update(
            loss_fn, hparams, server_state.params, batches, mask, key=key, model_state=model_state
        )
        return client_state, output._replace(
            message={LOCAL_STEPS: info.num_steps.astype(jnp.float32)}
        )

    def server_update(hparams: HParams, state: ServerState, outputs: ClientOutput, total_weight):
        del total_weight  # p_i are normalised over the sampled set
        params, opt_state = server_model_step(
            server_optimizer, hparams, state.params, state.opt_state, normalized_delta(outputs)
        )
        return ServerState(params=params, opt_state=opt_state)

    return Algorithm(
        name="fednova",
        init=stateless_init(server_optimizer),
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        hparams=STEP_SIZES,
        linear_aggregate=False,
        uplink=lambda params: {LOCAL_STEPS: jax.ShapeDtypeStruct((), jnp.float32)},  # τ_i
    )


register(
    "fednova",
    fednova,
    "FedNova",
    options=SERVER_OPTIMIZER,
    refuses={
        "local_optimizer": "FedNova's normalisation here is that of vanilla local SGD (the "
        "paper's a_i = tau_i); with momentum its weights differ"
    },
    hparams=STEP_SIZES,
)
