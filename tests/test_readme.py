"""Every command block of README.md runs as written, so that the README cannot rot.

How each kind of block runs:

* ``scaffold-jax ...`` lines (``\\`` continues a line, ``#`` starts a comment): each line is
  ``scaffold_jax.cli.main(argv)``, in README order, in ONE scratch folder for the whole
  README (so two commands' default output folders must not collide), where ``tests/`` and
  ``examples/`` of the repository are linked. The one change made to a command:
  ``--rounds 2 --eval-every 1`` is appended to ``run``, ``sweep`` and ``reproduce`` (the
  last flag wins), so that a 1,000-round protocol costs its compilations and two rounds.
  Most run under ``-m slow`` (each compiles its programs: 10-60 s on 2 cores); the
  default suite runs the few listed in ``FAST``.
* ``python ...`` lines run as a subprocess of this interpreter, in the same folder.
* Python blocks run in README order in one namespace (the README says that the later
  blocks continue the API example), as written.
* A block the README quotes from a file of the repository (the plugin examples) must be
  that file's text.
* ``text`` blocks are what a command prints, not commands; ``source .venv/bin/activate``
  is what this test's interpreter already did.
* ``make demo`` / ``make test``: the demo is run by tests/test_end_to_end.py and the suite is
  this one; the block is checked to be exactly those two commands (test_docs.py).

A block of a kind not listed here fails the test: a new block must say how it runs.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FASHION = "/usr/share/datasets/fashion-mnist"

#: What each run/sweep/reproduce command gets appended (documented above).
SHORTEN = ["--rounds", "2", "--eval-every", "1"]

#: The commands the default suite runs (a few seconds each: small data or one short run
#: of each kind); every other command runs under ``-m slow`` (a fresh clone's suite stays
#: within its time, and `make test-slow` runs them all).
FAST = (
    "--dataset quadratic",
    "python tests/plugins/lab.py",
    "--dataset blobs_npz",
    "run --availability cyclic",
)

#: Python blocks quoted from a file: a distinctive first line -> the file.
QUOTED = {
    'models.MODELS.register("dropout_mlp"': "tests/plugins/lab.py",
    "HPARAMS = {**STEP_SIZES": "tests/plugins/damped_fedavg.py",
}


def _blocks() -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the README, in order."""
    return re.findall(r"```(\w*)\n(.*?)```", README.read_text(), re.S)


def _commands() -> list[str]:
    """Every shell command line of the README's blocks, continuations joined."""
    lines = []
    for lang, text in _blocks():
        if lang not in ("", "bash", "sh"):
            continue
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _python_blocks() -> list[str]:
    return [text for lang, text in _blocks() if lang == "python"]


def _is_quoted(text: str) -> str | None:
    for first, path in QUOTED.items():
        if first in text:
            return path
    return None


def test_every_block_is_of_a_kind_this_file_runs():
    for lang, _text in _blocks():
        assert lang in ("", "bash", "sh", "python", "text"), f"README block of kind {lang!r}"
    for line in _commands():
        assert line.split()[0] in ("scaffold-jax", "python", "make", "source"), (
            f"README command {line!r}: this test does not know how to run it; teach it "
            "(tests/test_readme.py) or write the command as `scaffold-jax ...`/`python ...`"
        )
    make = [line.split("#")[0].split() for line in _commands() if line.startswith("make")]
    assert make == [["make", "demo"], ["make", "test"]]


def _statements(source: str) -> list[str]:
    """The top-level statements of Python source, formatting aside."""
    return [ast.dump(node) for node in ast.parse(textwrap.dedent(source)).body]


def test_the_quoted_plugin_examples_are_the_files_text():
    quoted = [(text, _is_quoted(text)) for text in _python_blocks()]
    assert sorted(path for _, path in quoted if path) == sorted(QUOTED.values())
    for text, path in quoted:
        if path:
            # Every statement quoted is one of the file's (the file's docstring aside).
            theirs = set(_statements((ROOT / path).read_text()))
            missing = [s for s in _statements(text) if s not in theirs]
            assert not missing, f"README quotes statements that are not in {path}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The folder every command of the README runs in, in order."""
    folder = tmp_path_factory.mktemp("readme")
    for name in ("tests", "examples"):
        (folder / name).symlink_to(ROOT / name)
    return folder


def _argv(line: str) -> list[str]:
    argv = shlex.split(line, comments=True)
    if argv[0] == "scaffold-jax":
        command = next((a for a in argv[1:] if not a.startswith("-")), None)
        if command in ("run", "sweep", "reproduce"):
            argv += SHORTEN
    return argv


def _params():
    params = []
    for i, line in enumerate(_commands()):
        if line.startswith(("make", "source .venv/bin/activate")):
            continue
        marks = [] if any(f in line for f in FAST) else [pytest.mark.slow]
        params.append(pytest.param(line, id=f"{i:02d} {line[:60]}", marks=marks))
    return params


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
@pytest.mark.parametrize("line", _params())
def test_every_readme_command_runs_as_written(line, scratch, monkeypatch, capsys):
    from scaffold_jax.cli import main

    monkeypatch.chdir(scratch)
    argv = _argv(line)
    if argv[0] == "python":
        done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                              cwd=scratch, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return
    code = main(argv[1:])
    err = capsys.readouterr().err
    assert code == 0, f"{line}\n{err[-3000:]}"


@pytest.mark.slow  # three 100-round runs and a DP calibration: about a minute
@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
def test_the_python_blocks_run_in_order_in_one_namespace(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    # The tracker example's wandb, replaced by a recorder (not installed, and offline).
    logged = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: None
    wandb.log = lambda metrics, step: logged.append((step, metrics))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    namespace: dict = {}
    for i, text in enumerate(_python_blocks()):
        if not _is_quoted(text):
            code = compile(textwrap.dedent(text), f"README.md python block {i}", "exec")
            exec(code, namespace)  # noqa: S102
    if "dp_epsilon" in namespace["result"].records[-1]:  # the privacy example, calibrated
        assert namespace["result"].records[-1]["dp_epsilon"] == pytest.approx(3, rel=1e-3)
    # The tracker got every record of its run, at its round.
    assert [step for step, _ in logged] == list(range(0, 101, 10))
    assert all("test_accuracy" in metrics for _, metrics in logged)
