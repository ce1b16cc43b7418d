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

from scaffold_jax.local import _longest_of_chunk, takes_key


def active_steps(mask: jax.Array) -> jax.Array:
    """``[K]`` bool: the steps whose batch holds a real example (``mask`` ``[K, B]``)."""
    return jnp.sum(mask, axis=tuple(range(1, mask.ndim))) > 0


def masked_steps(step, carry, active: jax.Array):
    """``carry`` after ``step(k, carry)`` for every k with ``active[k]``, in order; the
    others leave it unchanged (they are skipped past the last active one)."""
    last = _longest_of_chunk(
        jnp.max(jnp.where(active, jnp.arange(active.shape[0], dtype=jnp.int32), -1))
    )

    def body(state):
        k, inner = state
        return k + 1, optax.tree.where(active[k], step(k, inner), inner)

    return jax.lax.while_loop(lambda s: s[0] <= last, body, (jnp.zeros((), jnp.int32), carry))[1]


def step_keys(loss_fn, key):
    """``key_of(k)``: step k's key for a loss that takes one (dropout), ``fold_in(key, k)``
    as :func:`~scaffold_jax.local.local_sgd` gives it; None for a deterministic loss."""
    if key is None or not takes_key(loss_fn):
        return lambda k: None
    return lambda k: jax.random.fold_in(key, k)


def index(tree, k):
    """Step k of a ``[K, ...]`` pytree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), tree)
