"""A resume continues exactly the run it names, from the API as from the command line.

The identity a checkpoint carries covers what changes the computation (the data's
fingerprint, the algorithm's options, plugin code) and not what does not (an explicit
default, the folder the same data was read from); every statistic a record reports is
checkpointed; a record reaches a callback only once its checkpoint is written; the summary
comes from the records, so a resumed run's equals the uninterrupted one's.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_classification_clients

import scaffold_jax as sj
from scaffold_jax import checkpoint, results
from scaffold_jax.cli import main
from scaffold_jax.registry import ConfigError


def _sim(option=2):
    model = sj.models.logistic_regression((5,), 3)
    return sj.Simulation(sj.scaffold(model.loss_fn, option=option), model,
                         sj.BatchPlan.fixed(2, 4), 3)  # fmt: skip


def _data(seed=0):
    return sj.from_client_arrays(make_classification_clients([9, 7, 8, 6, 10], seed=seed))


HP = sj.hparams(client_lr=0.1)


# ----------------------------------------------------------------------------- the API
@pytest.mark.parametrize(
    ("change", "named"),
    [("data", "data_fingerprint"), ("option", "algorithm_options")],
    ids=["other data", "another SCAFFOLD option"],
)
def test_simulation_run_refuses_to_resume_onto_other_data_or_options(tmp_path, change, named):
    directory = tmp_path / "ckpt"
    _sim().run(_data(), HP, 4, eval_every=2, checkpoint_dir=directory)
    sim = _sim(option=1) if change == "option" else _sim()
    data = _data(seed=1) if change == "data" else _data()
    with pytest.raises(ConfigError, match=f"belongs to a different run .*{named}"):
        sim.run(data, HP, 6, eval_every=2, checkpoint_dir=directory, resume=True)
    # The same data and options resume.
    _sim().run(_data(), HP, 6, eval_every=2, checkpoint_dir=directory, resume=True)


def test_a_record_reaches_the_callback_only_after_its_checkpoint(tmp_path, monkeypatch):
    """A crash between a record and its checkpoint: the callback never saw that record,
    so the resumed run hands over every round exactly once in all."""
    reference = _sim().run(_data(), HP, 5, eval_every=1)
    directory, seen = tmp_path / "ckpt", []
    original = checkpoint.Checkpointer.save

    def save(self, state, key, extra=None, step=None):
        if step == 3:
            raise OSError(28, "No space left on device")
        return original(self, state, key, extra, step)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    with pytest.raises(OSError):  # a checkpoint at every evaluation (not the default)
        _sim().run(_data(), HP, 5, eval_every=1, checkpoint_dir=directory, checkpoint_every=1,
                   callback=seen.append)  # fmt: skip
    assert [r["round"] for r in seen] == [0, 1, 2]
    monkeypatch.undo()
    result = _sim().run(
        _data(), HP, 5, eval_every=1, checkpoint_dir=directory, resume=True, callback=seen.append
    )
    assert result.resumed_from == 2 and [r["round"] for r in seen] == [0, 1, 2, 3, 4, 5]
    strip = lambda records: [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    assert strip(seen) == strip(reference.records)


def test_the_means_a_record_reports_are_exact_after_a_resume_between_evaluations(tmp_path):
    """local_loss and client_drift are means over the rounds since the last evaluation;
    a checkpoint between two evaluations holds the rounds it has seen of them."""
    reference = _sim().run(_data(), HP, 8, eval_every=4)
    directory = tmp_path / "ckpt"
    _sim().run(_data(), HP, 8, eval_every=4, checkpoint_dir=directory, checkpoint_every=3,
               keep_checkpoints=10)  # fmt: skip
    assert checkpoint.Checkpointer(directory).rounds() == [0, 3, 6, 8]
    shutil.rmtree(directory / "8")  # a kill after round 6, a checkpoint between evaluations
    resumed = _sim().run(_data(), HP, 8, eval_every=4, checkpoint_dir=directory, resume=True)
    assert resumed.resumed_from == 6
    assert resumed.records[-1]["round"] == 8
    for name in ("local_loss", "client_drift"):
        assert resumed.records[-1][name] == reference.records[-1][name], name


@pytest.mark.parametrize(("share", "saved"), [(1.0, [0, 2, 4, 6, 8]), (1e-9, [0, 8])])
def test_the_default_cadence_saves_at_evaluations_within_its_share_of_the_time(
    tmp_path, monkeypatch, share, saved
):
    """Without checkpoint_every a checkpoint comes at an evaluation once the time since the
    last save is (1 - s) / s times what that save took: every evaluation when s = 1, only
    the start and the end when s is tiny; a resume from the sparse ones is exact."""
    from scaffold_jax.loop import driver

    monkeypatch.setattr(driver, "CHECKPOINT_SHARE", share)
    directory = tmp_path / "ckpt"
    result = _sim().run(_data(), HP, 8, eval_every=2, checkpoint_dir=directory, keep_checkpoints=10)
    assert checkpoint.Checkpointer(directory).rounds() == saved
    assert result.checkpoint_seconds > 0
    if share < 1:  # killed before the end: the resume runs again from round 0, exactly
        shutil.rmtree(directory / "8")
        resumed = _sim().run(_data(), HP, 8, eval_every=2, checkpoint_dir=directory, resume=True)
        strip = lambda records: [{k: v for k, v in r.items() if k != "seconds"} for r in records]
        assert resumed.resumed_from == 0 and strip(resumed.records) == strip(result.records)


def test_a_resume_under_other_library_versions_names_both_and_the_flag(tmp_path, monkeypatch):
    """The identity records jax, jaxlib and numpy's versions (not a hash of their files):
    a resume after an upgrade is refused naming both versions and --accept-new-versions,
    and goes on within accept_new_versions()."""
    from scaffold_jax import loop, versions

    directory = tmp_path / "ckpt"
    _sim().run(_data(), HP, 4, eval_every=2, checkpoint_dir=directory)
    saved = checkpoint.latest_extra(directory)["identity"]
    assert saved["versions"] == loop.library_versions()
    assert "plugin_code" not in json.dumps(saved) and "sha256" not in json.dumps(saved)
    newer = {**loop.library_versions(), "jax": "99.0.0"}
    monkeypatch.setattr(versions, "library_versions", lambda: newer)
    with pytest.raises(ConfigError) as refused:
        _sim().run(_data(), HP, 6, eval_every=2, checkpoint_dir=directory, resume=True)
    message = str(refused.value)
    assert f"written with jax {saved['versions']['jax']}, and this is jax 99.0.0" in message
    assert "--accept-new-versions" in message and "\n" not in message
    with loop.accept_new_versions():
        result = _sim().run(_data(), HP, 6, eval_every=2, checkpoint_dir=directory, resume=True)
    assert result.resumed_from == 4 and result.records[-1]["round"] == 6


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (dict(sampler=sj.sampling.make("poisson")), "sampler"),
        (dict(participation=sj.participation.make(dropouts="bernoulli")), "participation"),
    ],
    ids=["another sampler", "another participation model"],
)
def test_a_sweep_refuses_to_resume_under_another_sampler_or_participation(tmp_path, other, named):
    """A sweep's chunks carry a single run's identity (sweeps used to leave the sampler
    and the participation models out, and resumed under others)."""
    hp, seeds, _ = sj.sweep.grid(client_lr=[0.05, 0.1], seeds=[0])
    directory = tmp_path / "ckpt"
    args = dict(num_rounds=2, eval_every=2, checkpoint_dir=directory)
    sj.sweep.sweep(_sim(), _data(), hp, seeds, **args)
    with pytest.raises(ConfigError, match=f"belongs to a different run .*{named}: "):
        sj.sweep.sweep(_sim().replace(**other), _data(), hp, seeds, resume=True, **args)
    assert sj.sweep.sweep(_sim(), _data(), hp, seeds, resume=True, **args).num_chunks == 1


@pytest.mark.slow  # command-line runs resumed: ~10 s each
def test_the_command_line_refuses_other_versions_unless_accepted(tmp_path, monkeypatch, capsys):
    from scaffold_jax import loop, versions

    out = str(tmp_path / "run")
    assert main([*RUN, "--out", out]) == 0
    newer = {**loop.library_versions(), "numpy": "9.9.9"}
    monkeypatch.setattr(versions, "library_versions", lambda: newer)
    capsys.readouterr()
    assert main([*RUN, "--rounds", "8", "--out", out, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "this is numpy 9.9.9" in err and "--accept-new-versions" in err
    assert len(err.splitlines()) == 1
    assert main([*RUN, "--rounds", "8", "--out", out, "--resume", "--accept-new-versions"]) == 0
    assert results.read_records(out)[-1]["round"] == 8


# ----------------------------------------------------------------------------- the CLI
RUN = ["run", "--dataset", "synthetic", "--num-clients", "8", "--clients-per-round", "4",
       "--rounds", "6", "--eval-every", "2", "--quiet"]  # fmt: skip


def _summary(out):
    summary = results.read_summary(out)
    drop = ("updated_at", "started_at", "wall_seconds")
    return {k: v for k, v in summary.items() if k not in drop}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    return out


def test_a_resume_of_a_finished_run_keeps_its_summary(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = _summary(out)
    assert "mean_client_drift" in before["runs"]["scaffold"]
    assert main([*RUN, "--out", str(out), "--resume"]) == 0
    after = _summary(out)
    assert sorted(after.pop("files")) == sorted(before.pop("files"))
    assert after == before  # timing and drift included


@pytest.mark.parametrize(
    "explicit",
    [["--weighting", "uniform"], ["--server-optimizer", "sgd"], ["--set", "model=logreg"]],
    ids=lambda e: " ".join(e),
)
def test_an_explicit_default_resumes(finished, tmp_path, explicit):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert main([*RUN, "--out", str(out), "--resume", "--rounds", "8", *explicit]) == 0
    assert results.read_records(out)[-1]["round"] == 8


def test_an_explicit_default_hparam_of_fedprox_resumes(tmp_path):
    argv = [*RUN, "--algorithm", "fedprox", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    assert main([*argv, "--resume", "--prox-mu", "1"]) == 0
    assert main([*argv, "--resume", "--prox-mu", "0.5"]) == 2


def test_another_train_eval_sample_is_refused_on_resume(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert main([*RUN, "--out", str(out), "--resume", "--train-eval-examples", "10"]) == 2
    assert "train_eval_examples: 4096 in the run, 10 now" in capsys.readouterr().err


@pytest.mark.slow  # command-line runs resumed: ~10 s each
def test_the_same_data_from_another_folder_resumes_and_other_data_is_refused(tmp_path, capsys):
    """--data-dir may move (the data's fingerprint is compared, not the folder)."""
    fashion = Path("/usr/share/datasets/fashion-mnist")
    if not fashion.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist")
    copy = tmp_path / "copy"
    shutil.copytree(fashion, copy)
    argv = ["run", "--dataset", "fashion_mnist", "--max-train-examples", "600",
            "--max-test-examples", "100", "--num-clients", "6", "--rounds", "2", "--quiet",
            "--out", str(tmp_path / "run")]  # fmt: skip
    assert main([*argv, "--data-dir", str(fashion)]) == 0
    assert main([*argv, "--data-dir", str(copy), "--resume", "--rounds", "3"]) == 0
    # The copy changed in place: another test set. Refused before the folder is touched.
    config_before = (tmp_path / "run" / "config.json").read_text()
    import gzip

    for name in copy.glob("t10k-images*"):  # every test image inverted (16-byte header)
        gz = name.suffix == ".gz"
        raw = np.frombuffer(gzip.decompress(name.read_bytes()) if gz else name.read_bytes(),
                            np.uint8).copy()  # fmt: skip
        raw[16:] = 255 - raw[16:]
        name.write_bytes(gzip.compress(raw.tobytes()) if gz else raw.tobytes())
    capsys.readouterr()
    assert main([*argv, "--data-dir", str(copy), "--resume", "--rounds", "4"]) == 2
    err = capsys.readouterr().err
    assert "data_fingerprint" in err and "of another run" in err
    assert (tmp_path / "run" / "config.json").read_text() == config_before
    assert results.read_summary(tmp_path / "run")["status"] == "finished"


# ----------------------------------------------------------------------------- plugins
PLUGIN = """
import scaffold_jax as sj
from scaffold_jax.algorithms import register

def damped(loss_fn, server_optimizer=None):
    return sj.fedavg(loss_fn)._replace(name="damped")

register("damped", damped, "Damped", replace=True)
"""


def _plugin_run(tmp_path, plugin, *extra):
    return main([*RUN, "--algorithm", "damped", "--plugin", str(plugin),
                 "--out", str(tmp_path / "run"), *extra])  # fmt: skip


@pytest.mark.slow  # command-line runs resumed: ~10 s each
def test_a_plugin_edited_since_the_run_is_refused_on_resume(tmp_path, capsys):
    plugin = tmp_path / "damped.py"
    plugin.write_text(PLUGIN)
    assert _plugin_run(tmp_path, plugin) == 0
    assert _plugin_run(tmp_path, plugin, "--resume", "--rounds", "8") == 0  # unchanged: fine
    plugin.write_text(PLUGIN + "\n# a change\n")
    from scaffold_jax import registry

    registry.restore(registry.snapshot())  # the edited file is imported again below
    import sys

    for name in [n for n in sys.modules if n.startswith("scaffold_jax_plugin_damped")]:
        del sys.modules[name]
    capsys.readouterr()
    assert _plugin_run(tmp_path, plugin, "--resume", "--rounds", "10") == 2
    assert "plugin_code" in capsys.readouterr().err


def test_a_plugin_that_replaces_a_built_in_is_refused_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    plugin = tmp_path / "override.py"
    plugin.write_text(PLUGIN.replace('register("damped", damped, "Damped"',
                                     'register("scaffold", damped, "Not SCAFFOLD"'))  # fmt: skip
    capsys.readouterr()
    code = main([*RUN, "--out", str(out), "--resume", "--rounds", "8", "--plugin", str(plugin)])
    assert code == 2
    err = capsys.readouterr().err
    assert "plugin_code" in err and "algorithm scaffold" in err
    assert results.read_summary(out)["status"] == "finished"


def test_two_plugin_files_of_one_name_are_both_imported(tmp_path):
    from scaffold_jax.algorithms import ALGORITHMS
    from scaffold_jax.registry import load_plugins

    for folder, name in (("a", "first_x"), ("b", "second_x")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same.py").write_text(
            PLUGIN.replace('"damped", damped, "Damped"', f'"{name}", damped, "{name}"')
        )
    first, second = load_plugins([tmp_path / "a" / "same.py", tmp_path / "b" / "same.py"])
    assert first != second and {"first_x", "second_x"} <= set(ALGORITHMS.names())


@pytest.mark.parametrize(
    ("body", "code", "says"),
    [
        ("import sys\nsys.exit(0)\n", 2, "called sys.exit(0) while importing"),
        (PLUGIN.replace('return sj.fedavg(loss_fn)._replace(name="damped")', "return None"),
         2, "its factory scaffold_jax_plugin_broken.damped returned NoneType, not an Algorithm"),
        (PLUGIN.replace('return sj.fedavg(loss_fn)._replace(name="damped")',
                        "return {}['missing']"),
         1, "a plugin failed at "),
    ],
    ids=["sys.exit", "factory returns None", "a bug in the plugin"],
)  # fmt: skip
def test_a_broken_plugin_is_one_line_naming_it(tmp_path, capsys, body, code, says):
    plugin = tmp_path / "broken.py"
    plugin.write_text(body)
    assert _plugin_run(tmp_path, plugin) == code
    err = capsys.readouterr().err.strip()
    assert says in err and err.count("\n") == 0 and "Traceback" not in err
    if code == 1:
        assert "broken.py:" in err and "KeyError" in err


# ----------------------------------------------------------------------------- exit codes
def test_a_runtime_failure_exits_1_and_a_usage_error_2(tmp_path, capsys):
    # Divergence: the arguments were valid, the run failed.
    assert (
        main([*RUN, "--client-lr", "1e30", "--server-lr", "1e30", "--out", str(tmp_path / "d")])
        == 1
    )
    assert results.read_summary(tmp_path / "d")["status"] == "diverged"
    # More rounds done than asked on resume: a usage error.
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*RUN, "--out", str(out), "--resume", "--rounds", "4"]) == 2
    assert "pass a larger num_rounds" in capsys.readouterr().err


def test_a_sigterm_summary_says_where_it_stopped(tmp_path):
    from scaffold_jax.loop import RunTerminated

    writer = results.RunWriter(tmp_path / "run", {"algorithm": "sgd"})
    with pytest.raises(RunTerminated), writer:
        raise RunTerminated("SIGTERM received: stopped after round 3 (checkpoint ...).", None)
    error = json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert error == "RunTerminated: SIGTERM received: stopped after round 3 (checkpoint ...)."


@pytest.mark.slow  # two real tables (~15 s)
def test_a_table_resumed_with_dataset_auto_keeps_the_dataset_it_resolved(tmp_path, monkeypatch):
    """`reproduce table3 --dataset auto`, resumed after EMNIST became available, goes on
    with the dataset its folder holds: one table, one dataset."""
    from scaffold_jax.paper import runs

    asked = []
    original = runs.resolve_dataset

    def resolve(name, *args):
        asked.append(name)
        return original("fashion_mnist" if name == "auto" else name, *args)

    monkeypatch.setattr(runs, "resolve_dataset", resolve)  # reproduce_table loads with it
    argv = ["reproduce", "table3", "--quick", "--quiet", "--out", str(tmp_path / "t"),
            "--set", "similarities=[0.0]", "--set", "num_rounds=2", "--lr-grid", "0.1"]  # fmt: skip
    assert main(argv) == 0
    assert main([*argv, "--resume"]) == 0
    assert asked == ["auto", "fashion_mnist"]


# ------------------------------------------------- what the run computes, not its spelling
SMALL = ["run", "--dataset", "synthetic", "--num-clients", "2", "--clients-per-round", "2",
         "--rounds", "2", "--eval-every", "1", "--quiet"]  # fmt: skip
DEVICES = "seconds_per_example,down_bytes_per_s,up_bytes_per_s\n0.01,1e6,1e6\n0.02,1e6,1e6\n"


@pytest.mark.slow  # command-line runs resumed: ~6 s
def test_the_compressed_entries_spelled_out_resume_as_all(tmp_path, capsys):
    argv = [*SMALL, "--compression", "topk", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    spelled = ["--compress-entries", "delta_control,delta_params"]  # SCAFFOLD's two, reordered
    assert main([*argv, "--resume", "--rounds", "3", *spelled]) == 0
    assert main([*argv, "--resume", "--rounds", "4", "--compress-entries", "delta_params"]) == 2
    assert "compress_entries: 'all' in the run, 'delta_params' now" in capsys.readouterr().err


def test_the_same_devices_at_another_path_resume_and_other_devices_are_refused(tmp_path, capsys):
    first, moved = tmp_path / "devices.csv", tmp_path / "elsewhere.csv"
    first.write_text(DEVICES)
    moved.write_text(DEVICES + "5,1,1\n")  # and a row no client of N = 2 reads
    argv = [*SMALL, "--profiles", "file", "--out", str(tmp_path / "run")]
    assert main([*argv, "--profile-file", str(first)]) == 0
    assert main([*argv, "--profile-file", str(moved), "--resume", "--rounds", "3"]) == 0
    assert results.read_records(tmp_path / "run")[-1]["round"] == 3
    other = tmp_path / "other.csv"
    other.write_text(DEVICES.replace("0.02", "0.03"))  # a row a client reads
    assert main([*argv, "--profile-file", str(other), "--resume", "--rounds", "4"]) == 2
    assert "holds another run (profile_file" in capsys.readouterr().err


@pytest.mark.slow  # command-line runs resumed: ~10 s each
def test_a_sweep_resumes_with_its_grid_values_in_another_order(tmp_path):
    argv = ["sweep", "--dataset", "synthetic", "--clients-per-round", "2", "--rounds", "2",
            "--eval-every", "1", "--quiet", "--out", str(tmp_path / "sweep")]  # fmt: skip
    assert main([*argv, "--lr-grid", "0.1", "0.3", "--grid", "num_clients=4,6"]) == 0
    rows = lambda: sorted((tmp_path / "sweep" / "sweep.csv").read_text().splitlines())  # noqa: E731
    before = rows()
    assert main([*argv, "--lr-grid", "0.3", "0.1", "--grid", "num_clients=6,4", "--resume"]) == 0
    assert rows() == before  # the same configs, the same results (listed in the new order)
