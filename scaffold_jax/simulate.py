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
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
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
    """S distinct client ids, uniformly without replacement (int32 ``[S]``)."""
    if clients_per_round == num_clients:
        return jr.permutation(key, num_clients).astype(jnp.int32)
    return jr.choice(key, num_clients, (clients_per_round,), replace=False).astype(jnp.int32)


def client_keys(round_key: jax.Array, ids: jax.Array) -> jax.Array:
    """Per-client keys derived from the client id (``[S]`` keys)."""
    clients_key = jr.split(round_key)[1]
    return jax.vmap(lambda i: jr.fold_in(clients_key, i))(ids)


def round_key_and_ids(key, round_index, num_clients, clients_per_round):
    round_key = jr.fold_in(key, round_index)
    ids = sample_clients(jr.split(round_key)[0], num_clients, clients_per_round)
    return round_key, ids


@dataclasses.dataclass
class RunResult:
    """What :meth:`Simulation.run` returns.

    Attributes:
      state: the final :class:`SimState`.
      records: one dict per evaluation (round, test/train metrics, elapsed seconds).
      client_ids: ``[R, S]`` int32, the clients sampled in every round (audit and replay).
      round_metrics: per-round metrics, each ``[R]``.
      compile_seconds: time spent compiling the round program(s) and the evaluation.
      run_seconds: wall time of the rounds and evaluations after compilation.
    """

    state: SimState
    records: list[dict[str, Any]]
    client_ids: np.ndarray
    round_metrics: dict[str, np.ndarray]
    compile_seconds: float
    run_seconds: float

    def final(self, name: str) -> float:
        return float(self.records[-1][name])


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
    ):
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan, got {type(plan).__name__}.")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r} is unknown; use one of {WEIGHTINGS}.")
        if int(clients_per_round) < 1:
            raise ValueError(
                f"clients_per_round (S) = {clients_per_round} is invalid: it must be >= 1."
            )
        self.algorithm = algorithm
        self.problem = problem
        self.plan = plan
        self.clients_per_round = int(clients_per_round)
        self.weighting = weighting
        self.eval_batch_size = int(eval_batch_size)
        self.round = jax.jit(self.round_fn, donate_argnums=(1,))
        self.run_rounds = jax.jit(
            self.run_rounds_fn, static_argnames=("num_rounds",), donate_argnums=(1,)
        )
        self.evaluate = jax.jit(self.evaluate_fn)

    # ----------------------------------------------------------------- the pure programs
    def round_fn(self, hparams: HParams, state: SimState, data, key: jax.Array):
        """One round (pure; :attr:`round` is its jitted, state-donating version)."""
        num_clients, num_sampled = data.num_clients, self.clients_per_round
        round_key, ids = round_key_and_ids(key, state.round, num_clients, num_sampled)
        keys = client_keys(round_key, ids)
        batches, mask = jax.vmap(lambda i, k: data.client_batches(i, k, self.plan))(ids, keys)
        rows = take_rows(state.clients, ids)
        new_rows, outputs = jax.vmap(
            self.algorithm.client_update, in_axes=(None, None, 0, 0, 0, 0)
        )(hparams, state.server, rows, batches, mask, keys)
        if self.weighting == "num_examples":
            weights = data.counts[ids].astype(jnp.float32)
            total_weight = jnp.sum(data.counts.astype(jnp.float32))
        else:
            weights = jnp.ones((num_sampled,), jnp.float32)
            total_weight = jnp.asarray(num_clients, jnp.float32)
        outputs = outputs._replace(weight=weights)
        server = self.algorithm.server_update(hparams, state.server, outputs, total_weight)
        clients = set_rows(state.clients, ids, new_rows)
        metrics = {k: jnp.mean(v) for k, v in outputs.metrics.items()}
        metrics["client_ids"] = ids
        # Client drift: mean ‖y_i − x‖ and the norm of the aggregated update ‖Δx‖.
        metrics["client_drift"] = jnp.mean(jnp.sqrt(jax.vmap(sq_norm)(outputs.delta_params)))
        metrics["update_norm"] = jnp.sqrt(sq_norm(weighted_mean(outputs.delta_params, weights)))
        return SimState(server=server, clients=clients, round=state.round + 1), metrics

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
            owner = jnp.repeat(
                jnp.arange(data.num_clients), data.counts, total_repeat_length=n
            )
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

    def run(
        self,
        data,
        hparams: HParams,
        num_rounds: int,
        eval_every: int | None = None,
        seed: int = 0,
        state: SimState | None = None,
        callback: Callable[[dict[str, Any]], None] | None = None,
    ) -> RunResult:
        """Runs ``num_rounds`` rounds, evaluating at round 0 and every ``eval_every`` rounds.

        Rounds between two evaluations run as ONE compiled ``lax.scan``. The root key is
        ``jax.random.key(seed)``; round r uses ``fold_in(root, r)``, so a run resumed from a
        state at round r continues exactly as an uninterrupted one.

        Args:
          data: a federated dataset (:class:`~scaffold_jax.data.FederatedData` or a
            procedural one).
          hparams: an :class:`HParams` (build it with :func:`scaffold_jax.hparams`).
          num_rounds: rounds to run (>= 1).
          eval_every: evaluation period E in rounds (default: ``num_rounds``).
          seed: the root seed.
          state: a state to continue from (default: a fresh :meth:`init`). It is donated.
          callback: called with each evaluation record as it is made.
        """
        if int(num_rounds) < 1:
            raise ValueError(f"num_rounds = {num_rounds} is invalid: it must be >= 1.")
        eval_every = int(num_rounds if eval_every is None else eval_every)
        if eval_every < 1:
            raise ValueError(f"eval_every = {eval_every} is invalid: it must be >= 1.")
        check_hparams(hparams)
        if state is None:
            state = self.init(data)
        else:
            self.check(data)
        key = jr.key(seed)
        compile_seconds = 0.0
        compiled = {}

        def program(length):
            nonlocal compile_seconds
            if length not in compiled:
                start = time.perf_counter()
                compiled[length] = self.run_rounds.lower(
                    hparams, state, data, key, num_rounds=length
                ).compile()
                compile_seconds += time.perf_counter() - start
            return compiled[length]

        start = time.perf_counter()
        evaluate = self.evaluate.lower(state.server, data).compile()
        compile_seconds += time.perf_counter() - start

        records, all_metrics = [], []
        run_start = time.perf_counter()
        compile_before = compile_seconds

        def record():
            metrics = jax.device_get(evaluate(state.server, data))
            entry = {"round": int(state.round), **{k: float(v) for k, v in metrics.items()}}
            entry["seconds"] = time.perf_counter() - run_start - (compile_seconds - compile_before)
            records.append(entry)
            if callback is not None:
                callback(entry)

        record()
        done = 0
        while done < num_rounds:
            length = min(eval_every, num_rounds - done)
            state, metrics = program(length)(hparams, state, data, key)
            all_metrics.append(jax.device_get(metrics))
            done += length
            record()
        jax.block_until_ready(state)
        run_seconds = time.perf_counter() - run_start - (compile_seconds - compile_before)
        round_metrics = {
            k: np.concatenate([m[k] for m in all_metrics]) for k in all_metrics[0]
        }
        client_ids = round_metrics.pop("client_ids")
        return RunResult(
            state=state,
            records=records,
            client_ids=client_ids,
            round_metrics=round_metrics,
            compile_seconds=compile_seconds,
            run_seconds=run_seconds,
        )

