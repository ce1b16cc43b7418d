"""Pieces shared by the algorithms: the server model step and the local-update client.

The server step applies ``x ← x + η_g Δx`` or, with an optax transformation, treats
``−Δx`` as a pseudo-gradient (Reddi et al. 2021, "Adaptive Federated Optimization"):
``optax.trace(0.9)`` gives FedAvgM, ``optax.scale_by_adam()`` FedAdam,
``optax.scale_by_yogi()`` FedYogi. The transformation must NOT include a learning rate;
η_g stays in :class:`~scaffold_jax.types.HParams`, so it can be swept without recompiling.
Factories take it as an optax transformation or by name (``"adam:eps=1e-3"``, see
:mod:`scaffold_jax.optimizers`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax import optimizers
from scaffold_jax.local import Correction, local_sgd
from scaffold_jax.tree import weighted_mean
from scaffold_jax.types import Algorithm, ClientOutput, HParams, PyTree


class ServerState(NamedTuple):
    """Server state of the stateless algorithms (FedAvg, FedProx, SGD).

    Attributes:
      params: the server model x.
      opt_state: the server optimizer's state (``()`` without one).
    """

    params: PyTree
    opt_state: PyTree


def transformation(spec) -> optax.GradientTransformation | None:
    """An optimizer argument of a factory (a transformation, a name or None) as a
    transformation (None: plain SGD)."""
    return optimizers.build(spec)


def init_server_optimizer(server_optimizer, params: PyTree) -> PyTree:
    return () if server_optimizer is None else server_optimizer.init(params)


def server_model_step(
    server_optimizer, hparams: HParams, params: PyTree, opt_state: PyTree, delta: PyTree
) -> tuple[PyTree, PyTree]:
    """``x ← x + η_g Δx``, or x ← x − η_g · opt(−Δx) with an optax transformation."""
    if server_optimizer is None:
        return optax.tree.add_scale(params, hparams.server_lr, delta), opt_state
    pseudo_grad = optax.tree.scale(-1.0, delta)
    updates, opt_state = server_optimizer.update(pseudo_grad, opt_state, params)
    return optax.tree.add_scale(params, -hparams.server_lr, updates), opt_state


def aggregate_params(outputs: ClientOutput) -> PyTree:
    """Δx: the weighted mean of the Δy_i (uniform weights ⇒ the paper's 1/|S| mean)."""
    return weighted_mean(outputs.delta_params, outputs.weight)


def local_update(
    loss_fn,
    hparams: HParams,
    server_params: PyTree,
    batches,
    mask,
    correction: Correction | None = None,
    offset: PyTree | None = None,
    optimizer: optax.GradientTransformation | None = None,
    key=None,
    model_state=None,
):
    """K corrected local steps from x (see :func:`~scaffold_jax.local.local_sgd` for
    ``correction``, ``offset``, ``optimizer``, ``key`` and ``model_state``).

    Returns:
      ``(y, output, info)``: the final params, a :class:`ClientOutput` of Δy_i alone
      (weight 1, no message) and the solver's :class:`~scaffold_jax.local.LocalResult`.
    """
    y, info = local_sgd(
        loss_fn,
        server_params,
        batches,
        mask,
        hparams.client_lr,
        correction,
        offset,
        optimizer,
        key,
        model_state,
    )
    delta = optax.tree.sub(y, server_params)
    output = ClientOutput(
        delta_params=delta,
        weight=jnp.ones((), jnp.float32),
        metrics={
            "local_loss": info.mean_loss,
            "local_steps": info.num_steps.astype(jnp.float32),
        },
        model_state=info.model_state,
    )
    return y, output, info


def stateless_server_update(server_optimizer):
    """The server update of FedAvg, FedProx and SGD (no control variates)."""

    def server_update(hparams: HParams, state: ServerState, outputs: ClientOutput, total_weight):
        del total_weight  # only stateful algorithms need the population weight
        params, opt_state = server_model_step(
            server_optimizer, hparams, state.params, state.opt_state, aggregate_params(outputs)
        )
        return ServerState(params=params, opt_state=opt_state)

    return server_update


def stateless_init(server_optimizer):
    def init(params: PyTree):
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        return ServerState(params, init_server_optimizer(server_optimizer, params)), ()

    return init


def server_params(state) -> PyTree:
    return state.params


def records_options(factory):
    """Decorates an algorithm factory ``factory(loss_fn, **options)`` so that the
    :class:`Algorithm` it builds carries the options it was called with (defaults filled
    in) as :attr:`Algorithm.options`: the run identity compares them on resume. A value
    that is not plain data (an optax transformation) is named by its type."""
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def build(loss_fn, *args, **kwargs) -> Algorithm:
        algorithm = factory(loss_fn, *args, **kwargs)
        bound = signature.bind(loss_fn, *args, **kwargs)
        bound.apply_defaults()
        options = {k: _plain(v) for k, v in list(bound.arguments.items())[1:]}
        return algorithm._replace(options=options)

    return build


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return str(jnp.dtype(value))  # a dtype given as jnp.float32
    except TypeError:
        return f"<{type(value).__name__}>"
