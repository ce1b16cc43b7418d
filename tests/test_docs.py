"""The documentation: the API reference builds without a warning (cross-references
resolve), docs/config.md is what its generator makes, the example config is valid."""

import dataclasses
from pathlib import Path

import pytest

from scaffold_jax import docs, experiments
from scaffold_jax.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent


def test_the_api_reference_builds_without_a_warning(tmp_path):
    pytest.importorskip("pdoc")
    assert docs.build_api(tmp_path) == []
    page = (tmp_path / "scaffold_jax" / "sweep.html").read_text()
    assert 'id="grid"' in page  # the functions are documented ...
    assert 'href="loop.html#drive"' in page  # ... and :func:`...` references are links


def test_an_unresolved_reference_is_a_warning(tmp_path, monkeypatch):
    pdoc_doc = pytest.importorskip("pdoc.doc")
    (tmp_path / "refs_example.py").write_text(
        '"""See :func:`~scaffold_jax.sweep.grid` and :class:`Local`."""\n\n\n'
        "class Local:\n"
        '    """Its :meth:`run` and :attr:`scaffold_jax.sweep.SweepResult.records`; not\n'
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
    assert committed == experiments.config_reference(), (
        "docs/config.md is stale: regenerate it with `make docs` (python -m scaffold_jax.docs)"
    )
    for field in dataclasses.fields(experiments.RunConfig):
        assert f"| `{field.name}` |" in committed
    for name in ("prox_mu", "alpha", "scaffold_option", "server_optimizer"):
        assert f"| `{name}` |" in committed


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
