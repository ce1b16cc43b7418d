"""Shared test helpers.

Rank promotion is set to "raise" and dtype promotion to "strict" (as equinox's tests do):
a client axis broadcast by accident, or a float64 / int32 value silently mixed into
float32 arithmetic, fails loudly instead of producing wrong numbers.
"""

import os
import shutil
import tempfile

# JAX's persistent compilation cache for the test session, in a temporary folder (never the
# user's ~/.cache): a program compiled twice (the same small simulation in two tests, the
# same command-line run in two subprocesses) is compiled once. Most of the suite's programs
# differ, so it saves 5-10% of a fresh run (benchmarks/README.md, "The test suite"); a
# folder kept between runs saves more: SCAFFOLD_JAX_TEST_XLA_CACHE set beforehand names a folder
# to reuse (kept), or "off". The pytest-xdist workers and the command-line processes the
# tests start inherit the folder through the environment; the process that made it
# removes it at the end.
_CACHE_ENV = "SCAFFOLD_JAX_TEST_XLA_CACHE"
_OWN_CACHE = None
if _CACHE_ENV not in os.environ:
    _OWN_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="scaffold_jax_test_xla_")
_CACHE = os.environ[_CACHE_ENV]
if _CACHE.strip().lower() in ("", "0", "off", "false", "no"):
    _CACHE = None

# The tests' programs compile 3-4x faster with LLVM's optimisation off and XLA's older CPU
# fusion emitters (1.2 s -> 0.3 s for a small round program, which runs in milliseconds
# here): `make test`'s quick loop. The last bits of a result can differ from the programs
# users get (other machine code), so `make test-slow` and `make test-release` (both in CI)
# compile as users do: SCAFFOLD_JAX_TEST_COMPILE=release. The flags reach the command-line
# processes the tests start through the environment. XLA aborts on a flag it does not know,
# so a jaxlib older than the one they were measured with (0.10) compiles as users do.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
_MODE = os.environ.setdefault("SCAFFOLD_JAX_TEST_COMPILE", "quick")
if _MODE not in ("quick", "release"):
    raise ValueError("SCAFFOLD_JAX_TEST_COMPILE must be 'quick' (the default) or 'release'")
if _MODE == "quick":
    from importlib.metadata import version

    if tuple(int(p) for p in version("jaxlib").split(".")[:2] if p.isdigit()) >= (0, 10):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_XLA_FLAGS}".strip()

# The command line turns the same cache on by itself (scaffold_jax.compilation_cache); in
# the tests it points at the session's folder. tests/test_compilation_cache.py uses its own.
os.environ["SCAFFOLD_JAX_COMPILE_CACHE"] = _CACHE or "off"
# No size limit: with one, JAX takes a file lock and scans the whole folder at every write
# (the suite's time nearly doubled). Without the lock a process can read an entry that
# another is still writing; JAX then fails to decompress it, warns and compiles instead.

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import scaffold_jax as sj  # noqa: E402
from scaffold_jax import registry  # noqa: E402


def pytest_unconfigure(config):
    if _OWN_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Registries are process-global: what a test (or a module's fixtures) registers, plugins'
# entries included, is undone after it, so no test sees another's entries whatever the
# order or the worker it runs on.
@pytest.fixture(autouse=True, scope="module")
def _registries_per_module():
    snap = registry.snapshot()
    yield
    registry.restore(snap)


@pytest.fixture(autouse=True)
def _registries_per_test():
    snap = registry.snapshot()
    yield
    registry.restore(snap)


def make_classification_clients(sizes, dim=5, num_classes=3, seed=0, skew=True):
    """Unequal-size clients with label skew: client i mostly sees labels near i."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(num_classes, dim)).astype(np.float32) * 2
    clients = []
    for i, n in enumerate(sizes):
        if skew:
            y = (rng.integers(0, 2, n) + i) % num_classes
        else:
            y = rng.integers(0, num_classes, n)
        x = centers[y] + rng.normal(size=(n, dim)).astype(np.float32)
        clients.append({"x": x.astype(np.float32), "y": y.astype(np.int32)})
    return clients


@pytest.fixture(scope="session")
def small_data():
    """7 clients of unequal sizes (2..13 examples), 5 features, 3 classes, a test set."""
    sizes = [2, 9, 5, 13, 3, 7, 11]
    clients = make_classification_clients(sizes)
    test = make_classification_clients([40], seed=1, skew=False)[0]
    return sj.from_client_arrays(clients, test=test)


@pytest.fixture(scope="session")
def small_problem():
    return sj.models.logistic_regression((5,), 3, zero_init=False, key=jax.random.key(3))


def binary_clients(sizes, seed: int):
    """Clients of ``sizes`` examples: 3 standard-normal features, labels 0/1 at random (the
    clock's, FedBuff's and the continued runs' tests)."""
    rng = np.random.default_rng(seed)
    return sj.data.from_client_arrays(
        [
            {"x": rng.normal(size=(n, 3)).astype("float32"), "y": rng.integers(0, 2, n)}
            for n in sizes
        ]
    )


def quadratic_clients(num_clients=4, dim=3, seed=0):
    """Heterogeneous quadratics f_i(x) = ½ xᵀA_i x − b_iᵀx, one "example" per client.

    Returns (data, problem, x_star) with x* = (Σ A_i)⁻¹ Σ b_i.
    """
    rng = np.random.default_rng(seed)
    a = []
    for _ in range(num_clients):
        q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
        a.append((q * rng.uniform(0.2, 1.0, dim)) @ q.T)
    a = np.stack(a).astype(np.float32)
    b = (rng.normal(size=(num_clients, dim)) * 3).astype(np.float32)
    x_star = np.linalg.solve(a.astype(np.float64).sum(0), b.astype(np.float64).sum(0))
    clients = [{"A": a[i : i + 1], "b": b[i : i + 1]} for i in range(num_clients)]
    data = sj.from_client_arrays(clients)

    def loss_fn(params, batch):
        x = params["x"]
        return 0.5 * jnp.einsum("i,bij,j->b", x, batch["A"], x) - batch["b"] @ x

    problem = sj.Problem(params={"x": jnp.zeros(dim, jnp.float32)}, loss_fn=loss_fn)
    return data, problem, x_star


def reference_grad(loss_fn, params, batch, mask):
    """The reference loops' gradient: of the masked mean loss, at float64 host params (cast
    to float32 for the model), returned as float64 numpy. Shared by the per-client
    reference loops of the algorithm tests (nothing vmapped, no engine code)."""

    def mean_loss(p):
        return jnp.sum(loss_fn(p, batch) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    p32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    return jax.tree.map(lambda g: np.asarray(g, np.float64), jax.grad(mean_loss)(p32))


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def run_folder_final_state(out, rounds: int) -> list:
    """The leaves of the newest checkpoint of a `scaffold-jax run` folder, which must be at
    ``rounds`` (rebuilt from its config.json: what a resume must reach bit for bit)."""
    import json
    from pathlib import Path

    from scaffold_jax import checkpoint, experiments

    config = experiments.RunConfig.from_dict(json.loads((Path(out) / "config.json").read_text()))
    built = experiments.build(config)
    like = built.simulation.state_like(built.data.num_clients)
    restored = checkpoint.restore_latest(Path(out) / experiments.CHECKPOINTS, like)
    assert restored.round == rounds
    return [np.asarray(a) for a in jax.tree.leaves(restored.state)]


# `SCAFFOLD_JAX_TEST_COMPILE_LOG=path pytest ...`: one JSON line per test (setup, call and
# teardown together) with its XLA compilations and the seconds spent tracing, lowering and
# compiling in this process (subprocesses not counted), into path.<worker>: where a slow
# test's time goes. benchmarks/test_durations.py reads it.
_COMPILE_LOG = os.environ.get("SCAFFOLD_JAX_TEST_COMPILE_LOG")
if _COMPILE_LOG:
    import json
    import time

    _COMPILE_EVENTS = {
        "/jax/core/compile/backend_compile_duration": "compile",
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    }
    _spent: dict = {}

    def _on_duration(event, seconds, **_):
        kind = _COMPILE_EVENTS.get(event)
        if kind:
            _spent[kind] = _spent.get(kind, 0.0) + seconds
            if kind == "compile":
                _spent["compiles"] = _spent.get("compiles", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(_on_duration)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _spent.clear()
        start = time.perf_counter()
        yield
        line = {"test": item.nodeid, "seconds": time.perf_counter() - start, **_spent}
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_COMPILE_LOG}.{worker}", "a") as f:
            f.write(json.dumps(line) + "\n")
