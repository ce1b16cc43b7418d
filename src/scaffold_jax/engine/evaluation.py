"""Centralised evaluation of the server model: the evaluators a :class:`Simulation` traces
into its ``evaluate`` program, and the chunked per-example loop they share."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from scaffold_jax.tree import take_rows, weighted_mean
from scaffold_jax.types import PyTree


def heldout_metrics(sim, params: PyTree, data, model=None) -> dict[str, jax.Array]:
    """``test_loss`` and ``test_accuracy`` of ``params`` on ``data.test`` (when present);
    a model with running statistics uses :meth:`Simulation.mean_statistics`."""
    test = getattr(data, "test", None)
    if test is None:
        return {}
    if model is not None:
        model = {"server": sim.mean_statistics(model, data)}
    out = {"test_loss": jnp.mean(sim.per_example(sim.problem.loss_fn, params, test, model))}
    if sim.problem.accuracy_fn is not None:
        correct = sim.per_example(sim.problem.accuracy_fn, params, test, model)
        out["test_accuracy"] = jnp.mean(correct)
    return out


TRAIN_EVAL_EXAMPLES = 4096
"""Training examples the training objective is evaluated on by default (a fixed uniform
subsample; :func:`train_objective`)."""


def train_objective(sim, params: PyTree, data, model=None) -> dict[str, jax.Array]:
    """``train_loss``, the federated objective f(x) = Σ_i p_i f_i(x) / Σ_j p_j under the
    simulation's weighting (uniform: (1/N) Σ_i f_i; ``"num_examples"``: the mean over all
    examples), over the training examples of materialised data.

    With ``sim.train_eval_examples = m`` smaller than the n training examples, it is
    estimated on a FIXED uniform subsample of m examples (the same at every evaluation, so
    curves compare like with like), each weighted by n/m times its weight in f
    (p_i / (Σ_j p_j n_i)): an unbiased estimate, at m/n of the cost of the full pass.
    ``None``: every example, the exact objective. Under the ``"local"`` statistics policy
    every example is evaluated with its own client's statistics.
    """
    if not hasattr(data, "examples"):
        return {}
    n = jax.tree.leaves(data.examples)[0].shape[0]
    m = sim.train_eval_examples
    if m is None or m >= n:
        owner = jnp.repeat(jnp.arange(data.num_clients), data.counts, total_repeat_length=n)
        losses = sim.per_example(sim.problem.loss_fn, params, data.examples, model, owner)
        sums = jax.ops.segment_sum(losses, owner, num_segments=data.num_clients)
        means = sums / data.counts.astype(jnp.float32)
        if sim.equal_weights:
            return {"train_loss": jnp.mean(means)}
        weights = sim.client_weights(data)
        return {"train_loss": jnp.sum(weights * means) / jnp.sum(weights)}
    # Static indices (n and m are shapes): a constant of the program, drawn once. Each
    # example's client is found from the clients' sorted row offsets.
    index = np.sort(np.random.default_rng(0).choice(n, m, replace=False)).astype(np.int32)
    examples = jax.tree.map(lambda a: a[index], data.examples)
    owner = jnp.searchsorted(data.offsets, index, side="right") - 1
    losses = sim.per_example(sim.problem.loss_fn, params, examples, model, owner)
    if sim.equal_weights:
        weight = 1.0 / (data.num_clients * data.counts[owner].astype(jnp.float32))
    else:  # example e of client i stands for p_i / (Σ_j p_j n_i) of the objective
        weights = sim.client_weights(data)
        weight = weights[owner] / (jnp.sum(weights) * data.counts[owner].astype(jnp.float32))
    return {"train_loss": (n / m) * jnp.sum(weight * losses)}


#: What :meth:`Simulation.evaluate_fn` computes unless told otherwise.
DEFAULT_EVALUATORS = (heldout_metrics, train_objective)


def per_example(
    sim,
    fn: Callable,
    params: PyTree,
    examples: PyTree,
    model: PyTree = None,
    owner: jax.Array | None = None,
) -> jax.Array:
    """``fn(params, batch) -> [B]`` over all examples in chunks of
    ``eval_batch_size`` (``lax.map``), without copying the data.

    With the running statistics ``model`` (``SimState.model``) it is called as
    ``fn(params, batch, state=...)``, in inference mode: with the server's statistics
    (``"average"``), with each example's own client's (``"local"``, given each
    example's client ``owner``: every example is then evaluated alone, vmapped), or,
    (for a test set of nobody's, pass ``{"server": mean_statistics(model, data)}``).
    """
    n = jax.tree.leaves(examples)[0].shape[0]
    if model is not None:
        return _per_example_with_stats(sim, fn, params, examples, model, owner)
    size = min(sim.eval_batch_size, n)
    num_chunks = math.ceil(n / size)

    def chunk(i):
        # The last chunk is clamped to end at n; its overlap with the previous chunk is
        # dropped below, so every example counts exactly once.
        start = jnp.minimum(i * size, n - size)
        batch = jax.tree.map(
            lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=0), examples
        )
        return fn(params, batch).astype(jnp.float32)

    values = jax.lax.map(chunk, jnp.arange(num_chunks))  # [num_chunks, size]
    if num_chunks * size == n:
        return values.reshape(-1)
    head = values[:-1].reshape(-1)
    tail = values[-1, num_chunks * size - n :]
    return jnp.concatenate([head, tail])


def mean_statistics(sim, model: PyTree, data) -> PyTree:
    """The running statistics a model of nobody's is evaluated with: the server's, or
    under the ``"local"`` policy the clients' mean (uniform, or weighted by n_i under
    ``weighting="num_examples"``)."""
    if "server" in model:
        return model["server"]
    weights, _ = sim.weights(data, jnp.arange(data.num_clients, dtype=jnp.int32))
    return weighted_mean(model["clients"], weights)


def _per_example_with_stats(sim, fn, params, examples, model, owner):
    if "server" in model:
        return per_example(sim, partial(fn, state=model["server"]), params, examples)
    table = model["clients"]
    if owner is None:
        raise ValueError(
            "per_example with every client's own statistics needs each example's "
            "client (owner=); for examples of nobody's, pass {'server': "
            "simulation.mean_statistics(model, data)}."
        )

    def each(params, batch):
        def one(example):
            stats = take_rows(table, example["owner"][None])
            stats = jax.tree.map(lambda a: a[0], stats)
            single = jax.tree.map(lambda a: a[None], example["example"])
            return fn(params, single, state=stats)[0]

        return jax.vmap(one)(batch)

    return per_example(sim, each, params, {"example": examples, "owner": owner})
