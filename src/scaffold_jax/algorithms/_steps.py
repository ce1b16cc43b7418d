"""The masked loop of the personalized algorithms' local steps (APFL, pFedMe,
Per-FedAvg), whose steps carry more than the params :func:`~scaffold_jax.local.local_sgd`
takes: ``step(k, carry)`` runs for each step k whose batch has a real example, an empty
(padded) step leaves the carry as it was, and the loop stops after the last non-empty step
of the client (or of the longest client vmapped beside it), as ``local_sgd``'s does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.local import step_loop, takes_key


def active_steps(mask: jax.Array) -> jax.Array:
    """``[K]`` bool: the steps whose batch holds a real example (``mask`` ``[K, B]``)."""
    return jnp.sum(mask, axis=tuple(range(1, mask.ndim))) > 0


def masked_steps(step, carry, active: jax.Array):
    """``carry`` after ``step(k, carry)`` for every k with ``active[k]``, in order; the
    others leave it unchanged (they are skipped past the last active one)."""
    return step_loop(
        lambda k, inner: optax.tree.where(active[k], step(k, inner), inner), carry, active
    )


def step_keys(loss_fn, key):
    """``key_of(k)``: step k's key for a loss that takes one (dropout), ``fold_in(key, k)``
    as :func:`~scaffold_jax.local.local_sgd` gives it; None for a deterministic loss."""
    if key is None or not takes_key(loss_fn):
        return lambda k: None
    return lambda k: jax.random.fold_in(key, k)


def index(tree, k):
    """Step k of a ``[K, ...]`` pytree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), tree)
