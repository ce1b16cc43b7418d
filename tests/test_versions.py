"""The declared dependency floors agree everywhere, and an environment below them fails clearly.

pyproject.toml's floors, the import-time check's (``scaffold_jax._requirements.MINIMUM``)
and the pins of .ci/min-constraints.txt, at which ``make test-min`` runs the smoke tests,
must be the same versions; a jax, flax, optax, numpy or orbax below its floor (which
``pip install --no-deps`` can leave in place) must fail at ``import scaffold_jax`` with the
versions found and needed.
"""

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from scaffold_jax import _requirements

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / ".ci" / "min-constraints.txt"


def declared_floors() -> dict[str, Version]:
    """Every requirement of pyproject.toml (dependencies and extras) -> its floor."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        texts += extra
    floors = {}
    for text in texts:
        req = Requirement(text)
        (spec,) = req.specifier  # a floor and nothing else: no caps, so none to keep true
        assert spec.operator == ">=", f"{text}: declare a floor (>=) only"
        floors[canonicalize_name(req.name)] = Version(spec.version)
    return floors


def pinned() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.partition("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: pin one version (==)"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_every_declared_floor_is_pinned_in_the_min_constraints():
    floors, pins = declared_floors(), pinned()
    assert {name: pins.get(name) for name in floors} == floors


def test_the_import_time_check_has_pyprojects_floors():
    floors = declared_floors()
    checked = {name: Version(version) for name, version in _requirements.MINIMUM.items()}
    assert checked == {name: floors[name] for name in checked}
    # jax decides most of what works: it must be among the checked.
    assert {"jax", "flax", "optax"} <= set(_requirements.MINIMUM)


def fake_versions(**found):
    """A ``metadata.version`` that reports ``found`` (``orbax_checkpoint`` for
    orbax-checkpoint) and the floor for every other checked package."""
    found = {canonicalize_name(name): version for name, version in found.items()}

    def version_of(name):
        return found.get(canonicalize_name(name), _requirements.MINIMUM[name])

    return version_of


def test_a_jax_below_its_floor_names_what_was_found_and_what_is_needed():
    with pytest.raises(ImportError) as err:
        _requirements.check(fake_versions(jax="0.5.3"))
    message = str(err.value)
    assert "found jax 0.5.3" in message
    assert f"pip install -U 'jax>={_requirements.MINIMUM['jax']}'" in message
    assert "flax" not in message  # only what is too old


def test_every_package_below_its_floor_is_named_in_one_error():
    with pytest.raises(ImportError) as err:
        _requirements.check(fake_versions(flax="0.8.5", orbax_checkpoint="0.6.4"))
    message = str(err.value)
    assert "found flax 0.8.5, orbax-checkpoint 0.6.4" in message
    assert "'flax>=0.10.0' 'orbax-checkpoint>=0.10.0'" in message


@pytest.mark.parametrize(
    "jax_version",
    [
        _requirements.MINIMUM["jax"],
        "0.10.2",  # compared as numbers: a string comparison would call 0.10 older than 0.6
        _requirements.MINIMUM["jax"] + "rc1",
        _requirements.MINIMUM["jax"] + ".dev20250601",
        "1.0",
    ],
)
def test_versions_at_or_above_the_floor_pass(jax_version):
    _requirements.check(fake_versions(jax=jax_version))


def test_a_package_pip_does_not_know_or_an_unnumbered_version_is_not_judged():
    def version_of(name):
        if name == "jax":
            raise metadata.PackageNotFoundError(name)
        return "unknown" if name == "flax" else _requirements.MINIMUM[name]

    _requirements.check(version_of)


def test_release_reads_the_numeric_part():
    assert _requirements.release("0.6.1") == (0, 6, 1)
    assert _requirements.release("2.0.0rc1") == (2, 0, 0)
    assert _requirements.release("1.26.4+local") == (1, 26, 4)
    assert _requirements.release("unknown") == ()


def test_import_fails_before_jax_is_imported_when_installed_jax_is_too_old(tmp_path):
    """What a `pip install --no-deps` next to an old jax looks like: pip's record of jax
    says 0.5.3. The import must stop at the check, not at jax's missing names."""
    dist = tmp_path / "jax-0.5.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jax\nVersion: 0.5.3\n")
    code = "import sys\ntry:\n    import scaffold_jax\nexcept ImportError as e:\n"
    code += "    print(e); print('jax' in sys.modules)\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    message, jax_imported = proc.stdout.splitlines()
    assert "found jax 0.5.3" in message and "'jax>=0.6.1'" in message
    assert jax_imported == "False"
