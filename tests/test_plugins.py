"""An algorithm defined outside the package (tests/plugins/damped_fedavg.py) runs like a
built-in one: in Simulation, in a sweep over its own hyper-parameter, and from
`scaffold-jax run` / `scaffold-jax sweep` with --plugin. None of the package names it."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import assert_trees_close

import scaffold_jax as sj
from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.cli import main
from scaffold_jax.registry import load_plugins
from scaffold_jax.sweep import grid, sweep

PLUGIN = str(Path(__file__).parent / "plugins" / "damped_fedavg.py")
FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)


@pytest.fixture(scope="module")
def damped():
    load_plugins([PLUGIN])
    return ALGORITHMS["damped_fedavg"]


def _sim(algorithm, problem):
    return sj.Simulation(algorithm, problem, sj.BatchPlan.epochs(batch_size=3, num_epochs=1), 3)


def test_the_plugin_registers_its_algorithm_and_hyper_parameter(damped):
    assert damped.display_name == "FedAvg (damped)"
    assert list(damped.hparams) == ["client_lr", "server_lr", "damping"]
    assert damped.hparams["damping"].default == 0.5
    # Loading it again (same file) keeps one entry.
    load_plugins([PLUGIN])
    assert list(ALGORITHMS).count("damped_fedavg") == 1


def test_in_a_simulation_it_equals_fedavg_with_a_scaled_server_step(
    damped, small_data, small_problem
):
    plugin = _sim(damped.build(small_problem.loss_fn), small_problem)
    mine = plugin.run(small_data, {"client_lr": 0.3, "damping": 0.25}, num_rounds=4, seed=2)
    fedavg = _sim(sj.fedavg(small_problem.loss_fn), small_problem)
    theirs = fedavg.run(small_data, sj.hparams(client_lr=0.3, server_lr=0.75), num_rounds=4, seed=2)
    np.testing.assert_array_equal(mine.client_ids, theirs.client_ids)
    assert_trees_close(mine.state.server.params, theirs.state.server.params, rtol=1e-6)
    # Its declared default applies when the hyper-parameter is not given ...
    default = plugin.run(small_data, sj.hparams(client_lr=0.3), num_rounds=4, seed=2)
    half = fedavg.run(small_data, sj.hparams(client_lr=0.3, server_lr=0.5), num_rounds=4, seed=2)
    assert_trees_close(default.state.server.params, half.state.server.params, rtol=1e-6)
    # ... and a name it does not declare is refused, naming what it takes.
    with pytest.raises(ValueError, match="does not take the hyper-parameter.* prox_mu.*damping"):
        plugin.run(small_data, sj.hparams(client_lr=0.3, prox_mu=1.0), num_rounds=1)
    with pytest.raises(ValueError, match="damping=-1 is invalid"):
        plugin.run(small_data, {"client_lr": 0.3, "damping": -1.0}, num_rounds=1)


def test_a_sweep_over_its_own_hyper_parameter_equals_the_single_runs(
    damped, small_data, small_problem
):
    sim = _sim(damped.build(small_problem.loss_fn), small_problem)
    hp, seeds, _ = grid(client_lr=0.3, damping=[0.0, 0.5, 0.9], seeds=[0, 1])
    result = sweep(sim, small_data, hp, seeds, num_rounds=3, eval_every=1)
    assert [c["damping"] for c in result.configs] == [0.0, 0.0, 0.5, 0.5, 0.9, 0.9]
    for j, config in enumerate(result.configs):
        alone = sim.run(
            small_data,
            {"client_lr": 0.3, "damping": config["damping"]},
            num_rounds=3,
            eval_every=1,
            seed=config["seed"],
        )
        server = jax.tree.map(lambda a: a[j], result.server_states.params)
        assert_trees_close(server, alone.state.server.params, rtol=1e-5)
        np.testing.assert_array_equal(result.client_ids[j], alone.client_ids)


TINY = [
    "--dataset", "fashion_mnist", "--max-train-examples", "600", "--max-test-examples", "200",
    "--num-clients", "6", "--clients-per-round", "3", "--local-epochs", "1",
    "--rounds", "4", "--eval-every", "2", "--quiet",
]  # fmt: skip


@pytest.mark.slow  # a run and a sweep from the command line: ~10 s
@needs_fashion
def test_from_the_command_line_run_and_sweep(tmp_path):
    base = ["--plugin", PLUGIN, "--algorithm", "damped_fedavg", *TINY]
    # The plugin's own hyper-parameter is a flag once the plugin is loaded.
    assert main(["run", *base, "--damping", "0.25", "--out", str(tmp_path / "run")]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["algorithm"] == "damped_fedavg" and saved["hparams"] == {"damping": 0.25}
    assert saved["plugins"] == [PLUGIN]
    records = results.read_records(tmp_path / "run")
    assert [r["round"] for r in records] == [0, 2, 4]
    # The same run as FedAvg with η_g = 0.75: the same accuracy curve.
    fedavg = ["--algorithm", "fedavg", *TINY, "--server-lr", "0.75"]
    assert main(["run", *fedavg, "--out", str(tmp_path / "fedavg")]) == 0
    theirs = results.read_records(tmp_path / "fedavg")
    np.testing.assert_allclose(
        [r["test_loss"] for r in records], [r["test_loss"] for r in theirs], rtol=1e-5
    )
    # The written config.json resumes the plugin by itself (its `plugins` key) with --set.
    again = ["run", "--config", str(tmp_path / "run" / "config.json"), "--set", "damping=0.5"]
    assert main([*again, "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text())["hparams"] == {
        "damping": 0.5
    }
    # A sweep over the plugin's hyper-parameter, written as it goes.
    sweep_argv = ["sweep", *base, "--grid", "damping=0,0.5", "--seeds", "0", "1"]
    assert main([*sweep_argv, "--out", str(tmp_path / "sweep"), "--target", "0.3"]) == 0
    swept = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    configs = swept["results"]["damped_fedavg"]["configs"]
    assert sorted({c["damping"] for c in configs}) == [0.0, 0.5] and len(configs) == 4
    assert len(results.read_records(tmp_path / "sweep")) == 4 * 3  # every record, as it went


def test_unknown_plugins_and_algorithms_are_named_errors(tmp_path, capsys):
    assert main(["run", "--plugin", "no_such_module_xyz", "--out", str(tmp_path / "o")]) == 2
    assert "plugin 'no_such_module_xyz' cannot be imported" in capsys.readouterr().err
    assert main(["run", "--algorithm", "damped_fedavgg", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    # One line with the hint; how plugins register is in --plugin's help, not repeated.
    assert "algorithm = 'damped_fedavgg' is invalid" in err
    assert "(did you mean 'damped_fedavg'?)" in err and len(err.strip().splitlines()) == 1
