"""What the personalized algorithms' reference loops (tests/test_apfl.py,
test_pfedme.py, test_perfedavg.py) share: the tiny logistic-regression problem, its
gradient in float64 numpy, and the round's randomness replayed from its documented keys.

Nothing here runs an algorithm: each test file writes its client's local work as a plain
per-client numpy loop. From the package they take data access only (a client's examples,
the batch plan's positions for a key, the sampler, the dropout model's draw, the
documented key derivations), never the engine's or an algorithm's arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import scaffold_jax as sj
from scaffold_jax import participation
from scaffold_jax.engine.keys import DROPOUT_STREAM, extra_batches_key, participation_key
from scaffold_jax.sampling import sample_clients

PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)  # 1..5 steps per client, padded
CLIENTS_PER_ROUND = 3


def simulation(algorithm, problem, dropout_rate=None):
    part = None
    if dropout_rate is not None:
        part = participation.make(dropouts="bernoulli", options={"dropout_rate": dropout_rate})
    return sj.Simulation(algorithm, problem, PLAN, CLIENTS_PER_ROUND, participation=part)


def to64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def grad(params, batch):
    """∇ of the masked mean softmax cross-entropy of the logistic regression at float64
    ``params`` ({"linear": {"kernel" [C, D], "bias" [C]}}); ``batch`` is (x, y, mask)."""
    x, y, mask = batch
    kernel, bias = params["linear"]["kernel"], params["linear"]["bias"]
    logits = x @ kernel.T + bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    g = p * mask[:, None] / max(mask.sum(), 1.0)
    return {"linear": {"bias": g.sum(axis=0), "kernel": g.T @ x}}


def add(a, b, scale=1.0):
    """a + scale · b, leaf by leaf."""
    return jax.tree.map(lambda u, v: u + scale * v, a, b)


def vdot(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(float(np.sum(u * v)) for u, v in pairs)


def max_abs_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in pairs)


def client_batches(data, client, key):
    """The client's batches for ``key`` as the plan draws them: a list of (x, y, mask)
    per step, float64, the empty (padded) steps included."""
    pos, mask = PLAN.positions(key, data.counts[client], data.max_count)
    pos, mask = np.asarray(pos), np.asarray(mask, np.float64)
    examples = data.client_examples(int(client))
    x, y = np.asarray(examples["x"], np.float64), np.asarray(examples["y"])
    return [(x[pos[k]], y[pos[k]], mask[k]) for k in range(len(pos))]


def run(data, x0, rounds, seed, client_work, server_lr=1.0, dropout_rate=None):
    """Rounds of a FedAvg-like server ``x ← x + server_lr · mean Δw`` (uniform weights,
    over the clients that report) around ``client_work(i, x, batches, draw) -> Δw``,
    where ``draw(stream)`` gives the client's batches of an extra stream; ``client_work``
    keeps its client's personal state itself (a client that drops after its work keeps
    it). Returns x, the sampled ids ``[R, S]`` and the dropped ones ``[R, S]`` (bool)."""
    x = to64(x0)
    root = jr.key(seed)
    dropouts = None
    if dropout_rate is not None:
        dropouts = participation.make(
            dropouts="bernoulli", options={"dropout_rate": dropout_rate}
        ).dropouts
    all_ids, all_dropped = [], []
    for r in range(rounds):
        round_key = jr.fold_in(root, r)
        sample_key, clients_key = jr.split(round_key)
        ids = np.asarray(sample_clients(sample_key, data.num_clients, CLIENTS_PER_ROUND))
        dropped = np.zeros(len(ids), bool)
        if dropouts is not None:
            key = participation_key(round_key, DROPOUT_STREAM)
            dropped = np.asarray(dropouts.dropped(key, jnp.asarray(ids, jnp.int32)))
        deltas = []
        for i, gone in zip(ids, dropped, strict=True):
            key = jr.fold_in(clients_key, int(i))
            draw = lambda stream, i=i, key=key: client_batches(
                data, i, extra_batches_key(key, stream)
            )
            delta = client_work(int(i), x, client_batches(data, i, key), draw)
            if not gone:
                deltas.append(delta)
        if deltas:
            mean = jax.tree.map(lambda *d: sum(d) / len(d), *deltas)
            x = add(x, mean, server_lr)
        all_ids.append(ids)
        all_dropped.append(dropped)
    return x, np.stack(all_ids), np.stack(all_dropped)


def row(table, i):
    return jax.tree.map(lambda a: a[i], table)
