"""SCAFFOLD with warm-started controls (option I of Algorithm 1's control update, at x0):
c_i = ∇f_i(x0) for every client
and c = their mean before round 1; the invariant from the start; rounds to a target that
no longer depend on the gradient dissimilarity G; the option in configs and Figure 3."""

import json
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from conftest import assert_trees_close, reference_grad

import scaffold_jax as sj
from scaffold_jax import paper
from scaffold_jax.algorithms import client_controls
from scaffold_jax.cli import main
from scaffold_jax.data import synthetic
from scaffold_jax.experiments import ConfigError, RunConfig

PLAN = sj.BatchPlan.fixed(batch_size=2, num_steps=2)
FASHION = "/usr/share/datasets/fashion-mnist"


def _sim(problem, weighting="uniform", dtype=jnp.float32, chunk="auto"):
    alg = sj.scaffold(problem.loss_fn, control_dtype=dtype, warm_controls=True)
    return sj.Simulation(alg, problem, PLAN, 3, weighting=weighting, client_chunk=chunk)


def _full_gradients(problem, data):
    x0 = jax.tree.map(lambda a: np.asarray(a, np.float64), problem.params)
    return [
        reference_grad(problem.loss_fn, x0, data.client_examples(i), np.ones(int(n)))
        for i, n in enumerate(np.asarray(data.counts))
    ]


@pytest.mark.parametrize(("weighting", "chunk"), [("uniform", "auto"), ("num_examples", 2)])
def test_every_control_starts_at_its_full_gradient_and_c_at_their_mean(
    weighting, chunk, small_data, small_problem
):
    state = _sim(small_problem, weighting, chunk=chunk).init(small_data)
    grads = _full_gradients(small_problem, small_data)
    table = jax.tree.map(lambda *g: np.stack(g), *grads)
    assert_trees_close(client_controls(state.clients), table, rtol=1e-5, atol=1e-6)
    w = np.ones(len(grads)) if weighting == "uniform" else np.asarray(small_data.counts, float)
    mean = jax.tree.map(lambda a: np.tensordot(w, a, axes=1) / w.sum(), table)
    assert_trees_close(state.server.control, mean, rtol=1e-5, atol=1e-6)
    assert int(state.round) == 0
    assert float(np.max(np.abs(jax.tree.leaves(mean)[0]))) > 1e-2  # not trivially zero


def test_cold_controls_start_at_zero(small_data, small_problem):
    state = sj.Simulation(sj.scaffold(small_problem.loss_fn), small_problem, PLAN, 3).init(
        small_data
    )
    assert all(not np.any(np.asarray(a)) for a in jax.tree.leaves(state.server.control))


def test_bfloat16_controls_c_is_the_mean_of_the_stored_values(small_data, small_problem):
    state = _sim(small_problem, dtype=jnp.bfloat16).init(small_data)
    stored = client_controls(state.clients)
    mean = jax.tree.map(lambda a: np.mean(np.asarray(a, np.float64), axis=0), stored)
    assert_trees_close(state.server.control, mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weighting", ["uniform", "num_examples"])
def test_the_invariant_holds_after_every_round(weighting, small_data, small_problem):
    sim = _sim(small_problem, weighting)
    hp = sim.resolve_hparams(sj.hparams(client_lr=0.2))
    w = np.ones(7) if weighting == "uniform" else np.asarray(small_data.counts, np.float64)
    state = sim.init(small_data)
    for _ in range(4):
        state, _ = sim.round(hp, state, small_data, jr.key(3))
        table = client_controls(state.clients)
        mean = jax.tree.map(
            lambda a: np.tensordot(w, np.asarray(a, np.float64), axes=1) / w.sum(), table
        )
        assert_trees_close(state.server.control, mean, rtol=1e-5, atol=1e-6)


def _rounds_to_target(warm: bool, G: float, rounds: int = 40) -> int | None:
    qp = synthetic.figure3_problem(G, seed=0, delta=0.5, mu=0.01, dim=10, start_distance=10.0)
    alg = sj.scaffold(qp.problem.loss_fn, warm_controls=warm)
    sim = sj.Simulation(alg, qp.problem, sj.BatchPlan.full(10), clients_per_round=2)
    result = sim.run(qp.data, sj.hparams(client_lr=1.0), num_rounds=rounds, eval_every=1)
    error = np.array([r["test_loss"] for r in result.records]) - qp.f_star
    reached = np.flatnonzero(error <= 1e-2 * error[0])
    return int(reached[0]) if reached.size else None


def test_warm_rounds_to_the_target_do_not_depend_on_G():
    """On the heterogeneous quadratics of Figure 3 (the Hessians and f fixed, G varied
    through the b_i), warm SCAFFOLD's trajectory never sees the b_i except through ∇f(x0):
    the same number of rounds for G = 1, 10, 100. With zero controls the first rounds are
    FedAvg's, and G shows."""
    warm = [_rounds_to_target(True, G) for G in (1.0, 10.0, 100.0)]
    cold = [_rounds_to_target(False, G) for G in (1.0, 10.0, 100.0)]
    assert warm[0] is not None and warm == [warm[0]] * 3, warm
    assert len(set(cold)) > 1 and min(c or 99 for c in cold[1:]) > warm[0], cold


def test_it_is_a_config_option(tmp_path):
    assert RunConfig(options={"warm_controls": "true"}).resolved_options()["warm_controls"]
    assert RunConfig().resolved_options()["warm_controls"] is False
    with pytest.raises(ConfigError, match="warm_controls = 'maybe' is invalid"):
        RunConfig(options={"warm_controls": "maybe"}).validate()
    with pytest.raises(ConfigError, match="warm_controls = True does not apply to algorithm"):
        RunConfig(algorithm="fedavg", options={"warm_controls": True}).validate()


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_it_is_a_switch_on_the_command_line(tmp_path):
    out = tmp_path / "run"
    argv = [
        "run", "--dataset", "fashion_mnist", "--max-train-examples", "600",
        "--max-test-examples", "200", "--num-clients", "6", "--clients-per-round", "3",
        "--rounds", "2", "--eval-every", "2", "--warm-controls", "--quiet", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["warm_controls"] == "true"
    assert RunConfig.from_dict(config).resolved_options()["warm_controls"] is True


def test_figure3_shows_the_warm_rows_when_asked(tmp_path):
    protocol = paper.fig3_protocol(
        quick=True,
        gradient_dissimilarities=[1.0, 100.0],
        local_steps=[10],
        methods=["scaffold"],
        lr_grid=[1.0, 0.5],
        num_rounds=40,
        warm_controls=True,
    )
    summary = paper.reproduce_fig3(protocol, tmp_path / "fig3", quiet=True)
    cells = {(c["warm_controls"], c["G"]): c["rounds"] for c in summary["cells"]}
    assert cells[(True, 1.0)] == cells[(True, 100.0)]
    assert cells[(False, 100.0)] > cells[(True, 100.0)]
    table = (tmp_path / "fig3" / "fig3.md").read_text()
    assert "| SCAFFOLD (warm c) | 10 |" in table
