"""Bad inputs on the command line: each is refused before anything runs, with an error that
names it and no traceback; a usage error exits 2, a run that cannot start for missing or
damaged data exits 1.

The library calls behind these are cases of ``tests/test_bad_inputs.py`` (their exact
messages); here the command line is checked end to end, in-process, on tiny inputs.
"""

from __future__ import annotations

import json

import pytest

from scaffold_jax.cli import main
from scaffold_jax.experiments import RunConfig

# A tiny run that never starts: every case below is refused first.
QUAD = ["--dataset", "quadratic", "--num-clients", "4", "--rounds", "1"]


def refused(argv: list[str], capsys, tmp_path, code: int | None = 2) -> str:
    """Runs ``scaffold-jax ARGV`` (output under ``tmp_path``) and returns its error text,
    after checking the exit status (None: any failure), that nothing but the error was
    printed and that it is no traceback."""
    command, *rest = argv
    extra = ["--quiet", "--no-compile-cache", "--out", str(tmp_path / "out")]
    if command in ("run", "sweep"):
        extra.append("--no-checkpoint")
    status = main([command, *rest, *extra])
    assert status == code if code is not None else status in (1, 2)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err.startswith("scaffold-jax: error: "), err
    assert not (tmp_path / "out").exists()  # refused before the folder was made
    return err


def one_error(err: str) -> str:
    """The single error of a refusal (a config's errors are listed one per line under
    ``invalid config:``)."""
    lines = err.removeprefix("scaffold-jax: error: ").strip().splitlines()
    if lines[0].endswith(("invalid config:", "protocol:")):
        lines = lines[1:]
    assert len(lines) == 1, lines
    return lines[0].strip()


# ------------------------------------------------------------ 1. step sizes below float32
@pytest.mark.parametrize(
    ("flag", "value"), [("--client-lr", "1e-50"), ("--server-lr", "1e-45"), ("--prox-mu", "1e-40")]
)
def test_a_step_size_that_underflows_float32_is_a_usage_error(flag, value, capsys, tmp_path):
    algorithm = ["--algorithm", "fedprox"] if flag == "--prox-mu" else []
    err = refused(["run", *QUAD, *algorithm, flag, value], capsys, tmp_path)
    name = flag[2:].replace("-", "_")
    assert one_error(err).startswith(f"{name} = {value} underflows float32 (smallest normal")


# ------------------------------------------------------------ 2. local steps and rounds
@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--local-steps", "1000000000"], "local_steps = 1000000000"),
        (["--batch-fraction", "1e-9"], "batch_fraction = 1e-09"),
        (["--local-epochs", "100000000"], "local_epochs = 100000000"),
        (["--set", "local_steps=1000000"], "local_steps = 1000000"),
        (["--batch-size", "2", "--local-epochs", "200000"], "local_epochs = 200000"),
    ],
)
def test_a_plan_of_too_many_local_steps_is_a_usage_error(flags, names, capsys, tmp_path):
    error = one_error(refused(["run", *QUAD, *flags], capsys, tmp_path))
    assert names in error and "at most 100000 local steps per round" in error


@pytest.mark.parametrize("rounds", ["2000000000", "1000000000000"])
def test_more_rounds_than_a_run_can_hold_is_a_usage_error(rounds, capsys, tmp_path):
    """2e9 rounds hung silently before compiling; 1e12 overflowed."""
    error = one_error(refused(["run", *QUAD[:-2], "--rounds", rounds], capsys, tmp_path))
    assert error.startswith(f"rounds = {rounds} is invalid: it must be an integer >= 1 and <=")


# ------------------------------------------------------------ 3. optimizer parameters
@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("adam:b1=2", "b1 = 2.0 is invalid: it must be a number in [0, 1)"),
        ("adam:b2=1", "b2 = 1.0 is invalid: it must be a number in [0, 1)"),
        ("momentum:momentum=-0.5", "momentum = -0.5 is invalid: it must be a number in [0, 1)"),
        ("fedadam:tau=0", "tau = 0.0 is invalid: it must be a number > 0"),
        ("adagrad:initial_accumulator=-1", "initial_accumulator = -1.0 is invalid"),
        ("adam:b1=0.5,b1=0.6", "b1 is given twice; give it once"),
    ],
)
def test_an_optimizer_parameter_out_of_range_is_a_usage_error(spec, says, capsys, tmp_path):
    error = one_error(refused(["run", *QUAD, "--server-optimizer", spec], capsys, tmp_path))
    assert error.startswith(f"server_optimizer = {spec!r} is invalid") and says in error


# ------------------------------------------------------------ 4. a data dir without the data
def test_a_data_dir_without_the_dataset_is_refused_not_searched_past(capsys, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train-images-idx3-ubyte").write_bytes(b"")
    argv = ["run", "--data-dir", str(tmp_path / "data"), "--num-clients", "2", "--rounds", "1"]
    error = one_error(refused(argv, capsys, tmp_path, code=1))
    assert error.startswith(f"data_dir {tmp_path / 'data'} lacks the IDX files of fashion_mnist")
    assert "t10k-labels-idx1-ubyte[.gz]" in error


def test_femnist_without_its_test_split_names_the_folder(capsys, tmp_path):
    train = tmp_path / "leaf" / "train"
    train.mkdir(parents=True)
    user = {"x": [[0.0] * 784] * 2, "y": [0, 1]}
    (train / "a.json").write_text(json.dumps({"users": ["w"], "user_data": {"w": user}}))
    argv = ["run", "--dataset", "femnist", "--data-dir", str(tmp_path / "leaf"), "--rounds", "1"]
    error = one_error(refused([*argv, "--num-clients", "1"], capsys, tmp_path, code=1))
    assert error.startswith(f"{tmp_path / 'leaf' / 'test'} does not exist")
    assert "--data-dir" in error and "test=None" not in error


def test_a_garbage_femnist_h5_file_is_named(capsys, tmp_path):
    pytest.importorskip("h5py")
    for name in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
        (tmp_path / name).write_bytes(b"garbage" * 20)
    argv = ["run", "--dataset", "femnist", "--data-dir", str(tmp_path), "--rounds", "1"]
    # A damaged file: the run cannot start (whether that is exit 1 or 2 is cli.main's call).
    err = refused([*argv, "--num-clients", "1"], capsys, tmp_path, code=None)
    assert f"{tmp_path / 'fed_emnist_train.h5'} is not a readable HDF5 file" in err


# ------------------------------------------------------------ 5. config files
def test_a_config_directory_is_refused_as_a_directory(capsys, tmp_path):
    (tmp_path / "configs").mkdir()
    err = refused(["run", "--config", str(tmp_path / "configs")], capsys, tmp_path)
    assert one_error(err) == (
        f"config file {tmp_path / 'configs'} is a directory; give a .toml or .json file."
    )


def test_a_json_config_that_repeats_a_key_is_refused(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"dataset": "quadratic", "rounds": 2, "rounds": 3}')
    err = refused(["run", "--config", str(path)], capsys, tmp_path)
    assert one_error(err) == (
        f"config file {path} gives the key 'rounds' twice (2, then 3); give each key once."
    )


def test_a_toml_config_that_repeats_a_key_is_refused(capsys, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('dataset = "quadratic"\nrounds = 2\nrounds = 3\n')
    err = refused(["run", "--config", str(path)], capsys, tmp_path)
    assert one_error(err).startswith(f"config file {path} could not be parsed:")


# ------------------------------------------------------------ 6. sweeps
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--seeds", "0", "0"],
            "--seeds repeats 0: give each seed once (a repeated seed is the same run counted "
            "twice, which shrinks the spread over seeds).",
        ),
        (
            ["--algorithms", "scaffold", "fedavg", "scaffold"],
            "--algorithms repeats scaffold: give each algorithm once.",
        ),
    ],
)
def test_a_sweep_that_repeats_a_seed_or_an_algorithm_is_refused_up_front(
    flags, message, capsys, tmp_path
):
    assert one_error(refused(["sweep", *QUAD, *flags], capsys, tmp_path)) == message


# ------------------------------------------------------------ 7. a field of the wrong type
def test_a_field_of_the_wrong_type_is_a_usage_error_not_a_type_error(capsys, tmp_path):
    argv = ["run", "--set", 'model=["mlp"]', "--state-policy", "local", "--rounds", "1"]
    err = refused(argv, capsys, tmp_path)
    assert "model = ['mlp'] is invalid: it must be one of 'logreg', 'mlp'" in err


WRONG = {
    "int": ["x"], "float": "x", "str": [1], "bool": "x", "ints": "x", "floats": "x",
    "strs": "x", "table": 1,
}  # fmt: skip


@pytest.mark.parametrize("field", RunConfig.field_names())
def test_every_config_field_given_the_wrong_type_is_a_config_error(field):
    from scaffold_jax.experiments import ConfigError

    kind = RunConfig.__dataclass_fields__[field].metadata["kind"]
    with pytest.raises(ConfigError, match=f"(^|\n  ){field} = "):
        RunConfig.from_dict({field: WRONG[kind]}).validate()


# ------------------------------------------------------------ 8. paper protocols
@pytest.mark.parametrize(
    ("protocol", "setting", "says"),
    [
        ("fig3", "dim=100000000", "dim=100000000 with num_clients=2 needs "),
        ("fig3", "dim=1e8", "dim = 100000000.0 is invalid: it must be an integer >= 2."),
        ("fig3", "num_rounds=2000000000", "num_rounds = 2000000000 is invalid"),
        ("fig3", "local_steps=[1000000]", "local_steps = (1000000,) is invalid"),
        ("fig3", 'methods="sgd"', "methods = 'sgd' is invalid"),
        ("table3", "similarities=5", "similarities = 5 is invalid"),
        ("table3", "rows=[1]", "rows = (1,) is invalid"),
        ("table3", "lr_grids=5", "lr_grids = 5 is invalid"),
        ("table3", "batch_fraction=1e-9", "K = 1000000000 local steps per round"),
    ],
)
def test_a_protocol_field_that_cannot_run_is_a_usage_error(
    protocol, setting, says, capsys, tmp_path
):
    argv = ["reproduce", protocol, "--quick", "--set", setting]
    error = one_error(refused(argv, capsys, tmp_path))
    assert says in error
