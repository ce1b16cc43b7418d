"""The :class:`Checkpointer`: one directory of orbax steps, saved atomically and restored
newest first, past corrupt ones (see :mod:`scaffold_jax.checkpoint`)."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.checkpoint.checksums import (
    FORMAT,
    _agree,
    _block_digests,
    _block_sharding,
    _check_matches,
    _Corrupt,
    _digest,
    _gather_block_digests,
    _host_or_spread,
    _is_spread,
    _key_size,
    _leaf_paths,
    _place,
    _sha256,
    _split_key,
    _verified,
    _verified_payload,
)
from scaffold_jax.checkpoint.failed_saves import (
    _FAILED_CODES,
    _filter_orbax_noise,
    _HeldLog,
    _os_problem,
    _settle,
)
from scaffold_jax.types import PyTree

_TMP_MARK = ".orbax-checkpoint-tmp"
_CORRUPT_SUFFIX = ".corrupt"


class CheckpointError(ValueError):
    """No checkpoint in a directory could be read (all of them are corrupt)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or vanished folder);
    the checkpoints saved before it are intact."""

    def __str__(self) -> str:  # the message alone: it names the round, the folder, the fix
        return self.strerror or super().__str__()


class Restored(NamedTuple):
    """What :func:`~scaffold_jax.checkpoint.restore_latest` returns.

    Attributes:
      state: the restored state, with the tree structure of ``like_state`` (device arrays;
        placed with ``like_state``'s shardings where it has them).
      key: the root PRNG key saved with it (a typed key).
      round: the checkpoint's round (its orbax step).
      extra: the JSON-able ``extra`` dict given to :func:`~scaffold_jax.checkpoint.save`.
      path: the checkpoint's directory.
    """

    state: PyTree
    key: jax.Array
    round: int
    extra: dict[str, Any]
    path: Path


def _step_dir(directory: Path, step: int) -> Path:
    return directory / str(step)


class Checkpointer:
    """Saves and restores simulation states in one directory, keeping the last few.

    Use it as a context manager (or call :meth:`close`): orbax runs background threads
    that must be shut down before the interpreter exits.

    Args:
      directory: where the checkpoints live (created if missing).
      max_to_keep: how many of the newest checkpoints to keep while saving (>= 1);
        :meth:`keep_newest` prunes further once a run is finished.

    Raises:
      ValueError: ``max_to_keep < 1``.
    """

    def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3):
        import orbax.checkpoint as ocp  # optional dependency: imported only when used

        if int(max_to_keep) < 1:
            raise ValueError(f"max_to_keep = {max_to_keep} is invalid: it must be >= 1.")
        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self._failed = False
        _filter_orbax_noise()
        if _is_writer():
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise CheckpointWriteError(
                    err.errno,
                    f"cannot create the checkpoint folder {self.directory}: {err.strerror or err}.",
                ) from err
            self._remove_partial_saves()
        _barrier("open")
        # The directory and the folders above it, as they are (see _check_place and
        # _undo_recreated). Each is held open: a deleted folder's inode number is then
        # never reused, so a folder recreated at its path can never pass for it.
        self._pins = [_pin(p) for p in (self.directory, *self.directory.parents)]
        self._chain = [(p, _place_of(p)) for p in (self.directory, *self.directory.parents)]
        self._place = self._chain[0][1]
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(max_to_keep),
            # Synchronous: when save() returns the step is on disk, so an interrupt or a
            # SIGKILL right after it cannot lose it.
            enable_async_checkpointing=False,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("arrays", "meta"), options=options
        )
        self._arrays_handler = ocp.StandardCheckpointHandler()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Waits for orbax to finish and releases its threads."""
        # After a failed save orbax may log that error again while it closes: said already.
        held = _HeldLog()
        if self._failed:
            held.hold()
        try:
            for close in (self._manager.close, self._arrays_handler.close):
                try:
                    close()
                except Exception:
                    if not self._failed:
                        raise
                    # After a failed save orbax may raise that error again: said already.
        finally:
            held.stop()
            for fd in self._pins:
                if fd is not None:
                    os.close(fd)
            self._pins = []

    # ------------------------------------------------------------------ listing
    def rounds(self) -> list[int]:
        """The rounds of the complete checkpoints present, oldest first."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_round(self) -> int | None:
        """The newest checkpoint's round, or None when there is none."""
        rounds = self.rounds()
        return rounds[-1] if rounds else None

    def keep_newest(self, count: int) -> list[int]:
        """Deletes every checkpoint but the newest ``count``: a finished run or sweep needs
        only its final state to be resumed or extended, and each step holds the whole
        client table (hundreds of MB for a large sweep).

        Each step goes by one ``rename(2)`` to a temporary name first, so a process killed
        while deleting leaves no half step (the leftover is removed when the directory
        is next opened, as a half save is).

        Args:
          count: how many of the newest checkpoints to keep (>= 1).

        Returns:
          The rounds deleted, oldest first.

        Raises:
          ValueError: ``count < 1``.
        """
        if int(count) < 1:
            raise ValueError(f"keep_newest({count}) is invalid: it must keep >= 1 checkpoint.")
        gone = self.rounds()[: -int(count)]
        _barrier("prune-start")  # every process has listed the steps before any goes
        if _is_writer():
            for step in gone:
                doomed = self.directory / f"{step}{_TMP_MARK}-deleted"
                _step_dir(self.directory, step).rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        _barrier("prune-done")
        self._manager.reload()
        return gone

    def _remove_partial_saves(self) -> None:
        # A save killed half-way leaves only its temporary directory; it can never be
        # completed, and orbax's own clean-up runs in a thread that may outlive us.
        for path in self.directory.iterdir():
            if _TMP_MARK in path.name and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ saving
    def save(
        self,
        state: PyTree,
        key: jax.Array,
        extra: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> Path:
        """Writes a checkpoint atomically and drops the oldest beyond ``max_to_keep``.

        Args:
          state: the state to save, usually a :class:`~scaffold_jax.types.SimState`. The
            save is synchronous (its arrays are on disk when it returns), so it may be
            donated right afterwards.
          key: the run's root key (a typed key or raw ``uint32`` key data).
          extra: a JSON-able dict stored alongside (NaN and Inf floats are allowed).
          step: the checkpoint's round; default ``int(state.round)``.

        Returns:
          The checkpoint's directory.

        Raises:
          TypeError: ``extra`` is not JSON-able.
          ValueError: a checkpoint for this round already exists.
          CheckpointWriteError: the checkpoint could not be written (a full disk, a
            read-only folder, the directory deleted or moved); the earlier ones are intact.
        """
        if step is None:
            step = int(state.round)
        step = int(step)
        self._check_place(step)
        if _step_dir(self.directory, step).exists():
            raise ValueError(
                f"a checkpoint for round {step} already exists in {self.directory}; "
                "checkpoints are never overwritten."
            )
        key_impl, key_data = _split_key(key)
        # A leaf spread over processes stays a jax.Array: orbax writes each process's blocks
        # from that process, and only their digests travel (a collective with several
        # processes). Every other leaf is copied to the host whole, as with one process.
        leaves = [_host_or_spread(a) for a in jax.tree.leaves(state)]
        own = {i: _block_digests(a) for i, a in enumerate(leaves) if _is_spread(a)}
        blocks = _gather_block_digests(own)
        leaf_meta = []
        for i, (p, a) in enumerate(zip(_leaf_paths(state), leaves, strict=True)):
            m = {"path": p, "shape": list(a.shape), "dtype": str(jnp.dtype(a.dtype))}
            if i in blocks:
                m["blocks"] = blocks[i]
            else:
                m["sha256"] = _sha256(a)
            leaf_meta.append(m)
        try:
            extra = json.loads(json.dumps({} if extra is None else dict(extra)))
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint extra must be JSON-able: {err}") from err
        payload = {
            "round": step,
            "key_impl": key_impl,
            "key_shape": list(key_data.shape),  # [2] for one key; [G, 2] for a sweep's G
            "key_sha256": _sha256(key_data),
            "leaves": leaf_meta,
            "extra": extra,
        }
        meta = {"format": FORMAT, "payload": payload, "sha256": _digest(payload)}
        # Orbax cannot write zero-size arrays; their shape in the metadata is all we need.
        arrays = {f"{i:05d}": a for i, a in enumerate(leaves) if a.size > 0}
        arrays["key"] = key_data
        ocp = self._ocp
        threads = set(threading.enumerate())
        # Orbax's log of this save (absl's records, asyncio's reports of its tasks) is held
        # back: passed on once it succeeded, dropped when it failed (it then only repeats
        # the error raised).
        held = _HeldLog()
        held.hold()
        try:
            self._manager.reload()
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            if not saved:  # pragma: no cover - orbax declines only for read-only managers
                raise RuntimeError(f"orbax declined to save round {step} in {self.directory}.")
            self._manager.wait_until_finished()
            self._check_place(step)  # moved during the save: orbax wrote at the old path
        except Exception as err:
            self._failed = True
            error = self._save_failed(step, err, threads)
            if error is None:
                raise
            raise error from err
        finally:
            held.stop()
        if not self._failed:
            held.release()
        _barrier(f"saved-{step}")  # no process lists the directory before the step is there
        return _step_dir(self.directory, step)

    def _check_place(self, step: int) -> None:
        """Raises when the directory (or a folder above it, a run folder) was deleted or
        moved since it was opened: orbax would recreate it, a half folder at the old path."""
        if self._place is not None and _place_of(self.directory) != self._place:
            raise CheckpointWriteError(
                errno.ENOENT,
                f"cannot write checkpoint round {step} in {self.directory}: that folder was "
                "deleted or moved while the run was writing it. Every record finished "
                "before is kept; resume where the run's folder is now (--resume).",
            )

    def _save_failed(
        self, step: int, err: Exception, threads: set[threading.Thread]
    ) -> Exception | None:
        """Cleans up after a save that raised ``err`` and returns the error to raise
        instead (None: ``err`` itself, not a failed write): orbax's threads for it are
        waited for and, for a failed write, its temporary directory removed, so that what
        is left is exactly the steps saved before."""
        _settle(threads)
        problem = _os_problem(err)
        if problem is not None:  # orbax's late reports of it are not printed (see below)
            _FAILED_CODES.add(problem[0])
        # The save's asyncio tasks and futures that failed unawaited are reported when they
        # are collected ("Task exception was never retrieved", a traceback): now, while
        # their reports are held back, not at some later collection or at exit.
        gc.collect()
        try:
            self._check_place(step)  # a folder deleted or moved: say that, not ENOENT
        except OSError as moved:
            if _is_writer():
                self._undo_recreated(step)
            return moved
        if problem is None:
            return None  # not the disk's: left as it is (the next opening clears it)
        if _is_writer():
            for _ in range(3):  # a late tensorstore write may recreate a file once
                with contextlib.suppress(OSError):
                    self._remove_partial_saves()
                time.sleep(0.05)
                if not any(_TMP_MARK in p.name for p in _entries(self.directory)):
                    break
        code, reason = problem
        if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            then = "free space, then --resume"
        else:
            then = "make it writable, then --resume"
        return CheckpointWriteError(
            code,
            f"cannot write checkpoint round {step} in {self.directory}: {reason}. Every "
            f"record finished before is kept; {then}.",
        )

    def _undo_recreated(self, step: int) -> None:
        """Removes what a save wrote at the directory's path after the directory was
        moved or deleted (orbax writes by path, creating the folders it misses): the
        step's folders, then each folder emptied by that up to the first one that was
        there when the checkpointer opened. Anything else found there is left alone."""
        for path, place in self._chain:
            now = _place_of(path)
            if now is not None and now == place:
                break  # an original folder: nothing above it was recreated
            if now is None:
                continue
            if path == self.directory:
                for entry in _entries(path):
                    if entry.name == str(step) or entry.name.startswith(f"{step}{_TMP_MARK}"):
                        shutil.rmtree(entry, ignore_errors=True)
            try:
                path.rmdir()  # only when empty
            except OSError:
                break

    # ------------------------------------------------------------------ restoring
    def restore_latest(self, like_state: PyTree) -> Restored:
        """Restores the newest readable checkpoint, falling back past corrupt ones.

        Args:
          like_state: a state (or ``jax.eval_shape`` of one) with the tree structure,
            shapes and dtypes to restore into.

        Returns:
          A :class:`Restored`.

        Raises:
          FileNotFoundError: the directory holds no checkpoint.
          ValueError: the newest intact checkpoint does not match ``like_state``
            (different structure, shape or dtype: another configuration wrote it).
          CheckpointError: every checkpoint present is corrupt.

        Warns:
          UserWarning: for each corrupt checkpoint skipped (it is renamed to
            ``<round>.corrupt``).
        """
        rounds = self.rounds()
        if not rounds:
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}.")
        broken = []
        newest_first = rounds[::-1]
        for i, step in enumerate(newest_first):
            try:
                restored, err = self._restore(step, like_state), None
            except _Corrupt as error:
                restored, err = None, error
            # Several processes: all must take the same branch (a step corrupt for one of
            # them is corrupt for all), since the quarantine and the next try are collective.
            err = _agree(err)
            if err is None:
                return restored
            moved = self._quarantine(step)
            broken.append(f"round {step}: {err}")
            then = (
                f"falling back to the checkpoint of round {newest_first[i + 1]}"
                if i + 1 < len(newest_first)
                else "no older checkpoint is left"
            )
            warnings.warn(
                f"checkpoint {_step_dir(self.directory, step)} is corrupt ({err}); "
                f"moved it to {moved.name}; {then}.",
                UserWarning,
                stacklevel=2,
            )
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}: every one is corrupt "
            f"({'; '.join(broken)})."
        )

    def _restore(self, step: int, like_state: PyTree) -> Restored:
        ocp = self._ocp
        path = _step_dir(self.directory, step)
        # Orbax and tensorstore raise many error types for damaged files (JSONDecodeError,
        # FileNotFoundError, ValueError with a tensorstore status, ...): all mean "corrupt".
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            ).meta
            payload = _verified_payload(meta)
        except Exception as err:
            raise _Corrupt(f"unreadable metadata: {_short(err)}") from err
        if payload["round"] != step:
            raise _Corrupt(f"its metadata says round {payload['round']}")
        like_leaves, treedef = jax.tree.flatten(like_state)
        _check_matches(path, payload["leaves"], like_state)
        # A leaf saved in blocks that line up with like_state's sharding comes back as a
        # jax.Array of that sharding: each process reads only its own blocks. Any other leaf
        # is read whole (as a numpy array) on every process.
        target = {}
        for i, (m, like) in enumerate(zip(payload["leaves"], like_leaves, strict=True)):
            if int(np.prod(m["shape"])) == 0:
                continue
            sharding = _block_sharding(m, like)
            target[f"{i:05d}"] = (
                np.zeros(m["shape"], jnp.dtype(m["dtype"]))
                if sharding is None
                else jax.ShapeDtypeStruct(
                    tuple(m["shape"]), jnp.dtype(m["dtype"]), sharding=sharding
                )
            )
        try:
            # One key unless the checkpoint says otherwise (its metadata names the shape).
            key_shape = payload.get("key_shape", [_key_size(payload["key_impl"])])
            target["key"] = np.zeros(key_shape, np.uint32)
            # Through the handler, not the manager: the manager ends its restore with a
            # barrier, which a process whose read failed would never reach.
            arrays = self._arrays_handler.restore(
                path / "arrays", args=ocp.args.StandardRestore(target)
            )
            arrays = {
                k: v if isinstance(target[k], jax.ShapeDtypeStruct) else np.asarray(v)
                for k, v in arrays.items()
            }
        except Exception as err:
            raise _Corrupt(f"unreadable arrays: {_short(err)}") from err
        leaves = []
        for i, (m, like) in enumerate(zip(payload["leaves"], like_leaves, strict=True)):
            name = f"{i:05d}"
            value = arrays.get(name, np.zeros(m["shape"], jnp.dtype(m["dtype"])))
            if not _verified(value, m):
                raise _Corrupt(f"array {m['path']} fails its checksum")
            leaves.append(value if isinstance(value, jax.Array) else _place(value, like))
        key_data = arrays["key"]
        if _sha256(key_data) != payload["key_sha256"]:
            raise _Corrupt("the root key fails its checksum")
        key = jr.wrap_key_data(key_data, impl=payload["key_impl"])
        return Restored(
            state=jax.tree.unflatten(treedef, leaves),
            key=key,
            round=step,
            extra=payload["extra"],
            path=path,
        )

    def _quarantine(self, step: int) -> Path:
        source = _step_dir(self.directory, step)
        target = self.directory / f"{step}{_CORRUPT_SUFFIX}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{_CORRUPT_SUFFIX}-{n}"
        _barrier(f"quarantine-{step}-start")  # every process has listed `target` free
        if _is_writer():
            source.rename(target)
        _barrier(f"quarantine-{step}-done")
        self._manager.reload()
        return target


def _pin(directory: Path) -> int | None:
    """An open descriptor of the directory (None where it cannot be opened)."""
    try:
        return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None


def _place_of(directory: Path) -> tuple[int, int] | None:
    """The directory's (device, inode), None if it cannot be read."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _is_writer() -> bool:
    """Whether this process changes the directory: process 0 (orbax's primary host)."""
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    """Waits for every process (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"scaffold_jax.checkpoint:{name}")


def _short(err: BaseException, limit: int = 200) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
