"""The command line's persistent compilation cache: a second identical run loads every
program it compiles from the cache (no new entry), ``--no-compile-cache`` and
``SCAFFOLD_JAX_COMPILE_CACHE=off`` write none."""

import json
import os
import subprocess
import sys

import pytest
from test_cli import TINY, needs_fashion

from scaffold_jax import compilation_cache, results


def _run(tmp_path, name, cache, *extra):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    env = {**os.environ, compilation_cache.ENV: str(cache)}
    argv = ["run", "--config", str(config), "--rounds", "4", "--out", str(tmp_path / name)]
    proc = subprocess.run(
        [sys.executable, "-m", "scaffold_jax.cli", *argv, "--quiet", *extra],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / name / "summary.json").read_text())


def _entries(folder):
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.slow  # two fresh command-line processes (~10 s); the flag is tested in-process
@needs_fashion
def test_a_second_identical_run_compiles_nothing_new(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path, "first", cache)
    entries = _entries(cache)
    assert entries  # the round and evaluation programs at least
    second = _run(tmp_path, "second", cache)
    assert _entries(cache) == entries  # every program came from the cache
    # ...and runs the same: a cached program is the program.
    same = [{k: v for k, v in r.items() if "seconds" not in k} for r in (first, second)]
    assert [r["round"] for r in results.read_records(tmp_path / "second")] == [0, 2, 4]
    for name in ("rounds_to_target", "final"):
        assert same[0].get(name) == same[1].get(name)


def test_no_compile_cache_leaves_the_cache_off(monkeypatch, tmp_path):
    """``main`` turns the cache on before anything compiles, unless --no-compile-cache."""
    from scaffold_jax import cli

    calls = []
    monkeypatch.setattr(compilation_cache, "enable", lambda: calls.append(1))
    argv = ["run", "--rounds", "0", "--out", str(tmp_path / "x"), "--quiet"]  # refused
    assert cli.main(argv) == 2 and calls == [1]
    assert cli.main([*argv, "--no-compile-cache"]) == 2 and calls == [1]


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(compilation_cache.ENV, "off")
    assert compilation_cache.default_directory() is None
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "x"))
    assert compilation_cache.default_directory() == tmp_path / "x"
    monkeypatch.delenv(compilation_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_directory() == tmp_path / "scaffold_jax" / "xla"
