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
rest) holds each slot's client, start version, start and finish times and its computed
update and new client row. A server step is ONE program, run where a synchronous round
runs (``round_fn``; many of them fused into a block like rounds):

1. the B slots with the earliest finish times arrive (ties: the lower slot);
2. the algorithm's own ``server_update`` aggregates their staleness-weighted updates as a
   cohort of B with their weights p_j, and their new rows are written to the client
   table;
3. B replacements are drawn uniformly without replacement among the clients not in
   flight once the arrivals are out (the arrived clients are eligible again); the
   replacement of the j-th arrival starts at that arrival's time, from x^t for the first
   B − 1 and from x^{t+1} for the B-th (the step happens at the B-th arrival), and they
   train vmapped in the same program;
4. virtual time advances to the latest of the arrivals' finish times (never backwards: a
   replacement that would finish before it is counted in the next step's buffer).

The first step first fills the table: M clients sampled at time 0, trained from x^0
(:func:`initial_clients`; a single run's round-0 record reports them as its
``started_ids``). Each step's metrics: ``arrived_ids``, ``arrival_staleness`` and
``started_ids`` (``[B]``), ``staleness_mean``/``staleness_max``, ``version`` and the
clock's ``round_duration`` (the seconds since the previous step); records carry
``virtual_time``, the steps' durations summed: their state's clock ``InFlight.now`` (up to
each duration's float32 rounding; :func:`running_totals`).

Algorithms with an asynchronous contract (their registry entry says ``asynchronous``;
:func:`asynchronous_algorithms`): FedAvg, FedProx and SCAFFOLD. Others are refused with
the reason, as are the participation models, the clock's deadline and over-selection
(FedBuff's own policy replaces them), message transforms (privacy, compression) and
running model statistics. On a client mesh the
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

from scaffold_jax.engine import aggregation
from scaffold_jax.engine.axes import over_clients
from scaffold_jax.engine.keys import client_keys, constants_key, server_key
from scaffold_jax.engine.phases import Cohort, Draw
from scaffold_jax.participation.base import ModelSpec
from scaffold_jax.registry import Option, Registry, factory_kwargs, resolve_options
from scaffold_jax.sampling import sample_available
from scaffold_jax.tree import all_finite, take_rows
from scaffold_jax.types import ClientOutput, PyTree, SimState


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

    def weight(self, staleness: jax.Array) -> jax.Array:
        """s(τ) (float32)."""
        if self.staleness == "constant":
            return jnp.ones(staleness.shape, jnp.float32)
        return jax.lax.rsqrt(1.0 + staleness.astype(jnp.float32))


class InFlight(NamedTuple):
    """The in-flight table: ``[M]`` slots, each a client training since ``start`` from the
    model of ``version``, arriving at ``finish`` with ``outputs`` (its Δy_i and message)
    and its new client row ``rows``; ``now`` the virtual time of the last step."""

    ids: jax.Array
    version: jax.Array
    start: jax.Array
    finish: jax.Array
    outputs: ClientOutput
    rows: PyTree
    now: jax.Array


def initial_inflight(algorithm, params, client_row, concurrency: int) -> InFlight:
    """An empty table of ``concurrency`` slots (filled by the first step)."""
    row = jax.tree.map(lambda a: jnp.zeros((concurrency, *jnp.shape(a)), jnp.result_type(a)),
                       client_row)  # fmt: skip
    like = {} if algorithm.uplink is None else algorithm.uplink(params)
    zeros = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jnp.zeros((concurrency, *jnp.shape(a)), jnp.float32), tree
    )
    outputs = ClientOutput(zeros(params), jnp.zeros((concurrency,), jnp.float32), {}, zeros(like))
    return InFlight(
        ids=jnp.zeros((concurrency,), jnp.int32),
        version=jnp.zeros((concurrency,), jnp.int32),
        start=jnp.zeros((concurrency,), jnp.float32),
        finish=jnp.zeros((concurrency,), jnp.float32),
        outputs=outputs,
        rows=row,
        now=jnp.zeros((), jnp.float32),
    )


def running_totals(execution: FedBuff, state: SimState) -> dict[str, float]:
    """The running totals of the records (``scaffold_jax.loop.RUNNING_TOTALS``) that a
    FedBuff state says itself after t steps: M + B·t clients downloaded (the M started at
    time 0, then B a step), B·t uploaded, and the clock's ``now`` seconds. ``{}`` at t = 0.
    A run continuing a state it did not return reads them here."""
    steps = int(state.round)
    if steps == 0:
        return {}
    size = execution.buffer_size
    return {
        "downloads": float(execution.concurrency + size * steps),
        "uploads": float(size * steps),
        "round_duration": float(state.inflight.now),
    }


def _train(sim, hparams, servers, clients, ids, key, run_key, data, start):
    """The clients ``ids`` trained from their ``servers`` (one server state per client,
    stacked) and their rows of ``clients``, with keys from ``key``: their outputs, new
    rows and finish times (``start`` plus their duration on their device, whose profile
    is drawn from the run's key ``run_key``, as a synchronous round's is)."""
    algorithm, plan = sim.algorithm, sim.plan
    keys = client_keys(key, ids)
    rows_in = take_rows(clients, ids)

    def work(client_id, client_key, row, server):
        batches, mask = data.client_batches(client_id, client_key, plan)
        return algorithm.client_update(hparams, server, row, batches, mask, client_key)

    chunk = sim.resolve_client_chunk(data)
    if chunk is not None and chunk >= ids.shape[0]:
        chunk = None
    new_rows, outputs = over_clients(work, (ids, keys, rows_in, servers), chunk)
    counts = data.counts[ids]
    examples = plan.examples(counts, plan.local_steps(counts))
    profiles = sim.participation.profiles
    per_client = sim.traffic()
    profile = profiles.profile(constants_key(run_key), ids)
    durations = profiles.durations(profile, per_client.down, per_client.up, examples)
    outputs = outputs._replace(metrics={}, model_state=None)
    return outputs, new_rows, start + durations


def _broadcast(server, count: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (count, *jnp.shape(a))), server)


def start_key(key: jax.Array) -> jax.Array:
    """The key of the first M clients' draw and work: a key of the run that no step's key
    (``fold_in(key, step)``) equals."""
    return jr.fold_in(key, np.uint32(2**32 - 2))


def initial_clients(key: jax.Array, num_clients: int, concurrency: int) -> jax.Array:
    """The M clients in flight at time 0, uniformly without replacement (int32 ``[M]``)."""
    ids, _ = sample_available(start_key(key), jnp.ones((num_clients,), bool), concurrency)
    return ids


def _start(sim, hparams, state: SimState, data, key) -> SimState:
    """Fills the table: M clients sampled at time 0, trained from x^0 (version 0)."""
    concurrency = sim.execution.concurrency
    ids = initial_clients(key, data.num_clients, concurrency)
    outputs, rows, finish = _train(
        sim, hparams, _broadcast(state.server, concurrency), state.clients, ids,
        start_key(key), key, data, jnp.zeros((concurrency,), jnp.float32),
    )  # fmt: skip
    table = InFlight(
        ids=ids,
        version=jnp.zeros((concurrency,), jnp.int32),
        start=jnp.zeros((concurrency,), jnp.float32),
        finish=finish,
        outputs=outputs,
        rows=rows,
        now=jnp.zeros((), jnp.float32),
    )
    return state._replace(inflight=table)


def server_step(sim, hparams, state: SimState, data, key: jax.Array):
    """One server step of FedBuff (see the module docstring): ``(state, metrics)``."""
    buff = sim.execution
    size, concurrency = buff.buffer_size, buff.concurrency
    first = state.round == 0
    state = jax.lax.cond(first, lambda s: _start(sim, hparams, s, data, key), lambda s: s, state)
    table, version = state.inflight, state.round
    step_key = jr.fold_in(key, version)

    # 1. The B earliest arrivals (a stable sort: ties go to the lower slot).
    slots = jnp.argsort(table.finish, stable=True)[:size]
    arrived = table.ids[slots]
    staleness = version - table.version[slots]
    arrival_time = table.finish[slots]
    outputs = jax.tree.map(lambda a: a[slots], table.outputs)
    outputs = outputs._replace(
        delta_params=jax.tree.map(
            lambda a: a * buff.weight(staleness).reshape((size,) + (1,) * (a.ndim - 1)),
            outputs.delta_params,
        )
    )
    new_rows = jax.tree.map(lambda a: a[slots], table.rows)

    # 2. The algorithm's server update on them as a cohort of B; their rows written back.
    draw = Draw(step_key, arrived, arrived, client_keys(step_key, arrived), None,
                state.participation, {})  # fmt: skip
    # The simulation's weighting, as a synchronous round's (uniform: 1 each, of N;
    # num_examples: n_i, of Σ n_j), so the update averages by p_j and c moves by
    # Σ p_j Δc_j / Σ_all p_i: c stays the weighted mean of the c_i.
    weights, total_weight = sim.weights(data, arrived)
    cohort = Cohort(None, weights, total_weight, None, {})
    shared = {"cohort_size": jnp.float32(size), "key": server_key(step_key)}
    rnd = aggregation.Round(draw, cohort, shared, None, False)
    rows = take_rows(state.clients, arrived)
    stepped, metrics = aggregation.server_side(
        sim, rnd, state.round, hparams, state.server, state.server, outputs, new_rows, rows,
        state.clients, None, None, None, None, None,
    )  # fmt: skip

    # 3. B replacements among the clients not in flight; the first B - 1 from x^t, the
    # B-th from x^{t+1}.
    staying = jnp.ones((concurrency,), bool).at[slots].set(False)
    busy = jnp.zeros((data.num_clients,), bool).at[table.ids].max(staying)
    started, _ = sample_available(jr.fold_in(step_key, 5), ~busy, size)
    last = jnp.arange(size) == size - 1

    def per_replacement(old, new):
        return jnp.where(last.reshape((size,) + (1,) * jnp.ndim(old)), new[None], old[None])

    servers = jax.tree.map(per_replacement, state.server, stepped.server)
    new_outputs, new_rows, finish = _train(
        sim, hparams, servers, stepped.clients, started, step_key, key, data, arrival_time
    )
    versions = jnp.where(jnp.arange(size) == size - 1, version + 1, version)
    now = jnp.maximum(table.now, jnp.max(arrival_time))

    def put(a, b):
        return a.at[slots].set(b)

    new_table = InFlight(
        ids=put(table.ids, started),
        version=put(table.version, versions),
        start=put(table.start, arrival_time),
        finish=put(table.finish, finish),
        outputs=jax.tree.map(put, table.outputs, new_outputs),
        rows=jax.tree.map(put, table.rows, new_rows),
        now=now,
    )
    metrics.update(
        arrived_ids=arrived,
        arrival_staleness=staleness,
        started_ids=started,
        staleness_mean=jnp.mean(staleness.astype(jnp.float32)),
        staleness_max=jnp.max(staleness).astype(jnp.float32),
        version=(version + 1).astype(jnp.float32),
        round_duration=now - table.now,
        downloads=jnp.float32(size) + jnp.where(first, jnp.float32(concurrency), 0.0),
    )
    new_state = stepped._replace(inflight=new_table)
    return sim.layout.constrain(new_state, "state"), metrics


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


def server_steps(sim, hparams, state: SimState, data, key, diverged=None, configs=None):
    """:func:`server_step` as ``Simulation.round_fn`` runs it: for one config, or for a
    sweep's group of ``configs`` (vmapped: each config its own server, table and
    in-flight table; the step counter shared). Which clients start and when does not
    depend on a config's hyper-parameters (their durations do not), so the configs of a
    seed see the same clients, as a synchronous sweep's do. With ``diverged`` (the sweep's
    freeze policy) a step whose new server state or new updates hold a NaN/Inf is not
    applied, nor any once the config diverged; the metrics gain ``finite``."""

    def one(hparams, state, diverged):
        new, metrics = server_step(sim, hparams, state, data, key)
        if diverged is None:
            return new, metrics
        finite = metrics["server_finite"] & all_finite(new.inflight.outputs)
        keep = finite & ~diverged
        kept = jax.tree.map(
            lambda a, b: jnp.where(keep, a, b),
            (new.server, new.clients, new.inflight),
            (state.server, state.clients, state.inflight),
        )
        metrics["finite"] = finite
        return new._replace(server=kept[0], clients=kept[1], inflight=kept[2]), metrics

    if not configs:
        return one(hparams, state, diverged)
    per_config = SimState(server=0, clients=0, round=None, model=None, participation=None,
                          messages=None, inflight=0)  # fmt: skip
    axes = (0, per_config, None if diverged is None else 0)
    return jax.vmap(one, in_axes=axes, out_axes=(per_config, 0), axis_size=configs)(
        hparams, state, diverged
    )
