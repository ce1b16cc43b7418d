"""Using the command line as the README does: the default output folders (one per
configuration, found again by --resume), --plugin before the command, unknown flags named
with the closest flag, and --help naming every registered algorithm."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scaffold_jax import cli, results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.cli import main
from scaffold_jax.experiments import commands

PLUGIN = "tests/plugins/damped_fedavg.py"
ROOT = Path(__file__).parent.parent
#: A run of seconds: the quadratics, every client every round, two local steps.
QUAD = ["--dataset", "quadratic", "--num-clients", "4", "--client-fraction", "1",
        "--local-steps", "2", "--eval-every", "1", "--quiet"]  # fmt: skip


# ----------------------------------------------------------------------------- folders
class _Stop(Exception):
    """Raised where the command would start running: the folder is chosen by then."""


def _folders(monkeypatch, argvs) -> list[Path]:
    """The output folder each command line would write, without running it."""
    chosen = []

    def run_grid(grid, folder, **options):
        chosen.append(Path(folder))
        raise _Stop

    monkeypatch.setattr(commands, "run_grid", run_grid)
    for argv in argvs:
        with pytest.raises(_Stop):
            main(argv)
    return chosen


def test_the_readme_commands_in_order_get_a_folder_each(monkeypatch):
    """The README's commands without --out, run one after the other, never meet a
    folder that another one filled (a finished run is never overwritten)."""
    argvs = [
        ["run", "--config", str(ROOT / "examples" / "scaffold_fmnist.toml"), "--rounds", "50"],
        ["sweep", "--algorithms", "scaffold", "fedavg", "--lr-grid", "0.03", "0.1", "0.3",
         "--seeds", "0", "1", "2", "--rounds", "100"],
        ["sweep", "--algorithms", "fedprox", "--lr-grid", "0.1", "0.3", "--grid",
         "prox_mu=0.01,0.1,1"],
        ["sweep", "--algorithms", "scaffold", "fedavg", "--grid", "server_lr=0.5,1",
         "--grid", "similarity=0,50", "--grid", "local_epochs=1,5", "--seeds", "0", "1", "2"],
        ["run", "--algorithm", "fedprox", "--set", "prox_mu=0.1"],
        ["run", "--algorithm", "mime", "--base-optimizer", "momentum:momentum=0.9",
         "--client-lr", "0.03"],
        ["run", "--algorithm", "fedavg", "--server-optimizer", "fedadam:tau=1e-3",
         "--server-lr", "0.03", "--local-optimizer", "momentum"],
        ["run", "--algorithm", "scaffold", "--warm-controls"],
        ["run", "--dataset", "fashion_mnist", "--model", "cnn", "--client-lr", "0.05",
         "--local-test-fraction", "0.2"],
        ["run", "--tensorboard"],
        ["run", "--dataset", "shakespeare", "--model", "char_lstm", "--num-clients", "10",
         "--clients-per-round", "5", "--batch-plan", "fixed", "--local-steps", "10",
         "--batch-size", "10", "--rounds", "40", "--eval-every", "20", "--client-lr", "1"],
    ]  # fmt: skip
    folders = _folders(monkeypatch, argvs)
    assert len(set(folders)) == len(folders), folders
    assert folders[0] == Path("runs/scaffold-fmnist")  # the config file's `out`
    digest = "[0-9a-f]{8}"
    assert re.fullmatch(f"results/sweep-fashion_mnist-{digest}", str(folders[1]))
    assert re.fullmatch(f"results/scaffold-fashion_mnist-{digest}", str(folders[7]))
    assert re.fullmatch(f"results/scaffold-shakespeare-{digest}", str(folders[-1]))


def test_the_same_settings_find_the_same_folder(monkeypatch):
    """What a resume may change (rounds, evaluation cadence, targets, the data's folder)
    and explicit defaults keep the folder, so `--resume` finds it; the rest does not."""
    base = ["run", "--algorithm", "fedavg", "--client-lr", "0.05"]
    same = [
        base,
        [*base, "--rounds", "500", "--eval-every", "10", "--targets", "0.6"],
        [*base, "--similarity", "0", "--server-lr", "1", "--data-dir", "/elsewhere"],
        [*base[:3], "--set", "client_lr=0.05", "--resume", "--tensorboard"],
    ]
    other = [
        [*base, "--seed", "1"],
        [*base, "--client-lr", "0.1"],
        [*base, "--similarity", "10"],
        ["run", "--algorithm", "fedprox", "--client-lr", "0.05"],
    ]
    sweeps = [
        ["sweep", "--lr-grid", "0.1", "0.3", "--seeds", "0", "1"],
        ["sweep", "--lr-grid", "0.1", "0.3", "--seeds", "0", "1", "--rounds", "20"],
        ["sweep", "--lr-grid", "0.1", "0.3", "--seeds", "0", "1", "2"],
    ]
    first, *rest = _folders(monkeypatch, [*same, *other, *sweeps])
    assert rest[: len(same) - 1] == [first] * (len(same) - 1)
    others = rest[len(same) - 1 : len(same) - 1 + len(other)]
    assert len({first, *others}) == 1 + len(other)
    one, more_rounds, more_seeds = rest[-3:]
    assert one == more_rounds != more_seeds
    # An explicit folder is used as given.
    assert _folders(monkeypatch, [[*base, "--out", "mine"]]) == [Path("mine")]


def test_diagnose_gets_a_folder_per_setting(monkeypatch, tmp_path):
    chosen = []

    def check_folder(folder, overwrite, dry_run=False):
        chosen.append(Path(folder))
        raise _Stop

    monkeypatch.setattr(results, "check_folder", check_folder)
    for argv in (["diagnose"], ["diagnose", "--similarity", "50"], ["diagnose", "--gd-steps", "3"]):
        with pytest.raises(_Stop):
            main(argv)
    assert len(set(chosen)) == 3
    assert all(re.fullmatch("results/diagnose-fashion_mnist-[0-9a-f]{8}", str(f)) for f in chosen)


def test_a_run_resumes_from_its_default_folder(monkeypatch, tmp_path, capsys):
    """The commands as a user types them, in one working folder: --resume with more
    rounds continues the run in its default folder, and the same run again is refused (a
    finished run is never overwritten)."""
    monkeypatch.chdir(tmp_path)
    assert main(["run", *QUAD, "--rounds", "2"]) == 0
    (first,) = (tmp_path / "results").iterdir()
    assert re.fullmatch("scaffold-quadratic-[0-9a-f]{8}", first.name)
    assert main(["run", *QUAD, "--rounds", "3", "--resume"]) == 0
    assert list((tmp_path / "results").iterdir()) == [first]
    assert [r["round"] for r in results.read_records(first)] == [0, 1, 2, 3]
    assert results.read_summary(first)["runs"]["scaffold"]["resumed_from"] == 2
    capsys.readouterr()
    assert main(["run", *QUAD, "--rounds", "3"]) == 1
    assert f"output folder results/{first.name} already holds a finished run" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "error",
    ["RESOURCE_EXHAUSTED: Out of memory while trying to allocate 531264504608 bytes.",
     "INTERNAL: Error dispatching computation: Out of memory allocating 7329695328 bytes."],
)  # fmt: skip
def test_running_out_of_memory_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys, error):
    """XLA's failure to allocate, which no check before the run foresaw (the fuzz's config
    that asked for 7.3 GB under an 8 GiB limit), ends the command with exit 1 and one line
    naming it; any other XLA runtime error stays a traceback (a bug to report)."""
    import jax

    def run_grid(grid, folder, **options):
        raise jax.errors.JaxRuntimeError(error)

    monkeypatch.setattr(commands, "run_grid", run_grid)
    monkeypatch.chdir(tmp_path)
    assert main(["run", *QUAD, "--rounds", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"scaffold-jax: error: the run ran out of memory ({error}); finished records are kept."
    )
    monkeypatch.setattr(commands, "run_grid", lambda *a, **k: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("INTERNAL: something else")))  # fmt: skip
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        main(["run", *QUAD, "--rounds", "2"])


# ----------------------------------------------------------------------------- plugins
def test_plugin_before_the_command_works_as_after_it(tmp_path):
    assert cli._parse(["--plugin", PLUGIN, "run", "--algorithm", "damped_fedavg"]).plugin == [
        PLUGIN
    ]
    for command in (["sweep"], ["diagnose"], ["reproduce", "fig3"]):
        args = cli._parse(["--plugin", "a.py", *command, "--plugin", "b.py"])
        assert args.plugin == ["a.py", "b.py"]  # before the command first
    # Its algorithm and hyper-parameter have flags, and the run records the plugin.
    out = tmp_path / "run"
    argv = ["--plugin", PLUGIN, "run", "--algorithm", "damped_fedavg", "--damping", "0.25",
            *QUAD, "--rounds", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["plugins"] == [PLUGIN] and saved["hparams"] == {"damping": 0.25}


def test_a_plugin_before_the_command_that_cannot_load_is_a_usage_error(capsys):
    assert main(["--plugin", "no_such_module_xyz", "run"]) == 2
    assert "plugin 'no_such_module_xyz' cannot be imported" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_plugin_that_raises_keyboard_interrupt_at_import_is_named_not_an_interrupt(
    where, tmp_path, capsys
):
    """It exited 130, "interrupted; finished records are kept", naming no plugin."""
    plugin = tmp_path / "halts.py"
    plugin.write_text("import os\n\nraise KeyboardInterrupt('stop here')\n")
    flag = ["--plugin", str(plugin)]
    argv = [*flag, "run"] if where == "before" else ["run", *flag]
    assert main([*argv, *QUAD, "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"scaffold-jax: error: plugin '{plugin}' failed while importing: it raised "
        f"KeyboardInterrupt at {plugin}:3 (in <module>) (no Ctrl-C was pressed); a plugin "
        "only registers entries: fix that line or leave the plugin out.\n"
    )
    assert not (tmp_path / "o").exists()


def test_a_ctrl_c_while_a_plugin_imports_still_interrupts(tmp_path):
    """A real SIGINT during the plugin's import is the user's Ctrl-C: exit 130, as always."""
    plugin = tmp_path / "slow.py"
    plugin.write_text("import os, signal, time\n\nos.kill(os.getpid(), signal.SIGINT)\n"
                      "time.sleep(30)\n")  # fmt: skip
    # A shell that started the tests in the background (`make test &`, nohup) ignores
    # SIGINT in them, and Python keeps an inherited SIG_IGN: the command gets Python's own
    # SIGINT handler first, as when started from a terminal.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['scaffold_jax.cli', *sys.argv[1:]]; "
        "runpy.run_module('scaffold_jax.cli', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", start, "--plugin", str(plugin), "run", *QUAD,
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "scaffold-jax: interrupted; finished records are kept.\n"


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--client_lr", "0.1"],
         "run: unknown flag --client_lr (did you mean --client-lr?)"),
        (["sweep", "--num_clients=5"],
         "sweep: unknown flag --num_clients (did you mean --num-clients?)"),
        (["run", "--clientlr", "0.1"],
         "run: unknown flag --clientlr (did you mean --client-lr?)"),
        (["run", "--seeds", "0", "1"],
         "run: unknown flag --seeds (did you mean --seed? --seeds is a flag of sweep)"),
        (["diagnose", "--rounds", "5"],
         "diagnose: unknown flag --rounds (--rounds is a flag of run, reproduce and sweep)"),
        (["run", "--frobnicate", "-1"], "run: unknown flag --frobnicate."),
        (["run", "--rounds", "3", "4"], "run: unexpected argument '4'."),
        (["--plugin", PLUGIN, "run", "--dampnig", "0.1"],
         "run: unknown flag --dampnig (did you mean --damping?)"),
    ],
)  # fmt: skip
def test_an_unknown_flag_is_one_line_naming_the_closest_flag(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"scaffold-jax: error: {message}")
    command = argv[2] if argv[0] == "--plugin" else argv[0]
    assert err.endswith(f" See 'scaffold-jax {command} --help'.\n")


# ----------------------------------------------------------------------------- help
def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


def test_help_names_every_registered_algorithm_a_plugins_too(capsys):
    top = _help(["--help"], capsys)
    assert all(spec.display_name in top for _, spec in ALGORITHMS.items())
    run = _help(["run", "--help"], capsys)
    assert f"(--algorithm: {', '.join(ALGORITHMS)})" in run
    sweep = _help(["sweep", "--help"], capsys)
    assert f"({' | '.join(ALGORITHMS)})" in sweep
    plugged = _help(["--plugin", PLUGIN, "--help"], capsys)
    assert f"{ALGORITHMS['damped_fedavg'].display_name})" in plugged


def test_the_package_description_names_every_built_in_algorithm():
    text = (ROOT / "pyproject.toml").read_text()
    (description,) = re.findall(r'^description = "(.*)"$', text, flags=re.M)
    assert all(spec.display_name in description for _, spec in ALGORITHMS.items())
