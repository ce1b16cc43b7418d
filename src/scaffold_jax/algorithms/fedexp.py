"""FedExP: FedAvg with a server step size extrapolated from the clients' updates.

Jhunjhunwala, Wang, Joshi, "FedExP: Speeding Up Federated Averaging via Extrapolation",
ICLR 2023. https://arxiv.org/abs/2301.09604 (Algorithm 1).

FedAvg's clients (K plain local SGD steps from x); the server chooses its step size every
round from the updates, as POCS extrapolation does:
``η_g = max(1, Σ_{i∈S} ‖Δ_i‖² / (2 |S| (‖Δ̄‖² + ε)))`` with Δ_i = y_i − x and
Δ̄ = mean_{i∈S} Δ_i, then ``x ← x + η_g Δ̄``. ε > 0 is the declared hyper-parameter
``fedexp_eps`` (default 1e-3, the paper's small values); FedExP declares no ``server_lr``.
The η_g of every round is the round metric ``fedexp_server_lr``. When the clients' updates
agree (all Δ_i equal), the ratio is 1/2 and η_g = 1: FedAvg's step; the more they
disagree, the longer the step.

With ``weighting="num_examples"`` both means are weighted by n_i over S:
Δ̄ = Σ p_i Δ_i and η_g = max(1, Σ p_i ‖Δ_i‖² / (2 (‖Δ̄‖² + ε))) with p_i = n_i / Σ_{j∈S} n_j
(the uniform p_i = 1/|S| give the paper's formula).

The paper evaluates the mean of the last two iterates, (x_t + x_{t−1}) / 2, because the
extrapolated iterates oscillate around the optimum; ``average_last_two=True`` (an option,
off by default) makes that the model evaluated (``server_params``), while the rounds still
continue from x_t. A client sends Δy_i alone (its ``ClientOutput.message`` is empty), but
the server reads each ‖Δy_i‖² for its step size, which a noised sum does not release: not
for differential privacy (``Algorithm.linear_aggregate`` is False).

With a server optimizer (FedOpt, Reddi et al. 2021; not part of the paper's Algorithm 1)
η_g scales the transformation's output as for FedAvg: ``x ← x − η_g T(−Δ̄)``, with η_g
still chosen from the raw updates as above.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.algorithms.common import (
    init_server_optimizer,
    local_update,
    records_options,
    server_model_step,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.registry import Option
from scaffold_jax.tree import sq_norm, weighted_mean
from scaffold_jax.types import (
    STEP_SIZES,
    Algorithm,
    ClientOutput,
    HParam,
    HParams,
    PyTree,
    ServerOutput,
)

HPARAMS = {
    "client_lr": STEP_SIZES["client_lr"],
    "fedexp_eps": HParam(1e-3, "FedExP epsilon > 0 in its server step size's denominator"),
}

#: The round metric that reports the server step size η_g.
SERVER_LR = "fedexp_server_lr"


class FedExPServerState(NamedTuple):
    """Attributes: params (x_t), previous (x_{t−1}; x⁰ before round 1), opt_state (the
    server optimizer's, ``()`` without one)."""

    params: PyTree
    previous: PyTree
    opt_state: PyTree = ()


def extrapolated_step(hparams: HParams, outputs: ClientOutput) -> tuple[PyTree, jax.Array]:
    """``(Δ̄, η_g)`` of the sampled clients' outputs (leading ``[S]`` axis; ``weight`` the
    engine's 1 or n_i)."""
    mean = weighted_mean(outputs.delta_params, outputs.weight)
    p = outputs.weight / jnp.sum(outputs.weight)
    spread = jnp.sum(p * jax.vmap(sq_norm)(outputs.delta_params))
    server_lr = jnp.maximum(1.0, spread / (2.0 * (sq_norm(mean) + hparams.fedexp_eps)))
    return mean, server_lr


@records_options
def fedexp(
    loss_fn,
    average_last_two: bool = False,
    server_optimizer: optax.GradientTransformation | str | None = None,
) -> Algorithm:
    """FedExP (Algorithm 1 of Jhunjhunwala et al. 2023).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      average_last_two: evaluate (x_t + x_{t−1}) / 2 instead of x_t (the paper's
        evaluation).
      server_optimizer: optional optax transformation WITHOUT a learning rate (or its
        name) applied to ``−Δ̄``, the step scaled by FedExP's η_g (see the module
        docstring).

    Examples:
      >>> import jax.numpy as jnp
      >>> alg = fedexp(lambda p, b: jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))
      >>> alg.name, list(alg.hparams)
      ('fedexp', ['client_lr', 'fedexp_eps'])
    """

    server_optimizer = transformation(server_optimizer)

    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        opt_state = init_server_optimizer(server_optimizer, params)
        return FedExPServerState(params, params, opt_state), ()

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        _, output, _ = local_update(
            loss_fn, hparams, server_state.params, batches, mask, key=key, model_state=model_state
        )
        return client_state, output

    def server_update(hparams: HParams, state, outputs: ClientOutput, total_weight):
        del total_weight  # both means are over the sampled clients
        mean, server_lr = extrapolated_step(hparams, outputs)
        params, opt_state = server_model_step(
            server_optimizer,
            hparams.replace(server_lr=server_lr),
            state.params,
            state.opt_state,
            mean,
        )
        state = FedExPServerState(params, state.params, opt_state)
        return ServerOutput(state, {SERVER_LR: server_lr})

    def server_params(state: FedExPServerState) -> PyTree:
        if average_last_two:
            return jax.tree.map(lambda a, b: 0.5 * (a + b), state.params, state.previous)
        return state.params

    return Algorithm(
        name="fedexp",
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        hparams=HPARAMS,
        linear_aggregate=False,
    )


register(
    "fedexp",
    fedexp,
    "FedExP",
    hparams=HPARAMS,
    options={
        **SERVER_OPTIMIZER,
        "average_last_two": Option(
            False,
            "FedExP: evaluate the mean of the last two server models (the paper's "
            "evaluation) instead of the last",
            "bool",
        ),
    },
    refuses={
        "local_optimizer": "FedExP's step size rule is derived for FedAvg's plain local SGD",
    },
)
