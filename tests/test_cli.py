"""The `scaffold-jax` command: help, `run` end to end, config errors, and the quick
paper protocols, whose numbers must show the paper's findings."""

import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from scaffold_jax import results
from scaffold_jax.cli import main

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)

TINY = """
algorithm = "scaffold"
dataset = "fashion_mnist"
max_train_examples = 2000
max_test_examples = 500
num_clients = 10
clients_per_round = 5
local_epochs = 1
client_lr = 0.1
rounds = 10
eval_every = 2
targets = [0.3, 0.99]
"""


# ----------------------------------------------------------------------------- help
@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["reproduce", "--help"]])
def test_help_works(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: scaffold-jax" in out
    if argv == ["run", "--help"]:
        assert "--client-lr" in out and "--similarity" in out and "--config" in out
    if argv == ["reproduce", "--help"]:
        assert "fig3" in out and "table3" in out and "--quick" in out


@pytest.mark.slow
@needs_fashion
def test_a_resumed_run_shows_each_round_once_in_tensorboard(tmp_path):
    """Records after the newest checkpoint are written again by the resumed run: the
    resume purges them from TensorBoard (its SessionLog.START), as metrics.jsonl drops them."""
    pytest.importorskip("tensorboardX")
    import shutil

    from test_results import read_tensorboard_scalars

    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "run"
    argv = ["run", "--config", str(config), "--rounds", "4", "--eval-every", "1",
            "--checkpoint-every", "2", "--tensorboard", "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    # As if killed after round 4's record, before its checkpoint: resume from round 2.
    shutil.rmtree(out / "checkpoints" / "4")
    assert main([*argv, "--resume"]) == 0
    rounds = [r["round"] for r in results.read_records(out)]
    assert rounds == [0, 1, 2, 3, 4]
    shown = read_tensorboard_scalars(out / "tensorboard")["test_accuracy"]
    assert [step for step, _ in shown] == rounds
    np.testing.assert_allclose(
        [v for _, v in shown], [r["test_accuracy"] for r in results.read_records(out)], rtol=1e-6
    )


def test_the_console_script_is_installed():
    # pyproject.toml declares scaffold-jax = "scaffold_jax.cli:main".
    script = os.path.join(os.path.dirname(sys.executable), "scaffold-jax")
    if not os.path.exists(script):
        pytest.skip("package not installed as a script in this environment")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "reproduce" in proc.stdout


# ----------------------------------------------------------------------------- run
@needs_fashion
def test_run_end_to_end_writes_every_file(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "run"
    argv = ["run", "--config", str(config), "--rounds", "6", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    files = {p.name for p in out.iterdir()}
    assert {
        "config.json", "metrics.jsonl", "summary.json", "metrics.csv", "accuracy.png", "loss.png",
        "accuracy_vs_uplink.png",
    } <= files  # fmt: skip
    saved = json.loads((out / "config.json").read_text())
    assert saved["rounds"] == 6 and saved["client_lr"] == 0.1  # the flag beat the file
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["dataset"] == "fashion_mnist"
    assert summary["rounds_to_target"]["0.99"] is None
    assert summary["compile_seconds"] > 0 and summary["run_seconds"] > 0
    assert summary["environment"]["jax"]
    assert [r["round"] for r in results.read_records(out)] == [0, 2, 4, 6]
    printed = capsys.readouterr()
    assert printed.out == "" and "round" not in printed.err and "loading" not in printed.err

    # A finished run's folder is refused without --overwrite ...
    assert main(argv) == 1
    assert "already holds a finished run" in capsys.readouterr().err
    # ... and replaced with it; without --quiet, progress on stderr (not a terminal here:
    # plain lines), one per evaluation, after a line for loading and one per compilation.
    loud = [a for a in argv if a != "--quiet"]
    if importlib.util.find_spec("tensorboardX"):
        loud.append("--tensorboard")
    assert main([*loud, "--overwrite", "--algorithm", "fedavg", "--client-lr", "1.0"]) == 0
    assert json.loads((out / "config.json").read_text())["algorithm"] == "fedavg"
    printed, err = capsys.readouterr()
    # The summary names the algorithm's own hyper-parameters only (no μ for FedAvg).
    assert "hyper-parameters: client_lr=1.0, server_lr=1.0\n" in printed
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["fedavg"]["hparams"] == {"client_lr": 1.0, "server_lr": 1.0}
    if "--tensorboard" in loud:  # the event files hold every record's metrics
        from test_results import read_tensorboard_scalars

        scalars = read_tensorboard_scalars(out / "tensorboard")
        for name in ("test_accuracy", "test_loss", "train_loss"):
            assert scalars[name] == [
                (r["round"], float(np.float32(r[name]))) for r in results.read_records(out)
            ]
    err = err.splitlines()
    assert err[0] == "loading fashion_mnist and building the run..."
    assert err[1].startswith("loading fashion_mnist and building the run: ")
    assert any(line.startswith("compiling 2 rounds as one program: ") for line in err)
    rounds = [line for line in err if line.startswith("fedavg: round ")]
    assert [line.split()[2] for line in rounds] == ["2/6", "4/6", "6/6"]
    assert all("elapsed" in line and "acc=" in line for line in rounds)
    # The rate counts from the first block on: the first line has none (its block holds
    # the one-off costs of the first execution and checkpoint), the others do.
    assert ["ETA" in line for line in rounds] == [False, True, True]


@pytest.mark.parametrize(
    "text, suffix, message",
    [
        (
            "algoritm = 'sgd'\n",
            ".toml",
            "unknown config key 'algoritm' (did you mean 'algorithm'?)",
        ),
        (
            '{"num_clients": -3}',
            ".json",
            "num_clients = -3 is invalid: it must be an integer in [1, 2147483647]",
        ),
        ("rounds = 0\nclient_lr = -0.1\n", ".toml", "rounds = 0 is invalid"),
        (
            "similarity = 200\n",
            ".toml",
            "similarity = 200 is invalid: it must be a percentage in [0, 100]",
        ),
    ],
)
def test_bad_configs_are_named_errors(tmp_path, capsys, text, suffix, message):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "o").exists()  # nothing written for an invalid config


def test_bad_flags_are_named_errors(tmp_path, capsys):
    assert main(["run", "--client-fraction", "1.5", "--out", str(tmp_path / "o")]) == 2
    assert "client_fraction = 1.5 is invalid: it must be in (0, 1]" in capsys.readouterr().err
    assert main(["run", "--config", str(tmp_path / "none.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--rounds", "ten"])
    assert exit_.value.code == 2
    assert main(["reproduce", "fig3", "--set", "horizon=3", "--out", str(tmp_path / "f")]) == 2
    assert "unknown protocol field" in capsys.readouterr().err


# ----------------------------------------------------------------------------- fig3
@pytest.mark.slow
def test_reproduce_fig3_quick_shows_the_papers_findings(tmp_path, capsys):
    out = tmp_path / "fig3"
    assert main(["reproduce", "fig3", "--quick", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")  # --quiet: no table, no progress
    summary = json.loads((out / "summary.json").read_text())
    horizon = summary["runs"][next(iter(summary["runs"]))].get("last_round", 150)

    def rounds(method, k, g):
        (cell,) = [
            c for c in summary["cells"]
            if c["method"] == method and c["local_steps"] == k and c["G"] == g
        ]  # fmt: skip
        return math.inf if cell["rounds"] is None else cell["rounds"]

    gs = (1.0, 10.0, 100.0)
    sgd = rounds("sgd", None, 1.0)
    assert sgd < math.inf and all(rounds("sgd", None, g) == sgd for g in gs)  # GD ignores G
    # FedAvg gets slower as G grows ...
    for k in (2, 10):
        assert rounds("fedavg", k, 1.0) < rounds("fedavg", k, 10.0) <= rounds("fedavg", k, 100.0)
    # ... and as K grows; it is competitive with SGD only at G = 1.
    for g in gs:
        assert rounds("fedavg", 10, g) >= rounds("fedavg", 2, g)
    assert rounds("fedavg", 10, 1.0) > rounds("fedavg", 2, 1.0)
    assert rounds("fedavg", 2, 1.0) <= 1.25 * sgd
    assert rounds("fedavg", 2, 100.0) > 2 * sgd
    # SCAFFOLD: rounds to the target vary little with G, and it beats SGD, by more at K = 10
    # (the paper: about 2x at K = 2 and 5x at K = 10).
    for k in (2, 10):
        values = [rounds("scaffold", k, g) for g in gs]
        assert max(values) < math.inf and max(values) <= 1.6 * min(values), values
    assert all(rounds("scaffold", 10, g) < rounds("scaffold", 2, g) for g in gs)
    assert sgd / max(rounds("scaffold", 2, g) for g in gs) >= 1.5
    assert sgd / max(rounds("scaffold", 10, g) for g in gs) >= 3.0
    # The outputs: the table (with speed-ups over SGD), the figure, every record.
    table = (out / "fig3.md").read_text()
    assert "| method | K | G = 1 | G = 10 | G = 100 |" in table and "×)" in table
    assert f"{horizon}+" in table  # FedAvg at G = 100 never gets there
    assert (out / "fig3.png").read_bytes()[:4] == b"\x89PNG"
    records = results.read_records(out)
    assert {"error", "relative_error", "client_lr", "G"} <= set(records[-1])


# ----------------------------------------------------------------------------- table3
@pytest.mark.slow  # the real table in ~70 s; test_experiments runs tables in memory
@needs_fashion
def test_reproduce_table3_quick_on_fashion_mnist(tmp_path, capsys):
    out = tmp_path / "table3"
    argv = ["reproduce", "table3", "--quick", "--dataset", "fashion_mnist", "--out", str(out)]
    assert main(argv) == 0
    printed, err = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dataset"] == "fashion_mnist"
    assert json.loads((out / "config.json").read_text())["dataset"] == "fashion_mnist"
    target = summary["target"]
    assert target == 0.7
    # Progress in rounds over every cell (plain lines: stderr is not a terminal here),
    # after the data; a line per finished cell.
    err = err.splitlines()
    assert err[0] == "loading fashion_mnist and building SGD E=1 s=0%..."
    cells_done = [line for line in err if " E=1 s=0%: " in line and "rounds in" in line]
    assert [line.split(":")[0] for line in cells_done] == [
        "SGD E=1 s=0%", "SCAFFOLD E=1 s=0%", "FedAvg E=1 s=0%", "FedProx E=1 s=0%"
    ]  # fmt: skip
    rounds = [line for line in err if line.startswith("table3: round ")]
    assert rounds[-1].split()[2] == "240/240" and "ETA" in rounds[-1]
    assert len(rounds) <= 10 + 4  # a line a tenth (and a cell's first), not one a record
    # The plan before anything compiles; after each cell but the last, the time left
    # (scaffold_jax.experiments.cost, tested in test_cost.py).
    plan = "table3: plan: 4 cell(s), 6 config(s) x 60 rounds = 360 config-rounds"
    assert [line.startswith(plan) for line in err].index(True) < err.index(
        "compiling the evaluation..."
    )
    lefts = [line.partition(" compile)")[2] for line in cells_done]
    assert all(re.fullmatch(r"; about .+ left for [321] cell\(s\)", t) for t in lefts[:3])
    assert lefts[3] == ""
    cells = {c["method"]: c for c in summary["cells"]}
    assert set(cells) == {"sgd", "scaffold", "fedavg", "fedprox"}
    assert all(c["similarity"] == 0.0 and c["epochs"] == 1 for c in cells.values())
    # At 0% similarity SCAFFOLD reaches the target in fewer rounds than FedAvg (and SGD).
    scaffold = cells["scaffold"]["rounds"]
    assert scaffold is not None
    for other in ("fedavg", "sgd"):
        rounds = cells[other]["rounds"]
        assert rounds is None or scaffold < rounds, (other, rounds, scaffold)
    # The table: the paper's layout, the dataset named, chosen step sizes, the wall time.
    table = (out / "table3.md").read_text()
    assert table in printed
    assert "— fashion_mnist" in table and "rounds to 0.7 test accuracy" in table
    lines = table.splitlines()
    assert "| method | epochs | 0% |" in lines
    assert any(line.startswith("| SCAFFOLD | 1 | ") and "×)" in line for line in lines)
    assert any(line.startswith("| SGD | 1 | ") and "(1.0×)" in line for line in lines)
    assert "Chosen η_l" in table and "Wall time:" in table
    assert summary["wall_seconds_total"] > 0
    assert {"accuracy.png", "loss.png", "metrics.csv", "table3.md"} <= set(summary["files"])


# ----------------------------------------------------------------------------- sweep
@pytest.mark.slow
@needs_fashion
def test_sweep_writes_per_config_records_and_the_best_step_size(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(config), "--algorithms", "scaffold", "fedavg",
            "--lr-grid", "0.1", "0.001", "--seeds", "0", "1", "--target", "0.3",
            "--out", str(out)]  # fmt: skip
    tensorboard = importlib.util.find_spec("tensorboardX") is not None
    assert main([*argv, "--tensorboard"] if tensorboard else argv) == 0
    if tensorboard:  # a TensorBoard run per config (overlaid on one chart), plain tags
        from test_results import read_tensorboard_runs

        runs = read_tensorboard_runs(out / "tensorboard")
        records = results.read_records(out)
        assert len(runs) == 8 and set(runs) == {r["series"] for r in records}
        assert "fedavg client_lr=0.1 server_lr=1 seed=1" in runs
        metrics = ("test_accuracy", "test_loss", "train_loss", "local_loss", "client_drift",
                   "bytes_down", "bytes_up", "bytes_down_total", "bytes_up_total")  # fmt: skip
        for series, scalars in runs.items():
            assert set(scalars) == {*metrics, "seconds"}
            for metric in metrics:  # every record's value at its round (round 0 has no
                # local_loss or client_drift: no local step has run)
                assert scalars[metric] == [
                    (r["round"], float(np.float32(r[metric])))
                    for r in records
                    if r["series"] == series and metric in r
                ]
    # Progress over both algorithms' rounds, a line per evaluation (stderr is no terminal).
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "loading fashion_mnist and building scaffold..."
    swept = [line for line in err if line.startswith("sweep: round ")]
    assert [line.split()[2] for line in swept] == [f"{r}/20" for r in range(2, 21, 2)]
    assert "scaffold [1/2]" in swept[0] and "fedavg [2/2]" in swept[-1]
    # Each cell's first line has no rate yet (its compilation and first block), the rest do.
    assert ["ETA" in line for line in swept] == [False, *[True] * 4, False, *[True] * 4]
    # The first cell's phases in full; the next cell's only when they take a second.
    compiled = [line for line in err if line.startswith("compiling") and line.endswith(" s")]
    assert 2 <= len(compiled) <= 4
    assert {"sweep.json", "summary.md", "rounds_to_target.png", "best_curves.png"} <= {
        p.name for p in out.iterdir()
    }
    record = json.loads((out / "sweep.json").read_text())
    for name in ("scaffold", "fedavg"):
        res = record["results"][name]
        assert [(c["client_lr"], c["seed"]) for c in res["configs"]] == [
            (0.1, 0), (0.1, 1), (0.001, 0), (0.001, 1)
        ]  # fmt: skip
        assert [len(r) for r in res["records"]] == [6] * 4  # rounds 0, 2, ..., 10
        assert res["diverged_round"] == [-1] * 4
        # η_l = 0.001 barely moves the model: the paper's criterion must pick 0.1.
        assert record["summary"][name]["best"]["hparams"]["client_lr"] == 0.1
    assert "| scaffold |" in (out / "summary.md").read_text()
    # η_l = 0.1 is the largest value of its grid: the optimum may lie beyond, and the
    # sweep says so (even with --quiet) in the summary too.
    edges = [
        f"{name}: the chosen client_lr = 0.1 is the largest value of its grid (0.001, 0.1); "
        "the best value may lie above it: extend the grid above 0.1."
        for name in ("scaffold", "fedavg")
    ]
    assert [line for line in err if line.startswith("warning: ")] == [
        f"warning: {line}" for line in edges
    ]
    assert json.loads((out / "summary.json").read_text())["edge_of_grid"] == edges
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["algorithm"], r["client_lr"], r["seed"], r["chosen"]) for r in rows] == [
        (name, lr, seed, str(lr == "0.1"))
        for name in ("scaffold", "fedavg") for lr in ("0.1", "0.001") for seed in ("0", "1")
    ]  # fmt: skip
    # What reaching the target sent: the cumulative uplink at its round, SCAFFOLD twice
    # FedAvg's per round (Δy_i and Δc_i).
    for r in rows:
        if r["rounds_to_target"]:
            per_round = float(r["final_bytes_up_total"]) / float(r["rounds"])
            assert float(r["bytes_up_to_target"]) == per_round * int(r["rounds_to_target"])
    ratio = {r["algorithm"]: float(r["final_bytes_up"]) for r in rows}
    assert ratio["scaffold"] == 2 * ratio["fedavg"]
    argv.append("--quiet")
    assert main(argv) == 1  # a finished sweep is not overwritten silently
    assert "already holds a finished run" in capsys.readouterr().err


@needs_fashion
def test_sweep_json_is_strict_json_when_a_config_diverges(tmp_path, capsys):
    """A diverged config's losses are NaN: sweep.json writes them as null, so a strict
    parser (one that refuses NaN / Infinity tokens) reads the file."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.replace("rounds = 10", "rounds = 4"))
    out = tmp_path / "sweep"
    argv = ["sweep", "--config", str(config), "--lr-grid", "0.1", "1e38", "--target", "0.3",
            "--out", str(out), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    text = (out / "sweep.json").read_text()

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    record = json.loads(text, parse_constant=refuse)
    res = record["results"]["scaffold"]
    assert res["diverged_round"][0] == -1 and res["diverged_round"][1] >= 1
    assert None in [r.get("test_loss") for r in res["records"][1]]  # NaN written as null
    assert all(isinstance(r["test_loss"], float) for r in res["records"][0])
    # --quiet: no table, no progress; a warning (η_l = 0.1 at the edge of its grid) stays.
    out, err = capsys.readouterr()
    assert out == "" and [line.split(":")[0] for line in err.splitlines()] == ["warning"]


@pytest.mark.parametrize("terminated", ["run_terminated", "sigterm_exit"])
def test_sigterm_prints_one_line_and_exits_143(monkeypatch, capsys, terminated):
    from scaffold_jax import cli
    from scaffold_jax.loop import RunTerminated

    def stopped(args):
        if terminated == "run_terminated":
            raise RunTerminated("SIGTERM received: stopped after round 4 (no checkpoint_dir, "
                                "nothing saved).", result=None)  # fmt: skip
        raise SystemExit(143)  # SIGTERM outside a running loop (sigterm_exits)

    monkeypatch.setattr(cli, "_run_command", stopped)
    assert main(["run", "--quiet"]) == 143
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "scaffold-jax: terminated (SIGTERM); finished records are kept"
    )
    if terminated == "run_terminated":
        assert err[0].endswith("(SIGTERM received: stopped after round 4 (no checkpoint_dir, "
                               "nothing saved)).")  # fmt: skip


def test_other_exits_pass_through_main(monkeypatch):
    from scaffold_jax import cli

    monkeypatch.setattr(cli, "_run_command", lambda args: sys.exit(3))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--quiet"])
    assert exit_.value.code == 3


# ----------------------------------------------------------------------------- diagnose
@pytest.mark.slow  # the diagnosis from the command line: ~5 s
@needs_fashion
def test_diagnose_prints_the_papers_constants_and_writes_its_folder(tmp_path, capsys):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "diag"
    argv = ["diagnose", "--config", str(config), "--num-iters", "5", "--out", str(out)]
    assert main([*argv, "--gd-steps", "1"]) == 0
    printed, err = capsys.readouterr()
    for name in ("G at x", "(G, B)", "δ (Hessian dissim.)", "β (smoothness)", "suggested K"):
        assert name in printed
    beta = float(printed.split("β (smoothness)")[1].split()[0])
    assert 0 < beta < 1000
    # Progress on stderr: the data, the gradient steps, each timed stage.
    err = err.splitlines()
    assert err[0] == "loading fashion_mnist..."
    assert any(line.startswith("gradient descent: step 1/1 (100%), ") for line in err)
    assert any(line.startswith("β (smoothness): 10 clients, 5 power iterations: ") for line in err)
    # --out: the report as JSON (what was printed) and the (G, B) plot.
    saved = json.loads((out / "diagnose.json").read_text())
    assert saved["report"]["num_points"] == 2 and saved["report"]["num_iters"] == 5
    assert saved["report"]["beta"] == pytest.approx(beta, rel=1e-5)
    assert (out / "gradient_fit.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "summary.json").read_text())["status"] == "finished"
    # A folder with a report is kept unless --overwrite; --quiet prints nothing and still
    # writes the folder; --gd-steps and --client-lr change the path the fit uses.
    assert main([*argv, "--quiet"]) == 1
    assert "already holds a finished run" in capsys.readouterr().err
    quiet = [*argv, "--quiet", "--overwrite", "--gd-steps", "2", "--client-lr", "0.5"]
    assert main(quiet) == 0
    assert capsys.readouterr() == ("", "")
    again = json.loads((out / "diagnose.json").read_text())
    assert again["report"]["num_points"] == 3 and len(again["report"]["points"]) == 3
    assert again["report"]["points"][0] == saved["report"]["points"][0]  # the same x
    assert again["report"]["points"][1] != saved["report"]["points"][1]  # a longer step
    assert json.loads((out / "config.json").read_text())["client_lr"] == 0.5


# Each config flag of diagnose, with a value other than its default.
_DIAGNOSE_VALUES = {
    "dataset": ["mnist"], "data_dir": ["/data"], "local_test_fraction": ["0.1"], "download": [],
    "max_train_examples": ["100"], "max_test_examples": ["50"], "partition": ["dirichlet"],
    "model": ["mlp"], "num_clients": ["7"], "seed": ["3"], "partition_seed": ["4"],
    "client_lr": ["0.5"],
}  # fmt: skip


def _option_value(option) -> list[str]:
    """A flag value for a declared option that differs from its (unset) default."""
    if option.kind == "bool":
        return []
    if option.choices:
        return [str(option.choices[-1])]
    if option.kind in ("ints", "floats"):
        return [str(v) for v in option.default]
    return [str(option.default)]


def test_every_diagnose_flag_means_something(capsys):
    """diagnose lists only flags that change what it measures or writes: the data,
    partition and model it builds (each reaches its config), --gd-steps / --num-iters /
    --out / --overwrite / --quiet (see the test above); none of run's algorithm, sampling,
    plan or horizon flags."""
    import re

    from scaffold_jax.cli import DIAGNOSE_FIELDS, _config, build_parser
    from scaffold_jax.cli_flags import DIAGNOSE_OPTIONS, _flag
    from scaffold_jax.experiments import declared_options

    with pytest.raises(SystemExit):
        main(["diagnose", "--help"])
    listed = set(re.findall(r"(?<![\w-])--[a-zA-Z][a-zA-Z-]*", capsys.readouterr().out))
    own = {"--help", "--config", "--plugin", "--set", "--gd-steps", "--num-iters", "--out",
           "--overwrite", "--quiet"}  # fmt: skip
    # The fields, and the options the models, partitioners and datasets declare.
    fields = {*DIAGNOSE_FIELDS, *declared_options(DIAGNOSE_OPTIONS)}
    assert listed == own | {_flag(name) for name in fields}
    assert set(_DIAGNOSE_VALUES) == set(DIAGNOSE_FIELDS)
    values = {**_DIAGNOSE_VALUES, **{
        k: _option_value(o) for k, o in declared_options(DIAGNOSE_OPTIONS).items()
    }}  # fmt: skip
    default = _config(build_parser().parse_args(["diagnose"]), validate=False)
    for name, value in values.items():
        args = build_parser().parse_args(["diagnose", _flag(name), *value])
        assert getattr(_config(args, validate=False), name) != getattr(default, name), name
    args = build_parser().parse_args(["diagnose", "--set", "seed=4"])
    assert _config(args, validate=False).seed == 4
    # --set of a field diagnose does not use is refused, naming it.
    assert main(["diagnose", "--set", "rounds=3", "--set", "prox_mu=1"]) == 2
    assert "--set prox_mu, rounds: diagnose does not use them" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--gd-steps", "2147483648", "--gd-steps = 2147483648 is too many: use at most 10000"),
     ("--gd-steps", "10001", "--gd-steps = 10001 is too many"),
     ("--num-iters", "2147483648", "--num-iters = 2147483648 is invalid: use 1 to 10000"),
     ("--num-iters", "0", "--num-iters = 0 is invalid: use 1 to 10000")],
)  # fmt: skip
def test_diagnose_refuses_counts_that_would_run_for_hours(flag, value, says, tmp_path, capsys):
    """2**31 gradient-descent steps ran for hours (found by the slow fuzz test); refused
    before anything is loaded, like the other usage errors."""
    argv = ["diagnose", "--dataset", "synthetic", "--num-clients", "4", "--quiet"]
    assert main([*argv, flag, value, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- resume
@pytest.mark.slow  # 15 s; the quick tier's kill points are tests/test_cli_resume.py's
def test_a_killed_protocol_resumes_keeping_its_finished_cells(tmp_path):
    """fig3 (small): killed after two finished cells, --resume keeps them and runs the
    rest; records (each once), cells and table equal an uninterrupted run's."""
    import signal
    import time

    argv = ["reproduce", "fig3", "--quick", "--rounds", "30", "--lr-grid", "0.1", "0.3",
            "--quiet"]  # fmt: skip

    def start(out, *extra):
        return subprocess.Popen(
            [sys.executable, "-m", "scaffold_jax.cli", *argv, "--out", str(out), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    full = start(tmp_path / "full")
    assert full.wait(timeout=300) == 0, full.stderr.read()
    out = tmp_path / "killed"
    proc = start(out)
    deadline = time.monotonic() + 200
    parts = out / results.PARTS_FILE
    while not parts.exists() or len(parts.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    resumed = start(out, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()

    def comparable(folder):
        records = [
            {k: v for k, v in r.items() if k != "seconds"} for r in results.read_records(folder)
        ]
        summary = results.read_summary(folder)
        cells = [
            {k: v for k, v in c.items() if not k.endswith("_seconds")} for c in summary["cells"]
        ]
        return records, cells, (folder / "fig3.md").read_text().split("Wall time")[0]

    assert comparable(out) == comparable(tmp_path / "full")
    assert results.read_summary(out)["status"] == "finished"
