"""FedDyn (Acar et al., ICLR 2021): the FedProx identity, the engine against a per-client
reference loop, the invariant h = mean_i g_i, the command line and a sweep over alpha."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close, reference_grad

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS, feddyn
from scaffold_jax.algorithms.common import ServerState
from scaffold_jax.algorithms.feddyn import FedDynClientState, FedDynServerState
from scaffold_jax.cli import main
from scaffold_jax.sampling import sample_clients
from scaffold_jax.sweep import grid, sweep

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)  # 1..5 steps per client, padded


def _sim(problem, weighting="uniform", chunk=None):
    alg = feddyn(problem.loss_fn)
    return sj.Simulation(alg, problem, PLAN, 3, weighting=weighting, client_chunk=chunk)


def _zeros(params):
    return jax.tree.map(jnp.zeros_like, params)


def test_it_is_registered_with_its_own_hyper_parameters():
    spec = ALGORITHMS["feddyn"]
    assert spec.display_name == "FedDyn" and spec.default_plan == "fraction"
    assert list(spec.hparams) == ["client_lr", "alpha"]  # no server_lr
    assert spec.hparams["alpha"].default == 0.01 and not spec.hparams["alpha"].allow_zero


# ----------------------------------------------------------------------- FedProx identity
def test_with_zero_g_and_h_the_local_step_is_fedprox_with_mu_alpha(small_data, small_problem):
    alpha = 0.3
    dyn = feddyn(small_problem.loss_fn)
    prox = sj.fedprox(small_problem.loss_fn)
    hp_dyn = sj.HParams(client_lr=0.4, alpha=alpha)
    hp_prox = sj.HParams(client_lr=0.4, server_lr=1.0, prox_mu=alpha)
    x = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), small_problem.params)
    key = jr.key(5)
    for client in range(small_data.num_clients):
        batches, mask = small_data.client_batches(jnp.int32(client), key, PLAN)
        state, mine = dyn.client_update(
            hp_dyn,
            FedDynServerState(x, _zeros(x)),
            FedDynClientState(_zeros(x)),
            batches,
            mask,
            key,
        )
        _, theirs = prox.client_update(hp_prox, ServerState(x, ()), (), batches, mask, key)
        assert_trees_close(mine.delta_params, theirs.delta_params, rtol=1e-6, atol=1e-7)
        assert float(mine.metrics["local_steps"]) == float(theirs.metrics["local_steps"]) > 0
        # ... and the client's new state is g_i = −α Δy_i.
        assert_trees_close(
            state.g, jax.tree.map(lambda d: -alpha * d, theirs.delta_params), rtol=1e-6, atol=1e-7
        )


def test_one_round_from_zero_state_gives_fedprox_local_models(small_data, small_problem):
    alpha = 0.3
    mine = _sim(small_problem).run(
        small_data, {"client_lr": 0.4, "alpha": alpha}, num_rounds=1, seed=3
    )
    prox = sj.Simulation(sj.fedprox(small_problem.loss_fn), small_problem, PLAN, 3)
    theirs = prox.run(small_data, sj.hparams(client_lr=0.4, prox_mu=alpha), num_rounds=1, seed=3)
    np.testing.assert_array_equal(mine.client_ids, theirs.client_ids)
    server = mine.state.server
    # mean_S y_i = x + h/α is FedProx's new model (η_g = 1) ...
    mean_y = jax.tree.map(lambda p, h: p + h / alpha, server.params, server.h)
    assert_trees_close(mean_y, theirs.state.server.params, rtol=1e-5, atol=1e-6)
    # ... and each sampled client's y_i = x − g_i/α is FedProx's y_i on the same batches.
    x0 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), small_problem.params)
    clients_key = jr.split(jr.fold_in(jr.key(3), 0))[1]
    for i in np.asarray(mine.client_ids[0]):
        key = jr.fold_in(clients_key, int(i))
        batches, mask = small_data.client_batches(jnp.int32(i), key, PLAN)
        hp = sj.HParams(client_lr=0.4, server_lr=1.0, prox_mu=alpha)
        _, out = prox.algorithm.client_update(hp, ServerState(x0, ()), (), batches, mask, key)
        g_i = jax.tree.map(lambda a, i=i: a[i], mine.state.clients.g)
        assert_trees_close(
            jax.tree.map(lambda g: -g / alpha, g_i), out.delta_params, rtol=1e-5, atol=1e-6
        )


# ----------------------------------------------------------------------- reference loop
def reference_run(problem, data, plan, num_sampled, lr, alpha, rounds, seed, weighting):
    """FedDyn's Algorithm 1 written out client by client: Python lists of g_i, float64
    numpy on the host; only the documented randomness contract is shared with the engine
    (round key fold_in(root, r) split into (sample key, clients key), client key
    fold_in(clients key, id), the batch plan's positions)."""
    n_clients = data.num_clients
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    h = jax.tree.map(np.zeros_like, x)
    g = [jax.tree.map(np.zeros_like, x) for _ in range(n_clients)]
    counts = np.asarray(data.counts)
    weights = np.ones(n_clients) if weighting == "uniform" else counts.astype(np.float64)
    root = jr.key(seed)

    def grad_at(params, batch, mask):
        return reference_grad(problem.loss_fn, params, batch, mask)

    all_ids = []
    for r in range(rounds):
        sample_key, clients_key = jr.split(jr.fold_in(root, r))
        ids = np.asarray(sample_clients(sample_key, n_clients, num_sampled))
        all_ids.append(ids)
        ys, ws = [], []
        for i in ids:
            key = jr.fold_in(clients_key, int(i))
            pos, mask = plan.positions(key, counts[i], data.max_count)
            pos, mask = np.asarray(pos), np.asarray(mask)
            examples = data.client_examples(int(i))
            y = jax.tree.map(np.copy, x)
            for k in range(len(pos)):
                if mask[k].sum() == 0:
                    continue
                batch = jax.tree.map(lambda a, k=k: a[pos[k]], examples)
                grad = grad_at(y, batch, mask[k])
                y = jax.tree.map(
                    lambda yy, gg, gi, xx: yy - lr * (gg - gi + alpha * (yy - xx)),
                    y, grad, g[i], x,
                )  # fmt: skip
            g[i] = jax.tree.map(lambda gi, yy, xx: gi - alpha * (yy - xx), g[i], y, x)
            ys.append(y)
            ws.append(weights[i])
        total = weights.sum()
        for w, y in zip(ws, ys, strict=True):
            h = jax.tree.map(lambda hh, yy, xx, w=w: hh - alpha * w * (yy - xx) / total, h, y, x)
        mean_y = jax.tree.map(
            lambda *v: sum(w * a for w, a in zip(ws, v, strict=True)) / sum(ws), *ys
        )
        x = jax.tree.map(lambda m, hh: m - hh / alpha, mean_y, h)
    return x, h, g, np.stack(all_ids)


@pytest.mark.parametrize(("weighting", "chunk"), [("uniform", None), ("num_examples", 2)])
def test_engine_matches_per_client_reference_loop(weighting, chunk, small_data, small_problem):
    lr, alpha, rounds, seed = 0.3, 0.2, 5, 7
    sim = _sim(small_problem, weighting, chunk)
    result = sim.run(small_data, {"client_lr": lr, "alpha": alpha}, num_rounds=rounds, seed=seed)
    x, h, g, ids = reference_run(
        small_problem, small_data, PLAN, 3, lr, alpha, rounds, seed, weighting
    )
    np.testing.assert_array_equal(result.client_ids, ids)
    assert np.bincount(ids.ravel()).max() >= 3  # some g_i is carried over several rounds
    assert_trees_close(result.state.server.params, x, rtol=1e-5, atol=1e-6)
    assert_trees_close(result.state.server.h, h, rtol=1e-5, atol=1e-6)
    table = jax.tree.map(lambda *rows: np.stack(rows), *g)
    assert_trees_close(result.state.clients.g, table, rtol=1e-5, atol=1e-6)
    assert float(np.max(np.abs(jax.tree.leaves(table)[0]))) > 1e-3  # g is not trivially 0


# ----------------------------------------------------------------------- invariant
@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_h_is_the_weighted_mean_of_all_client_states_after_every_round(
    weighting, small_data, small_problem
):
    sim = _sim(small_problem, weighting)
    hp = sim.resolve_hparams({"client_lr": 0.3, "alpha": 0.1})
    n = small_data.num_clients
    w = np.ones(n) if weighting == "uniform" else np.asarray(small_data.counts, np.float64)
    state, key = sim.init(small_data), jr.key(11)
    for _ in range(6):
        state, _ = sim.round(hp, state, small_data, key)
        mean_g = jax.tree.map(
            lambda a: np.tensordot(w, np.asarray(a, np.float64), axes=1) / w.sum(),
            state.clients.g,
        )
        assert_trees_close(state.server.h, mean_g, rtol=1e-5, atol=1e-6)
    assert int(state.round) == 6
    assert float(np.max(np.abs(jax.tree.leaves(state.server.h)[0]))) > 1e-4


# ----------------------------------------------------------------------- hyper-parameters
def test_server_lr_is_refused_unless_at_its_default(small_data, small_problem):
    sim = _sim(small_problem)
    # sj.hparams fills in server_lr = 1: dropped, FedDyn has no server step size.
    assert list(sim.resolve_hparams(sj.hparams(client_lr=0.1))) == ["client_lr", "alpha"]
    assert float(sim.resolve_hparams(sj.hparams(client_lr=0.1)).alpha) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="feddyn does not take the hyper-parameter.*server_lr"):
        sim.run(small_data, sj.hparams(client_lr=0.1, server_lr=0.5), num_rounds=1)
    with pytest.raises(ValueError, match="alpha=0 is invalid: every value must be finite and > 0"):
        sim.run(small_data, {"client_lr": 0.1, "alpha": 0.0}, num_rounds=1)


def test_the_command_line_refuses_a_server_lr(tmp_path, capsys):
    argv = ["run", "--algorithm", "feddyn", "--set", "server_lr=0.5", "--rounds", "1"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "server_lr" in err and "feddyn" in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


TINY = [
    "--dataset", "fashion_mnist", "--max-train-examples", "600", "--max-test-examples", "200",
    "--num-clients", "6", "--clients-per-round", "3", "--rounds", "4", "--eval-every", "2",
    "--quiet",
]  # fmt: skip


@needs_fashion
def test_it_runs_from_the_command_line(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "feddyn", "--set", "alpha=0.05", *TINY, "--out", str(out)]
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == "feddyn" and saved["hparams"] == {"alpha": 0.05}
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2, 4]
    assert all(np.isfinite(r["test_loss"]) for r in records)
    # server_lr left at its default is fine.
    default = ["run", "--algorithm", "feddyn", *TINY, "--out", str(tmp_path / "default")]
    assert main(default) == 0
    assert json.loads((tmp_path / "default" / "config.json").read_text())["hparams"] == {}
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["status"] == "finished"


def test_a_sweep_over_alpha_equals_the_single_runs(small_data, small_problem):
    sim = _sim(small_problem)
    hp, seeds, _ = grid(client_lr=0.1, alpha=[0.01, 0.1], seeds=[0])
    result = sweep(sim, small_data, hp, seeds, num_rounds=3, eval_every=1)
    assert [c["alpha"] for c in result.configs] == pytest.approx([0.01, 0.1])
    for j, config in enumerate(result.configs):
        alone = sim.run(
            small_data,
            {"client_lr": 0.1, "alpha": config["alpha"]},
            num_rounds=3,
            eval_every=1,
            seed=config["seed"],
        )
        server = jax.tree.map(lambda a, j=j: a[j], result.server_states)
        assert_trees_close(server.params, alone.state.server.params, rtol=1e-5)
        assert_trees_close(server.h, alone.state.server.h, rtol=1e-5)
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)
