"""Mime and MimeLite (Karimireddy et al., NeurIPS 2021, arXiv:2008.03606): its identities
(MimeLite with no base optimizer is FedAvg; Mime with K = 1 full batches is MimeLite), the
engine against a per-client reference loop, the full-data pass, sweeps and the command
line."""

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
from scaffold_jax.algorithms import ALGORITHMS, mime, mimelite
from scaffold_jax.cli import main
from scaffold_jax.sampling import sample_clients
from scaffold_jax.sweep import grid, sweep

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
PLAN = sj.BatchPlan.epochs(batch_size=3, num_epochs=1)  # 1..5 steps per client, padded


def test_they_are_registered_with_a_base_optimizer_option():
    for name, display in (("mime", "Mime"), ("mimelite", "MimeLite")):
        spec = ALGORITHMS[name]
        assert spec.display_name == display
        assert list(spec.hparams) == ["client_lr", "server_lr"]
        assert spec.options["base_optimizer"].default == "momentum"  # optax.trace(0.9)
        assert "local_optimizer" in spec.refuses


# ----------------------------------------------------------------------- identities
def test_mimelite_without_a_base_optimizer_is_fedavg(small_data, small_problem):
    hp = sj.hparams(client_lr=0.3, server_lr=0.7)
    lite = sj.Simulation(mimelite(small_problem.loss_fn, "sgd"), small_problem, PLAN, 3)
    avg = sj.Simulation(sj.fedavg(small_problem.loss_fn), small_problem, PLAN, 3)
    a = lite.run(small_data, hp, num_rounds=4, seed=2)
    b = avg.run(small_data, hp, num_rounds=4, seed=2)
    np.testing.assert_array_equal(a.client_ids, b.client_ids)
    assert_trees_close(a.state.server.params, b.state.server.params, rtol=1e-6, atol=1e-7)


def test_mime_with_one_full_batch_step_equals_mimelite(small_data, small_problem):
    """K = 1 on the full batch: every Mime client steps along B(c), the mean of MimeLite's
    B(∇f_i(x)) steps, B linear (momentum). Several rounds, so the momentum is not 0."""
    plan = sj.BatchPlan.full(1)
    hp = sj.hparams(client_lr=0.2)
    runs = [
        sj.Simulation(f(small_problem.loss_fn), small_problem, plan, 3).run(
            small_data, hp, num_rounds=4, seed=5
        )
        for f in (mime, mimelite)
    ]
    a, b = (r.state.server for r in runs)
    assert_trees_close(a.params, b.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(a.base_state, b.base_state, rtol=1e-5, atol=1e-6)
    assert float(np.max(np.abs(jax.tree.leaves(a.base_state)[0]))) > 1e-3
    # ... and the model moved (the identity is not that of two idle runs).
    moved = [
        np.asarray(jax.tree.leaves(r.state.server.params)[0])
        - np.asarray(jax.tree.leaves(small_problem.params)[0])
        for r in runs
    ]
    assert np.max(np.abs(moved[0])) > 1e-3


def test_with_adam_as_base_mime_at_one_step_is_not_mimelite(small_data, small_problem):
    """The K = 1 identity needs a base optimizer linear in g; Adam is not (the contract
    says so): the two differ, which shows the identity test above can fail."""
    plan = sj.BatchPlan.full(1)
    hp = sj.hparams(client_lr=0.2)
    a, b = (
        sj.Simulation(f(small_problem.loss_fn, "adam"), small_problem, plan, 3)
        .run(small_data, hp, num_rounds=3, seed=5)
        .state.server.params
        for f in (mime, mimelite)
    )
    diff = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    assert diff > 1e-3


# ----------------------------------------------------------------------- reference loop
def reference_run(problem, data, plan, num_sampled, lr, server_lr, beta, rounds, seed, *,
                  corrected, weighting):  # fmt: skip
    """Mime / MimeLite with B = heavy-ball momentum (optax.trace: u = g + β m) written out
    client by client in float64 on the host. Shares only the documented randomness
    contract with the engine (round key fold_in(root, r) split into (sample key, clients
    key), client key fold_in(clients key, id), the batch plan's positions)."""
    x = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    m = jax.tree.map(np.zeros_like, x)
    counts = np.asarray(data.counts)
    root = jr.key(seed)
    all_ids, controls = [], []
    for r in range(rounds):
        sample_key, clients_key = jr.split(jr.fold_in(root, r))
        ids = np.asarray(sample_clients(sample_key, data.num_clients, num_sampled))
        all_ids.append(ids)
        w = np.ones(len(ids)) if weighting == "uniform" else counts[ids].astype(np.float64)
        # 1. Every sampled client's gradient at x on ALL its examples; c is their mean.
        full = []
        for i in ids:
            examples = data.client_examples(int(i))
            full.append(reference_grad(problem.loss_fn, x, examples, np.ones(counts[i])))
        c = jax.tree.map(lambda *g: sum(wi * gi for wi, gi in zip(w, g, strict=True)) / w.sum(),
                         *full)  # fmt: skip
        controls.append(c)
        # 2. Local steps with the momentum m frozen.
        deltas = []
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
                g = reference_grad(problem.loss_fn, y, batch, mask[k])
                if corrected:
                    gx = reference_grad(problem.loss_fn, x, batch, mask[k])
                    g = jax.tree.map(lambda a, b, cc: a - b + cc, g, gx, c)
                y = jax.tree.map(lambda yy, gg, mm: yy - lr * (gg + beta * mm), y, g, m)
            deltas.append(jax.tree.map(lambda yy, xx: yy - xx, y, x))
        # 3. Server: the model average, then the base optimizer's state on c.
        mean = jax.tree.map(
            lambda *d: sum(wi * di for wi, di in zip(w, d, strict=True)) / w.sum(), *deltas
        )
        x = jax.tree.map(lambda xx, d: xx + server_lr * d, x, mean)
        m = jax.tree.map(lambda cc, mm: cc + beta * mm, c, m)
    return x, m, controls[-1], np.stack(all_ids)


@pytest.mark.parametrize(
    ("name", "weighting", "chunk"),
    [
        ("mime", "uniform", None),
        ("mime", "num_examples", 2),
        pytest.param("mimelite", "uniform", 2, marks=pytest.mark.slow),
    ],
)
def test_engine_matches_per_client_reference_loop(name, weighting, chunk, small_data,
                                                  small_problem):  # fmt: skip
    lr, server_lr, beta, rounds, seed = 0.1, 0.8, 0.5, 5, 7
    factory = mime if name == "mime" else mimelite
    alg = factory(small_problem.loss_fn, f"momentum:momentum={beta}")
    sim = sj.Simulation(alg, small_problem, PLAN, 3, weighting=weighting, client_chunk=chunk)
    result = sim.run(small_data, sj.hparams(client_lr=lr, server_lr=server_lr),
                     num_rounds=rounds, seed=seed)  # fmt: skip
    x, m, c, ids = reference_run(
        small_problem, small_data, PLAN, 3, lr, server_lr, beta, rounds, seed,
        corrected=name == "mime", weighting=weighting,
    )  # fmt: skip
    np.testing.assert_array_equal(result.client_ids, ids)
    server = result.state.server
    assert_trees_close(server.params, x, rtol=1e-5, atol=1e-6)
    assert_trees_close(server.control, c, rtol=1e-5, atol=1e-6)  # the last round's c
    assert_trees_close(server.base_state.trace, m, rtol=1e-5, atol=1e-6)
    assert float(np.max(np.abs(jax.tree.leaves(m)[0]))) > 1e-3


def test_the_control_is_the_full_batch_gradient_whatever_the_plan(small_data, small_problem):
    """c is the mean of ∇f_i(x) over each client's WHOLE data, also when the plan draws a
    single small batch per round."""
    plan = sj.BatchPlan.fixed(batch_size=2, num_steps=1)
    sim = sj.Simulation(mime(small_problem.loss_fn), small_problem, plan, 7)  # S = N
    state = sim.init(small_data)
    state, _ = sim.round(sim.resolve_hparams(sj.hparams(client_lr=0.1)), state, small_data,
                         jr.key(0))  # fmt: skip
    x0 = jax.tree.map(lambda a: np.asarray(a, np.float64), small_problem.params)
    grads = [
        reference_grad(
            small_problem.loss_fn,
            x0,
            small_data.client_examples(i),
            np.ones(int(small_data.counts[i])),
        )  # fmt: skip
        for i in range(small_data.num_clients)
    ]
    mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    assert_trees_close(state.server.control, mean, rtol=1e-5, atol=1e-6)
    # The momentum advanced once, on c: from zero, m = c.
    assert_trees_close(state.server.base_state.trace, mean, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- sweeps, CLI
def test_a_sweep_equals_the_single_runs(small_data, small_problem):
    sim = sj.Simulation(mime(small_problem.loss_fn), small_problem, PLAN, 3)
    hp, seeds, _ = grid(client_lr=[0.03, 0.1], seeds=[0, 1])
    result = sweep(sim, small_data, hp, seeds, num_rounds=3, eval_every=3)
    for j, config in enumerate(result.configs):
        alone = sim.run(small_data, sj.hparams(client_lr=config["client_lr"]), num_rounds=3,
                        eval_every=3, seed=config["seed"])  # fmt: skip
        server = jax.tree.map(lambda a, j=j: a[j], result.server_states)
        assert_trees_close(server.params, alone.state.server.params, rtol=1e-5)
        assert_trees_close(server.base_state, alone.state.server.base_state, rtol=1e-5)
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)


def test_checkpoint_and_resume_continue_the_run_bit_for_bit(small_data, small_problem, tmp_path):
    sim = sj.Simulation(mimelite(small_problem.loss_fn), small_problem, PLAN, 3)
    hp = sj.hparams(client_lr=0.1)
    whole = sim.run(small_data, hp, num_rounds=4, eval_every=2, seed=3)
    sim.run(small_data, hp, num_rounds=2, eval_every=2, seed=3, checkpoint_dir=tmp_path)
    resumed = sim.run(small_data, hp, num_rounds=4, eval_every=2, seed=3,
                      checkpoint_dir=tmp_path, resume=True)  # fmt: skip
    assert resumed.resumed_from == 2
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


TINY = [
    "--dataset", "fashion_mnist", "--max-train-examples", "600", "--max-test-examples", "200",
    "--num-clients", "6", "--clients-per-round", "3", "--rounds", "4", "--eval-every", "2",
    "--quiet",
]  # fmt: skip


@needs_fashion
@pytest.mark.slow  # command-line runs: ~4 s each
@pytest.mark.parametrize("name", ["mime", "mimelite"])
def test_it_runs_from_the_command_line(name, tmp_path):
    out = tmp_path / name
    argv = ["run", "--algorithm", name, "--client-lr", "0.03", "--base-optimizer",
            "momentum:momentum=0.5", *TINY, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == name
    assert saved["options"] == {"base_optimizer": "momentum:momentum=0.5"}
    records = results.read_records(out)
    assert [r["round"] for r in records] == [0, 2, 4]
    assert records[-1]["test_loss"] < records[0]["test_loss"]


def test_a_bad_base_optimizer_is_refused_naming_the_parameter(tmp_path, capsys):
    argv = ["run", "--algorithm", "mime", "--base-optimizer", "momentum:beta=0.9",
            "--rounds", "1", "--out", str(tmp_path / "o"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "base_optimizer = 'momentum:beta=0.9' is invalid" in err
    assert "momentum has no parameter 'beta'; it takes momentum" in err
    assert not (tmp_path / "o").exists()


def test_mime_is_a_valid_method_of_the_table_protocols():
    from scaffold_jax import paper

    protocol = paper.table3_protocol(quick=True, extra_methods=["mime", "feddyn"]).validate()
    methods = [r.method for r in protocol.all_rows]
    assert methods[-2:] == ["mime", "feddyn"] and methods[:4] == [
        "sgd", "scaffold", "fedavg", "fedprox",
    ]  # fmt: skip
    assert protocol.lr_grid("mime") == (0.003, 0.01, 0.03, 0.1, 0.3)
    with pytest.raises(sj.experiments.ConfigError, match="method 'mimee' is unknown"):
        paper.table3_protocol(quick=True, extra_methods=["mimee"]).validate()


def test_the_base_state_is_never_advanced_by_local_steps(small_data, small_problem):
    """Frozen: a client's update depends on s, but s after the round is B.update(c, s)
    whatever the local steps did (a larger η_l changes the model, not s)."""
    sim = sj.Simulation(mime(small_problem.loss_fn), small_problem, PLAN, 3)
    states = []
    for lr in (0.01, 0.3):
        state = sim.init(small_data)
        state, _ = sim.round(sim.resolve_hparams(sj.hparams(client_lr=lr)), state, small_data,
                             jr.key(1))  # fmt: skip
        states.append(state.server)
    assert_trees_close(states[0].base_state, states[1].base_state, rtol=0, atol=0)
    assert not np.allclose(
        np.asarray(jax.tree.leaves(states[0].params)[0]),
        np.asarray(jax.tree.leaves(states[1].params)[0]),
    )
    assert isinstance(states[0].control, dict) and jnp.ndim(jax.tree.leaves(states[0].control)[0])
