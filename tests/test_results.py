"""The run folder writer, rounds-to-target and the paper-style tables."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

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
