"""The documentation: the API reference builds without a warning (cross-references
resolve) and has a page for every public module, docs/config.md is what its generator
makes and holds every flag of the command line, the example config is valid."""

import argparse
import dataclasses
import pkgutil
import re
from pathlib import Path

import pytest

from scaffold_jax import cli, docs, experiments
from scaffold_jax.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The API reference, built once: ``(folder, warnings)``."""
    pytest.importorskip("pdoc")
    folder = tmp_path_factory.mktemp("api")
    return folder, docs.build_api(folder)


@pytest.mark.slow  # the API reference build: ~11 s of the quick tier
def test_the_api_reference_builds_without_a_warning(api):
    folder, problems = api
    assert problems == []
    page = (folder / "scaffold_jax" / "sweep.html").read_text()
    assert 'id="grid"' in page  # the functions are documented ...
    assert 'href="loop.html#drive"' in page  # ... and :func:`...` references are links


@pytest.mark.slow  # the API reference build: ~11 s of the quick tier
def test_every_public_module_has_a_page_listed_by_its_package(api):
    """Not only what ``__all__`` names: ``experiments``, ``results``, ``types``, ``paper``,
    ``algorithms.common``... each have a page, and their package's page links it."""
    folder, _ = api
    import scaffold_jax

    public = ["scaffold_jax"] + [
        info.name
        for info in pkgutil.walk_packages(scaffold_jax.__path__, "scaffold_jax.")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]
    for name in ("experiments", "results", "types", "paper", "algorithms.common", "data.batching"):
        assert f"scaffold_jax.{name}" in public
    pages = {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.html")}
    assert {name.replace(".", "/") for name in public} <= pages
    for name in public[1:]:
        package, _, module = name.rpartition(".")
        index = (folder / (package.replace(".", "/") + ".html")).read_text()
        link = f"{package.rpartition('.')[2]}/{module}.html"
        assert f'href="{link}"' in index, f"{package}'s page does not link {name}"
    results = (folder / "scaffold_jax" / "results.html").read_text()
    assert 'id="TensorBoardSink"' in results
    paper = (folder / "scaffold_jax" / "paper.html").read_text()
    assert 'id="TableProtocol.max_train_examples"' in paper  # a `reproduce --set` field


def test_an_unresolved_reference_is_a_warning(tmp_path, monkeypatch):
    pdoc_doc = pytest.importorskip("pdoc.doc")
    (tmp_path / "refs_example.py").write_text(
        '"""See :func:`~scaffold_jax.sweep.grid` and :class:`Local`."""\n\n\n'
        "class Local:\n"
        '    """Its :meth:`run` and :attr:`scaffold_jax.sweep.SweepCarry.diverged`; not\n'
        '    :func:`scaffold_jax.sweep.no_such_function` nor :mod:`scaffold_jax.simulate`."""\n\n'
        "    def run(self):\n"
        '        """Calls :func:`missing`."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import refs_example

    import scaffold_jax.sweep

    modules = {
        "scaffold_jax": pdoc_doc.Module(scaffold_jax),
        "scaffold_jax.sweep": pdoc_doc.Module(scaffold_jax.sweep),
        "refs_example": pdoc_doc.Module(refs_example),
    }
    found = docs.unresolved_references(modules)
    assert [line for line in found if line.startswith("refs_example")] == [
        "refs_example.Local: scaffold_jax.sweep.no_such_function",
        "refs_example.Local: scaffold_jax.simulate",
        "refs_example.Local.run: missing",
    ]


def test_the_config_reference_is_current(monkeypatch):
    # Other tests load plugin algorithms into the registry; the reference is the package's.
    ours = {n: s for n, s in ALGORITHMS.items() if s.factory.__module__.startswith("scaffold_jax")}
    monkeypatch.setattr(ALGORITHMS, "_entries", ours)
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == docs.config_markdown(), (
        "docs/config.md is stale: regenerate it with `make docs` (python -m scaffold_jax.docs)"
    )
    for field in dataclasses.fields(experiments.RunConfig):
        assert f"| `{field.name}` |" in committed
    for name in ("prox_mu", "alpha", "scaffold_option", "server_optimizer"):
        assert f"| `{name}` |" in committed


def _sections(text: str) -> dict[str, str]:
    """docs/config.md's command-line sections by command (``""``: before the command)."""
    parts = re.split(r"^### `scaffold-jax ?([a-z]*)`.*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_flag_of_every_command_is_in_the_config_reference(monkeypatch):
    """A flag that stands for a config key is in the key tables; every other flag (--out,
    --resume, --seeds, --grid, --set...) in its command's own table, with its default."""
    ours = {n: s for n, s in ALGORITHMS.items() if s.factory.__module__.startswith("scaffold_jax")}
    monkeypatch.setattr(ALGORITHMS, "_entries", ours)
    committed = (ROOT / "docs" / "config.md").read_text()
    keys_part, _, flags_part = committed.partition("## Command-line flags")
    sections = _sections(flags_part)
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) <= set(sections)
    fields = {f.name for f in dataclasses.fields(experiments.RunConfig)}
    own = {}
    for name, command in commands.choices.items():
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            is_key = action.default is argparse.SUPPRESS and (
                action.dest in fields or action.dest.startswith("declared:")
            )
            if is_key:
                assert f"| `{flag}` |" in keys_part, f"{name} {flag}"
            else:
                assert f"| `{flag}` |" in sections[name], f"{name} {flag}"
                own.setdefault(name, []).append(flag)
    for action in parser._actions:  # before the command (a global --plugin)
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            assert f"| `{action.option_strings[0]}` |" in sections[""]
    for flag in ("--resume", "--tensorboard", "--checkpoint-every", "--no-checkpoint", "--set"):
        assert flag in own["run"] and flag in own["sweep"]
    assert {"--seeds", "--lr-grid", "--grid", "--algorithms", "--target"} <= set(own["sweep"])
    assert {"--quick", "--lr-grid", "--set", "--plugin", "--out"} <= set(own["reproduce"])
    assert {"--out", "--gd-steps", "--num-iters"} <= set(own["diagnose"])
    assert "| `--seeds` | N ... | `[0]` |" in sections["sweep"]  # argument and default
    assert "| `--checkpoint-minutes` | M | `5.0` |" in sections["run"]


def test_the_example_config_is_valid_and_documented():
    path = ROOT / "examples" / "scaffold_fmnist.toml"
    values = experiments.load_config_file(path)
    config = experiments.RunConfig.from_dict(values, where=str(path)).validate()
    assert (config.algorithm, config.dataset, config.num_clients) == (
        "scaffold",
        "fashion_mnist",
        100,
    )
    assert config.resolved_clients_per_round() == 20
    assert config.resolved_partition() == ("similarity", {"similarity": 0})
    plan = config.resolved_plan()
    assert (plan.kind, plan.fraction, plan.num_epochs) == ("fraction", 0.2, 1)
    assert config.resolved_options()["scaffold_option"] == "II"
    reference = (ROOT / "docs" / "config.md").read_text()
    assert all(f"| `{key}` |" in reference for key in values)


def test_the_readme_opens_with_exactly_the_two_commands():
    """The set-up contract: README.md's first code block is `make demo` and `make test`."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    assert readme.index("```") < readme.index("\n\n", readme.index("# scaffold_jax")) + 3


def test_the_documented_commands_leave_git_status_clean():
    """Every folder the commands of the README and the site write (their --out, their data
    folders, and each command's default output folder) is ignored by git: `git status`
    stays clean."""
    import shlex
    import shutil
    import subprocess

    from test_doc_blocks import PAGES, _commands

    from scaffold_jax import paper
    from scaffold_jax.experiments import RunConfig
    from scaffold_jax.experiments.commands import default_folder

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = {"results/demo/accuracy.png"}  # make demo
    for line in [line for page in PAGES for line in _commands(page)]:
        argv = shlex.split(line, comments=True)
        for flag in ("--out", "--data-dir"):
            if flag in argv:
                written.add(argv[argv.index(flag) + 1] + "/x")
        if argv[:2] == ["python", "tests/plugins/lab.py"]:
            written.add(argv[2] + "/blobs.npz")
    config = RunConfig()
    for command in ("run", "sweep", "diagnose"):
        written.add(str(default_folder(command, config, config.to_dict()) / "summary.json"))
    written.add(str(paper.default_folder("fig3", False, {}) / "summary.json"))
    written.add(str(paper.default_folder("table3", True, {"seed": 1}) / "summary.json"))
    assert len(written) > 8
    checked = subprocess.run(["git", "check-ignore", "--no-index", *sorted(written)], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
    ignored = set(checked.stdout.split())
    assert sorted(written - ignored) == []
