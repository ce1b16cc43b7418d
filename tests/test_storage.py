"""A run folder under storage trouble: deleted or moved while a run writes it, a disk that
fills during a checkpoint, a table or plot that cannot be written, a lock file left empty
by a kill, two resumes started together.

The runs are in-process ``scaffold-jax`` commands on the quadratic family (a few seconds);
a run whose stderr is counted runs as its own process, so that every line it prints
(orbax's threads included) is seen.
"""

import errno
import json
import logging
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_folder_final_state

from scaffold_jax import checkpoint, results
from scaffold_jax.cli import main
from scaffold_jax.results import folder as run_folder
from scaffold_jax.results import lock as folder_lock

ROUNDS = 6
# A checkpoint every round (not the default cadence): a failure can be injected into any.
RUN = ["run", "--dataset", "quadratic", "--num-clients", "10", "--rounds", str(ROUNDS),
       "--eval-every", "1", "--checkpoint-every", "1", "--quiet"]  # fmt: skip


def _records(out):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in results.read_records(out)]


def _final_state(out):
    return run_folder_final_state(out, ROUNDS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its records and final state."""
    out = tmp_path_factory.mktemp("storage") / "reference"
    assert main([*RUN, "--out", str(out)]) == 0
    return {"records": _records(out), "state": _final_state(out)}


def _assert_resumes_exactly(out, reference):
    """``--resume`` finishes the run: every record once, bit for bit the uninterrupted run's
    records and final state."""
    assert main([*RUN, "--out", str(out), "--resume"]) == 0
    records = _records(out)
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    assert records == reference["records"]
    for mine, theirs in zip(_final_state(out), reference["state"], strict=True):
        np.testing.assert_array_equal(mine, theirs)
    summary = results.read_summary(out)
    assert summary["status"] == "finished"
    assert all((Path(out) / name).exists() for name in summary["files"])
    assert not (Path(out) / results.LOCK_FILE).exists()


def _leftovers(out):
    """Temporary files and folders left in a run folder (orbax's, or a half-written JSON)."""
    return [str(p) for p in Path(out).rglob("*") if "tmp" in p.name]


# ------------------------------------------------------------------ folder deleted or moved
def _at(monkeypatch, when: str, action) -> None:
    """Runs ``action`` once during the run: after its 3rd record, or while its 3rd
    checkpoint is written (orbax then writes by path, at the folder's old place)."""
    count = [0]
    if when == "after a record":
        original = results.RunWriter.record

        def record(self, *args, **kwargs):
            entry = original(self, *args, **kwargs)
            count[0] += 1
            if count[0] == 3:
                action()
            return entry

        monkeypatch.setattr(results.RunWriter, "record", record)
    else:
        import orbax.checkpoint as ocp

        original = ocp.CheckpointManager.save

        def save(self, *args, **kwargs):
            count[0] += 1
            if count[0] == 3:
                action()
            return original(self, *args, **kwargs)

        monkeypatch.setattr(ocp.CheckpointManager, "save", save)


WHEN = ["after a record", "during a checkpoint"]


@pytest.mark.parametrize("when", WHEN)
def test_a_deleted_output_folder_fails_the_run_in_one_line_and_is_never_recreated(
    tmp_path, monkeypatch, capsys, when
):
    out = tmp_path / "run"
    _at(monkeypatch, when, lambda: shutil.rmtree(out))
    assert main([*RUN, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    # Said by whichever write came first: the writer's, or a checkpoint's.
    assert str(out) in err and "was deleted or moved while the run was writing it" in err
    assert not out.exists()  # no half folder (checkpoints) recreated at its path


@pytest.mark.parametrize("when", WHEN)
def test_a_moved_output_folder_fails_the_run_says_why_where_it_went_and_resumes_there(
    tmp_path, monkeypatch, capsys, when, reference
):
    out, moved = tmp_path / "run", tmp_path / "moved"
    _at(monkeypatch, when, lambda: out.rename(moved))
    assert main([*RUN, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "was deleted or moved while the run was writing it" in err and "--resume" in err
    assert not out.exists()
    summary = results.read_summary(moved)  # written where the folder is now
    assert summary["status"] == "failed" and "was deleted or moved" in summary["error"]
    assert not (moved / results.LOCK_FILE).exists()
    assert not _leftovers(moved)
    monkeypatch.undo()
    _assert_resumes_exactly(moved, reference)


def test_a_writer_whose_lock_was_taken_away_stops(tmp_path):
    with pytest.raises(results.RunFolderError, match="lock file .* was deleted or replaced"):
        with results.RunWriter(tmp_path / "run", {"a": 1}, plots=()) as writer:
            writer.record("s", {"round": 0, "test_accuracy": 0.1})
            (tmp_path / "run" / results.LOCK_FILE).unlink()
            writer.record("s", {"round": 1, "test_accuracy": 0.2})
    assert [r["round"] for r in results.read_records(tmp_path / "run")] == [0]


# ------------------------------------------------------------------ a full disk at a checkpoint
DRIVER = r"""
import errno, os, sys
import orbax.checkpoint as ocp
from scaffold_jax.cli import main

mode, ballast, at, argv = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
original, calls = ocp.CheckpointManager.save, [0]

def fill(path, headroom=8192):
    # Every block of the disk but `headroom` (room for the summary that says "failed").
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    for size in (1 << 16, 4096, 512):
        try:
            while os.write(fd, b"\0" * size):
                pass
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - headroom))
    os.close(fd)

def save(self, step, *args, **kwargs):
    calls[0] += 1
    if calls[0] == at:
        if mode == "tmpfs":
            fill(ballast)  # the disk fills: orbax's own writes fail
        else:  # what orbax passes on from tensorstore, a partial step on disk
            tmp = os.path.join(os.fspath(self.directory), f"{step}.orbax-checkpoint-tmp-7")
            os.makedirs(os.path.join(tmp, "arrays"))
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing "00001/0" in OCDBT database at local '
                f'file "{tmp}/arrays/": Failed to write 380 bytes to file 8: No space left '
                "on device [os_error_code='28']"
            )
    return original(self, step, *args, **kwargs)

ocp.CheckpointManager.save = save
sys.exit(main(argv))
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs at tmp_path/disk (as root, where mounting is allowed), else None."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = False
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount"):
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
        )
        mounted = proc.returncode == 0
    try:
        yield disk if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.parametrize("disk", ["tmpfs", "fake"])
def test_a_disk_full_during_a_checkpoint_is_one_line_a_failed_summary_no_tmp_and_resumes_exactly(
    tmp_path, small_disk, reference, disk
):
    """The disk fills while the 3rd checkpoint (round 2) is written: a small tmpfs filled
    for real (as root), or a fake that fails orbax's save as tensorstore does."""
    if disk == "tmpfs" and small_disk is None:
        pytest.skip("mounting a tmpfs needs root (and a container that allows it)")
    place = small_disk if disk == "tmpfs" else tmp_path
    out, ballast = place / "run", place / "ballast"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, disk, str(ballast), "3", *RUN, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: no orbax thread tracebacks
    assert proc.stderr == (
        f"scaffold-jax: error: cannot write checkpoint round 2 in {out / 'checkpoints'}"
        ": No space left on device. Every record finished before is kept; free space, then "
        "--resume.\n"
    )
    summary = results.read_summary(out)
    assert summary["status"] == "failed"
    assert "CheckpointWriteError" in summary["error"] and "No space left" in summary["error"]
    assert not _leftovers(out)
    kept = _records(out)  # those written before (round 2's, if written before its save)
    assert len(kept) >= 2 and kept == reference["records"][: len(kept)]
    assert checkpoint.latest_round(out / "checkpoints") == 1
    ballast.unlink(missing_ok=True)  # space freed
    _assert_resumes_exactly(out, reference)


# What orbax and its asyncio loops may report of a failed save besides the error raised,
# each in the way it reaches stderr: during the save (a task that failed unawaited and is
# only collected later, a late callback into the closed loop, a thread of a loop that ends
# with the error) and after it (a thread's absl log, another thread's error). Each used to
# print a traceback after the one clear line, now and then (when orbax's timing made it).
NOISY_DRIVER = r"""
import asyncio, errno, os, sys, threading, time
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from scaffold_jax.cli import main

at, argv = int(sys.argv[1]), sys.argv[2:]
original, calls = ocp.CheckpointManager.save, [0]

def disk_full():
    return OSError(errno.ENOSPC, "No space left on device")

async def write():
    raise disk_full()

def noise():
    loop = asyncio.new_event_loop()
    task = loop.create_task(write())
    loop.run_until_complete(asyncio.sleep(0.01))  # the task failed; nobody retrieves it
    loop.close()
    cycle = [task]
    cycle.append(cycle)  # freed by a collection only: reported then
    del task, cycle

    class Late:  # tensorstore's callback into the closed loop, from a destructor
        def __del__(self):
            loop.call_soon(print)

    late = Late()
    late.me = late
    del late
    thread = threading.Thread(target=lambda: asyncio.run(write()))
    thread.start()
    thread.join()

def after():
    time.sleep(0.5)  # the save has raised by now
    try:
        raise disk_full()
    except OSError:
        absl_logging.exception("Save Finalize thread failed.")
    asyncio.run(write())  # and a thread that ends with it

def save(self, step, *args, **kwargs):
    calls[0] += 1
    if calls[0] == at:
        noise()
        threading.Thread(target=after).start()
        tmp = os.path.join(os.fspath(self.directory), f"{step}.orbax-checkpoint-tmp-7")
        os.makedirs(os.path.join(tmp, "arrays"))
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Error writing "00001/0" in OCDBT database at local file '
            f'"{tmp}/arrays/": No space left on device [os_error_code=\'28\']'
        )
    return original(self, step, *args, **kwargs)

ocp.CheckpointManager.save = save
sys.exit(main(argv))
"""


@pytest.mark.slow  # ~7 s; the quick tier keeps the other disk-full test
def test_a_disk_full_at_a_checkpoint_is_one_line_whatever_orbax_reports_besides(tmp_path):
    """The one clear line, and no traceback after it, however orbax's threads, tasks and
    event loops report the same failure (a run in 7 printed an 8-line asyncio traceback)."""
    for at in (1, 3):  # the first checkpoint (round 0) and a later one
        out = tmp_path / f"run-{at}"
        proc = subprocess.run(
            [sys.executable, "-c", NOISY_DRIVER, str(at), *RUN, "--checkpoint-every", "1",
             "--out", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == (
            f"scaffold-jax: error: cannot write checkpoint round {at - 1} in "
            f"{out / 'checkpoints'}: No space left on device. Every record finished before "
            "is kept; free space, then --resume.\n"
        )
        assert results.read_summary(out)["status"] == "failed"


def test_a_failed_save_is_a_checkpoint_write_error_and_keeps_the_steps_before(
    tmp_path, monkeypatch, caplog
):
    """The library alone: an OSError subclass naming the round, orbax's temporary folder
    removed, no absl error records, and the checkpointer still closes cleanly."""
    import orbax.checkpoint as ocp

    import scaffold_jax as sj

    problem = sj.models.logistic_regression((4,), 3)
    state = sj.init_state(sj.scaffold(problem.loss_fn), problem.params, num_clients=5)
    original = ocp.CheckpointManager.save

    def full(self, step, *args, **kwargs):
        (tmp_path / f"{step}.orbax-checkpoint-tmp-3" / "arrays").mkdir(parents=True)
        raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device")

    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, jax.random.key(0), step=0)
        monkeypatch.setattr(ocp.CheckpointManager, "save", full)
        with (
            caplog.at_level(logging.WARNING),
            pytest.raises(checkpoint.CheckpointWriteError) as info,
        ):
            ckpt.save(state, jax.random.key(0), step=1)
        monkeypatch.setattr(ocp.CheckpointManager, "save", original)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert f"cannot write checkpoint round 1 in {tmp_path}: No space left on device" in str(
        info.value
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0"]
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.ERROR]
    # A failure that is not the disk's (a bug) is raised as it is.
    with checkpoint.Checkpointer(tmp_path) as ckpt:

        def bug(self, *args, **kwargs):
            raise TypeError("not a disk problem")

        monkeypatch.setattr(ocp.CheckpointManager, "save", bug)
        with pytest.raises(TypeError, match="not a disk problem"):
            ckpt.save(state, jax.random.key(0), step=2)


# ------------------------------------------------------------------ a folder that cannot be written
@pytest.fixture
def read_only_place(tmp_path, monkeypatch, request):
    """A folder holding a finished run (``run``), then made read-only: a tmpfs remounted
    read-only (as root, where mounting is allowed), or os.mkdir/os.unlink failing with
    EROFS under it (what a chmod 0o555 folder does to a user who is not root)."""
    place = tmp_path / "ro"
    place.mkdir()
    if request.param == "tmpfs":
        if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("mount")):
            pytest.skip("mounting a tmpfs needs root")
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(place)],
                                 capture_output=True)  # fmt: skip
        if mounted.returncode != 0:
            pytest.skip("this container does not allow mounting")
    try:
        assert main([*RUN[:-1], "--rounds", "1", "--quiet", "--out", str(place / "run")]) == 0
        if request.param == "tmpfs":
            subprocess.run(["mount", "-o", "remount,ro", str(place)], check=True)
        else:

            def refused(real):
                def call(path, *args, **kwargs):
                    if os.fspath(path).startswith(str(place)):
                        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
                    return real(path, *args, **kwargs)

                return call

            for name in ("mkdir", "unlink"):
                monkeypatch.setattr(os, name, refused(getattr(os, name)))
        yield place
    finally:
        if request.param == "tmpfs":
            subprocess.run(["umount", "-l", str(place)], capture_output=True)


@pytest.mark.parametrize("read_only_place", ["mock", "tmpfs"], indirect=True)
def test_a_read_only_folder_is_named_as_such_in_one_line(read_only_place, capsys):
    """It said "free space ... then --resume" (a new run), or a bare "[Errno 30]"
    (--overwrite of a run there)."""
    fix = "it is on a read-only file system. Choose a writable --out.\n"
    capsys.readouterr()
    assert main([*RUN, "--out", str(read_only_place / "new")]) == 1
    assert capsys.readouterr().err == (
        f"scaffold-jax: error: cannot write {read_only_place / 'new'}: {fix}"
    )
    assert main([*RUN, "--out", str(read_only_place / "run"), "--overwrite"]) == 1
    assert capsys.readouterr().err == (
        f"scaffold-jax: error: cannot write {read_only_place / 'run'}: {fix}"
    )


# ------------------------------------------------------------------ files made from the records
def test_a_table_that_cannot_be_written_never_fails_a_finished_sweep(tmp_path, capsys):
    out = tmp_path / "sweep"
    (out / "sweep.csv").mkdir(parents=True)  # a folder in the way: the CSV cannot be written
    code = main(["sweep", "--dataset", "quadratic", "--num-clients", "10", "--rounds", "2",
                 "--eval-every", "1", "--lr-grid", "0.1", "0.3", "--no-checkpoint", "--quiet",
                 "--out", str(out)])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "could not write sweep.csv" in err
    summary = results.read_summary(out)
    assert summary["status"] == "finished"
    assert "sweep.csv" not in summary["files"] and "summary.md" in summary["files"]
    assert not _leftovers(out)


def test_write_text_and_write_figure_leave_out_what_cannot_be_written(
    tmp_path, monkeypatch, capsys
):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    class Figure:  # writes half a file, then the disk is full
        def savefig(self, path, dpi):
            Path(path).write_bytes(b"\x89PNG half")
            full()

    with results.RunWriter(tmp_path, {"a": 1}, plots=()) as writer:
        writer.record("s", {"round": 0, "test_accuracy": 0.1})
        assert writer.write_text("table.md", "| a |\n") == tmp_path / "table.md"
        with monkeypatch.context() as m:
            m.setattr(run_folder, "_replacing", full)
            assert writer.write_text("sweep.csv", "a,b\n") is None
            with pytest.raises(results.RunFolderError, match="No space left on device"):
                writer.write_text("needed.json", "{}", required=True)
        assert writer.write_figure("curves.png", Figure()) is None
        summary = writer.finish()
    err = capsys.readouterr().err
    assert "could not write sweep.csv: No space left on device; left out" in err
    assert "could not write curves.png" in err
    assert summary["status"] == "finished" and "table.md" in summary["files"]
    assert not {"sweep.csv", "needed.json", "curves.png"} & set(summary["files"])
    assert not (tmp_path / "curves.png").exists() and not _leftovers(tmp_path)


# ------------------------------------------------------------------ the lock file
def _unfinished_run(out: Path, lock: str, age: float) -> None:
    """A folder as a run killed between creating its lock and writing it leaves it."""
    with results.RunWriter(out, {"a": 1}, plots=()) as writer:
        writer.record("s", {"round": 0, "test_accuracy": 0.1})
        summary = writer.summary()  # "running": a SIGKILL leaves it so
    (out / results.SUMMARY_FILE).write_text(json.dumps(summary))
    path = out / results.LOCK_FILE
    path.write_text(lock)
    then = time.time() - age
    os.utime(path, (then, then))


@pytest.mark.parametrize("lock", ["", '{"pid": 12'])
def test_an_empty_or_cut_short_lock_is_stale_once_a_few_seconds_old(tmp_path, lock):
    out = tmp_path / "run"
    _unfinished_run(out, lock, age=60.0)
    results.check_lock(out)
    assert not (out / results.LOCK_FILE).exists()
    summary = results.read_summary(out)
    assert summary["status"] == "interrupted" and "SIGKILL" in summary["error"]
    with results.RunWriter(out, {"a": 1}, plots=(), resume=True) as writer:  # resumable
        assert [r["round"] for r in writer.records] == [0]


def test_a_fresh_empty_lock_is_being_taken_waited_for_and_never_says_kill_none(
    tmp_path, monkeypatch
):
    out = tmp_path / "run"
    _unfinished_run(out, "", age=0.0)
    live = {"pid": os.getppid(), "host": platform.node(), "started": "now"}

    def taken():  # the process that created it writes it
        time.sleep(0.3)
        (out / results.LOCK_FILE).write_text(json.dumps(live))

    threading.Thread(target=taken).start()
    start = time.monotonic()
    with pytest.raises(FileExistsError) as info:
        results.check_lock(out)
    assert time.monotonic() - start >= 0.25
    assert f"in use by a running scaffold-jax (pid {live['pid']}" in str(info.value)
    assert "None" not in str(info.value)
    # One that stays empty is stale once older than the grace period.
    monkeypatch.setattr(folder_lock, "_LOCK_GRACE", 0.5)
    (out / results.LOCK_FILE).write_text("")
    results.check_lock(out)
    assert not (out / results.LOCK_FILE).exists()


def test_the_lock_is_written_whole_and_leaves_no_temporary_file(tmp_path):
    with results.RunWriter(tmp_path, {"a": 1}, plots=()):
        info = json.loads((tmp_path / results.LOCK_FILE).read_text())
        assert info["pid"] == os.getpid() and info["host"] == platform.node()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".lock")] == [".lock"]
    assert not (tmp_path / results.LOCK_FILE).exists() and not _leftovers(tmp_path)


def test_temporary_files_of_a_killed_writer_are_removed_on_resume(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    out = tmp_path / "run"
    _unfinished_run(out, "", age=60.0)
    mine = out / "notes.tmp"  # not the writer's: kept
    left = [
        f"summary.json.{dead.pid}-0123abcd.tmp",
        "metrics.jsonl.tmp",
        f".lock.{dead.pid}-89abcdef.tmp",
    ]
    for name in [*left, mine.name]:
        (out / name).write_text("half")
    with results.RunWriter(out, {"a": 1}, plots=(), resume=True):
        pass
    assert not any((out / name).exists() for name in left) and mine.exists()


# ------------------------------------------------------------------ two resumes together
def _resume(folder, start, outcome) -> None:
    """One `--resume`'s folder steps (run_grid's): check the lock, then open the writer."""
    try:
        start.wait(10)
        results.check_lock(folder)
        with results.RunWriter(folder, {"a": 1}, plots=(), resume=True):
            time.sleep(0.5)  # holds the folder while the other one tries
        outcome.put("took it")
    except FileExistsError as err:
        outcome.put(f"refused: {err}")
    except BaseException as err:  # noqa: BLE001 - reported to the test
        outcome.put(f"failed: {type(err).__name__}: {err}")


@pytest.mark.filterwarnings("ignore:os.fork")
def test_two_resumes_started_together_one_takes_the_folder_the_other_is_refused(
    tmp_path, monkeypatch
):
    # A forked child must not touch the accelerator runtime: the summary's environment
    # is the parent's, taken once.
    env = results.environment()
    monkeypatch.setattr(run_folder, "environment", lambda: env)
    context = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a process id that is gone: its lock is stale
    stale = json.dumps({"pid": dead.pid, "host": platform.node(), "started": "then"})
    for attempt in range(6):
        out = tmp_path / f"run{attempt}"
        _unfinished_run(out, stale, age=0.0)
        start, outcome = context.Event(), context.Queue()
        procs = [context.Process(target=_resume, args=(out, start, outcome)) for _ in range(2)]
        for proc in procs:
            proc.start()
        start.set()
        said = sorted(outcome.get(timeout=30) for _ in procs)
        for proc in procs:
            proc.join(10)
        assert said[1] == "took it", said
        assert said[0].startswith("refused: ") and "is in use by a running scaffold-jax" in said[0]
        summary = results.read_summary(out)
        assert summary["status"] == "finished", summary
        assert not (out / results.LOCK_FILE).exists() and not _leftovers(out)
