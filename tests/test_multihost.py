"""Multi-host through JAX itself: two processes on localhost run ONE sharded simulation.

Each process calls ``jax.distributed.initialize`` (coordinator on localhost,
``num_processes=2``) with two forced CPU devices, so the client mesh has 4 devices over 2
processes and the cross-process collectives go through gloo (jax's CPU collectives,
``jax_cpu_collectives_implementation="gloo"``). Both processes then gather the global
result and must agree with each other and with the same run on one process, one device.
They also checkpoint a run together, stop it half way with a SIGTERM that only process 1
receives, damage its newest checkpoint and resume it from the one before: the resumed run
must end exactly where the uninterrupted one does. Each process writes and reads only its
own half of the client table: orbax writes the blocks of process 1 from process 1, no
process gathers a global array (``process_allgather`` is watched), and the restored table
comes back from orbax already spread over the processes. A block that only process 1 reads,
truncated or with a flipped byte, makes both processes fall back to the previous step. The
processes are this file run as a script.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

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

    from scaffold_jax import layout

    out = {f"leaf{i}": a for i, a in enumerate(layout.gather(jax.tree.leaves(result.state)))}
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
    from scaffold_jax import layout

    sim, data = build()
    sharded = layout.shard(sim, layout.client_mesh())
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
    np.savez(out_dir / f"process{process_id}.npz", **out)

    # Checkpoints: both processes save rounds 0, 1, 2 (keeping the last 2); at round 2 only
    # process 1 gets a SIGTERM, and both stop after that block. Process 0 then damages round
    # 2, and the resumed run falls back to round 1 (both processes agree, process 0 alone
    # renames it) and runs on to ROUNDS.
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    # Watched from here on: every process_allgather (it must never see a global array, as
    # the whole-table gather of every leaf did) and every array orbax restores (the table
    # must come back spread over the processes, not read whole on each).
    gathered, restored_arrays = [], []
    real_allgather = multihost_utils.process_allgather
    real_restore = ocp.StandardCheckpointHandler.restore

    def watched_allgather(x, *args, **kwargs):
        global_array = isinstance(x, jax.Array) and not x.is_fully_addressable
        gathered.append([list(np.shape(x)), global_array])
        return real_allgather(x, *args, **kwargs)

    def watched_restore(self, *args, **kwargs):
        restored = real_restore(self, *args, **kwargs)
        for value in jax.tree.leaves(restored):
            if np.ndim(value) >= 2 and np.shape(value)[0] == NUM_CLIENTS:  # the table
                spread = isinstance(value, jax.Array) and not value.is_fully_addressable
                rows = (
                    sum(s.data.shape[0] for s in value.addressable_shards)
                    if isinstance(value, jax.Array)
                    else NUM_CLIENTS
                )
                restored_arrays.append([spread, rows])
        return restored

    multihost_utils.process_allgather = watched_allgather
    ocp.StandardCheckpointHandler.restore = watched_restore

    def terminate_process_1(record):
        if process_id == 1 and record["round"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    ckpt_dir = out_dir / "ckpt"
    run = functools.partial(
        sharded.run,
        data,
        sj.hparams(client_lr=0.1),
        ROUNDS,
        eval_every=2,
        checkpoint_dir=ckpt_dir,
        checkpoint_every=1,
        keep_checkpoints=2,
    )
    try:
        run(callback=terminate_process_1)
        info["terminated"] = None
    except sj.RunTerminated as stop:
        info["terminated"] = [stop.message, int(stop.result.state.round)]
    info["kept"] = sorted(p.name for p in ckpt_dir.iterdir())
    multihost_utils.sync_global_devices("listed")
    if process_id == 0:
        (ckpt_dir / "2" / "meta" / "metadata").write_bytes(b"")
    multihost_utils.sync_global_devices("damaged")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(resume=True)
    info["warnings"] = [str(w.message) for w in caught if w.category is UserWarning]
    info["resumed_from"] = resumed.resumed_from
    multihost_utils.sync_global_devices("resumed")
    info["after_resume"] = sorted(p.name for p in ckpt_dir.iterdir())
    # Process 1 wrote its own blocks (with the whole-table gather, process 0 wrote all).
    process_1 = ckpt_dir / "4" / "arrays" / "ocdbt.process_1" / "d"
    info["process_1_files"] = sorted(p.name for p in process_1.glob("*"))
    info["gathered"], info["restored_tables"] = list(gathered), list(restored_arrays)
    info["damaged_blocks"] = damaged_blocks(out_dir, process_id)
    multihost_utils.process_allgather = real_allgather
    ocp.StandardCheckpointHandler.restore = real_restore
    np.savez(out_dir / f"resumed{process_id}.npz", **outcome(resumed))
    (out_dir / f"process{process_id}.json").write_text(json.dumps(info))
    jax.distributed.shutdown()


def damaged_blocks(out_dir: Path, process_id: int) -> dict[str, list]:
    """Saves two steps of a table spread over both processes, damages a block file that
    only process 1 reads (its own rows) and restores: both processes must fall back to the
    older step, whether process 1 fails to read the block (truncated: process 0 reads its
    blocks fine) or reads wrong bytes (a flipped byte: only its checksum tells).

    The table's blocks are 6 KiB: orbax (tensorstore's OCDBT) inlines values under 1 KiB
    in its index, which process 0 merges into the step's own files; larger ones stay in
    the ``ocdbt.process_<i>`` folder of the process that wrote them."""
    import jax
    import jax.random as jr
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from scaffold_jax import checkpoint, layout

    mesh = layout.client_mesh()
    rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    full = np.random.default_rng(3).normal(size=(NUM_CLIENTS, 256)).astype(np.float32)
    state = {
        "server": jax.device_put(
            np.arange(8.0, dtype=np.float32), NamedSharding(mesh, PartitionSpec())
        ),
        "table": jax.make_array_from_callback(full.shape, rows, lambda index: full[index]),
    }
    out = {}
    for name in ("truncated", "flipped"):
        directory = out_dir / f"blocks-{name}"
        with checkpoint.Checkpointer(directory) as ckpt:
            ckpt.save(state, jr.key(1), step=10)
            ckpt.save(state, jr.key(2), step=11)
        files = list((directory / "11" / "arrays" / "ocdbt.process_1" / "d").glob("*"))
        if process_id == 0 and files:  # none: process 1 wrote nothing (the test fails)
            largest = max(files, key=lambda p: p.stat().st_size)
            data = bytearray(largest.read_bytes())
            if name == "truncated":
                data = data[: len(data) // 2]
            else:
                data[len(data) // 2] ^= 0x01
            largest.write_bytes(bytes(data))
        multihost_utils.sync_global_devices(f"damaged-{name}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = checkpoint.restore_latest(directory, like_state=state)
        table = restored.state["table"]
        same = all(np.array_equal(s.data, full[s.index]) for s in table.addressable_shards)
        out[name] = [
            restored.round,
            [str(w.message) for w in caught if w.category is UserWarning],
            sorted(p.name for p in directory.iterdir()),
            bool(same and not table.is_fully_addressable),
            bool(np.array_equal(jr.key_data(restored.key), jr.key_data(jr.key(1)))),
        ]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two jax.distributed processes and a reference (~14 s)
def test_two_processes_match_one(tmp_path):
    """Two jax processes (4 devices) run one simulation; both equal a one-process run."""
    port = free_port()
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "  # compiled as this process is
        f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
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
        got = dict(np.load(tmp_path / f"process{pid}.npz"))
        assert sorted(got) == sorted(expected)
        np.testing.assert_array_equal(got["client_ids"], expected["client_ids"])
        for key, want in expected.items():
            atol = 1e-5 * float(np.max(np.abs(want), initial=0.0))
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=atol, err_msg=key)

        # The checkpointed run, stopped after round 2 and resumed past a damaged round 2.
        by = "" if pid == 1 else " by another process"
        assert info["terminated"] == [
            f"SIGTERM received{by}: stopped after round 2 (checkpoint at round 2 in "
            f"{tmp_path / 'ckpt'}).",
            2,
        ], info
        assert info["kept"] == ["1", "2"], info  # max_to_keep rotation with 2 processes
        assert info["resumed_from"] == 1, info
        assert len(info["warnings"]) == 1, info
        warning = info["warnings"][0]
        assert "ckpt/2 is corrupt" in warning, info
        assert "moved it to 2.corrupt; falling back to the checkpoint of round 1" in warning
        assert info["after_resume"] == ["2.corrupt", "3", "4"], info
        # No whole-table gather: process 1 wrote its blocks itself, only small host arrays
        # (signals, corrupt flags, block digests) were gathered, and each process restored
        # its own half of the table, spread over the processes.
        assert info["process_1_files"], info
        assert info["gathered"] and not any(global_ for _, global_ in info["gathered"]), info
        assert info["restored_tables"], info
        assert all(
            spread and rows == NUM_CLIENTS // NUM_PROCESSES
            for spread, rows in info["restored_tables"]
        ), info
        for name, (round_, caught, listed, same, key) in info["damaged_blocks"].items():
            # Round 10's table and key (jr.key(1)), read back block by block.
            assert round_ == 10 and same and key, (name, info["damaged_blocks"])
            assert len(caught) == 1 and "blocks-" + name + "/11 is corrupt" in caught[0]
            assert "falling back to the checkpoint of round 10" in caught[0], caught
            assert listed == ["10", "11.corrupt"], (name, listed)
        resumed = dict(np.load(tmp_path / f"resumed{pid}.npz"))
        # Bit for bit the uninterrupted two-process run (the same sums in the same order:
        # checkpoints and the resume change only where the compiled blocks start and stop),
        # evaluation records included, so it too matches the one-process run within rtol
        # 1e-5; client_ids holds only the rounds run after round 1.
        assert sorted(resumed) == sorted(got)
        np.testing.assert_array_equal(resumed.pop("client_ids"), got["client_ids"][1:])
        for key, value in resumed.items():
            np.testing.assert_array_equal(value, got[key], err_msg=key)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
