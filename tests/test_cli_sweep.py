"""`scaffold-jax sweep` over any declared hyper-parameter (vmapped) and over data / shape
settings (an outer product of programs): each config equals its own run, the tidy
sweep.csv, the edge-of-grid warning, the partition seed apart from the run seeds, and
one named error per kind of bad grid."""

import csv
import json
import os
import re

import numpy as np
import pytest

from scaffold_jax import experiments, results
from scaffold_jax.cli import build_parser, main

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)

TINY = """
dataset = "fashion_mnist"
max_train_examples = 500
max_test_examples = 200
num_clients = 5
clients_per_round = 3
local_epochs = 1
client_lr = 0.1
rounds = 4
eval_every = 2
"""


def _config_file(tmp_path, text=TINY):
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return str(path)


def _rows(folder):
    with open(folder / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow  # one vmapped program and one single-run program: ~5 s on 2 cores
@needs_fashion
def test_a_grid_over_two_declared_hparams_equals_each_config_run_alone(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", _config_file(tmp_path), "--algorithm", "fedprox",
            "--grid", "server_lr=0.5,1", "--grid", "prox_mu=0.01,0.1", "--seeds", "0", "3",
            "--target", "0.3", "--out", str(out), "--no-checkpoint", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    rows = _rows(out)
    assert [(float(r["server_lr"]), float(r["prox_mu"]), int(r["seed"])) for r in rows] == [
        (lr, mu, seed) for lr in (0.5, 1.0) for mu in (0.01, 0.1) for seed in (0, 3)
    ]
    # Each config alone, as `scaffold-jax run --seed S --partition-seed 0` builds it (the
    # sweep's data comes from --seed 0; logreg's initial params do not depend on the seed).
    base = experiments.RunConfig.from_dict(
        {**experiments.load_config_file(_config_file(tmp_path)), "algorithm": "fedprox"}
    )
    built = experiments.build(base.replace(seed=3, partition_seed=0))
    for row in rows:
        config = base.replace(
            server_lr=float(row["server_lr"]), hparams={"prox_mu": float(row["prox_mu"])}
        )
        alone = built.simulation.run(
            built.data, config.resolved_hparams(), num_rounds=4, eval_every=2, seed=int(row["seed"])
        )
        final = alone.records[-1]
        for name in ("test_accuracy", "test_loss", "train_loss"):
            np.testing.assert_allclose(float(row[f"final_{name}"]), final[name], rtol=2e-5)
        assert row["rounds_to_target"] == str(results.rounds_to_target(alone.records, 0.3) or "")
    # The seeds differ, so the sweep really ran four configs per seed, not one.
    assert len({r["final_test_loss"] for r in rows}) == 8
    summary = json.loads((out / "summary.json").read_text())
    assert summary["edge_of_grid"] == json.loads((out / "sweep.json").read_text())["edge_of_grid"]


@pytest.mark.slow  # two programs (one per similarity): ~6 s on 2 cores
@needs_fashion
def test_an_outer_axis_over_a_data_setting_runs_one_program_per_value(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", _config_file(tmp_path), "--algorithms", "sgd",
            "--lr-grid", "0.001", "0.3", "1e38", "--grid", "similarity=0,100", "--seeds", "0", "1",
            "--target", "0.3", "--out", str(out), "--no-checkpoint"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    record = json.loads((out / "sweep.json").read_text())
    assert list(record["results"]) == ["sgd similarity=0", "sgd similarity=100"]
    assert record["settings"] == {"sgd similarity=0": {"similarity": 0.0},
                                  "sgd similarity=100": {"similarity": 100.0}}  # fmt: skip
    # A program run per setting (the two splits' equal shapes share one compilation).
    for key in ("sgd similarity=0", "sgd similarity=100"):
        assert printed.err.count(f"\n{key}: 6 config(s) x 4 rounds in ") == 1
    rows = _rows(out)
    assert len(rows) == 2 * 3 * 2  # settings × η_l × seeds
    assert len({(r["similarity"], r["client_lr"], r["seed"]) for r in rows}) == len(rows)
    # Each setting's data is its own: the same config trains differently on each split.
    by = {(r["similarity"], r["client_lr"], r["seed"]): r for r in rows}
    assert (
        by[("0.0", "0.3", "0")]["final_train_loss"] != by[("100.0", "0.3", "0")]["final_train_loss"]
    )
    # 1e38 diverges and 0.001 barely moves: 0.3, inside the grid, is chosen, no warning.
    assert [r["client_lr"] for r in rows if r["chosen"] == "True"] == ["0.3"] * 4
    assert {r["status"] for r in rows if r["client_lr"] == "1e+38"} == {"diverged"}
    assert record["edge_of_grid"] == [] and "warning" not in printed.err
    assert "edge of their grid" not in (out / "summary.md").read_text()


# ----------------------------------------------------------------------------- pieces
class _Grid:
    """What results.grid_edges and sweep_table read of a SweepResult."""

    def __init__(self, algorithm, configs, finals, diverged_round=None):
        self.algorithm, self.configs = algorithm, configs
        self.records = [
            [{"round": 0, "test_accuracy": 0.1, "status": "ok"},
             {"round": 5, "test_accuracy": acc, "test_loss": 1.0 - acc, "status": "ok"}]
            for acc in finals
        ]  # fmt: skip
        self.diverged_round = np.asarray(diverged_round or [-1] * len(configs))


def test_grid_edges_fire_at_either_end_and_never_inside_or_on_one_value():
    configs = [{"client_lr": lr, "server_lr": 1.0, "seed": 0} for lr in (0.1, 0.3, 1.0)]
    for finals, expected in (((0.9, 0.5, 0.4), "smallest"), ((0.4, 0.5, 0.9), "largest")):
        sweep = {"a": _Grid("a", configs, finals)}
        edges = results.grid_edges(sweep, results.summarize(sweep, 0.8))
        # server_lr has one value: never an edge.
        assert [(e["name"], e["edge"], e["grid"]) for e in edges] == [
            ("client_lr", expected, [0.1, 0.3, 1.0])
        ]
    inside = {"a": _Grid("a", configs, (0.4, 0.9, 0.5))}
    assert results.grid_edges(inside, results.summarize(inside, 0.8)) == []


def test_a_grid_edge_at_the_smallest_value_suggests_only_allowed_values():
    """Every hyper-parameter is >= 0 (step sizes > 0): below the smallest value of a grid
    the warning suggests smaller positive values, and at 0 itself values between 0 and
    the next one, never "below 0"."""

    def warning(name, grid, finals):
        configs = [{"client_lr": 0.1, name: v, "seed": 0} for v in grid]
        sweep = {"a": _Grid("a", configs, finals)}
        (edge,) = results.grid_edges(sweep, results.summarize(sweep, 0.8))
        assert (edge["name"], edge["edge"]) == (name, "smallest")
        line = results.format_grid_edge(edge)
        suggested = [float(v) for v in re.search(r"\(e\.g\. ([^)]*)\)", line)[1].split(", ")]
        return line, suggested

    line, suggested = warning("server_momentum", [0.0, 0.5, 0.9], (0.9, 0.5, 0.4))
    assert "below 0" not in line and "0 is also the smallest value allowed" in line
    assert "between 0 and 0.5" in line and all(0 < v < 0.5 for v in suggested)
    line, suggested = warning("client_lr", [0.03, 0.1, 0.3], (0.9, 0.5, 0.4))
    assert "extend the grid below 0.03 with smaller positive values" in line
    assert all(0 < v < 0.03 for v in suggested)


def test_sweep_table_is_tidy_one_row_per_config_and_seed():
    fedprox = [{"client_lr": 0.1, "prox_mu": mu, "seed": s} for mu in (0.01, 0.1) for s in (0, 1)]
    sgd = [{"client_lr": 0.1, "seed": s} for s in (0, 1)]
    sweeps = {
        "fedprox similarity=0": _Grid("fedprox", fedprox, (0.9, 0.8, 0.5, 0.6)),
        "sgd similarity=0": _Grid("sgd", sgd, (0.5, 0.9), diverged_round=[3, -1]),
    }
    settings = {key: {"similarity": 0.0} for key in sweeps}
    rows = results.sweep_table(sweeps, 0.7, settings)
    assert len(rows) == 6
    assert all(list(r) == list(rows[0]) for r in rows)  # the same columns, in one order
    assert list(rows[0])[:5] == ["algorithm", "similarity", "client_lr", "prox_mu", "seed"]
    assert [r["prox_mu"] for r in rows] == [0.01, 0.01, 0.1, 0.1, None, None]
    assert [r["rounds_to_target"] for r in rows] == [5, 5, None, None, None, 5]
    # sgd has one group (its seeds): chosen, even with a diverged seed.
    assert [r["chosen"] for r in rows] == [True, True, False, False, True, True]
    assert [r["diverged_round"] for r in rows[4:]] == [3, None]
    assert rows[0]["final_test_accuracy"] == 0.9 and rows[0]["best_test_accuracy"] == 0.9
    text = results.csv_text(rows)
    assert text.splitlines()[0].startswith("algorithm,similarity,client_lr,prox_mu,seed,")
    assert len(text.splitlines()) == 7 and ",," in text.splitlines()[5]  # blanks for None


@needs_fashion
def test_the_partition_seed_alone_decides_the_data():
    base = experiments.RunConfig.from_dict(
        {"max_train_examples": 300, "max_test_examples": 50, "num_clients": 4}
    )

    def fingerprint(**changes):
        return experiments.data_fingerprint(experiments.build(base.replace(**changes)).data)

    assert fingerprint(seed=5, partition_seed=0) == fingerprint(seed=0)
    assert fingerprint(seed=0, partition_seed=1) == fingerprint(seed=1)
    assert fingerprint(seed=0, partition_seed=1) != fingerprint(seed=0)


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"scaffold-jax {name} {action.option_strings} has no help"
    sweep_help = " ".join(commands.choices["sweep"].format_help().split())
    assert "do NOT re-partition" in sweep_help and "--partition-seed" in sweep_help


@pytest.mark.parametrize(
    "grid, message",
    [
        (["prox_mu=0.1"], "--grid prox_mu: no algorithm of this sweep (scaffold) declares the "
         "hyper-parameter prox_mu (fedprox does); add one with --algorithms or remove the axis."),
        (["server_rl=0.5,1"], "--grid server_rl: unknown name 'server_rl' (did you mean "
         "'server_lr'?). An axis is a hyper-parameter an algorithm of this sweep (scaffold) "
         "declares: client_lr, server_lr; or a data / shape setting: "),
        (["server_lr=0.5,big"], "--grid 'server_lr=0.5,big': 'big' is not a number; every "
         "value of an axis must be one (e.g. --grid server_lr=0.5,1)."),
        (["server_lr="], "--grid 'server_lr=' has no values: list at least one after '='"),
        (["server_lr=0.5,,1"], "--grid 'server_lr=0.5,,1' has an empty value"),
        (["server_lr"], "--grid 'server_lr' is invalid: it must be NAME=V1,V2,..."),
        (["server_lr=1,1"], "--grid 'server_lr=1,1' repeats 1: give each value once"),
        (["server_lr=1", "server_lr=2"], "--grid server_lr is given twice"),
        (["local_epochs=1,1.5"], "--grid local_epochs: local_epochs takes integers; 1.5 is "
         "not one."),
        (["seed=0,1"], "--grid seed: seed is not an axis of a sweep: the run seeds are --seeds; "
         "--grid partition_seed=... re-partitions the data."),
        (["similarity=0,200"], "similarity = 200.0 is invalid: it must be a percentage in "
         "[0, 100]"),
        (["server_lr=0.5,-1"], "server_lr = -1.0 is invalid"),
    ],
)  # fmt: skip
def test_bad_grids_are_named_errors_before_anything_runs(tmp_path, capsys, grid, message):
    out = tmp_path / "o"
    argv = ["sweep", "--out", str(out), "--quiet"]
    for item in grid:
        argv += ["--grid", item]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before any data is read or any folder written
