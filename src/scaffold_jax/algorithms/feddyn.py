"""FedDyn: federated learning with dynamic regularisation.

Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021. https://arxiv.org/abs/2111.04263 (Algorithm 1).

Every client keeps a state g_i across rounds (g_i⁰ = 0; the gradient of its linear term);
the server keeps x and h (h⁰ = 0). A sampled client minimises
``f_i(y) − ⟨g_i, y⟩ + (α/2)‖y − x‖²`` with K SGD steps from y = x,
``y ← y − η_l (∇f_i(y; batch) − g_i + α (y − x))``, then sets ``g_i ← g_i − α (y_i − x)``.
The server applies ``h ← h − α Σ_S w_i Δy_i / W`` and ``x ← Σ_S w_i y_i / Σ_S w_i − h / α``,
with W the total weight of ALL N clients. With the paper's uniform weights (w_i = 1,
W = N) that is ``h ← h − α (1/N) Σ_S Δy_i``, and ``h = mean_i g_i`` over all N clients
holds after every round; with ``weighting="num_examples"`` it keeps
``h = Σ_i n_i g_i / Σ_i n_i``. A client sends Δy_i alone (its ``ClientOutput.message`` is
empty): the server's update of h reads nothing else.

α is the declared hyper-parameter ``alpha`` (> 0, default 0.01). FedDyn declares no
server step size: its server step is the formula above. With g_i ≡ 0 and h ≡ 0 its local
step is FedProx's with μ = α.

With a server optimizer (FedOpt, Reddi et al. 2021) the formula's step
``Δx = Σ_S w_i y_i / Σ_S w_i − h / α − x`` is the pseudo-gradient's negative:
``x ← x − η_g T(−Δx)``, and FedDyn then declares η_g (``server_lr``, default 1).
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
    server_params,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.tree import weighted_mean, weighted_sum
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParam, HParams, PyTree

HPARAMS = {
    "client_lr": STEP_SIZES["client_lr"],
    "alpha": HParam(0.01, "FedDyn dynamic regularisation weight alpha (> 0)"),
}


class FedDynServerState(NamedTuple):
    """Attributes: params (x), h (the server's correction, mean of the g_i), opt_state
    (the server optimizer's, ``()`` without one)."""

    params: PyTree
    h: PyTree
    opt_state: PyTree = ()


class FedDynClientState(NamedTuple):
    """Attributes: g (g_i, the client's linear term; float32, like the params)."""

    g: PyTree


@records_options
def feddyn(
    loss_fn, server_optimizer: optax.GradientTransformation | str | None = None
) -> Algorithm:
    """FedDyn (Algorithm 1 of Acar et al. 2021).

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: optional optax transformation WITHOUT a learning rate (or its
        name) applied to the negated server step (see the module docstring); with one,
        FedDyn declares ``server_lr``.
    """
    server_optimizer = transformation(server_optimizer)

    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        zeros = optax.tree.zeros_like(params)
        opt_state = init_server_optimizer(server_optimizer, params)
        return FedDynServerState(params, zeros, opt_state), FedDynClientState(g=zeros)

    def client_update(
        hparams: HParams, server_state, client_state, batches, mask, key, model_state=None
    ):
        x, g_i = server_state.params, client_state.g

        def dynamic(y, batch, batch_mask, step_key):
            del batch, batch_mask, step_key
            return optax.tree.scale(hparams.alpha, optax.tree.sub(y, x))

        # Every gradient gets −g_i + α (y − x). A client that drew no data takes no step:
        # y = x, so its g_i is unchanged.
        _, output, _ = local_update(
            loss_fn,
            hparams,
            x,
            batches,
            mask,
            correction=dynamic,
            offset=optax.tree.scale(-1.0, g_i),
            key=key,
            model_state=model_state,
        )
        g_plus = optax.tree.add_scale(g_i, -hparams.alpha, output.delta_params)
        return FedDynClientState(g=g_plus), output

    def server_update(hparams: HParams, state, outputs: ClientOutput, total_weight):
        alpha = hparams.alpha
        delta = weighted_sum(outputs.delta_params, outputs.weight)
        h = optax.tree.add_scale(state.h, -alpha / total_weight, delta)
        mean_delta = weighted_mean(outputs.delta_params, outputs.weight)
        step = optax.tree.add_scale(mean_delta, -1.0 / alpha, h)  # mean y − h/α − x
        if server_optimizer is None:
            return FedDynServerState(optax.tree.add(state.params, step), h, state.opt_state)
        params, opt_state = server_model_step(
            server_optimizer, hparams, state.params, state.opt_state, step
        )
        return FedDynServerState(params, h, opt_state)

    return Algorithm(
        name="feddyn",
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        hparams=_hparams(server_optimizer),
    )


def _hparams(server_optimizer=None) -> dict:
    """FedDyn's hyper-parameters: α, and η_g only with a server optimizer."""
    return HPARAMS if transformation(server_optimizer) is None else {**HPARAMS, **STEP_SIZES}


register("feddyn", feddyn, "FedDyn", options=SERVER_OPTIMIZER, hparams=_hparams)
