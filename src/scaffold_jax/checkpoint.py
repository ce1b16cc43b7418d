"""Save and restore the full simulation state with orbax: atomic, rotating, verified.

A checkpoint holds everything needed to continue a run exactly: every leaf of the
:class:`~scaffold_jax.types.SimState` (the server state, the whole ``[N, ...]`` client
table, the round), the root PRNG key (as ``jax.random.key_data`` plus the name of its
implementation, since typed keys are not serialisable) and an arbitrary JSON-able ``extra``
dict (``Simulation.run`` stores the evaluation records made so far there).

Layout. ``directory/<round>/`` is one orbax :class:`~orbax.checkpoint.CheckpointManager`
step with two items: ``arrays`` (the leaves, ``StandardSave``) and ``meta`` (``JsonSave``:
the round, the key implementation, ``extra``, and for every leaf its path, shape, dtype and
SHA-256). Leaves are stored flat, under their index, and rebuilt with the caller's
``like_state`` tree: that sidesteps orbax's handling of NamedTuples and of the empty ``()``
nodes stateless algorithms carry, and it lets a mismatch be reported leaf by leaf.

Atomicity. Orbax writes a step to ``<round>.orbax-checkpoint-tmp-<timestamp>/`` and, once
every file is written, renames it to ``<round>/`` (``AtomicRenameTemporaryPath``: a single
``rename(2)``, atomic on a local filesystem). Saving is synchronous, so a process killed at
any instant leaves either the complete new step or only a temporary directory, which the
step listing ignores; a :class:`Checkpointer` deletes such leftovers when it opens the
directory. The last ``max_to_keep`` steps are kept.

Failed saves. A save that cannot be written (a full disk, a read-only folder) raises one
:class:`CheckpointWriteError` (an ``OSError``: its errno, and one line naming the round and
the directory) instead of orbax's and tensorstore's errors; the threads orbax started for it
are waited for, its temporary directory is removed, and orbax's reports of the same error
from its threads (absl log records with tracebacks, asyncio's "Task exception was never
retrieved" for its tasks, "Event loop is closed" from late tensorstore callbacks) are not
printed: the error is said once. The steps saved before are intact, so the run
resumes from the newest of them. A directory deleted or moved while the checkpointer is
open (or a folder above it: the run folder) is never recreated: saving raises instead.

Verification and fallback. Orbax does not checksum: a flipped byte in an array file restores
silently as a wrong value (we checked with orbax 0.12.8). So the SHA-256 of every leaf and of
the metadata itself are recorded at save time and checked at restore time.
:func:`restore_latest` tries the newest step first; a step that cannot be read or fails
verification is renamed to ``<round>.corrupt`` (kept for inspection, and out of the way of
the step that will be saved again at that round), a :class:`UserWarning` names it, and the
previous step is tried. A checkpoint that is intact but was written for a differently shaped
simulation is NOT treated as corrupt: that raises ``ValueError`` at once and moves nothing.

Several processes (``jax.distributed.initialize``). Every process opens the same
:class:`Checkpointer` and calls :meth:`~Checkpointer.save` and
:meth:`~Checkpointer.restore_latest` at the same points (both are collectives), on a
directory that all of them see (a shared filesystem). No process ever holds another's part
of the client table: a leaf spread over processes is handed to orbax as the ``jax.Array``
it is, and orbax writes each process's own blocks from that process, in parallel (into
``arrays/ocdbt.process_<i>/``, whose index process 0 merges before the rename).
Gathering the whole table to every host, as this module first did, cost each process the
host memory of the entire ``[N, ...]`` table (the very thing a client mesh spreads out) and
serialised the write on process 0. The checksums follow the blocks: each process hashes the
blocks it holds (one copy of each: the ``replica_id == 0`` one), the digests alone (a few
bytes each) are gathered, and process 0 writes them all in ``meta``, keyed by the block's
slice (``"0:12,0:5,0:3"``). Leaves held whole by every process (one process, or host
arrays) are saved from process 0 with one digest per leaf, as before. Restoring asks orbax
for each leaf with the sharding of ``like_state``, so each process reads only its own
blocks, and verifies each against its digest. A checkpoint whose blocks do not line up with
``like_state``'s (written by another number of processes or devices, or on one process) is
read whole on every process and checked slice by slice instead. The arrays are read
without orbax's closing barrier, so a damaged file that only one process reads cannot leave
the others waiting: the processes then agree on whether the step is corrupt (it is when any
of them fails to read or verify it), and only process 0 changes the directory (removing
partial saves, renaming corrupt steps), between barriers.

Examples:
  >>> import tempfile, jax.random as jr, numpy as np
  >>> import scaffold_jax as sj
  >>> from scaffold_jax import checkpoint
  >>> problem = sj.models.logistic_regression((4,), 3)
  >>> state = sj.init_state(sj.scaffold(problem.loss_fn), problem.params, num_clients=5)
  >>> with tempfile.TemporaryDirectory() as d:
  ...     _ = checkpoint.save(d, state, jr.key(0), extra={"note": "demo"})
  ...     restored = checkpoint.restore_latest(d, like_state=state)
  >>> restored.round, restored.extra
  (0, {'note': 'demo'})
  >>> bool(np.array_equal(restored.state.clients.control["linear"]["kernel"],
  ...                     state.clients.control["linear"]["kernel"]))
  True
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.types import PyTree

FORMAT = "scaffold_jax.checkpoint/1"
_TMP_MARK = ".orbax-checkpoint-tmp"
_CORRUPT_SUFFIX = ".corrupt"


class CheckpointError(ValueError):
    """No checkpoint in a directory could be read (all of them are corrupt)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only or vanished folder);
    the checkpoints saved before it are intact."""

    def __str__(self) -> str:  # the message alone: it names the round, the folder, the fix
        return self.strerror or super().__str__()


class _Corrupt(Exception):
    """Internal: one step is unreadable or fails verification."""


class Restored(NamedTuple):
    """What :func:`restore_latest` returns.

    Attributes:
      state: the restored state, with the tree structure of ``like_state`` (device arrays;
        placed with ``like_state``'s shardings where it has them).
      key: the root PRNG key saved with it (a typed key).
      round: the checkpoint's round (its orbax step).
      extra: the JSON-able ``extra`` dict given to :func:`save`.
      path: the checkpoint's directory.
    """

    state: PyTree
    key: jax.Array
    round: int
    extra: dict[str, Any]
    path: Path


def _leaf_paths(tree: PyTree) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _sha256(array: np.ndarray) -> str:
    # Hash the raw bytes (no copy for contiguous arrays); reshape first so 0-d arrays and
    # extension dtypes such as bfloat16 can be viewed as bytes.
    flat = np.ascontiguousarray(array).reshape(-1)
    return hashlib.sha256(flat.view(np.uint8).data).hexdigest()


def _spreads(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding`` puts blocks on other processes (never with one process)."""
    return not sharding.is_fully_addressable


def _is_spread(a: Any) -> bool:
    """Whether ``a`` is a (non-empty) jax.Array with blocks held by other processes."""
    return isinstance(a, jax.Array) and a.size > 0 and _spreads(a.sharding)


def _host_or_spread(a: Any) -> Any:
    """``a`` as saved: a jax.Array spread over processes as it is; anything else as a
    numpy array (typed keys as their key data)."""
    if isinstance(a, jax.Array):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jr.key_data(a)
        if _is_spread(a):
            return a
        if a.size == 0:  # nothing to fetch, from any process
            return np.zeros(a.shape, a.dtype)
    return np.asarray(a)


def _block_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
    """A block's place in its array as text, e.g. ``"0:12,0:5,0:3"`` (``""`` for a scalar)."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _block_digests(a: jax.Array) -> dict[str, str]:
    """The SHA-256 of each block of ``a`` this process holds, one copy of each: the
    ``replica_id == 0`` one (another process hashes a block held by several)."""
    return {
        _block_key(s.index, a.shape): _sha256(np.asarray(s.data))
        for s in a.addressable_shards
        if s.replica_id == 0
    }


def _gather_block_digests(own: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    """Every process's block digests, merged (a collective with several processes).

    Only the digests travel: each process's ``own`` as JSON bytes, padded to the longest,
    through two ``process_allgather`` calls on small numpy arrays.
    """
    if jax.process_count() == 1:
        return own
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps({str(i): d for i, d in own.items()}).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    sizes = sizes.reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    merged: dict[int, dict[str, str]] = {}
    for row, size in zip(rows, sizes, strict=True):
        for i, digests in json.loads(row[: int(size)].tobytes()).items():
            merged.setdefault(int(i), {}).update(digests)
    return merged


def _block_sharding(m: dict[str, Any], like: Any) -> jax.sharding.Sharding | None:
    """``like``'s sharding when the leaf ``m`` was saved in exactly its blocks and it spreads
    over processes (each process then reads its own blocks); None to read it whole.

    Decided from global information only, so every process decides alike."""
    sharding = getattr(like, "sharding", None)
    if "blocks" not in m or not isinstance(sharding, jax.sharding.Sharding):
        return None
    if not _spreads(sharding):
        return None
    shape = tuple(m["shape"])
    keys = {_block_key(i, shape) for i in sharding.devices_indices_map(shape).values()}
    return sharding if keys == set(m["blocks"]) else None


def _verified(value: Any, m: dict[str, Any]) -> bool:
    """Whether ``value`` (a numpy array, or a jax.Array of this process's blocks) has the
    shape, dtype and checksum(s) ``m`` records."""
    if list(value.shape) != m["shape"] or str(jnp.dtype(value.dtype)) != m["dtype"]:
        return False
    if "sha256" in m:  # one digest for the leaf: value is whole
        return _sha256(np.asarray(value)) == m["sha256"]
    blocks = m["blocks"]
    if isinstance(value, jax.Array):  # this process's blocks, replicas included
        pieces = [(_block_key(s.index, value.shape), s.data) for s in value.addressable_shards]
    else:  # read whole: check every block saved
        pieces = [(k, value[_block_slices(k)]) for k in blocks]
    return all(blocks.get(k) == _sha256(np.asarray(data)) for k, data in pieces)


def _block_slices(key: str) -> tuple[slice, ...]:
    if not key:
        return ()
    return tuple(slice(*(int(x) for x in part.split(":"))) for part in key.split(","))


def _canonical(payload: dict[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True, allow_nan=True)


def _step_dir(directory: Path, step: int) -> Path:
    return directory / str(step)


class Checkpointer:
    """Saves and restores simulation states in one directory, keeping the last few.

    Use it as a context manager (or call :meth:`close`): orbax runs background threads
    that must be shut down before the interpreter exits.

    Args:
      directory: where the checkpoints live (created if missing).
      max_to_keep: how many of the newest checkpoints to keep (>= 1).

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
                np.zeros(m["shape"], _dtype(m["dtype"]))
                if sharding is None
                else jax.ShapeDtypeStruct(tuple(m["shape"]), _dtype(m["dtype"]), sharding=sharding)
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
            value = arrays.get(name, np.zeros(m["shape"], _dtype(m["dtype"])))
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


# ---------------------------------------------------------------------- module functions
def save(
    directory: str | os.PathLike,
    state: PyTree,
    key: jax.Array,
    extra: dict[str, Any] | None = None,
    max_to_keep: int = 3,
) -> Path:
    """Saves ``state`` at round ``state.round`` in ``directory``; see :meth:`Checkpointer.save`."""
    with Checkpointer(directory, max_to_keep=max_to_keep) as ckpt:
        return ckpt.save(state, key, extra)


def restore_latest(directory: str | os.PathLike, like_state: PyTree) -> Restored:
    """Restores the newest readable checkpoint; see :meth:`Checkpointer.restore_latest`.

    Raises:
      FileNotFoundError: ``directory`` does not exist or holds no checkpoint.
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no checkpoint to restore: {directory} is not a directory.")
    with Checkpointer(directory, max_to_keep=1_000_000) as ckpt:
        return ckpt.restore_latest(like_state)


def latest_round(directory: str | os.PathLike) -> int | None:
    """The newest checkpoint's round in ``directory`` (None if none; not verified)."""
    if not Path(directory).is_dir():
        return None
    rounds = [int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir()]
    return max(rounds) if rounds else None


def latest_extra(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``extra`` of the newest checkpoint in ``directory`` whose metadata reads and
    verifies (None if none): a caller checks a run's identity with it before touching
    anything else, without restoring the state."""
    if not Path(directory).is_dir():
        return None
    rounds = sorted(
        (int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir()),
        reverse=True,
    )
    for step in rounds:
        try:
            meta = json.loads((_step_dir(Path(directory), step) / "meta" / "metadata").read_text())
            return _verified_payload(meta)["extra"]
        except Exception:  # unreadable or damaged: the restore will say so, or use an older
            continue
    return None


# ---------------------------------------------------------------------- failed saves
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


def _settle(before: set[threading.Thread], timeout: float = 30.0) -> None:
    """Waits for the threads orbax started for a save that failed (those still writing,
    or failing in turn), so that its temporary directory can be removed for good."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread in before or thread is threading.current_thread():
            continue
        if type(thread).__module__.startswith("orbax"):
            # threading's own join: orbax's re-raises the thread's error, said already.
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_problem(err: BaseException) -> tuple[int, str] | None:
    """The operating-system error behind a failed save, as (errno, its text): an
    OSError, or tensorstore's ``[os_error_code='28']`` in the text of the ValueError that
    orbax passes on; None if there is none (not a failed write: a bug to show as is)."""
    seen, error = set(), err
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno:
            return error.errno, error.strerror or str(error)
        found = _OS_ERROR_CODE.search(str(error))
        if found:
            code = int(found.group(1))
            return code, os.strerror(code)
        error = error.__cause__ or error.__context__
    text = str(err)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO):
        if os.strerror(code) in text:
            return code, os.strerror(code)
    return None


#: The loggers orbax reports a save's errors on: absl's (its own log, its threads'), and
#: asyncio's (its tasks' and futures' exceptions nobody retrieved).
_ORBAX_LOGGERS = ("absl", "asyncio")


class _HeldLog(logging.Filter):
    """While held (see :meth:`Checkpointer.save`), holds back the records of orbax's
    loggers and the errors its threads (or those of its asyncio loops) end with."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.thread_errors: list[Any] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def hold(self) -> None:
        for name in _ORBAX_LOGGERS:
            logging.getLogger(name).addFilter(self)
        _HOLDING.append(self)

    def stop(self) -> None:
        for name in _ORBAX_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        with contextlib.suppress(ValueError):
            _HOLDING.remove(self)

    def release(self) -> None:
        """Passes what it held on: each record to its own logger, each thread's error to
        ``threading.excepthook``."""
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        for args in self.thread_errors:
            threading.excepthook(args)
        self.records.clear()
        self.thread_errors.clear()


#: The holds in force (a save in progress, a checkpointer closing after a failed one).
_HOLDING: list[_HeldLog] = []


_NOISE_FILTERED = False


#: The errno of every save that failed in this process (its late reports are repeats).
_FAILED_CODES: set[int] = set()


def _filter_orbax_noise() -> None:
    """Keeps orbax's second and third reports of a failed save off stderr (once per
    process, when the first :class:`Checkpointer` opens): its threads log the error they
    hand to the caller (absl ERROR records with a traceback each), its asyncio tasks that
    failed unawaited are reported when collected (asyncio's "Task exception was never
    retrieved", with a traceback), a thread of it may end with the error, and tensorstore
    writes still in flight complete into the closed event loop of that thread ("Event
    loop is closed", an unraisable exception). The caller gets the error itself, once
    (:class:`CheckpointWriteError`). Every other record, unraisable exception and thread
    error is passed on as before."""
    global _NOISE_FILTERED
    if _NOISE_FILTERED:
        return
    _NOISE_FILTERED = True
    logging.getLogger("absl").addFilter(_not_a_rethrown_error)
    logging.getLogger("asyncio").addFilter(_not_a_repeated_report)
    sys.unraisablehook = _UnraisableFilter(sys.unraisablehook)
    threading.excepthook = _ThreadErrorFilter(threading.excepthook)


def _not_a_rethrown_error(record: logging.LogRecord) -> bool:
    if "_SignalingThread.run() raised an exception" in str(record.msg):
        return False
    return not (record.exc_info and _repeats_a_failed_save(record.exc_info[1]))


def _not_a_repeated_report(record: logging.LogRecord) -> bool:
    """asyncio's report of a task or future of a failed save: its error unretrieved, or
    the task left pending when orbax closed its loop."""
    if record.exc_info and _repeats_a_failed_save(record.exc_info[1]):
        return False
    if _FAILED_CODES and "Task was destroyed but it is pending" in str(record.msg):
        text = record.getMessage()
        return "orbax" not in text and "tensorstore" not in text
    return True


def _repeats_a_failed_save(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a late report of a save that failed in this process (raised to
    its caller once already): that write error, or a callback into the event loop orbax
    closed after it."""
    try:
        if not _FAILED_CODES or exc is None:
            return False
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return True
        problem = _os_problem(exc)
        return problem is not None and problem[0] in _FAILED_CODES
    except Exception:  # noqa: BLE001 - a filter never fails what it filters
        return False


class _UnraisableFilter:
    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if not (_late_loop_callback(unraisable) or _repeats_a_failed_save(unraisable.exc_value)):
            self.previous(unraisable)


class _ThreadErrorFilter:
    """``threading.excepthook`` but for a thread of orbax (or of its asyncio loops) that
    ends with the error of a failed save."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, args) -> None:
        if not _in_orbax(args):
            self.previous(args)
        elif _HOLDING:  # during a save: said with it if it fails, passed on if not
            _HOLDING[-1].thread_errors.append(args)
        elif not _repeats_a_failed_save(args.exc_value):
            self.previous(args)


def _in_orbax(args) -> bool:
    """Whether a thread's error came through orbax, tensorstore or an asyncio loop."""
    if type(args.thread).__module__.startswith("orbax"):
        return True
    tb = args.exc_traceback
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if any(f"{os.sep}{part}{os.sep}" in name for part in ("orbax", "tensorstore", "asyncio")):
            return True
        tb = tb.tb_next
    return False


def _late_loop_callback(unraisable) -> bool:
    """A callback into an event loop that orbax already closed after a failed save."""
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


# ---------------------------------------------------------------------- helpers
def _split_key(key: jax.Array) -> tuple[str, np.ndarray]:
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jr.key_impl(key)), np.asarray(jr.key_data(key), np.uint32)
    if key.dtype != jnp.uint32 or key.ndim != 1:
        raise TypeError(
            f"key must be a typed PRNG key or raw uint32 key data, got {key.dtype}{key.shape}."
        )
    # Raw key data of the default implementation (what jax.random.PRNGKey returns).
    return str(jr.key_impl(jr.wrap_key_data(key))), np.asarray(key, np.uint32)


def _key_size(impl: str) -> int:
    return int(jr.key_data(jr.key(0, impl=impl)).shape[-1])


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def _verified_payload(meta: Any) -> dict[str, Any]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} checkpoint")
    payload = meta.get("payload")
    if not isinstance(payload, dict) or _digest(payload) != meta.get("sha256"):
        raise ValueError("metadata checksum mismatch")
    return payload


def _dtype(name: str) -> np.dtype:
    return jnp.dtype(name)  # jnp knows bfloat16 and the other ml_dtypes by name


def _place(value: np.ndarray, like: Any) -> jax.Array:
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    # Spread over processes, but the checkpoint's blocks differ from this sharding's: every
    # process read the whole value and builds its own blocks from it.
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _is_writer() -> bool:
    """Whether this process changes the directory: process 0 (orbax's primary host)."""
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    """Waits for every process (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"scaffold_jax.checkpoint:{name}")


def _agree(err: _Corrupt | None) -> _Corrupt | None:
    """``err``, or a :class:`_Corrupt` if another process failed where this one did not.

    With several processes a collective: each reports whether it could read and verify
    the step, and the step counts as corrupt for all when it is for any.
    """
    if jax.process_count() == 1:
        return err
    from jax.experimental import multihost_utils

    failed = multihost_utils.process_allgather(np.asarray([err is not None], np.int32))
    failed = np.asarray(failed).reshape(-1)
    if err is None and failed.any():
        where = ", ".join(str(int(i)) for i in np.flatnonzero(failed))
        return _Corrupt(f"unreadable or failing verification on process(es) {where}")
    return err


def _short(err: BaseException, limit: int = 200) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_matches(path: Path, saved: list[dict[str, Any]], like_state: PyTree) -> None:
    """Raises ValueError naming the differences if ``saved`` does not fit ``like_state``."""
    paths = _leaf_paths(like_state)
    like_leaves = jax.tree.leaves(like_state)
    problems = []
    if [m["path"] for m in saved] != paths:
        problems.append(
            f"it holds {len(saved)} arrays {[m['path'] for m in saved][:6]}, this simulation's "
            f"state has {len(paths)} {paths[:6]}"
        )
    else:
        for m, like in zip(saved, like_leaves, strict=True):
            shape, dtype = list(np.shape(like)), str(jnp.dtype(like.dtype))
            if m["shape"] != shape or m["dtype"] != dtype:
                problems.append(
                    f"{m['path']} is {m['dtype']}{tuple(m['shape'])} in the checkpoint but "
                    f"{dtype}{tuple(shape)} here"
                )
    if problems:
        raise ValueError(
            f"checkpoint {path} does not match this simulation: {'; '.join(problems[:3])}. "
            "It was written by a run with another model, number of clients or algorithm; "
            "resume with the same configuration or use another checkpoint directory."
        )
