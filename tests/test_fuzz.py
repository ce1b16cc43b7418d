"""Fuzzing the command line: random argument lists and config files for every command
never end in a traceback or a hang, only in 0, a one-line error with exit 1 (a run that
could not start or finish) or 2 (invalid arguments), or argparse's usage error.

Slow (``pytest -m slow``): it runs for ``SCAFFOLD_JAX_FUZZ_SECONDS`` (600 by default) and
prints how many argument lists it tried. The fuzzing runs in a child process under an 8 GiB
address-space limit: an input that kills the process (an XLA abort, the kernel's OOM killer)
then fails one test naming that input, instead of taking down a pytest-xdist worker and, in
CI, the make that waited on it. Every list starts from a small valid run (a
synthetic dataset, 2 rounds, 4 clients), so a list that is valid runs for seconds, and
the fuzzed flags override it: their values come from a pool of the values that break
programs (0, negatives, huge and subnormal numbers, NaN, empty and odd strings, paths that
are folders or missing).
"""

import argparse
import contextlib
import functools
import io
import json
import os
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaffold_jax import cli
from scaffold_jax.engine.checks import MAX_ROUNDS

pytestmark = pytest.mark.slow
CHILD = os.environ.get("SCAFFOLD_JAX_FUZZ_CHILD") == "1"
LOG = os.environ.get("SCAFFOLD_JAX_FUZZ_LOG")  # each input, written before it runs
MEMORY_LIMIT = 8 * 2**30
BUDGET = float(os.environ.get("SCAFFOLD_JAX_FUZZ_SECONDS", "600"))
HANG_SECONDS = 180  # far beyond a 2-round synthetic run; a list that takes longer hangs
BASE = {
    "run": ["--dataset", "synthetic", "--num-clients", "4", "--rounds", "2", "--quiet"],
    "sweep": [
        "--dataset",
        "synthetic",
        "--num-clients",
        "4",
        "--rounds",
        "2",
        "--quiet",
        "--lr-grid",
        "0.1",
        "0.3",
    ],  # fmt: skip
    "diagnose": ["--dataset", "synthetic", "--num-clients", "4", "--num-iters", "2", "--quiet"],
    "reproduce": ["fig3", "--quick", "--rounds", "2", "--quiet"],
}
NUMBERS = ["0", "-1", "1", "2", "3", "0.5", "1e-50", "1e-45", "1e30", "1e9", "2147483648",
           "1000000000000", "nan", "inf", "-inf", "1.5", "100"]  # fmt: skip
WORDS = ["", " ", "x", "none", "None", "true", "[1]", '{"a": 1}', "sgd", "adam:b1=2",
         "momentum:momentum=-1", "logreg", "mlp", "fedavg", "scaffold", "../", "é",
         "a=b"]  # fmt: skip


@functools.cache
def _flags(command: str) -> list[tuple[str, argparse.Action]]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = sub.choices[command]._actions
    skip = {"--help", "--out", "--overwrite", "--resume", "--plugin", "--config"}
    return [(a.option_strings[-1], a) for a in actions
            if a.option_strings and a.option_strings[-1] not in skip]  # fmt: skip


def _values(action: argparse.Action, tmp: str):
    pool = NUMBERS if action.type in (int, float) else [*WORDS, *NUMBERS, tmp, tmp + "/missing"]
    if action.nargs == 0:  # a switch
        return st.just([])
    if action.nargs in ("+", "*"):
        return st.lists(st.sampled_from(pool), min_size=0, max_size=3)
    if action.nargs == "?":
        return st.lists(st.sampled_from(pool), max_size=1)
    return st.lists(st.sampled_from(pool), min_size=1, max_size=1)


@st.composite
def argv(draw, tmp: str):
    command = draw(st.sampled_from(sorted(BASE)))
    flags = _flags(command)
    chosen = draw(
        st.lists(st.sampled_from(flags), min_size=1, max_size=4, unique_by=lambda f: f[0])
    )
    extra = []
    for flag, action in chosen:
        extra += [flag, *draw(_values(action, tmp))]
    sets = draw(st.lists(st.tuples(st.sampled_from(["rounds", "model", "similarity", "seed",
                                                    "hparams", "options", "nope", "dim"]),
                                   st.sampled_from(NUMBERS + WORDS)), max_size=2))  # fmt: skip
    for key, value in sets:
        extra += ["--set", f"{key}={value}"]
    return [command, *BASE[command], *extra]


@st.composite
def config_file(draw):
    from scaffold_jax.experiments import RunConfig, declared_hparams, declared_options

    keys = [*RunConfig.field_names(), *declared_hparams(), *declared_options(), "unknown_key"]
    values = st.one_of(
        st.none(), st.booleans(), st.integers(-3, 10**12),
        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS),
        st.lists(st.integers(-2, 5), max_size=3),
        st.dictionaries(st.sampled_from(WORDS), st.integers(), max_size=2),
    )  # fmt: skip
    chosen = draw(st.dictionaries(st.sampled_from(keys), values, max_size=4))
    rounds = chosen.get("rounds")
    if type(rounds) is int and 1_000 < rounds <= MAX_ROUNDS:
        # A valid long run only takes long (2,099,762 rounds, an evaluation every 5, ran
        # past HANG_SECONDS in a fresh clone's CI): what the fuzz checks is that a run ends
        # cleanly, so a valid count beyond 1,000 runs as 1,000; those beyond MAX_ROUNDS stay
        # (their refusal is checked).
        chosen["rounds"] = 1_000
    return {"dataset": "synthetic", "num_clients": 4, "rounds": 2, **chosen}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


TRIED = {"argv": 0, "config": 0}


def _check(args, tmp_path, kind):
    out = tmp_path / f"out-{TRIED[kind]}"
    if args[0] != "reproduce" or "--out" not in args:
        args = [*args, "--out", str(out)]
    if LOG:  # a config file's text too: the file is gone when the parent reads the log
        shown = [*args, "#", open(args[2]).read()] if args[1:2] == ["--config"] else args
        with open(LOG, "a") as log:
            log.write(json.dumps(shown) + "\n")
    stderr = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_SECONDS)
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(args)
            except SystemExit as err:  # argparse's usage error
                code = err.code
    except _Hang:
        pytest.fail(f"hung for {HANG_SECONDS} s: scaffold-jax {' '.join(args)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    text = stderr.getvalue()
    assert code in (0, 1, 2), (code, args, text)
    assert "Traceback" not in text, (args, text)
    if code == 1:  # a runtime failure: one line
        errors = [line for line in text.splitlines() if line.startswith("scaffold-jax: error")]
        assert len(errors) == 1, (args, text)


STARTED: dict[str, float] = {}


def _over_budget(kind: str) -> bool:
    """Each test fuzzes for half the budget from its first example."""
    return time.monotonic() - STARTED.setdefault(kind, time.monotonic()) > BUDGET / 2


in_child = pytest.mark.skipif(not CHILD, reason="runs inside test_fuzz_in_a_child_process")


@in_child
@settings(max_examples=5_000, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(data=st.data())
def test_random_argument_lists_end_cleanly(data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    args = data.draw(argv(str(tmp)))
    if _over_budget("argv"):  # drawn all the same: hypothesis replays draws
        return
    TRIED["argv"] += 1
    _check(args, tmp, "argv")


@in_child
@settings(max_examples=5_000, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(values=config_file(), suffix=st.sampled_from([".json", ".toml"]))
def test_random_config_files_end_cleanly(values, suffix, tmp_path_factory):
    if _over_budget("config"):
        return
    tmp = tmp_path_factory.mktemp("fuzz")
    path = tmp / f"config{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(values))
    else:  # TOML has no null: a key set to None is left out
        path.write_text("".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in values.items()
                                if v is not None))  # fmt: skip
    TRIED["config"] += 1
    _check(["run", "--config", str(path)], tmp, "config")


@in_child
def test_report_how_many_were_tried():
    """Read by test_fuzz_in_a_child_process, which prints it (``-s``) and keeps it in
    pytest's cache (``.pytest_cache/v/scaffold_jax/fuzz``, also under xdist): the counts go
    to the closing note of a change to the CLI."""
    report = f"{TRIED['argv']} argument lists, {TRIED['config']} config files in {BUDGET:.0f} s"
    print(f"\nfuzz: {report}")
    assert TRIED["argv"] > 0 and TRIED["config"] > 0


@pytest.mark.skipif(CHILD, reason="the parent of the fuzzing")
def test_fuzz_in_a_child_process(tmp_path, request):
    import subprocess
    import sys

    log = tmp_path / "inputs.jsonl"
    script = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['-q', '-s', '-p', 'no:xdist', '-p', 'no:cacheprovider',"
        f" '-m', 'slow', {__file__!r}]))\n"
    )
    env = {**os.environ, "SCAFFOLD_JAX_FUZZ_CHILD": "1", "SCAFFOLD_JAX_FUZZ_LOG": str(log),
           "JAX_PLATFORMS": "cpu"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=BUDGET + 2 * HANG_SECONDS + 300)  # fmt: skip
    inputs = log.read_text().splitlines() if log.exists() else []
    last = f"scaffold-jax {' '.join(json.loads(inputs[-1]))}" if inputs else "none yet"
    assert done.returncode == 0, (
        f"the fuzzing process ended with {done.returncode} after {len(inputs)} inputs; "
        f"the last: {last}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )
    report = next(line for line in done.stdout.splitlines() if line.startswith("fuzz: "))
    print(f"\n{report}")
    if hasattr(request.config, "cache"):  # absent under -p no:cacheprovider
        request.config.cache.set("scaffold_jax/fuzz", report.removeprefix("fuzz: "))
