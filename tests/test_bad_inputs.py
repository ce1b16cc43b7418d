"""Bad input is refused with a message that names the problem — one test per case.

The cases below are ALSO the table in ``docs/bad_inputs.md``: ``render_doc()`` builds it
from them and :func:`test_the_doc_lists_exactly_these_cases` fails when the two disagree.
Regenerate the page with ``python tests/test_bad_inputs.py``.

In an expected message, ``{tmp}`` stands for the test's temporary directory and ``…`` for
any text (used only where the message quotes a third-party error, e.g. tensorstore's, or
names the machine, e.g. its platform).
"""

from __future__ import annotations

import dataclasses
import errno
import gzip
import json
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import checkpoint, cli, experiments, paper, resources, results
from scaffold_jax import sweep as sweeps
from scaffold_jax.data import femnist, partition, sources, synthetic
from scaffold_jax.experiments import ConfigError, RunConfig, load_config_file
from scaffold_jax.loop import DivergenceError
from scaffold_jax.registry import load_plugins

DOC = Path(__file__).parent.parent / "docs" / "bad_inputs.md"

# A run whose privacy settings the DP cases vary (quadratic data: nothing to load).
DP_RUN = {"dataset": "quadratic", "num_clients": 50, "rounds": 10}
# A run with the virtual clock's device profiles (scaffold_jax.participation.clock).
TIMED = {"profiles": "lognormal"}
# What a dropout rate must be (scaffold_jax.participation.dropouts).
DROPOUT_RATE = (
    "a probability in [0, 1): at 1 every sampled client drops, so no update ever reaches the "
    "server and the model never trains"
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
      id: the test id.
      what: the bad input, in words (the doc's first column).
      call: the call that refuses it, in words.
      error: the exception type raised.
      message: the exact message; ``{tmp}`` = the temp dir, ``…`` = any text.
      make: performs the bad call, given the test context.
    """

    id: str
    what: str
    call: str
    error: type[BaseException]
    message: str
    make: Callable[[SimpleNamespace], object]


# --------------------------------------------------------------------------- helpers
def clients(sizes=(2, 9, 5, 13, 3, 7, 11), dim=5, num_classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(n, dim)).astype(np.float32),
            "y": rng.integers(0, num_classes, n).astype(np.int32),
        }
        for n in sizes
    ]


def simulation(ctx, s=2, plan=None, algorithm=None, problem=None, **kw):
    problem = problem or ctx.problem
    algorithm = algorithm or sj.scaffold(problem.loss_fn)
    return sj.Simulation(algorithm, problem, plan or sj.BatchPlan.fixed(2, 1), s, **kw)


def run(ctx, *, sim=None, data=None, hp=None, **kw):
    sim = sim or simulation(ctx)
    args = {"num_rounds": 2, "eval_every": 1, **kw}
    return sim.run(data or ctx.data, hp or sj.hparams(0.1), **args)


def resume(ctx, **kw):
    return run(ctx, sim=ctx.sim, checkpoint_dir=ctx.ckpt_dir, resume=True, **kw)


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, payload: bytes) -> Path:
    path.write_bytes(payload)
    return path


def idx_folder(ctx, labels_test: np.ndarray, type_code: int = 0x08) -> Path:
    folder = ctx.tmp / "fmnist"
    folder.mkdir()
    images = np.zeros((3, 2, 2), np.uint8)
    write(folder / "train-images-idx3-ubyte", idx_bytes(images))
    write(folder / "train-labels-idx1-ubyte", idx_bytes(np.array([0, 1, 2], np.uint8)))
    write(folder / "t10k-images-idx3-ubyte.gz", gzip.compress(idx_bytes(images)))
    write(folder / "t10k-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(labels_test, type_code)))
    return folder


def train_only_idx_folder(ctx) -> Path:
    """A folder with Fashion-MNIST's training IDX files but not its test files."""
    folder = ctx.tmp / "fmnist"
    folder.mkdir()
    write(folder / "train-images-idx3-ubyte", idx_bytes(np.zeros((3, 2, 2), np.uint8)))
    write(folder / "train-labels-idx1-ubyte", idx_bytes(np.array([0, 1, 2], np.uint8)))
    return folder


def leaf_train_only(ctx) -> Path:
    """A LEAF FEMNIST folder with train/*.json and no test/."""
    folder = ctx.tmp / "leaf"
    (folder / "train").mkdir(parents=True)
    user = {"x": np.zeros((2, 784)).tolist(), "y": [0, 1]}
    (folder / "train" / "a.json").write_text(json.dumps({"users": ["w"], "user_data": {"w": user}}))
    return folder


def garbage_h5_folder(ctx) -> Path:
    """TFF's two FEMNIST file names holding bytes that are no HDF5."""
    pytest.importorskip("h5py")
    folder = ctx.tmp / "fem"
    folder.mkdir()
    for name in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
        (folder / name).write_bytes(b"not an hdf5 file" * 10)
    return folder


def json_with_a_repeated_key(ctx) -> Path:
    return write(ctx.tmp / "dup.json", b'{"rounds": 2, "client_lr": 0.1, "rounds": 3}')


def corrupt_every_checkpoint(ctx) -> None:
    for step in ctx.ckpt_dir.iterdir():
        (step / "meta" / "metadata").write_text("{")


def with_empty_client(ctx):
    data = ctx.data
    counts = np.asarray(data.counts).copy()
    counts[2] = 0
    return dataclasses.replace(data, counts=jnp.asarray(counts))


def with_label(ctx, index: int, label: int, field: str = "examples"):
    data = ctx.data
    examples = dict(getattr(data, field))
    y = np.asarray(examples["y"]).copy()
    y[index] = label
    examples["y"] = jnp.asarray(y)
    return dataclasses.replace(data, **{field: examples})


def with_values(field: str, index: tuple, value, dtype=None, sizes=(2, 9, 5)):
    """Clients whose ``field`` holds ``value`` at ``index`` of client 1 (as ``dtype``)."""
    data = clients(sizes=sizes)
    array = data[1][field].astype(dtype or data[1][field].dtype)
    array[index] = value
    data[1][field] = array
    return data


def with_memory(num_bytes: int, call: Callable[[], object]) -> object:
    """``call()`` on a machine with ``num_bytes`` of memory available."""
    with mock.patch.object(resources, "available_memory_bytes", lambda device=None: num_bytes):
        return call()


def unwritable(ctx, call: Callable[[], object], code: int = errno.EROFS) -> object:
    """``call()`` with ``ctx.tmp / "ro"`` on a read-only file system (``code``: EROFS), or
    not writable by this user (EACCES): creating or removing anything under it fails, as
    in a chmod 0o555 folder (simulated: the tests may run as root)."""
    root = str(ctx.tmp / "ro")

    def refused(real):
        def call_(path, *args, **kwargs):
            if os.fspath(path).startswith(root):
                raise OSError(code, os.strerror(code), os.fspath(path))
            return real(path, *args, **kwargs)

        return call_

    with mock.patch.object(os, "mkdir", refused(os.mkdir)), \
            mock.patch.object(os, "unlink", refused(os.unlink)):  # fmt: skip
        return call()


def overwrite_unwritable(ctx) -> None:
    """``--overwrite`` of a finished run whose folder has become read-only."""
    folder = ctx.tmp / "ro" / "run"
    with results.RunWriter(folder, {"a": 1}, plots=()) as writer:
        writer.record("s", {"round": 0, "test_accuracy": 0.1})
    unwritable(ctx, lambda: results.check_folder(folder, overwrite=True))


def read_only_files(ctx, call: Callable[[], object]) -> object:
    """``call()`` with ``ctx.tmp / "ro"`` on a read-only file system: no file is created
    there (``os.open`` with ``O_CREAT``), as under ``mount -o ro`` (simulated: the tests
    may run as root)."""
    root, real = str(ctx.tmp / "ro"), os.open

    def opening(path, flags, *args, **kwargs):
        where = os.fspath(path)
        if kwargs.get("dir_fd") is None and not os.path.isabs(where):
            where = os.path.abspath(where)
        if flags & os.O_CREAT and (where.startswith(root) or kwargs.get("dir_fd") is not None):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real(path, flags, *args, **kwargs)

    with mock.patch.object(os, "open", opening):
        return call()


def killed_run_read_only(ctx) -> None:
    """``--resume`` of a run killed with SIGKILL (its lock names a process that is gone),
    whose folder has become read-only: clearing the stale lock rewrites the summary."""
    import platform

    folder = ctx.tmp / "ro" / "run"
    writer = results.RunWriter(folder, {"a": 1}, plots=())
    writer.open()  # a "running" summary and this process's lock, never closed
    gone = 2**22 + 12345  # beyond pid_max's default: no such process
    (folder / ".lock").write_text(json.dumps({"pid": gone, "host": platform.node()}))
    read_only_files(ctx, lambda: results.check_lock(folder))


def fifo(ctx) -> str:
    path = ctx.tmp / "devices.fifo"
    os.mkfifo(path)
    return str(path)


def profile_csv(ctx, *rows: str) -> str:
    text = "seconds_per_example,down_bytes_per_s,up_bytes_per_s\n" + "\n".join(rows) + "\n"
    return str(write(ctx.tmp / "devices.csv", text.encode()))


def cli_config(*argv: str) -> RunConfig:
    """The config ``scaffold-jax run ARGV`` builds (not validated)."""
    return cli._config(cli._parse(["run", *argv]), validate=False)


def quick_run(values) -> None:
    """``scaffold-jax run`` of these config values (refused before its folder is made)."""
    experiments.run(RunConfig.from_dict({**DP_RUN, **values}), quiet=True)


def sweep_args(*argv: str):
    return cli.build_parser().parse_args(["sweep", *argv])


EMPTY_TEST = {"x": np.zeros((0, 5), np.float32), "y": np.zeros(0, np.int32)}
# Shared tails of messages below.
TOO_MANY = (
    "at most 100000 local steps per round are allowed (a round's batches [S, K, B, ...] are "
    "built in memory)"
)
UNSET = (
    "or leave data_dir unset to search $SCAFFOLD_JAX_DATA_DIR, the system folders and the cache."
)


# --------------------------------------------------------------------------- the cases
# fmt: off
CASES = [
    # ----- the round's shape
    Case("S-greater-than-N", "S > N (8 of 7 clients)", "Simulation.run", ValueError,
         "clients_per_round (S) = 8 exceeds the number of clients N = 7; use S <= N.",
         lambda ctx: run(ctx, sim=simulation(ctx, s=8))),
    Case("S-below-1", "S < 1", "Simulation(...)", ValueError,
         "clients_per_round (S) = 0 is invalid: it must be >= 1.",
         lambda ctx: simulation(ctx, s=0)),
    Case("S-not-an-integer", "S = 2.5", "Simulation(...)", ValueError,
         "clients_per_round (S) = 2.5 is invalid: it must be an integer >= 1.",
         lambda ctx: simulation(ctx, s=2.5)),
    Case("K-below-1", "K < 1 local steps", "BatchPlan.fixed", ValueError,
         "num_local_steps (K) = 0 is invalid: it must be >= 1.",
         lambda ctx: sj.BatchPlan.fixed(batch_size=2, num_steps=0)),
    Case("B-below-1", "batch size B < 1", "BatchPlan.fixed", ValueError,
         "batch_size = 0 is invalid: it must be >= 1.",
         lambda ctx: sj.BatchPlan.fixed(batch_size=0, num_steps=2)),
    Case("B-beyond-int32", "batch size B = 2^31 (found by the fuzz test: an OverflowError "
         "in the data check)", "BatchPlan.fixed", ValueError,
         "batch_size = 2147483648 is invalid: at most 1073741824 examples a batch are allowed "
         "(a client's positions are int32); use a smaller batch.",
         lambda ctx: sj.BatchPlan.fixed(batch_size=2**31, num_steps=2)),
    Case("epochs-below-1", "epochs < 1", "BatchPlan.epochs", ValueError,
         "num_epochs = 0 is invalid: it must be >= 1.",
         lambda ctx: sj.BatchPlan.epochs(batch_size=2, num_epochs=0)),
    Case("fraction-above-1", "batch fraction > 1", "BatchPlan.fraction_of_data", ValueError,
         "batch fraction = 1.5 is invalid: it must be in (0, 1]; the paper uses 0.2 "
         "(5 steps per epoch).",
         lambda ctx: sj.BatchPlan.fraction_of_data(1.5, num_epochs=1)),
    Case("fraction-zero", "batch fraction = 0", "BatchPlan.fraction_of_data", ValueError,
         "batch fraction = 0.0 is invalid: it must be in (0, 1]; the paper uses 0.2 "
         "(5 steps per epoch).",
         lambda ctx: sj.BatchPlan.fraction_of_data(0.0, num_epochs=1)),
    Case("plan-kind", "unknown batch plan kind", "BatchPlan", ValueError,
         "BatchPlan kind 'minibatch' is unknown; use one of ('fixed', 'epochs', 'fraction', "
         "'full').",
         lambda ctx: sj.BatchPlan("minibatch")),
    Case("plan-type", "a plan that is not a BatchPlan", "Simulation(...)", TypeError,
         "plan must be a BatchPlan, got tuple.",
         lambda ctx: sj.Simulation(sj.fedavg(ctx.problem.loss_fn), ctx.problem, (2, 1), 2)),
    Case("weighting", "unknown weighting", "Simulation(...)", ValueError,
         "weighting 'size' is unknown; use one of uniform, num_examples.",
         lambda ctx: simulation(ctx, weighting="size")),
    Case("eval-batch-size", "evaluation chunk < 1", "Simulation(...)", ValueError,
         "eval_batch_size = 0 is invalid: it must be >= 1.",
         lambda ctx: simulation(ctx, eval_batch_size=0)),
    # ----- step sizes
    Case("client-lr-zero", "η_l = 0", "hparams", ValueError,
         "client_lr=0 is invalid: every value must be finite and > 0.",
         lambda ctx: sj.hparams(client_lr=0.0)),
    Case("client-lr-negative", "η_l < 0", "hparams", ValueError,
         # (types.py prints the float32 value in float64 digits)
         "client_lr=-0.1 is invalid: every value must be finite and > 0.",
         lambda ctx: sj.hparams(client_lr=-0.1)),
    Case("client-lr-nan", "η_l = NaN", "hparams", ValueError,
         "client_lr=nan is invalid: every value must be finite and > 0.",
         lambda ctx: sj.hparams(client_lr=float("nan"))),
    Case("client-lr-inf", "η_l = inf", "hparams", ValueError,
         "client_lr=inf is invalid: every value must be finite and > 0.",
         lambda ctx: sj.hparams(client_lr=float("inf"))),
    Case("server-lr-zero", "η_g = 0", "hparams", ValueError,
         "server_lr=0 is invalid: every value must be finite and > 0.",
         lambda ctx: sj.hparams(client_lr=0.1, server_lr=0.0)),
    Case("mu-negative", "FedProx μ < 0", "hparams", ValueError,
         "prox_mu=-1 is invalid: every value must be finite and >= 0.",
         lambda ctx: sj.hparams(client_lr=0.1, prox_mu=-1.0)),
    Case("lr-smuggled", "HParams built by hand with η_l < 0", "Simulation.run", ValueError,
         "client_lr=-1 is invalid: every value must be finite and > 0.",
         lambda ctx: run(ctx, hp=sj.HParams(client_lr=-1.0, server_lr=1.0))),
    Case("hparams-type", "a float instead of HParams", "Simulation.run", TypeError,
         "hparams must be an HParams (use scaffold_jax.hparams(...)), got float.",
         lambda ctx: simulation(ctx).run(ctx.data, 0.1, num_rounds=1)),
    Case("hparams-vector", "a grid of η_l given to a single run", "Simulation.run",
         ValueError,
         "hparams.client_lr has shape (2,): Simulation.run takes scalar hyper-parameters; use "
         "scaffold_jax.sweep to run a grid of them.",
         lambda ctx: run(ctx, hp=sj.hparams(client_lr=jnp.array([0.1, 0.2])))),
    Case("diverging-lr", "η_l so large that the run diverges", "Simulation.run",
         DivergenceError,
         "scaffold diverged: the server state holds NaN/Inf after round … (the first "
         "non-finite update came from round …) with client_lr=1e+30, server_lr=1e+30. "
         "Lower client_lr or server_lr.",
         lambda ctx: run(ctx, sim=ctx.sim, hp=sj.hparams(client_lr=1e30, server_lr=1e30))),
    # ----- algorithms
    Case("algorithm-name", "unknown algorithm", "algorithms.make", ValueError,
         "algorithm 'fedsgd' is unknown (did you mean 'sgd'?); use one of scaffold, fedavg, "
         "feddyn, fednova, fedprox, mime, mimelite, sgd….",
         lambda ctx: sj.algorithms.make("fedsgd", ctx.problem.loss_fn)),
    Case("scaffold-option", "unknown SCAFFOLD option", "scaffold", ValueError,
         "SCAFFOLD option 3 is unknown; use 1 (or 'I': control = gradient at x) or 2 (or "
         "'II': control from the local update, the paper's default).",
         lambda ctx: sj.scaffold(ctx.problem.loss_fn, option=3)),
    Case("control-dtype", "control variates stored as int8", "scaffold", ValueError,
         "control_dtype int8 is not supported; use float32 or bfloat16.",
         lambda ctx: sj.scaffold(ctx.problem.loss_fn, control_dtype=jnp.int8)),
    # ----- model and data
    Case("params-data-mismatch", "a model for 7 features on 5-feature data",
         "Simulation.run", ValueError,
         "the model's params do not fit the data: loss_fn(params, batch) failed for a batch "
         "with shapes {'x': ((2, 5), 'float32'), 'y': ((2,), 'int32')} and params with shapes "
         "{'linear': {'bias': (3,), 'kernel': (3, 7)}}. Build the model for the data's "
         "example shape and number of classes. (…)",
         lambda ctx: run(ctx, sim=simulation(ctx, problem=sj.models.logistic_regression((7,), 3)))),
    Case("loss-returns-mean", "a loss that returns a mean", "Simulation.run", ValueError,
         "loss_fn must return one loss per example, shape (2,); it returned shape (). Return "
         "per-example losses, not a mean.",
         lambda ctx: run(ctx, sim=simulation(ctx, problem=ctx.problem._replace(
             loss_fn=lambda p, b: jnp.mean(ctx.problem.loss_fn(p, b)))))),
    Case("test-set-mismatch", "a test set with another example shape", "Simulation.run",
         ValueError,
         "the test set does not fit the model: loss_fn(params, test) failed for a test set "
         "with shapes {'x': ((4, 7), 'float32'), 'y': ((4,), 'int32')} (training batches: "
         "{'x': ((5,), 'float32'), 'y': ((), 'int32')}). Give the test set the fields and "
         "example shape of the training data. (…)",
         lambda ctx: run(ctx, data=sj.from_client_arrays(
             clients(), test={"x": np.zeros((4, 7), np.float32), "y": np.zeros(4, np.int32)}))),
    Case("data-type", "a dict instead of a federated dataset", "Simulation.run", TypeError,
         "data must be a federated dataset (a FederatedData, e.g. from "
         "scaffold_jax.from_client_arrays, or a procedural dataset with num_clients, counts "
         "and client_batches); got dict.",
         lambda ctx: run(ctx, data={"x": np.zeros((3, 5))})),
    Case("num-classes", "fewer than 2 classes", "models.logistic_regression", ValueError,
         "num_classes=1 must be >= 2.",
         lambda ctx: sj.models.logistic_regression((5,), 1)),
    Case("empty-client", "a client with no examples", "from_client_arrays", ValueError,
         "client 2 has no data (0 examples). Drop it or give it at least one example.",
         lambda ctx: sj.from_client_arrays(clients(sizes=(3, 4, 0)))),
    Case("empty-client-in-dataset", "a dataset whose count for a client is 0",
         "Simulation.run", ValueError,
         "clients [2] have no data; every client needs >= 1 example.",
         lambda ctx: run(ctx, data=with_empty_client(ctx))),
    Case("no-clients", "an empty client list", "from_client_arrays", ValueError,
         "from_client_arrays needs at least one client; got an empty list.",
         lambda ctx: sj.from_client_arrays([])),
    Case("client-fields", "clients with different fields", "from_client_arrays", ValueError,
         "client 1 has pytree structure PyTreeDef({'x': *, 'z': *}), but client 0 has "
         "PyTreeDef({'x': *, 'y': *}); every client must hold the same fields.",
         lambda ctx: sj.from_client_arrays([clients()[0], {"x": np.zeros((2, 5)),
                                                           "z": np.zeros(2)}])),
    Case("client-lengths", "fields of one client with different lengths",
         "from_client_arrays", ValueError,
         "client 0: every leaf must share one leading example axis; got sizes {2, 3}.",
         lambda ctx: sj.from_client_arrays([{"x": np.zeros((2, 5)), "y": np.zeros(3)}])),
    Case("fractional-batch-size", "a fractional batch size", "BatchPlan.fixed", ValueError,
         "batch_size = 2.7 is invalid: it must be a whole number.",
         lambda ctx: sj.BatchPlan.fixed(2.7, 3)),
    Case("fractional-steps", "a fractional number of local steps", "BatchPlan.full",
         ValueError,
         "num_local_steps (K) = 1.5 is invalid: it must be a whole number.",
         lambda ctx: sj.BatchPlan.full(1.5)),
    Case("empty-partition", "a partition with no clients", "from_partition", ValueError,
         "the partition is empty: it assigns no clients.",
         lambda ctx: sj.from_partition({"x": np.zeros((3, 2))}, [])),
    Case("partition-out-of-range", "a partition index beyond the examples", "from_partition",
         ValueError,
         "the partition holds indices outside [0, 3), the number of examples; partition the "
         "same examples you pass.",
         lambda ctx: sj.from_partition({"x": np.zeros((3, 2))}, [np.array([0, 3])])),
    Case("partition-duplicate", "an example given to two clients", "from_partition",
         ValueError,
         "the partition assigns 1 examples to more than one client; every example may belong "
         "to one client only.",
         lambda ctx: sj.from_partition({"x": np.zeros((3, 2))}, [np.array([0, 1]),
                                                                 np.array([1, 2])])),
    # ----- files
    Case("idx-truncated", "a truncated IDX file", "sources.read_idx", ValueError,
         "{tmp}/short-idx1-ubyte: truncated IDX file: header (10,) |u1 needs 18 bytes, the "
         "file has 13.",
         lambda ctx: sources.read_idx(write(ctx.tmp / "short-idx1-ubyte",
                                            idx_bytes(np.arange(10, dtype=np.uint8))[:13]))),
    Case("idx-truncated-gzip", "a truncated gzipped IDX file", "sources.read_idx",
         ValueError,
         "{tmp}/short-idx1-ubyte.gz: corrupt or truncated gzip stream (…).",
         lambda ctx: sources.read_idx(write(
             ctx.tmp / "short-idx1-ubyte.gz",
             gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8)))[:40]))),
    Case("idx-magic", "a file with the wrong IDX magic number", "sources.read_idx",
         ValueError,
         "{tmp}/notes.txt is not an IDX file: magic number 68656c6c; expected 00 00 <type "
         "code> <ndim> with a type code in {0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E}.",
         lambda ctx: sources.read_idx(write(ctx.tmp / "notes.txt", b"hello world"))),
    Case("labels-out-of-range", "an IDX label outside [0, C)", "sources.load_idx_folder",
         ValueError,
         "{tmp}/fmnist/t10k-labels-idx1-ubyte.gz: label 12 at index 1 is outside [0, 10) (1 "
         "labels out of range).",
         lambda ctx: sources.load_idx_folder(idx_folder(ctx, np.array([0, 12, 3], np.uint8)),
                                             "fashion_mnist", num_classes=10)),
    Case("dataset-name", "an unknown dataset name", "sources.canonical_name", ValueError,
         "unknown dataset 'mnistt'; known: mnist, fashion_mnist, cifar10, cifar100, "
         "emnist/balanced, emnist/byclass, emnist/bymerge, emnist/digits, emnist/letters, "
         "emnist/mnist.",
         lambda ctx: sources.canonical_name("mnistt")),
    # ----- partitions
    Case("more-clients-than-examples", "more clients than examples",
         "partition.similarity_split", ValueError,
         "more clients than examples: num_clients = 10 but only 5 examples; every client "
         "needs at least one.",
         lambda ctx: partition.similarity_split(np.arange(5) % 2, 10, similarity=10, seed=0)),
    Case("num-clients-zero", "N < 1", "partition.iid_split", ValueError,
         "num_clients = 0 is invalid: it must be >= 1.",
         lambda ctx: partition.iid_split(10, 0, seed=0)),
    Case("dirichlet-alpha", "Dirichlet α <= 0", "partition.dirichlet_split", ValueError,
         "alpha = 0.0 is invalid: it must be finite and > 0.",
         lambda ctx: partition.dirichlet_split(np.arange(20) % 2, 4, alpha=0.0, seed=0)),
    Case("similarity-range", "similarity outside [0, 100]", "partition.similarity_split",
         ValueError,
         "similarity = 150 is invalid: it is a percentage in [0, 100] (0 = label-sorted, "
         "100 = i.i.d.).",
         lambda ctx: partition.similarity_split(np.arange(20) % 2, 4, similarity=150, seed=0)),
    Case("shards", "more shards than examples", "partition.shard_split", ValueError,
         "more shards than examples: 4 clients * 3 shards = 12 shards but only 10 examples.",
         lambda ctx: partition.shard_split(np.arange(10) % 2, 4, shards_per_client=3)),
    Case("labels-not-integers", "float labels", "partition.dirichlet_split", ValueError,
         "labels must be integers, got dtype float64.",
         lambda ctx: partition.dirichlet_split(np.linspace(0, 1, 8), 2, alpha=1.0, seed=0)),
    # ----- the run loop
    Case("num-rounds-zero", "num_rounds < 1", "Simulation.run", ValueError,
         "num_rounds = 0 is invalid: it must be >= 1.",
         lambda ctx: run(ctx, num_rounds=0)),
    Case("num-rounds-fraction", "num_rounds = 2.5", "Simulation.run", ValueError,
         "num_rounds = 2.5 is invalid: it must be an integer >= 1.",
         lambda ctx: run(ctx, num_rounds=2.5)),
    Case("eval-every-zero", "eval_every < 1", "Simulation.run", ValueError,
         "eval_every = 0 is invalid: it must be >= 1.",
         lambda ctx: run(ctx, eval_every=0)),
    Case("seed", "a seed that is not an integer", "Simulation.run", ValueError,
         "seed = 1.5 is invalid: it must be an integer >= 0.",
         lambda ctx: run(ctx, seed=1.5)),
    # ----- checkpoints
    Case("checkpoint-every-zero", "checkpoint_every < 1", "Simulation.run", ValueError,
         "checkpoint_every = 0 is invalid: it must be >= 1.",
         lambda ctx: run(ctx, checkpoint_dir=ctx.tmp / "new", checkpoint_every=0)),
    Case("checkpoint-every-without-dir", "checkpoint_every without checkpoint_dir",
         "Simulation.run", ValueError,
         "checkpoint_every = 5 was given without a checkpoint_dir to save in.",
         lambda ctx: run(ctx, checkpoint_every=5)),
    Case("keep-zero", "keep_checkpoints < 1", "Simulation.run", ValueError,
         "keep_checkpoints = 0 is invalid: it must be >= 1.",
         lambda ctx: run(ctx, checkpoint_dir=ctx.tmp / "new", keep_checkpoints=0)),
    Case("resume-without-dir", "resume=True without checkpoint_dir", "Simulation.run",
         ValueError,
         "resume=True needs the checkpoint_dir to resume from.",
         lambda ctx: run(ctx, resume=True)),
    Case("resume-and-state", "resume=True and state= together", "Simulation.run",
         ValueError,
         "pass either state= (continue from a state in memory) or resume=True (continue from "
         "the checkpoint), not both.",
         lambda ctx: resume(ctx, state=simulation(ctx).init(ctx.data))),
    Case("resume-no-checkpoint", "resume from an empty directory", "Simulation.run",
         FileNotFoundError,
         "no checkpoint to restore in {tmp}/empty.",
         lambda ctx: run(ctx, checkpoint_dir=ctx.tmp / "empty", resume=True)),
    Case("directory-in-use", "a fresh run into a directory holding checkpoints",
         "Simulation.run", ValueError,
         "checkpoint_dir {tmp}/ckpt already holds checkpoints (the newest at round 2); pass "
         "resume=True to continue that run or use an empty directory.",
         lambda ctx: run(ctx, checkpoint_dir=ctx.ckpt_dir)),
    Case("resume-other-shape", "resume with another number of clients (shapes differ)",
         "Simulation.run", ValueError,
         "checkpoint {tmp}/ckpt/2 does not match this simulation: .clients.control['linear']"
         "['bias'] is float32(7, 3) in the checkpoint but float32(6, 3) here; "
         ".clients.control['linear']['kernel'] is float32(7, 3, 5) in the checkpoint but "
         "float32(6, 3, 5) here. It was written by a run with another model, number of "
         "clients, algorithm or execution; resume with the same configuration or use another "
         "checkpoint directory.",
         lambda ctx: resume(ctx, data=sj.from_client_arrays(clients(sizes=(2, 9, 5, 13, 3, 7))))),
    Case("resume-other-run", "resume with another step size and seed", "Simulation.run",
         ConfigError,
         "cannot resume from {tmp}/ckpt/2: it belongs to a different run (seed: 0 in the "
         "checkpoint, 1 now; hparams: (client_lr=0.1, server_lr=1.0) in the "
         "checkpoint, (client_lr=0.2, server_lr=1.0) now). Resume with the same "
         "algorithm, data, batch plan, S, weighting, hparams and seed, or start a new run in "
         "another checkpoint directory.",
         lambda ctx: resume(ctx, hp=sj.hparams(0.2), seed=1)),
    Case("resume-past-end", "resume with num_rounds below the checkpoint's round",
         "Simulation.run", ConfigError,
         "the checkpoint is at round 2, past the end of this run (round 1 = 0 + num_rounds "
         "1); pass a larger num_rounds.",
         lambda ctx: resume(ctx, num_rounds=1)),
    Case("checkpoint-corrupt", "every checkpoint corrupt", "Simulation.run",
         checkpoint.CheckpointError,
         "no readable checkpoint in {tmp}/ckpt: every one is corrupt (round 2: unreadable "
         "metadata: …; round 1: unreadable metadata: …; round 0: unreadable metadata: …).",
         lambda ctx: (corrupt_every_checkpoint(ctx), resume(ctx))),
    Case("checkpoint-same-round", "saving a round that is already saved", "checkpoint.save",
         ValueError,
         "a checkpoint for round 2 already exists in {tmp}/ckpt; checkpoints are never "
         "overwritten.",
         lambda ctx: checkpoint.save(ctx.ckpt_dir, ctx.state_at_2, ctx.key)),
    Case("checkpoint-extra", "a checkpoint extra that is not JSON-able", "checkpoint.save",
         TypeError,
         "checkpoint extra must be JSON-able: Object of type ndarray is not JSON serializable",
         lambda ctx: checkpoint.save(ctx.tmp / "new", ctx.state_at_2, ctx.key,
                                     extra={"a": np.zeros(2)})),
    Case("label-outside-classes", "labels outside [0, C) in in-memory data (C = 3)",
         "Simulation.run", ValueError,
         "labels must be class indices in [0, 3) for this model: label 3 at index 4 of the "
         "clients' examples (1 labels out of range). Remap the labels to 0..2, or build the "
         "model with num_classes > 3.",
         lambda ctx: run(ctx, data=with_label(ctx, 4, 3))),
    Case("negative-test-label", "a negative label in the test set", "Simulation.run",
         ValueError,
         "labels must be class indices in [0, 3) for this model: label -1 at index 0 of the "
         "test set (1 labels out of range). Remap the labels to 0..2.",
         lambda ctx: run(ctx, data=with_label(ctx, 0, -1, field="test"))),
    Case("restore-missing-dir", "restoring from a directory that does not exist",
         "checkpoint.restore_latest", FileNotFoundError,
         "no checkpoint to restore: {tmp}/nowhere is not a directory.",
         lambda ctx: checkpoint.restore_latest(ctx.tmp / "nowhere", ctx.state_at_2)),
    # ----- seeds beyond 32 bits (jax.random.key(2**32) == jax.random.key(0))
    Case("seed-beyond-32-bits", "a seed >= 2**32", "Simulation.run", ValueError,
         "seed = 4294967296 is invalid: it must be <= 4294967295 (jax.random.key keeps only "
         "the low 32 bits: a larger seed repeats a smaller one).",
         lambda ctx: run(ctx, seed=2**32)),
    Case("config-seed-beyond-32-bits", "a config seed >= 2**63", "RunConfig.validate",
         ConfigError,
         "invalid config: seed = 9223372036854775808 is invalid: it must be an integer >= 0 "
         "and <= 4294967295 (jax.random.key keeps only the low 32 bits: a larger seed repeats "
         "a smaller one).",
         lambda ctx: RunConfig(seed=2**63).validate()),
    Case("sweep-seed-beyond-32-bits", "a sweep seed >= 2**32", "sweep.grid", ValueError,
         "seed = 4294967296 is invalid: it must be <= 4294967295 (jax.random.key keeps only "
         "the low 32 bits: a larger seed repeats a smaller one).",
         lambda ctx: sweeps.grid(client_lr=0.1, seeds=[0, 2**32])),
    Case("protocol-seed-beyond-32-bits", "a protocol seed >= 2**32", "paper.fig3_protocol",
         ConfigError,
         "invalid fig3 protocol: seed = 4294967296 is invalid: it must be an integer >= 0 "
         "and <= 4294967295 (jax.random.key keeps only the low 32 bits: a larger seed repeats "
         "a smaller one).",
         lambda ctx: paper.fig3_protocol(quick=True, seed=2**32)),
    # ----- values the move to the device would change silently
    Case("idx-float-labels", "an IDX label file of float32 values", "sources.load_idx_folder",
         ValueError,
         "{tmp}/fmnist/t10k-labels-idx1-ubyte.gz: labels must be integer class indices, got "
         "float32 values (label 1.5 at index 1); store them as integers (IDX type code 0x08, "
         "unsigned bytes).",
         lambda ctx: sources.load_idx_folder(
             idx_folder(ctx, np.array([0, 1.5, 2], np.float32), type_code=0x0D),
             "fashion_mnist", num_classes=10)),
    Case("labels-beyond-int32", "an int64 label >= 2**31", "from_client_arrays", ValueError,
         "the field ['y'] holds 2147483648 at client 1's example 4, outside int32 (the device "
         "stores int64 as int32, where it would wrap); use values in [-2147483648, 2147483647] "
         "(e.g. remap labels to 0..C-1).",
         lambda ctx: sj.from_client_arrays(with_values("y", (4,), 2**31, np.int64))),
    Case("partition-float-indices", "a partition of float indices", "from_partition",
         ValueError,
         "client 0's partition indices are float64 values (e.g. 0.0); indices must be "
         "integers: give each client an integer array of example indices.",
         lambda ctx: sj.from_partition({"x": np.zeros((3, 2))}, [np.array([0.0, 1.7]),
                                                                 np.array([2])])),
    Case("check-partition-float-indices", "a partition of float indices",
         "partition.check_partition", ValueError,
         "client 1's partition indices are float64 values (e.g. 2.5); indices must be "
         "integers.",
         lambda ctx: partition.check_partition([np.array([0, 1]), np.array([2.5])], 3)),
    Case("nan-features", "a NaN feature", "from_client_arrays", ValueError,
         "the field ['x'] holds a non-finite value: nan at client 1's example 3. Features must "
         "be finite (a NaN or Inf makes every run diverge); drop or repair those examples "
         "first (e.g. np.nan_to_num).",
         lambda ctx: sj.from_client_arrays(with_values("x", (3, 2), np.nan))),
    Case("inf-test-features", "an Inf feature in the test set", "from_client_arrays",
         ValueError,
         "the field ['x'] holds a non-finite value: inf at test example 1. Features must be "
         "finite (a NaN or Inf makes every run diverge); drop or repair those examples first "
         "(e.g. np.nan_to_num).",
         lambda ctx: sj.from_client_arrays(clients(), test=with_values("x", (1, 0), np.inf)[1])),
    Case("features-beyond-float32", "a float64 feature beyond float32's range",
         "from_partition", ValueError,
         "the field ['x'] holds a value beyond float32's range (the device stores float64 as "
         "float32): 1e+39 at client 0's example 1, example 2 of the examples passed. Features "
         "must be finite in float32 (a NaN or Inf makes every run diverge); drop or repair "
         "those examples first (e.g. np.nan_to_num).",
         lambda ctx: sj.from_partition({"x": np.array([0.0, 1.0, 1e39])}, [np.array([0, 2]),
                                                                          np.array([1])])),
    # ----- empty test sets ("integer modulo by zero" in the evaluation)
    Case("empty-test-set", "a test set with 0 examples", "from_client_arrays", ValueError,
         "the test set is empty (0 examples): give it at least one example, or pass "
         "test=None to build the data without one.",
         lambda ctx: sj.from_client_arrays(clients(), test=EMPTY_TEST)),
    Case("empty-test-set-in-dataset", "a dataset whose test set has 0 rows", "Simulation.run",
         ValueError,
         "the test set is empty (0 examples): give it at least one example, or build the data "
         "with test=None to run without a held-out evaluation.",
         lambda ctx: run(ctx, data=dataclasses.replace(
             ctx.data, test={k: jnp.asarray(v) for k, v in EMPTY_TEST.items()}))),
    # ----- sizes
    Case("client-table-too-large", "a client table larger than the memory (N = 10**12)",
         "Simulation.run", ValueError,
         "the client table of N = 1000000000000 clients needs 72000000000000 bytes (65.5 TiB), "
         "more than the 1073741824 bytes (1.0 GiB) available on …; one round's chunk of 2 "
         "clients adds … bytes of local work. Use fewer clients N or a smaller model, or split "
         "the table over more devices with a ClientMesh layout (scaffold_jax.layout).",
         lambda ctx: with_memory(2**30, lambda: run(
             ctx, data=dataclasses.replace(ctx.data, num_clients=10**12)))),
    Case("round-work-too-large", "a round's K local steps of batches larger than the memory",
         "Simulation.run", ValueError,
         "one round's local work needs 97176 bytes (94.9 KiB) with the client table, more "
         "than the 90000 bytes (87.9 KiB) available on cpu: each chunk of 2 clients gathers "
         "its K = 1000 local steps' batches at once (94.4 KiB). Use fewer local steps or a "
         "smaller batch size, client_chunk=1, or a smaller model.",
         lambda ctx: with_memory(90_000, lambda: run(
             ctx, sim=simulation(ctx, plan=sj.BatchPlan.fixed(2, 1000))))),
    # ----- step sizes beyond float32 (finite in Python, inf once float32)
    Case("client-lr-beyond-float32", "η_l = 1e39", "hparams", ValueError,
         "client_lr=1e+39 is invalid: hyper-parameters are float32, where it would become inf; "
         "every value must be finite and at most 3.4028235e+38 in magnitude.",
         lambda ctx: sj.hparams(client_lr=1e39)),
    Case("config-client-lr-beyond-float32", "--client-lr 1e39", "RunConfig.validate",
         ConfigError,
         "invalid config: client_lr = 1e+39 is invalid: it must be finite and > 0, and at "
         "most 3.4028235e+38 (the largest float32; the step sizes and hyper-parameters are "
         "float32, where a larger value becomes inf).",
         lambda ctx: RunConfig(client_lr=1e39).validate()),
    # ----- configs and the command line
    Case("data-dir-missing", "a --data-dir that does not exist", "sources.load",
         FileNotFoundError,
         "data_dir {tmp}/nowhere does not exist; pass the folder that holds the IDX files of "
         "fashion_mnist, or leave data_dir unset to search $SCAFFOLD_JAX_DATA_DIR, the system "
         "folders and the cache.",
         lambda ctx: sources.load("fashion_mnist", data_dir=ctx.tmp / "nowhere")),
    Case("out-empty", "--out \"\"", "RunConfig.validate", ConfigError,
         "invalid config: out = '' is invalid: it must be a folder path (an empty one would "
         "write into the working folder); give a folder, or leave out unset for "
         "results/<algorithm>-<dataset>-<digest>.",
         lambda ctx: RunConfig(out="").validate()),
    Case("scaffold-option-list", "scaffold_option = [2] (a list)", "RunConfig.validate",
         ConfigError,
         "invalid config: scaffold_option = [2] is invalid: it must be one of 'I', 'II'.",
         lambda ctx: RunConfig.from_dict({"scaffold_option": [2]}).validate()),
    Case("hparams-not-a-table", "hparams = 0.5 (not a table)", "RunConfig.from_dict",
         ConfigError,
         "hparams = 0.5 is invalid: it must be a table of names and values.",
         lambda ctx: RunConfig.from_dict({"hparams": 0.5})),
    Case("optimizer-name", "an unknown server optimizer", "RunConfig.validate", ConfigError,
         "invalid config: server_optimizer = 'adamw' is invalid: optimizer 'adamw' is "
         "unknown (did you mean 'adam'?); use one of sgd, momentum, adagrad, adam, fedadam, "
         "yogi…",
         lambda ctx: RunConfig(options={"server_optimizer": "adamw"}).validate()),
    Case("optimizer-parameter", "an optimizer parameter it does not take", "optimizers.parse",
         ValueError,
         "optimizer 'momentum:beta=0.9': momentum has no parameter 'beta'; it takes momentum.",
         lambda ctx: sj.optimizers.parse("momentum:beta=0.9")),
    Case("scaffold-local-optimizer", "SCAFFOLD with a local optimizer", "RunConfig.validate",
         ConfigError,
         "invalid config: local_optimizer = 'momentum' does not apply to algorithm = "
         "'scaffold': SCAFFOLD's correction c - c_i is defined for plain SGD local steps…",
         lambda ctx: RunConfig(options={"local_optimizer": "momentum"}).validate()),
    Case("sweep-target", "sweep --target 5", "scaffold-jax sweep", ConfigError,
         "--target = 5 is invalid: it must be a test accuracy in (0, 1], e.g. --target 0.7.",
         lambda ctx: cli._sweep_command(sweep_args("--target", "5"))),
    Case("sweep-grid-undeclared", "sweep --grid over a hyper-parameter no algorithm of the "
         "sweep declares", "scaffold-jax sweep", ConfigError,
         "--grid prox_mu: no algorithm of this sweep (scaffold) declares the hyper-parameter "
         "prox_mu (fedprox does); add one with --algorithms or remove the axis.",
         lambda ctx: cli._sweep_command(sweep_args("--grid", "prox_mu=0.1,1"))),
    Case("sweep-grid-not-a-number", "sweep --grid with a value that is not a number",
         "scaffold-jax sweep", ConfigError,
         "--grid 'server_lr=0.5,big': 'big' is not a number; every value of an axis must be "
         "one (e.g. --grid server_lr=0.5,1).",
         lambda ctx: cli._sweep_command(sweep_args("--grid", "server_lr=0.5,big"))),
    Case("sweep-grid-empty", "sweep --grid with no values", "scaffold-jax sweep", ConfigError,
         "--grid 'server_lr=' has no values: list at least one after '=' (e.g. --grid "
         "server_lr=0.5,1).",
         lambda ctx: cli._sweep_command(sweep_args("--grid", "server_lr="))),
    Case("sweep-grid-seed", "sweep --grid over the seed", "scaffold-jax sweep", ConfigError,
         "--grid seed: seed is not an axis of a sweep: the run seeds are --seeds; --grid "
         "partition_seed=... re-partitions the data.",
         lambda ctx: cli._sweep_command(sweep_args("--grid", "seed=0,1"))),
    # ----- step sizes below float32's smallest normal (> 0 in Python, 0 once float32)
    Case("client-lr-underflows-float32", "η_l = 1e-50", "hparams", ValueError,
         "client_lr=1e-50 underflows float32 (smallest normal 1.2e-38): hyper-parameters are "
         "float32, where it would become 0 or a subnormal; every nonzero value must be at least "
         "1.1754944e-38 in magnitude.",
         lambda ctx: sj.hparams(client_lr=1e-50)),
    Case("server-lr-subnormal-float32", "η_g = 1e-45 (a float32 subnormal)", "hparams",
         ValueError,
         "server_lr=1e-45 underflows float32 (smallest normal 1.2e-38): hyper-parameters are "
         "float32, where it would become 0 or a subnormal; every nonzero value must be at least "
         "1.1754944e-38 in magnitude.",
         lambda ctx: sj.hparams(client_lr=0.1, server_lr=1e-45)),
    Case("mu-underflows-float32", "FedProx μ = 1e-40 (0 is allowed, 1e-40 is not)", "hparams",
         ValueError,
         "prox_mu=1e-40 underflows float32 (smallest normal 1.2e-38): hyper-parameters are "
         "float32, where it would become 0 or a subnormal; every nonzero value must be at least "
         "1.1754944e-38 in magnitude.",
         lambda ctx: sj.hparams(client_lr=0.1, prox_mu=1e-40)),
    Case("config-client-lr-underflows-float32", "--client-lr 1e-50", "RunConfig.validate",
         ConfigError,
         "invalid config: client_lr = 1e-50 underflows float32 (smallest normal 1.2e-38): "
         "the step sizes and hyper-parameters are float32, where it would become 0; it must be "
         "finite and > 0, and at least 1.1754944e-38.",
         lambda ctx: RunConfig(client_lr=1e-50).validate()),
    Case("config-mu-underflows-float32", "--prox-mu 1e-40", "RunConfig.validate", ConfigError,
         "invalid config: prox_mu = 1e-40 underflows float32 (smallest normal 1.2e-38): the "
         "step sizes and hyper-parameters are float32, where it would become 0; it must be "
         "finite and >= 0, and 0 or at least 1.1754944e-38.",
         lambda ctx: RunConfig(algorithm="fedprox", prox_mu=1e-40).validate()),
    # ----- plans of too many local steps K (they ended in XLA out-of-memory tracebacks)
    Case("K-too-many", "K = 10**9 local steps", "BatchPlan.fixed", ValueError,
         f"num_local_steps (K) = 1000000000 is invalid: {TOO_MANY}; use fewer.",
         lambda ctx: sj.BatchPlan.fixed(batch_size=2, num_steps=10**9)),
    Case("fraction-makes-K-too-many", "batch fraction = 1e-9 (K = 10**9)",
         "BatchPlan.fraction_of_data", ValueError,
         "batch fraction = 1e-09 with num_epochs = 1 makes K = 1000000000 local steps per round "
         f"(num_epochs * round(1 / fraction)); {TOO_MANY}. Use a larger fraction or fewer epochs.",
         lambda ctx: sj.BatchPlan.fraction_of_data(1e-9, num_epochs=1)),
    Case("epochs-make-K-too-many", "10**8 local epochs", "BatchPlan.epochs", ValueError,
         "num_epochs = 100000000 is invalid: it makes K >= 100000000 local steps per round; "
         f"{TOO_MANY}. Use fewer epochs.",
         lambda ctx: sj.BatchPlan.epochs(batch_size=2, num_epochs=10**8)),
    Case("epochs-K-from-the-data", "batches of 1 over a client of 10**6 examples, 2 epochs",
         "BatchPlan.shape", ValueError,
         "batch_size = 1 with num_epochs = 2 makes K = 2000000 local steps per round for the "
         f"largest client (1000000 examples: num_epochs * ceil(n / batch_size)); {TOO_MANY}. Use a "
         "larger batch_size or fewer epochs.",
         lambda ctx: sj.BatchPlan.epochs(batch_size=1, num_epochs=2).shape(10**6)),
    Case("config-local-steps-too-many", "--local-steps 1000000000", "RunConfig.validate",
         ConfigError,
         "invalid config: local_steps = 1000000000 (batch_plan = 'full'): num_local_steps (K) "
         f"= 1000000000 is invalid: {TOO_MANY}; use fewer.",
         lambda ctx: RunConfig(local_steps=10**9).validate()),
    Case("config-local-epochs-too-many", "--local-epochs 100000000", "RunConfig.validate",
         ConfigError,
         "invalid config: batch_fraction = 0.2, local_epochs = 100000000 (batch_plan = "
         "'fraction'): batch fraction = 0.2 with num_epochs = 100000000 makes K = 500000000 "
         f"local steps per round (num_epochs * round(1 / fraction)); {TOO_MANY}. Use a larger "
         "fraction or fewer epochs.",
         lambda ctx: RunConfig(local_epochs=10**8).validate()),
    Case("config-rounds-too-many", "--rounds 2000000000 (it hung before compiling)",
         "RunConfig.validate", ConfigError,
         "invalid config: rounds = 2000000000 is invalid: it must be an integer >= 1 and <= "
         "10000000 (every round's metrics and sampled clients are kept in memory, and the blocks "
         "of rounds are planned before compiling).",
         lambda ctx: RunConfig(rounds=2_000_000_000).validate()),
    # ----- optimizer parameters outside their ranges
    Case("optimizer-decay-above-1", "adam:b1=2", "optimizers.parse", ValueError,
         "optimizer 'adam:b1=2': b1 = 2.0 is invalid: it must be a number in [0, 1).",
         lambda ctx: sj.optimizers.parse("adam:b1=2")),
    Case("optimizer-decay-1", "adam:b2=1 (bias correction divides by 0)", "optimizers.parse",
         ValueError,
         "optimizer 'adam:b2=1': b2 = 1.0 is invalid: it must be a number in [0, 1).",
         lambda ctx: sj.optimizers.parse("adam:b2=1")),
    Case("optimizer-momentum-negative", "momentum:momentum=-0.5", "optimizers.parse",
         ValueError,
         "optimizer 'momentum:momentum=-0.5': momentum = -0.5 is invalid: it must be a number "
         "in [0, 1).",
         lambda ctx: sj.optimizers.parse("momentum:momentum=-0.5")),
    Case("optimizer-tau-zero", "fedadam:tau=0 (it diverged, blaming the step sizes)",
         "optimizers.parse", ValueError,
         "optimizer 'fedadam:tau=0': tau = 0.0 is invalid: it must be a number > 0, at least "
         "1.1754944e-38 (the smallest normal float32).",
         lambda ctx: sj.optimizers.parse("fedadam:tau=0")),
    Case("optimizer-accumulator-negative", "adagrad:initial_accumulator=-1",
         "optimizers.parse", ValueError,
         "optimizer 'adagrad:initial_accumulator=-1': initial_accumulator = -1.0 is invalid: it "
         "must be a number >= 0.",
         lambda ctx: sj.optimizers.parse("adagrad:initial_accumulator=-1")),
    Case("optimizer-parameter-twice", "adam:b1=0.5,b1=0.6", "optimizers.parse", ValueError,
         "optimizer 'adam:b1=0.5,b1=0.6': b1 is given twice; give it once.",
         lambda ctx: sj.optimizers.parse("adam:b1=0.5,b1=0.6")),
    Case("config-optimizer-tau-zero", "--server-optimizer fedadam:tau=0", "RunConfig.validate",
         ConfigError,
         "invalid config: server_optimizer = 'fedadam:tau=0' is invalid: optimizer "
         "'fedadam:tau=0': tau = 0.0 is invalid: it must be a number > 0, at least "
         "1.1754944e-38 (the smallest normal float32).",
         lambda ctx: RunConfig(options={"server_optimizer": "fedadam:tau=0"}).validate()),
    # ----- a given data_dir is used or refused, never searched past
    Case("data-dir-without-files", "a --data-dir without the dataset's files", "sources.load",
         FileNotFoundError,
         "data_dir {tmp} lacks the IDX files of fashion_mnist: missing "
         "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] "
         "or test-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] or "
         "test-labels-idx1-ubyte[.gz] (gzipped or raw) (also looked in {tmp}/fashion_mnist, "
         f"{{tmp}}/fashion-mnist); put them there, {UNSET}",
         lambda ctx: sources.load("fashion_mnist", data_dir=ctx.tmp)),
    Case("data-dir-train-only", "a --data-dir with the training files only", "sources.load",
         FileNotFoundError,
         "data_dir {tmp}/fmnist lacks the IDX files of fashion_mnist: missing "
         "t10k-images-idx3-ubyte[.gz] or test-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz] "
         "or test-labels-idx1-ubyte[.gz] (gzipped or raw) (also looked in "
         f"{{tmp}}/fmnist/fashion_mnist, {{tmp}}/fmnist/fashion-mnist); put them there, {UNSET}",
         lambda ctx: sources.load("fashion_mnist", data_dir=train_only_idx_folder(ctx))),
    Case("data-dir-no-idx-distribution", "a --data-dir for CIFAR-10 (TFDS only)",
         "sources.load", FileNotFoundError,
         "data_dir {tmp} was given, but cifar10 has no IDX files to read from a folder; leave "
         "data_dir unset to load it from the .npz cache or TFDS (download=True / --download "
         "fetches it).",
         lambda ctx: sources.load("cifar10", data_dir=ctx.tmp)),
    Case("femnist-without-test-split", "a FEMNIST folder without test/", "femnist.load",
         FileNotFoundError,
         "{tmp}/leaf/test does not exist: FEMNIST's test split (LEAF's test/*.json) belongs "
         "beside the training split {tmp}/leaf/train. Put it there, or pass --data-dir "
         "(data_dir) a folder that holds both splits.",
         lambda ctx: femnist.load(leaf_train_only(ctx), use_cache=False)),
    Case("femnist-garbage-h5", "a FEMNIST .h5 file that is not HDF5", "femnist.load",
         ValueError,
         "{tmp}/fem/fed_emnist_train.h5 is not a readable HDF5 file (…): it is corrupt or "
         "truncated; replace it with TFF's file (download it again).",
         lambda ctx: femnist.load(garbage_h5_folder(ctx), use_cache=False)),
    # ----- config files, types and sweeps
    Case("config-file-directory", "--config DIR (a directory)", "load_config_file",
         ConfigError,
         "config file {tmp} is a directory; give a .toml or .json file.",
         lambda ctx: load_config_file(ctx.tmp)),
    Case("config-json-key-twice", "a JSON config that gives a key twice", "load_config_file",
         ConfigError,
         "config file {tmp}/dup.json gives the key 'rounds' twice (2, then 3); give each key "
         "once.",
         lambda ctx: load_config_file(json_with_a_repeated_key(ctx))),
    Case("config-field-wrong-type", "model = [\"mlp\"] (a list for a name), with "
         "state_policy", "RunConfig.validate", ConfigError,
         "invalid config: state_policy = 'local' does not apply to this config; remove it "
         "or set model = 'resnet18'. state_policy = 'local' applies to a model with running "
         "statistics (resnet18 with resnet_norm = 'batch', or a plugin model that takes "
         "state_policy); model = ['mlp'] keeps none. model = ['mlp'] is invalid: it must be "
         "one of 'logreg', 'mlp', 'cnn', 'resnet18', 'char_lstm' (did you mean 'mlp'?).",
         lambda ctx: RunConfig.from_dict({"model": ["mlp"], "state_policy": "local"}).validate()),
    Case("sweep-seeds-repeated", "sweep --seeds 0 1 0", "experiments.sweep", ConfigError,
         "--seeds repeats 0: give each seed once (a repeated seed is the same run counted "
         "twice, which shrinks the spread over seeds).",
         lambda ctx: experiments.sweep(RunConfig(), seeds=[0, 1, 0])),
    Case("sweep-grid-seed-repeated", "sweep.grid with seeds [0, 0]", "sweep.grid", ValueError,
         "the grid axis seed repeats 0; give each value once.",
         lambda ctx: sj.sweep.grid([0.1], seeds=[0, 0])),
    Case("api-rounds-too-many", "Simulation.run with num_rounds = 2e9", "Simulation.run",
         ValueError,
         "num_rounds = 2000000000 is invalid: it must be <= 10000000 (every round's metrics "
         "and sampled clients are kept in memory, and the blocks of rounds are planned before "
         "compiling).",
         lambda ctx: run(ctx, sim=ctx.sim, num_rounds=2_000_000_000)),
    Case("sweep-algorithms-repeated", "sweep --algorithms scaffold scaffold",
         "scaffold-jax sweep", ConfigError,
         "--algorithms repeats scaffold: give each algorithm once.",
         lambda ctx: cli._sweep_command(sweep_args("--algorithms", "scaffold", "scaffold"))),
    # ----- paper protocols
    Case("protocol-dim-beyond-memory", "reproduce fig3 --set dim=100000 (1 GiB available)",
         "paper.fig3_protocol", ConfigError,
         "invalid fig3 protocol: dim=100000 with num_clients=2 needs 480000000000 bytes "
         "(447.0 GiB) of host memory for the clients' d x d Hessians, in float64, more than the "
         "1073741824 bytes (1.0 GiB) available; use a smaller dim.",
         lambda ctx: with_memory(2**30, lambda: paper.fig3_protocol(quick=True, dim=100_000))),
    Case("protocol-local-steps-too-many", "reproduce fig3 --set local_steps=[2,1000000]",
         "paper.fig3_protocol", ConfigError,
         "invalid fig3 protocol: local_steps = (2, 1000000) is invalid: it must be a "
         "non-empty list of integers in [1, 100000].",
         lambda ctx: paper.fig3_protocol(quick=True, local_steps=[2, 10**6])),
    Case("protocol-field-wrong-type", "reproduce table3 --set similarities=5 (not a list)",
         "TableProtocol.validate", ConfigError,
         "invalid table3 protocol: similarities = 5 is invalid: it must be a non-empty list "
         "of percentages in [0, 100].",
         lambda ctx: paper.table3_protocol(quick=True, similarities=5).validate()),
    Case("quadratic-dim-beyond-memory", "a quadratic of dim 100000 (1 GiB available)",
         "synthetic.quadratic_problem", ValueError,
         "dim=100000 with num_clients=2 needs 480000000000 bytes (447.0 GiB) of host memory for "
         "the clients' d x d Hessians, in float64, more than the 1073741824 bytes (1.0 GiB) "
         "available; use a smaller dim.",
         lambda ctx: with_memory(2**30, lambda: synthetic.quadratic_problem(
             2, 100_000, beta=1.0, delta=0.3, G=1.0, mu=0.1))),
    # Found by tests/test_fuzz.py: N = 2**31 clients allocated 72 GiB before any check.
    Case("config-num-clients-beyond-int32", "--num-clients 2147483648", "RunConfig.validate",
         ConfigError,
         "invalid config: num_clients = 2147483648 is invalid: it must be an integer in "
         "[1, 2147483647] (client ids are int32).",
         lambda ctx: RunConfig(dataset="synthetic", num_clients=2**31).validate()),
    Case("synthetic-clients-beyond-memory", "Synthetic(α, β) with 10⁹ clients (1 GiB available)",
         "synthetic.synthetic_alpha_beta", ValueError,
         "num_clients=1000000000 with dim=60 needs 308000000000 bytes (286.8 GiB) of host memory "
         "for at least 1000000000 examples of 60 float32 features, more than the 1073741824 "
         "bytes (1.0 GiB) available; use fewer clients (or procedural_synthetic, which keeps "
         "none).",
         lambda ctx: with_memory(2**30, lambda: synthetic.synthetic_alpha_beta(
             10**9, alpha=1.0, beta=1.0))),
    Case("procedural-clients-beyond-memory",
         "procedural Synthetic(α, β) with 10⁹ clients (1 GiB available)",
         "synthetic.procedural_synthetic", ValueError,
         "num_clients=1000000000 needs 36000000000 bytes (33.5 GiB) of host memory for the "
         "clients' sizes, more than the 1073741824 bytes (1.0 GiB) available; use fewer "
         "clients.",
         lambda ctx: with_memory(2**30, lambda: synthetic.procedural_synthetic(
             10**9, alpha=1.0, beta=1.0))),
    # User-level differential privacy (scaffold_jax.privacy).
    Case("dp-epsilon-zero", "--dp-epsilon 0", "RunConfig.validate", ConfigError,
         "invalid config: dp_epsilon = 0.0 is invalid: it must be a number > 0.",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=0.0).validate()),
    Case("dp-delta-one", "--dp-delta 1", "RunConfig.validate", ConfigError,
         "invalid config: privacy = 'gaussian': dp_delta = 1.0 is invalid: it must be in "
         "(0, 1).",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=3.0, dp_delta=1.0).validate()),
    Case("dp-infinite-cohort", "a private run's config file with clients_per_round: Infinity",
         "RunConfig.validate", ConfigError,
         "invalid config: clients_per_round = inf is invalid: it must be an integer in "
         "[1, num_clients = 50].",
         lambda ctx: RunConfig(**DP_RUN, clients_per_round=math.inf, dp_clip=1.0,
                               dp_noise_multiplier=1.0).validate()),
    Case("dp-no-noise", "--dp-clip 1 without a noise multiplier or a target epsilon",
         "RunConfig.resolved_hparams", ConfigError,
         "a private run needs its noise: give dp_noise_multiplier (--dp-noise-multiplier Z) or "
         "a target dp_epsilon (--dp-epsilon E, calibrated for the planned rounds).",
         lambda ctx: RunConfig(**DP_RUN, dp_clip=1.0).validate().resolved_hparams()),
    Case("dp-epsilon-and-noise", "--dp-epsilon 3 --dp-noise-multiplier 1",
         "RunConfig.resolved_hparams", ConfigError,
         "dp_epsilon = 3.0 and dp_noise_multiplier = 1.0 are both set: give one of them (the "
         "noise multiplier is calibrated from the target epsilon).",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=3.0,
                               dp_noise_multiplier=1.0).validate().resolved_hparams()),
    Case("dp-epsilon-out-of-reach", "--dp-epsilon 1e-6 --dp-delta 1e-10 (10 rounds)",
         "RunConfig.resolved_hparams", ConfigError,
         "dp_epsilon = 1e-06 at delta = 1e-10 after 10 rounds (sampling rate 0.2) is out of "
         "reach: it would need a noise multiplier of about 2.89e+08, above 1000 (epsilon there "
         "is 0.289). Use fewer rounds, a larger epsilon or delta, or a smaller sampling rate "
         "(fewer clients_per_round or more num_clients).",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=1e-6,
                               dp_delta=1e-10).validate().resolved_hparams()),
    Case("dp-pld-fixed-size", "--dp-accountant pld with the uniform (fixed-size) sampler",
         "RunConfig.validate", ConfigError,
         "invalid config: privacy = 'gaussian': accountant = 'pld' does not cover sampling "
         "= 'fixed_size' (sampling without replacement, replace-one adjacency): use accountant "
         "= 'rdp', or the poisson sampler (sampler = 'poisson').",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=3.0, dp_accountant="pld").validate()),
    Case("dp-weighted", "--weighting num_examples with DP", "RunConfig.validate", ConfigError,
         "invalid config: privacy = 'gaussian': differential privacy needs weighting = "
         "'uniform', not 'num_examples': weights of n_i make one client's share of the sum "
         "unbounded and reveal its size.",
         lambda ctx: RunConfig(**DP_RUN, dp_noise_multiplier=1.0,
                               weighting="num_examples").validate()),
    Case("dp-fednova", "FedNova made private", "privacy.private", ValueError,
         "fednova cannot be made differentially private here: its server reads each client's "
         "output on its own (FedNova divides each Δy_i by its own step count, FedExP reads each "
         "‖Δy_i‖²), not only their sum, which is all a noised aggregate releases. Use fedavg, "
         "fedprox, scaffold, feddyn, mime or mimelite.",
         lambda ctx: sj.privacy.private(sj.fednova(ctx.problem.loss_fn))),
    Case("dp-private-twice", "an algorithm made private twice", "privacy.private", ValueError,
         "fedavg is private already: wrap an algorithm once.",
         lambda ctx: sj.privacy.private(sj.privacy.private(sj.fedavg(ctx.problem.loss_fn)))),
    Case("dp-count-noise-too-small", "adaptive clipping with 2 sigma_b <= z",
         "accounting.update_noise_multiplier", ValueError,
         "count noise sigma_b = 0.25 is too small for dp_noise_multiplier = 1.0: adaptive "
         "clipping needs 2*sigma_b > z; raise the count noise or lower z.",
         lambda ctx: sj.privacy.accounting.update_noise_multiplier(1.0, 0.25)),
    Case("poisson-bound-too-small", "--poisson-bound 12 for S = 10 of N = 1000",
         "sampling.poisson_bound", ValueError,
         "poisson_bound = 12 is too small for an expected cohort of S = 10 of N = 1000: a round "
         "overflows it with probability 2.1e-01 (> 1e-09), and an overflowing round would drop "
         "sampled clients. Use poisson_bound >= 34, or leave it unset (the default bound).",
         lambda ctx: sj.sampling.poisson_bound(1000, 10, 12)),
    # Participation models (scaffold_jax.participation).
    Case("markov-short-off-spells", "--availability markov --availability-rate 0.8 "
         "--mean-on-rounds 2", "RunConfig.validate", ConfigError,
         "invalid config: availability_rate = 0.8 with mean_on_rounds = 2.0 asks for "
         "unavailable spells shorter than one round (mean 0.5): use mean_on_rounds >= 4, or a "
         "lower availability_rate.",
         lambda ctx: RunConfig(**DP_RUN, availability="markov", availability_rate=0.8,
                               mean_on_rounds=2.0).validate()),
    Case("cyclic-uneven-blocks", "--availability cyclic --cycle-groups 4 --cycle-rounds 10",
         "RunConfig.validate", ConfigError,
         "invalid config: cycle_rounds = 10 does not split into cycle_groups = 4 equal "
         "blocks: use a multiple of 4 (e.g. 8).",
         lambda ctx: RunConfig(**DP_RUN, availability="cyclic", cycle_groups=4,
                               cycle_rounds=10).validate()),
    Case("cyclic-empty-groups", "--cycle-groups 64 for N = 50 clients", "RunConfig.validate",
         ConfigError,
         "invalid config: cycle_groups = 64 exceeds the number of clients N = 50: some "
         "groups would be empty. Use cycle_groups <= N.",
         lambda ctx: RunConfig(**DP_RUN, availability="cyclic", cycle_groups=64).validate()),
    Case("trace-no-path", "--availability trace without a file", "RunConfig.validate",
         ConfigError,
         "invalid config: availability = 'trace' needs availability_trace = PATH (command "
         "line: --availability-trace PATH), the file of the clients' availability bits.",
         lambda ctx: RunConfig(**DP_RUN, availability="trace").validate()),
    Case("trace-missing", "--availability-trace of a file that does not exist",
         "RunConfig.validate", ConfigError,
         "invalid config: availability_trace = '{tmp}/devices.txt': no such file. Give the "
         "path of a trace (.npy [clients, rounds] of 0/1, or text: one line of 0/1 per "
         "client).",
         lambda ctx: RunConfig(**DP_RUN, availability="trace",
                               availability_trace=str(ctx.tmp / "devices.txt")).validate()),
    Case("trace-too-few-clients", "a trace of 3 clients for N = 7", "Simulation.run",
         ValueError,
         "the availability trace {tmp}/three.txt has 3 clients (rows) but the run has N = 7: "
         "give a trace with a row for every client, or fewer clients.",
         lambda ctx: run(ctx, sim=simulation(ctx, participation=sj.participation.make(
             "trace", options={"availability_trace": str(write(ctx.tmp / "three.txt",
                                                               b"0110\n1100\n0011\n"))})))),
    Case("dropout-rate-without-model", "--dropout-rate 0.3 without --dropouts bernoulli",
         "RunConfig.validate", ConfigError,
         "invalid config: dropout_rate = 0.3 does not apply to dropouts = 'none'; remove it "
         "or set dropouts = 'bernoulli'.",
         lambda ctx: RunConfig(**DP_RUN, dropout_rate=0.3).validate()),
    Case("dp-with-dropouts", "a private run with --dropouts bernoulli", "RunConfig.validate",
         ConfigError,
         "invalid config: privacy = 'gaussian': differential privacy's accounting assumes "
         "every sampled client is drawn by the sampler alone and reaches the server; with "
         "dropouts = 'bernoulli' who takes part changes in a way no accountant here covers: "
         "use availability = 'always' and dropouts = 'none' for a private run (stragglers are "
         "fine: clipping bounds any update).",
         lambda ctx: RunConfig(**DP_RUN, dropouts="bernoulli",
                               dp_noise_multiplier=1.0).validate()),
    # Issue 40: settings that cannot mean what the user wants, and trace files that were
    # not named.
    Case("dropout-rate-one", "--dropouts bernoulli --dropout-rate 1 (no update ever arrives)",
         "RunConfig.validate", ConfigError,
         f"invalid config: dropout_rate = 1.0 is invalid: it must be {DROPOUT_RATE}.",
         lambda ctx: RunConfig(**DP_RUN, dropouts="bernoulli", dropout_rate=1.0).validate()),
    Case("dropout-rate-one-api", "Bernoulli dropouts of rate 1", "participation.make",
         ValueError, f"dropout_rate = 1.0 is invalid: it must be {DROPOUT_RATE}.",
         lambda ctx: sj.participation.make(dropouts="bernoulli",
                                           options={"dropout_rate": 1.0})),
    Case("trace-all-zeros", "an availability trace of zeros only (0 participants every round)",
         "RunConfig.validate", ConfigError,
         "invalid config: the availability trace {tmp}/zeros.txt makes no client available in "
         "any round (every bit of its first 50 rows, the run's N clients, is 0): every round "
         "would have 0 participants and the model would never train. Mark each client's "
         "available rounds with 1 (rounds with none available are fine).",
         lambda ctx: RunConfig(**DP_RUN, availability="trace", availability_trace=str(
             write(ctx.tmp / "zeros.txt", b"0000\n" * 50))).validate()),
    Case("straggler-min-steps-above-K", "--stragglers uniform --straggler-min-steps 1000 with "
         "a plan of 5 steps (it was capped silently)", "RunConfig.validate", ConfigError,
         "invalid config: straggler_min_steps = 1000 exceeds K = 5, the most local steps the "
         "plan gives a client: every client would complete all its steps (k_min is capped at "
         "K), so none would straggle. Use straggler_min_steps <= 5, or a plan of more local "
         "steps.",
         lambda ctx: RunConfig(**DP_RUN, stragglers="uniform",
                               straggler_min_steps=1000).validate()),
    Case("straggler-min-steps-above-K-api", "uniform stragglers of k_min = 2 with K = 1",
         "Simulation.run", ValueError,
         "straggler_min_steps = 2 exceeds K = 1, the most local steps the plan gives a client: "
         "every client would complete all its steps (k_min is capped at K), so none would "
         "straggle. Use straggler_min_steps <= 1, or a plan of more local steps.",
         lambda ctx: run(ctx, sim=simulation(ctx, participation=sj.participation.make(
             stragglers="uniform", options={"straggler_min_steps": 2})))),
    Case("dp-epsilon-below-resolution", "--dp-epsilon 1e-300 (met by epsilon 0, reported far "
         "above it once z was rounded to float32)", "RunConfig.resolved_hparams", ConfigError,
         "dp_epsilon = 1e-300 at delta = 0.0135 after 10 rounds (sampling rate 0.2) is below "
         "what the accountant resolves: its epsilon is already 0 at a noise multiplier of "
         "117.033 (delta alone bounds the privacy loss there), so such a target does not set "
         "the noise. Use dp_epsilon >= 3e-06, or a smaller delta.",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=1e-300).validate().resolved_hparams()),
    Case("dp-delta-above-one-over-N", "--dp-delta 0.5 for N = 50 (it was a Python warning)",
         "RunConfig.validate", ConfigError,
         "invalid config: privacy = 'gaussian': dp_delta = 0.5 >= 1/N = 2.0e-02 (N = 50 "
         "clients) is no privacy: a delta of 1/N or more lets a mechanism publish one client's "
         "data outright. Use delta < 1/N, e.g. N^-1.1 = 1.4e-02 (the default).",
         lambda ctx: RunConfig(**DP_RUN, dp_epsilon=3.0, dp_delta=0.5).validate()),
    Case("dp-delta-above-one-over-N-api", "privacy.private(..., delta=0.5) for N = 7",
         "Simulation.run", ValueError,
         "dp_delta = 0.5 >= 1/N = 1.4e-01 (N = 7 clients) is no privacy: a delta of 1/N or "
         "more lets a mechanism publish one client's data outright. Use delta < 1/N, e.g. "
         "N^-1.1 = 1.2e-01 (the default).",
         lambda ctx: run(ctx, sim=simulation(ctx, algorithm=sj.privacy.private(
             sj.fedavg(ctx.problem.loss_fn), delta=0.5)),
             hp=sj.hparams(0.1, dp_clip=1.0, dp_noise_multiplier=1.0))),
    Case("model-beyond-memory", "--model mlp --hidden-sizes 500000 with 64 MiB available (it "
         "aborted in XLA under a memory limit)", "models.build", ValueError,
         "model = 'mlp' with hidden_sizes = [500000]: MLP's 35500010 parameters need 502000040 "
         "bytes (478.7 MiB) of … memory to be initialised (142000040 for their values, 3x the "
         "largest weight's for its random draw), more than the 67108864 bytes (64.0 MiB) "
         "available; use a smaller model.",
         lambda ctx: with_memory(2**26, lambda: sj.models.build(
             "mlp", (60,), 10, key=ctx.key, options={"hidden_sizes": [500_000]}))),
    Case("trace-empty", "an empty availability trace (it said \"cannot reshape array\")",
         "participation.load_trace", ValueError,
         "the availability trace {tmp}/empty.txt holds no clients: it is empty, or only blank "
         "lines and # comments. Write one line per client of its rounds' 0/1 (0110, or "
         "0 1 1 0), or save a [clients, rounds] array of 0/1 as NAME.npy.",
         lambda ctx: sj.participation.load_trace(write(ctx.tmp / "empty.txt", b""))),
    Case("trace-blank", "an availability trace of blank lines and comments",
         "participation.load_trace", ValueError,
         "the availability trace {tmp}/blank.txt holds no clients: it is empty, or only blank "
         "lines and # comments. Write one line per client of its rounds' 0/1 (0110, or "
         "0 1 1 0), or save a [clients, rounds] array of 0/1 as NAME.npy.",
         lambda ctx: sj.participation.load_trace(write(ctx.tmp / "blank.txt",
                                                       b"\n   \n# devices\n"))),
    Case("trace-binary", "a binary availability trace (it raised a codec error)",
         "participation.load_trace", ValueError,
         "the availability trace {tmp}/trace.bin is not text (its byte 1 is not UTF-8: a "
         "binary file?) and its name does not end in .npy. Give a text file of one line of 0/1 "
         "per client, or a [clients, rounds] array of 0/1 saved with numpy.save as NAME.npy.",
         lambda ctx: sj.participation.load_trace(write(ctx.tmp / "trace.bin", b"\x00\xff\x93"))),
    Case("trace-npy-bad-header", "a .npy trace with a damaged header",
         "participation.load_trace", ValueError,
         "the availability trace {tmp}/trace.npy is a damaged .npy file: numpy cannot read its "
         "header or data (…). Save a [clients, rounds] array of 0/1 with numpy.save, or give a "
         "text trace (one line of 0/1 per client) under a name that does not end in .npy.",
         lambda ctx: sj.participation.load_trace(write(ctx.tmp / "trace.npy",
                                                       b"\x93NUMPY\x01\x00garbage"))),
    Case("trace-npy-not-npy", "a text file named .npy given as a trace",
         "participation.load_trace", ValueError,
         "the availability trace {tmp}/trace.npy is not a .npy file (it does not start with "
         "numpy's magic string \\x93NUMPY). Save a [clients, rounds] array of 0/1 with "
         "numpy.save, or give a text trace (one line of 0/1 per client) under a name that does "
         "not end in .npy.",
         lambda ctx: sj.participation.load_trace(write(ctx.tmp / "trace.npy", b"0110\n"))),
    Case("trace-directory", "--availability-trace DIR (it said \"no such file\")",
         "RunConfig.validate", ConfigError,
         "invalid config: availability_trace = '{tmp}' is a directory, not a file. Give the "
         "path of a trace (.npy [clients, rounds] of 0/1, or text: one line of 0/1 per "
         "client).",
         lambda ctx: RunConfig(**DP_RUN, availability="trace",
                               availability_trace=str(ctx.tmp)).validate()),
    # ----- found once the run is built: refused as the config's, before its folder is made
    Case("scaffnew-partial", "Scaffnew with S < N", "experiments.run", ConfigError,
         "Scaffnew needs every client in every round (S = N): the server's average relies on "
         "the controls h_i of ALL clients summing to 0, but clients_per_round (S) = 10 < N = "
         "50. Set clients_per_round = N (command line: --client-fraction 1).",
         lambda ctx: quick_run({"algorithm": "scaffnew", "out": str(ctx.tmp / "o")})),
    Case("poisson-bound-run", "--sampler poisson --poisson-bound 1", "experiments.run",
         ConfigError,
         "poisson_bound = 1 is too small for an expected cohort of S = 10 of N = 50: a round "
         "overflows it with probability 1.0e+00 (> 1e-09), and an overflowing round would "
         "drop sampled clients. Use poisson_bound >= 29, or leave it unset (the default "
         "bound).",
         lambda ctx: quick_run({"sampler": "poisson", "poisson_bound": 1,
                                "out": str(ctx.tmp / "o")})),
    Case("dp-count-noise-run", "--dp-count-noise 0.25 with --dp-noise-multiplier 10 and "
         "adaptive clipping", "experiments.run", ConfigError,
         "dp_count_noise = 0.25 is too small for dp_noise_multiplier = 10 with adaptive "
         "clipping (dp_clip_lr = 0.2): the count of unclipped clients gets noise sigma_b = "
         "dp_count_noise x S = 2.5 (S = 10), and adaptive clipping needs 2 sigma_b > "
         "dp_noise_multiplier. Use dp_count_noise > 0.5, a lower dp_noise_multiplier, or "
         "dp_clip_lr = 0 (a fixed clip norm).",
         lambda ctx: quick_run({"dp_noise_multiplier": 10, "dp_clip_lr": 0.2,
                                "dp_count_noise": 0.25, "out": str(ctx.tmp / "o")})),
    Case("dp-count-noise-api", "a private algorithm's count noise too small for z",
         "Simulation.run", ValueError,
         "dp_count_noise = 0.01 is too small for dp_noise_multiplier = 1 with adaptive "
         "clipping (dp_clip_lr = 0.2): the count of unclipped clients gets noise sigma_b = "
         "dp_count_noise x S = 0.02 (S = 2), and adaptive clipping needs 2 sigma_b > "
         "dp_noise_multiplier. Use dp_count_noise > 0.25, a lower dp_noise_multiplier, or "
         "dp_clip_lr = 0 (a fixed clip norm).",
         lambda ctx: run(ctx, sim=simulation(ctx, algorithm=sj.privacy.private(
             sj.fedavg(ctx.problem.loss_fn), count_noise=0.01)),
             hp=sj.hparams(0.1, dp_noise_multiplier=1.0, dp_clip_lr=0.2, dp_clip=1.0))),
    # ----- an output folder that cannot be written, a plugin that stops its own import
    Case("out-read-only", "--out on a read-only file system", "RunWriter.open",
         results.RunFolderError,
         "cannot write {tmp}/ro/run: it is on a read-only file system. Choose a writable --out.",
         lambda ctx: unwritable(ctx, results.RunWriter(ctx.tmp / "ro" / "run", {"a": 1},
                                                       plots=()).open)),
    Case("out-not-permitted", "--out in a folder this user may not write",
         "RunWriter.open", results.RunFolderError,
         "cannot write {tmp}/ro/run: permission denied. Choose a writable --out, or make this "
         "folder writable.",
         lambda ctx: unwritable(ctx, results.RunWriter(ctx.tmp / "ro" / "run", {"a": 1},
                                                       plots=()).open, errno.EACCES)),
    Case("overwrite-read-only", "--overwrite of a run on a read-only file system",
         "check_folder", results.RunFolderError,
         "cannot write {tmp}/ro/run: it is on a read-only file system. Choose a writable --out.",
         overwrite_unwritable),
    Case("plugin-keyboard-interrupt", "a plugin whose top level raises KeyboardInterrupt",
         "load_plugins", ConfigError,
         "plugin '{tmp}/stop.py' failed while importing: it raised KeyboardInterrupt at "
         "{tmp}/stop.py:2 (in <module>) (no Ctrl-C was pressed); a plugin only registers "
         "entries: fix that line or leave the plugin out.",
         lambda ctx: load_plugins([str(write(ctx.tmp / "stop.py",
                                             b"x = 1\nraise KeyboardInterrupt\n"))])),
    # Issue 42: compression of the uplink.
    Case("compress-bits-one", "--compression qsgd --compress-bits 1", "RunConfig.validate",
         ConfigError,
         "invalid config: compress_bits = 1 is invalid: it must be a whole number >= 2 and <= 16.",
         lambda ctx: RunConfig(**DP_RUN, compression="qsgd", compress_bits=1).validate()),
    Case("compress-bits-seventeen", "--compression qsgd --compress-bits 17", "RunConfig.validate",
         ConfigError,
         "invalid config: compress_bits = 17 is invalid: it must be a whole number >= 2 and <= 16.",
         lambda ctx: RunConfig(**DP_RUN, compression="qsgd", compress_bits=17).validate()),
    Case("compress-bits-fractional", "--compression qsgd --compress-bits 4.5",
         "RunConfig.validate", ConfigError,
         "invalid config: compress_bits = 4.5 is invalid: it must be a whole number >= 2 and "
         "<= 16.",
         lambda ctx: RunConfig(**DP_RUN, compression="qsgd", compress_bits=4.5).validate()),
    Case("compress-bits-api", "hparams compress_bits=1 for a qsgd algorithm",
         "Simulation.resolve_hparams", ValueError,
         "compress_bits=1 is invalid: every value must be a whole number >= 2 and <= 16.",
         lambda ctx: simulation(ctx, algorithm=sj.compression.compressed(
             sj.fedavg(ctx.problem.loss_fn), "qsgd")).resolve_hparams(
             {"client_lr": 0.1, "compress_bits": 1})),
    Case("compress-fraction-zero", "--compression topk --compress-fraction 0",
         "RunConfig.validate", ConfigError,
         "invalid config: compress_fraction = 0.0 is invalid: it must be finite and > 0 and <= 1.",
         lambda ctx: RunConfig(**DP_RUN, compression="topk", compress_fraction=0.0).validate()),
    Case("compress-fraction-above-one", "--compression randk --compress-fraction 1.5",
         "RunConfig.validate", ConfigError,
         "invalid config: compress_fraction = 1.5 is invalid: it must be finite and > 0 and <= 1.",
         lambda ctx: RunConfig(**DP_RUN, compression="randk", compress_fraction=1.5).validate()),
    Case("compress-entry-not-sent", "--algorithm fedavg --compression topk "
         "--compress-entries delta_control (FedAvg sends no Δc)", "RunConfig.validate",
         ConfigError,
         "invalid config: compression = 'topk': compress_entries names delta_control, which "
         "fedavg's clients do not send: they send delta_params (or use all).",
         lambda ctx: RunConfig(**DP_RUN, algorithm="fedavg", compression="topk",
                               compress_entries="delta_control").validate()),
    Case("compress-entry-unknown", "--compression signef --compress-entries delta_params,deltas",
         "RunConfig.validate", ConfigError,
         "invalid config: compression = 'signef': compress_entries names deltas, which "
         "scaffold's clients do not send: they send delta_params, delta_control (or use all).",
         lambda ctx: RunConfig(**DP_RUN, compression="signef",
                               compress_entries="delta_params,deltas").validate()),
    Case("compress-after-privacy",
         "compressed(private(fedavg), 'qsgd') (compression after the clip)",
         "compression.compressed", ValueError,
         "compressed(private(...), 'qsgd') is refused: compressing after the clip can raise a "
         "message's norm above the clip norm the noise is calibrated to (qsgd and randk scale "
         "entries up; topk and signef add their residuals). Compress first and make that "
         "private: private(compressed(algorithm, 'qsgd')), which clips what is sent (the "
         "command line builds it so).",
         lambda ctx: sj.compression.compressed(
             sj.privacy.private(sj.fedavg(ctx.problem.loss_fn)), "qsgd")),
    Case("compress-option-of-another", "--compression qsgd --compress-fraction 0.1",
         "RunConfig.validate", ConfigError,
         "invalid config: compress_fraction = 0.1 does not apply to compression = 'qsgd': it "
         "is topk and randk's; remove it or choose that compression.",
         lambda ctx: RunConfig(**DP_RUN, compression="qsgd", compress_fraction=0.1).validate()),
    Case("compress-residual-dtype", "--compression signef --compress-residual-dtype float16",
         "RunConfig.validate", ConfigError,
         "invalid config: compress_residual_dtype = 'float16' is invalid: it must be one of "
         "'float32', 'bfloat16'.",
         lambda ctx: RunConfig(**DP_RUN, compression="signef",
                               compress_residual_dtype="float16").validate()),
    # Issue 43: the virtual clock and FedBuff.
    Case("fedbuff-buffer-above-concurrency", "--execution fedbuff --concurrency 4 --buffer-size 5",
         "RunConfig.validate", ConfigError,
         "invalid config: buffer_size B = 5 exceeds concurrency M = 4: a step waits for B of the "
         "M clients in flight; use B <= M.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff", concurrency=4,
                               buffer_size=5).validate()),
    Case("fedbuff-concurrency-above-clients", "--execution fedbuff --concurrency 60 (N = 50)",
         "RunConfig.validate", ConfigError,
         "invalid config: concurrency M = 60 exceeds num_clients N = 50: at most N clients can "
         "be in flight; use M <= N.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff", concurrency=60).validate()),
    Case("fedbuff-buffer-zero", "--execution fedbuff --buffer-size 0", "RunConfig.validate",
         ConfigError, "invalid config: buffer_size = 0 is invalid: it must be an integer >= 1.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff", buffer_size=0).validate()),
    Case("fedbuff-without-profiles", "--execution fedbuff (no --profiles)", "RunConfig.validate",
         ConfigError,
         "invalid config: execution = 'fedbuff' needs device profiles to time its clients: set "
         "profiles = 'lognormal' or 'file' (--profiles).",
         lambda ctx: RunConfig(**DP_RUN, execution="fedbuff").validate()),
    Case("fedbuff-no-contract", "--execution fedbuff --algorithm feddyn", "RunConfig.validate",
         ConfigError,
         "invalid config: execution = 'fedbuff' has no asynchronous contract for 'feddyn' yet "
         "(what a stale update does to its server state is not written): use algorithm = "
         "fedavg | fedprox | scaffold, or execution = 'sync'.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff",
                               algorithm="feddyn").validate()),
    Case("fedbuff-no-contract-api", "Simulation(sj.mime(...), execution=sj.FedBuff(4, 2))",
         "Simulation.run", ValueError,
         "FedBuff has no asynchronous contract for 'mime' yet (what a stale update does to its "
         "server state is not written): use one of fedavg, fedprox, scaffold, or synchronous "
         "rounds.",
         lambda ctx: run(ctx, sim=simulation(
             ctx, algorithm=sj.mime(ctx.problem.loss_fn), execution=sj.FedBuff(4, 2),
             participation=sj.participation.make(profiles="lognormal")))),
    Case("fedbuff-with-over-selection", "--execution fedbuff --over-selection 2",
         "RunConfig.validate", ConfigError,
         "invalid config: FedBuff with over-selection (sample ceil(f S), keep the S first): "
         "over-selection keeps the S first of a synchronous cohort, and FedBuff has no cohort "
         "(its buffer of B arrivals is its policy): unset over_selection, or use synchronous "
         "rounds.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff",
                               over_selection=2.0).validate()),
    Case("clock-deadline-zero", "--profiles lognormal --round-deadline 0", "RunConfig.validate",
         ConfigError, "invalid config: round_deadline = 0.0 is invalid: it must be a number > 0.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, round_deadline=0.0).validate()),
    Case("clock-over-selection-below-one", "--profiles lognormal --over-selection 0.9",
         "RunConfig.validate", ConfigError,
         "invalid config: over_selection = 0.9 is invalid: it must be a number >= 1.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, over_selection=0.9).validate()),
    Case("clock-over-selection-above-clients", "--over-selection 3 -S 20 (N = 50)",
         "RunConfig.validate", ConfigError,
         "invalid config: over_selection = 3.0 samples ceil(f * S) = 60 clients a round, more "
         "than num_clients N = 50: use a smaller over_selection or clients_per_round.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, over_selection=3.0,
                               clients_per_round=20).validate()),
    Case("clock-negative-speed", "--profiles lognormal --seconds-per-example -0.01",
         "RunConfig.validate", ConfigError,
         "invalid config: seconds_per_example = -0.01 is invalid: it must be a number > 0.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, seconds_per_example=-0.01).validate()),
    Case("clock-negative-bandwidth", "--profiles lognormal --up-bytes-per-s -5",
         "RunConfig.validate", ConfigError,
         "invalid config: up_bytes_per_s = -5.0 is invalid: it must be a number > 0.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, up_bytes_per_s=-5.0).validate()),
    Case("clock-file-bad-row", "--profiles file with a row of a negative bandwidth",
         "RunConfig.validate", ConfigError,
         "invalid config: the profile file {tmp}/devices.csv, row 3 ('0.1,-5,100'): the file "
         "must be a CSV with the header seconds_per_example,down_bytes_per_s,up_bytes_per_s and "
         "one row of three positive numbers per device.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", profile_file=str(write(
             ctx.tmp / "devices.csv", b"seconds_per_example,down_bytes_per_s,up_bytes_per_s\n"
             b"0.1,100,100\n0.1,-5,100\n"))).validate()),
    Case("fedbuff-with-privacy", "--execution fedbuff --dp-noise-multiplier 1",
         "RunConfig.validate", ConfigError,
         "invalid config: FedBuff with user-level differential privacy (clip, Gaussian noise, "
         "accountant): differential privacy's accountant covers rounds of uniformly sampled "
         "clients; a FedBuff step's buffer holds whichever clients arrive first, so that "
         "amplification by sampling does not apply and no accountant here covers it: use "
         "synchronous rounds for a private run.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff", privacy="gaussian",
                               dp_noise_multiplier=1.0).validate()),
    # ----- settings that could not mean what the user wants, once accepted (exit 0)
    Case("clock-deadline-below-every-client", "--profiles lognormal --round-deadline 1e-9 "
         "(every round kept no client: the model never trained)", "RunConfig.validate",
         ConfigError,
         "invalid config: round_deadline = 1e-09 s is shorter than every client's local work "
         "alone: the fastest of the N = 50 clients (client 23) needs 0.00187 s for its 1 "
         "example a round (before its download and upload), so every round would drop every "
         "client and the model would never train; give round_deadline > 0.00187, or unset it.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, round_deadline=1e-9).validate()),
    Case("clock-file-slower-than-deadline", "--profiles file whose every device is slower "
         "than --round-deadline 0.5", "RunConfig.validate", ConfigError,
         "invalid config: round_deadline = 0.5 s is shorter than every client's local work "
         "alone: the fastest of the N = 50 clients (client 0 (row 2)) needs 1 s for its 1 "
         "example a round (before its download and upload), so every round would drop every "
         "client and the model would never train; give round_deadline > 1, or unset it.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", round_deadline=0.5, profile_file=(
             profile_csv(ctx, "1,1e6,1e6", "2,1e6,1e6"))).validate()),
    Case("clock-deadline-underflows", "--profiles lognormal --round-deadline 1e-50 (0 in the "
         "float32 clock)", "RunConfig.validate", ConfigError,
         "invalid config: round_deadline = 1e-50 is invalid: the virtual clock computes in "
         "float32, where it is 0 (the smallest normal float32 is 1.18e-38); give at least "
         "that many seconds (or unset it).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, round_deadline=1e-50).validate()),
    Case("clock-speed-overflows", "--profiles lognormal --seconds-per-example 1e39 (inf in "
         "float32: virtual_time Infinity)", "RunConfig.validate", ConfigError,
         "invalid config: seconds_per_example = 1e+39 is invalid: the virtual clock computes "
         "in float32, where it is inf (the largest float32 is 3.4e+38); give at most that "
         "many seconds.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, seconds_per_example=1e39).validate()),
    Case("clock-bandwidth-underflows", "--profiles lognormal --down-bytes-per-s 1e-50",
         "RunConfig.validate", ConfigError,
         "invalid config: down_bytes_per_s = 1e-50 is invalid: the virtual clock computes in "
         "float32, where it is 0 (the smallest normal float32 is 1.18e-38); give at least "
         "that many bytes per second.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, down_bytes_per_s=1e-50).validate()),
    Case("clock-compute-sigma-overflows", "--profiles lognormal --compute-sigma 1000 (the "
         "draws are 0 or inf in float32)", "RunConfig.validate", ConfigError,
         "invalid config: profiles = 'lognormal' (seconds_per_example = 0.005, compute_sigma "
         "= 1000.0, down_bytes_per_s = 1250000.0, up_bytes_per_s = 250000.0, bandwidth_sigma "
         "= 0.75) gives client 0 seconds per example = 0 in the virtual clock's float32 (a "
         "positive number from 1.18e-38 to 3.4e+38 is needed): use medians nearer 1 or "
         "smaller spreads (compute_sigma, bandwidth_sigma).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, compute_sigma=1000.0).validate()),
    Case("clock-bandwidth-sigma-overflows", "--profiles lognormal --bandwidth-sigma 100",
         "RunConfig.validate", ConfigError,
         "invalid config: profiles = 'lognormal' (seconds_per_example = 0.005, compute_sigma "
         "= 0.5, down_bytes_per_s = 1250000.0, up_bytes_per_s = 250000.0, bandwidth_sigma = "
         "100.0) gives client 0 downlink bytes/s = 0 in the virtual clock's float32 (a "
         "positive number from 1.18e-38 to 3.4e+38 is needed): use medians nearer 1 or "
         "smaller spreads (compute_sigma, bandwidth_sigma).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, bandwidth_sigma=100.0).validate()),
    Case("clock-file-cell-underflows", "--profiles file with a cell 1e-50 in a row a client "
         "reads", "RunConfig.validate", ConfigError,
         "invalid config: the profile file {tmp}/devices.csv gives client 1 (row 3) seconds "
         "per example = 0 in the virtual clock's float32 (a positive number from 1.18e-38 to "
         "3.4e+38 is needed): give each device numbers from 1.18e-38 to 3.4e+38.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", profile_file=profile_csv(
             ctx, "0.01,1e6,1e6", "1e-50,1e6,1e6")).validate()),
    Case("clock-file-cell-overflows", "--profiles file with a cell 1e39", "RunConfig.validate",
         ConfigError,
         "invalid config: the profile file {tmp}/devices.csv gives client 0 (row 2) uplink "
         "bytes/s = inf in the virtual clock's float32 (a positive number from 1.18e-38 to "
         "3.4e+38 is needed): give each device numbers from 1.18e-38 to 3.4e+38.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", profile_file=profile_csv(
             ctx, "0.01,1e6,1e39")).validate()),
    Case("clock-over-selection-huge", "--profiles lognormal --over-selection 1e300 (it "
         "printed a 301-digit integer)", "RunConfig.validate", ConfigError,
         "invalid config: over_selection = 1e+300 samples ceil(f * S) = 1e+301 clients a "
         "round, more than num_clients N = 50: use a smaller over_selection or "
         "clients_per_round.",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, over_selection=1e300).validate()),
    Case("clock-file-dev-null", "--profile-file /dev/null (it said \"no such file\")",
         "RunConfig.validate", ConfigError,
         "invalid config: profile_file = '/dev/null' is not a regular file (a device or a "
         "pipe): the file must be a CSV with the header seconds_per_example,down_bytes_per_s,"
         "up_bytes_per_s and one row of three positive numbers per device.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", profile_file="/dev/null").validate()),
    Case("clock-file-fifo", "--profile-file FIFO (a named pipe; never read: it would block)",
         "RunConfig.validate", ConfigError,
         "invalid config: profile_file = '{tmp}/devices.fifo' is not a regular file (a device "
         "or a pipe): the file must be a CSV with the header seconds_per_example,"
         "down_bytes_per_s,up_bytes_per_s and one row of three positive numbers per device.",
         lambda ctx: RunConfig(**DP_RUN, profiles="file", profile_file=fifo(ctx)).validate()),
    Case("fedbuff-sampler", "--execution fedbuff --sampler poisson (ignored: FedBuff draws "
         "its own clients)", "RunConfig.validate", ConfigError,
         "invalid config: execution = 'fedbuff' does not use sampler = 'poisson': it keeps "
         "concurrency M = 10 clients in flight (an arrival's replacement drawn uniformly among "
         "those not in flight) and steps every buffer_size B = 5 arrivals; remove it and set "
         "concurrency or buffer_size (--concurrency, --buffer-size).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff",
                               sampler="poisson").validate()),
    Case("fedbuff-clients-per-round", "--execution fedbuff --clients-per-round 5 (ignored)",
         "RunConfig.validate", ConfigError,
         "invalid config: execution = 'fedbuff' does not use clients_per_round = 5: it keeps "
         "concurrency M = 10 clients in flight (an arrival's replacement drawn uniformly among "
         "those not in flight) and steps every buffer_size B = 5 arrivals; remove it and set "
         "concurrency or buffer_size (--concurrency, --buffer-size).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff",
                               clients_per_round=5).validate()),
    Case("fedbuff-client-fraction", "--execution fedbuff --client-fraction 0.9 (ignored)",
         "RunConfig.validate", ConfigError,
         "invalid config: execution = 'fedbuff' does not use client_fraction = 0.9: it keeps "
         "concurrency M = 10 clients in flight (an arrival's replacement drawn uniformly among "
         "those not in flight) and steps every buffer_size B = 5 arrivals; remove it and set "
         "concurrency or buffer_size (--concurrency, --buffer-size).",
         lambda ctx: RunConfig(**DP_RUN, **TIMED, execution="fedbuff",
                               client_fraction=0.9).validate()),
    Case("compress-entries-without-compressor", "--compress-entries delta_params (no "
         "--compression)", "RunConfig.validate", ConfigError,
         "invalid config: compress_entries = 'delta_params' does not apply to compression = "
         "'none': it is an option of a compressor; remove it or choose a compression (qsgd, "
         "topk, randk, signef).",
         lambda ctx: RunConfig(**DP_RUN, compress_entries="delta_params").validate()),
    Case("compress-residual-without-compressor", "--compress-residual-dtype bfloat16 (no "
         "--compression)", "RunConfig.validate", ConfigError,
         "invalid config: compress_residual_dtype = 'bfloat16' does not apply to compression "
         "= 'none': it is an option of a compressor; remove it or choose a compression (qsgd, "
         "topk, randk, signef).",
         lambda ctx: RunConfig(**DP_RUN, compress_residual_dtype="bfloat16").validate()),
    Case("compress-residual-with-qsgd", "--compression qsgd --compress-residual-dtype "
         "bfloat16 (qsgd keeps no residual)", "RunConfig.validate", ConfigError,
         "invalid config: compress_residual_dtype = 'bfloat16' does not apply to compression "
         "= 'qsgd', which keeps no error-feedback residual; remove it or choose a compression "
         "with one (topk or signef).",
         lambda ctx: RunConfig(**DP_RUN, compression="qsgd",
                               compress_residual_dtype="bfloat16").validate()),
    Case("compress-entries-empty-name", "--compression topk --compress-entries delta_params, "
         "(it said \"names , which\")", "RunConfig.validate", ConfigError,
         "invalid config: compress_entries = 'delta_params,' holds an empty name (a stray "
         "comma): give names separated by single commas (e.g. delta_params,delta_control), or "
         "all.",
         lambda ctx: RunConfig(**DP_RUN, compression="topk",
                               compress_entries="delta_params,").validate()),
    Case("setting-twice-in-file", "a config file with compress_bits = 8 and hparams "
         "{compress_bits = 4} (it ran with 8)", "scaffold-jax run --config", ConfigError,
         "config file {tmp}/twice.json gives compress_bits = 8 and hparams.compress_bits = 4: "
         "a setting with two values; give it once, by name or in its table.",
         lambda ctx: cli_config("--config", str(write(ctx.tmp / "twice.json", json.dumps(
             {"compression": "qsgd", "compress_bits": 8, "hparams": {"compress_bits": 4}}
         ).encode())))),
    Case("setting-twice-option", "concurrency = 6 and options {concurrency = 4} (it ran with "
         "6)", "RunConfig.from_dict", ConfigError,
         "config gives concurrency = 6 and options.concurrency = 4: a setting with two values; "
         "give it once, by name or in its table.",
         lambda ctx: RunConfig.from_dict({"concurrency": 6, "options": {"concurrency": 4}})),
    Case("setting-twice-hparam", "prox_mu = 0.1 and hparams {prox_mu = 0.5}",
         "RunConfig(...)", ConfigError,
         "RunConfig gives prox_mu = 0.1 and hparams.prox_mu = 0.5: a setting with two values; "
         "give it once, by name or in its table.",
         lambda ctx: RunConfig(algorithm="fedprox", prox_mu=0.1, hparams={"prox_mu": 0.5})),
    Case("setting-twice-flag-and-set", "--concurrency 6 --set concurrency=4 (it ran with 4)",
         "scaffold-jax run", ConfigError,
         "--concurrency 6 and --set concurrency=4 give a setting two values: give it once (a "
         "flag or --set).",
         lambda ctx: cli_config("--concurrency", "6", "--set", "concurrency=4")),
    Case("resume-killed-read-only", "--resume of a killed run whose folder is read-only (it "
         "printed a raw [Errno 30] of summary.json.<pid>.tmp)", "check_lock",
         results.RunFolderError,
         "cannot write {tmp}/ro/run/summary.json: the run's folder is on a read-only file "
         "system, and --resume or --overwrite writes where the run is. Make the folder "
         "writable, or copy it to a writable place and --resume there.",
         killed_run_read_only),
    Case("algorithm-is-an-execution", "--algorithm fedbuff", "RunConfig.validate", ConfigError,
         "invalid config: algorithm = 'fedbuff' is invalid: it must be one of 'scaffold', "
         "'fedavg', …; 'fedbuff' is an execution, not an algorithm: set execution = 'fedbuff' "
         "(--execution fedbuff), with algorithm = fedavg | fedprox | scaffold.",
         lambda ctx: RunConfig(**DP_RUN, algorithm="fedbuff").validate()),
    Case("dataset-abbreviated", "--dataset fmnist (no did-you-mean)", "RunConfig.validate",
         ConfigError,
         "invalid config: dataset = 'fmnist' is invalid: it must be one of 'mnist', "
         "'fashion_mnist', … (did you mean 'fashion_mnist'?).",
         lambda ctx: RunConfig(dataset="fmnist").validate()),
    Case("sweep-targets", "sweep --targets 0.5 0.6 (sweep's flag is --target)", "scaffold-jax "
         "sweep", ConfigError,
         "sweep: --targets 0.5 0.6 is run's flag (the accuracies a run's summary reports); a "
         "sweep counts rounds to ONE target accuracy: give --target X (default 0.7).",
         lambda ctx: cli._sweep_command(sweep_args("--targets", "0.5", "0.6"))),
    Case("sweep-grid-compressor-hparam", "sweep --grid compress_bits=2,4 without --compression "
         "qsgd (it said \"unknown name\")", "experiments.sweep", ConfigError,
         "--grid compress_bits: compress_bits is a hyper-parameter of compression qsgd, not of "
         "compression = 'none'; choose that compression (--compression qsgd) or remove the "
         "axis.",
         lambda ctx: experiments.sweep(RunConfig(**DP_RUN), (), {"compress_bits": [2, 4]},
                                       out=str(ctx.tmp / "o"), quiet=True)),
    Case("sweep-grid-other-compressor-hparam", "sweep --compression qsgd --grid "
         "compress_fraction=0.1,0.2 (it suggested client_fraction)", "experiments.sweep",
         ConfigError,
         "--grid compress_fraction: compress_fraction is a hyper-parameter of compression topk "
         "and randk, not of compression = 'qsgd'; choose that compression (--compression "
         "topk) or remove the axis.",
         lambda ctx: experiments.sweep(RunConfig(**DP_RUN, compression="qsgd"), (),
                                       {"compress_fraction": [0.1, 0.2]},
                                       out=str(ctx.tmp / "o"), quiet=True)),
    Case("sweep-grid-of-names", "sweep --grid compression=topk,qsgd (it suggested --grid "
         "compression=0.5,1)", "scaffold-jax sweep", ConfigError,
         "--grid compression=topk,qsgd: compression takes a name, and a grid axis takes "
         "numbers (one program per value); sweep each compression on its own (--compression "
         "topk, then --compression qsgd, each with its own --out).",
         lambda ctx: cli._grid_axes(["compression=topk,qsgd"])),
    # Personalization.
    Case("personal-without-client-tests", "--finetune-steps 2 without client test data",
         "RunConfig.validate", ConfigError,
         "invalid config: finetune_steps = 2 evaluates every client's own model on its own "
         "test data, which dataset = 'fashion_mnist' has none of: set local_test_fraction (e.g. "
         "0.2, each client's held-out fraction).",
         lambda ctx: RunConfig(dataset="fashion_mnist", finetune_steps=2).validate()),
    Case("personalized-without-client-tests", "--algorithm ditto without client test data",
         "RunConfig.validate", ConfigError,
         "invalid config: algorithm = 'ditto' (a model per client) evaluates every client's own "
         "model on its own test data, which dataset = 'fashion_mnist' has none of: set "
         "local_test_fraction (e.g. 0.2, each client's held-out fraction).",
         lambda ctx: RunConfig(dataset="fashion_mnist", algorithm="ditto").validate()),
    Case("personal-eval-clients-zero", "--personal-eval-clients 0", "RunConfig.validate",
         ConfigError,
         "invalid config: personal_eval_clients = 0 is invalid: it must be an integer >= 1.",
         lambda ctx: RunConfig(dataset="fashion_mnist", local_test_fraction=0.2,
                               personal_eval_clients=0).validate()),
    Case("finetune-lr-negative", "--finetune-lr -1", "RunConfig.validate", ConfigError,
         "invalid config: finetune_lr = -1.0 is invalid: it must be a step size > 0.",
         lambda ctx: RunConfig(dataset="fashion_mnist", local_test_fraction=0.2,
                               finetune_lr=-1.0).validate()),
    Case("ditto-base-unknown", "--algorithm ditto --ditto-base mime", "RunConfig.validate",
         ConfigError,
         "invalid config: ditto_base = 'mime' is invalid: it must be one of 'fedavg', "
         "'fedprox', 'scaffold'.",
         lambda ctx: RunConfig(dataset="fashion_mnist", local_test_fraction=0.2, algorithm="ditto",
                               options={"ditto_base": "mime"}).validate()),
    Case("ditto-base-unknown-api", "algorithms.make('ditto', loss, base='mime')",
         "algorithms.make", ValueError,
         "Ditto's base 'mime' is not supported; use one of fedavg, fedprox, scaffold.",
         lambda ctx: sj.algorithms.make("ditto", ctx.problem.loss_fn, base="mime")),
    Case("personalized-under-fedbuff", "--algorithm ditto --execution fedbuff",
         "RunConfig.validate", ConfigError,
         "invalid config: execution = 'fedbuff' has no asynchronous contract for 'ditto' yet "
         "(what a stale update does to its server state is not written): use algorithm = "
         "fedavg | fedprox | scaffold, or execution = 'sync'.",
         lambda ctx: RunConfig(dataset="fashion_mnist", local_test_fraction=0.2, algorithm="ditto",
                               profiles="lognormal", execution="fedbuff").validate()),
    Case("fedrep-head-names-no-leaf", "algorithms.make('fedrep', loss, head='nope')",
         "Algorithm.init", ValueError,
         "head = 'nope' is refused: nope names no leaf; the params' leaves are linear/bias, "
         "linear/kernel (name some by path prefix, comma-separated).",
         lambda ctx: sj.algorithms.make("fedrep", ctx.problem.loss_fn, head="nope").init(
             ctx.problem.params)),
    Case("fedrep-head-is-everything", "FedRep on logistic regression (its head: every leaf)",
         "Algorithm.init", ValueError,
         "head = 'auto' is refused: it covers every leaf, leaving FedRep no body to share; the "
         "params' leaves are linear/bias, linear/kernel (name some by path prefix, "
         "comma-separated).",
         lambda ctx: sj.algorithms.make("fedrep", ctx.problem.loss_fn).init(ctx.problem.params)),
    Case("apfl-alpha-above-one", "--algorithm apfl --set apfl_alpha=1.5", "RunConfig.validate",
         ConfigError, "invalid config: apfl_alpha = 1.5 is invalid: it must be finite and >= 0 "
         "and <= 1.",
         lambda ctx: RunConfig(dataset="fashion_mnist", local_test_fraction=0.2, algorithm="apfl",
                               hparams={"apfl_alpha": 1.5}).validate()),
    Case("pfedme-beta-above-one", "pFedMe with server_lr (its beta) 1.5", "Simulation.run",
         ValueError, "server_lr=1.5 is invalid: every value must be finite and > 0 and <= 1.",
         lambda ctx: run(ctx, sim=simulation(
             ctx, algorithm=sj.algorithms.make("pfedme", ctx.problem.loss_fn)),
             hp=sj.hparams(client_lr=0.1, server_lr=1.5))),
    # Byzantine clients and robust aggregation.
    Case("aggregator-with-privacy", "--aggregator median with --dp-noise-multiplier",
         "RunConfig.validate", ConfigError,
         "invalid config: privacy = 'gaussian': aggregator = 'median' with differential "
         "privacy is refused: the noise is calibrated to the clipped SUM of the messages, "
         "which a robust aggregator does not release; use aggregator = 'mean' with privacy.",
         lambda ctx: RunConfig(**DP_RUN, aggregator="median",
                               hparams={"dp_noise_multiplier": 1.0}).validate()),
    Case("aggregator-private-api", "private(robustly_aggregated(scaffold, 'krum'))", "private",
         ValueError,
         "aggregator = 'krum' with differential privacy is refused: the noise is calibrated to "
         "the clipped SUM of the messages, which a robust aggregator does not release; use "
         "aggregator = 'mean' with privacy.",
         lambda ctx: sj.privacy.private(sj.robust.robustly_aggregated(
             sj.scaffold(ctx.problem.loss_fn), "krum"))),
    Case("aggregator-weighted", "--aggregator median --weighting num_examples",
         "RunConfig.validate", ConfigError,
         "invalid config: aggregator = 'median' weighs every reporting client the same: use "
         "weighting = 'uniform', not 'num_examples'.",
         lambda ctx: RunConfig(aggregator="median", weighting="num_examples").validate()),
    Case("aggregator-for-fednova", "robustly_aggregated(fednova, 'median')",
         "robustly_aggregated", ValueError,
         "fednova reads each client's output on its own (not only their mean), so aggregator "
         "= 'median' cannot stand in for its mean: use fedavg, fedprox, scaffold or feddyn.",
         lambda ctx: sj.robust.robustly_aggregated(sj.fednova(ctx.problem.loss_fn), "median")),
    Case("attack-with-warm-controls", "robust.attacked(scaffold(warm_controls=True), 'alie')",
         "attacked", ValueError,
         "attack = 'alie' with scaffold's warm controls is refused: every client sends its "
         "full-batch gradient once before round 1, outside the rounds the attacks and robust "
         "aggregators act on; turn them off (warm_controls=False).",
         lambda ctx: sj.robust.attacked(sj.scaffold(ctx.problem.loss_fn, warm_controls=True),
                                        "alie")),
    Case("bucketing-the-mean", "--aggregator mean --bucket-size 2", "RunConfig.validate",
         ConfigError,
         "invalid config: bucket_size = 2 does not apply to aggregator = 'mean': it is median, "
         "trimmed_mean, krum, multikrum, geomed, cclip's; remove it or choose one of those.",
         lambda ctx: RunConfig(aggregator="mean", hparams={"bucket_size": 2}).validate()),
    Case("bucket-size-as-option", "robustly_aggregated(scaffold, 'median', bucket_size=2)",
         "robustly_aggregated", ValueError,
         "aggregator = 'median' takes no option 'bucket_size' (its options: none); bucket_size "
         "is a hyper-parameter of the robust aggregators: give it with the others "
         "(sj.hparams(...)).",
         lambda ctx: sj.robust.robustly_aggregated(sj.scaffold(ctx.problem.loss_fn), "median",
                                                   bucket_size=2)),
    Case("byzantine-fraction-half", "--attack signflip --byzantine-fraction 0.5",
         "RunConfig.validate", ConfigError,
         "invalid config: byzantine_fraction = 0.5 is invalid: …",
         lambda ctx: RunConfig(attack="signflip", hparams={"byzantine_fraction": 0.5}).validate()),
    Case("labelflip-on-regression", "--dataset quadratic --attack labelflip",
         "RunConfig.validate", ConfigError,
         "invalid config: attack = 'labelflip' flips a classifier's labels, and the quadratic "
         "dataset is a regression: use a message attack (signflip, gaussian, alie, ipm).",
         lambda ctx: RunConfig(**DP_RUN, attack="labelflip").validate()),
    Case("unknown-attack", "--attack flip", "RunConfig.validate", ConfigError,
         "invalid config: attack = 'flip' is invalid: it must be one of 'none', 'signflip', "
         "'gaussian', 'alie', 'labelflip', 'ipm' (did you mean 'signflip'?).",
         lambda ctx: RunConfig(attack="flip").validate()),
]
# fmt: on


# Inputs that are NOT refused yet, in modules this test does not own (the doc lists them).
KNOWN_GAPS = [
    (
        "a test set whose fields or shapes differ from the clients'",
        "data/federated.py",
        "`from_client_arrays` accepts it; `Simulation.run` now refuses it (row above).",
    ),
]


# --------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-round run of the shared simulation, checkpointed every round (all three kept)."""
    problem = sj.models.logistic_regression((5,), 3)
    data = sj.from_client_arrays(clients(), test=clients(sizes=(20,), seed=1)[0])
    base = tmp_path_factory.mktemp("finished") / "ckpt"
    ctx = SimpleNamespace(problem=problem, data=data)
    sim = simulation(ctx)  # shared, so that the diverging case reuses its compiled rounds
    result = run(ctx, sim=sim, checkpoint_dir=base, checkpoint_every=1, keep_checkpoints=3)
    return SimpleNamespace(problem=problem, data=data, base=base, state=result.state, sim=sim)


@pytest.fixture
def ctx(finished_run, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(finished_run.base, ckpt_dir)
    return SimpleNamespace(
        tmp=tmp_path,
        problem=finished_run.problem,
        data=finished_run.data,
        sim=finished_run.sim,
        ckpt_dir=ckpt_dir,
        state_at_2=finished_run.state,
        key=__import__("jax").random.key(0),
    )


def message_pattern(template: str, tmp: Path) -> re.Pattern:
    parts = [re.escape(p.replace("{tmp}", str(tmp))) for p in template.split("…")]
    return re.compile(".*".join(parts), re.DOTALL)


# Orbax's threads report tensorstore failures on damaged files after the fact; the
# fallback warnings of the all-corrupt case are expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore:checkpoint .* is corrupt:UserWarning")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_with_its_message(case, ctx):
    with pytest.raises(case.error) as info:
        case.make(ctx)
    assert type(info.value) is case.error
    message = str(info.value)
    assert message_pattern(case.message, ctx.tmp).fullmatch(message), message


def test_the_diverged_round_does_not_depend_on_eval_every():
    """Least squares with η_l far above 2/β: the state grows ~|1 − η_l β| per round. Its
    update norm (a square root of a sum of squares) overflows rounds before the state does,
    so the round must come from the state (the engine's per-round ``server_finite``)."""

    def loss_fn(params, batch):
        return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2

    rng = np.random.default_rng(0)
    data = sj.from_client_arrays(
        [{"x": rng.normal(size=(n, 5)).astype(np.float32),
          "y": rng.normal(size=n).astype(np.float32)} for n in (4, 6, 5, 8)]
    )  # fmt: skip
    problem = sj.Problem(params={"w": jnp.zeros(5, jnp.float32)}, loss_fn=loss_fn)
    sim = sj.Simulation(sj.fedavg(loss_fn), problem, sj.BatchPlan.full(1), 4)
    errors = {}
    for every in (1, 4):
        with pytest.raises(DivergenceError) as info:
            sim.run(data, sj.hparams(100.0), num_rounds=40, eval_every=every)
        errors[every] = info.value
    rounds = {every: err.diverged_round for every, err in errors.items()}
    assert rounds[1] == rounds[4] > 1, rounds
    metrics = errors[4].result.round_metrics
    first_inf_norm = int(np.flatnonzero(~np.isfinite(metrics["update_norm"]))[0]) + 1
    assert first_inf_norm < rounds[4]  # the trap: the norm is inf while the state is finite
    assert (
        metrics["server_finite"][: rounds[4] - 1].all()
        and not metrics["server_finite"][rounds[4] - 1]
    )
    d = rounds[4]
    assert f"the first non-finite update came from round {d})" in str(errors[1])
    last = -(-d // 4) * 4  # the check after the block of 4 rounds that holds round d
    explained = (
        f"Lower client_lr or server_lr. (The state is checked after each block of rounds, "
        f"{last - 3}..{last} here; round {d} is the first whose new server state held NaN/Inf.)"
    )
    assert str(errors[4]).endswith(explained if d != last else "Lower client_lr or server_lr.")


def test_cases_are_many_and_distinct():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


def render_doc() -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def code(text: str) -> str:
        assert "`" not in text  # messages go in code spans (so <ndim> or * stay literal)
        return f"`{cell(text)}`"

    lines = [
        "# Bad inputs and the errors they raise",
        "",
        "Every row is a test case in `tests/test_bad_inputs.py` (`CASES`), which checks that",
        "the call raises exactly this error with exactly this message. This page is generated",
        "from those cases (`python tests/test_bad_inputs.py`) and a test fails when the two",
        "disagree. In a message, `{tmp}` stands for the directory involved and `…` for text",
        "quoted from a third-party error (flax, tensorstore, zlib) or naming the machine.",
        f"There are {len(CASES)}; other pages link here rather than repeat the figure.",
        "",
        "| # | Bad input | Refused by | Error | Message |",
        "|---|---|---|---|---|",
    ]
    for i, c in enumerate(CASES, 1):
        lines.append(
            f"| {i} | {cell(c.what)} | `{c.call}` | `{c.error.__name__}` | {code(c.message)} |"
        )
    lines += [
        "",
        "## Not refused yet",
        "",
        "Found while writing the cases above, in modules owned elsewhere:",
        "",
        "| Input | Module | What happens |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(a)} | `{b}` | {cell(c)} |" for a, b, c in KNOWN_GAPS]
    return "\n".join(lines) + "\n"


def test_the_doc_lists_exactly_these_cases():
    assert DOC.read_text() == render_doc(), "regenerate: python tests/test_bad_inputs.py"


if __name__ == "__main__":
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(render_doc())
    print(f"wrote {DOC} ({len(CASES)} cases)", file=sys.stderr)
