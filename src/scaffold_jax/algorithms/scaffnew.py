"""Scaffnew: ProxSkip's local steps with communication skipped at random.

Mishchenko, Malinovsky, Stich, Richtárik, "ProxSkip: Yes! Local Gradient Steps Provably
Lead to Communication Acceleration! Finally!", ICML 2022. https://arxiv.org/abs/2202.09357
(Algorithm 2, Scaffnew: ProxSkip applied to the consensus formulation of federated
learning).

Every client keeps a control h_i (h_i = 0 at the start); the server keeps x. ProxSkip takes
one local step ``x̂_i = x_i − γ (g_i(x_i) − h_i)`` per iteration on every client and, with
probability p (one coin shared by all clients), communicates:
``x ← (1/N) Σ_j (x̂_j − (γ/p) h_j)`` and ``h_i ← h_i + (p/γ) (x − x̂_i)``; without
communication ``x_i ← x̂_i``. The h_i then sum to 0 over the N clients forever.

A round here is the iterations up to and including one communication: every client starts
from x and takes K local steps, K ~ Geometric(p) on {1, 2, ...} drawn from the round's
shared key (``round_key``), the same K for all clients; then the server averages and every
client updates its h_i from the new x (the algorithm's ``client_sync`` step). γ is
``client_lr`` and p ``comm_prob``; Scaffnew has no server step size (its server step is
the average above).

K is bounded by the batch plan's K_plan: steps beyond it are not taken, so a draw K >
K_plan, of probability (1 − p)^K_plan, is truncated to K_plan. Choose K_plan with that
small (at p = 0.2, 21 steps make it < 1%), e.g. ``BatchPlan.fixed(batch_size, K_plan)``,
whose clients all have K_plan non-empty steps. The round metric ``local_steps`` is the
number of steps taken: min(K, K_plan) under a fixed plan (a client with fewer non-empty
steps in its plan takes fewer).

What a client sends: ``Δy_i = x̂_i − (γ/p) h_i − x``, its shifted model less x, which is
all the server's average reads (its ``ClientOutput.message`` is empty); the engine's
``client_drift`` is the norm of that.

Only full participation (S = N) with uniform weights is ProxSkip's method: the simulation
refuses S < N (the server's average relies on the h_i of ALL clients summing to 0) and
``weighting="num_examples"``. No server optimizer either: any other server step than the
average breaks Σ_i h_i = 0 (the h_i update reads the new x).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from scaffold_jax.algorithms.common import (
    ServerState,
    local_update,
    records_options,
    server_params,
    transformation,
)
from scaffold_jax.algorithms.registry import SERVER_OPTIMIZER, register
from scaffold_jax.tree import weighted_mean
from scaffold_jax.types import STEP_SIZES, Algorithm, ClientOutput, HParam, HParams, PyTree

HPARAMS = {
    "client_lr": STEP_SIZES["client_lr"],
    "comm_prob": HParam(
        0.2,
        "Scaffnew communication probability p in (0, 1]: K ~ Geometric(p) local steps per "
        "round, truncated at the batch plan's K_plan (P(K > K_plan) = (1-p)^K_plan)",
        maximum=1.0,
    ),
}


class ScaffnewClientState(NamedTuple):
    """Attributes: control (h_i, float32 like the params)."""

    control: PyTree


def draw_local_steps(round_key, comm_prob, max_steps: int) -> jax.Array:
    """K ~ Geometric(p) on {1, 2, ...} (P(K > k) = (1 − p)^k), truncated to ``max_steps``.

    ``K = 1 + floor(log u / log(1 − p))`` with u uniform in (0, 1): p = 1 gives K = 1, and
    a tiny p a huge K that is truncated before it is cast to int32.

    Returns:
      int32 scalar in [1, max_steps].
    """
    u = jr.uniform(round_key, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny)
    steps = 1.0 + jnp.floor(jnp.log(u) / jnp.log1p(-comm_prob))
    return jnp.minimum(steps, float(max_steps)).astype(jnp.int32)


def _sgd_only(server_optimizer) -> str:
    """``"sgd"`` if ``server_optimizer`` names none (None, ``"sgd"``), else ValueError; the
    factory checks its argument with it, the registry's option (every built-in has one) a
    config's value when it is read."""
    if transformation(server_optimizer) is not None:
        raise ValueError(
            "Scaffnew's server step is ProxSkip's average of the clients' shifted models, "
            "which keeps the controls summing to 0; another server step breaks that; leave "
            "server_optimizer at 'sgd' (none)."
        )
    return "sgd"


@records_options
def scaffnew(loss_fn, server_optimizer: str | None = None) -> Algorithm:
    """Scaffnew (Algorithm 2 of Mishchenko et al. 2022), a round per communication.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      server_optimizer: None or ``"sgd"`` (none): the registry's every algorithm has this
        option, and Scaffnew refuses any other.

    Raises:
      ValueError: a server optimizer.

    Examples:
      >>> import jax.numpy as jnp
      >>> alg = scaffnew(lambda p, b: jnp.sum((p["w"] - b["x"]) ** 2, axis=-1))
      >>> alg.name, list(alg.hparams)
      ('scaffnew', ['client_lr', 'comm_prob'])
    """
    _sgd_only(server_optimizer)

    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        return ServerState(params, ()), ScaffnewClientState(optax.tree.zeros_like(params))

    def client_update(
        hparams: HParams,
        server_state,
        client_state,
        batches,
        mask,
        key,
        round_key,
        model_state=None,
    ):
        x, h = server_state.params, client_state.control
        num_steps = draw_local_steps(round_key, hparams.comm_prob, mask.shape[0])
        # The steps after the K-th are emptied: the local solver skips them (and stops
        # after the last non-empty one).
        taken = (jnp.arange(mask.shape[0]) < num_steps).astype(mask.dtype)
        mask = mask * taken.reshape((-1,) + (1,) * (mask.ndim - 1))
        _, output, _ = local_update(
            loss_fn,
            hparams,
            x,
            batches,
            mask,
            offset=optax.tree.scale(-1.0, h),
            key=key,
            model_state=model_state,
        )
        shift = -hparams.client_lr / hparams.comm_prob
        delta = optax.tree.add_scale(output.delta_params, shift, h)
        return client_state, output._replace(delta_params=delta)

    def server_update(hparams: HParams, state: ServerState, outputs: ClientOutput, total_weight):
        del hparams, total_weight  # S = N, uniform: the mean over S is over all clients
        mean_delta = weighted_mean(outputs.delta_params, outputs.weight)
        return ServerState(optax.tree.add(state.params, mean_delta), ())

    def client_sync(hparams: HParams, server_before, server_after, client_state, output):
        del client_state
        # h_i + (p/γ)(x⁺ − x̂_i) with x̂_i = x + Δy_i + (γ/p) h_i: the h_i cancel, so it is
        # computed without them (no cancellation error). As x⁺ − x is the mean of the Δy_i,
        # the new h_i sum to 0 up to rounding.
        moved = optax.tree.sub(server_after.params, server_before.params)
        control = optax.tree.scale(
            hparams.comm_prob / hparams.client_lr, optax.tree.sub(moved, output.delta_params)
        )
        return ScaffnewClientState(control)

    def check(num_clients: int, clients_per_round: int, weighting: str, participation=None) -> None:
        if participation is not None and participation.describe():
            raise ValueError(
                "Scaffnew needs every client in every round, each stopping at the shared "
                "communication step; it cannot run with "
                f"{' and '.join(participation.describe())}: use availability = 'always', "
                "stragglers = 'none' and dropouts = 'none'."
            )
        if clients_per_round != num_clients:
            raise ValueError(
                f"Scaffnew needs every client in every round (S = N): the server's average "
                f"relies on the controls h_i of ALL clients summing to 0, but clients_per_round "
                f"(S) = {clients_per_round} < N = {num_clients}. Set clients_per_round = N "
                "(command line: --client-fraction 1)."
            )
        if weighting != "uniform":
            raise ValueError(
                f"Scaffnew averages the clients uniformly (ProxSkip's consensus step); "
                f"weighting={weighting!r} is not supported: use weighting='uniform'."
            )

    return Algorithm(
        name="scaffnew",
        init=init,
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        hparams=HPARAMS,
        client_sync=client_sync,
        check=check,
    )


register(
    "scaffnew",
    scaffnew,
    "Scaffnew",
    hparams=HPARAMS,
    options={
        "server_optimizer": SERVER_OPTIMIZER["server_optimizer"]._replace(normalize=_sgd_only)
    },
    refuses={
        "local_optimizer": "Scaffnew's local steps are ProxSkip's plain gradient steps "
        "corrected by the control h_i",
    },
)
