"""The round program, the multi-round scan, evaluation and the run loop.

A round is one pure function ``round(hparams, state, data, key) -> (state, metrics)``:

1. ``round_key = fold_in(key, state.round)``; sample S of N clients uniformly without
   replacement; client i's key is ``fold_in(clients_key, i)`` (``clients_key`` split from
   the round key), so what a client does depends on its id, never on its position in the
   sampled set or on how the client axis is laid out.
2. gather the sampled rows of the client table, draw each client's batches, run
   ``vmap(client_update)`` over the S clients;
3. aggregate with the algorithm's pure ``server_update``; scatter the new rows back.

Many rounds run as one ``lax.scan`` inside one ``jit`` whose state argument is donated,
so the ``[N, ...]`` client table is updated in place. Nothing per client or per step
happens in Python.

Between those compiled blocks, :meth:`Simulation.run` evaluates, saves checkpoints of the
whole state (:mod:`scaffold_jax.checkpoint`; ``resume=True`` continues bit for bit), turns
SIGINT / SIGTERM into a clean stop after the current block, and stops a run whose server
state became NaN/Inf with :class:`DivergenceError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.tree import broadcast_rows, set_rows, sq_norm, take_rows, weighted_mean
from scaffold_jax.types import Algorithm, HParams, Problem, PyTree, SimState, check_hparams

WEIGHTINGS = ("uniform", "num_examples")


def init_state(algorithm: Algorithm, params: PyTree, num_clients: int) -> SimState:
    """The initial :class:`SimState`: server state from ``params``, the single-client state
    broadcast to a ``[N, ...]`` table, round 0."""
    server, client = algorithm.init(params)
    # The state is donated to the round program; copying keeps the caller's params alive.
    return SimState(
        server=jax.tree.map(lambda a: jnp.array(a, copy=True), server),
        clients=broadcast_rows(client, num_clients),
        round=jnp.zeros((), jnp.int32),
    )


def sample_clients(key: jax.Array, num_clients: int, clients_per_round: int) -> jax.Array:
    """S distinct client ids, uniformly without replacement (int32 ``[S]``).

    Every S-subset of the N clients is equally likely. For S << N this uses Floyd's
    algorithm (O(S²) work, no O(N) pass: 2-3 ms for S = 1000 of N = 10⁶, where a full
    permutation takes ~0.7 s on a CPU); otherwise a permutation of all N ids.
    """
    n, s = num_clients, clients_per_round
    if s == n or s * s > 16 * n * max(1, n.bit_length()):
        return jr.permutation(key, n)[:s].astype(jnp.int32)
    keys = jr.split(key, s)

    def add_one(i, chosen):
        # Floyd: draw j in [0, t]; take j unless already chosen, in which case take t
        # (which cannot be chosen yet). Each step keeps the chosen set uniform.
        t = n - s + i
        j = jr.randint(keys[i], (), 0, t + 1, dtype=jnp.int32)
        return chosen.at[i].set(jnp.where(jnp.any(chosen == j), t, j))

    return jax.lax.fori_loop(0, s, add_one, jnp.full((s,), -1, jnp.int32))


def client_keys(round_key: jax.Array, ids: jax.Array) -> jax.Array:
    """Per-client keys derived from the client id (``[S]`` keys)."""
    clients_key = jr.split(round_key)[1]
    return jax.vmap(lambda i: jr.fold_in(clients_key, i))(ids)


def round_key_and_ids(key, round_index, num_clients, clients_per_round):
    round_key = jr.fold_in(key, round_index)
    ids = sample_clients(jr.split(round_key)[0], num_clients, clients_per_round)
    return round_key, ids


STATUSES = ("finished", "diverged", "interrupted")


@dataclasses.dataclass
class RunResult:
    """What :meth:`Simulation.run` returns (or attaches to the exception it raises).

    Attributes:
      state: the final :class:`SimState`.
      records: one dict per evaluation (round, test/train metrics, elapsed seconds). After
        ``resume=True`` it starts with the records restored from the checkpoint.
      client_ids: ``[R, S]`` int32, the clients sampled in every round run by THIS call
        (audit and replay); after a resume the first row is round ``resumed_from``.
      round_metrics: per-round metrics of the rounds run by this call, each ``[R]``.
      compile_seconds: time spent compiling the round program(s) and the evaluation.
      run_seconds: wall time of the rounds and evaluations after compilation (checkpoint
        writing excluded).
      status: ``"finished"`` for a returned result; ``"diverged"`` on the result carried
        by a :class:`DivergenceError`; ``"interrupted"`` on the result carried (as
        ``.result``) by the ``KeyboardInterrupt`` or :class:`RunTerminated` raised on
        SIGINT / SIGTERM.
      resumed_from: the round of the checkpoint this call resumed from, else None.
      checkpoint_seconds: wall time spent writing checkpoints.
    """

    state: SimState
    records: list[dict[str, Any]]
    client_ids: np.ndarray
    round_metrics: dict[str, np.ndarray]
    compile_seconds: float
    run_seconds: float
    status: str = "finished"
    resumed_from: int | None = None
    checkpoint_seconds: float = 0.0

    def final(self, name: str) -> float:
        return float(self.records[-1][name])


class DivergenceError(ValueError):
    """The server state of a run became NaN or Inf; the run stopped.

    Attributes:
      result: the :class:`RunResult` so far, ``status="diverged"``; its ``state`` is the
        non-finite one, its ``records`` the (finite) evaluations made before.
      records: ``result.records``.
      diverged_round: the round that produced the non-finite values (1-based, i.e. the
        value of ``state.round`` after it, as :mod:`scaffold_jax.sweep` reports it).
    """

    def __init__(self, message: str, result: RunResult, diverged_round: int):
        super().__init__(message)
        self.result = result
        self.records = result.records
        self.diverged_round = diverged_round


class RunTerminated(SystemExit):
    """SIGTERM stopped a run after its current compiled block (and its checkpoint).

    A ``SystemExit`` with code 143 (128 + SIGTERM, what a shell reports for a process
    killed by SIGTERM). ``result`` is the :class:`RunResult` so far,
    ``status="interrupted"``; ``message`` says where the checkpoint is.
    """

    def __init__(self, message: str, result: RunResult):
        super().__init__(128 + int(signal.SIGTERM))
        self.message = message
        self.result = result


class _DeferredSignals:
    """Holds SIGINT and SIGTERM back until the current compiled block has finished.

    A compiled block cannot be stopped half-way without losing it, so the first signal is
    only noted; the run loop saves a checkpoint at the end of the block and then raises. A
    second signal acts at once (the user does not want to wait). The previous handlers are
    restored on exit. Off the main thread Python cannot install handlers: nothing changes.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _DeferredSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            # None: a handler installed outside Python; SIG_IGN: the signal is ignored on
            # purpose (e.g. nohup). Either way it is not ours to take over.
            if previous is None or previous is signal.SIG_IGN:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            return
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __exit__(self, *exc_info) -> None:
        self._restore()


def _agreed_signal(received: int | None) -> tuple[int | None, bool]:
    """``(signal, here)``: the signal to stop on and whether THIS process received it.

    With several processes every one must stop after the same block (the checkpoint and
    the next block are collectives), so the processes pool what they received at every
    block boundary (a collective) and all stop if any of them was signalled.
    """
    if jax.process_count() == 1:
        return received, received is not None
    from jax.experimental import multihost_utils

    pooled = multihost_utils.process_allgather(np.asarray([received or 0], np.int32))
    pooled = np.asarray(pooled).reshape(-1)
    pooled = pooled[pooled != 0]
    if received is not None:
        return received, True
    return (int(pooled[0]), False) if pooled.size else (None, False)


@jax.jit
def _all_finite(tree: PyTree) -> jax.Array:
    """True when every floating-point value in ``tree`` is finite."""
    flags = [
        jnp.all(jnp.isfinite(a))
        for a in jax.tree.leaves(tree)
        if jnp.issubdtype(a.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int; ValueError unless it is an integer >= ``minimum``.

    Integral floats (``1e3``) are accepted; ``2.5`` or ``True`` are not: ``int()`` would
    silently truncate them.
    """
    if isinstance(value, bool):
        as_int = None
    elif isinstance(value, (int, np.integer)):
        as_int = int(value)
    elif isinstance(value, (float, np.floating)) and float(value).is_integer():
        as_int = int(value)
    else:
        as_int = None
    if as_int is None:
        raise ValueError(f"{name} = {value!r} is invalid: it must be an integer >= {minimum}.")
    if as_int < minimum:
        raise ValueError(f"{name} = {value} is invalid: it must be >= {minimum}.")
    return as_int


def _run_identity(sim: Simulation, data, hparams: HParams, seed: int) -> dict[str, Any]:
    """What fixes a run's trajectory; a resumed run must agree on all of it."""
    identity = {
        "algorithm": sim.algorithm.name,
        "num_clients": int(data.num_clients),
        "clients_per_round": sim.clients_per_round,
        "weighting": sim.weighting,
        "plan": repr(sim.plan),
        "seed": int(seed),
        "hparams": {k: np.asarray(v).tolist() for k, v in hparams._asdict().items()},
    }
    return json.loads(json.dumps(identity))  # the form it has after a JSON round trip


def _format_hparams(values: dict[str, Any]) -> str:
    """``client_lr=0.1, ...`` with float32 values printed as float32 (0.1, not 0.100000001)."""
    return ", ".join(f"{k}={np.asarray(v, np.float32)[()]!s}" for k, v in values.items())


def _check_same_run(saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
    if saved is None:
        return  # written by checkpoint.save() directly: nothing to compare

    def show(key, value):
        if key == "hparams" and isinstance(value, dict):
            return f"({_format_hparams(value)})"
        return repr(value)

    diffs = [
        f"{k}: {show(k, saved.get(k))} in the checkpoint, {show(k, v)} now"
        for k, v in current.items()
        if saved.get(k) != v
    ]
    if diffs:
        raise ValueError(
            f"cannot resume from {where}: it belongs to a different run ({'; '.join(diffs)}). "
            "Resume with the same algorithm, data, batch plan, S, weighting, hparams and "
            "seed, or start a new run in another checkpoint directory."
        )


CLIENT_CHUNK_BYTES = 16 * 2**20
"""Working-set budget of one chunk of clients on CPU (``client_chunk="auto"``), sized so
that a chunk's K local steps run from a server core's L2/L3 caches."""


def balanced_chunk(num: int, chunk: int) -> int | None:
    """A chunk size of at most ``chunk`` that splits ``num`` evenly when it can.

    The largest divisor of ``num`` in ``[chunk / 2, chunk]``, else ``ceil(num / n)`` for the
    fewest chunks n; None when one chunk holds all ``num``.
    """
    if chunk >= num:
        return None
    for size in range(chunk, max(1, chunk // 2) - 1, -1):
        if num % size == 0:
            return size
    return -(-num // -(-num // chunk))


class Simulation:
    """A federated simulation of one algorithm on one problem with a fixed round shape.

    Everything that fixes the SHAPE of the program (the algorithm, the batch plan, S, the
    weighting) is given here; everything that is data (hyper-parameters, state, the dataset,
    the key) is passed to the compiled functions, so changing a step size or the seed never
    recompiles.

    Args:
      algorithm: an :class:`~scaffold_jax.types.Algorithm`.
      problem: the :class:`~scaffold_jax.types.Problem` (initial params and loss).
      plan: the :class:`~scaffold_jax.data.batching.BatchPlan` of the local steps.
      clients_per_round: S.
      weighting: ``"uniform"`` (the paper's 1/|S| averaging) or ``"num_examples"``.
      eval_batch_size: examples per chunk in the jitted evaluation.
      client_chunk: how many sampled clients run in one vmapped chunk of the round:
        ``"auto"`` (all S on an accelerator, cache-sized chunks on CPU; see
        :meth:`resolve_client_chunk`), None (all S) or a number of clients.

    Examples:
      >>> import numpy as np, scaffold_jax as sj
      >>> rng = np.random.default_rng(0)
      >>> data = sj.data.from_client_arrays(
      ...     [{"x": rng.normal(size=(n, 4)).astype("float32"), "y": rng.integers(0, 3, n)}
      ...      for n in (5, 8, 6)])
      >>> problem = sj.models.logistic_regression((4,), 3)
      >>> sim = sj.Simulation(sj.scaffold(problem.loss_fn), problem,
      ...                     sj.BatchPlan.fixed(batch_size=4, num_steps=3), clients_per_round=2)
      >>> result = sim.run(data, sj.hparams(client_lr=0.1), num_rounds=4, eval_every=2)
      >>> [r["round"] for r in result.records]
      [0, 2, 4]
    """

    def __init__(
        self,
        algorithm: Algorithm,
        problem: Problem,
        plan: BatchPlan,
        clients_per_round: int,
        weighting: str = "uniform",
        eval_batch_size: int = 4096,
        client_chunk: int | str | None = "auto",
    ):
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan, got {type(plan).__name__}.")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r} is unknown; use one of {WEIGHTINGS}.")
        self.algorithm = algorithm
        self.problem = problem
        self.plan = plan
        self.clients_per_round = _check_count("clients_per_round (S)", clients_per_round)
        self.weighting = weighting
        self.eval_batch_size = _check_count("eval_batch_size", eval_batch_size)
        if not (client_chunk is None or (isinstance(client_chunk, str) and client_chunk == "auto")):
            try:
                client_chunk = _check_count("client_chunk", client_chunk)
            except ValueError:
                raise ValueError(
                    f"client_chunk = {client_chunk!r} is invalid: use 'auto', None (all S "
                    "clients in one vmap) or a number of clients per chunk >= 1."
                ) from None
        self.client_chunk = client_chunk
        self.round = jax.jit(self.round_fn, donate_argnums=(1,))
        self.run_rounds = jax.jit(
            self.run_rounds_fn, static_argnames=("num_rounds",), donate_argnums=(1,)
        )
        self.evaluate = jax.jit(self.evaluate_fn)

    # ----------------------------------------------------------------- the pure programs
    def round_fn(
        self, hparams: HParams, state: SimState, data, key: jax.Array, *, configs: int = 1
    ):
        """One round (pure; :attr:`round` is its jitted, state-donating version).

        ``configs``: how many configurations run this round side by side under an outer
        ``vmap`` (a sweep's block); they share the CPU chunk budget (see
        :meth:`resolve_client_chunk`).
        """
        num_clients, num_sampled = data.num_clients, self.clients_per_round
        round_key, ids = round_key_and_ids(key, state.round, num_clients, num_sampled)
        # The _constrain calls are layout hints, no-ops here (see scaffold_jax.sharding):
        # the table is read and written with the REPLICATED ids; the clients' work is split
        # over devices by position in the sampled set.
        ids = self._constrain(ids, "replicated")
        keys = client_keys(round_key, ids)
        work_ids, keys = self._constrain((ids, keys), "sampled")
        rows = self._constrain(take_rows(state.clients, ids), "sampled")

        def client_work(client_id, client_key, row):
            # Batches are drawn inside each client's work so that a chunk gathers only its
            # own clients' examples (the working set stays chunk-sized).
            batches, mask = data.client_batches(client_id, client_key, self.plan)
            return self.algorithm.client_update(
                hparams, state.server, row, batches, mask, client_key
            )

        chunk = self.resolve_client_chunk(data, configs)
        if chunk is None:
            new_rows, outputs = jax.vmap(client_work)(work_ids, keys, rows)
        else:
            new_rows, outputs = jax.lax.map(
                lambda args: client_work(*args), (work_ids, keys, rows), batch_size=chunk
            )
        if self.weighting == "num_examples":
            weights = data.counts[ids].astype(jnp.float32)
            total_weight = jnp.sum(data.counts.astype(jnp.float32))
        else:
            weights = jnp.ones((num_sampled,), jnp.float32)
            total_weight = jnp.asarray(num_clients, jnp.float32)
        outputs = outputs._replace(weight=weights)
        server = self.algorithm.server_update(hparams, state.server, outputs, total_weight)
        clients = set_rows(state.clients, ids, self._constrain(new_rows, "replicated"))
        metrics = {k: jnp.mean(v) for k, v in outputs.metrics.items()}
        metrics["client_ids"] = ids
        # Client drift: mean ‖y_i − x‖ and the norm of the aggregated update ‖Δx‖.
        metrics["client_drift"] = jnp.mean(jnp.sqrt(jax.vmap(sq_norm)(outputs.delta_params)))
        metrics["update_norm"] = jnp.sqrt(sq_norm(weighted_mean(outputs.delta_params, weights)))
        new_state = SimState(server=server, clients=clients, round=state.round + 1)
        return self._constrain(new_state, "state"), self._constrain(metrics, "replicated")

    def resolve_client_chunk(self, data, configs: int = 1) -> int | None:
        """How many sampled clients one vmapped chunk of the round runs (None: all S).

        ``client_chunk="auto"`` picks None on an accelerator, where one kernel over all S
        clients is fastest, and on CPU as many clients as fit :data:`CLIENT_CHUNK_BYTES`
        of working set (their ``[K, B, ...]`` batches, one step's batch in float32 and
        four params-sized buffers), so that a chunk's K steps run in cache instead of
        streaming ``[S, params]`` buffers through memory at every step (measured in
        benchmarks/README.md: W3 SCAFFOLD 2.7x faster). The chunk is balanced (the
        largest divisor of S in [chunk/2, chunk] when there is one): ``lax.map`` runs a
        remainder as one more, separately compiled, vmap. Results equal the unchunked
        round up to the order of floating-point sums. ``configs`` configurations vmapped
        side by side (a sweep) share the budget: each chunk holds all of them.
        """
        num_sampled = self.clients_per_round
        if self.client_chunk is None:
            return None
        if self.client_chunk != "auto":
            return None if self.client_chunk >= num_sampled else self.client_chunk
        if jax.default_backend() != "cpu":
            return None
        batches, _ = jax.eval_shape(lambda: data.client_batches(jnp.int32(0), jr.key(0), self.plan))
        per_client = sum(
            math.prod(a.shape) * a.dtype.itemsize + 4 * math.prod(a.shape[1:])
            for a in jax.tree.leaves(batches)
        ) + 4 * sum(4 * math.prod(jnp.shape(a)) for a in jax.tree.leaves(self.problem.params))
        return balanced_chunk(num_sampled, max(1, CLIENT_CHUNK_BYTES // (per_client * configs)))

    def _constrain(self, tree: PyTree, layout: str) -> PyTree:
        """Sharding hook of :meth:`round_fn`: returns ``tree`` unchanged.

        :class:`scaffold_jax.sharding.ShardedSimulation` overrides it to pin ``layout``:
        ``"replicated"`` (on every device), ``"sampled"`` (``[S, ...]`` leaves split over
        the mesh's client axis) or ``"state"`` (a :class:`SimState`: table rows split,
        server and round replicated).
        """
        del layout
        return tree

    def run_rounds_fn(self, hparams: HParams, state: SimState, data, key, num_rounds: int):
        """``num_rounds`` rounds as one ``lax.scan``; metrics gain a leading ``[R]`` axis."""

        def body(state, _):
            return self.round_fn(hparams, state, data, key)

        return jax.lax.scan(body, state, None, length=num_rounds)

    def evaluate_fn(self, server_state: PyTree, data) -> dict[str, jax.Array]:
        """Centralised metrics of the server model x, batched over the whole sets.

        ``test_loss`` / ``test_accuracy`` on ``data.test`` (when present) and ``train_loss``,
        the federated objective f(x) = (1/N) Σ_i f_i(x) (Σ_i n_i f_i / Σ_i n_i under
        ``weighting="num_examples"``), when the data are materialised.
        """
        params = self.algorithm.server_params(server_state)
        out = {}
        if getattr(data, "test", None) is not None:
            out["test_loss"] = jnp.mean(self._per_example(self.problem.loss_fn, params, data.test))
            if self.problem.accuracy_fn is not None:
                out["test_accuracy"] = jnp.mean(
                    self._per_example(self.problem.accuracy_fn, params, data.test)
                )
        if hasattr(data, "examples"):
            losses = self._per_example(self.problem.loss_fn, params, data.examples)
            n = losses.shape[0]
            owner = jnp.repeat(jnp.arange(data.num_clients), data.counts, total_repeat_length=n)
            sums = jax.ops.segment_sum(losses, owner, num_segments=data.num_clients)
            if self.weighting == "num_examples":
                out["train_loss"] = jnp.sum(sums) / n
            else:
                out["train_loss"] = jnp.mean(sums / data.counts.astype(jnp.float32))
        return out

    def _per_example(self, fn: Callable, params: PyTree, examples: PyTree) -> jax.Array:
        """``fn`` over all examples in chunks (``lax.map``), without copying the data."""
        n = jax.tree.leaves(examples)[0].shape[0]
        size = min(self.eval_batch_size, n)
        num_chunks = math.ceil(n / size)

        def chunk(i):
            # The last chunk is clamped to end at n; its overlap with the previous chunk is
            # dropped below, so every example counts exactly once.
            start = jnp.minimum(i * size, n - size)
            batch = jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=0), examples
            )
            return fn(params, batch).astype(jnp.float32)

        values = jax.lax.map(chunk, jnp.arange(num_chunks))  # [num_chunks, size]
        if num_chunks * size == n:
            return values.reshape(-1)
        head = values[:-1].reshape(-1)
        tail = values[-1, num_chunks * size - n :]
        return jnp.concatenate([head, tail])

    # ----------------------------------------------------------------- the host-side API
    def init(self, data) -> SimState:
        """Checks the set-up against ``data`` and returns the initial :class:`SimState`."""
        self.check(data)
        return init_state(self.algorithm, self.problem.params, data.num_clients)

    def check(self, data) -> None:
        """Raises ValueError naming the problem if the simulation cannot run on ``data``."""
        if not all(hasattr(data, a) for a in ("num_clients", "counts", "client_batches")):
            raise TypeError(
                "data must be a federated dataset (a FederatedData, e.g. from "
                "scaffold_jax.from_client_arrays, or a procedural dataset with num_clients, "
                f"counts and client_batches); got {type(data).__name__}."
            )
        num_clients = data.num_clients
        if self.clients_per_round > num_clients:
            raise ValueError(
                f"clients_per_round (S) = {self.clients_per_round} exceeds the number of "
                f"clients N = {num_clients}; use S <= N."
            )
        counts = np.asarray(data.counts)
        if counts.min() < 1:
            empty = np.flatnonzero(counts < 1)[:5].tolist()
            raise ValueError(f"clients {empty} have no data; every client needs >= 1 example.")
        self._check_problem_fits(data)
        self._check_labels(data)

    def _check_labels(self, data) -> None:
        """Integer labels of materialised data must index the problem's C classes."""
        num_classes = getattr(self.problem, "num_classes", None)
        if num_classes is None:
            return
        sets = {"the clients' examples": getattr(data, "examples", None)}
        sets["the test set"] = getattr(data, "test", None)
        for where, examples in sets.items():
            if not isinstance(examples, Mapping) or "y" not in examples:
                continue
            if not getattr(examples["y"], "is_fully_addressable", True):
                continue  # spread over processes: each process checks its own input data
            labels = np.asarray(examples["y"])
            if not np.issubdtype(labels.dtype, np.integer) or labels.size == 0:
                continue
            bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
            if bad.size:
                wider = (
                    ""
                    if labels.min() < 0
                    else f", or build the model with num_classes > {labels.max()}"
                )
                raise ValueError(
                    f"labels must be class indices in [0, {num_classes}) for this model: "
                    f"label {labels[bad[0]]} at index {bad[0]} of {where} ({bad.size} labels "
                    f"out of range). Remap the labels to 0..{num_classes - 1}{wider}."
                )

    def _check_problem_fits(self, data) -> None:
        batches, mask = jax.eval_shape(
            lambda: data.client_batches(jnp.int32(0), jr.key(0), self.plan)
        )
        batch = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), batches)
        try:
            out = jax.eval_shape(self.problem.loss_fn, self.problem.params, batch)
        except Exception as err:  # flax, optax and jnp each raise their own error types
            shapes = jax.tree.map(lambda s: (tuple(s.shape), str(s.dtype)), batch)
            params = jax.tree.map(lambda a: tuple(jnp.shape(a)), self.problem.params)
            raise ValueError(
                "the model's params do not fit the data: loss_fn(params, batch) failed for a "
                f"batch with shapes {shapes} and params with shapes {params}. Build the model "
                f"for the data's example shape and number of classes. ({err})"
            ) from err
        if tuple(out.shape) != tuple(mask.shape[1:]):
            raise ValueError(
                f"loss_fn must return one loss per example, shape {tuple(mask.shape[1:])}; it "
                f"returned shape {tuple(out.shape)}. Return per-example losses, not a mean."
            )
        test = getattr(data, "test", None)
        if test is not None:
            # Evaluation runs the loss on the test set too; a set the model cannot read would
            # otherwise fail deep inside the compiled evaluation with a flax or KeyError.
            structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), test)
            try:
                jax.eval_shape(self.problem.loss_fn, self.problem.params, structs)
            except Exception as err:
                shapes = jax.tree.map(lambda s: (tuple(s.shape), str(s.dtype)), structs)
                train = jax.tree.map(lambda s: (tuple(s.shape[1:]), str(s.dtype)), batch)
                raise ValueError(
                    f"the test set does not fit the model: loss_fn(params, test) failed for a "
                    f"test set with shapes {shapes} (training batches: {train}). Give the "
                    f"test set the fields and example shape of the training data. ({err})"
                ) from err

    def run(
        self,
        data,
        hparams: HParams,
        num_rounds: int,
        eval_every: int | None = None,
        seed: int = 0,
        state: SimState | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        resume: bool = False,
    ) -> RunResult:
        """Runs ``num_rounds`` rounds, evaluating at the start and every ``eval_every`` rounds.

        Rounds between two evaluations (or checkpoints) run as ONE compiled ``lax.scan``.
        The root key is ``jax.random.key(seed)``; round r uses ``fold_in(root, r)``, so a
        run resumed from a state at round r continues exactly as an uninterrupted one.

        The schedule is anchored at the round the run started from, r0 (0 for a fresh run):
        evaluations at r0, r0 + E, r0 + 2E, ... and at the last round r0 + ``num_rounds``;
        checkpoints (with ``checkpoint_dir``) at r0 and every ``checkpoint_every`` rounds
        after it, and at the last round, so a finished run always leaves its final state.

        Resuming. ``resume=True`` restores the newest readable checkpoint in
        ``checkpoint_dir`` (falling back past corrupt ones with a warning, see
        :func:`scaffold_jax.checkpoint.restore_latest`) and continues the SAME run: pass the
        arguments of the interrupted call unchanged. ``num_rounds`` then still counts from
        r0, so the resumed call runs only the rounds left; the evaluation records restored
        from the checkpoint open ``records`` and ``callback`` sees only the new ones. The
        final state is bitwise identical to an uninterrupted run's. A checkpoint written by
        another configuration (algorithm, data, plan, S, weighting, hparams, seed, shapes)
        is refused with ``ValueError``. A sharded simulation
        (:class:`~scaffold_jax.sharding.ShardedSimulation`) restores the state directly in
        its mesh layout (client table split, server replicated).

        Signals. While it runs, SIGINT and SIGTERM are deferred: the current compiled block
        finishes, a checkpoint is saved (with ``checkpoint_dir``), then SIGINT raises a
        plain ``KeyboardInterrupt`` and SIGTERM a :class:`RunTerminated` (a ``SystemExit``
        with code 143), each carrying the result so far, ``status="interrupted"``, as its
        ``result`` attribute. A second signal acts at once (and carries no result). The
        previous handlers are restored when ``run`` returns or raises. With several
        processes (``jax.distributed``) a signal received by any of them stops all of them
        after the same block: they pool what they received at every block boundary.

        Divergence. After every block the server state is checked; NaN or Inf stops the run
        with :class:`DivergenceError` (a ``ValueError``) naming the round, the algorithm and
        the step sizes, and carrying the result so far (``status="diverged"``). We raise
        rather than return: a single run that diverged is almost always a mistake to be
        seen, and a grid search can catch it and read ``err.result``. (Vectorised sweeps
        flag divergence per config instead; see :mod:`scaffold_jax.sweep`.) The diverged
        state is never checkpointed.

        Args:
          data: a federated dataset (:class:`~scaffold_jax.data.FederatedData` or a
            procedural one).
          hparams: an :class:`HParams` (build it with :func:`scaffold_jax.hparams`).
          num_rounds: rounds to run from r0 (>= 1).
          eval_every: evaluation period E in rounds (default: ``num_rounds``).
          seed: the root seed.
          state: a state to continue from (default: a fresh :meth:`init`). It is donated.
            Not with ``resume=True``.
          callback: called with each evaluation record as it is made.
          checkpoint_dir: where to save checkpoints (see :mod:`scaffold_jax.checkpoint`).
            Without ``resume`` it must not hold checkpoints already.
          checkpoint_every: checkpoint period in rounds (default: at every evaluation).
          keep_checkpoints: how many of the newest checkpoints to keep.
          resume: continue from the newest checkpoint in ``checkpoint_dir``.

        Returns:
          A :class:`RunResult` with ``status="finished"``.

        Raises:
          ValueError: bad arguments, data that do not fit, a checkpoint directory already
            in use, or a checkpoint of another run.
          FileNotFoundError: ``resume=True`` and no checkpoint in ``checkpoint_dir``.
          scaffold_jax.checkpoint.CheckpointError: every checkpoint there is corrupt.
          DivergenceError: the server state became NaN or Inf.
          KeyboardInterrupt: SIGINT (after the current block and its checkpoint).
          RunTerminated: SIGTERM (after the current block and its checkpoint).
        """
        num_rounds = _check_count("num_rounds", num_rounds)
        eval_every = _check_count("eval_every", num_rounds if eval_every is None else eval_every)
        seed = _check_count("seed", seed, minimum=0)
        check_hparams(hparams)
        for name, value in hparams._asdict().items():
            if np.ndim(value) != 0:
                raise ValueError(
                    f"hparams.{name} has shape {np.shape(value)}: Simulation.run takes scalar "
                    "hyper-parameters; use scaffold_jax.sweep to run a grid of them."
                )
        if checkpoint_dir is None:
            if resume:
                raise ValueError("resume=True needs the checkpoint_dir to resume from.")
            if checkpoint_every is not None:
                raise ValueError(
                    f"checkpoint_every = {checkpoint_every} was given without a checkpoint_dir "
                    "to save in."
                )
        else:
            checkpoint_every = _check_count(
                "checkpoint_every", eval_every if checkpoint_every is None else checkpoint_every
            )
            keep_checkpoints = _check_count("keep_checkpoints", keep_checkpoints)
        if resume and state is not None:
            raise ValueError(
                "pass either state= (continue from a state in memory) or resume=True "
                "(continue from the checkpoint), not both."
            )

        self.check(data)
        identity = _run_identity(self, data, hparams, seed)
        ckpt = None
        if checkpoint_dir is not None:
            from scaffold_jax.checkpoint import Checkpointer  # orbax is an optional extra

            ckpt = Checkpointer(checkpoint_dir, max_to_keep=keep_checkpoints)
        try:
            return self._run(
                data,
                hparams,
                num_rounds,
                eval_every,
                seed,
                state,
                callback,
                ckpt,
                checkpoint_every,
                resume,
                identity,
            )
        finally:
            if ckpt is not None:
                ckpt.close()

    def _run(
        self,
        data,
        hparams: HParams,
        num_rounds: int,
        eval_every: int,
        seed: int,
        state: SimState | None,
        callback: Callable[[dict[str, Any]], None] | None,
        ckpt,
        checkpoint_every: int | None,
        resume: bool,
        identity: dict[str, Any],
    ) -> RunResult:
        """The body of :meth:`run` once the arguments and data are checked and ``ckpt`` is
        open."""
        key = jr.key(seed)
        records: list[dict[str, Any]] = []
        resumed_from = None
        seconds_before = 0.0  # run time spent by the process(es) before a resume
        start = 0
        if resume:
            # Restored straight into this simulation's layout (a sharded one's shardings):
            # the compiled blocks and evaluation then see the layout a fresh run has.
            restored = ckpt.restore_latest(self._state_like(data.num_clients))
            _check_same_run(restored.extra.get("identity"), identity, str(restored.path))
            state, key, resumed_from = restored.state, restored.key, restored.round
            records = list(restored.extra.get("records", []))
            seconds_before = float(restored.extra.get("seconds", 0.0))
            start = int(restored.extra.get("start_round", 0))
        else:
            if ckpt is not None and ckpt.latest_round() is not None:
                raise ValueError(
                    f"checkpoint_dir {ckpt.directory} already holds checkpoints (the newest "
                    f"at round {ckpt.latest_round()}); pass resume=True to continue that run "
                    "or use an empty directory."
                )
            if state is None:
                state = init_state(self.algorithm, self.problem.params, data.num_clients)
            start = int(state.round)
        end = start + num_rounds
        current = int(state.round)
        if current > end:
            raise ValueError(
                f"the checkpoint is at round {current}, past the end of this run (round "
                f"{end} = {start} + num_rounds {num_rounds}); pass a larger num_rounds."
            )

        compile_seconds = 0.0
        compiled = {}

        def program(length):
            nonlocal compile_seconds
            if length not in compiled:
                t0 = time.perf_counter()
                compiled[length] = self.run_rounds.lower(
                    hparams, state, data, key, num_rounds=length
                ).compile()
                compile_seconds += time.perf_counter() - t0
            return compiled[length]

        t0 = time.perf_counter()
        evaluate = self.evaluate.lower(state.server, data).compile()
        all_finite = _all_finite.lower(state.server).compile()
        compile_seconds += time.perf_counter() - t0

        all_metrics = []
        checkpoint_seconds = 0.0
        run_start = time.perf_counter()
        compile_before = compile_seconds

        def elapsed() -> float:
            spent = time.perf_counter() - run_start
            return seconds_before + spent - (compile_seconds - compile_before) - checkpoint_seconds

        def record():
            metrics = jax.device_get(evaluate(state.server, data))
            entry = {"round": int(state.round), **{k: float(v) for k, v in metrics.items()}}
            entry["seconds"] = elapsed()
            records.append(entry)
            if callback is not None:
                callback(entry)

        def save():
            nonlocal checkpoint_seconds
            t0 = time.perf_counter()
            extra = {
                "identity": identity,
                "start_round": start,
                "records": records,
                "seconds": elapsed(),
            }
            ckpt.save(state, key, extra)
            checkpoint_seconds += time.perf_counter() - t0

        def result(status):
            jax.block_until_ready(state)
            if all_metrics:
                metrics = {k: np.concatenate([m[k] for m in all_metrics]) for k in all_metrics[0]}
                client_ids = metrics.pop("client_ids")
            else:
                metrics = {}
                client_ids = np.zeros((0, self.clients_per_round), np.int32)
            run_seconds = time.perf_counter() - run_start - (compile_seconds - compile_before)
            return RunResult(
                state=state,
                records=records,
                client_ids=client_ids,
                round_metrics=metrics,
                compile_seconds=compile_seconds,
                run_seconds=run_seconds - checkpoint_seconds,
                status=status,
                resumed_from=resumed_from,
                checkpoint_seconds=checkpoint_seconds,
            )

        def due(r: int, every: int) -> bool:
            return r == end or (r - start) % every == 0

        def next_point(r: int, every: int) -> int:
            return min(end, start + ((r - start) // every + 1) * every)

        def stop_if_signalled(signals: _DeferredSignals) -> None:
            received, here = _agreed_signal(signals.received)
            if received is None:
                return
            if ckpt is not None and ckpt.latest_round() != current:
                save()
            where = (
                f"checkpoint at round {current} in {ckpt.directory}"
                if ckpt is not None
                else "no checkpoint_dir, nothing saved"
            )
            name = signal.Signals(received).name
            by = "" if here else " by another process"
            message = f"{name} received{by}: stopped after round {current} ({where})."
            partial = result("interrupted" if current < end else "finished")
            if received == signal.SIGTERM:
                raise RunTerminated(message, partial)
            # A plain KeyboardInterrupt, not a subclass: only then does an uncaught one make
            # Python exit "killed by SIGINT" (status 130), which is what lets a shell loop
            # around the command stop on Ctrl-C.
            interrupt = KeyboardInterrupt(message)
            interrupt.result = partial
            raise interrupt

        with _DeferredSignals() as signals:
            if resumed_from is None:
                record()
                if ckpt is not None:
                    save()  # so that resume=True works even if round r0 + 1 is never reached
            while current < end:
                stop_if_signalled(signals)
                boundary = next_point(current, eval_every)
                if ckpt is not None:
                    boundary = min(boundary, next_point(current, checkpoint_every))
                block_start = current
                state, metrics = program(boundary - current)(hparams, state, data, key)
                metrics = jax.device_get(metrics)
                all_metrics.append(metrics)
                current = boundary
                if not bool(all_finite(state.server)):
                    self._diverged(result("diverged"), hparams, block_start, current, metrics)
                if due(current, eval_every):
                    record()
                if ckpt is not None and due(current, checkpoint_every):
                    save()
            # A signal during the last block (or before a run with nothing left to do) is
            # still honoured: the caller asked to stop whatever comes after this run.
            stop_if_signalled(signals)
        return result("finished")

    def _state_like(self, num_clients: int) -> SimState:
        """The state's shapes and dtypes for ``num_clients`` (``jax.ShapeDtypeStruct``
        leaves): what ``run(resume=True)`` restores a checkpoint into. A sharded simulation
        adds its shardings, so the state is restored already placed."""
        return jax.eval_shape(lambda: init_state(self.algorithm, self.problem.params, num_clients))

    def _diverged(self, result: RunResult, hparams: HParams, first: int, last: int, metrics):
        """Raises :class:`DivergenceError` for a block (rounds ``first``..``last``)."""
        bad = np.flatnonzero(~np.isfinite(np.asarray(metrics["update_norm"])))
        diverged_round = first + int(bad[0]) + 1 if bad.size else last
        steps = _format_hparams(hparams._asdict())
        raise DivergenceError(
            f"{self.algorithm.name} diverged: the server state holds NaN/Inf after round "
            f"{last} (the first non-finite update came from round {diverged_round}) with "
            f"{steps}. Lower client_lr or server_lr.",
            result,
            diverged_round,
        )
