"""FedNova (Wang et al., NeurIPS 2020, arXiv:2007.07481): equals FedAvg when every
client takes the same number of steps (also under a server optimizer), matches a plain
per-client reference loop when the step counts differ, handles a client that took no
step, and runs from the registry, a sweep and the command line."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from conftest import assert_trees_close, reference_grad

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS, fednova
from scaffold_jax.algorithms.fednova import normalized_delta
from scaffold_jax.cli import main
from scaffold_jax.sampling import sample_clients
from scaffold_jax.sweep import grid, sweep
from scaffold_jax.types import ClientOutput

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)

# Every client takes K = 3 steps of 2 examples (small_data's clients hold 2..13 examples).
EQUAL = sj.BatchPlan.fixed(batch_size=2, num_steps=3)
# One epoch of batches of 3: clients of 2..13 examples take 1..5 steps (padded slots).
UNEQUAL = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)
ROUNDS, SEED = 4, 7


def _sim(alg, problem, plan, weighting="uniform", chunk=None):
    return sj.Simulation(
        alg, problem, plan, clients_per_round=3, weighting=weighting, client_chunk=chunk
    )


def _max_gap(a, b):
    gaps = jax.tree.map(lambda u, v: np.max(np.abs(np.asarray(u) - np.asarray(v))), a, b)
    return max(jax.tree.leaves(gaps))


# --------------------------------------------------------------------------- the reference
def reference_fednova(problem, data, plan, num_sampled, hp, rounds, seed, weighting, decay=None):
    """FedNova written out client by client, as the contract states it (no vmap).

    Float64 numpy on the host; only a minibatch gradient is jax (float32, one client at a
    time). The randomness contract is the engine's (tests/test_engine.py::reference_run):
    round key fold_in(root, r) split into (sample key, clients key), client key
    fold_in(clients key, id), the plan's positions. ``decay``: FedAvgM-style momentum on the
    pseudo-gradient (optax.trace: m ← g + decay·m; x ← x − η_g m).

    Returns (x, sampled ids [R, S], per-round τ_i [R, S]).
    """
    lr, glr = float(hp.client_lr), float(hp.server_lr)
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    m = jax.tree.map(np.zeros_like, x)
    counts = np.asarray(data.counts)
    root = jr.key(seed)

    def grad_at(params, batch, mask):
        return reference_grad(problem.loss_fn, params, batch, mask)

    all_ids, all_taus = [], []
    for r in range(rounds):
        sample_key, clients_key = jr.split(jr.fold_in(root, r))
        ids = np.asarray(sample_clients(sample_key, data.num_clients, num_sampled))
        ds, taus, ws = [], [], []
        for i in ids:
            key = jr.fold_in(clients_key, int(i))
            pos, mask = plan.positions(key, counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            y, tau = jax.tree.map(np.copy, x), 0
            for k in range(pos.shape[0]):
                if mask[k].sum() == 0:
                    continue  # a padded step: not taken, not counted
                batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
                y = jax.tree.map(lambda yy, gg: yy - lr * gg, y, grad_at(y, batch, mask[k]))
                tau += 1
            ds.append(jax.tree.map(lambda xx, yy, tau=tau: (xx - yy) / (lr * tau), x, y))
            taus.append(tau)
            ws.append(1.0 if weighting == "uniform" else float(counts[i]))
        p = np.asarray(ws) / np.sum(ws)
        tau_eff = float(np.sum(p * np.asarray(taus, np.float64)))
        pseudo = jax.tree.map(
            lambda *d: tau_eff * lr * sum(pi * di for pi, di in zip(p, d, strict=True)), *ds
        )
        if decay is not None:
            m = jax.tree.map(lambda mm, g: g + decay * mm, m, pseudo)
            pseudo = m
        x = jax.tree.map(lambda xx, g: xx - glr * g, x, pseudo)
        all_ids.append(ids)
        all_taus.append(taus)
    return x, np.stack(all_ids), np.asarray(all_taus, np.float64)


# --------------------------------------------------------------------------- equal τ_i
@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_with_equal_local_steps_it_equals_fedavg(weighting, small_data, small_problem):
    hp = sj.hparams(client_lr=0.3, server_lr=0.8)
    nova = _sim(fednova(small_problem.loss_fn), small_problem, EQUAL, weighting)
    avg = _sim(sj.fedavg(small_problem.loss_fn), small_problem, EQUAL, weighting)
    mine = nova.run(small_data, hp, num_rounds=ROUNDS, seed=SEED)
    theirs = avg.run(small_data, hp, num_rounds=ROUNDS, seed=SEED)
    np.testing.assert_array_equal(mine.client_ids, theirs.client_ids)
    np.testing.assert_array_equal(mine.round_metrics["local_steps"], 3.0)
    assert_trees_close(mine.state.server.params, theirs.state.server.params, rtol=1e-6)


def test_with_equal_local_steps_and_server_momentum_it_equals_fedavgm(small_data, small_problem):
    hp = sj.hparams(client_lr=0.3, server_lr=0.8)
    loss = small_problem.loss_fn
    nova = _sim(fednova(loss, server_optimizer=optax.trace(0.9)), small_problem, EQUAL)
    avgm = _sim(sj.fedavg(loss, server_optimizer=optax.trace(0.9)), small_problem, EQUAL)
    mine = nova.run(small_data, hp, num_rounds=ROUNDS, seed=SEED)
    theirs = avgm.run(small_data, hp, num_rounds=ROUNDS, seed=SEED)
    assert_trees_close(mine.state.server, theirs.state.server, rtol=1e-6)
    # The momentum did something: plain FedAvg ends elsewhere.
    plain = _sim(sj.fedavg(loss), small_problem, EQUAL).run(
        small_data, hp, num_rounds=ROUNDS, seed=SEED
    )
    assert _max_gap(mine.state.server.params, plain.state.server.params) > 1e-3


# --------------------------------------------------------------------------- unequal τ_i
# (weighting, server momentum decay, client_chunk): chunk 2 of S = 3 runs through lax.map.
CASES = [
    ("uniform", None, None),
    ("num_examples", None, None),
    ("uniform", 0.9, 2),
    ("num_examples", 0.9, None),
]


@pytest.mark.parametrize(
    ("weighting", "decay", "chunk"), CASES, ids=[f"{w}-m{d}-chunk{c}" for w, d, c in CASES]
)
def test_with_unequal_local_steps_it_matches_the_reference_and_not_fedavg(
    weighting, decay, chunk, small_data, small_problem
):
    hp = sj.hparams(client_lr=0.4, server_lr=0.8)
    opt = None if decay is None else optax.trace(decay)
    loss = small_problem.loss_fn
    sim = _sim(fednova(loss, server_optimizer=opt), small_problem, UNEQUAL, weighting, chunk)
    assert sim.resolve_client_chunk(small_data) == chunk
    result = sim.run(small_data, hp, num_rounds=ROUNDS, seed=SEED)
    x, ids, taus = reference_fednova(
        small_problem, small_data, UNEQUAL, 3, hp, ROUNDS, SEED, weighting, decay
    )
    # The sampled clients really took different numbers of steps.
    assert len(np.unique(taus)) >= 3
    np.testing.assert_array_equal(result.client_ids, ids)
    # The engine's round metric is the uniform mean of the τ_i the server used.
    np.testing.assert_allclose(result.round_metrics["local_steps"], taus.mean(axis=1), rtol=1e-6)
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    # ... and FedAvg (same batches) ends elsewhere.
    fedavg = _sim(sj.fedavg(loss, server_optimizer=opt), small_problem, UNEQUAL, weighting, chunk)
    other = fedavg.run(small_data, hp, num_rounds=ROUNDS, seed=SEED).state.server.params
    assert _max_gap(other, x) > 1e-3


# --------------------------------------------------------------------------- the aggregate
def _outputs(deltas, taus, weights):
    return ClientOutput(
        delta_params={"w": jnp.asarray(deltas, jnp.float32)},
        weight=jnp.asarray(weights, jnp.float32),
        metrics={},
        message={"local_steps": jnp.asarray(taus, jnp.float32)},
    )


def test_the_aggregate_is_tau_eff_times_the_normalised_mean():
    deltas = [[0.0, 0.0], [2.0, -4.0], [3.0, 6.0]]
    # weights 1, 2, 1 (p = 1/4, 1/2, 1/4), τ = 0, 2, 3: τ_eff = 0 + 1 + 3/4 = 1.75.
    got = normalized_delta(_outputs(deltas, [0.0, 2.0, 3.0], [1.0, 2.0, 1.0]))
    expected = 1.75 * (0.5 * np.asarray([1.0, -2.0]) + 0.25 * np.asarray([1.0, 2.0]))
    np.testing.assert_allclose(got["w"], expected, rtol=1e-6)


def test_a_client_that_took_no_step_contributes_nothing_and_nothing_is_nan():
    # A client with τ_i = 0 (it drew no data) has Δy_i = 0: no 0/0, it adds nothing.
    got = normalized_delta(_outputs([[0.0], [2.0]], [0.0, 4.0], [1.0, 1.0]))
    np.testing.assert_allclose(got["w"], [2.0 * 0.5 * 0.5], rtol=1e-6)  # τ_eff = 2, p = ½
    # No client took a step, or no weight at all: the server model stays where it is.
    for taus, weights in [([0.0, 0.0], [1.0, 1.0]), ([2.0, 3.0], [0.0, 0.0])]:
        zero = normalized_delta(_outputs([[0.0], [0.0]], taus, weights))
        np.testing.assert_array_equal(zero["w"], [0.0])
    # Under jit too (as the engine runs it).
    jitted = jax.jit(normalized_delta)(_outputs([[0.0], [2.0]], [0.0, 4.0], [1.0, 1.0]))
    np.testing.assert_allclose(jitted["w"], got["w"], rtol=1e-6)


# --------------------------------------------------------------------------- the layers above
def test_it_is_registered_with_the_step_sizes():
    spec = ALGORITHMS["fednova"]
    assert spec.display_name == "FedNova" and spec.default_plan == "fraction"
    assert list(spec.hparams) == ["client_lr", "server_lr"]
    assert sj.algorithms.make("fednova", lambda p, b: jnp.zeros(())).name == "fednova"


def test_a_sweep_equals_the_single_runs(small_data, small_problem):
    sim = _sim(fednova(small_problem.loss_fn), small_problem, UNEQUAL)
    hp, seeds, configs = grid(client_lr=[0.05, 0.1], seeds=[0])
    result = sweep(sim, small_data, hp, seeds, num_rounds=3, eval_every=1)
    assert [c["client_lr"] for c in result.configs] == [0.05, 0.1]
    for j, config in enumerate(configs):
        alone = sim.run(small_data, sj.hparams(config["client_lr"]), 3, 1, seed=config["seed"])
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)
        server = jax.tree.map(lambda a, j=j: a[j], result.server_states)
        assert_trees_close(server, alone.state.server, rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(result.records[j], alone.records, strict=True):
            for name in ("test_loss", "test_accuracy", "train_loss"):
                np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-5, atol=1e-6)


@needs_fashion
def test_it_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    argv = [
        "run", "--algorithm", "fednova", "--dataset", "fashion_mnist",
        "--max-train-examples", "600", "--max-test-examples", "200",
        "--num-clients", "6", "--clients-per-round", "3", "--batch-size", "16",
        "--local-epochs", "1", "--rounds", "4", "--eval-every", "2",
        "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = results.read_summary(out)
    assert summary["status"] == "finished"
    assert json.loads((out / "config.json").read_text())["algorithm"] == "fednova"
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2, 4]
    assert all(np.isfinite(r["test_accuracy"]) for r in records)
