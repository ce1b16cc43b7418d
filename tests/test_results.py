"""The run folder writer, rounds-to-target, the one step-size selection policy, the
paper-style tables and the plots (one style: Figure objects, the backend left alone)."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from scaffold_jax import results
from scaffold_jax.results import Cell, RunWriter

RECORDS = [
    {"round": 0, "test_accuracy": 0.10, "test_loss": 2.3},
    {"round": 5, "test_accuracy": 0.45, "test_loss": 1.5},
    {"round": 10, "test_accuracy": 0.52, "test_loss": 1.2},
    {"round": 15, "test_accuracy": 0.50, "test_loss": 1.1},
]


# ----------------------------------------------------------------------------- metrics
def test_rounds_to_target_is_the_first_evaluated_round_at_or_past_the_target():
    assert results.rounds_to_target(RECORDS, 0.45) == 5
    assert results.rounds_to_target(RECORDS, 0.5) == 10
    assert results.rounds_to_target(RECORDS, 0.9) is None
    assert results.rounds_to_target(RECORDS, 1.2, "test_loss", higher_is_better=False) == 10
    assert results.rounds_to_target([], 0.5) is None


def test_rounds_to_target_never_counts_a_diverged_value():
    # -inf is below every error target and NaN compares False: both must not count.
    recs = [
        {"round": 0, "error": 1.0},
        {"round": 1, "error": -math.inf},
        {"round": 2, "error": math.nan},
        {"round": 3, "error": 1e-3},
    ]
    assert results.rounds_to_target(recs, 1e-2, "error", higher_is_better=False) == 3
    acc = [{"round": 0, "test_accuracy": math.inf}, {"round": 1, "test_accuracy": math.nan}]
    assert results.rounds_to_target(acc, 0.5) is None
    assert results.best_value(acc) is None


def test_series_summary_reports_targets_best_and_final():
    out = results.series_summary(RECORDS, targets=[0.5, 0.9])
    assert out["rounds_to_target"] == {"0.5": 10, "0.9": None}
    assert out["best_test_accuracy"] == pytest.approx(0.52)
    assert out["best_test_loss"] == pytest.approx(1.1)
    assert out["last_round"] == 15 and out["num_records"] == 4
    assert out["final"]["test_accuracy"] == pytest.approx(0.50)


def test_rounds_to_target_and_best_value_ignore_records_after_a_divergence():
    recs = [
        {"round": 0, "test_accuracy": 0.1, "status": "ok"},
        {"round": 5, "test_accuracy": 0.9, "status": "diverged"},  # a sweep config, frozen
    ]
    assert results.rounds_to_target(recs, 0.5) is None
    assert results.best_value(recs) == pytest.approx(0.1)
    assert results.rounds_to_target(recs[:1], 0.1) == 0  # "ok" counts like no status


# ----------------------------------------------------------------------------- selection
def _run(lr, accuracies, loss=1.0, seed=0, diverged=False, loss_name="train_loss"):
    """A hand-made run evaluated at rounds 0, 5, 10, ... with a constant final loss."""
    records = [
        {"round": 5 * i, "test_accuracy": a, loss_name: loss} for i, a in enumerate(accuracies)
    ]
    return results.Candidate({"client_lr": lr}, records, diverged, seed)


def _chosen(runs, target=0.5, **kw):
    best, _ = results.select(runs, target, **kw)
    return best["hparams"]["client_lr"]


def test_select_takes_the_fewest_mean_rounds_and_every_seed_must_reach():
    runs = [
        _run(0.1, [0.1, 0.6, 0.6], seed=0),  # reaches at 5 ...
        _run(0.1, [0.1, 0.2, 0.3], seed=1),  # ... but this seed never: not reached
        _run(0.3, [0.1, 0.2, 0.6], seed=0),
        _run(0.3, [0.1, 0.2, 0.7], seed=1),  # 10 and 10
        _run(1.0, [0.1, 0.2, 0.3, 0.6], seed=0),
        _run(1.0, [0.1, 0.2, 0.3, 0.9], seed=1),  # 15 and 15, better best value
    ]
    best, groups = results.select(runs, 0.5)
    assert best["hparams"] == {"client_lr": 0.3} and best["seeds"] == [0, 1]
    assert (best["rounds_mean"], best["rounds_std"], best["reached"]) == (10.0, 0.0, 2)
    by_lr = {g["hparams"]["client_lr"]: g for g in groups}
    assert by_lr[0.1]["rounds_mean"] is None and by_lr[0.1]["reached"] == 1
    assert by_lr[0.1]["rounds_to_target"] == [5, None] and by_lr[0.1]["configs"] == [0, 1]


def test_select_breaks_equal_rounds_by_the_best_value_before_the_final_loss():
    runs = [
        _run(0.1, [0.1, 0.6, 0.65], loss=0.1),  # lower loss, smaller η_l ...
        _run(0.3, [0.1, 0.6, 0.8], loss=2.0),  # ... but this best value is higher
    ]
    assert _chosen(runs) == 0.3
    # Mean rounds over seeds: (5 + 15) / 2 ties with 10; the best value still decides.
    seeds = [
        _run(0.1, [0.1, 0.6, 0.6], seed=0),
        _run(0.1, [0.1, 0.2, 0.2, 0.6], seed=1),
        _run(0.3, [0.1, 0.2, 0.9], seed=0),
        _run(0.3, [0.1, 0.2, 0.9], seed=1),
    ]
    assert _chosen(seeds) == 0.3


def test_select_breaks_equal_rounds_and_best_value_by_the_final_loss():
    runs = [_run(0.1, [0.1, 0.6, 0.7], loss=1.0), _run(0.3, [0.1, 0.6, 0.7], loss=0.5)]
    assert _chosen(runs) == 0.3
    assert _chosen(runs, target=None) == 0.3
    # Without a training loss, the test loss decides.
    test_loss = [
        _run(0.1, [0.1, 0.6, 0.7], loss=0.9, loss_name="test_loss"),
        _run(0.3, [0.1, 0.6, 0.7], loss=0.4, loss_name="test_loss"),
    ]
    assert _chosen(test_loss) == 0.3


def test_select_breaks_a_full_tie_by_the_smaller_step_size():
    runs = [_run(0.3, [0.1, 0.6, 0.7]), _run(0.1, [0.1, 0.6, 0.7]), _run(1.0, [0.1, 0.6, 0.7])]
    assert _chosen(runs) == 0.1


def test_a_diverged_group_ranks_last_even_if_it_reached_first():
    nan = float("nan")
    runs = [
        _run(3.0, [0.9, nan], seed=0, diverged=True),  # reached at round 0, then blew up
        _run(3.0, [0.9, 0.95], seed=1),
        _run(0.3, [0.1, 0.2, 0.3], seed=0),  # never reaches: still ahead of a diverged one
        _run(0.3, [0.1, 0.2, 0.3], seed=1),
        _run(0.1, [0.1, 0.2, 0.6], seed=0),
        _run(0.1, [0.1, 0.2, 0.6], seed=1),
    ]
    best, groups = results.select(runs, 0.5)
    assert best["hparams"] == {"client_lr": 0.1}
    ranked = sorted(groups, key=results.selection_key)
    assert [g["hparams"]["client_lr"] for g in ranked] == [0.1, 0.3, 3.0]
    assert ranked[-1]["num_diverged"] == 1 and ranked[-1]["final_loss_mean"] == math.inf
    # A "status" other than "ok" in the records marks a run diverged too.
    frozen = _run(3.0, [0.9, 0.9])
    frozen.records[1]["status"] = "diverged"
    assert _chosen([frozen, _run(0.1, [0.1, 0.6])]) == 0.1


def test_select_without_a_target_ranks_by_the_best_value():
    runs = [
        _run(0.1, [0.1, 0.7, 0.7, 0.7]),  # reaches 0.5 first ...
        _run(0.3, [0.1, 0.2, 0.3, 0.9]),  # ... this one has the best accuracy
    ]
    assert _chosen(runs, target=0.5) == 0.1
    best, groups = results.select(runs, None)
    assert best["hparams"] == {"client_lr": 0.3} and best["best_value_mean"] == 0.9
    assert all(g["rounds_mean"] is None and g["rounds_to_target"] == [None] for g in groups)


def test_select_for_errors_lower_is_better():
    runs = [
        results.Candidate({"client_lr": 0.1}, [{"round": r, "e": 1 / (r + 1)} for r in range(9)]),
        results.Candidate({"client_lr": 0.3}, [{"round": r, "e": 0.5**r} for r in range(9)]),
    ]
    best, _ = results.select(runs, 0.1, "e", higher_is_better=False)
    assert best["hparams"]["client_lr"] == 0.3 and best["rounds_mean"] == 4.0
    best, _ = results.select(runs, None, "e", higher_is_better=False)
    assert best["hparams"]["client_lr"] == 0.3
    with pytest.raises(ValueError, match="at least one run"):
        results.select([], 0.5)


def _sweep_like(algorithm, lrs, seeds=(0, 1), diverged_lr=None, horizon=10):
    """A SweepResult look-alike (duck-typed, as results sits below scaffold_jax.sweep)."""
    configs, records, diverged = [], [], []
    for lr in lrs:
        for seed in seeds:
            configs.append({"client_lr": lr, "server_lr": 1.0, "seed": seed})
            blown = lr == diverged_lr
            recs = []
            for i in range(horizon + 1):
                acc = 1 - 0.9 * math.exp(-i * lr) - 0.01 * seed
                status = "diverged" if blown and i > 2 else "ok"
                recs.append(
                    {
                        "round": 10 * i,
                        "test_accuracy": math.nan if status != "ok" else acc,
                        "train_loss": math.nan if status != "ok" else 1 - acc,
                        "status": status,
                    }
                )
            records.append(recs)
            diverged.append(blown)
    return types.SimpleNamespace(
        algorithm=algorithm, configs=configs, records=records, diverged=diverged
    )


def test_summarize_a_sweep_with_the_one_policy_and_format_it():
    sweeps = {
        "scaffold": _sweep_like("scaffold", [0.03, 0.1, 0.3, 3.0], diverged_lr=3.0),
        "fedavg": _sweep_like("fedavg", [0.01, 0.05]),
    }
    summary = results.summarize(sweeps, target=0.6)
    best = summary["scaffold"]["best"]
    assert best["hparams"] == {"client_lr": 0.3, "server_lr": 1.0}  # 3.0 reached first
    assert best["seeds"] == [0, 1] and summary["scaffold"]["target"] == 0.6
    assert len(summary["scaffold"]["groups"]) == 4
    assert summary["fedavg"]["best"]["rounds_mean"] is None  # neither η_l reaches
    assert results.summarize(sweeps["fedavg"], 0.6).keys() == {"fedavg"}
    table = results.format_summary(summary)
    assert "| scaffold | client_lr=0.3, server_lr=1 |" in table
    assert "| fedavg | client_lr=0.05, server_lr=1 | not reached | 0/2 |" in table
    none = results.format_summary(results.summarize(sweeps, None))
    # Without a target, no rounds-to-target columns (they would read "—" and "0/2").
    assert none.startswith("| algorithm | hparams | best test_accuracy |")
    assert "| scaffold | client_lr=0.3, server_lr=1 | 0.9" in none


# ----------------------------------------------------------------------------- tables
@pytest.mark.parametrize(
    "rounds, horizon, text",
    [(77, 1000, "77"), (None, 1000, "1k+"), (None, 2000, "2k+"), (None, 60, "60+"), (0, 5, "0")],
)
def test_format_rounds(rounds, horizon, text):
    assert results.format_rounds(rounds, horizon) == text


@pytest.mark.parametrize(
    "rounds, baseline, text",
    [
        (77, 317, "(4.1×)"),
        (317, 317, "(1.0×)"),
        (None, 317, "(<0.3×)"),  # as the paper prints a method that never got there
        (250, None, "(>4.0×)"),
        (None, None, ""),
    ],
)
def test_format_speedup_over_sgd(rounds, baseline, text):
    assert results.format_speedup(rounds, baseline, horizon=1000) == text


def test_rounds_table_has_the_papers_layout():
    cells = [
        Cell(("SGD", 1), "0%", 317, 1000),
        Cell(("SGD", 1), "10%", 365, 1000),
        Cell(("SCAFFOLD", 1), "0%", 77, 1000),
        Cell(("SCAFFOLD", 1), "10%", 62, 1000),
        Cell(("FedAvg", 20), "0%", None, 1000),
        Cell(("FedAvg", 20), "10%", 18, 1000),
    ]
    table = results.rounds_table(cells, ("method", "epochs"))
    assert table.splitlines() == [
        "| method | epochs | 0% | 10% |",
        "|---|---|---|---|",
        "| SGD | 1 | 317 (1.0×) | 365 (1.0×) |",
        "| SCAFFOLD | 1 | 77 (4.1×) | 62 (5.9×) |",
        "| FedAvg | 20 | 1k+ (<0.3×) | 18 (20.3×) |",
    ]


def test_rounds_table_without_a_baseline_row_prints_no_speedups():
    cells = [Cell(("SCAFFOLD", "20%"), "0%", 143, 1000), Cell(("FedAvg", "1%"), "0%", None, 1000)]
    table = results.rounds_table(cells, ("method", "sampled"))
    assert "| SCAFFOLD | 20% | 143 |" in table
    assert "| FedAvg | 1% | 1k+ |" in table
    assert "×" not in table


def test_value_table_formats_best_accuracy_and_chosen_step_sizes():
    cells = [
        Cell(("SGD",), "0%", value=0.7661, client_lr=3.0),
        Cell(("SCAFFOLD",), "0%", value=0.8012, client_lr=0.1),
    ]
    assert "| SCAFFOLD | 0.801 |" in results.value_table(cells, ("method",))
    lrs = results.value_table(cells, ("method",), fmt="g", field="client_lr")
    assert "| SGD | 3 |" in lrs and "| SCAFFOLD | 0.1 |" in lrs


# ----------------------------------------------------------------------------- writer
def _write_run(folder, records=RECORDS, series="scaffold", **kwargs):
    with RunWriter(folder, {"algorithm": series}, targets=[0.5], **kwargs) as writer:
        for r in records:
            writer.record(series, r)
        writer.describe(series, compile_seconds=1.5, run_seconds=3.0)
        return writer.finish()


def test_writer_writes_every_file(tmp_path):
    summary = _write_run(tmp_path / "run")
    folder = tmp_path / "run"
    assert json.loads((folder / "config.json").read_text()) == {"algorithm": "scaffold"}
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 5, 10, 15]
    assert all(json.loads(line)["series"] == "scaffold" for line in lines)
    on_disk = json.loads((folder / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "finished"
    assert on_disk["rounds_to_target"] == {"0.5": 10}
    assert on_disk["runs"]["scaffold"]["compile_seconds"] == 1.5
    assert on_disk["best_test_accuracy"] == pytest.approx(0.52)
    env = on_disk["environment"]
    assert env["jax"] and env["devices"] and env["backend"]
    csv_lines = (folder / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].split(",")[:3] == ["series", "round", "test_accuracy"]
    assert len(csv_lines) == 5
    for png in ("accuracy.png", "loss.png"):
        assert (folder / png).read_bytes()[:4] == b"\x89PNG"
    assert set(on_disk["files"]) >= {"config.json", "metrics.jsonl", "metrics.csv"}


def test_records_are_on_disk_as_soon_as_they_are_written(tmp_path):
    with RunWriter(tmp_path, {}, targets=[0.5]) as writer:
        writer.record("sgd", RECORDS[0])
        writer.record("sgd", RECORDS[1])
        # Mid-run: another process reading the folder sees both records and the status.
        assert [r["round"] for r in results.read_records(tmp_path)] == [0, 5]
        assert results.read_summary(tmp_path)["status"] == "running"
        writer.finish(plots=())


def test_a_killed_run_keeps_every_finished_record(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal
        from scaffold_jax.results import RunWriter
        writer = RunWriter({str(tmp_path)!r}, {{"algorithm": "sgd"}})
        writer.open()
        for r in range(3):
            writer.record("sgd", {{"round": r, "test_accuracy": 0.1 * r}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert [r["round"] for r in results.read_records(tmp_path)] == [0, 1, 2]
    assert results.read_summary(tmp_path)["status"] == "running"


def test_metrics_csv_holds_every_record_as_soon_as_it_is_written(tmp_path):
    import csv

    def rows():
        with open(tmp_path / results.CSV_FILE, newline="") as f:
            return list(csv.DictReader(f))

    writer = results.RunWriter(tmp_path, {}, plots=())
    writer.open()
    writer.record("a", {"round": 0, "test_accuracy": 0.125})
    writer.record("a", {"round": 5, "test_accuracy": 0.25})
    assert rows() == [
        {"series": "a", "round": "0", "test_accuracy": "0.125"},
        {"series": "a", "round": "5", "test_accuracy": "0.25"},
    ]
    # A record with a new field: the header grows, the earlier rows leave it empty.
    writer.record("a", {"round": 10, "test_accuracy": 0.5, "error": 0.1})
    assert [r["error"] for r in rows()] == ["", "", "0.1"]
    writer.reset_records([{"round": 0, "test_accuracy": 0.125}], "a")  # a resume cuts back
    assert rows() == [{"series": "a", "round": "0", "test_accuracy": "0.125"}]
    writer.close("interrupted")


def test_a_torn_last_line_is_ignored(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 0}\n{"round": 5}\n{"rou')
    assert results.read_records(tmp_path) == [{"round": 0}, {"round": 5}]


@pytest.mark.parametrize(
    "error, status", [(KeyboardInterrupt, "interrupted"), (RuntimeError, "failed")]
)
def test_an_exception_records_the_status_and_keeps_the_records(tmp_path, error, status):
    with pytest.raises(error):
        with RunWriter(tmp_path, {}) as writer:
            writer.record("fedavg", RECORDS[0])
            raise error("boom")
    summary = results.read_summary(tmp_path)
    assert summary["status"] == status
    assert "boom" in summary["error"]
    assert len(results.read_records(tmp_path)) == 1


def test_a_finished_run_is_not_overwritten(tmp_path):
    _write_run(tmp_path)
    with pytest.raises(FileExistsError, match="finished run.*--overwrite"):
        RunWriter(tmp_path, {}).open()


def test_an_interrupted_run_is_not_overwritten_either(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with RunWriter(tmp_path, {}) as writer:
            writer.record("sgd", RECORDS[0])
            raise KeyboardInterrupt
    with pytest.raises(FileExistsError, match="unfinished run.*'interrupted'.*1 records"):
        RunWriter(tmp_path, {}).open()


def test_overwrite_replaces_the_run_and_nothing_else(tmp_path):
    _write_run(tmp_path, records=RECORDS)
    (tmp_path / "notes.txt").write_text("mine")
    summary = _write_run(tmp_path, records=RECORDS[:2], overwrite=True)
    assert summary["status"] == "finished"
    assert len(results.read_records(tmp_path)) == 2  # not appended to the old 4
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_empty_existing_folder_is_fine(tmp_path):
    (tmp_path / "out").mkdir()
    _write_run(tmp_path / "out")
    assert results.read_summary(tmp_path / "out")["status"] == "finished"


def test_several_series_give_one_line_each_and_panels(tmp_path):
    with RunWriter(tmp_path, {}, targets=[0.5]) as writer:
        for series, shift in (("sgd", 0.0), ("scaffold", 0.1)):
            for r in RECORDS:
                writer.record(series, {**r, "test_accuracy": r["test_accuracy"] + shift})
        spec = results.PlotSpec(
            "panels.png", "test_accuracy", "acc", panels={"a": ["sgd"], "b": ["scaffold"]}
        )
        summary = writer.finish(plots=[spec])
    assert summary["runs"]["scaffold"]["rounds_to_target"] == {"0.5": 5}
    assert summary["runs"]["sgd"]["rounds_to_target"] == {"0.5": 10}
    assert "rounds_to_target" not in summary  # no single headline with two series
    assert (tmp_path / "panels.png").is_file()
    assert os.path.getsize(tmp_path / "panels.png") > 1000


def test_an_early_check_never_deletes_the_old_run(tmp_path):
    _write_run(tmp_path)
    results.check_folder(tmp_path, overwrite=True, dry_run=True)
    assert len(results.read_records(tmp_path)) == 4
    results.check_folder(tmp_path, overwrite=True)
    assert results.read_records(tmp_path) == [] and not (tmp_path / "summary.json").exists()


# ----------------------------------------------------------------------------- plots
def _drawn(fig):
    """The figure drawn (so artists have extents), and its renderer."""
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _assert_one_style(fig, backend):
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure)
    assert matplotlib_backend() == backend  # the global backend is left alone
    renderer = _drawn(fig)
    box = fig.bbox
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:  # outside the axes (never over a curve) and not clipped
            extent = legend.get_window_extent(renderer)
            assert not extent.overlaps(ax.get_window_extent(renderer))
            assert extent.x0 >= 0 and extent.y0 >= 0 and extent.x1 <= box.x1 + 1
        label = ax.xaxis.label.get_window_extent(renderer)  # the x label is not clipped
        assert label.y0 >= 0 and label.x0 >= 0 and label.x1 <= box.x1 + 1
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        for a, b in zip(ticks, ticks[1:], strict=False):
            assert not a.overlaps(b), "x tick labels overlap"


def matplotlib_backend():
    import matplotlib

    return matplotlib.get_backend()


def test_run_curves_are_figures_with_panels_a_target_line_and_outside_legends(tmp_path):
    pytest.importorskip("matplotlib")
    backend = matplotlib_backend()
    recs = [
        {"series": f"{name} (η_l = {lr:g})", "round": 5 * i, "test_accuracy": a + shift}
        for name, lr, shift in (("scaffold", 0.1, 0.1), ("sgd", 1.0, 0.0))
        for i, a in enumerate([0.1, 0.45, 0.52, 0.5])
    ]
    spec = results.PlotSpec("a.png", "test_accuracy", "test accuracy", target=0.5, title="t")
    fig = results.plot_curves(recs, spec, tmp_path / "a.png")
    _assert_one_style(fig, backend)
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["scaffold (η_l = 0.1)", "sgd (η_l = 1)", "target 0.5"]
    renamed = results.plot_curves(recs, spec._replace(legend=lambda name: name.split()[0]))
    assert [t.get_text() for t in renamed.axes[0].get_legend().get_texts()][:2] == [
        "scaffold", "sgd"
    ]  # fmt: skip
    several = results.plot_curves(recs, spec._replace(target=(0.5, 0.6)))
    (ax,) = several.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()][-1] == "targets 0.5, 0.6"
    assert sorted(line.get_ydata()[0] for line in ax.get_lines()[2:]) == [0.5, 0.6]
    panels = spec._replace(
        panels={"G = 1": ["sgd (η_l = 1)"], "G = 10": ["scaffold (η_l = 0.1)"]}, logy=True
    )
    fig = results.plot_curves(recs, panels)
    _assert_one_style(fig, backend)
    assert [ax.get_title() for ax in fig.axes] == ["G = 1", "G = 10"]
    assert results.plot_curves(recs, spec._replace(metric="nothing")) is None


def test_sweep_plots_are_figures_with_titles_and_readable_axes(tmp_path):
    pytest.importorskip("matplotlib")
    backend = matplotlib_backend()
    lrs = [0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
    sweeps = {
        "scaffold": _sweep_like("scaffold", lrs, diverged_lr=10.0),
        "fedavg": _sweep_like("fedavg", lrs[:-1], seeds=(0, 1, 2)),
    }
    fig = results.plot_rounds_to_target(sweeps, 0.6)
    _assert_one_style(fig, backend)
    (ax,) = fig.axes
    assert "not reached" not in ax.get_title() and "mean ± std" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "not reached (at 100 rounds)", "diverged (at 100 rounds)", "scaffold", "fedavg"
    ]  # fmt: skip
    assert [float(t) for t in ax.get_xticks()] == lrs
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{lr:g}" for lr in lrs]
    # η_l = 10 reached the target before it blew up: marked, not on scaffold's line.
    scaffold_line = ax.get_lines()[0]
    assert 10.0 not in list(scaffold_line.get_xdata()) and 3.0 in list(scaffold_line.get_xdata())
    assert ax.get_ylim()[0] == 0 and all(float(t).is_integer() for t in ax.get_yticks())
    # With η_l fixed, the swept hyper-parameter is the x axis.
    by_server_lr = _sweep_like("fedavg", [0.3, 1.0])  # 2 values x 2 seeds, relabelled
    by_server_lr.configs = [
        {**c, "client_lr": 0.3, "server_lr": lr}
        for c, lr in zip(by_server_lr.configs, (0.5, 0.5, 1.0, 1.0), strict=True)
    ]
    (ax,) = results.plot_rounds_to_target(by_server_lr, 0.6).axes
    assert ax.get_xlabel() == "server step size η_g"
    assert [float(t) for t in ax.get_xticks()] == [0.5, 1.0]
    # A grid spanning 40 decades: the labels that would overlap are left out.
    wide = results.plot_rounds_to_target(_sweep_like("sgd", [0.03, 0.1, 0.3, 1e38]), 0.6)
    wide.canvas.draw()
    assert [t.get_text() for t in wide.axes[0].get_xticklabels()] == ["0.03", "", "", "1e+38"]
    fig = results.plot_best_curves(sweeps, 0.6)
    _assert_one_style(fig, backend)
    (ax,) = fig.axes
    assert "± 1 std" in ax.get_title() and ax.get_ylabel() == "test accuracy"
    assert all(float(t).is_integer() for t in ax.get_xticks())  # rounds are whole
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["scaffold (η_l = 3)", "fedavg (η_l = 3)", "target 0.6"]
    results.save_figure(fig, tmp_path / "best.png")
    assert (tmp_path / "best.png").read_bytes()[:4] == b"\x89PNG"


def test_diagnostics_plots_are_figures(tmp_path):
    pytest.importorskip("matplotlib")
    backend = matplotlib_backend()
    drift = results.plot_drift(
        {"FedAvg": [2.0 - i / 30 for i in range(30)], "SCAFFOLD": [2 * 0.8**i for i in range(30)]},
        tmp_path / "drift.png",
    )
    _assert_one_style(drift, backend)
    assert drift.axes[0].get_yscale() == "log"
    g_plot = results.plot_G_vs_similarity([100, 0, 50], [0.8, 9.0, 4.5], tmp_path / "g.png")
    _assert_one_style(g_plot, backend)
    for name in ("drift.png", "g.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="pair up"):
        results.plot_G_vs_similarity([0, 50], [1.0])


def test_plotting_never_imports_pyplot_or_sets_the_backend(tmp_path):
    pytest.importorskip("matplotlib")
    script = textwrap.dedent(
        """
        import sys
        import matplotlib
        matplotlib.use("svg")
        from scaffold_jax import results
        recs = [{"series": "a", "round": r, "test_accuracy": r / 10} for r in range(5)]
        results.plot_curves(recs, results.PlotSpec("a.png", "test_accuracy", "acc"), sys.argv[1])
        results.plot_drift({"a": [1.0, 0.5]})
        results.plot_G_vs_similarity([0, 100], [2.0, 1.0])
        assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
        assert "matplotlib.pyplot" not in sys.modules
        """
    )
    out = tmp_path / "a.png"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, timeout=120)
    assert out.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------- full disks
class _FullAfter:
    """A file object that fails with ENOSPC after ``n`` writes (a disk filling up)."""

    def __init__(self, f, n):
        self.f, self.n = f, n

    def write(self, text):
        self.n -= 1
        if self.n < 0:
            self.f.write(text[: len(text) // 2])  # part of the line reaches the file
            self.f.flush()
            raise OSError(28, "No space left on device")
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_stops_the_writer_with_one_line_and_keeps_whole_records(tmp_path):
    import errno

    from scaffold_jax.results import RunFolderError, RunWriter

    with pytest.raises(RunFolderError) as info:
        with RunWriter(tmp_path, {"algorithm": "sgd"}, targets=[0.5]) as writer:
            writer._metrics = _FullAfter(writer._metrics, 2)
            for r in range(5):
                writer.record("sgd", {"round": r, "test_accuracy": 0.1 * r})
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC and "\n" not in message
    assert f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device" in message
    # The two finished records are intact and the file ends with a whole line.
    assert [r["round"] for r in results.read_records(tmp_path)] == [0, 1]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    summary = results.read_summary(tmp_path)
    assert summary["status"] == "failed" and "No space left on device" in summary["error"]
    assert not (tmp_path / results.LOCK_FILE).exists()


def test_a_plot_that_cannot_be_written_never_fails_a_finished_run(tmp_path, monkeypatch, capsys):
    from scaffold_jax.results import RunWriter

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(results.folder, "plot_curves", full)  # RunWriter.finish draws with it
    with RunWriter(tmp_path, {"algorithm": "sgd"}, targets=[0.5]) as writer:
        writer.record("sgd", {"round": 0, "test_accuracy": 0.1, "test_loss": 1.0})
        summary = writer.finish()
    assert summary["status"] == "finished" == results.read_summary(tmp_path)["status"]
    assert "could not write accuracy.png" in capsys.readouterr().err


def test_the_environment_names_the_git_commit_and_the_library_versions(monkeypatch):
    import subprocess
    from pathlib import Path

    import flax
    import numpy as np
    import optax

    env = results.environment()
    assert (env["flax"], env["optax"], env["numpy"]) == (
        flax.__version__, optax.__version__, np.__version__
    )  # fmt: skip
    assert env["jax"] and env["jaxlib"] and env["python"].count(".") == 2
    root = Path(results.provenance.__file__).resolve().parents[3]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    in_checkout = head.returncode == 0 and (root / ".git").exists()
    assert env["git_commit"] == (head.stdout.decode().strip() if in_checkout else None)

    # No git (or not a checkout): None, never an error.
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    results.git_revision.cache_clear()
    monkeypatch.setattr(results.provenance.subprocess, "run", no_git)
    try:
        assert results.environment()["git_commit"] is None
        assert results.git_revision() == {"git_commit": None, "git_dirty": None}
    finally:
        results.git_revision.cache_clear()


def read_tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the event files in ``directory``, parsed with
    tensorboardX's protobufs (TFRecord framing: length, CRC, event, CRC), as TensorBoard
    shows them: a ``SessionLog.START`` at step T drops the earlier events of step >= T."""
    import struct
    from pathlib import Path

    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                scalars = {
                    tag: [(step, v) for step, v in values if step < event.step]
                    for tag, values in scalars.items()
                }
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def read_tensorboard_runs(directory) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{run: scalars}`` of every TensorBoard run (a folder holding event files) under
    ``directory``, named by its path relative to it, as TensorBoard names runs."""
    from pathlib import Path

    folders = {p.parent for p in Path(directory).rglob("events.out.tfevents.*")}
    return {str(f.relative_to(directory)): read_tensorboard_scalars(f) for f in sorted(folders)}


def test_tensorboard_sink_writes_one_scalar_per_metric_with_the_round_as_step(tmp_path):
    pytest.importorskip("tensorboardX")
    records = [
        {"series": "a", "round": 0, "test_accuracy": 0.125, "test_loss": 2.5, "seconds": 0.0},
        {"series": "a", "round": 5, "test_accuracy": 0.75, "test_loss": 0.5, "seconds": 1.5},
    ]
    sink = results.TensorBoardSink(tmp_path)
    for record in records:
        sink(record)
    # Flushed per record: readable before close (a killed run keeps its events).
    assert read_tensorboard_scalars(tmp_path / "tensorboard")["test_accuracy"] == [
        (0, 0.125), (5, 0.75)
    ]  # fmt: skip
    sink.close()
    assert read_tensorboard_scalars(tmp_path / "tensorboard") == {
        name: [(r["round"], r[name]) for r in records]
        for name in ("test_accuracy", "test_loss", "seconds")
    }


def test_a_resumed_run_purges_the_rounds_it_runs_again_from_tensorboard(tmp_path):
    """The interrupted process logged rounds 0, 5, 10; the checkpoint was at round 5, so
    the resumed one logs round 10 again (another value): TensorBoard shows it once."""
    pytest.importorskip("tensorboardX")
    first = results.TensorBoardSink(tmp_path)
    for r, acc in ((0, 0.1), (5, 0.5), (10, 0.7)):
        first({"round": r, "test_accuracy": acc})
    first.close()
    resumed = results.TensorBoardSink(tmp_path)
    resumed.purge_from(6)
    resumed({"round": 10, "test_accuracy": 0.8})
    resumed.close()
    shown = read_tensorboard_scalars(tmp_path / "tensorboard")["test_accuracy"]
    assert [step for step, _ in shown] == [0, 5, 10]
    assert [value for _, value in shown] == pytest.approx([0.1, 0.5, 0.8])  # float32


def test_per_series_each_series_is_a_tensorboard_run_with_plain_tags(tmp_path):
    """A sweep's configs as TensorBoard runs (one folder each, named by the series), so
    TensorBoard overlays them; a purge drops the rounds of its own run only; closed, the
    sink opens new event files for later records."""
    pytest.importorskip("tensorboardX")
    sink = results.TensorBoardSink(tmp_path, per_series=True)
    a, b = "fedavg client_lr=0.1 seed=0", "scaffold client_lr=1e-05 seed=0"
    for r in (0, 5):
        sink({"series": a, "round": r, "test_accuracy": 0.1 + r / 10})
        sink({"series": b, "round": r, "test_accuracy": 0.2 + r / 10})
    sink.close()
    sink.purge_from(0, series=a)  # a resumed sweep writes a's records again
    sink({"series": a, "round": 0, "test_accuracy": 0.125})
    sink.close()
    runs = read_tensorboard_runs(tmp_path / "tensorboard")
    assert runs == {
        a: {"test_accuracy": [(0, 0.125)]},
        b: {"test_accuracy": [(0, pytest.approx(0.2)), (5, pytest.approx(0.7))]},
    }
    with pytest.raises(ValueError, match="needs a 'series' in every record"):
        sink({"round": 0, "test_accuracy": 0.5})


@pytest.mark.parametrize(
    "series, folder",
    [
        ("sgd similarity=0 client_lr=0.1 seed=1", "sgd similarity=0 client_lr=0.1 seed=1"),
        ("a/b c:d", "a-b c-d"),
        ("..", "series-.."),
    ],
)
def test_a_series_names_its_run_folder_with_what_a_file_name_holds(series, folder):
    assert results.tensorboard.run_folder_name(series) == folder


def test_results_and_its_sink_are_attributes_of_the_package_without_importing_them():
    """`import scaffold_jax as sj; sj.results.TensorBoardSink(...)` (the README's callback)
    works, and neither the results layer nor tensorboardX loads at `import scaffold_jax`."""
    code = (
        "import sys, scaffold_jax as sj\n"
        "assert 'scaffold_jax.results' not in sys.modules\n"
        "assert sj.results.TensorBoardSink.__name__ == 'TensorBoardSink'\n"
        "assert sj.experiments.RunConfig().algorithm == 'scaffold'\n"
        "assert 'tensorboardX' not in sys.modules\n"
        "try:\n    sj.no_such_thing\nexcept AttributeError as err:\n    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "module 'scaffold_jax' has no attribute 'no_such_thing'\n"
