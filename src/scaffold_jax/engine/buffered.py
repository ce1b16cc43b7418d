"""Asynchronous buffered aggregation, FedBuff (Nguyen et al., AISTATS 2022; see
the manual's page “The network model”),
as an execution mode of the engine: ``Simulation(..., execution=FedBuff(M, B))``.

M clients are in flight at all times (``concurrency``), each training from the model
current when it started; its upload arrives at its start time plus its duration on its
device (:mod:`scaffold_jax.participation.clock`). When B uploads have arrived
(``buffer_size``) the server steps: x^{t+1} = x^t + η_g Σ_j p_j s(τ_j) Δy_j / Σ_j p_j
over the B arrivals, with the staleness τ_j = t − t_j (t_j the version it started from),
s(τ) = 1/√(1+τ) (``staleness="sqrt"``) or 1 (``"constant"``) and p_j the client's weight
under the simulation's weighting, as a synchronous cohort's: p_j = 1 (``"uniform"``, the
default: the mean, 1/B) or its n_j examples (``"num_examples"``). SCAFFOLD's
c ← c + Σ_j p_j Δc_j / Σ_i p_i over all N clients ((1/N) Σ_j Δc_j uniformly; no staleness
weight, so c = Σ_i p_i c_i / Σ_i p_i holds), and every arriving client writes its state
(its c_i⁺). FedAsync is B = 1.

Vectorized: the in-flight table (:class:`InFlight`, ``[M, ...]``, in
:attr:`SimState.inflight <scaffold_jax.types.SimState>`: checkpointed and resumed with the
rest) holds each slot's client, start version, start and finish times, its computed
update, new client row and statistics, and whether its upload will count. A server step
is ONE program, the execution mode's ``step`` (:class:`FedBuff`; many of them fused into
a block like rounds), built from the synchronous round's own phases:

1. the availability model steps (once per server step, as once per round);
2. the B slots with the earliest finish times are the step's events (ties: the lower
   slot): uploads that arrive, or uploads lost (a dropout, a timeout at start + D, a slot
   no available client could start in), which count with weight 0;
3. the round's server side (:func:`scaffold_jax.engine.aggregation.server_side`) runs on
   them as a cohort of B with their weights p_j: the message pipeline (compression with
   each client's residual), the staleness weights on the sent Δy_j, the algorithm's own
   ``server_update``, the write-back of the reported clients' rows;
4. B replacements are drawn uniformly without replacement among the available clients
   not in flight once the events are out (their clients are eligible again); the
   replacement of the j-th event starts at its time, from x^t for the first B − 1 and
   from x^{t+1} for the B-th, and they train vmapped in the same program with the round's
   own client work (:func:`start_clients`: stragglers' steps, dropouts, the local work,
   the clock's durations at the size each upload is sent);
5. virtual time advances to the latest of the events' times (never backwards: a
   replacement that would finish before it is counted in the next step's buffer).

The first step first fills the table: M clients sampled at time 0 among the available,
trained from x^0 (:func:`first_clients`; a single run's round-0 record reports them as
its ``started_ids``). Each step's metrics: ``arrived_ids`` (−1: a free slot),
``arrival_staleness``, ``started_ids`` (−1: a slot left free) and, where uploads can be
lost, ``reported`` (``[B]``), ``staleness_mean``/``staleness_max``, ``version``,
``dropped``/``late`` (among the started), ``started_steps`` (stragglers) and the clock's
``round_duration`` (the seconds since the previous step); records carry
``virtual_time``, the steps' durations summed: their state's clock ``InFlight.now`` (up to
each duration's float32 rounding; :func:`scaffold_jax.engine.inflight.running_totals`).

Algorithms with an asynchronous contract (their registry entry says ``asynchronous``;
:func:`asynchronous_algorithms`): FedAvg, FedProx and SCAFFOLD; others are refused with
the reason. What FedBuff composes with is the compatibility matrix's
(:mod:`scaffold_jax.compatibility`): everything but over-selection (no synchronous
cohort) and differential privacy (no accountant covers buffers). On a client mesh the
in-flight table's rows are split over the devices like the client table's (where M
splits evenly; replicated otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from scaffold_jax.engine import aggregation, phases
from scaffold_jax.engine.axes import at_once
from scaffold_jax.engine.inflight import InFlight, initial_clients, start_key
from scaffold_jax.engine.keys import (
    AVAILABILITY_STREAM,
    client_keys,
    participation_key,
    server_key,
)
from scaffold_jax.engine.phases import Cohort, Draw
from scaffold_jax.participation.base import ModelSpec
from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options
from scaffold_jax.sampling import sample_available
from scaffold_jax.tree import all_finite, take_rows
from scaffold_jax.types import ClientOutput, ModelState, PyTree, SimState


def asynchronous_algorithms() -> list[str]:
    """The registered algorithms whose asynchronous contract is written (their registry
    entry's ``asynchronous``; see the manual's page “The network model”): FedAvg, FedProx,
    SCAFFOLD, and plugins'."""
    from scaffold_jax.algorithms import ALGORITHMS

    return sorted(name for name, spec in ALGORITHMS.items() if spec.asynchronous)


#: Staleness weightings s(τ).
STALENESS = ("sqrt", "constant")


@dataclasses.dataclass(frozen=True)
class FedBuff:
    """FedBuff's execution: ``concurrency`` M clients in flight, a server step every
    ``buffer_size`` B arrivals (1 <= B <= M; B = 1 is FedAsync), staleness weighting
    s(τ) = 1/√(1+τ) (``"sqrt"``) or 1 (``"constant"``)."""

    concurrency: int
    buffer_size: int
    staleness: str = "sqrt"

    def __post_init__(self):
        for name in ("concurrency", "buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} = {value!r} is invalid: it must be an integer >= 1.")
        if self.buffer_size > self.concurrency:
            raise ValueError(
                f"buffer_size B = {self.buffer_size} exceeds concurrency M = "
                f"{self.concurrency}: a step waits for B of the M clients in flight; use "
                "B <= M."
            )
        if self.staleness not in STALENESS:
            raise ValueError(
                f"staleness = {self.staleness!r} is invalid: use one of {', '.join(STALENESS)}."
            )

    name = "fedbuff"

    def step(self, ctx, hparams, state: SimState, data, key: jax.Array, diverged=None,
             configs=None):  # fmt: skip
        """One server step (:func:`server_steps`): the execution mode's round."""
        return server_steps(ctx, self, hparams, state, data, key, diverged, configs)

    def weight(self, staleness: jax.Array) -> jax.Array:
        """s(τ) (float32)."""
        if self.staleness == "constant":
            return jnp.ones(staleness.shape, jnp.float32)
        return jax.lax.rsqrt(1.0 + staleness.astype(jnp.float32))


def first_clients(participation, key: jax.Array, num_clients: int, concurrency: int) -> list:
    """The ids of the M clients the first step starts at time 0 (-1: a slot left free),
    as :func:`server_step` draws them: for the records, on the host."""
    available = None
    model = participation.availability
    if model is not None:
        _, available = model.step(
            model.init(num_clients),
            participation_key(jr.fold_in(key, 0), AVAILABILITY_STREAM),
            jnp.zeros((), jnp.int32),
            num_clients,
        )
    ids, present = initial_clients(key, num_clients, concurrency, available)
    return np.where(np.asarray(present), np.asarray(ids), -1).tolist()


class Started(NamedTuple):
    """Clients started on their local work: what the in-flight table keeps of them and
    the start's metrics (``dropped``, ``late``: uploads that will be lost)."""

    outputs: ClientOutput
    rows: PyTree
    stats: PyTree
    finish: jax.Array
    active: jax.Array
    reported: jax.Array
    steps: jax.Array | None
    metrics: dict[str, jax.Array]


def start_clients(ctx, hparams, servers, state: SimState, work, data, start) -> Started:
    """The clients of ``work`` = ``(ids, present, key, run_key)`` started at times ``start``
    from ``servers`` = ``(server states, the server's running statistics or None)``, one
    per client, stacked, and their rows of ``state``'s tables:
    the synchronous round's phases for them (stragglers' steps, dropouts, the local work)
    and the clock's finish times, a client slower than the deadline timing out at
    start + D."""
    (ids, present, key, run_key), (servers, server_stats) = work, servers
    draw = phases.draw_of(ctx, key, ids, present, state.participation, {})
    cohort = phases.drop_out(ctx, draw, phases.cohort(ctx, data, draw, run_key))
    own = None
    if state.model is not None and "clients" in state.model:
        own = take_rows(state.model["clients"], ids)
    rows_in = take_rows(state.clients, ids)
    rows = phases.Rows(state.clients, rows_in, rows_in, {}, own, own, None, None)
    from_servers = phases.PerClient(servers, server_stats)
    new_rows, outputs = phases.local_work(ctx, hparams, from_servers, rows, draw, cohort, data,
                                          None)  # fmt: skip
    spent = phases.durations(ctx, hparams, data, draw, cohort, run_key)
    deadline = ctx.participation.profiles.deadline
    reported = jnp.ones(ids.shape, bool) if cohort.present is None else cohort.present
    metrics = dict(cohort.metrics)
    if deadline is not None:
        late = spent > jnp.float32(deadline)
        metrics["late"] = jnp.sum(reported & late).astype(jnp.float32)
        reported = reported & ~late
        spent = jnp.minimum(spent, jnp.float32(deadline))
    active = jnp.ones(ids.shape, bool) if present is None else present
    stats = None if outputs.model_state is None else outputs.model_state.value
    outputs = outputs._replace(metrics={}, model_state=None)
    # A slot no client could start in stays free until the next step (``finish`` = now).
    finish = jnp.where(active, start + spent, start)
    steps = cohort.planned if ctx.participation.stragglers is not None else None
    return Started(outputs, new_rows, stats, finish, active, reported, steps, metrics)


def _broadcast(tree, count: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (count, *jnp.shape(a))), tree)


def _server_stats(state: SimState):
    return None if state.model is None else state.model.get("server")


def _fill(ctx, hparams, state: SimState, data, key, available) -> SimState:
    """Fills the table: M clients sampled at time 0 among the available, from x^0."""
    concurrency = state.inflight.ids.shape[0]
    ids, present = initial_clients(key, data.num_clients, concurrency, available)
    present = None if available is None else present
    servers = (_broadcast(state.server, concurrency),
               None if _server_stats(state) is None else _broadcast(_server_stats(state),
                                                                    concurrency))  # fmt: skip
    work = (ids, present, start_key(key), key)
    new = start_clients(ctx, hparams, servers, state, work, data,
                        jnp.zeros((concurrency,), jnp.float32))  # fmt: skip
    table = state.inflight._replace(
        ids=ids, version=jnp.zeros((concurrency,), jnp.int32),
        start=jnp.zeros((concurrency,), jnp.float32), finish=new.finish,
        outputs=new.outputs, rows=new.rows, active=new.active, reported=new.reported,
        stats=new.stats, downloads=jnp.sum(new.active).astype(jnp.int32),
    )  # fmt: skip
    return state._replace(inflight=table)


def server_step(ctx, execution: FedBuff, hparams, state: SimState, data, key: jax.Array):
    """One server step of FedBuff (see the module docstring): ``(state, metrics)``."""
    size = execution.buffer_size
    part_state, available, part_metrics = phases.availability(ctx, state, data, key)
    first = state.round == 0
    state = jax.lax.cond(
        first, lambda s: _fill(ctx, hparams, s, data, key, available), lambda s: s, state
    )
    table, version = state.inflight, state.round
    step_key = jr.fold_in(key, version)

    # 1. The B earliest events (a stable sort: ties go to the lower slot): uploads that
    # arrive, and uploads lost (a dropout, a timeout, a slot left free), which count nothing.
    slots = jnp.argsort(table.finish, stable=True)[:size]
    arrived = table.ids[slots]
    staleness = version - table.version[slots]
    arrival_time = table.finish[slots]
    reported = table.reported[slots]
    outputs = jax.tree.map(lambda a: a[slots], table.outputs)
    if table.stats is not None:
        outputs = outputs._replace(
            model_state=ModelState(jax.tree.map(lambda a: a[slots], table.stats), None)
        )
    new_rows = jax.tree.map(lambda a: a[slots], table.rows)

    # 2. The algorithm's server update on them as a cohort of B (the simulation's
    # weighting, as a synchronous round's: uniform 1 each of N, or n_i of Σ n_j, so c
    # stays the weighted mean of the c_i), through the same server side as a round.
    weights, total_weight = ctx.weights(data, arrived)
    losing = ctx.participation.availability is not None or ctx.participation.dropouts is not None
    present = reported if losing or ctx.participation.profiles.deadline is not None else None
    if present is not None:
        weights = jnp.where(present, weights, 0.0)
    draw = Draw(step_key, arrived, arrived, client_keys(step_key, arrived), None, part_state,
                {})  # fmt: skip
    cohort = Cohort(present, weights, total_weight, None, dict(part_metrics), present)
    shared = {"cohort_size": jnp.float32(size), "key": server_key(step_key)}
    rnd = aggregation.Round(draw, cohort, shared, state.round, execution.weight(staleness))
    rows = phases.gather(ctx, state, arrived, at_once, freeze=False)
    stepped, metrics = aggregation.server_side(
        ctx, rnd, hparams, state.server, state.server, rows, (new_rows, outputs), None
    )

    # 3. B replacements among the available clients not in flight; the first B - 1 from
    # x^t, the B-th from x^{t+1}.
    staying = jnp.ones(table.ids.shape, bool).at[slots].set(False) & table.active
    busy = jnp.zeros((data.num_clients,), bool).at[table.ids].max(staying)
    free = ~busy if available is None else available & ~busy
    started, found = sample_available(jr.fold_in(step_key, 5), free, size)
    last = jnp.arange(size) == size - 1

    def per_replacement(old, new):
        if old is None:
            return None
        return jax.tree.map(
            lambda a, b: jnp.where(last.reshape((size,) + (1,) * jnp.ndim(a)), b[None], a[None]),
            old, new,
        )  # fmt: skip

    servers = (per_replacement(state.server, stepped.server),
               per_replacement(_server_stats(state), _server_stats(stepped)))  # fmt: skip
    work = (started, None if available is None else found, step_key, key)
    new = start_clients(ctx, hparams, servers, stepped, work, data, arrival_time)
    versions = jnp.where(last, version + 1, version)
    now = jnp.maximum(table.now, jnp.max(arrival_time))

    def put(a, b):
        return a.at[slots].set(b)

    downloads = jnp.sum(new.active).astype(jnp.int32)
    uploads = jnp.sum(reported & table.active[slots]).astype(jnp.int32)
    new_table = InFlight(
        ids=put(table.ids, started), version=put(table.version, versions),
        start=put(table.start, arrival_time), finish=put(table.finish, new.finish),
        outputs=jax.tree.map(put, table.outputs, new.outputs),
        rows=jax.tree.map(put, table.rows, new.rows), now=now,
        active=put(table.active, new.active), reported=put(table.reported, new.reported),
        stats=None if table.stats is None else jax.tree.map(put, table.stats, new.stats),
        downloads=table.downloads + downloads, uploads=table.uploads + uploads,
    )  # fmt: skip
    metrics.update(new.metrics)
    if new.steps is not None:
        metrics["started_steps"] = new.steps.astype(jnp.float32)
    filled = jnp.where(first, table.downloads, 0).astype(jnp.float32)
    metrics.update(
        arrived_ids=jnp.where(table.active[slots], arrived, -1),
        arrival_staleness=staleness,
        started_ids=jnp.where(new.active, started, -1),
        staleness_mean=jnp.mean(staleness.astype(jnp.float32)),
        staleness_max=jnp.max(staleness).astype(jnp.float32),
        version=(version + 1).astype(jnp.float32),
        round_duration=now - table.now,
        downloads=downloads.astype(jnp.float32) + filled,
        uploads=uploads.astype(jnp.float32),
    )
    if present is not None:
        metrics["reported"] = present
    new_state = stepped._replace(inflight=new_table)
    return ctx.layout.constrain(new_state, "state"), metrics


#: How rounds run (``execution``, ``--execution``): ``sync`` (the paper's synchronous
#: rounds) or ``fedbuff`` (this module), with its declared options.
EXECUTIONS: Registry[ModelSpec] = Registry("execution")
EXECUTIONS.register("sync", ModelSpec(None))
EXECUTIONS.register(
    "fedbuff",
    ModelSpec(
        FedBuff,
        {
            # Trade-offs (more in flight or a bigger buffer costs bytes and staleness):
            # a sweep reports a row per value, not a "best".
            "concurrency": Option(
                10, "FedBuff: clients in flight at all times (M)", "int", low=1, tradeoff=True,
            ),
            "buffer_size": Option(
                5, "FedBuff: arrivals per server step (B <= M; 1: FedAsync)", "int", low=1,
                tradeoff=True,
            ),
            "staleness": Option(
                "sqrt", "FedBuff: staleness weight s(tau) of an update", "str",
                choices=STALENESS,
            ),
        },
    ),
)  # fmt: skip


def make_execution(name: str, options=None) -> FedBuff | None:
    """The execution ``name`` with its declared options (given, else their defaults);
    None for synchronous rounds."""
    spec = EXECUTIONS[name]
    if spec.build is None:
        return None
    values = resolve_options(spec.options, options or {})
    return spec.build(**factory_kwargs(spec.options, values))


def server_steps(ctx, execution: FedBuff, hparams, state: SimState, data, key, diverged=None,
                 configs=None):  # fmt: skip
    """:func:`server_step` as ``Simulation.round_fn`` runs it: for one config, or for a
    sweep's group of ``configs`` (vmapped: each config its own server, table and
    in-flight table; the step counter and the availability model shared). Which clients
    start and when does not depend on a config's step sizes (a compressor's sizes change
    the durations: each config times its own), so the configs of a seed see the same
    clients, as a synchronous sweep's do. With ``diverged`` (the sweep's freeze policy) a
    step whose new server state or new updates hold a NaN/Inf is not applied, nor any once
    the config diverged; the metrics gain ``finite``."""

    def one(hparams, state, diverged):
        new, metrics = server_step(ctx, execution, hparams, state, data, key)
        if diverged is None:
            return new, metrics
        finite = metrics["server_finite"] & all_finite(new.inflight.outputs)
        keep = finite & ~diverged
        fields = ("server", "clients", "inflight", "model", "messages")
        kept = jax.tree.map(
            lambda a, b: jnp.where(keep, a, b),
            tuple(getattr(new, f) for f in fields),
            tuple(getattr(state, f) for f in fields),
        )
        metrics["finite"] = finite
        return new._replace(**dict(zip(fields, kept, strict=True))), metrics

    if not configs:
        return one(hparams, state, diverged)
    per_config = SimState(server=0, clients=0, round=None, model=0, participation=None,
                          messages=0, inflight=0)  # fmt: skip
    axes = (0, per_config, None if diverged is None else 0)
    return jax.vmap(one, in_axes=axes, out_axes=(per_config, 0), axis_size=configs)(
        hparams, state, diverged
    )
