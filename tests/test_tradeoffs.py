"""A sweep over a trade-off (privacy's ε, compression, a deadline, FedBuff's concurrency) is
a frontier, not a tuning: the summary has one row per value with its input column and the
costs the records carry, the step size is chosen per value, `tradeoffs.png` plots the
curve; and a problem without accuracy gets no target columns."""

import csv
import json
import os

import numpy as np
import pytest

from scaffold_jax import experiments, results
from scaffold_jax.cli import main
from scaffold_jax.compression import COMPRESSORS
from scaffold_jax.engine.buffered import EXECUTIONS
from scaffold_jax.experiments.commands import tradeoff_names
from scaffold_jax.privacy import MECHANISMS

FASHION = "/usr/share/datasets/fashion-mnist"
needs_fashion = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
TINY = ["--dataset", "fashion_mnist", "--max-train-examples", "500", "--max-test-examples",
        "200", "--num-clients", "5", "--clients-per-round", "3", "--local-epochs", "1",
        "--rounds", "4", "--eval-every", "2", "--no-checkpoint", "--no-compile-cache"]  # fmt: skip
QUAD = ["--dataset", "quadratic", "--num-clients", "20", "--local-steps", "5", "--profiles",
        "lognormal", "--execution", "fedbuff", "--algorithms", "fedavg", "scaffold",
        "--buffer-size", "4", "--lr-grid", "0.05", "0.1", "--rounds", "6", "--eval-every", "3",
        "--no-checkpoint", "--no-compile-cache"]  # fmt: skip


def _rows(folder):
    with open(folder / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def _table(text):
    """The Markdown table's rows (header first) as lists of cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


# ----------------------------------------------------------------------------- declared
def test_each_setting_declares_whether_it_is_a_tradeoff_where_it_is_declared():
    assert MECHANISMS["gaussian"].hparams["dp_noise_multiplier"].tradeoff
    assert MECHANISMS["gaussian"].options["dp_epsilon"].tradeoff
    assert COMPRESSORS["topk"].hparams["compress_fraction"].tradeoff
    assert COMPRESSORS["qsgd"].hparams["compress_bits"].tradeoff
    names = tradeoff_names()
    assert {"dp_epsilon", "dp_noise_multiplier", "compress_fraction", "compress_bits",
            "round_deadline", "over_selection"} <= names  # fmt: skip
    # Knobs tuned for accuracy (the clip norm too: ε does not depend on it).
    assert not names & {"client_lr", "server_lr", "prox_mu", "alpha", "dp_clip", "similarity"}


# ----------------------------------------------------------------------------- pieces
class _Grid:
    """What the summaries read of a SweepResult: a top-k grid over fraction × η_l whose
    accuracy grows with the fraction (the least compression is always "best")."""

    algorithm = "fedavg"

    def __init__(self):
        self.configs = [
            {"compress_fraction": f, "client_lr": lr, "server_lr": 1.0, "seed": 0}
            for f in (0.01, 0.1, 1.0)
            for lr in (0.03, 0.1, 0.3)
        ]
        # η_l = 0.1 is best at 1% and 10%, 0.3 with no compression.
        best = {0.01: 0.1, 0.1: 0.1, 1.0: 0.3}
        self.records = []
        for c in self.configs:
            f, lr = c["compress_fraction"], c["client_lr"]
            acc = 0.5 + 0.2 * f + (0.1 if lr == best[f] else 0.0)
            sent = 1000 * f * 5
            self.records.append(
                [
                    {"round": 0, "test_accuracy": 0.1, "bytes_up_total": 0, "status": "ok"},
                    {
                        "round": 5,
                        "test_accuracy": acc,
                        "train_loss": 1 - acc,
                        "bytes_up_total": sent,
                        "status": "ok",
                    },
                ]  # fmt: skip
            )
        self.diverged_round = np.full(len(self.configs), -1)


def test_a_compression_grid_is_summarised_one_row_per_fraction_with_its_own_choice():
    grid = {"fedavg": _Grid()}
    axes = ["compress_fraction"]
    split = results.split_tradeoffs(grid, axes)
    assert list(split) == [f"fedavg compress_fraction={f:g}" for f in (0.01, 0.1, 1.0)]
    summary = results.summarize(split, target=None)
    chosen = {k: e["best"]["hparams"]["client_lr"] for k, e in summary.items()}
    assert list(chosen.values()) == [0.1, 0.1, 0.3]
    # No "extend the grid above 1": a trade-off has no optimum beyond its grid (η_l = 0.1,
    # inside its grid, is not at an edge either; 0.3 at 100% is).
    edges = results.grid_edges(split, summary, tradeoff_names())
    assert [(e["series"], e["name"]) for e in edges] == [
        ("fedavg compress_fraction=1", "client_lr")
    ]
    rows = results.frontier_rows(summary, split, axes, tradeoff_names())
    table = _table(results.format_frontier(rows, axes))
    assert table[0][:3] == ["algorithm", "compress_fraction", "hparams"]
    assert "uplink" in table[0] and "rounds to target" not in table[0]
    assert [r[:3] for r in table[1:]] == [
        ["fedavg", "0.01", "client_lr=0.1, server_lr=1"],
        ["fedavg", "0.1", "client_lr=0.1, server_lr=1"],
        ["fedavg", "1", "client_lr=0.3, server_lr=1"],
    ]
    assert [r[table[0].index("uplink")] for r in table[1:]] == ["50 B", "500 B", "5 kB"]
    # sweep.csv marks one chosen config per fraction, not one for the whole grid.
    tidy = results.sweep_table(grid, 0.6, tradeoffs=axes)
    assert [(r["compress_fraction"], r["client_lr"]) for r in tidy if r["chosen"]] == [
        (0.01, 0.1), (0.1, 0.1), (1.0, 0.3)
    ]  # fmt: skip


def test_the_tradeoff_plot_draws_a_line_per_algorithm_over_the_values():
    pytest.importorskip("matplotlib")
    grid = {"fedavg": _Grid()}
    split = results.split_tradeoffs(grid, ["compress_fraction"])
    summary = results.summarize(split, target=0.6)
    rows = results.frontier_rows(summary, split, ["compress_fraction"])
    fig = results.plot_tradeoffs(rows, ["compress_fraction"])
    first, uplink = fig.axes[:2]  # the fraction, and the uplink it costs
    assert first.get_xlabel() == "compress_fraction" and "uplink" in uplink.get_xlabel()
    line = first.get_lines()[0]  # the errorbar's caps are lines too
    assert list(line.get_xdata()) == [0.01, 0.1, 1.0]
    assert list(line.get_ydata()) == pytest.approx([0.602, 0.62, 0.8])


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow  # two vmapped programs of 6 configs: ~15 s on 2 cores
@needs_fashion
def test_a_privacy_sweep_prints_every_epsilon_and_plots_the_curve(tmp_path, capsys):
    out = tmp_path / "dp"
    argv = ["sweep", *TINY, "--algorithms", "fedavg", "scaffold", "--sampler", "poisson",
            "--grid", "dp_epsilon=1,3,8", "--lr-grid", "0.1", "0.3", "--dp-clip", "0.5",
            "--target", "0.3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = _table(capsys.readouterr().out)
    header, body = table[0], table[1:]
    assert header[:3] == ["algorithm", "dp_epsilon", "hparams"] and "ε spent" in header
    assert [(r[0], r[1]) for r in body] == [
        (alg, eps) for alg in ("fedavg", "scaffold") for eps in ("1", "3", "8")
    ]
    assert not any("dp_noise_multiplier" in r[2] for r in body)  # ε is the label, not z
    spent = [float(r[header.index("ε spent")]) for r in body]
    assert all(0.99 * t <= s <= t for s, t in zip(spent, [1, 3, 8] * 2, strict=True))
    rows = _rows(out)
    assert list(rows[0])[:3] == ["algorithm", "dp_epsilon", "client_lr"]
    assert sorted({float(r["dp_epsilon"]) for r in rows}) == [1.0, 3.0, 8.0]
    assert sum(r["chosen"] == "True" for r in rows) == 6  # one per algorithm and ε
    assert (out / "tradeoffs.png").is_file()
    assert json.loads((out / "summary.json").read_text())["tradeoffs"] == ["dp_epsilon"]
    assert "the chosen dp_" not in (out / "summary.md").read_text()  # no edge on a trade-off


@pytest.mark.slow  # one vmapped program of 4 configs and one of deadlines: ~15 s on 2 cores
@needs_fashion
def test_a_compression_and_a_deadline_sweep_print_their_frontiers(tmp_path, capsys):
    out = tmp_path / "topk"
    argv = ["sweep", *TINY, "--algorithm", "fedavg", "--compression", "topk",
            "--grid", "compress_fraction=0.01,1", "--lr-grid", "0.1", "0.3",
            "--target", "0.3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    header, *body = _table(printed.out)
    assert header[:2] == ["algorithm", "compress_fraction"] and "uplink" in header
    assert [r[1] for r in body] == ["0.01", "1"]
    assert "extend the grid above 1" not in printed.err
    assert (out / "tradeoffs.png").is_file()

    out = tmp_path / "deadline"
    argv = ["sweep", *TINY, "--algorithm", "fedavg", "--profiles", "lognormal",
            "--grid", "round_deadline=1,100", "--lr-grid", "0.1", "0.3",
            "--target", "0.3", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    header, *body = _table(capsys.readouterr().out)
    assert header[:2] == ["algorithm", "round_deadline"]
    assert {"virtual time", "time to target", "rounds to target"} <= set(header)
    assert [(r[0], r[1]) for r in body] == [("fedavg", "1"), ("fedavg", "100")]
    assert "time_to_target" in _rows(out)[0]
    assert (out / "tradeoffs.png").is_file()


@pytest.mark.slow  # four small FedBuff programs: ~25 s on 2 cores
def test_a_sweep_without_accuracy_prints_no_target_columns(tmp_path, capsys, monkeypatch):
    # FedBuff's concurrency as a trade-off, as its declaration in engine.buffered sets it.
    options = EXECUTIONS["fedbuff"].options
    for name in ("concurrency", "buffer_size"):
        monkeypatch.setitem(options, name, options[name]._replace(tradeoff=True))
    out = tmp_path / "fedbuff"
    argv = ["sweep", *QUAD, "--grid", "concurrency=4,8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "nan" not in printed and "not reached" not in printed
    assert "quadratic has no test accuracy" in printed
    header, *body = _table(printed)
    assert header[:3] == ["algorithm", "concurrency", "hparams"]
    assert "rounds to target" not in header and "best test_loss" in header
    assert "virtual time" in header
    assert [(r[0], r[1]) for r in body] == [
        ("fedavg", "4"), ("scaffold", "4"), ("fedavg", "8"), ("scaffold", "8")
    ]  # fmt: skip
    rows = _rows(out)
    assert "target" not in rows[0] and "rounds_to_target" not in rows[0]
    assert rows[0]["best_test_loss"] and "final_concurrency" not in rows[0]
    assert not (out / "rounds_to_target.png").exists()
    assert (out / "best_curves.png").is_file() and (out / "tradeoffs.png").is_file()
    record = json.loads((out / "sweep.json").read_text())
    assert record["target"] is None and record["metric"] == "test_loss"


def test_the_sweep_grid_keeps_each_noise_multipliers_target_epsilon():
    config = experiments.RunConfig(dataset="quadratic", num_clients=50, rounds=6,
                                   sampler="poisson", algorithm="fedavg")  # fmt: skip
    grid, _, epsilons = experiments.sweep_grid(config, [], {"dp_epsilon": [3, 8]}, [0], 0.7)
    (of,) = epsilons.values()
    assert sorted(of.values()) == [3, 8]
    assert list(of) == list(grid.cells[0].axes["dp_noise_multiplier"])
