"""Multi-host through JAX itself: two processes on localhost run ONE sharded simulation.

Each process calls ``jax.distributed.initialize`` (coordinator on localhost,
``num_processes=2``) with two forced CPU devices, so the client mesh has 4 devices over 2
processes and the cross-process collectives go through gloo (jax's CPU collectives,
``jax_cpu_collectives_implementation="gloo"``). Both processes then gather the global
result and must agree with each other and with the same run on one process, one device.
The processes are this file run as a script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
ROUNDS = 4
NUM_CLIENTS = 24  # 6 rows of the table per device
CLIENTS_PER_ROUND = 10  # not a multiple of the 4 devices


def build():
    """``(simulation, data)``: SCAFFOLD with sampling on unequal, label-skewed clients."""
    from conftest import make_classification_clients

    import scaffold_jax as sj

    sizes = [2 + (5 * i) % 9 for i in range(NUM_CLIENTS)]
    sizes[-1] += (-sum(sizes)) % (NUM_PROCESSES * DEVICES_PER_PROCESS)  # rows split evenly
    test = make_classification_clients([40], seed=1, skew=False)[0]
    data = sj.from_client_arrays(make_classification_clients(sizes), test=test)
    problem = sj.models.logistic_regression((5,), 3)
    sim = sj.Simulation(
        sj.scaffold(problem.loss_fn),
        problem,
        sj.BatchPlan.fixed(batch_size=3, num_steps=4),
        clients_per_round=CLIENTS_PER_ROUND,
    )
    return sim, data


def outcome(result) -> dict[str, np.ndarray]:
    import jax

    from scaffold_jax import sharding

    out = {f"leaf{i}": a for i, a in enumerate(sharding.gather(jax.tree.leaves(result.state)))}
    out["client_ids"] = np.asarray(result.client_ids)
    for name in result.records[0]:
        if name != "seconds":
            out[name] = np.array([r[name] for r in result.records])
    return out


def worker(port: int, process_id: int, out_dir: Path) -> None:
    """One of the processes: joins the others, runs the sharded simulation, saves."""
    import jax

    # gloo is already jax's default for CPU collectives; said here so the test documents
    # what a multi-process CPU run needs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=120,
    )
    import scaffold_jax as sj
    from scaffold_jax import sharding

    sim, data = build()
    sharded = sharding.shard(sim, sharding.client_mesh())
    result = sharded.run(data, sj.hparams(client_lr=0.1), num_rounds=ROUNDS, eval_every=2)
    out = outcome(result)  # a collective: every process gathers the whole table
    table = jax.tree.leaves(result.state.clients)[0]
    info = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "table_fully_addressable": table.is_fully_addressable,
        "local_rows": sum(s.data.shape[0] for s in table.addressable_shards),
    }
    # Checkpoints (saving or resuming) are refused with several processes, up front.
    try:
        sharded.run(data, sj.hparams(client_lr=0.1), ROUNDS, 2, checkpoint_dir=out_dir, resume=True)
        info["checkpoint_refusal"] = None
    except NotImplementedError as err:
        info["checkpoint_refusal"] = str(err)
    np.savez(out_dir / f"process{process_id}.npz", **out)
    (out_dir / f"process{process_id}.json").write_text(json.dumps(info))
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    """Two jax processes (4 devices) run one simulation; both equal a one-process run."""
    port = free_port()
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
        JAX_PLATFORMS="cpu",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(port), str(pid), str(tmp_path)],
            env=env,
            cwd=Path(__file__).parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(NUM_PROCESSES)
    ]
    try:
        # The one-process reference, computed while the two processes run.
        import scaffold_jax as sj

        sim, data = build()
        expected = outcome(
            sim.run(data, sj.hparams(client_lr=0.1), num_rounds=ROUNDS, eval_every=2)
        )
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, err in zip(procs, errors, strict=True):
        assert p.returncode == 0, err[-4000:]

    for pid in range(NUM_PROCESSES):
        info = json.loads((tmp_path / f"process{pid}.json").read_text())
        assert info["process_index"] == pid and info["process_count"] == NUM_PROCESSES
        assert info["device_count"] == NUM_PROCESSES * DEVICES_PER_PROCESS
        assert info["local_device_count"] == DEVICES_PER_PROCESS
        # Each process holds only its half of the table.
        assert not info["table_fully_addressable"]
        assert info["local_rows"] == NUM_CLIENTS // NUM_PROCESSES
        assert "several processes" in (info["checkpoint_refusal"] or ""), info
        got = dict(np.load(tmp_path / f"process{pid}.npz"))
        assert sorted(got) == sorted(expected)
        np.testing.assert_array_equal(got["client_ids"], expected["client_ids"])
        for key, want in expected.items():
            atol = 1e-5 * float(np.max(np.abs(want), initial=0.0))
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=atol, err_msg=key)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
