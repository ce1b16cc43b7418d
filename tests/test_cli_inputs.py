"""Bad inputs on the command line: each is refused before anything runs, with an error that
names it and no traceback; a usage error exits 2, a run that cannot start for missing or
damaged data exits 1.

The library calls behind these are cases of ``tests/test_bad_inputs.py`` (their exact
messages); here the command line is checked end to end, in-process, on tiny inputs.
"""

from __future__ import annotations

import json
import re

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
    """The single error of a refusal: ONE line (a config's errors follow ``invalid
    config:`` on that line)."""
    lines = err.removeprefix("scaffold-jax: error: ").strip().splitlines()
    assert len(lines) == 1, lines
    return re.sub(r"^invalid (config|\w+ protocol): ", "", lines[0].strip())


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
    with pytest.raises(ConfigError, match=f"(^|invalid config: |\\. ){field} = "):
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


# ------------------------------------------------------------ 9. the contract: exit 2, one line
PRIVATE = ["--dataset", "quadratic", "--num-clients", "50", "--rounds", "10"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", *PRIVATE, "--dp-noise-multiplier", "10", "--dp-clip-lr", "0.2",
          "--dp-count-noise", "0.25"],
         "dp_count_noise = 0.25 is too small for dp_noise_multiplier = 10 with adaptive "
         "clipping (dp_clip_lr = 0.2)"),
        (["run", *PRIVATE, "--sampler", "poisson", "--poisson-bound", "1"],
         "poisson_bound = 1 is too small for an expected cohort of S = 10 of N = 50"),
        (["run", *PRIVATE, "--algorithm", "scaffnew"],
         "Scaffnew needs every client in every round (S = N)"),
        (["sweep", *PRIVATE, "--algorithms", "scaffnew", "--lr-grid", "0.1", "0.3"],
         "Scaffnew needs every client in every round (S = N)"),
        (["sweep", *PRIVATE, "--dp-noise-multiplier", "1", "--dp-clip-lr", "0.2",
          "--grid", "dp_noise_multiplier=1,10", "--dp-count-noise", "0.25"],
         "dp_count_noise = 0.25 is too small for dp_noise_multiplier = 10"),
    ],
)  # fmt: skip
def test_a_config_error_found_once_the_run_is_built_is_a_usage_error(argv, says, capsys, tmp_path):
    """Refused by the algorithm's, the sampler's or the privacy mechanism's own checks
    (not the config's): these exited 1, as a run that failed, with the folder made."""
    assert one_error(refused(argv, capsys, tmp_path)).startswith(says)


def test_a_failure_while_running_is_still_not_a_usage_error(capsys, tmp_path, monkeypatch):
    """Only what the run's checks refuse before it starts is the config's: a ValueError
    raised while it runs (a bug, a failed check at run time) stays exit 1."""
    from scaffold_jax.experiments import runner

    def fails(*args, **kwargs):
        raise ValueError("something went wrong in round 3")

    monkeypatch.setattr(runner, "run_loop", fails)
    status = main(["run", *QUAD, "--quiet", "--no-checkpoint", "--out", str(tmp_path / "o")])
    assert status == 1
    assert capsys.readouterr().err == "scaffold-jax: error: something went wrong in round 3\n"


def test_a_config_with_several_errors_says_them_in_one_line(capsys, tmp_path):
    err = refused(["run", *QUAD[:-2], "--rounds", "0", "--client-lr", "-1"], capsys, tmp_path)
    assert err == (
        "scaffold-jax: error: invalid config: client_lr = -1.0 is invalid: it must be finite "
        "and > 0. rounds = 0 is invalid: it must be an integer >= 1 and <= 10000000 (every "
        "round's metrics and sampled clients are kept in memory, and the blocks of rounds are "
        "planned before compiling).\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--dp-noise-multiplier", "one"],
         "--dp-noise-multiplier 'one' is invalid: it takes a number (e.g. 0.5 or 1e-3). See "
         "'scaffold-jax run --help'."),
        (["run", "--rounds", "ten"],
         "--rounds 'ten' is invalid: it takes an integer (e.g. 10). See 'scaffold-jax run "
         "--help'."),
        (["sweep", "--seeds", "0", "x"],
         "--seeds 'x' is invalid: it takes an integer (e.g. 10). See 'scaffold-jax sweep "
         "--help'."),
        (["reproduce", "fig4"],
         "experiment 'fig4' is invalid: it takes one of 'fig3', 'table3', 'table4', 'table5'. "
         "See 'scaffold-jax reproduce --help'."),
        (["run", "--rounds"], "--rounds: expected one argument. See 'scaffold-jax run --help'."),
        (["--plugin"], "--plugin: expected one argument. See 'scaffold-jax --help'."),
    ],
)  # fmt: skip
def test_a_bad_flag_value_is_one_line_naming_the_flag_without_the_usage(argv, message, capsys):
    """argparse printed 25 lines of usage before its error."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"scaffold-jax: error: {message}\n"


# ------------------------------------------------------------ issue 40: settings that cannot
# mean what the user wants, and availability traces that were not named
def _trace(tmp_path, name: str, payload: bytes | None) -> str:
    path = tmp_path / name
    if payload is None:
        path.mkdir()
    else:
        path.write_bytes(payload)
    return str(path)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--dropouts", "bernoulli", "--dropout-rate", "1"],
         "dropout_rate = 1.0 is invalid: it must be a probability in [0, 1): at 1 every sampled "
         "client drops"),
        (["--stragglers", "uniform", "--straggler-min-steps", "1000"],
         "straggler_min_steps = 1000 exceeds K = 5, the most local steps the plan gives a "
         "client"),
        # An epochs plan: its K is the data's, refused once the data is built.
        (["--stragglers", "uniform", "--straggler-min-steps", "3", "--batch-size", "1",
          "--local-epochs", "1"],
         "straggler_min_steps = 3 exceeds K = 1, the most local steps the plan gives a client"),
        pytest.param(  # the accountant's calibration: ~9 s (also a case of test_bad_inputs)
            ["--num-clients", "50", "--rounds", "10", "--dp-epsilon", "1e-300"],
            "dp_epsilon = 1e-300 at delta = 0.0135 after 10 rounds (sampling rate 0.2) is below "
            "what the accountant resolves", marks=pytest.mark.slow),
        (["--num-clients", "50", "--rounds", "10", "--dp-epsilon", "3", "--dp-delta", "0.5"],
         "privacy = 'gaussian': dp_delta = 0.5 >= 1/N = 2.0e-02 (N = 50 clients) is no privacy"),
    ],
)  # fmt: skip
def test_a_setting_that_cannot_mean_what_was_asked_is_a_usage_error(flags, says, capsys, tmp_path):
    """Each was accepted with exit 0 (the last with a Python warning only)."""
    error = one_error(refused(["run", *QUAD, *flags], capsys, tmp_path))
    assert error.startswith(says), error


@pytest.mark.parametrize(
    ("name", "payload", "says"),
    [
        ("zeros.txt", b"0000\n" * 4, "makes no client available in any round"),
        ("empty.txt", b"", "holds no clients: it is empty, or only blank lines"),
        ("blank.txt", b"\n \n# none\n", "holds no clients: it is empty, or only blank lines"),
        ("trace.bin", b"\x00\xff\x93", "is not text (its byte 1 is not UTF-8: a binary file?)"),
        ("trace.npy", b"\x93NUMPY\x01\x00garbage", "is a damaged .npy file: numpy cannot read"),
        ("text.npy", b"0110\n", "is not a .npy file (it does not start with numpy's magic"),
        ("folder", None, "is a directory, not a file. Give the path of a trace (.npy"),
    ],
)  # fmt: skip
def test_an_availability_trace_that_cannot_be_read_is_named_with_its_problem(
    name, payload, says, capsys, tmp_path
):
    """They said "cannot reshape array of size 0", raised a codec error, quoted numpy, said
    "no such file" for a directory, or ran with 0 participants every round."""
    trace = _trace(tmp_path, name, payload)
    error = one_error(
        refused(["run", *QUAD, "--availability", "trace", "--availability-trace", trace],
                capsys, tmp_path)
    )  # fmt: skip
    assert trace in error and says in error, error
    if payload is not None and name != "zeros.txt":
        assert "0/1" in error and ".npy" in error  # the formats


def test_a_model_beyond_a_memory_limit_is_refused_before_it_is_allocated(tmp_path):
    """Under an address-space limit (ulimit -v) the model's params were allocated and read,
    and XLA aborted with "Check failed" (exit 134); now refused up front, in one line."""
    import os
    import subprocess
    import sys

    pytest.importorskip("resource")
    limit = 8 * 2**30
    args = ["run", "--dataset", "synthetic", "--num-clients", "2", "--rounds", "1", "--model",
            "mlp", "--hidden-sizes", "200000000", "--quiet", "--no-checkpoint",
            "--no-compile-cache", "--out", str(tmp_path / "out")]  # fmt: skip
    # The limit set in the child itself (a preexec_fn would fork this multithreaded process).
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
        "from scaffold_jax.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # a GPU's driver needs more address space
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.startswith("scaffold-jax: error: ")
    error = one_error(done.stderr)
    assert error.startswith("model = 'mlp' with hidden_sizes = [200000000]: MLP's "), error
    needed, available = map(int, re.findall(r"(\d+) bytes \(", error))
    assert needed > limit > available
    assert not (tmp_path / "out").exists()


def test_a_flag_overrides_the_file_table_and_one_value_given_twice_is_accepted(tmp_path):
    """A flag still overrides the config file, also a name the file gives in its table
    (only two values in one place, the file or the command line, are refused)."""
    from scaffold_jax import cli

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"algorithm": "fedprox", "hparams": {"prox_mu": 0.3}}))
    args = cli._parse(["run", "--config", str(path), "--prox-mu", "0.5"])
    assert cli._config(args, validate=False).hparams == {"prox_mu": 0.5}
    args = cli._parse(["run", "--prox-mu", "0.5", "--set", "prox_mu=0.5"])
    assert cli._config(args, validate=False).hparams == {"prox_mu": 0.5}
    same = RunConfig.from_dict({"compress_bits": 8, "hparams": {"compress_bits": 8.0}})
    assert same.hparams == {"compress_bits": 8}
    # replace() sets a name over its table's value (what a sweep's axes do).
    assert RunConfig(algorithm="fedprox", prox_mu=0.1).replace(prox_mu=0.2).hparams == {
        "prox_mu": 0.2
    }
