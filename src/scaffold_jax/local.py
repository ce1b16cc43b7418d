"""The local solver shared by every local-update algorithm.

K masked steps as one loop (:func:`step_loop`: all K where no client can stop early, else
up to the last non-empty step of the client or of the longest client vmapped beside it),
with a gradient-correction hook through which SCAFFOLD (``g + (c − c_i)``), FedProx
(``g + μ (y − x)``), FedDyn and Mime (``g − ∇f_i(x; ζ) + c``) plug in, and an optional
optax transformation of the corrected gradient (a local optimizer, or Mime's frozen base
optimizer). Written for ONE client; the engine vmaps it across the sampled clients.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.tree import masked_mean
from scaffold_jax.types import Array, Batch, ModelState, PyTree

#: The name of the engine's vmap over the clients of a chunk: the local loop of each client
#: stops with the longest of them (:func:`local_sgd`).
CLIENT_AXIS = "clients"

# (params y, the step's batch, its mask, the step's key) -> the offset added to the
# gradient at y (the step uses g + correction(y, batch, mask, key)); FedProx reads only y,
# Mime the batch and the key too (its gradient at x sees the same dropout as the one at y).
Correction = Callable[[PyTree, Batch, Array, Array], PyTree]


class LocalResult(NamedTuple):
    """What the local solver returns besides the final params.

    Attributes:
      num_steps: int32, the number of steps actually taken (steps whose mask is empty are
        skipped). SCAFFOLD option II divides by this K, not by the padded K.
      mean_loss: the mean minibatch loss over the steps taken, at the params before each step.
      model_state: the :class:`~scaffold_jax.types.ModelState` after the steps taken (None
        when none was given).
    """

    num_steps: Array
    mean_loss: Array
    model_state: ModelState | None = None


def takes(fn, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (False for a builtin or C callable, which
    has no keyword to pass)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def takes_key(loss_fn) -> bool:
    """Whether ``loss_fn`` has a ``key`` parameter: a stochastic loss (dropout) that the
    local steps call as ``loss_fn(params, batch, key=k)`` with a fresh key every step, and
    evaluation as ``loss_fn(params, batch)`` (deterministic)."""
    return takes(loss_fn, "key")


def batch_loss(loss_fn, params: PyTree, batch: Batch, mask: Array, key=None) -> Array:
    """Masked mean of the per-example losses: padded slots contribute nothing. ``key``
    goes to a loss that takes one (:func:`takes_key`), and the mask to a loss with a
    ``mask`` parameter (a BatchNorm model's, whose batch statistics must leave the padded
    slots out); others get neither."""
    extra = {}
    if key is not None and takes_key(loss_fn):
        extra["key"] = key
    if takes(loss_fn, "mask"):
        extra["mask"] = mask
    return masked_mean(loss_fn(params, batch, **extra), mask)


def batch_grad(
    loss_fn, params: PyTree, batch: Batch, mask: Array, key=None
) -> tuple[Array, PyTree]:
    """``(loss, gradient)`` of the masked mean loss, with respect to the params as stored
    (the model decides their layout; see :class:`scaffold_jax.models.Dense`)."""
    return jax.value_and_grad(lambda p: batch_loss(loss_fn, p, batch, mask, key))(params)


def local_sgd(
    loss_fn,
    params: PyTree,
    batches: Batch,
    mask: Array,
    client_lr: Array,
    correction: Correction | None = None,
    offset: PyTree | None = None,
    optimizer: optax.GradientTransformation | None = None,
    key: Array | None = None,
    model_state: ModelState | None = None,
) -> tuple[PyTree, LocalResult]:
    """Runs K masked steps ``y ← y − η_l · T(∇f_i(y; batch) + offset + correction(y, ...))``.

    ``T`` is the identity (plain SGD) unless an ``optimizer`` is given. Plain SGD is what
    SCAFFOLD's correction is defined for: momentum or weight decay wrapped around the
    correction is a known cause of broken SCAFFOLD reproductions (Algorithm 1 of
    Karimireddy et al., ICML 2020, Section 4, takes plain SGD steps), so only
    FedAvg, FedProx and Mime pass one.

    Args:
      loss_fn: per-example loss ``loss_fn(params, batch) -> [B]``.
      params: the starting point (the server model x).
      batches: pytree of ``[K, B, ...]`` arrays.
      mask: ``[K, B]`` float32, 1 for real examples.
      client_lr: η_l (float32 scalar).
      correction: optional ``(y, batch, mask) -> offset``, added to every gradient
        (FedProx's ``μ (y − x)``, Mime's ``c − ∇f_i(x; batch)``). An additive offset rather
        than a map ``(y, g) -> g'``: the step stays one fused ``y − η_l (g + offset)``.
      offset: optional constant pytree added to every gradient (SCAFFOLD's ``c − c_i``).
      optimizer: optional optax transformation WITHOUT a learning rate applied to the
        corrected gradient; its state starts from ``optimizer.init(params)`` (fresh every
        round) and advances only on the steps taken (an empty step leaves it as it was).
      key: the client's key for this round; step k's loss gets ``fold_in(key, k)`` when it
        takes a key (:func:`takes_key`, e.g. dropout). None: no key is passed.
      model_state: the model's running statistics (BatchNorm's), advanced at every step
        taken by the forward pass at the step's params y on its batch; None: a stateless
        model.

    Returns:
      The final params y and a :class:`LocalResult`.
    """
    if not takes_key(loss_fn):
        key = None  # nothing to split per step: the loss is deterministic

    def step(k, carry):
        y, opt_state, loss_sum, taken, stats = carry
        batch = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), batches)
        batch_mask = jax.lax.dynamic_index_in_dim(mask, k, keepdims=False)
        step_key = None if key is None else jax.random.fold_in(key, k)
        loss, grad = batch_grad(loss_fn, y, batch, batch_mask, step_key)
        if offset is not None:
            grad = optax.tree.add(grad, offset)
        if correction is not None:
            grad = optax.tree.add(grad, correction(y, batch, batch_mask, step_key))
        active = jnp.sum(batch_mask) > 0
        if optimizer is not None:
            grad, new_state = optimizer.update(grad, opt_state, y)
            opt_state = optax.tree.where(active, new_state, opt_state)
        if stats is not None:
            # The statistics of the batch at y, as the model's training step records them:
            # the same forward pass as the gradient's, which costs nothing measurable on
            # top of it (benchmarks/bench_model_state.py: 1.00x of frozen statistics).
            stats = optax.tree.where(active, stats.advance(y, batch, batch_mask, step_key), stats)
        y_next = optax.tree.where(active, optax.tree.add_scale(y, -client_lr, grad), y)
        loss_sum = loss_sum + jnp.where(active, loss.astype(jnp.float32), 0.0)
        return y_next, opt_state, loss_sum, taken + active.astype(jnp.int32), stats

    has_data = jnp.sum(mask, axis=tuple(range(1, mask.ndim))) > 0
    opt_state = () if optimizer is None else optimizer.init(params)
    zero = jnp.zeros((), jnp.int32)
    carry = (params, opt_state, jnp.zeros((), jnp.float32), zero, model_state)
    y, _, loss_sum, num_steps, model_state = step_loop(step, carry, has_data)
    mean_loss = loss_sum / jnp.maximum(num_steps, 1).astype(jnp.float32)
    return y, LocalResult(num_steps=num_steps, mean_loss=mean_loss, model_state=model_state)


# Set while the engine traces the clients' work of a round in which stopping early saves
# nothing (every client vmapped side by side takes all K steps): see `every_step_runs`.
_EVERY_STEP_RUNS = contextvars.ContextVar("scaffold_jax_every_step_runs", default=False)


@contextlib.contextmanager
def every_step_runs(yes: bool = True):
    """While active, :func:`step_loop` runs all K steps as a loop of K trips known to the
    compiler instead of stopping after the last non-empty one.

    The results are the same either way (an empty step leaves the carry as it was); what
    differs is the program: a loop whose trip count is data makes an accelerator read its
    condition back to the host after every trip (a synchronisation per local step), while a
    loop of known trip count runs without one. The engine turns it on when no client of
    the round can stop early: a plan whose K is every client's and no stragglers.
    """
    token = _EVERY_STEP_RUNS.set(yes)
    try:
        yield
    finally:
        _EVERY_STEP_RUNS.reset(token)


def step_loop(step: Callable, carry, active: Array):
    """``carry`` after ``step(k, carry)`` for k = 0, 1, ... through the last ``active``
    step (``[K]`` bool) of the client, or of the longest client vmapped beside it; all K
    under :func:`every_step_runs`. ``step`` must leave the carry as it was on an inactive
    step: the loop decides only how far to run, never which steps count.

    The loop runs to this client's last non-empty step, not over all K padded steps: a
    client of an epochs plan takes E·ceil(n_i / B) steps, and the engine runs clients of
    similar step counts side by side (Simulation.round_fn), so a chunk of vmapped clients
    loops only as long as its longest client.
    """
    num_steps = active.shape[0]
    if _EVERY_STEP_RUNS.get():
        return jax.lax.fori_loop(0, num_steps, step, carry)
    last = _longest_of_chunk(jnp.max(jnp.where(active, jnp.arange(num_steps, dtype=jnp.int32), -1)))

    def body(state):
        k, inner = state
        return k + 1, step(k, inner)

    return jax.lax.while_loop(lambda s: s[0] <= last, body, (jnp.zeros((), jnp.int32), carry))[1]


def _longest_of_chunk(last: Array) -> Array:
    """The largest ``last`` over the clients vmapped side by side (the engine's
    :data:`CLIENT_AXIS`), or ``last`` itself for a client run alone.

    With the bound the same for every client of a chunk, the loop's counter and condition
    are not batched: a vmapped while loop with a per-client condition would ``select``
    every carried value (the params) between the step and no step, at every step.
    """
    try:
        return jax.lax.pmax(last, CLIENT_AXIS)
    except NameError:  # not inside the engine's vmap over clients: one client alone
        return last


def flatten_steps(batches: Batch, mask: Array) -> tuple[Batch, Array]:
    """Merges the ``[K, B]`` axes into one ``[K·B]`` batch (all data drawn this round)."""
    flat = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), batches)
    return flat, mask.reshape(-1)
