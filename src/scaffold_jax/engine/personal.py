"""Personalized evaluation: every evaluated client's own model p_i and the global model x
on the client's own test data T_i, in ONE compiled pass.

The pass is vmapped over clients (in chunks of about ``eval_batch_size`` test examples,
``lax.map`` over the chunks), so its cost is one evaluation pass over the test examples
whatever N is. Client i's p_i is the algorithm's :attr:`~scaffold_jax.types.Algorithm.personal`
model (Ditto's v_i, APFL's mixture, ...), or x for an algorithm that trains one global
model; with fine-tuning (:class:`Personalization`) it is then taken F plain SGD steps on
D_i, batches as the run's plan draws them from the evaluation's key. Nothing of it is
stored or sent.

Records (over the E evaluated clients that have a test example; standard deviations are
population ones): ``personal_accuracy_{mean, weighted, std, worst10, min}`` and
``personal_loss_mean`` for p_i, the same as ``local_*`` for x, and
``personal_gain_fraction``, the fraction of clients whose p_i is strictly more accurate
on T_i than x. ``worst10`` is the mean over the worst ⌈0.1 E⌉ clients. An algorithm
whose server keeps no trained model of the whole (FedRep's and FedPer's heads stay on the
clients: :attr:`~scaffold_jax.types.Algorithm.personal` with ``global_model=False``)
reports no ``local_*`` and no gain.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.engine.axes import over_clients
from scaffold_jax.local import batch_loss, local_sgd
from scaffold_jax.types import SimState

#: The stream of the run's key the evaluation draws from (the fixed sample of evaluated
#: clients, the fine-tuning batches): far from the rounds' ``fold_in(key, round)``.
EVAL_STREAM = (1 << 31) - 1


class Personalization(NamedTuple):
    """How clients' own models are evaluated.

    Attributes:
      finetune_steps: F, plain SGD steps on the client's training data from its model
        before it is evaluated (0: none; p_i = x exactly for a global algorithm).
      finetune_lr: their step size; None: the run's client step size η_l.
      clients: E, the number of evaluated clients, a fixed sample drawn once from the
        run's key; None: all N.
    """

    finetune_steps: int = 0
    finetune_lr: float | None = None
    clients: int | None = None


def evaluated_ids(num_clients: int, clients: int | None, key: jax.Array) -> jax.Array:
    """The evaluated clients' ids, sorted: all N, or E drawn without replacement from
    ``key``'s evaluation stream (the same at every evaluation of a run)."""
    if clients is None or clients >= num_clients:
        return jnp.arange(num_clients, dtype=jnp.int32)
    drawn = jr.choice(jr.fold_in(key, EVAL_STREAM), num_clients, (clients,), replace=False)
    return jnp.sort(drawn).astype(jnp.int32)


def _summary(prefix: str, accuracy, loss, counts, has) -> dict[str, jax.Array]:
    num = jnp.sum(has).astype(jnp.float32)
    mean = jnp.sum(jnp.where(has, accuracy, 0.0)) / num
    spread = jnp.sqrt(jnp.sum(jnp.where(has, jnp.square(accuracy - mean), 0.0)) / num)
    worst = jnp.sort(jnp.where(has, accuracy, jnp.inf))
    k = jnp.maximum(1.0, jnp.ceil(0.1 * num))
    in_worst = jnp.arange(worst.shape[0], dtype=jnp.float32) < k
    weights = jnp.where(has, counts, 0).astype(jnp.float32)
    return {
        f"{prefix}_accuracy_mean": mean,
        f"{prefix}_accuracy_weighted": jnp.sum(weights * accuracy) / jnp.sum(weights),
        f"{prefix}_accuracy_std": spread,
        f"{prefix}_accuracy_worst10": jnp.sum(jnp.where(in_worst, worst, 0.0)) / k,
        f"{prefix}_accuracy_min": worst[0],
        f"{prefix}_loss_mean": jnp.sum(jnp.where(has, loss, 0.0)) / num,
    }


def test_offsets(data) -> jax.Array:
    counts = data.client_test_counts
    return jnp.concatenate([jnp.zeros(1, counts.dtype), jnp.cumsum(counts)[:-1]])


def client_evaluation(sim, hparams, state: SimState, data, key: jax.Array):
    """Every evaluated client's p_i and x on its own test data (see the module docstring).

    Returns:
      ``(metrics, per_client)``: the records' scalars, and ``{"client", "n_train",
      "n_test", "global", "personal"}`` ``[E]`` arrays (accuracies; ``global`` NaN where
      the server keeps no whole model) for ``personal.csv``.
    """
    problem, algorithm = sim.problem, sim.algorithm
    options = sim.personalization or Personalization()
    tests, counts = data.client_test, data.client_test_counts
    width = data.max_test_count
    ids = evaluated_ids(data.num_clients, options.clients, key)
    offsets = test_offsets(data)
    x = algorithm.server_params(state.server)
    model = state.model
    round_key = jr.fold_in(jr.fold_in(key, EVAL_STREAM), state.round)
    lr = hparams.client_lr if options.finetune_lr is None else options.finetune_lr
    whole = getattr(algorithm.personal, "global_model", True)
    separate = algorithm.personal is not None or options.finetune_steps > 0
    last = jax.tree.leaves(tests)[0].shape[0] - 1

    def one(client_id):
        client_key = jr.fold_in(round_key, client_id)

        def adapt(params, steps, step_lr):
            if steps == 0:
                return params
            # Batches as the run's plan draws them, K per draw: as many draws as F needs.
            draws = [data.client_batches(client_id, client_key, sim.plan)]
            per_draw = draws[0][1].shape[0]
            for d in range(1, math.ceil(steps / per_draw)):
                draws.append(data.client_batches(client_id, jr.fold_in(client_key, d), sim.plan))
            batches, mask = jax.tree.map(lambda *a: jnp.concatenate(a)[:steps], *draws)
            return local_sgd(problem.loss_fn, params, batches, mask, step_lr)[0]

        position = jnp.arange(width)
        valid = position < counts[client_id]
        rows = jnp.minimum(offsets[client_id] + position, last)
        batch = jax.tree.map(lambda a: a[rows], tests)
        mask = valid.astype(jnp.float32)
        extra = {}
        if model is not None:  # inference mode, with the client's own statistics if kept
            if "server" in model:
                extra["state"] = model["server"]
            else:
                extra["state"] = jax.tree.map(lambda a: a[client_id], model["clients"])

        def scores(params):
            hits = jnp.sum(mask * problem.accuracy_fn(params, batch, **extra))
            return hits, batch_loss(
                lambda p, b: problem.loss_fn(p, b, **extra), params, batch, mask
            )

        global_scores = scores(x) if whole else (jnp.float32(jnp.nan), jnp.float32(jnp.nan))
        if not separate:
            return global_scores, global_scores
        params = x
        if algorithm.personal is not None:
            row = jax.tree.map(lambda a: a[client_id], state.clients)
            params = algorithm.personal(hparams, state.server, row, adapt)
        params = adapt(params, options.finetune_steps, lr)
        return global_scores, scores(params)

    chunk = max(1, sim.eval_batch_size // max(width, 1))
    chunk = None if chunk >= ids.shape[0] else chunk
    (global_hits, global_loss), (hits, loss) = over_clients(one, (ids,), chunk)
    n_test = counts[ids]
    has = n_test > 0
    tested = jnp.maximum(n_test, 1).astype(jnp.float32)
    personal, local = hits / tested, global_hits / tested
    metrics = _summary("personal", personal, loss, n_test, has)
    if whole:
        metrics.update(_summary("local", local, global_loss, n_test, has))
        gain = jnp.sum(has & (personal > local)) / jnp.sum(has)
        metrics["personal_gain_fraction"] = gain.astype(jnp.float32)
    per_client = {
        "client": ids,
        "n_train": data.counts[ids],
        "n_test": n_test,
        "global": jnp.where(has, local, jnp.nan),
        "personal": jnp.where(has, personal, jnp.nan),
    }
    return metrics, per_client
