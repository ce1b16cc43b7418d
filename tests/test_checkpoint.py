"""Checkpoints: atomic orbax saves, verified restores that fall back past corrupt steps,
and ``Simulation.run``'s resume, signal and divergence handling — including a real
SIGKILL and a real SIGINT of a simulation running in a subprocess.

Every comparison with an uninterrupted run is BITWISE (``assert_array_equal``): resuming
must continue the very same run, not a close one.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import checkpoint
from scaffold_jax.algorithms import client_controls
from scaffold_jax.loop import DivergenceError, RunTerminated

TESTS_DIR = Path(__file__).parent
ROOT = TESTS_DIR.parent
NUM_ROUNDS = 8
SEED = 11


def make_run():
    """A small least-squares problem: 6 clients of 2..7 examples, SCAFFOLD, S = 3, one
    epoch of batches of 2 per round (random batches AND random client sampling, so any
    slip in the restored key, round or client table changes the result)."""
    rng = np.random.default_rng(0)
    sizes = [3, 7, 2, 5, 4, 6]
    targets = rng.normal(size=(len(sizes), 3))
    clients = []
    for i, n in enumerate(sizes):
        x = rng.normal(size=(n, 3)).astype(np.float32)
        y = (x @ targets[i] + 0.1 * rng.normal(size=n)).astype(np.float32)
        clients.append({"x": x, "y": y})
    data = sj.from_client_arrays(clients)

    def loss_fn(params, batch):
        return 0.5 * (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2

    problem = sj.Problem(params={"w": jnp.zeros(3), "b": jnp.zeros(())}, loss_fn=loss_fn)
    sim = sj.Simulation(
        sj.scaffold(loss_fn), problem, sj.BatchPlan.epochs(batch_size=2, num_epochs=1), 3
    )
    return sim, data, sj.hparams(client_lr=0.1)


# Evaluating and checkpointing every round makes every round one compiled block, so a
# signal can land between any two rounds.
RUN_ARGS = {"num_rounds": NUM_ROUNDS, "eval_every": 1, "seed": SEED, "checkpoint_every": 1}

# The subprocess: runs the simulation (optionally slowed down in the callback so the test
# can kill it between rounds) and saves the final state's leaves with np.savez.
SCRIPT = textwrap.dedent(
    """
    import json, signal, sys, time
    # Python's own SIGINT handler, as from a terminal: a shell that started the tests in
    # the background (nohup, `make test &`) passes SIGINT on as ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tests_dir!r})
    import jax, numpy as np
    from test_checkpoint import RUN_ARGS, make_run

    options = json.loads(sys.argv[1])
    sim, data, hp = make_run()

    def slow(record):
        with open(options["progress"], "a") as f:
            f.write(f"{{record['round']}}\\n")
        time.sleep(options["sleep"])

    args = dict(RUN_ARGS, checkpoint_every=options["checkpoint_every"])
    result = sim.run(data, hp, callback=slow, checkpoint_dir=options["dir"],
                     resume=options["resume"], **args)
    np.savez(options["out"], *[np.asarray(a) for a in jax.tree.leaves(result.state)])
    """
)


def leaves(state):
    return [np.asarray(a) for a in jax.tree.leaves(state)]


def assert_bitwise_equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def strip_seconds(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.fixture(scope="module")
def setup():
    return make_run()


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """The uninterrupted run (with the same checkpoint schedule as the runs under test)."""
    sim, data, hp = setup
    directory = tmp_path_factory.mktemp("reference")
    result = sim.run(data, hp, checkpoint_dir=directory, **RUN_ARGS)
    return {"leaves": leaves(result.state), "records": result.records, "dir": directory}


@pytest.fixture(scope="module")
def interrupted(setup, tmp_path_factory):
    """A run stopped by SIGINT (sent from its callback) after round 3."""
    sim, data, hp = setup
    directory = tmp_path_factory.mktemp("interrupted")
    # A shell starts background jobs (`cmd &`, nohup) with SIGINT ignored, and run() rightly
    # leaves an ignored signal alone; this test is about the default, interactive case.
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    handler_before = signal.getsignal(signal.SIGINT)

    def interrupt_at_round_3(record):
        if record["round"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    try:
        with pytest.raises(KeyboardInterrupt) as info:
            sim.run(data, hp, checkpoint_dir=directory, callback=interrupt_at_round_3, **RUN_ARGS)
        restored = signal.getsignal(signal.SIGINT) is handler_before
    finally:
        signal.signal(signal.SIGINT, original)
    return {"dir": directory, "error": info.value, "handler_restored": restored}


# --------------------------------------------------------------------------- checkpoint.py
def random_state(num_clients=5, control_dtype=jnp.float32, seed=0):
    """A SCAFFOLD state (server x and c, an [N, 4, 3] + [N, 3] client table) of noise."""
    params = {"linear": {"bias": jnp.zeros(3), "kernel": jnp.zeros((4, 3))}}
    alg = sj.scaffold(lambda p, b: jnp.zeros(()), control_dtype=control_dtype)
    state = sj.init_state(alg, params, num_clients)
    keys = iter(jr.split(jr.key(seed), 16))

    def noise(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jr.normal(next(keys), a.shape).astype(a.dtype)
        if a.dtype == jnp.uint16:  # a bfloat16 table, stored as bit patterns
            values = jr.normal(next(keys), a.shape).astype(jnp.bfloat16)
            return jax.lax.bitcast_convert_type(values, jnp.uint16)
        return a

    return jax.tree.map(noise, state)


def at_round(state, r):
    return state._replace(round=jnp.int32(r))


def test_save_and_restore_round_trip_bitwise_with_key_and_extra(tmp_path):
    state = random_state(control_dtype=jnp.bfloat16)  # bf16 (uint16 bits) table, f32 server
    extra = {"records_written": 7, "note": "x", "loss": float("nan")}
    checkpoint.save(tmp_path, at_round(state, 4), jr.key(123), extra=extra)
    restored = checkpoint.restore_latest(tmp_path, like_state=state)
    assert restored.round == 4 and int(restored.state.round) == 4
    assert restored.extra["records_written"] == 7 and np.isnan(restored.extra["loss"])
    np.testing.assert_array_equal(jr.key_data(restored.key), jr.key_data(jr.key(123)))
    assert jax.tree.structure(restored.state) == jax.tree.structure(state)
    assert_bitwise_equal(leaves(restored.state)[:-1], leaves(state)[:-1])
    assert all(a.dtype == jnp.uint16 for a in jax.tree.leaves(restored.state.clients))
    assert_bitwise_equal(
        leaves(client_controls(restored.state.clients)), leaves(client_controls(state.clients))
    )


def test_raw_uint32_key_data_is_accepted(tmp_path):
    state = random_state()
    checkpoint.save(tmp_path, state, jr.PRNGKey(5))
    restored = checkpoint.restore_latest(tmp_path, state)
    np.testing.assert_array_equal(jr.key_data(restored.key), np.asarray(jr.PRNGKey(5)))


def test_only_the_newest_k_checkpoints_are_kept(tmp_path):
    state = random_state()
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for r in range(5):
            ckpt.save(at_round(state, r), jr.key(0))
        assert ckpt.rounds() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]


def test_keep_newest_deletes_the_older_checkpoints(tmp_path):
    state = random_state()
    with checkpoint.Checkpointer(tmp_path, max_to_keep=5) as ckpt:
        for r in range(4):
            ckpt.save(at_round(state, r), jr.key(0))
        with pytest.raises(ValueError, match="keep >= 1"):
            ckpt.keep_newest(0)
        assert ckpt.keep_newest(2) == [0, 1]
        assert ckpt.rounds() == [2, 3]
        assert ckpt.keep_newest(1) == [2] and ckpt.keep_newest(1) == []
        ckpt.save(at_round(state, 4), jr.key(0))  # the manager goes on from there
        assert ckpt.rounds() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]
    assert int(checkpoint.restore_latest(tmp_path, state).round) == 4


def test_save_writes_a_temporary_directory_and_renames_it_when_complete(tmp_path, monkeypatch):
    """Atomicity: the final directory appears only by one rename of a complete tmp dir."""
    from orbax.checkpoint._src.path import async_path

    renames = []
    real_rename = async_path.rename

    async def spying_rename(src, dst):
        files = sorted(str(p.relative_to(src)) for p in Path(src).rglob("*") if p.is_file())
        renames.append((Path(src).name, Path(dst).name, Path(dst).exists(), files))
        return await real_rename(src, dst)

    monkeypatch.setattr(async_path, "rename", spying_rename)
    checkpoint.save(tmp_path, at_round(random_state(), 6), jr.key(0))
    (src, dst, dst_existed, files) = renames[-1]
    assert src.startswith("6.orbax-checkpoint-tmp") and dst == "6" and not dst_existed
    assert "meta/metadata" in files and "arrays/manifest.ocdbt" in files


def test_a_save_that_dies_before_its_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import async_path

    state = random_state()
    checkpoint.save(tmp_path, at_round(state, 1), jr.key(0))

    async def dying_rename(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(async_path, "rename", dying_rename)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save(tmp_path, at_round(state, 2), jr.key(0))
    monkeypatch.undo()
    assert any(".orbax-checkpoint-tmp" in p.name for p in tmp_path.iterdir())
    assert checkpoint.latest_round(tmp_path) == 1
    restored = checkpoint.restore_latest(tmp_path, state)  # also clears the leftover
    assert restored.round == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def _data_file(step_dir: Path) -> Path:
    """The largest file holding array chunks (the one the restore really reads)."""
    files = [p for p in (step_dir / "arrays" / "d").iterdir() if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # orbax alone restores this silently; the checksum must not
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated-array-file": lambda d: _truncate(_data_file(d)),
    "deleted-array-file": lambda d: _data_file(d).unlink(),
    "flipped-byte-in-array-file": lambda d: _flip_byte(_data_file(d)),
    "flipped-byte-in-metadata": lambda d: _flip_byte(d / "meta" / "metadata"),
    "emptied-metadata": lambda d: (d / "meta" / "metadata").write_bytes(b""),
}


# Orbax's background threads report tensorstore's failure on a damaged file a second time,
# after the restore already raised it ("Event loop is closed"): harmless noise.
ORBAX_THREAD_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@ORBAX_THREAD_NOISE
@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, corrupt):
    old, new = random_state(seed=1), random_state(seed=2)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(at_round(old, 1), jr.key(0), extra={"which": "old"})
        ckpt.save(at_round(new, 2), jr.key(0), extra={"which": "new"})
    corrupt(tmp_path / "2")
    broken = re.escape(f"checkpoint {tmp_path}/2 is corrupt")
    then = "falling back to the checkpoint of round 1"
    with pytest.warns(UserWarning, match=rf"{broken} .* moved it to 2\.corrupt; {then}\."):
        restored = checkpoint.restore_latest(tmp_path, old)
    assert restored.round == 1 and restored.extra == {"which": "old"}
    assert_bitwise_equal(leaves(restored.state)[:-1], leaves(old)[:-1])
    # Moved aside, not deleted, and out of the way of the next save at round 2.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt"]
    checkpoint.save(tmp_path, at_round(new, 2), jr.key(0))
    assert checkpoint.restore_latest(tmp_path, old).round == 2


def _as_on_several_processes(monkeypatch):
    """Makes every sharding count as spread over processes, so one process saves and
    restores leaves block by block, as each of several processes does with its own."""
    monkeypatch.setattr(checkpoint.checksums, "_spreads", lambda sharding: True)


def _unsharded(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)


def test_leaves_spread_over_processes_are_saved_with_one_digest_per_block(tmp_path, monkeypatch):
    _as_on_several_processes(monkeypatch)
    state = random_state()
    checkpoint.save(tmp_path, at_round(state, 3), jr.key(7))
    payload = json.loads((tmp_path / "3" / "meta" / "metadata").read_text())["payload"]
    for m in payload["leaves"]:
        assert "sha256" not in m, m
        whole = ",".join(f"0:{n}" for n in m["shape"])  # one device: one block, the leaf
        assert list(m["blocks"]) == [whole], m
    # Read back block by block (orbax restores into the like_state's shardings) and whole
    # (a like_state without shardings: every block is checked as a slice of the whole).
    for like in (state, _unsharded(state)):
        restored = checkpoint.restore_latest(tmp_path, like)
        assert restored.round == 3
        assert_bitwise_equal(leaves(restored.state)[:-1], leaves(state)[:-1])
        np.testing.assert_array_equal(jr.key_data(restored.key), jr.key_data(jr.key(7)))


@pytest.mark.parametrize("read", ["block-by-block", "whole"])
def test_a_flipped_byte_in_a_block_fails_its_checksum_and_the_step_is_quarantined(
    tmp_path, monkeypatch, read
):
    """The flip lands in the table's values: 200 clients make them too large (> 1 KiB) for
    orbax to inline them in its checksummed index, so orbax reads the wrong bytes silently
    and only the block's digest catches them."""
    _as_on_several_processes(monkeypatch)
    old, new = random_state(200, seed=1), random_state(200, seed=2)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(at_round(old, 1), jr.key(0))
        ckpt.save(at_round(new, 2), jr.key(0))
    values = max(
        (p for p in (tmp_path / "2" / "arrays").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    _flip_byte(values)
    like = old if read == "block-by-block" else _unsharded(old)
    with pytest.warns(UserWarning, match=r"2 is corrupt \(array .* fails its checksum\)"):
        restored = checkpoint.restore_latest(tmp_path, like)
    assert restored.round == 1
    assert_bitwise_equal(leaves(restored.state)[:-1], leaves(old)[:-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt"]


def test_a_checkpoint_of_another_shape_is_refused_and_left_in_place(tmp_path):
    checkpoint.save(tmp_path, random_state(num_clients=5), jr.key(0))
    with pytest.raises(ValueError, match=r"does not match this simulation: .*\(5, 4, 3\)"):
        checkpoint.restore_latest(tmp_path, random_state(num_clients=6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0"]


# --------------------------------------------------------------------------- Simulation.run
def test_checkpointing_does_not_change_the_run(setup, reference):
    sim, data, hp = setup
    plain = sim.run(data, hp, num_rounds=NUM_ROUNDS, eval_every=1, seed=SEED)
    assert plain.status == "finished"
    assert_bitwise_equal(leaves(plain.state), reference["leaves"])
    assert strip_seconds(plain.records) == strip_seconds(reference["records"])
    # Saved at the start and every round; the finished run leaves its final state only.
    assert sorted(int(p.name) for p in reference["dir"].iterdir()) == [NUM_ROUNDS]


def test_keep_checkpoints_keeps_more_of_a_finished_run(setup, tmp_path):
    sim, data, hp = setup
    sim.run(data, hp, checkpoint_dir=tmp_path, keep_checkpoints=3, **RUN_ARGS)
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [6, 7, 8]


def test_a_finished_run_extends_from_its_one_checkpoint_bit_for_bit(setup, reference, tmp_path):
    """The one checkpoint a finished run keeps is all that more rounds need."""
    sim, data, hp = setup
    directory = tmp_path / "ckpt"
    shutil.copytree(reference["dir"], directory)
    longer = dict(RUN_ARGS, num_rounds=NUM_ROUNDS + 3)
    extended = sim.run(data, hp, checkpoint_dir=directory, resume=True, **longer)
    assert extended.resumed_from == NUM_ROUNDS
    straight = sim.run(data, hp, checkpoint_dir=tmp_path / "straight", **longer)
    assert_bitwise_equal(leaves(extended.state), leaves(straight.state))
    assert strip_seconds(extended.records) == strip_seconds(straight.records)
    assert sorted(int(p.name) for p in directory.iterdir()) == [NUM_ROUNDS + 3]


def test_a_finished_sweep_keeps_one_checkpoint_per_chunk_unless_told(setup, tmp_path):
    sim, data, _ = setup
    grid, seeds, _ = sj.sweep.grid([0.05, 0.1], seeds=[0, 1])
    args = dict(num_rounds=4, eval_every=1, checkpoint_every=1)
    sj.sweep.sweep(sim, data, grid, seeds, checkpoint_dir=tmp_path / "one", **args)
    sj.sweep.sweep(sim, data, grid, seeds, checkpoint_dir=tmp_path / "three",
                   keep_checkpoints=3, **args)  # fmt: skip
    for name, kept in (("one", [4]), ("three", [2, 3, 4])):
        chunks = sorted((tmp_path / name).iterdir())
        assert chunks, name
        for chunk in chunks:
            assert sorted(int(p.name) for p in chunk.iterdir()) == kept, chunk
    # A resume of the finished sweep reads its chunks back from the one checkpoint each.
    again = sj.sweep.sweep(sim, data, grid, seeds, checkpoint_dir=tmp_path / "one",
                           resume=True, **args)  # fmt: skip
    assert all(len(records) == 5 for records in again.records)


def test_sigint_finishes_the_block_saves_and_raises_keyboard_interrupt(interrupted):
    err = interrupted["error"]
    assert type(err) is KeyboardInterrupt  # exactly: so Python exits "killed by SIGINT"
    assert err.result.status == "interrupted" and int(err.result.state.round) == 3
    assert "SIGINT received: stopped after round 3 (checkpoint at round 3" in str(err)
    assert checkpoint.latest_round(interrupted["dir"]) == 3
    assert interrupted["handler_restored"]


def test_resume_after_sigint_is_bitwise_identical(setup, reference, interrupted, tmp_path):
    sim, data, hp = setup
    directory = tmp_path / "ckpt"
    shutil.copytree(interrupted["dir"], directory)
    seen = []
    result = sim.run(
        data, hp, checkpoint_dir=directory, resume=True, callback=seen.append, **RUN_ARGS
    )
    assert result.status == "finished" and result.resumed_from == 3
    assert_bitwise_equal(leaves(result.state), reference["leaves"])
    assert strip_seconds(result.records) == strip_seconds(reference["records"])
    assert [r["round"] for r in seen] == list(range(4, NUM_ROUNDS + 1))  # only the new ones
    assert result.client_ids.shape == (NUM_ROUNDS - 3, 3)


@ORBAX_THREAD_NOISE
def test_resume_falls_back_past_a_corrupt_checkpoint_and_still_matches(
    setup, reference, interrupted, tmp_path
):
    sim, data, hp = setup
    directory = tmp_path / "ckpt"
    shutil.copytree(interrupted["dir"], directory)
    _truncate(_data_file(directory / "3"))
    with pytest.warns(UserWarning, match=r"ckpt/3 is corrupt .* checkpoint of round 2\."):
        result = sim.run(data, hp, checkpoint_dir=directory, resume=True, **RUN_ARGS)
    assert result.resumed_from == 2
    assert_bitwise_equal(leaves(result.state), reference["leaves"])
    assert strip_seconds(result.records) == strip_seconds(reference["records"])


def test_resuming_a_finished_run_returns_it_without_running(setup, reference, tmp_path):
    sim, data, hp = setup
    directory = tmp_path / "ckpt"
    shutil.copytree(reference["dir"], directory)
    result = sim.run(data, hp, checkpoint_dir=directory, resume=True, **RUN_ARGS)
    assert result.status == "finished" and result.resumed_from == NUM_ROUNDS
    assert result.client_ids.shape == (0, 3) and result.round_metrics == {}
    assert_bitwise_equal(leaves(result.state), reference["leaves"])
    assert strip_seconds(result.records) == strip_seconds(reference["records"])


def test_sigterm_saves_and_exits_with_code_143(setup, tmp_path):
    sim, data, hp = setup
    handler_before = signal.getsignal(signal.SIGTERM)

    def terminate_at_round_2(record):
        if record["round"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    # checkpoint_every beyond the run: a checkpoint at round 2 can only come from SIGTERM.
    args = dict(RUN_ARGS, checkpoint_every=100)
    with pytest.raises(SystemExit) as info:
        sim.run(data, hp, checkpoint_dir=tmp_path, callback=terminate_at_round_2, **args)
    assert isinstance(info.value, RunTerminated) and info.value.code == 143
    assert info.value.result.status == "interrupted"
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == [0, 2]
    assert signal.getsignal(signal.SIGTERM) is handler_before


def test_divergence_stops_the_run_with_the_round_and_step_sizes(setup, tmp_path):
    sim, data, hp = setup
    with pytest.raises(DivergenceError) as info:
        sim.run(
            data,
            sj.hparams(client_lr=1e3),
            num_rounds=NUM_ROUNDS,
            eval_every=2,
            seed=SEED,
            checkpoint_dir=tmp_path,
            checkpoint_every=1,
        )
    err = info.value
    assert isinstance(err, ValueError)
    message = str(err)
    assert message.startswith("scaffold diverged: the server state holds NaN/Inf after round")
    assert "client_lr=1000.0, server_lr=1.0" in message
    assert f"came from round {err.diverged_round})" in message
    assert err.result.status == "diverged"
    assert not np.all(np.isfinite(np.asarray(err.result.state.server.params["w"])))
    assert [r["round"] for r in err.records] == list(range(0, err.diverged_round, 2))
    # The non-finite state was never saved: the newest checkpoint is before divergence.
    assert checkpoint.latest_round(tmp_path) < err.diverged_round


# --------------------------------------------------------------------------- real signals
@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A persistent compilation cache shared by the subprocesses: only the first one
    compiles (they run the same programs), which keeps these tests quick."""
    return tmp_path_factory.mktemp("jax_cache")


def _start(tmp_path, jax_cache, **options):
    script = tmp_path / "run_sim.py"
    script.write_text(SCRIPT.format(tests_dir=str(TESTS_DIR)))
    options = {
        "dir": str(tmp_path / "ckpt"),
        "out": str(tmp_path / "final.npz"),
        "progress": str(tmp_path / "progress.txt"),
        "sleep": 0.0,
        "resume": False,
        "checkpoint_every": 1,
        **options,
    }
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(jax_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(options)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until(condition, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the simulation exited early ({proc.returncode}):\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the simulation")
        time.sleep(0.02)


def _progress(tmp_path) -> int:
    path = tmp_path / "progress.txt"
    rounds = [int(x) for x in path.read_text().split()] if path.exists() else []
    return max(rounds, default=-1)


def _resume_and_compare(tmp_path, jax_cache, reference):
    proc = _start(tmp_path, jax_cache, resume=True)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    with np.load(tmp_path / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert_bitwise_equal(got, reference["leaves"])
    return err


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_round_then_resume_is_bitwise_identical(
    tmp_path, jax_cache, reference
):
    proc = _start(tmp_path, jax_cache, sleep=0.25)
    ckpt_dir = tmp_path / "ckpt"
    _wait_until(lambda: (checkpoint.latest_round(ckpt_dir) or 0) >= 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    killed_at = checkpoint.latest_round(ckpt_dir)
    assert 2 <= killed_at < NUM_ROUNDS  # it really died mid-run
    _resume_and_compare(tmp_path, jax_cache, reference)


# Slow (two interpreter starts); the in-process SIGINT tests above cover the same code path
# in the default run, this one adds the process-level view: exit status and stderr.
@pytest.mark.slow
def test_sigint_to_a_process_saves_then_exits_and_resume_is_bitwise_identical(
    tmp_path, jax_cache, reference
):
    # checkpoint_every beyond the run: only the start checkpoint and the one saved on
    # SIGINT can exist, so a checkpoint past round 0 proves the signal path saved it.
    proc = _start(tmp_path, jax_cache, sleep=0.25, checkpoint_every=100)
    _wait_until(lambda: _progress(tmp_path) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT  # an uncaught KeyboardInterrupt re-raises SIGINT
    assert "KeyboardInterrupt: SIGINT received: stopped after round" in err
    saved = checkpoint.latest_round(tmp_path / "ckpt")
    assert 2 <= saved < NUM_ROUNDS
    assert f"stopped after round {saved} (checkpoint at round {saved}" in err
    err = _resume_and_compare(tmp_path, jax_cache, reference)
    assert "is corrupt" not in err  # the checkpoint saved on SIGINT is intact


def test_a_checkpoint_of_the_earlier_in_out_kernels_is_refused_naming_the_shapes(tmp_path):
    """The models store kernels [out, in] now; a checkpoint of the earlier [in, out]
    logistic regression is refused with both shapes, never silently transposed."""
    problem = sj.models.logistic_regression((4,), 3)
    sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem, sj.BatchPlan.full(1), 2)
    old_params = {"linear": {"bias": jnp.zeros(3), "kernel": jnp.zeros((4, 3))}}
    old_state = sj.init_state(sim.algorithm, old_params, 5)
    checkpoint.save(tmp_path, old_state, jr.key(0))
    rng = np.random.default_rng(0)
    data = sj.from_client_arrays(
        [{"x": rng.normal(size=(3, 4)).astype("float32"), "y": np.arange(3)} for _ in range(5)]
    )
    with pytest.raises(ValueError, match=r"kernel'\] is float32\(5, 4, 3\) in the checkpoint "
                       r"but float32\(5, 3, 4\) here"):  # fmt: skip
        sim.run(data, sj.hparams(0.1), num_rounds=1, checkpoint_dir=tmp_path, resume=True)
