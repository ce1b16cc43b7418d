"""Every code block of README.md and of the documentation site (docs/) runs as written, so
that neither can rot.

The pages: README.md and every Markdown page under docs/ (:data:`PAGES`). How each kind of
block runs:

* ``scaffold-jax ...`` lines (``\\`` continues a line, ``#`` starts a comment): each line is
  ``scaffold_jax.cli.main(argv)``, in page order, in ONE scratch folder per page (so two
  commands of a page must not collide in their default output folders, and a page's
  later commands may use what its earlier ones wrote), where ``tests/`` and ``examples/``
  of the repository are linked. The one change made to a command: ``--rounds 2
  --eval-every 1`` is appended to ``run``, ``sweep`` and ``reproduce`` (the last flag
  wins), so that a 1,000-round protocol costs its compilations and two rounds. Most run
  under ``-m slow`` (each compiles its programs: 10-60 s on 2 cores); the default suite
  runs the few listed in ``FAST``.
* ``python ...`` lines run as a subprocess of this interpreter, in the same folder.
* ``pip install ...`` lines are the installs ``make`` performs (checked against the
  Makefile, not run: they would reinstall this interpreter's packages).
* Each Python block runs ALONE, in a fresh namespace, as a script would: it has its own
  imports and set-up (no block continues another's variables) and prints what its page
  shows (a bare expression at the end would print nothing in a script). Checked without
  running (:func:`test_every_python_block_stands_alone_and_prints`) and by running each
  (``-m slow``).
* A block a page quotes from a file of the repository (the plugin examples) must be that
  file's text.
* ``text`` blocks are what a command prints, not commands; ``source .venv/bin/activate``
  is what this test's interpreter already did.
* ``make demo`` / ``make test``: the demo is run by tests/test_end_to_end.py and the suite is
  this one; the block is checked to be exactly those two commands (test_docs.py).
* The results pages (docs/results/) record the commands of long experiments (hours),
  written as shell scripts with variables: each command is expanded by bash and checked
  to parse and validate its configuration, up to where it would start running
  (:func:`test_every_results_command_parses_and_validates`), not run.
* docs/history.md, the development log, is quoted history: its blocks are not run.
* A block right after ``<!-- not run by the tests: REASON -->`` is not run; the reason must
  name the test file that runs what it shows (one block: ``jax.distributed`` on a cluster).

A block of a kind not listed here fails the test: a new block must say how it runs.
"""

from __future__ import annotations

import ast
import json
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
DOCS = ROOT / "docs"
FASHION = "/usr/share/datasets/fashion-mnist"

#: The pages whose commands and Python blocks run: README.md, then docs/ (the results
#: pages and the development log aside, see the module docstring).
PAGES = [README] + sorted(
    p
    for p in DOCS.rglob("*.md")
    if "_build" not in p.parts and p.parent.name != "results" and p.name != "history.md"
)
RESULTS_PAGES = sorted((DOCS / "results").glob("*.md"))
GETTING_STARTED = DOCS / "getting-started.md"

#: What each run/sweep/reproduce command gets appended (documented above).
SHORTEN = ["--rounds", "2", "--eval-every", "1"]

#: The commands the default suite runs (a few seconds each: small data or one short run
#: of each kind); every other command runs under ``-m slow`` (a fresh clone's suite stays
#: within its time, and `make test-slow` runs them all). A page's commands share its
#: folder in order (extending.md writes the blobs its later commands read), so a pattern
#: here keeps whole chains in one tier.
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


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


#: The comment that exempts the next block, and why (see the module docstring).
NOT_RUN = re.compile(r"<!-- not run by the tests: (.+?) -->\s*$")
_FENCE = re.compile(r"^```([\w{}-]*)[^\n]*\n(.*?)^```", re.S | re.M)


def _exempt(page: Path) -> list[tuple[str, str]]:
    """(reason, block text) of every block a page exempts."""
    text = page.read_text()
    out = []
    for match in _FENCE.finditer(text):
        reason = NOT_RUN.search(text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1])
        if reason:
            out.append((reason.group(1), match.group(2)))
    return out


def _blocks(page: Path = README) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a page that runs, in order (MyST
    directives such as ``{toctree}`` are the site's structure, not code; exempt blocks
    are left out)."""
    exempt = {text for _, text in _exempt(page)}
    return [
        (m.group(1), m.group(2))
        for m in _FENCE.finditer(page.read_text())
        if not m.group(1).startswith("{") and m.group(2) not in exempt
    ]


def test_an_exempt_block_names_the_test_that_runs_it():
    exempt = [(page, reason) for page in PAGES for reason, _ in _exempt(page)]
    assert len(exempt) <= 2, exempt  # few, each with its reason
    for page, reason in exempt:
        named = re.findall(r"tests/test_\w+\.py", reason)
        assert named and all((ROOT / n).exists() for n in named), (_name(page), reason)


def _commands(page: Path = README) -> list[str]:
    """Every shell command line of a page's blocks, continuations joined."""
    lines = []
    for lang, text in _blocks(page):
        if lang not in ("", "bash", "sh"):
            continue
        joined = text.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _python_blocks(page: Path = README) -> list[str]:
    return [text for lang, text in _blocks(page) if lang == "python"]


def _is_quoted(text: str) -> str | None:
    for first, path in QUOTED.items():
        if first in text:
            return path
    return None


def test_the_pages_are_the_site():
    """The pages this file runs are every page of the site (a page left out would rot)."""
    names = {_name(p) for p in PAGES}
    assert {"README.md", "docs/getting-started.md", "docs/how-to/privacy.md"} <= names
    assert len(PAGES) >= 25, names


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_is_of_a_kind_this_file_runs(page):
    for lang, _text in _blocks(page):
        assert lang in ("", "bash", "sh", "python", "text"), (
            f"{_name(page)}: a block of kind {lang!r}"
        )
    for line in _commands(page):
        assert line.split()[0] in ("scaffold-jax", "python", "make", "source", "pip"), (
            f"{_name(page)} command {line!r}: this test does not know how to run it; teach it "
            "(tests/test_doc_blocks.py) or write the command as `scaffold-jax ...`/`python ...`"
        )
    make = [line.split("#")[0].split() for line in _commands(page) if line.startswith("make")]
    assert make in ([], [["make", "demo"], ["make", "test"]]), _name(page)


def test_the_pip_installs_are_the_makefiles():
    """A page's `pip install -e ".[extras]"` names only extras the Makefile installs."""
    makefile = (ROOT / "Makefile").read_text()
    installed = set(re.search(r'pip install -q -e "\.\[([\w,]+)\]"', makefile).group(1).split(","))
    pips = [line for page in PAGES for line in _commands(page) if line.startswith("pip")]
    assert pips, "no page shows the install"
    for line in pips:
        extras = re.fullmatch(r'pip install -e "\.\[([\w,]+)\]".*', line)
        assert extras, f"an install this test does not know: {line!r}"
        assert set(extras.group(1).split(",")) <= installed, line


def _statements(source: str) -> list[str]:
    """The top-level statements of Python source, formatting aside."""
    return [ast.dump(node) for node in ast.parse(textwrap.dedent(source)).body]


def test_the_quoted_plugin_examples_are_the_files_text():
    quoted = [(text, _is_quoted(text)) for page in PAGES for text in _python_blocks(page)]
    assert sorted(path for _, path in quoted if path) == sorted(QUOTED.values())
    for text, path in quoted:
        if path:
            # Every statement quoted is one of the file's (the file's docstring aside).
            theirs = set(_statements((ROOT / path).read_text()))
            missing = [s for s in _statements(text) if s not in theirs]
            assert not missing, f"a page quotes statements that are not in {path}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The folder of each page that its commands run in, in order."""
    folders = {}

    def folder(page: Path) -> Path:
        if page not in folders:
            folders[page] = tmp_path_factory.mktemp(_name(page).replace("/", "-"))
            for name in ("tests", "examples"):
                (folders[page] / name).symlink_to(ROOT / name)
        return folders[page]

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
    for page in PAGES:
        for i, line in enumerate(_commands(page)):
            if line.startswith(("make", "source .venv/bin/activate", "pip")):
                continue
            marks = [] if any(f in line for f in FAST) else [pytest.mark.slow]
            name = f"{_name(page)} {i:02d} {line[:50]}"
            params.append(pytest.param(page, line, id=name, marks=marks))
    return params


@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
@pytest.mark.parametrize(("page", "line"), _params())
def test_every_command_runs_as_written(page, line, scratch, monkeypatch, capsys):
    from scaffold_jax.cli import main

    folder = scratch(page)
    monkeypatch.chdir(folder)
    argv = _argv(line)
    if argv[0] == "python":
        done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                              cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return
    code = main(argv[1:])
    err = capsys.readouterr().err
    assert code == 0, f"{line}\n{err[-3000:]}"


def _own_blocks() -> list[tuple[Path, int, str]]:
    """(page, index, text) of every Python block that is not quoted from a file."""
    return [
        (page, i, text)
        for page in PAGES
        for i, text in enumerate(_python_blocks(page))
        if not _is_quoted(text)
    ]


def _free_names(source: str) -> set[str]:
    """Names a block reads but neither imports, assigns nor defines (builtins aside): what
    it would take from another block."""
    import builtins

    tree = ast.parse(textwrap.dedent(source))
    bound, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound - set(dir(builtins))


def test_every_python_block_stands_alone_and_prints():
    """Run as a script, each block works alone and shows its result: no names from
    another block, no bare expression (a script prints nothing for it), a print."""
    problems = []
    for page, i, text in _own_blocks():
        where = f"{_name(page)} python block {i}"
        free = _free_names(text)
        if free:
            problems.append(f"{where} uses {sorted(free)} without defining them")
        body = ast.parse(textwrap.dedent(text)).body
        if any(isinstance(n, ast.Expr) and not isinstance(n.value, ast.Call) for n in body):
            problems.append(f"{where} has a bare expression: a script would print nothing")
        calls = [n for n in ast.walk(ast.Module(body=body, type_ignores=[]))
                 if isinstance(n, ast.Call)]  # fmt: skip
        if not any(isinstance(c.func, ast.Name) and c.func.id == "print" for c in calls):
            problems.append(f"{where} prints nothing")
    assert problems == []


@pytest.fixture(scope="module")
def wandb_recorder():
    """The tracker example's wandb, replaced by a recorder (not installed, and offline)."""
    logged = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: None
    wandb.log = lambda metrics, step: logged.append((step, metrics))
    previous = sys.modules.get("wandb")
    sys.modules["wandb"] = wandb
    yield logged
    if previous is None:
        sys.modules.pop("wandb", None)
    else:
        sys.modules["wandb"] = previous


@pytest.mark.slow  # 100-round runs, a DP calibration, a million-client table: minutes
@pytest.mark.skipif(not os.path.isdir(FASHION), reason="needs Debian's dataset-fashion-mnist")
@pytest.mark.parametrize(
    ("page", "index", "text"),
    [pytest.param(p, i, t, id=f"{_name(p)} {i}") for p, i, t in _own_blocks()],
)
def test_each_python_block_runs_alone(page, index, text, wandb_recorder, monkeypatch,
                                      tmp_path, capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}  # a fresh one: nothing from another block
    wandb_recorder.clear()
    code = compile(textwrap.dedent(text), f"{_name(page)} python block {index}", "exec")
    exec(code, namespace)  # noqa: S102
    assert capsys.readouterr().out.strip(), "the block printed nothing"
    if "dp_epsilon" in getattr(namespace.get("result"), "records", [{}])[-1]:
        # The privacy example, calibrated.
        assert namespace["result"].records[-1]["dp_epsilon"] == pytest.approx(3, rel=1e-3)
    if "wandb" in namespace:
        # The tracker got every record of its run, at its round.
        assert [step for step, _ in wandb_recorder] == list(range(0, 101, 10))
        assert all("test_accuracy" in metrics for _, metrics in wandb_recorder)


def _results_commands() -> list[tuple[Path, list[str]]]:
    """Each ``scaffold-jax`` command of the results pages' blocks as bash expands it (their
    scripts set shell variables), without running anything."""
    out = []
    for page in RESULTS_PAGES:
        for lang, text in _blocks(page):
            if lang not in ("", "bash", "sh") or "scaffold-jax" not in text:
                continue
            probe = "scaffold-jax() { printf '%s\\0' \"$@\"; printf '\\n\\1'; }\npython() { :; }\n"
            done = subprocess.run(
                ["bash", "-c", probe + text], capture_output=True, text=True, check=True
            )
            for argv in done.stdout.split("\n\x01")[:-1]:
                out.append((page, argv.lstrip("\n").split("\0")[:-1]))
    return out


@pytest.mark.parametrize(
    ("page", "argv"),
    [pytest.param(p, a, id=f"{_name(p)} {' '.join(a)[:50]}") for p, a in _results_commands()],
)
def test_every_results_command_parses_and_validates(page, argv, monkeypatch, tmp_path):
    """The recipe of a results page still parses and its configuration validates, up to
    where the command would start building and running it."""
    from scaffold_jax import cli
    from scaffold_jax.experiments import commands
    from scaffold_jax.paper import runs as paper_runs

    class Stop(Exception):
        pass

    def run_grid(grid, folder, **options):
        raise Stop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(commands, "run_grid", run_grid)
    monkeypatch.setattr(paper_runs, "run_grid", run_grid)
    try:
        code = cli.main([*argv, "--quiet"])
    except Stop:
        return
    pytest.fail(f"{_name(page)}: {' '.join(argv)} did not reach its run (exit {code})")


def test_results_commands_are_found():
    """Every results page with a recipe contributes its commands (the parser above)."""
    pages = {p.name for p, _ in _results_commands()}
    assert {"algorithms.md", "communication.md", "participation.md", "privacy.md"} <= pages
    assert all(argv and argv[0] in ("run", "sweep", "reproduce") for _, argv in _results_commands())
    assert json.dumps([a for _, a in _results_commands()])  # plain strings only
