"""The round as named phases, each a pure function; ``round_fn``
(:mod:`scaffold_jax.engine.round`) runs them in order.

1. :func:`sample`: the availability model's step, the sampler's S ids (with the cohort
   mask of a varying cohort), the clients' keys.
2. :func:`gather`: the sampled rows of the client table (and of the model's statistics and
   the message transforms' states, where kept per client).
3. :func:`cohort`: the aggregation weights and the clients' planned local steps (a
   straggler's cut short).
4. :func:`pre_round`: an algorithm's pass over each sampled client's whole data (Mime).
5. :func:`drop_out`: clients that drop after their local work become masked rows, and
   :func:`clock`: each client's duration on its device, the round's duration, and the
   clients a deadline or over-selection drops (masked rows too).
6. :func:`local_work`: every sampled client's local steps, vmapped (in chunks on CPU).
7. the server side, per config (``server_side`` in :mod:`scaffold_jax.engine.aggregation`):
   ``model_statistics``, ``client_messages`` (the message pipeline,
   :mod:`scaffold_jax.messages`), ``aggregate`` (the algorithm's ``server_update``),
   ``client_sync``, ``round_metrics``, ``freeze`` (a sweep's diverged configs) and
   ``scatter``.

A sweep's M configs of one seed (``configs``) share phases 1-5; the local work runs them
side by side inside each client's work, and the server side is vmapped over them
(:mod:`scaffold_jax.engine.axes`). A row whose client does not take part (a Poisson round's
empty slot, an unavailable or dropped client) has weight 0, keeps its table rows and is
left out of the metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.engine.axes import (
    at_once,
    one_after_another,
    over_clients,
    over_configs,
    swap_leading,
)
from scaffold_jax.engine.keys import (
    AVAILABILITY_STREAM,
    DROPOUT_STREAM,
    STRAGGLER_STREAM,
    client_keys,
    constants_key,
    extra_batches_key,
    participation_key,
    round_key_and_ids,
    server_key,
    shared_key,
)
from scaffold_jax.local import every_step_runs, takes
from scaffold_jax.messages import MessageContext
from scaffold_jax.sampling import split_sample
from scaffold_jax.tree import set_rows, take_rows, weighted_mean
from scaffold_jax.types import ModelState, PyTree, SimState

#: The plan of a full-data pass (:class:`~scaffold_jax.types.FullDataPass`): every example
#: of the client once, as one batch.
FULL_DATA = BatchPlan.full(1)


class Draw(NamedTuple):
    """The round's sample: the round key, the sampled ids (replicated, for the table) and
    the same ids and keys laid out for the clients' work, the cohort mask (None: every
    row takes part), the availability model's new state, the sample's metrics and the
    run's constants (:func:`run_constants`; empty where the execution mode gives none)."""

    round_key: jax.Array
    ids: jax.Array
    work_ids: jax.Array
    keys: jax.Array
    sampled: jax.Array | None
    participation: PyTree
    metrics: dict[str, jax.Array]
    run: Mapping[str, Any] = {}


def reporting_ids(draw: Draw) -> jax.Array:
    """The round's row ids as the message transforms read them: −1 for an empty slot of
    a varying cohort."""
    return draw.ids if draw.sampled is None else jnp.where(draw.sampled, draw.ids, -1)


class Rows(NamedTuple):
    """The gathered rows of the tables the round updates: ``clients`` (the table itself),
    ``rows`` (the sampled rows; ``rows_in`` as the clients' work reads them), ``model`` (the
    running statistics), ``stats`` / ``stats_in`` (their sampled rows, per client policy)
    and ``messages`` (the sampled rows of ``table``, the message transforms' states)."""

    clients: PyTree
    rows: PyTree
    rows_in: PyTree
    model: dict[str, PyTree]
    stats: PyTree
    stats_in: PyTree
    messages: PyTree
    table: PyTree


class Cohort(NamedTuple):
    """Who reports and with what weight: ``present`` (None: all), ``weights`` ``[S]``,
    ``total_weight`` (of all N), ``planned`` local steps (None where not needed), and
    ``trained``, the rows that do their local work (the sampled ones, None: all), which
    keep their personal state (:class:`~scaffold_jax.types.PersonalState`) when their
    upload is then lost."""

    present: jax.Array | None
    weights: jax.Array
    total_weight: jax.Array
    planned: jax.Array | None
    metrics: dict[str, jax.Array]
    trained: jax.Array | None = None


def keep_absent(present: jax.Array | None, new: PyTree, old: PyTree) -> PyTree:
    """``new`` for the rows that take part, ``old`` for the masked-out ones."""
    if present is None or new is None:
        return new
    return jax.tree.map(
        lambda a, b: jnp.where(present.reshape(present.shape + (1,) * (a.ndim - 1)), a, b),
        new,
        old,
    )


def availability(ctx, state: SimState, data, key: jax.Array):
    """The availability model's step of round (or server step) ``state.round``: its new
    state, the clients available (bool ``[N]``; None: all) and the round's metrics."""
    model = ctx.participation.availability
    if model is None:
        return state.participation, None, {}
    part_state, available = model.step(
        state.participation,
        participation_key(jr.fold_in(key, state.round), AVAILABILITY_STREAM),
        state.round,
        data.num_clients,
    )
    return part_state, available, {"available": jnp.sum(available).astype(jnp.float32)}


def draw_of(ctx, round_key, ids, sampled, part_state, metrics) -> Draw:
    """The :class:`Draw` of clients ``ids`` with their keys from ``round_key``."""
    # The table is read and written with the REPLICATED ids; the clients' work is split
    # over devices by position in the sampled set (no-ops on one device).
    ids = ctx.layout.constrain(ids, "replicated")
    keys = client_keys(round_key, ids)
    work_ids, keys = ctx.layout.constrain((ids, keys), "sampled")
    return Draw(round_key, ids, work_ids, keys, sampled, part_state, metrics)


def sample(ctx, state: SimState, data, key: jax.Array) -> Draw:
    part_state, available, metrics = availability(ctx, state, data, key)
    round_key, drawn = round_key_and_ids(
        key, state.round, data.num_clients,
        ctx.participation.sampled(ctx.clients_per_round), ctx.sampler, available,
    )  # fmt: skip
    ids, sampled = split_sample(drawn)
    draw = draw_of(ctx, round_key, ids, sampled, part_state, metrics)
    return draw._replace(run=run_constants(ctx, data, key))


def gather(ctx, state: SimState, ids: jax.Array, per_config, freeze: bool) -> Rows:
    rows = per_config(take_rows, (0, None))(state.clients, ids)
    clients = state.clients
    if freeze:
        # Writing the gathered rows back is a no-op that makes the table the round updates
        # depend on them: the gather is materialised before the in-place scatter, which
        # XLA would otherwise fuse into the late `where` of `freeze` and pay for with a
        # copy of the whole table.
        clients = per_config(set_rows, (0, None, 0))(clients, ids, rows)
    # The model's running statistics: the server's (every client starts from them) or
    # each sampled client's own row.
    model = dict(state.model or {})
    stats = per_config(take_rows, (0, None))(model["clients"], ids) if "clients" in model else None
    if freeze and stats is not None:  # as for the client table above
        model["clients"] = per_config(set_rows, (0, None, 0))(model["clients"], ids, stats)
    messages = None
    if state.messages is not None:
        messages = per_config(take_rows, (0, None))(state.messages, ids)
    layout = ctx.layout
    return Rows(
        clients, rows, layout.constrain(rows, "sampled"), model, stats,
        layout.constrain(stats, "sampled"), messages, state.messages,
    )  # fmt: skip


def cohort(ctx, data, draw: Draw, key: jax.Array) -> Cohort:
    part, chunk = ctx.participation, ctx.chunk
    # The clients' local steps where chunks are sorted by them (see `local_work`): by data
    # size under an epochs plan, each straggler's completed steps K_i <= planned, or
    # constant when only the rows an availability model or dropouts mask out go last.
    planned = None
    masked_last = part.availability is not None or part.dropouts is not None
    if part.stragglers is not None or (chunk is not None and (ctx.plan.steps_vary or masked_last)):
        planned = ctx.plan.local_steps(data.counts[draw.work_ids])
    if part.stragglers is not None:
        # The step mask of a straggler is cut after its K_i steps (local_work), and the
        # local loop stops there.
        planned = part.stragglers.steps(
            participation_key(draw.round_key, STRAGGLER_STREAM),
            constants_key(key),
            draw.ids,
            planned,
        )
    weights, total_weight = ctx.weights(data, draw.ids)
    if draw.sampled is not None:
        weights = jnp.where(draw.sampled, weights, 0.0)
    return Cohort(draw.sampled, weights, total_weight, planned, dict(draw.metrics), draw.sampled)


def full_data_pass(full_pass, server, rows, ids, weights, data, chunk, aggregation=None,
                   context=None, run=None):  # fmt: skip
    """Runs a :class:`~scaffold_jax.types.FullDataPass` for clients ``ids`` (rows
    ``rows``): each on ALL its examples as one batch; returns the new rows and the server
    state the pass's server function makes from the weighted mean message.

    A server function with a ``messages`` parameter gets the clients' messages and weights
    themselves instead (``server(state, None, messages=..., weights=...)``, differential
    privacy's aggregation), and those of the ``aggregation`` keywords (``cohort_size``,
    ``key``, ``hparams``) it takes. A ``pre_round`` pass gives the round's message
    ``context`` (its ``transform`` acts on the messages first) and the run's constants
    ``run``: a client function gets those of ``hparams=``, ``client_id=`` and ``run=`` it
    takes."""
    given = {"hparams": context.hparams, "run": run} if run else {}
    extra = {k: v for k, v in given.items() if takes(full_pass.client, k)}
    with_id = bool(run) and takes(full_pass.client, "client_id")

    def one(client_id, row):
        batches, mask = data.client_batches(client_id, jr.key(0), FULL_DATA)
        batch = jax.tree.map(lambda a: a[0], batches)
        who = {"client_id": client_id} if with_id else {}
        return full_pass.client(server, row, batch, mask[0], **extra, **who)

    rows, messages = over_clients(one, (ids, rows), chunk)
    released = {}
    if full_pass.transform is not None:
        messages, released = full_pass.transform(messages, weights, context)
    if takes(full_pass.server, "messages"):
        extra = {k: v for k, v in (aggregation or {}).items() if takes(full_pass.server, k)}
        return rows, full_pass.server(server, None, messages=messages, weights=weights, **extra)
    extra = {"released": released} if takes(full_pass.server, "released") else {}
    return rows, full_pass.server(server, weighted_mean(messages, weights), **extra)


def shared(ctx, draw: Draw) -> dict[str, jax.Array]:
    """The keywords every config's server functions may take: the round's expected cohort
    S (``cohort_size``) and the server's key of the round (``key``)."""
    return {"cohort_size": jnp.float32(ctx.clients_per_round), "key": server_key(draw.round_key)}


def run_constants(ctx, data, key: jax.Array) -> dict[str, Any]:
    """What the clients' work (as ``run=``) and the message transforms may read of the run
    itself: its constant key (:func:`constants_key`; the Byzantine clients' set is drawn
    from it), N and the classifier's number of classes (None for a regression)."""
    return {"run_key": constants_key(key), "num_clients": data.num_clients,
            "num_classes": ctx.problem.num_classes}  # fmt: skip


def pre_round(ctx, hparams, server, rows_in, draw, cohort, data, per_config):
    """The algorithm's pass over each sampled client's whole data before the local work
    (Mime's full-batch gradient at x): new rows and server state; unchanged without one."""
    full_pass = ctx.algorithm.pre_round
    if full_pass is None:
        return rows_in, server
    aggregation = shared(ctx, draw)

    def one_config(hparams, server, rows):
        context = MessageContext(
            hparams, server, aggregation["cohort_size"], aggregation["key"], reporting_ids(draw),
            draw.run.get("run_key"), draw.run.get("num_clients"),
        )  # fmt: skip
        return full_data_pass(
            full_pass, server, rows, draw.work_ids, cohort.weights, data, ctx.chunk,
            {**aggregation, "hparams": hparams}, context, draw.run,
        )  # fmt: skip

    return per_config(one_config)(hparams, server, rows_in)


def drop_out(ctx, draw: Draw, cohort: Cohort) -> Cohort:
    """A client that drops after its local work is lost to the round: from here on it is a
    masked row (after the pre-round pass, which it did send). Its work could change
    nothing, so the chunks of dropped rows are skipped."""
    dropouts = ctx.participation.dropouts
    if dropouts is None:
        return cohort
    dropped = dropouts.dropped(participation_key(draw.round_key, DROPOUT_STREAM), draw.ids)
    if cohort.present is not None:
        dropped = dropped & cohort.present
    metrics = {**cohort.metrics, "dropped": jnp.sum(dropped).astype(jnp.float32)}
    present = ~dropped if cohort.present is None else cohort.present & ~dropped
    weights = jnp.where(present, cohort.weights, 0.0)
    return cohort._replace(present=present, weights=weights, metrics=metrics)


def durations(ctx, hparams, data, draw: Draw, cohort: Cohort, key: jax.Array) -> jax.Array:
    """Each client's duration on its device (float32 ``[S]``, seconds;
    :mod:`scaffold_jax.participation.clock`): its download, the examples its local steps
    (and a pre-round pass) process, and its upload at the size it is sent (compressed
    with one config's ``hparams`` where compressed)."""
    profiles = ctx.participation.profiles
    counts = data.counts[draw.work_ids]
    steps = cohort.planned if cohort.planned is not None else ctx.plan.local_steps(counts)
    examples = ctx.plan.examples(counts, steps)
    if ctx.algorithm.pre_round is not None:  # a pass over all its data, then its message
        examples = examples + counts
    profile = profiles.profile(constants_key(key), draw.work_ids)
    up = ctx.up_bytes(hparams) + ctx.traffic.pre_round
    return profiles.durations(profile, ctx.traffic.down, up, examples)


def clock(ctx, hparams, data, draw: Draw, cohort: Cohort, key: jax.Array) -> Cohort:
    """The virtual clock of a synchronous round: from each taking-part client's
    :func:`durations`, the S earliest within the deadline report, the others become
    masked rows (``late``), and the round lasts ``round_duration`` seconds."""
    profiles = ctx.participation.profiles
    if profiles is None:
        return cohort
    spent = durations(ctx, hparams, data, draw, cohort, key)
    kept, duration = profiles.select(spent, cohort.present, ctx.clients_per_round)
    taking = jnp.ones(kept.shape, bool) if cohort.present is None else cohort.present
    metrics = {
        **cohort.metrics,
        "late": jnp.sum(taking & ~kept).astype(jnp.float32),
        "round_duration": duration,
    }
    if not profiles.drops:  # every client reports: the round's arithmetic is unchanged
        return cohort._replace(metrics=metrics)
    weights = jnp.where(kept, cohort.weights, 0.0)
    return cohort._replace(present=kept, weights=weights, metrics=metrics)


class PerClient(NamedTuple):
    """Server states stacked one per client (FedBuff: each client trains from the model
    current when it started), with the server's running statistics likewise (None)."""

    server: PyTree
    stats: PyTree = None


def local_work(ctx, hparams, server_in, rows: Rows, draw: Draw, cohort: Cohort, data, configs):
    """Every sampled client's ``client_update``: new rows and outputs, ``[S, ...]`` (for a
    sweep's group ``[S, M, ...]``, the configs inside each client's work). ``server_in``:
    the server state every client starts from, or a :class:`PerClient` of one each."""
    algorithm, plan = ctx.algorithm, ctx.plan
    per_config = partial(over_configs, configs) if configs else at_once
    common = {}
    if takes(algorithm.client_update, "round_key"):
        common["round_key"] = shared_key(draw.round_key)

    def client_work(client_id, client_key, row, stats, server, server_stats, steps=None):
        # Batches are drawn inside each client's work so that a chunk gathers only its own
        # clients' examples (the working set stays chunk-sized).
        def batches_of(key):
            batches, mask = data.client_batches(client_id, key, plan)
            if steps is not None:  # a straggler: the steps after its K_i are empty
                done = jnp.arange(mask.shape[0]) < steps
                done = done.reshape(done.shape + (1,) * (mask.ndim - 1))
                mask = jnp.where(done, mask, jnp.zeros_like(mask))
            return batches, mask

        batches, mask = batches_of(client_key)

        def update(hparams, server_in, row, stats, server_stats):
            extra = dict(common)
            if takes(algorithm.client_update, "draw"):
                extra["draw"] = lambda stream: batches_of(extra_batches_key(client_key, stream))
            if takes(algorithm.client_update, "client_id"):  # (a data-poisoning attack)
                extra.update(client_id=client_id, run=draw.run)
            if ctx.stateful_model:
                stats = server_stats if stats is None else stats
                extra["model_state"] = ModelState(stats, ctx.problem.update_state)
            return algorithm.client_update(
                hparams, server_in, row, batches, mask, client_key, **extra
            )

        # Every config of a group on the same batches, inside this client's work: side by
        # side (their dots one wider dot), or one after another where side by side makes
        # every convolution a grouped one (`configs_one_at_a_time`).
        over = one_after_another if ctx.configs_one_at_a_time else per_config
        return over(update)(hparams, server, row, stats, server_stats)

    to_clients = partial(swap_leading, configs)
    server_stats = rows.model.get("server")
    if isinstance(server_in, PerClient):
        work = (draw.work_ids, draw.keys, rows.rows_in, rows.stats_in, *server_in)
        one = client_work
    else:
        work = (draw.work_ids, draw.keys, to_clients(rows.rows_in), to_clients(rows.stats_in))

        def one(client_id, client_key, row, stats, steps=None):
            return client_work(client_id, client_key, row, stats, server_in, server_stats, steps)

    if ctx.participation.stragglers is not None:
        work = (*work, ctx.layout.constrain(cohort.planned, "sampled"))
    # Clients of similar step counts side by side: a vmapped chunk's local loop runs as
    # long as its longest client (local_sgd stops after the last non-empty step), so
    # sorting by steps keeps the padded steps few (benchmarks/README.md, W6). Clients run
    # one at a time, or all in one vmap, gain nothing from it.
    chunk, present = ctx.chunk, cohort.present
    if ctx.algorithm.personal is not None:  # a dropped client's work changes its own state
        present = cohort.trained
    if chunk is not None and chunk >= draw.ids.shape[0]:
        chunk = None
    sort = chunk is not None and chunk > 1 and cohort.planned is not None
    active = present
    if sort:
        steps = cohort.planned
        if present is not None:  # the masked-out rows last, in chunks of their own
            steps = jnp.where(present, steps, -1)
        order = jnp.argsort(-steps, stable=True)
        work = jax.tree.map(lambda a: a[order], work)
        active = None if present is None else present[order]
    # A loop of K trips the compiler knows where no client can stop early (the same
    # results: empty steps are no-ops); on an accelerator a loop whose trip count is data
    # reads its condition back to the host after every step.
    with every_step_runs(not plan.steps_vary and ctx.participation.stragglers is None):
        new_rows, outputs = over_clients(one, work, chunk, active)
    if sort:
        back = jnp.argsort(order)
        new_rows, outputs = jax.tree.map(lambda a: a[back], (new_rows, outputs))
    return to_clients((new_rows, outputs))
