"""Tests of :mod:`scaffold_jax.sharding`: the client axis split over a device mesh.

The central test runs the same SCAFFOLD simulations (with sampling, S < N; S divisible by
8 and not) unsharded on one device in this process and sharded over 8 forced CPU devices
in a subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before
jax is imported, so it cannot share this process), and compares the final states,
sampled ids and evaluations. The subprocess also stops each sharded run at round 2 with a
checkpoint and resumes it (``resume=True``), which must give the uninterrupted sharded run
bit for bit. The subprocess is this file run as a script; its tests are in the slow tier
(~35 s), the one-device mesh's in the quick one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_classification_clients
from jax.sharding import PartitionSpec as P

import scaffold_jax as sj
from scaffold_jax import checkpoint, layout
from scaffold_jax.algorithms import client_controls
from scaffold_jax.data.synthetic import procedural_synthetic

ROUNDS = 4
NUM_DEVICES = 8
STATELESS = ("mime",)  # algorithms without a client table
CASES = {
    # S divisible by 8; procedural data (nothing to place but counts); float32 table.
    "procedural_s16": dict(data="procedural", num_clients=64, clients_per_round=16),
    # S = 12 not divisible by 8; materialised data whose examples are split over the
    # devices; bfloat16 table; data-size weighting (reads counts[ids]).
    "federated_s12": dict(
        data="federated",
        num_clients=40,
        clients_per_round=12,
        control_dtype="bfloat16",
        weighting="num_examples",
    ),
    # Mime: a full-data pass over the sampled clients every round (a weighted mean across
    # devices) before the local steps; its base optimizer's state is server state.
    "mime_s12": dict(
        data="federated",
        num_clients=40,
        clients_per_round=12,
        algorithm="mime",
        weighting="num_examples",
    ),
    # FedDyn: a stateful table (g_i) and the server's h, updated with the 1/N of all
    # clients.
    "feddyn_s12": dict(data="federated", num_clients=40, clients_per_round=12, algorithm="feddyn"),
    # SCAFFOLD with warm-started controls: one pass over ALL N clients of the table.
    "warm_s16": dict(data="procedural", num_clients=64, clients_per_round=16, warm_controls=True),
    # BatchNorm statistics kept per client: a second [N, ...] table (SimState.model), split
    # over the devices like the controls.
    # BatchNorm normalises by the std of 1-4 real examples: float32 rounding differences of
    # the summation order grow about tenfold, hence rtol 1e-4 against one device.
    # Markov availability (an [N] chain in SimState.participation, replicated), uniform
    # stragglers (cut step masks, chunks sorted by K_i) and dropouts (masked rows).
    "participation_s12": dict(
        data="federated",
        num_clients=40,
        clients_per_round=12,
        participation=dict(availability="markov", stragglers="uniform", dropouts="bernoulli"),
    ),
    "batchnorm_local_s12": dict(
        data="federated", num_clients=40, clients_per_round=12, model="batchnorm", rtol=1e-4
    ),
    # FedBuff: the in-flight table ([M = 16, ...], split over the devices), a server step
    # of B = 8 arrivals and their replacements trained from two server states.
    "fedbuff_m16": dict(
        data="federated",
        num_clients=40,
        clients_per_round=8,
        execution=(16, 8),
        participation=dict(profiles="lognormal"),
    ),
}


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train, mask=None):
        # No bias before BatchNorm (it has no gradient there: its float noise would be
        # all the leaf holds, and differ between summation orders).
        h = nn.Dense(6, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(
            h, mask=None if mask is None else mask[:, None]
        )
        return nn.Dense(3)(nn.relu(h))


def federated_sizes(num_clients: int) -> list[int]:
    """Unequal client sizes whose total is a multiple of 8 (so "auto" splits the rows)."""
    sizes = [3 + (7 * i) % 11 for i in range(num_clients)]
    sizes[-1] += (-sum(sizes)) % NUM_DEVICES
    return sizes


def build(case: dict):
    """``(simulation, data)`` for a case of :data:`CASES` (unsharded)."""
    if case["data"] == "procedural":
        # No test set: materialising one costs a compile (seconds) in each process.
        data = procedural_synthetic(case["num_clients"], 1.0, 1.0, sizes=20, num_test_clients=0)
        problem = sj.models.logistic_regression((60,), 10)
    else:
        clients = make_classification_clients(federated_sizes(case["num_clients"]))
        test = make_classification_clients([48], seed=1, skew=False)[0]
        data = sj.from_client_arrays(clients, test=test)
        problem = sj.models.logistic_regression((5,), 3, zero_init=False, key=jax.random.key(3))
        if case.get("model") == "batchnorm":
            problem = sj.models.classification_problem(
                _BatchNormNet(), (5,), jax.random.key(3), train_arg="train", mask_arg="mask",
                state_policy="local",
            )  # fmt: skip
    dtype = jnp.dtype(case.get("control_dtype", "float32"))
    if case.get("algorithm") in ("mime", "feddyn"):
        algorithm = sj.algorithms.make(case["algorithm"], problem.loss_fn)
    else:
        warm = case.get("warm_controls", False)
        algorithm = sj.scaffold(problem.loss_fn, control_dtype=dtype, warm_controls=warm)
    sim = sj.Simulation(
        algorithm,
        problem,
        sj.BatchPlan.fixed(batch_size=4, num_steps=3),
        clients_per_round=case["clients_per_round"],
        weighting=case.get("weighting", "uniform"),
        participation=sj.participation.make(**case.get("participation", {})),
        execution=sj.FedBuff(*case["execution"]) if "execution" in case else None,
    )
    return sim, data


def outcome(result: sj.RunResult) -> dict[str, np.ndarray]:
    """The comparable parts of a run: state leaves (the client controls as numbers, also
    for a bfloat16 table stored as bit patterns), sampled ids, evaluations."""
    state = layout.gather(result.state)
    if hasattr(state.clients, "control"):
        controls = client_controls(state.clients)
        state = state._replace(clients=state.clients._replace(control=controls))
    leaves = jax.tree.leaves(state)
    out = {f"leaf{i}": np.asarray(a, np.float32) for i, a in enumerate(leaves)}
    out["client_ids"] = np.asarray(result.client_ids)
    for name in result.records[0]:
        if name == "started_ids":  # FedBuff's round-0 record alone: the clients started
            out[name] = np.asarray(result.records[0][name])
        elif name != "seconds":
            out[name] = np.array([r[name] for r in result.records])
    return out


def collectives(hlo: str) -> list[tuple[str, list[str]]]:
    """``(op, result shapes)`` of every cross-device collective in an HLO module's text."""
    found = []
    for line in hlo.splitlines():
        match = re.search(
            r"=\s*(.*?)\s(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
            r"(?:-start)?\(",
            line,
        )
        if match:
            found.append((match.group(2), re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", match.group(1))))
    return found


# ----------------------------------------------------------------------- the subprocess
def worker(out_dir: Path) -> None:
    """Runs every case sharded over all (forced) devices; writes npz files and a report."""
    mesh = layout.client_mesh()
    report: dict = {"num_devices": mesh.size}
    for name, case in CASES.items():
        sim, data = build(case)
        sharded = layout.shard(sim, mesh)
        result = sharded.run(data, sj.hparams(client_lr=0.1), num_rounds=ROUNDS, eval_every=2)
        np.savez(out_dir / f"{name}.npz", **outcome(result))
        # The same run stopped at round 2 (checkpoints every 2 rounds), then resumed.
        directory = out_dir / f"checkpoints_{name}"
        hp = sj.hparams(client_lr=0.1)
        sharded.run(data, hp, num_rounds=2, eval_every=2, checkpoint_dir=directory)
        like = sharded.state_like(data.num_clients)
        restored = checkpoint.restore_latest(directory, like).state
        resumed = sharded.run(
            data, hp, num_rounds=ROUNDS, eval_every=2, checkpoint_dir=directory, resume=True
        )
        np.savez(out_dir / f"{name}_resumed.npz", **outcome(resumed))
        # Mime keeps no client state: no table leaves (None below).
        rows = jax.tree.leaves(restored.clients)[:1]
        report[f"{name}_resumed"] = {
            "resumed_from": resumed.resumed_from,
            "rounds_run": len(resumed.client_ids),
            "restored_table_spec": str(rows[0].sharding.spec) if rows else None,
            "restored_server_spec": str(jax.tree.leaves(restored.server)[0].sharding.spec),
            "restored_block_rows": sorted({s.data.shape[0] for s in rows[0].addressable_shards})
            if rows
            else None,
            "table_dtype": str(rows[0].dtype) if rows else None,
        }
        tables = jax.tree.leaves(result.state.clients)[:1]
        stats = jax.tree.leaves(result.state.model)[:1]
        report[name] = {
            "model_spec": str(stats[0].sharding.spec) if stats else None,
            "table_spec": str(tables[0].sharding.spec) if tables else None,
            "server_spec": str(jax.tree.leaves(result.state.server)[0].sharding.spec),
            "block_rows": sorted({s.data.shape[0] for s in tables[0].addressable_shards})
            if tables
            else None,
            "examples_spec": str(
                jax.tree.leaves(sharded.layout.place_data(data).examples)[0].sharding.spec
                if hasattr(data, "examples")
                else None
            ),
        }
    # The collectives of the compiled block of the first case (the same program run()
    # compiled, so XLA's in-process cache answers without compiling again).
    sim, data = build(CASES["procedural_s16"])
    sharded = layout.shard(sim, mesh)
    state, data = sharded.init(data), sharded.layout.place_data(data)
    lowered = sharded.run_rounds.lower(
        sj.hparams(client_lr=0.1), state, data, jax.random.key(0), num_rounds=2
    )
    report["collectives"] = collectives(lowered.compile().as_text())
    # Tables that cannot be split evenly are refused with a message.
    errors = []
    for attempt in (
        lambda: sj.init_state(sim.algorithm, sim.problem.params, 60, layout.ClientMesh(mesh)),
        lambda: layout.place_state(sj.init_state(sim.algorithm, sim.problem.params, 60), mesh),
    ):
        try:
            attempt()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    report["errors"] = errors
    (out_dir / "report.json").write_text(json.dumps(report))


def start_worker(out_dir: Path, num_devices: int = NUM_DEVICES) -> subprocess.Popen:
    """This file as a script, on ``num_devices`` forced CPU devices."""
    # Appended: the worker compiles as this process does (tests/conftest.py's flags).
    flags = f"--xla_force_host_platform_device_count={num_devices}"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(
        [sys.executable, __file__, str(out_dir)],
        env=env,
        cwd=Path(__file__).parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reference(name: str) -> dict[str, np.ndarray]:
    """A case run by the plain (unsharded) Simulation on this process's one device."""
    sim, data = build(CASES[name])
    return outcome(sim.run(data, sj.hparams(client_lr=0.1), num_rounds=ROUNDS, eval_every=2))


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """``(report, sharded outcomes, one-device outcomes)``; the 8-device subprocess runs
    while this process computes the one-device references (two cores, both busy)."""
    out_dir = tmp_path_factory.mktemp("sharded")
    proc = start_worker(out_dir)
    try:
        references = {name: reference(name) for name in CASES}
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    report = json.loads((out_dir / "report.json").read_text())
    sharded = {
        name: dict(np.load(out_dir / f"{name}.npz"))
        for case in CASES
        for name in (case, f"{case}_resumed")
    }
    return report, sharded, references


@pytest.mark.slow  # eight CPU devices in a subprocess: ~35 s (the one-device mesh stays quick)
@pytest.mark.parametrize("name", list(CASES))
def test_eight_devices_match_one_device(eight_devices, name):
    """SCAFFOLD with sampling gives the same run unsharded on 1 device and on 8."""
    report, sharded, references = eight_devices
    assert report["num_devices"] == NUM_DEVICES
    got, expected = sharded[name], references[name]
    assert sorted(got) == sorted(expected)
    # The sampled clients are the same ids in the same order: sampling does not see the mesh.
    np.testing.assert_array_equal(got["client_ids"], expected["client_ids"])
    for key, want in expected.items():
        # Only the order of floating-point sums differs (all-reduce vs one dot); atol is
        # relative to the leaf's scale so that near-zero entries do not fail rtol alone.
        tol = CASES[name].get("rtol", 1e-5)
        atol = tol * float(np.max(np.abs(want), initial=0.0))
        np.testing.assert_allclose(got[key], want, rtol=tol, atol=atol, err_msg=key)


@pytest.mark.slow  # eight CPU devices in a subprocess: ~35 s (the one-device mesh stays quick)
@pytest.mark.parametrize("name", list(CASES))
def test_eight_devices_resume_bitwise(eight_devices, name):
    """A sharded run stopped at round 2 and resumed with resume=True is the uninterrupted
    sharded run bit for bit (state, sampled ids, evaluations), restored in the mesh
    layout; and so, to rtol 1e-5, the unsharded run."""
    report, sharded, references = eight_devices
    info = report[f"{name}_resumed"]
    assert info["resumed_from"] == 2 and info["rounds_run"] == ROUNDS - 2, info
    assert info["restored_server_spec"] == str(P()), info
    if CASES[name].get("algorithm") not in STATELESS:  # no client table
        assert info["restored_table_spec"] == str(P("clients")), info
        assert info["restored_block_rows"] == [CASES[name]["num_clients"] // NUM_DEVICES], info
        dtype = "uint16" if CASES[name].get("control_dtype") == "bfloat16" else "float32"
        assert info["table_dtype"] == dtype
    got, uninterrupted = sharded[f"{name}_resumed"], sharded[name]
    np.testing.assert_array_equal(got["client_ids"], uninterrupted["client_ids"][2:])
    for key, want in uninterrupted.items():
        if key != "client_ids":
            np.testing.assert_array_equal(got[key], want, err_msg=key)
    for key, want in references[name].items():
        if key != "client_ids":
            tol = CASES[name].get("rtol", 1e-5)
            atol = tol * float(np.max(np.abs(want), initial=0.0))
            np.testing.assert_allclose(got[key], want, rtol=tol, atol=atol, err_msg=key)


@pytest.mark.slow  # eight CPU devices in a subprocess: ~35 s (the one-device mesh stays quick)
def test_eight_device_layout(eight_devices):
    """Table rows split in equal blocks, server replicated, examples split when even."""
    report = eight_devices[0]
    rows, replicated = str(P("clients")), str(P())
    for name, case in CASES.items():
        info = report[name]
        assert info["server_spec"] == replicated, info
        if case.get("algorithm") in STATELESS:
            assert info["table_spec"] is None  # no client state
            continue
        assert info["table_spec"] == rows, info
        assert info["block_rows"] == [case["num_clients"] // NUM_DEVICES], info
    assert report["federated_s12"]["examples_spec"] == rows
    # The per-client BatchNorm statistics are a table like the controls; none elsewhere.
    assert report["batchnorm_local_s12"]["model_spec"] == rows
    assert report["federated_s12"]["model_spec"] is None


@pytest.mark.slow  # eight CPU devices in a subprocess: ~35 s (the one-device mesh stays quick)
def test_round_moves_sampled_rows_not_the_table(eight_devices):
    """The compiled rounds' collectives carry [S, ...] rows and [P] sums, never [N, ...]."""
    found = eight_devices[0]["collectives"]
    assert found, "a sharded round must contain collectives"
    num_clients = CASES["procedural_s16"]["num_clients"]
    clients_per_round = CASES["procedural_s16"]["clients_per_round"]
    leading = {
        (op, int(re.search(r"\[(\d*)", shape).group(1) or 0))
        for op, shapes in found
        for shape in shapes
    }
    assert all(rows != num_clients for _, rows in leading), found
    # The sampled rows' gather (all-reduce) and write-back (all-gather) are [S, ...].
    assert ("all-reduce", clients_per_round) in leading, found
    assert ("all-gather", clients_per_round) in leading, found


@pytest.mark.slow  # eight CPU devices in a subprocess: ~35 s (the one-device mesh stays quick)
def test_uneven_table_is_refused(eight_devices):
    for message in eight_devices[0]["errors"]:
        assert message is not None and "multiple of 8" in message, message


# --------------------------------------------------------------- one device, in-process
def test_sharded_init_equals_init_state():
    sim, data = build(CASES["federated_s12"])
    mesh = layout.client_mesh()
    placed = sj.init_state(
        sim.algorithm, sim.problem.params, data.num_clients, layout.ClientMesh(mesh)
    )
    plain = sj.init_state(sim.algorithm, sim.problem.params, data.num_clients)
    assert jax.tree.structure(placed) == jax.tree.structure(plain)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(plain), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.fixture(scope="module")
def one_device():
    """``(simulation, data, sharded simulation on a one-device mesh)``, shared so that its
    compiled blocks are too."""
    sim, data = build(CASES["procedural_s16"])
    return sim, data, layout.shard(sim)


def test_one_device_mesh_is_bitwise_the_simulation(eight_devices, one_device):
    """On a one-device mesh the layout hints change nothing: bitwise equal results."""
    _, data, sharded = one_device
    hp = sj.hparams(client_lr=0.1)
    got = outcome(sharded.run(data, hp, num_rounds=ROUNDS, eval_every=2))
    expected = eight_devices[2]["procedural_s16"]
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # A state passed back in (positionally: the 6th argument of Simulation.run) is placed
    # and continued, as a plain run would.
    again = sharded.run(data, hp, 2, 2, 0, sharded.init(data))
    assert int(again.state.round) == 2


def assert_same_run(got: dict, expected: dict) -> None:
    """Bitwise the same final state and records (the sampled ids are compared apart)."""
    for key in expected:
        if key != "client_ids":
            np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


def test_checkpoint_resume_continues_bitwise(eight_devices, one_device, tmp_path):
    """Saved by a sharded run stopped at round 2, resumed with resume=True: the
    uninterrupted run, bit for bit; the state is restored placed on the mesh."""
    sim, data, sharded = one_device
    hp = sj.hparams(client_lr=0.1)
    sharded.run(data, hp, num_rounds=2, eval_every=2, checkpoint_dir=tmp_path)
    result = sharded.run(data, hp, ROUNDS, 2, checkpoint_dir=tmp_path, resume=True)
    assert result.resumed_from == 2 and len(result.client_ids) == ROUNDS - 2
    expected = eight_devices[2]["procedural_s16"]
    got = outcome(result)
    assert_same_run(got, expected)
    np.testing.assert_array_equal(got["client_ids"], expected["client_ids"][2:])
    # The restore target carries the mesh's shardings, so the leaves come back placed.
    restored = checkpoint.restore_latest(tmp_path, sharded.state_like(data.num_clients))
    table = jax.tree.leaves(restored.state.clients)[0]
    assert isinstance(table.sharding, jax.sharding.NamedSharding)
    assert table.sharding.spec == P("clients")
    # A checkpoint of the plain Simulation resumes sharded too (same run, other layout).
    plain_dir = tmp_path / "plain"
    sim.run(data, hp, num_rounds=2, eval_every=2, checkpoint_dir=plain_dir)
    again = sharded.run(data, hp, ROUNDS, 2, checkpoint_dir=plain_dir, resume=True)
    assert_same_run(outcome(again), expected)
    # ... and a sharded run's checkpoint resumes in the plain Simulation.
    sharded_dir = tmp_path / "sharded"
    sharded.run(data, hp, num_rounds=2, eval_every=2, checkpoint_dir=sharded_dir)
    plain = sim.run(data, hp, ROUNDS, 2, checkpoint_dir=sharded_dir, resume=True)
    assert_same_run(outcome(plain), expected)
    # resume=True with a state is still refused, as for a plain Simulation.
    with pytest.raises(ValueError, match="either state="):
        sharded.run(
            data, hp, ROUNDS, 2, state=sharded.init(data), checkpoint_dir=tmp_path, resume=True
        )


def test_data_shardings_policies():
    mesh = layout.client_mesh()
    _, data = build(CASES["federated_s12"])
    spec = lambda s: jax.tree.leaves(s.examples)[0].spec  # noqa: E731
    assert spec(layout.data_shardings(data, mesh, "replicate")) == jax.sharding.PartitionSpec()
    assert spec(layout.data_shardings(data, mesh, "shard")) == jax.sharding.PartitionSpec("clients")
    assert layout.data_shardings(data, mesh).counts.spec == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="unknown"):
        layout.data_shardings(data, mesh, "scatter")


def test_mesh_must_have_one_axis():
    devices = np.asarray(jax.devices()[:1]).reshape(1, 1)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    sim, _ = build(CASES["procedural_s16"])
    with pytest.raises(ValueError, match="one-axis mesh"):
        layout.shard(sim, mesh)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
