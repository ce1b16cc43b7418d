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
directory. The last ``max_to_keep`` steps are kept while a run saves; once it is finished,
``Simulation.run`` and sweeps keep only the newest ``keep_checkpoints`` (default 1, the final
state, all that a resume with more rounds needs: :meth:`Checkpointer.keep_newest`).

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

import json
import os
from pathlib import Path
from typing import Any

import jax

from scaffold_jax.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    Restored,
    _step_dir,
)
from scaffold_jax.checkpoint.checksums import FORMAT, _verified_payload
from scaffold_jax.types import PyTree

__all__ = [
    "FORMAT", "CheckpointError", "CheckpointWriteError", "Checkpointer", "Restored",
    "latest_extra", "latest_round", "restore_latest", "save",
]  # fmt: skip


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


def _saved_rounds(directory: str | os.PathLike) -> list[int]:
    """The rounds of the steps in ``directory``, newest first (not verified)."""
    if not Path(directory).is_dir():
        return []
    steps = (int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir())
    return sorted(steps, reverse=True)


def latest_round(directory: str | os.PathLike) -> int | None:
    """The newest checkpoint's round in ``directory`` (None if none; not verified)."""
    rounds = _saved_rounds(directory)
    return rounds[0] if rounds else None


def latest_extra(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ``extra`` of the newest checkpoint in ``directory`` whose metadata reads and
    verifies (None if none): a caller checks a run's identity with it before touching
    anything else, without restoring the state."""
    for step in _saved_rounds(directory):
        try:
            meta = json.loads((_step_dir(Path(directory), step) / "meta" / "metadata").read_text())
            return _verified_payload(meta)["extra"]
        except Exception:  # unreadable or damaged: the restore will say so, or use an older
            continue
    return None
