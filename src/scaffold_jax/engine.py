"""The pure programs of a simulation: init, sample, round, multi-round scan, evaluate.

A round is one pure function ``round(hparams, state, data, key) -> (state, metrics)``:

1. ``round_key = fold_in(key, state.round)``; sample S of N clients uniformly without
   replacement; client i's key is ``fold_in(clients_key, i)`` (``clients_key`` split from
   the round key), so what a client does depends on its id, never on its position in the
   sampled set or on how the client axis is laid out.
2. gather the sampled rows of the client table; if the algorithm has a ``pre_round`` pass
   (Mime), every sampled client first sends a message computed on its whole local data
   at x and the server takes their mean; then draw each client's batches and run
   ``vmap(client_update)`` over the S clients;
3. aggregate with the algorithm's pure ``server_update``; if the algorithm has a
   ``client_sync`` step (Scaffnew), every sampled client then updates its row from the new
   server state; scatter the new rows back.
   A model's running statistics (``SimState.model``, BatchNorm's) go to every sampled
   client's local steps (the server's, or the client's own row) and come back averaged
   with the round's weights, or written back to the clients' rows
   (``Problem.state_policy``).

A sampler of varying cohorts (Poisson sampling) returns ``(ids, present)``: the round keeps
its fixed width, and a row whose ``present`` is False has weight 0, keeps its client row
and statistics and is left out of the round's metrics (on CPU a chunk of such rows is
skipped). ``server_update`` may also take the round's expected cohort ``cohort_size`` and
its own ``key`` (:func:`server_key`): differential privacy's noised sum
(:mod:`scaffold_jax.privacy`) divides by the first and draws its noise from the second.

Participation models (:mod:`scaffold_jax.participation`) use the same masked rows: an
availability model's ``[N]`` mask (its state in ``SimState.participation``) restricts the
sampler to the available clients, a straggler's step mask is cut after its K_i steps, and
a dropped client becomes a masked row after the pre-round pass. Their draws come from
:func:`participation_key`, a stream of their own.

An algorithm's ``warm_start`` pass (SCAFFOLD's warm controls) runs once over all N
clients when the initial state is built (:meth:`Simulation.warm_start_fn`).

Many rounds run as one loop (:func:`repeat_rounds`) inside one ``jit`` whose state
argument is donated, so the ``[N, ...]`` client table is updated in place. Nothing per
client or per step happens in Python. This module and :mod:`scaffold_jax.layout` are the
only ones that know the client axis; the host loop that runs these programs (evaluation
cadence, checkpoints, signals, divergence) is :mod:`scaffold_jax.loop`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from scaffold_jax import resources
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.layout import SingleDevice
from scaffold_jax.local import CLIENT_AXIS, takes
from scaffold_jax.participation import Participation
from scaffold_jax.sampling import (
    Sampler,
    check_sampler,
    privacy_sampling,
    split_sample,
    takes_availability,
    uniform,
)
from scaffold_jax.tree import (
    all_finite,
    masked_mean,
    set_rows,
    sq_norm,
    take_rows,
    tree_bytes,
    weighted_mean,
)
from scaffold_jax.types import (
    STATE_POLICIES,
    Algorithm,
    HParams,
    ModelState,
    Problem,
    PyTree,
    ServerOutput,
    SimState,
    resolve_hparams,
)
from scaffold_jax.weighting import WEIGHTINGS
from scaffold_jax.weighting import make as make_weighting

#: The plan of a full-data pass (:class:`~scaffold_jax.types.FullDataPass`): every example
#: of the client once, as one batch.
FULL_DATA = BatchPlan.full(1)


def over_clients(fn: Callable, args: PyTree, chunk: int | None, active: jax.Array | None = None):
    """``fn`` over the leading client axis of ``args``: one ``vmap`` (named
    :data:`~scaffold_jax.local.CLIENT_AXIS`), or a ``lax.map`` over chunks of ``chunk``
    clients, each chunk one such vmap (None: all at once).

    ``active`` (bool, one per client): a chunk with no active client is skipped and gives
    zeros (a Poisson round's padding: the caller discards those rows). Only chunks skip:
    one vmap over all clients runs them all."""
    vmapped = jax.vmap(fn, axis_name=CLIENT_AXIS)
    if chunk is None:
        return vmapped(*args)

    def each(body):
        if active is None:
            return lambda a: body(*a)

        def run(a):
            chunk_args, chunk_active = a
            zeros = jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(body, *chunk_args)
            )
            return jax.lax.cond(jnp.any(chunk_active), lambda: body(*chunk_args), lambda: zeros)

        return run

    mapped = args if active is None else (args, active)
    if chunk == 1:
        # Not chunks of one: that vmaps the body over an axis of one, whose batched dots
        # and convolutions XLA's CPU backend runs slower than the plain ones.
        return jax.lax.map(each(fn), mapped)
    # lax.map(batch_size=) would vmap the chunks without the axis name: chunk by hand.
    num = jax.tree.leaves(args)[0].shape[0]
    whole = num - num % chunk
    head = jax.tree.map(lambda a: a[:whole].reshape(whole // chunk, chunk, *a.shape[1:]), mapped)
    out = jax.lax.map(each(vmapped), head)
    out = jax.tree.map(lambda a: a.reshape(whole, *a.shape[2:]), out)
    if whole == num:
        return out
    tail = each(vmapped)(jax.tree.map(lambda a: a[whole:], mapped))
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, tail)


def check_count(
    name: str, value: Any, minimum: int = 1, maximum: int | None = None, why: str = ""
) -> int:
    """``value`` as an int; ValueError unless it is an integer >= ``minimum`` (and <=
    ``maximum`` when given; ``why`` is appended to that message, e.g. :data:`SEED_WHY`).

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
    if maximum is not None and as_int > maximum:
        raise ValueError(f"{name} = {value} is invalid: it must be <= {maximum}{why}.")
    return as_int


MAX_SEED = 2**32 - 1
"""The largest seed: ``jax.random.key(seed)`` keeps only a seed's low 32 bits, so seed
``2**32 + s`` would silently repeat the run of seed ``s``."""

SEED_WHY = " (jax.random.key keeps only the low 32 bits: a larger seed repeats a smaller one)"

MAX_ROUNDS = 10_000_000
"""The most rounds one run may take. The round counter is int32 (2**31 - 1 at most), and
well before that a run stops being practical: its metrics and sampled clients are kept for
every round in memory, ``(20 + 4 S)`` bytes a round, and the host loop plans its blocks of
rounds before compiling (2e9 rounds hung there, silently)."""

ROUNDS_WHY = (
    " (every round's metrics and sampled clients are kept in memory, and the blocks of "
    "rounds are planned before compiling)"
)


def initial_state(
    algorithm: Algorithm,
    params: PyTree,
    num_clients: int,
    problem: Problem | None = None,
    participation: Participation | None = None,
) -> SimState:
    """The initial :class:`SimState` as a pure (traceable) function: server state from
    ``params``, the single-client state broadcast to a ``[N, ...]`` table, round 0, the
    running statistics of ``problem``'s model (when it keeps any) as its
    ``state_policy`` says: the server's, or one copy per client, and the initial state of
    ``participation``'s availability model (when it has one)."""

    def table(tree):
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (num_clients, *jnp.shape(a))), tree)

    server, client = algorithm.init(params)
    model = None
    if problem is not None and problem.model_state is not None:
        stats = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), problem.model_state)
        model = (
            {"server": stats} if problem.state_policy == "average" else {"clients": table(stats)}
        )
    availability = None if participation is None else participation.availability
    return SimState(
        server=jax.tree.map(jnp.asarray, server),
        clients=table(client),
        round=jnp.zeros((), jnp.int32),
        model=model,
        participation=None if availability is None else availability.init(num_clients),
    )


def init_state(
    algorithm: Algorithm,
    params: PyTree,
    num_clients: int,
    layout: Any = None,
    problem: Problem | None = None,
    participation: Participation | None = None,
) -> SimState:
    """:func:`initial_state`, built by one jitted program directly in ``layout``.

    The table is allocated once (on a :class:`~scaffold_jax.layout.ClientMesh`, each
    device only its own block); no host copy of it is made, and the result never aliases
    ``params`` (donating the state leaves the caller's params alive).

    Raises:
      ValueError: the layout cannot hold ``num_clients`` rows (not a multiple of its
        devices).
    """
    layout = SingleDevice() if layout is None else layout
    layout.check_num_clients(num_clients)

    def build(params):
        return initial_state(algorithm, params, num_clients, problem, participation)

    shardings = layout.state_shardings(jax.eval_shape(build, params))
    if jax.process_count() == 1:
        return jax.jit(build, out_shardings=shardings)(params)
    # Several processes: the params are numpy constants closed over, so the program has no
    # inputs to place and every process runs it alike on the global mesh.
    constants = jax.tree.map(np.asarray, params)
    return jax.jit(lambda: build(constants), out_shardings=shardings)()


def client_keys(round_key: jax.Array, ids: jax.Array) -> jax.Array:
    """Per-client keys derived from the client id (``[S]`` keys)."""
    clients_key = jr.split(round_key)[1]
    return jax.vmap(lambda i: jr.fold_in(clients_key, i))(ids)


def shared_key(round_key: jax.Array) -> jax.Array:
    """The key every client of a round shares (``client_update``'s ``round_key=``, e.g.
    Scaffnew's number of local steps): the round key's third stream, after the two that
    ``split(round_key)`` gives the sampler and the clients (``split(k)[i]`` is
    ``fold_in(k, i)``), so it is independent of both."""
    return jr.fold_in(round_key, 2)


def round_key_and_ids(
    key, round_index, num_clients, clients_per_round, sampler=uniform, available=None
):
    """The round's key and its S client ids, drawn by ``sampler`` from the round key's
    first stream (:mod:`scaffold_jax.sampling`), among the ``available`` clients when a
    mask is given. A sampler of varying cohorts (or one drawing among the available) gives
    ``(ids, present)`` for the ids (see :func:`~scaffold_jax.sampling.split_sample`)."""
    round_key = jr.fold_in(key, round_index)
    extra = {} if available is None else {"available": available}
    ids = sampler(jr.split(round_key)[0], round_index, num_clients, clients_per_round, **extra)
    return round_key, (ids if isinstance(ids, tuple) else jnp.asarray(ids, jnp.int32))


def server_key(round_key: jax.Array) -> jax.Array:
    """The key of the server's own randomness in a round (``server_update``'s ``key=``,
    e.g. differential privacy's noise): the round key's fourth stream, independent of the
    sampler's, the clients' and :func:`shared_key`'s."""
    return jr.fold_in(round_key, 3)


#: The participation models' streams of :func:`participation_key`.
AVAILABILITY_STREAM, STRAGGLER_STREAM, DROPOUT_STREAM = 0, 1, 2


def participation_key(round_key: jax.Array, stream: int) -> jax.Array:
    """The key of a participation model's draws in a round (``stream``: availability 0,
    stragglers 1, dropouts 2): the round key's fifth stream, split by model, so none of
    them moves the sampler's, the clients', :func:`shared_key`'s or :func:`server_key`'s
    draws (a run without them is today's, bitwise)."""
    return jr.fold_in(jr.fold_in(round_key, 4), stream)


def constants_key(key: jax.Array) -> jax.Array:
    """A key of the run that no round's key equals (the rounds fold in their index, which
    never reaches 2³² − 1): for what a participation model fixes per client for the whole
    run, such as a straggler's device speed."""
    return jr.fold_in(key, np.uint32(2**32 - 1))


def keep_absent(present: jax.Array | None, new: PyTree, old: PyTree) -> PyTree:
    """``new`` for the rows that take part, ``old`` for the masked-out ones."""
    if present is None or new is None:
        return new
    return jax.tree.map(
        lambda a, b: jnp.where(present.reshape(present.shape + (1,) * (a.ndim - 1)), a, b),
        new,
        old,
    )


def repeat_rounds(step: Callable, carry: PyTree, num_rounds: int, stop=None):
    """``num_rounds`` applications of ``step: carry -> (carry, metrics)``, metrics stacked
    on a leading ``[num_rounds]`` axis: a ``lax.scan``.

    With ``stop`` (a traced int <= ``num_rounds``) a ``lax.while_loop`` runs the first
    ``stop`` rounds only, writing each round's metrics into a ``[num_rounds]`` buffer
    (rows from ``stop`` on stay zero), so one compiled program serves blocks of any length
    up to ``num_rounds``: a run whose evaluation period does not divide its rounds, or
    whose checkpoints fall between evaluations, compiles once.
    """
    if stop is None:
        return jax.lax.scan(lambda c, _: step(c), carry, None, length=num_rounds)
    like = jax.eval_shape(step, carry)[1]
    buffer = jax.tree.map(lambda s: jnp.zeros((num_rounds, *s.shape), s.dtype), like)

    def body(loop):
        i, carry, buffer = loop
        carry, metrics = step(carry)
        write = lambda b, m: jax.lax.dynamic_update_index_in_dim(b, m, i, 0)  # noqa: E731
        return i + 1, carry, jax.tree.map(write, buffer, metrics)

    start = (jnp.zeros((), jnp.int32), carry, buffer)
    _, carry, buffer = jax.lax.while_loop(lambda loop: loop[0] < stop, body, start)
    return carry, buffer


def _has_primitive(jaxpr, name: str) -> bool:
    """Whether ``jaxpr`` or any jaxpr nested in its equations (custom_vjp, pjit, scan...)
    applies the primitive ``name``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(inner, "eqns") and _has_primitive(inner, name):
                    return True
    return False


def heldout_metrics(sim: Simulation, params: PyTree, data, model=None) -> dict[str, jax.Array]:
    """``test_loss`` and ``test_accuracy`` of ``params`` on ``data.test`` (when present);
    a model with running statistics uses :meth:`Simulation.mean_statistics`."""
    test = getattr(data, "test", None)
    if test is None:
        return {}
    if model is not None:
        model = {"server": sim.mean_statistics(model, data)}
    out = {"test_loss": jnp.mean(sim.per_example(sim.problem.loss_fn, params, test, model))}
    if sim.problem.accuracy_fn is not None:
        correct = sim.per_example(sim.problem.accuracy_fn, params, test, model)
        out["test_accuracy"] = jnp.mean(correct)
    return out


TRAIN_EVAL_EXAMPLES = 4096
"""Training examples the training objective is evaluated on by default (a fixed uniform
subsample; :func:`train_objective`)."""


def train_objective(sim: Simulation, params: PyTree, data, model=None) -> dict[str, jax.Array]:
    """``train_loss``, the federated objective f(x) = Σ_i p_i f_i(x) / Σ_j p_j under the
    simulation's weighting (uniform: (1/N) Σ_i f_i; ``"num_examples"``: the mean over all
    examples), over the training examples of materialised data.

    With ``sim.train_eval_examples = m`` smaller than the n training examples, it is
    estimated on a FIXED uniform subsample of m examples (the same at every evaluation, so
    curves compare like with like), each weighted by n/m times its weight in f
    (p_i / (Σ_j p_j n_i)): an unbiased estimate, at m/n of the cost of the full pass.
    ``None``: every example, the exact objective. Under the ``"local"`` statistics policy
    every example is evaluated with its own client's statistics.
    """
    if not hasattr(data, "examples"):
        return {}
    n = jax.tree.leaves(data.examples)[0].shape[0]
    m = sim.train_eval_examples
    if m is None or m >= n:
        owner = jnp.repeat(jnp.arange(data.num_clients), data.counts, total_repeat_length=n)
        losses = sim.per_example(sim.problem.loss_fn, params, data.examples, model, owner)
        sums = jax.ops.segment_sum(losses, owner, num_segments=data.num_clients)
        means = sums / data.counts.astype(jnp.float32)
        if sim.equal_weights:
            return {"train_loss": jnp.mean(means)}
        weights = sim.client_weights(data)
        return {"train_loss": jnp.sum(weights * means) / jnp.sum(weights)}
    # Static indices (n and m are shapes): a constant of the program, drawn once. Each
    # example's client is found from the clients' sorted row offsets.
    index = np.sort(np.random.default_rng(0).choice(n, m, replace=False)).astype(np.int32)
    examples = jax.tree.map(lambda a: a[index], data.examples)
    owner = jnp.searchsorted(data.offsets, index, side="right") - 1
    losses = sim.per_example(sim.problem.loss_fn, params, examples, model, owner)
    if sim.equal_weights:
        weight = 1.0 / (data.num_clients * data.counts[owner].astype(jnp.float32))
    else:  # example e of client i stands for p_i / (Σ_j p_j n_i) of the objective
        weights = sim.client_weights(data)
        weight = weights[owner] / (jnp.sum(weights) * data.counts[owner].astype(jnp.float32))
    return {"train_loss": (n / m) * jnp.sum(weight * losses)}


def client_metrics(sim: Simulation, params: PyTree, data, model=None) -> dict[str, jax.Array]:
    """Per-client accuracy of ``params`` on each client's own test examples
    (``data.client_test``; nothing when the data has none): over the clients with at least
    one test example, the mean (each client counts once), the example-weighted mean, the
    standard deviation, and ``client_accuracy_worst10``, the mean of the worst 10% of
    clients (⌈0.1 · clients⌉ of them). One pass over the client test examples, chunked
    like every evaluation, plus a segment sum. Under the ``"local"`` statistics policy
    each client is evaluated with its own statistics (FedBN's evaluation)."""
    tests = getattr(data, "client_test", None)
    if tests is None or sim.problem.accuracy_fn is None:
        return {}
    counts = data.client_test_counts
    n, num_clients = jax.tree.leaves(tests)[0].shape[0], counts.shape[0]
    owner = jnp.repeat(jnp.arange(num_clients), counts, total_repeat_length=n)
    correct = sim.per_example(sim.problem.accuracy_fn, params, tests, model, owner)
    hits = jax.ops.segment_sum(correct, owner, num_segments=num_clients)
    has = counts > 0
    num = jnp.sum(has).astype(jnp.float32)
    accuracy = jnp.where(has, hits / jnp.maximum(counts, 1).astype(jnp.float32), 0.0)
    mean = jnp.sum(accuracy) / num
    spread = jnp.sqrt(jnp.sum(jnp.where(has, jnp.square(accuracy - mean), 0.0)) / num)
    worst = jnp.sort(jnp.where(has, accuracy, jnp.inf))
    k = jnp.maximum(1.0, jnp.ceil(0.1 * num))
    in_worst = jnp.arange(num_clients, dtype=jnp.float32) < k
    return {
        "client_accuracy_mean": mean,
        "client_accuracy_weighted": jnp.sum(hits) / jnp.sum(counts).astype(jnp.float32),
        "client_accuracy_std": spread,
        "client_accuracy_worst10": jnp.sum(jnp.where(in_worst, worst, 0.0)) / k,
    }


#: What :meth:`Simulation.evaluate_fn` computes unless told otherwise.
DEFAULT_EVALUATORS = (heldout_metrics, train_objective, client_metrics)


class Simulation:
    """The compiled programs of one algorithm on one problem with a fixed round shape.

    Everything that fixes the SHAPE of the program (the algorithm, the batch plan, S, the
    weighting, the layout) is given here; everything that is data (hyper-parameters,
    state, the dataset, the key) is passed to the compiled functions, so changing a step
    size or the seed never recompiles. The host loop (:func:`scaffold_jax.loop.run`) runs
    them; ``scaffold_jax.Simulation`` (:class:`scaffold_jax.loop.Simulation`) is this class
    with a ``run`` method that calls it (the engine knows nothing of the loop above it).

    Args:
      algorithm: an :class:`~scaffold_jax.types.Algorithm`.
      problem: the :class:`~scaffold_jax.types.Problem` (initial params and loss).
      plan: the :class:`~scaffold_jax.data.batching.BatchPlan` of the local steps.
      clients_per_round: S.
      weighting: a registered weighting (:data:`scaffold_jax.weighting.WEIGHTINGS`):
        ``"uniform"`` (the paper's 1/|S| averaging), ``"num_examples"``, a plugin's.
      weighting_options: its options (given, else their declared defaults).
      eval_batch_size: examples per chunk in the jitted evaluation.
      client_chunk: how many sampled clients run in one vmapped chunk of the round:
        ``"auto"`` (all S on an accelerator or a client mesh, cache-sized chunks on CPU,
        one client at a time for a convolutional or recurrent model on CPU; see
        :meth:`resolve_client_chunk`), None (all S) or a number of clients.
      layout: where the client axis lives: :class:`~scaffold_jax.layout.SingleDevice`
        (default) or a :class:`~scaffold_jax.layout.ClientMesh`.
      evaluators: the evaluation functions ``fn(simulation, params, data) -> {name:
        scalar}`` traced into :meth:`evaluate_fn` (default :data:`DEFAULT_EVALUATORS`:
        test loss and accuracy, training objective).
      train_eval_examples: training examples the training objective (``train_loss``) is
        evaluated on: a fixed uniform subsample of this many (default
        :data:`TRAIN_EVAL_EXAMPLES`; an unbiased estimate, see :func:`train_objective`), or
        None for all of them. The mean loss of the clients' own local steps is in the
        round metrics (``local_loss``) whatever this is.
      sampler: which S clients take part in a round, ``sampler(key, round, N, S) -> ids``
        (:mod:`scaffold_jax.sampling`; default: the paper's uniform sampling without
        replacement; ``sampling.make(name, options)`` builds a registered one).
      participation: the clients' availability, stragglers and dropouts, a
        :class:`~scaffold_jax.participation.Participation` (``participation.make(...)``;
        default: every client always available, finishing its steps, never dropping).

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
        weighting_options: Mapping[str, Any] | None = None,
        eval_batch_size: int = 4096,
        client_chunk: int | str | None = "auto",
        layout: Any = None,
        evaluators: Sequence[Callable[..., Mapping[str, jax.Array]]] = DEFAULT_EVALUATORS,
        train_eval_examples: int | None = TRAIN_EVAL_EXAMPLES,
        sampler: Sampler | None = None,
        participation: Participation | None = None,
    ):
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a BatchPlan, got {type(plan).__name__}.")
        if not isinstance(weighting, str) or weighting not in WEIGHTINGS:
            raise ValueError(WEIGHTINGS.unknown_message(str(weighting)))
        self.algorithm = algorithm
        self.problem = problem
        self.plan = plan
        self.clients_per_round = check_count("clients_per_round (S)", clients_per_round)
        self.weighting = weighting
        self.weighting_options = dict(weighting_options or {})
        self._weigh = make_weighting(weighting, self.weighting_options)
        self.equal_weights = WEIGHTINGS[weighting].equal
        self.eval_batch_size = check_count("eval_batch_size", eval_batch_size)
        if not (client_chunk is None or (isinstance(client_chunk, str) and client_chunk == "auto")):
            try:
                client_chunk = check_count("client_chunk", client_chunk)
            except ValueError:
                raise ValueError(
                    f"client_chunk = {client_chunk!r} is invalid: use 'auto', None (all S "
                    "clients in one vmap) or a number of clients per chunk >= 1."
                ) from None
        self.client_chunk = client_chunk
        self.layout = SingleDevice() if layout is None else layout
        self.sampler = uniform if sampler is None else sampler
        if participation is None:
            participation = Participation()
        if not isinstance(participation, Participation):
            raise TypeError(
                "participation must be a scaffold_jax.participation.Participation (from "
                f"participation.make(...)), got {type(participation).__name__}."
            )
        self.participation = participation
        self.evaluators = tuple(evaluators)
        self.train_eval_examples = (
            None
            if train_eval_examples is None
            else check_count("train_eval_examples", train_eval_examples)
        )
        self.round = jax.jit(self.round_fn, donate_argnums=(1,))
        self.run_rounds = jax.jit(
            self.run_rounds_fn, static_argnames=("num_rounds",), donate_argnums=(1,)
        )
        self.evaluate = jax.jit(self.evaluate_fn)

    def replace(self, **changes: Any) -> Simulation:
        """A new simulation with some constructor arguments changed (e.g. ``layout=``)."""
        names = (
            "algorithm", "problem", "plan", "clients_per_round", "weighting",
            "weighting_options", "eval_batch_size", "client_chunk", "layout", "evaluators",
            "train_eval_examples", "sampler", "participation",
        )  # fmt: skip
        return type(self)(**{name: changes.get(name, getattr(self, name)) for name in names})

    # ----------------------------------------------------------------- the pure programs
    def round_fn(
        self,
        hparams: HParams,
        state: SimState,
        data,
        key: jax.Array,
        diverged: jax.Array | None = None,
        configs: int | None = None,
    ):
        """One round (pure; :attr:`round` is its jitted, state-donating version).

        ``configs``: M configs of one seed at once (a sweep's group): ``hparams``,
        ``state.server``, ``state.clients``, ``state.model`` and ``diverged`` carry a
        leading ``[M]`` axis, ``state.round`` and ``state.participation`` are shared. The
        configs share the round's sample, keys and minibatches (as their single runs
        draw them), and each sampled client runs the M configs' local steps side by side
        (client-major ``[S, M, ...]`` rows: the M configs' dots are one wider dot, with
        no per-step transpose); the per-config rest of the round is vmapped over M. The
        metrics gain the leading ``[M]`` axis.

        ``diverged``: for the sweep's freeze policy, this config's carried flag (a bool
        scalar). When given, a round whose new server state or new client rows hold a
        NaN/Inf is NOT applied (nor is any round once ``diverged`` is set): the state keeps
        its previous values, only the round counter advances, and the metrics gain
        ``finite``, whether this round's results were finite (the rows after the
        algorithm's ``client_sync`` step included). The metrics always hold
        ``server_finite``, whether the round's new server state is finite, and the
        metrics of a ``server_update`` that returns a
        :class:`~scaffold_jax.types.ServerOutput`.
        """
        num_clients, num_sampled = data.num_clients, self.clients_per_round
        layout = self.layout
        part = self.participation
        part_state, available, extra_metrics = state.participation, None, {}
        if part.availability is not None:
            part_state, available = part.availability.step(
                part_state,
                participation_key(jr.fold_in(key, state.round), AVAILABILITY_STREAM),
                state.round,
                num_clients,
            )
            extra_metrics["available"] = jnp.sum(available).astype(jnp.float32)
        round_key, sample = round_key_and_ids(
            key, state.round, num_clients, num_sampled, self.sampler, available
        )
        ids, present = split_sample(sample)
        # The table is read and written with the REPLICATED ids; the clients' work is split
        # over devices by position in the sampled set (no-ops on one device).
        ids = layout.constrain(ids, "replicated")
        keys = client_keys(round_key, ids)
        work_ids, keys = layout.constrain((ids, keys), "sampled")
        per_config = partial(_over_configs, configs) if configs else _at_once
        config_by_config = configs and self.configs_one_at_a_time(data)
        rows = per_config(take_rows, (0, None))(state.clients, ids)
        clients = state.clients
        if diverged is not None:
            # Writing the gathered rows back is a no-op that makes the table the round
            # updates depend on them: the gather is materialised before the in-place
            # scatter, which XLA would otherwise fuse into the late `where` below and pay
            # for with a copy of the whole table.
            clients = per_config(set_rows, (0, None, 0))(clients, ids, rows)
        rows_in = layout.constrain(rows, "sampled")
        # The model's running statistics: the server's (every client starts from them) or
        # each sampled client's own row.
        model = dict(state.model or {})
        stats_rows = (
            per_config(take_rows, (0, None))(model["clients"], ids) if "clients" in model else None
        )
        if diverged is not None and stats_rows is not None:
            # As for the client table above: no copy of the statistics table.
            model["clients"] = per_config(set_rows, (0, None, 0))(model["clients"], ids, stats_rows)
        stats_in = layout.constrain(stats_rows, "sampled")
        chunk = self.resolve_client_chunk(data)
        # The clients' local steps where chunks are sorted by them (see `sort` below): by
        # data size under an epochs plan, each straggler's completed steps K_i <= planned,
        # or constant when only the rows an availability model or dropouts mask out are
        # to go last.
        planned = None
        masked_last = part.availability is not None or part.dropouts is not None
        if part.stragglers is not None or (
            chunk is not None and (self.plan.steps_vary or masked_last)
        ):
            planned = self.plan.local_steps(data.counts[work_ids])
        if part.stragglers is not None:
            # The step mask of a straggler is cut after its K_i steps (client_work), and
            # the local loop stops there.
            planned = part.stragglers.steps(
                participation_key(round_key, STRAGGLER_STREAM), constants_key(key), ids, planned
            )
        weights, total_weight = self.weights(data, ids)
        if present is not None:
            weights = jnp.where(present, weights, 0.0)
        aggregation = {"cohort_size": jnp.float32(num_sampled), "key": server_key(round_key)}
        server_in = state.server
        if self.algorithm.pre_round is not None:

            def pre_round(hparams, server, rows):
                return self.full_data_pass(
                    self.algorithm.pre_round,
                    server,
                    rows,
                    work_ids,
                    weights,
                    data,
                    chunk,
                    {**aggregation, "hparams": hparams},
                )

            rows_in, server_in = per_config(pre_round)(hparams, state.server, rows_in)

        sampled = present  # the cohort (Poisson's slots, the available clients' draw)
        if part.dropouts is not None:
            # A client that drops after its local work is lost to the round: from here on
            # it is a masked row (after the pre-round pass, which it did send). Its work
            # could change nothing, so the chunks of dropped rows are skipped.
            dropped = part.dropouts.dropped(participation_key(round_key, DROPOUT_STREAM), ids)
            if present is not None:
                dropped = dropped & present
            extra_metrics["dropped"] = jnp.sum(dropped).astype(jnp.float32)
            present = ~dropped if present is None else present & ~dropped
            weights = jnp.where(present, weights, 0.0)

        algorithm = self.algorithm
        common = {}
        if takes(algorithm.client_update, "round_key"):
            common["round_key"] = shared_key(round_key)

        def client_work(client_id, client_key, row, stats, steps=None):
            # Batches are drawn inside each client's work so that a chunk gathers only its
            # own clients' examples (the working set stays chunk-sized).
            batches, mask = data.client_batches(client_id, client_key, self.plan)
            if steps is not None:  # a straggler: the steps after its K_i are empty
                done = jnp.arange(mask.shape[0]) < steps
                done = done.reshape(done.shape + (1,) * (mask.ndim - 1))
                mask = jnp.where(done, mask, jnp.zeros_like(mask))

            def update(hparams, server_in, row, stats, server_stats):
                extra = dict(common)
                if state.model is not None:
                    stats = server_stats if stats is None else stats
                    extra["model_state"] = ModelState(stats, self.problem.update_state)
                return algorithm.client_update(
                    hparams, server_in, row, batches, mask, client_key, **extra
                )

            # Every config of a group on the same batches, inside this client's work: side
            # by side (their dots one wider dot), or one after another where side by side
            # makes every convolution a grouped one (`configs_one_at_a_time`).
            over = one_after_another if config_by_config else per_config
            return over(update)(hparams, server_in, row, stats, model.get("server"))

        # The configs of a group run inside each client's work: rows client-major.
        to_clients = partial(_swap_leading, configs)
        work = (work_ids, keys, to_clients(rows_in), to_clients(stats_in))
        if part.stragglers is not None:
            work = (*work, layout.constrain(planned, "sampled"))
        # Clients of similar step counts side by side: a vmapped chunk's local loop runs as
        # long as its longest client (local_sgd stops after the last non-empty step), so
        # sorting by steps keeps the padded steps few (benchmarks/README.md, W6). Clients
        # run one at a time, or all in one vmap, gain nothing from it.
        sort = chunk is not None and chunk > 1 and planned is not None
        active = present
        if sort:
            steps = planned
            if present is not None:  # the masked-out rows last, in chunks of their own
                steps = jnp.where(present, steps, -1)
            order = jnp.argsort(-steps, stable=True)
            work = jax.tree.map(lambda a: a[order], work)
            active = None if present is None else present[order]

        def finish(
            hparams, server_in, server_before, new_rows, outputs, rows, clients, model,
            stats_rows, diverged,
        ):  # fmt: skip
            # The rest of the round: one config's (vmapped over a group's M configs).
            outputs = outputs._replace(weight=weights)
            new_model = None
            if state.model is not None:
                if not isinstance(outputs.model_state, ModelState):
                    raise ValueError(
                        f"{self.algorithm.name}'s client_update took model_state but returned no "
                        "ClientOutput.model_state: pass it to local_update / local_sgd (which "
                        "return it advanced) and put that in the output."
                    )
                stats_out = layout.constrain(
                    keep_absent(present, outputs.model_state.value, stats_rows), "replicated"
                )
                if "server" in model:
                    new_model = {"server": weighted_mean(stats_out, weights)}
                else:
                    new_model = {"clients": stats_out}
                outputs = outputs._replace(model_state=None)
            # What a server update may also take: the round's expected cohort S (differential
            # privacy divides by it, never by the realised count) and its own key.
            extra = {k: v for k, v in aggregation.items() if takes(algorithm.server_update, k)}
            server = algorithm.server_update(hparams, server_in, outputs, total_weight, **extra)
            server_metrics = {}
            if isinstance(server, ServerOutput):
                server, server_metrics = server
            if algorithm.client_sync is not None:
                # The sampled clients' step after aggregation, where their rows still are
                # (split over devices like their local work) and before they are written back.
                def sync(row, output):
                    return algorithm.client_sync(hparams, server_in, server, row, output)

                synced = (new_rows, layout.constrain(outputs, "sampled"))
                new_rows = over_clients(sync, synced, chunk)
            # A masked row's new values are dropped by the scatter below (set_rows' `write`).
            new_rows = layout.constrain(new_rows, "replicated")
            if present is None:
                mean = jnp.mean
            else:
                taking_part = present.astype(jnp.float32)

                def mean(values):
                    return masked_mean(values.astype(jnp.float32), taking_part)

            metrics = {k: mean(v) for k, v in outputs.metrics.items()}
            # The ids of the clients sampled (−1 only for a varying cohort's empty slots),
            # and with dropouts which of them reported: a user sees who dropped.
            metrics["client_ids"] = ids if sampled is None else jnp.where(sampled, ids, -1)
            if part.dropouts is not None:
                metrics["reported"] = present
            if present is not None:
                metrics["participants"] = jnp.sum(taking_part)
            if part.stragglers is not None:
                metrics["steps_taken"] = mean(planned.astype(jnp.float32))
            metrics.update(extra_metrics)
            # Client drift: mean ‖y_i − x‖ and the norm of the aggregated update ‖Δx‖.
            metrics["client_drift"] = mean(jnp.sqrt(jax.vmap(sq_norm)(outputs.delta_params)))
            metrics["update_norm"] = jnp.sqrt(sq_norm(weighted_mean(outputs.delta_params, weights)))
            # Whether this round's new server state is finite: the single run's divergence
            # check reports the first round where it is not (the update norm squares the
            # update, so it overflows rounds before the state does).
            metrics["server_finite"] = all_finite(server)
            taken = sorted(set(server_metrics) & {*metrics, "finite"})
            if taken:
                raise ValueError(
                    f"{algorithm.name}'s server_update reports the metric(s) {', '.join(taken)}, "
                    "which the clients or the engine already report: rename them."
                )
            metrics.update({k: jnp.asarray(v, jnp.float32) for k, v in server_metrics.items()})
            if diverged is not None:
                # Only the rows written back count (a masked row's values are discarded).
                finite = metrics["server_finite"] & all_finite(
                    (keep_absent(present, new_rows, rows), new_model)
                )
                keep = finite & ~diverged
                server = optax.tree.where(keep, server, server_before)
                new_rows = optax.tree.where(keep, new_rows, rows)
                if new_model is not None:
                    kept = (
                        {"server": model["server"]}
                        if "server" in model
                        else {"clients": stats_rows}
                    )
                    new_model = optax.tree.where(keep, new_model, kept)
                metrics["finite"] = finite
            clients = set_rows(clients, ids, new_rows, present)
            if new_model is not None and "clients" in new_model:
                new_model = {"clients": set_rows(model["clients"], ids, new_model["clients"])}
            new_state = SimState(
                server=server,
                clients=clients,
                round=state.round + 1,
                model=new_model,
                participation=part_state,
            )
            return layout.constrain(new_state, "state"), layout.constrain(metrics, "replicated")

        new_rows, outputs = over_clients(client_work, work, chunk, active)
        if sort:
            back = jnp.argsort(order)
            new_rows, outputs = jax.tree.map(lambda a: a[back], (new_rows, outputs))
        if configs:
            new_rows, outputs = to_clients((new_rows, outputs))
            new_state, metrics = _over_configs(configs, finish)(
                hparams, server_in, state.server, new_rows, outputs, rows, clients, model,
                stats_rows, diverged,
            )  # fmt: skip
            # The round counter and the participation state stay the group's, shared.
            shared = new_state._replace(round=state.round + 1, participation=part_state)
            return layout.constrain(shared, "state"), metrics
        return finish(
            hparams, server_in, state.server, new_rows, outputs, rows, clients, model,
            stats_rows, diverged,
        )  # fmt: skip

    def report(self, hparams: Mapping[str, Any], rounds: int, num_clients: int) -> dict:
        """The algorithm's host-side numbers for a record after ``rounds`` rounds with one
        config's ``hparams`` (a private run's ``dp_epsilon``; ``{}`` for most)."""
        if self.algorithm.report is None:
            return {}
        values = {k: float(np.asarray(v)) for k, v in hparams.items()}
        return dict(
            self.algorithm.report(
                values,
                rounds,
                num_clients,
                self.clients_per_round,
                privacy_sampling(self.sampler),
            )
        )

    def client_weights(self, data) -> jax.Array:
        """Every client's weight p_i (float32 ``[N]``) under the simulation's weighting."""
        return self._weigh(data.counts.astype(jnp.float32))

    def weights(self, data, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The aggregation weights of clients ``ids`` and the total weight of all N:
        ``(1, N)`` uniform, ``(n_i, Σ n_j)`` with ``weighting="num_examples"``."""
        if self.equal_weights:  # no [N] vector: a million procedural clients
            return jnp.ones(ids.shape, jnp.float32), jnp.asarray(data.num_clients, jnp.float32)
        weights = self.client_weights(data)
        return weights[ids], jnp.sum(weights)

    def full_data_pass(self, full_pass, server, rows, ids, weights, data, chunk, aggregation=None):
        """Runs a :class:`~scaffold_jax.types.FullDataPass` for clients ``ids`` (rows
        ``rows``): each on ALL its examples as one batch; returns the new rows and the
        server state the pass's server function makes from the weighted mean message.

        A server function with a ``messages`` parameter gets the clients' messages and
        weights themselves instead (``server(state, None, messages=..., weights=...)``,
        differential privacy's aggregation), and those of the ``aggregation`` keywords
        (``cohort_size``, ``key``, ``hparams``) it takes."""

        def one(client_id, row):
            batches, mask = data.client_batches(client_id, jr.key(0), FULL_DATA)
            batch = jax.tree.map(lambda a: a[0], batches)
            return full_pass.client(server, row, batch, mask[0])

        rows, messages = over_clients(one, (ids, rows), chunk)
        if takes(full_pass.server, "messages"):
            extra = {k: v for k, v in (aggregation or {}).items() if takes(full_pass.server, k)}
            return rows, full_pass.server(server, None, messages=messages, weights=weights, **extra)
        return rows, full_pass.server(server, weighted_mean(messages, weights))

    def warm_start_fn(self, state: SimState, data) -> SimState:
        """The state after the algorithm's ``warm_start`` pass over ALL N clients (the
        state itself when it has none). Clients run in chunks of S (or the round's CPU
        chunk), so the pass holds no more examples at once than a round does."""
        warm = self.algorithm.warm_start
        if warm is None:
            return state
        ids = jnp.arange(data.num_clients, dtype=jnp.int32)
        weights, _ = self.weights(data, ids)
        chunk = self.resolve_client_chunk(data) or min(self.clients_per_round, data.num_clients)
        clients, server = self.full_data_pass(
            warm, state.server, state.clients, ids, weights, data, chunk
        )
        return state._replace(server=server, clients=clients)

    def resolve_client_chunk(self, data, configs: int = 1) -> int | None:
        """How many sampled clients one vmapped chunk of the round runs (None: all S).

        ``client_chunk="auto"`` picks None on an accelerator or a layout that splits the
        clients over devices, where one kernel over all S clients is fastest, and on CPU
        as many clients as fit :data:`~scaffold_jax.resources.CLIENT_CHUNK_BYTES` of
        working set (their ``[K, B, ...]`` batches, one step's batch in float32 and four
        params-sized buffers), so that a chunk's K steps run in cache instead of streaming
        ``[S, params]`` buffers through memory at every step (measured in
        benchmarks/README.md), except for a model with convolutions or recurrences, which
        runs one client at a time on CPU (:meth:`one_client_at_a_time`). The chunk is
        balanced (the largest divisor of S in
        [chunk/2, chunk] when there is one): ``lax.map`` runs a remainder as one more,
        separately compiled, vmap. Results equal the unchunked round up to the order of
        floating-point sums. ``configs`` configurations vmapped side by side (a sweep's
        block) share the budget: a sweep asks for its chunk here and runs the round of
        ``replace(client_chunk=...)``.
        """
        num_sampled = self.clients_per_round
        if self.client_chunk is None or not self.layout.allows_client_chunks:
            return None
        if self.client_chunk != "auto":
            return None if self.client_chunk >= num_sampled else self.client_chunk
        if jax.default_backend() != "cpu":
            return None
        if self.one_client_at_a_time(data):
            return 1
        per_client = self.client_bytes(data) * configs
        budget = resources.CLIENT_CHUNK_BYTES
        return resources.balanced_chunk(num_sampled, max(1, budget // per_client))

    def one_client_at_a_time(self, data) -> bool:
        """Whether the loss contains a convolution or a loop (a recurrent model), read from
        its jaxpr once. On CPU such models run one client at a time: vmapped clients, each
        with its own kernels, make every convolution a grouped one and every recurrent
        matmul a batched one, which XLA's CPU backend runs several times slower than one
        client's own (benchmarks/README.md, W4 and W5)."""
        if not hasattr(self, "_one_at_a_time"):
            batches, _ = jax.eval_shape(
                lambda: data.client_batches(jnp.int32(0), jr.key(0), self.plan)
            )
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batches)
            jaxpr = jax.make_jaxpr(self.problem.loss_fn)(self.problem.params, batch).jaxpr
            self._one_at_a_time = any(
                _has_primitive(jaxpr, name) for name in ("conv_general_dilated", "scan", "while")
            )
        return self._one_at_a_time

    def configs_one_at_a_time(self, data) -> bool:
        """Whether a sweep runs its seeds, its configs (inside each client's work) and their
        evaluations one after another (``lax.map``) rather than vmapped: on CPU, for a model
        with convolutions or loops (:meth:`one_client_at_a_time`). Vmapped, each with its own
        kernels, they make every convolution a grouped one; on W4's CNN a sweep so vmapped
        took 6-7x the time of its configs run one by one (benchmarks/README.md)."""
        return jax.default_backend() == "cpu" and self.one_client_at_a_time(data)

    def client_bytes(self, data) -> int:
        """The working set of one sampled client's local steps, in bytes (see
        :meth:`resolve_client_chunk`)."""
        batches, _ = jax.eval_shape(lambda: data.client_batches(jnp.int32(0), jr.key(0), self.plan))
        return sum(
            math.prod(a.shape) * a.dtype.itemsize + 4 * math.prod(a.shape[1:])
            for a in jax.tree.leaves(batches)
        ) + 4 * sum(4 * math.prod(jnp.shape(a)) for a in jax.tree.leaves(self.problem.params))

    def run_rounds_fn(
        self, hparams: HParams, state: SimState, data, key, num_rounds: int, stop=None
    ):
        """``num_rounds`` rounds as one loop; metrics gain a leading ``[R]`` axis.

        ``stop``: when given (an int32 scalar <= ``num_rounds``, traced), only the first
        ``stop`` rounds run and the metrics' rows from ``stop`` on are zeros: one compiled
        program serves every block length up to ``num_rounds`` (the host loop's, whatever
        its evaluation and checkpoint cadence; see :func:`repeat_rounds`).
        """

        def body(state):
            return self.round_fn(hparams, state, data, key)

        return repeat_rounds(body, state, num_rounds, stop)

    def evaluate_fn(self, server_state: PyTree, data, model: PyTree = None) -> dict[str, jax.Array]:
        """Centralised metrics of the server model x: every evaluator's, merged (by default
        ``test_loss`` / ``test_accuracy`` on ``data.test`` and ``train_loss``).

        ``model``: the state's running statistics (``SimState.model``), for a problem that
        keeps them; an evaluator with a ``model`` parameter gets them (the built-in ones
        evaluate in inference mode with them, see :meth:`per_example`), others do not."""
        if model is None and self.problem.model_state is not None:
            raise ValueError(
                "the model keeps running statistics: evaluate it with them, "
                "evaluate(state.server, data, state.model)."
            )
        params = self.algorithm.server_params(server_state)
        out: dict[str, jax.Array] = {}
        for evaluator in self.evaluators:
            extra = {"model": model} if takes(evaluator, "model") else {}
            out.update(evaluator(self, params, data, **extra))
        return out

    def per_example(
        self,
        fn: Callable,
        params: PyTree,
        examples: PyTree,
        model: PyTree = None,
        owner: jax.Array | None = None,
    ) -> jax.Array:
        """``fn(params, batch) -> [B]`` over all examples in chunks of
        ``eval_batch_size`` (``lax.map``), without copying the data.

        With the running statistics ``model`` (``SimState.model``) it is called as
        ``fn(params, batch, state=...)``, in inference mode: with the server's statistics
        (``"average"``), with each example's own client's (``"local"``, given each
        example's client ``owner``: every example is then evaluated alone, vmapped), or,
        (for a test set of nobody's, pass ``{"server": mean_statistics(model, data)}``).
        """
        n = jax.tree.leaves(examples)[0].shape[0]
        if model is not None:
            return self._per_example_with_stats(fn, params, examples, model, owner)
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

    def mean_statistics(self, model: PyTree, data) -> PyTree:
        """The running statistics a model of nobody's is evaluated with: the server's, or
        under the ``"local"`` policy the clients' mean (uniform, or weighted by n_i under
        ``weighting="num_examples"``)."""
        if "server" in model:
            return model["server"]
        weights, _ = self.weights(data, jnp.arange(data.num_clients, dtype=jnp.int32))
        return weighted_mean(model["clients"], weights)

    def _per_example_with_stats(self, fn, params, examples, model, owner):
        if "server" in model:
            return self.per_example(partial(fn, state=model["server"]), params, examples)
        table = model["clients"]
        if owner is None:
            raise ValueError(
                "per_example with every client's own statistics needs each example's "
                "client (owner=); for examples of nobody's, pass {'server': "
                "simulation.mean_statistics(model, data)}."
            )

        def each(params, batch):
            def one(example):
                stats = take_rows(table, example["owner"][None])
                stats = jax.tree.map(lambda a: a[0], stats)
                single = jax.tree.map(lambda a: a[None], example["example"])
                return fn(params, single, state=stats)[0]

            return jax.vmap(one)(batch)

        return self.per_example(each, params, {"example": examples, "owner": owner})

    # ----------------------------------------------------------------- the host-side API
    def init(self, data) -> SimState:
        """Checks the set-up against ``data`` and returns the initial :class:`SimState`,
        placed in this simulation's layout."""
        self.check(data)
        state = init_state(
            self.algorithm,
            self.problem.params,
            data.num_clients,
            self.layout,
            self.problem,
            self.participation,
        )
        if self.algorithm.warm_start is None:
            return state
        shardings = self.layout.state_shardings(state)  # reads only the structure
        warm = jax.jit(self.warm_start_fn, donate_argnums=(0,), out_shardings=shardings)
        return warm(state, data)

    def state_like(self, num_clients: int) -> SimState:
        """The state's shapes, dtypes and (in a client mesh) shardings for ``num_clients``:
        what a checkpoint is restored into, already placed."""
        self.layout.check_num_clients(num_clients)
        like = jax.eval_shape(
            lambda: initial_state(
                self.algorithm, self.problem.params, num_clients, self.problem, self.participation
            )
        )
        shardings = self.layout.state_shardings(like)
        if shardings is None:
            return like
        return jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            like,
            shardings,
        )

    def check(self, data) -> None:
        """Raises ValueError naming the problem if the simulation cannot run on ``data``.

        Once ``data`` passed, checking it again is free (a command checks before its
        folder is made, then ``run`` checks as every caller's does)."""
        checked = getattr(self, "_checked", None)
        if checked is not None and checked() is data:
            return
        self._check(data)
        try:
            self._checked = weakref.ref(data)
        except TypeError:  # data that cannot be referenced weakly: checked every time
            self._checked = None

    def _check(self, data) -> None:
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
        if self.algorithm.check is not None:
            extra = {}
            if takes(self.algorithm.check, "sampling"):
                extra["sampling"] = privacy_sampling(self.sampler)
            if takes(self.algorithm.check, "participation"):
                extra["participation"] = self.participation
            self.algorithm.check(num_clients, self.clients_per_round, self.weighting, **extra)
        if self.sampler is not uniform:
            check_sampler(self.sampler, num_clients, self.clients_per_round)
        self._check_participation(num_clients)
        self._check_model_state()
        self._check_memory(data)
        counts = np.asarray(data.counts)
        if counts.min() < 1:
            empty = np.flatnonzero(counts < 1)[:5].tolist()
            raise ValueError(f"clients {empty} have no data; every client needs >= 1 example.")
        test = getattr(data, "test", None)
        leaves = jax.tree.leaves(test)
        if test is not None and leaves and np.ndim(leaves[0]) and np.shape(leaves[0])[0] == 0:
            raise ValueError(
                "the test set is empty (0 examples): give it at least one example, or build "
                "the data with test=None to run without a held-out evaluation."
            )
        self._check_problem_fits(data)
        self._check_labels(data)
        stragglers = self.participation.stragglers
        if stragglers is not None and hasattr(stragglers, "check"):
            # The most local steps a client takes (an epochs plan's: its largest client's).
            stragglers.check(int(self.plan.shape(int(counts.max()))[0]))

    def _check_participation(self, num_clients: int) -> None:
        availability = self.participation.availability
        if availability is None:
            return
        availability.check(num_clients)
        if not takes_availability(self.sampler):
            raise ValueError(
                f"the availability model {availability.name!r} needs a client sampler that "
                "draws among the available clients (one that takes available=, as 'uniform' "
                "and 'poisson' do); this sampler does not. Add an `available=None` keyword "
                "to it (scaffold_jax.sampling.sample_available draws S of them), or use "
                "availability = 'always'."
            )

    def _check_model_state(self) -> None:
        """Refuses a model with running statistics that this simulation cannot carry."""
        problem = self.problem
        if problem.model_state is None:
            return
        if problem.state_policy not in STATE_POLICIES:
            raise ValueError(
                f"Problem.state_policy={problem.state_policy!r} is unknown; use one of "
                f"{STATE_POLICIES}."
            )
        if problem.update_state is None:
            raise ValueError(
                "the problem has a model_state but no update_state: give "
                "update_state(params, state, batch, mask) -> state, the running statistics "
                "after a training forward pass (models.classification_problem builds it for "
                "a flax module)."
            )
        if not takes(self.algorithm.client_update, "model_state"):
            raise ValueError(
                f"{self.algorithm.name}'s client_update has no model_state parameter, so it "
                "cannot train a model with running statistics (BatchNorm's): add "
                "model_state=None to it and pass it to local_update / local_sgd (which "
                "advance it and return it in ClientOutput.model_state), or use a model "
                "without them (GroupNorm, LayerNorm)."
            )

    def _check_memory(self, data) -> None:
        """Refuses, before anything is compiled or allocated, a client table larger than the
        memory available for it (shapes from ``jax.eval_shape``: no allocation)."""
        num_clients = data.num_clients
        like = jax.eval_shape(
            lambda: initial_state(
                self.algorithm, self.problem.params, num_clients, self.problem, self.participation
            )
        )
        table = tree_bytes(like.clients)
        mesh = getattr(self.layout, "mesh", None)
        devices = list(np.asarray(mesh.devices).flat) if mesh is not None else [jax.devices()[0]]
        local = [d for d in devices if d.process_index == jax.process_index()] or devices
        # CPU "devices" of a process share its host memory; accelerators hold one block each.
        share = len(local) if local[0].platform == "cpu" else 1
        needed = table * share // len(devices)
        available = resources.available_memory_bytes(local[0])
        if needed <= available:
            return
        try:
            batches, _ = jax.eval_shape(
                lambda: data.client_batches(jnp.int32(0), jr.key(0), self.plan)
            )
            batch = (
                f"; one round's batches add {self.clients_per_round * tree_bytes(batches)} bytes"
            )
        except Exception:  # data that do not fit the plan: reported by the checks below
            batch = ""
        per = " per device" if share < len(devices) else ""
        raise ValueError(
            f"the client table of N = {num_clients} clients needs {needed} bytes "
            f"({resources.format_bytes(needed)}){per}, more than the {available} bytes "
            f"({resources.format_bytes(available)}) available{per} on {local[0].platform}"
            f"{batch}. Use "
            "fewer clients N or a smaller model, or split the table over more devices with a "
            "ClientMesh layout (scaffold_jax.layout)."
        )

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

    def resolve_hparams(self, hparams: HParams | Mapping[str, Any]) -> HParams:
        """``hparams`` completed with the algorithm's declared defaults and checked
        (see :func:`scaffold_jax.types.resolve_hparams`)."""
        return resolve_hparams(self.algorithm, hparams)


def _at_once(fn: Callable, in_axes: Any = 0) -> Callable:
    """``fn`` itself: a round of one config (see :func:`_over_configs`)."""
    del in_axes
    return fn


def _over_configs(configs: int, fn: Callable, in_axes: Any = 0) -> Callable:
    """``fn`` vmapped over a group's leading ``[M]`` config axis (``Simulation.round_fn``
    with ``configs``); what is not per config is closed over or given ``in_axes`` None.
    (``axis_size``: an algorithm without client state has an empty table.)"""
    return jax.vmap(fn, in_axes=in_axes, axis_size=configs)


def one_after_another(fn: Callable) -> Callable:
    """``fn`` mapped (``lax.map``) over the leading axis of every argument: a vmap that
    runs one slice at a time (a sweep's configs or seeds, see
    :meth:`Simulation.configs_one_at_a_time`)."""
    return lambda *args: jax.lax.map(lambda xs: fn(*xs), args)


def _swap_leading(configs: int | None, tree: PyTree) -> PyTree:
    """``[M, S, ...]`` ↔ ``[S, M, ...]`` for a group of configs (nothing for one config)."""
    if not configs or tree is None:
        return tree
    return jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), tree)
