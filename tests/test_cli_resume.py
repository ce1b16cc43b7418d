"""`scaffold-jax run` never loses work: checkpoints in the run folder, `--resume` after
SIGKILL / SIGINT / SIGTERM continues bit for bit with every evaluation round recorded
exactly once, wrong resumes are refused, and a live run's folder is locked.

The runs are real `scaffold-jax run` processes (a small Fashion-MNIST subset, evaluation
and a checkpoint every round, so that a kill can land anywhere: while compiling, mid-block,
while a checkpoint is written, right after a record is flushed).
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_folder_final_state

from scaffold_jax import experiments, results
from scaffold_jax.cli import main

FASHION = "/usr/share/datasets/fashion-mnist"
pytestmark = pytest.mark.skipif(
    not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist (CI installs it)"
)
ROUNDS = 12
TINY = f"""
algorithm = "scaffold"
dataset = "fashion_mnist"
max_train_examples = 2000
max_test_examples = 500
num_clients = 10
clients_per_round = 5
local_epochs = 1
client_lr = 0.1
rounds = {ROUNDS}
eval_every = 1
targets = [0.5, 0.7]
"""
#: The same run asynchronous (FedBuff: 6 clients in flight, steps of 3 arrivals; no S,
#: which FedBuff refuses: M and B say how many clients train).
FEDBUFF = (
    TINY.replace("clients_per_round = 5\n", "")
    + """
profiles = "lognormal"
execution = "fedbuff"
concurrency = 6
buffer_size = 3
"""
)
#: What FedBuff composes with (the manual's composition table), one at a time in the slow
#: tier and all at once in the quick tier.
COMPOSED = {
    "topk": 'compression = "topk"\ncompress_fraction = 0.1\n',
    "markov": 'availability = "markov"\navailability_rate = 0.6\n',
    "dropouts": 'dropouts = "bernoulli"\ndropout_rate = 0.3\n',
    "stragglers": 'stragglers = "uniform"\nstraggler_min_steps = 1\n',
    "deadline": "round_deadline = 1.5\n",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The config file and a persistent compilation cache shared by the processes."""
    root = tmp_path_factory.mktemp("cli_resume")
    (root / "tiny.toml").write_text(TINY)
    (root / "fedbuff.toml").write_text(FEDBUFF)
    (root / "fedbuff_all.toml").write_text(FEDBUFF + "".join(COMPOSED.values()))
    for name, lines in COMPOSED.items():
        (root / f"fedbuff_{name}.toml").write_text(FEDBUFF + lines)
    cache = root / "jax_cache"
    environment = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    return root, environment


def _argv(root, out, *extra, config="tiny.toml"):
    config = str(root / config)
    # A checkpoint every round (not the default cadence): a kill can land in any save.
    return [sys.executable, "-m", "scaffold_jax.cli", "run", "--config", config,
            "--out", str(out), "--quiet", "--checkpoint-every", "1", *extra]  # fmt: skip


def _run(root, environment, out, *extra, config="tiny.toml"):
    return subprocess.run(
        _argv(root, out, *extra, config=config), env=environment, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def _lines(out) -> int:
    path = Path(out) / results.METRICS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def _final_state(out):
    return run_folder_final_state(out, ROUNDS)


def _comparable(out):
    records = [{k: v for k, v in r.items() if k != "seconds"} for r in results.read_records(out)]
    summary = results.read_summary(out)
    keys = ("status", "rounds_to_target", "best_test_accuracy", "dataset", "targets")
    return records, {k: summary.get(k) for k in keys}


@pytest.fixture(scope="module")
def reference(env):
    root, environment = env
    out = root / "reference"
    proc = _run(root, environment, out)
    assert proc.returncode == 0, proc.stderr
    return {"out": out, "state": _final_state(out), "compare": _comparable(out)}


def _resume_matches(root, environment, out, reference, config="tiny.toml") -> bool:
    proc = _run(root, environment, out, "--resume", config=config)
    assert proc.returncode == 0, proc.stderr
    records, summary = _comparable(out)
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))  # each exactly once
    _assert_csv_is_the_records(out)  # rewritten from the kept records, then row by row
    assert (records, summary) == reference["compare"]
    for mine, theirs in zip(_final_state(out), reference["state"], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert not (Path(out) / results.LOCK_FILE).exists()
    return True


def _kill_after(root, environment, out, records: int, delay: float, sig=signal.SIGKILL,
                config="tiny.toml"):  # fmt: skip
    """Starts a run, waits for ``records`` records (0: for ``delay`` seconds from the
    start), then ``delay`` seconds more, and sends ``sig``."""
    # A shell that started the tests in the background (`make test &`) ignores SIGINT in
    # them, and Python keeps an inherited SIG_IGN: the run gets Python's own SIGINT
    # handler first, as when started from a terminal (not a preexec_fn: that forks a
    # multithreaded JAX process).
    python, _, module, *args = _argv(root, out, config=config)
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = [{module!r}, *sys.argv[1:]]; runpy.run_module({module!r}, run_name='__main__')"
    )
    proc = subprocess.Popen(
        [python, "-c", start, *args], env=environment, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while records and _lines(out) < records and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


# (records written, then seconds): mid-run in the quick tier, while compiling and right after
# a record with the slow tests.
KILL_POINTS = [(0, 0.3), (2, 0.0), (5, 0.02)]
QUICK_KILL_POINTS = [
    p if p == (5, 0.02) else pytest.param(*p, marks=pytest.mark.slow) for p in KILL_POINTS
]
MORE_KILL_POINTS = [(0, 1.0), (0, 2.0), (1, 0.0), (3, 0.001), (4, 0.05), (6, 0.0), (7, 0.01),
                    (8, 0.1), (10, 0.0), (11, 0.003), (12, 0.0), (13, 0.0)]  # fmt: skip


def _assert_csv_is_the_records(out) -> None:
    """metrics.csv, written row by row as metrics.jsonl, holds the records so far: all of
    them, or all but the last when the kill fell between the two files' writes (so after a
    kill at the second record, the CSV may hold only the first)."""
    import csv

    records = results.read_records(out)
    with open(Path(out) / results.CSV_FILE, newline="") as f:
        rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert len(records) - len(rows) in (0, 1) and len(rows) >= 1
    assert rows == [{k: str(v) for k, v in r.items()} for r in records[: len(rows)]]


@pytest.mark.parametrize(("records", "delay"), QUICK_KILL_POINTS)
def test_sigkill_then_resume_is_the_uninterrupted_run(env, reference, records, delay, tmp_path):
    root, environment = env
    code, _ = _kill_after(root, environment, tmp_path / "run", records, delay)
    assert code == -signal.SIGKILL  # it died mid-run
    if records >= 2:
        _assert_csv_is_the_records(tmp_path / "run")
    assert _resume_matches(root, environment, tmp_path / "run", reference)


def _killed_fedbuff_resumes(env, config, records, delay, tmp_path):
    """The uninterrupted run of ``config``, then one killed after ``records`` records and
    resumed: the same records, summary and final state bit for bit."""
    root, environment = env
    proc = _run(root, environment, tmp_path / "reference", config=config)
    assert proc.returncode == 0, proc.stderr
    reference = {"state": _final_state(tmp_path / "reference"),
                 "compare": _comparable(tmp_path / "reference")}  # fmt: skip
    out = tmp_path / "run"
    code, _ = _kill_after(root, environment, out, records, delay, config=config)
    assert code == -signal.SIGKILL
    assert _resume_matches(root, environment, out, reference, config=config)
    return results.read_records(out)


@pytest.mark.parametrize(
    ("records", "delay"),
    [pytest.param(5, 0.02, marks=pytest.mark.slow), pytest.param(2, 0.0, marks=pytest.mark.slow)],
)
def test_a_killed_fedbuff_run_resumes_to_the_uninterrupted_one(env, records, delay, tmp_path):
    """Asynchronous too, with every feature it composes with at once (top-k with error
    feedback, Markov availability, dropouts, stragglers, a deadline): the in-flight table
    (who is training since when, on which version, with which update, whether its upload
    will count) is in the checkpoint, so SIGKILL mid-run and --resume give the
    uninterrupted FedBuff run bit for bit, virtual time included."""
    kept = _killed_fedbuff_resumes(env, "fedbuff_all.toml", records, delay, tmp_path)
    assert all("virtual_time" in r for r in kept[1:])
    assert sum(r["dropped"] + r["late"] for r in kept[1:]) > 0  # uploads were lost
    assert min(r["available"] for r in kept[1:]) < 10  # and clients offline


@pytest.mark.slow
@pytest.mark.parametrize("composed", sorted(COMPOSED))
def test_each_fedbuff_composition_resumes_after_sigkill(env, composed, tmp_path):
    """FedBuff SCAFFOLD with each feature alone, from the command line: it runs to the end
    and a SIGKILL mid-run resumes to the uninterrupted run bit for bit."""
    kept = _killed_fedbuff_resumes(env, f"fedbuff_{composed}.toml", 4, 0.01, tmp_path)
    assert kept[-1]["round"] == ROUNDS and kept[-1]["virtual_time"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(("records", "delay"), MORE_KILL_POINTS)
def test_sigkill_at_many_points_then_resume(env, reference, records, delay, tmp_path):
    root, environment = env
    code, _ = _kill_after(root, environment, tmp_path / "run", records, delay)
    # After the last record the run still writes its final checkpoint, CSV and plots.
    assert code == -signal.SIGKILL or records == ROUNDS + 1
    assert _resume_matches(root, environment, tmp_path / "run", reference)


@pytest.mark.parametrize(
    ("sig", "status"),  # SIGTERM's line and status are also tested in process (test_cli)
    [
        pytest.param(sig, code, marks=pytest.mark.slow)
        for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143))
    ],
)
def test_sigint_and_sigterm_stop_cleanly_and_resume(env, reference, sig, status, tmp_path):
    root, environment = env
    out = tmp_path / "run"
    # After 2 of the 13 records: the rest of the run must outlast the signal's delivery
    # (a run that finishes first exits 0 with the signal never seen).
    code, _ = _kill_after(root, environment, out, 2, 0.0, sig=sig)
    assert code == status
    summary = results.read_summary(out)
    assert summary["status"] == "interrupted"
    assert not (out / results.LOCK_FILE).exists()  # released on the way out
    assert _resume_matches(root, environment, out, reference)


@pytest.mark.slow
def test_a_stale_lock_after_sigkill_says_interrupted_and_blocks_nothing(env, tmp_path):
    root, environment = env
    out = tmp_path / "run"
    code, _ = _kill_after(root, environment, out, 3, 0.0)
    assert code == -signal.SIGKILL
    assert (out / results.LOCK_FILE).exists()  # left behind by the killed process
    assert results.read_summary(out)["status"] == "running"
    # Any later command recognises it (the process is gone) and says what happened.
    proc = _run(root, environment, out)
    assert proc.returncode == 1 and "--resume to continue it" in proc.stderr
    summary = results.read_summary(out)
    assert summary["status"] == "interrupted" and "SIGKILL" in summary["error"]
    assert not (out / results.LOCK_FILE).exists()


def test_a_live_run_folder_is_locked_even_against_overwrite(env, tmp_path, capsys):
    root, _ = env
    out = tmp_path / "run"
    out.mkdir()
    # A lock held by a live process of this host (this test's parent: always alive).
    lock = {"pid": os.getppid(), "host": __import__("platform").node(), "started": "now"}
    (out / results.LOCK_FILE).write_text(json.dumps(lock))
    for extra in ([], ["--overwrite"], ["--resume"]):
        code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), *extra])
        assert code in (1, 2)
        err = capsys.readouterr().err
        assert "is in use by a running scaffold-jax" in err
    assert json.loads((out / results.LOCK_FILE).read_text()) == lock  # untouched


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (["--similarity", "10"], "similarity"),
        (["--max-train-examples", "1500"], "max_train_examples"),
        (["--set", "scaffold_option=I"], "scaffold_option"),  # each option by its name
        (["--client-lr", "0.2"], "client_lr"),
        (["--seed", "1"], "seed"),
        (["--train-eval-examples", "100"], "train_eval_examples"),  # records' estimator
    ],
)
def test_a_resume_with_other_settings_is_refused_naming_the_field(
    env, reference, change, field, tmp_path, capsys
):
    root, _ = env
    out = tmp_path / "run"
    import shutil

    shutil.copytree(reference["out"], out)
    code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), "--resume",
                 "--quiet", *change])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and f"{field}:" in err


def test_a_run_of_a_version_without_the_newer_settings_resumes(env, reference, tmp_path):
    """A config.json written before a setting existed (here the client sampler)
    resumes: the missing setting ran at its default."""
    import shutil

    root, _ = env
    out = tmp_path / "run"
    shutil.copytree(reference["out"], out)
    saved = json.loads((out / "config.json").read_text())
    del saved["sampler"]  # a field added since
    (out / "config.json").write_text(json.dumps(saved))
    code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), "--resume",
                 "--quiet"])  # fmt: skip
    assert code == 0
    # A setting that differs from its default is still refused.
    saved["partition_seed"] = 11
    (out / "config.json").write_text(json.dumps(saved))
    code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), "--resume",
                 "--quiet"])  # fmt: skip
    assert code == 2


@pytest.mark.slow
def test_another_runs_checkpoint_copied_in_is_refused(env, reference, tmp_path, capsys):
    """The config matches, but the newest checkpoint belongs to a run on other data."""
    root, environment = env
    other = tmp_path / "other"
    assert _run(root, environment, other, "--set", "similarity=50", "--rounds", "2").returncode == 0
    out = tmp_path / "run"
    import shutil

    shutil.copytree(reference["out"], out)
    ckpts = out / experiments.CHECKPOINTS
    shutil.rmtree(ckpts)
    shutil.copytree(other / experiments.CHECKPOINTS, ckpts)
    code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), "--resume",
                 "--quiet"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    # Refused before the folder is touched, naming each difference.
    assert "holds checkpoints of" in err and "data_fingerprint" in err
    assert results.read_summary(out)["status"] == "finished"
    assert "partition" in err


@pytest.mark.slow
def test_more_rounds_and_another_cadence_are_allowed(env, reference, tmp_path):
    root, environment = env
    out = tmp_path / "run"
    import shutil

    shutil.copytree(reference["out"], out)
    proc = _run(
        root, environment, out, "--resume", "--rounds", str(ROUNDS + 4), "--eval-every", "2"
    )
    assert proc.returncode == 0, proc.stderr
    rounds = [r["round"] for r in results.read_records(out)]
    assert rounds == [*range(ROUNDS + 1), ROUNDS + 2, ROUNDS + 4]
    assert results.read_summary(out)["status"] == "finished"


def _steps(folder) -> list[int]:
    return sorted(int(p.name) for p in Path(folder).iterdir() if p.name.isdigit())


@pytest.mark.slow  # two command-line processes; the quick tier has test_checkpoint.py's
def test_a_finished_run_keeps_its_final_checkpoint_unless_told(env, reference, tmp_path):
    """Checkpointed every round, a finished run leaves its final state only (all that
    --resume with more rounds needs: test_more_rounds_and_another_cadence_are_allowed);
    --keep-checkpoints (config key keep_checkpoints) keeps more, and may change on resume."""
    root, environment = env
    assert _steps(reference["out"] / experiments.CHECKPOINTS) == [ROUNDS]
    out = tmp_path / "kept"
    proc = _run(root, environment, out, "--rounds", "4", "--keep-checkpoints", "3")
    assert proc.returncode == 0, proc.stderr
    assert _steps(out / experiments.CHECKPOINTS) == [2, 3, 4]
    assert json.loads((out / "config.json").read_text())["keep_checkpoints"] == 3
    proc = _run(root, environment, out, "--rounds", "6", "--resume")
    assert proc.returncode == 0, proc.stderr
    assert _steps(out / experiments.CHECKPOINTS) == [6]


@pytest.mark.slow  # a sweep of two cells; the quick tier has test_checkpoint.py's
def test_a_finished_sweep_keeps_one_checkpoint_per_chunk(env, tmp_path):
    root, _ = env
    out = tmp_path / "sweep"
    code = main(["sweep", "--config", str(root / "tiny.toml"), "--algorithms", "fedavg",
                 "scaffold", "--lr-grid", "0.1", "0.3", "--rounds", "3", "--checkpoint-every",
                 "1", "--out", str(out), "--quiet"])  # fmt: skip
    assert code == 0
    chunks = sorted((out / experiments.CHECKPOINTS).glob("*/chunk-*"))
    assert len(chunks) == 2  # one cell per algorithm, one chunk each
    assert all(_steps(chunk) == [3] for chunk in chunks)


@pytest.mark.slow
def test_a_full_disk_is_one_clear_line_and_the_run_resumes_afterwards(
    env, reference, tmp_path, monkeypatch, capsys
):
    root, environment = env
    out = tmp_path / "run"
    original = results.RunWriter.open

    def open_on_a_filling_disk(self):
        original(self)
        metrics = self._metrics

        class Full:  # ENOSPC once 5 records are written
            written = 0

            def write(self, text):
                Full.written += 1
                if Full.written > 5:
                    raise OSError(28, "No space left on device")
                return metrics.write(text)

            def __getattr__(self, name):
                return getattr(metrics, name)

        self._metrics = Full()

    monkeypatch.setattr(results.RunWriter, "open", open_on_a_filling_disk)
    code = main(["run", "--config", str(root / "tiny.toml"), "--out", str(out), "--quiet"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "No space left on device" in err and "--resume" in err
    assert [r["round"] for r in results.read_records(out)] == [0, 1, 2, 3, 4]
    summary = results.read_summary(out)
    assert summary["status"] == "failed" and "No space left" in summary["error"]
    monkeypatch.undo()  # space freed
    assert _resume_matches(root, environment, out, reference)


def _start(environment, out, argv):
    """A `scaffold-jax` process writing ``out``."""
    return subprocess.Popen(
        [sys.executable, "-m", "scaffold_jax.cli", *argv, "--out", str(out), "--quiet"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _kill_when(proc, out, records: int, within: float = 120) -> None:
    """SIGKILL once ``out`` holds ``records`` records (0: two seconds in, compiling)."""
    deadline = time.monotonic() + within
    while _lines(out) < records:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(0.0 if records else 2.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def _without_timing(value):
    """A summary or record without what measures time (it differs between any two runs):
    keys naming seconds, dates, and a table's "Wall time" line."""
    if isinstance(value, str):
        return "\n".join(line for line in value.splitlines() if "Wall time" not in line)
    if isinstance(value, dict):
        return {
            k: _without_timing(v) for k, v in value.items()
            if "seconds" not in k and k not in ("started_at", "updated_at", "files")
        }  # fmt: skip
    if isinstance(value, list):
        return [_without_timing(v) for v in value]
    return value


@pytest.mark.parametrize(
    "records",
    [pytest.param(n, marks=pytest.mark.slow) for n in (10, 0, 4 * 7 + 4, 2 * 4 * 7 - 1)],
)  # mid first grid, while compiling, mid second grid, its last record; a sweep's resume is
# tested in process in the quick tier (test_lab_plugin, test_participation)
def test_a_killed_sweep_resumes_keeping_the_finished_grids(env, tmp_path, records):
    """Two algorithms: killed mid-grid, --resume keeps a finished grid and continues the
    unfinished one from its checkpoint; the records (each once), sweep.json and
    summary.json (timing excluded) are those of an uninterrupted sweep, and so is what
    TensorBoard shows: each config's run holds each round once, the records' values."""
    root, environment = env
    argv = ["sweep", "--algorithms", "fedavg", "scaffold", "--lr-grid", "0.1", "0.3",
            "--seeds", "0", "1", "--rounds", "6", "--eval-every", "1",
            "--checkpoint-every", "1", "--target", "0.5"]  # fmt: skip
    tensorboard = importlib.util.find_spec("tensorboardX") is not None
    if tensorboard:
        argv.append("--tensorboard")

    argv += ["--config", str(root / "tiny.toml")]
    full = _start(environment, tmp_path / "full", argv)
    assert full.wait(timeout=300) == 0, full.stderr.read()
    out = tmp_path / "killed"
    _kill_when(_start(environment, out, argv), out, records)
    resumed = _start(environment, out, [*argv, "--resume"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()

    def comparable(folder):
        records = [
            {k: v for k, v in r.items() if k != "seconds"} for r in results.read_records(folder)
        ]
        sweep = json.loads((folder / "sweep.json").read_text())
        return records, sweep["summary"]

    records, summary = comparable(out)
    assert len(records) == 2 * 4 * 7  # 2 algorithms x 4 configs x rounds 0..6, once each
    assert (records, summary) == comparable(tmp_path / "full")
    assert results.read_summary(out)["status"] == "finished"
    assert _without_timing(results.read_summary(out)) == _without_timing(
        results.read_summary(tmp_path / "full")
    )
    if tensorboard:
        from test_results import read_tensorboard_runs

        shown = read_tensorboard_runs(out / "tensorboard")
        assert set(shown) == {r["series"] for r in records}  # 8 configs, a run each
        for series, scalars in shown.items():
            assert scalars["test_accuracy"] == [
                (r["round"], float(np.float32(r["test_accuracy"])))
                for r in records
                if r["series"] == series
            ]


@pytest.mark.slow
@pytest.mark.parametrize("records", [0, 40, 120, 180])
def test_a_killed_table3_resumes_to_the_uninterrupted_table(env, tmp_path, records):
    """`reproduce table3 --quick` killed at any point (while compiling, in a cell, between
    cells, in the last ones) and resumed: the records (each once), the table and the
    summary (timing excluded) are the uninterrupted run's."""
    root, environment = env

    argv = ["reproduce", "table3", "--quick"]
    full = root / "table3-full"
    if not full.exists():
        proc = _start(environment, full, argv)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()
    out = tmp_path / "killed"
    _kill_when(_start(environment, out, argv), out, records, within=300)
    resumed = _start(environment, out, [*argv, "--resume"])
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()

    def comparable(folder):
        records = sorted(
            (_without_timing(r) for r in results.read_records(folder)),
            key=lambda r: (r["series"], r["round"]),
        )
        return (
            records,
            _without_timing((folder / "table3.md").read_text()),
            _without_timing(results.read_summary(folder)),
        )

    assert comparable(out) == comparable(full)
