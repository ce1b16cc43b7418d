"""The shared types of scaffold_jax.

An algorithm is written for ONE client (equinox's "write for one example, vmap at the
edge"); only :mod:`scaffold_jax.simulate` knows about the client axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Array = jax.Array
Batch = Any  # a pytree of arrays with a leading example axis, e.g. {"x": [B, ...], "y": [B]}


class HParams(NamedTuple):
    """Hyper-parameters, passed to the compiled round as DATA (float32 scalars).

    Because they are arrays and not Python floats closed over by the program, changing a
    step size never recompiles, and a sweep can ``vmap`` over a leading config axis.

    Attributes:
      client_lr: local step size η_l.
      server_lr: global step size η_g (1.0 in all of the paper's experiments).
      prox_mu: FedProx proximal weight μ (ignored by the other algorithms).
    """

    client_lr: Array
    server_lr: Array
    prox_mu: Array


def hparams(client_lr: float, server_lr: float = 1.0, prox_mu: float = 0.0) -> HParams:
    """Builds an :class:`HParams` of float32 arrays, checking the values when concrete.

    Any argument may be an array (e.g. ``[C]`` for a sweep over C configs).

    Raises:
      ValueError: a step size that is not finite and > 0, or μ that is not finite and >= 0.

    Examples:
      >>> hp = hparams(client_lr=0.1)
      >>> float(hp.server_lr)
      1.0
    """
    hp = HParams(
        client_lr=jnp.asarray(client_lr, jnp.float32),
        server_lr=jnp.asarray(server_lr, jnp.float32),
        prox_mu=jnp.asarray(prox_mu, jnp.float32),
    )
    check_hparams(hp)
    return hp


def check_hparams(hp: HParams) -> None:
    """Raises ValueError for non-positive or non-finite step sizes (concrete values only)."""
    if not isinstance(hp, HParams):
        raise TypeError(
            f"hparams must be an HParams (use scaffold_jax.hparams(...)), got {type(hp).__name__}."
        )
    for name, allow_zero in (("client_lr", False), ("server_lr", False), ("prox_mu", True)):
        value = getattr(hp, name)
        if isinstance(value, jax.core.Tracer):
            continue
        value = np.asarray(value, dtype=np.float32)
        bad = ~np.isfinite(value) | (value < 0) | ((value == 0) & (not allow_zero))
        if np.any(bad):
            allowed = "finite and >= 0" if allow_zero else "finite and > 0"
            # float32 digits (0.1, not 0.10000000149011612).
            shown = ", ".join(f"{v:.7g}" for v in value.ravel().tolist())
            shown = shown if value.ndim == 0 else f"[{shown}]"
            raise ValueError(f"{name}={shown} is invalid: every value must be {allowed}.")


class ClientOutput(NamedTuple):
    """What one client sends to the server after its local work.

    Attributes:
      delta_params: Δy_i = y_i − x (same pytree as the params).
      delta_control: Δc_i = c_i⁺ − c_i for SCAFFOLD; ``()`` for stateless algorithms.
      weight: aggregation weight, a float32 scalar. Clients report 1; the engine replaces
        it by the client's number of examples when ``weighting="num_examples"``.
      metrics: float32 scalars averaged over the sampled clients by the engine.
    """

    delta_params: PyTree
    delta_control: PyTree
    weight: Array
    metrics: dict[str, Array]


class Algorithm(NamedTuple):
    """A federated algorithm as three pure functions written for ONE client.

    Attributes:
      name: a short name for records ("scaffold", "fedavg", ...).
      init: ``init(params) -> (server_state, client_state)``; ``client_state`` is for a
        single client (the engine broadcasts it to ``[N, ...]``).
      client_update: ``client_update(hparams, server_state, client_state, batches, mask,
        key) -> (client_state, ClientOutput)`` with ``batches`` ``[K, B, ...]`` and ``mask``
        ``[K, B]`` (1.0 for a real example, 0.0 for padding).
      server_update: ``server_update(hparams, server_state, outputs, total_weight) ->
        server_state`` where ``outputs`` carry a leading ``[S]`` axis and ``total_weight``
        is the sum of the weights of ALL N clients (N under uniform weighting), which is
        what keeps SCAFFOLD's ``c = Σ w_i c_i / Σ w_i`` invariant exact.
      server_params: ``server_params(server_state) -> params``, the model x to evaluate.
    """

    name: str
    init: Callable[[PyTree], tuple[PyTree, PyTree]]
    client_update: Callable[..., tuple[PyTree, ClientOutput]]
    server_update: Callable[..., PyTree]
    server_params: Callable[[PyTree], PyTree]


class SimState(NamedTuple):
    """The whole simulation state, one pytree.

    Attributes:
      server: the algorithm's server state (unbatched).
      clients: the client table; every leaf has a leading ``[N, ...]`` client axis.
      round: int32 scalar, the number of rounds completed.
    """

    server: PyTree
    clients: PyTree
    round: Array


class Problem(NamedTuple):
    """A learning problem: initial params and per-example functions.

    The functions return one value PER EXAMPLE (shape ``[B]``) rather than a mean, so that
    the engine can mask padded slots exactly (a padded slot contributes nothing to a
    gradient or a mean). The engine never sees flax modules.

    Attributes:
      params: the initial model parameters (a pytree of float32 arrays).
      loss_fn: ``loss_fn(params, batch) -> [B]`` per-example losses.
      accuracy_fn: ``accuracy_fn(params, batch) -> [B]`` per-example correctness in
        {0, 1}, or ``None`` where accuracy has no meaning (e.g. quadratics).
      num_classes: for a classifier of integer labels ``batch["y"]``, the number of
        classes C; the simulation then refuses data whose labels fall outside [0, C)
        (the cross-entropy would silently read outside the logits). None: not checked.
    """

    params: PyTree
    loss_fn: Callable[[PyTree, Batch], Array]
    accuracy_fn: Callable[[PyTree, Batch], Array] | None = None
    num_classes: int | None = None
