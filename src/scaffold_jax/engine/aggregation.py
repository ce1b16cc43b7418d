"""The server side of a round, for one config (a sweep vmaps it over its configs): the
model's statistics, the message pipeline, the algorithm's aggregation, the clients' sync
step, the round's metrics, a diverged config's freeze, and the scatter of the new rows."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaffold_jax.engine.axes import over_clients
from scaffold_jax.engine.communication import check_uplink
from scaffold_jax.engine.phases import Cohort, Draw, Rows, keep_absent, reporting_ids
from scaffold_jax.local import takes
from scaffold_jax.messages import MessageContext
from scaffold_jax.tree import all_finite, masked_mean, set_rows, sq_norm, weighted_mean
from scaffold_jax.types import ClientOutput, ModelState, PersonalState, ServerOutput, SimState


class Round(NamedTuple):
    """What the server side reads of the round's shared phases (the same for every config
    of a sweep's group): the sample, the cohort, the server's keywords (``cohort_size``,
    ``key``), the round counter, and ``scale`` (None, or ``[S]`` factors of the sent Δy_i
    before aggregation: FedBuff's staleness weights s(τ_j))."""

    draw: Draw
    cohort: Cohort
    aggregation: dict[str, jax.Array]
    round: jax.Array
    scale: jax.Array | None = None


def model_statistics(ctx, rnd: Round, outputs: ClientOutput, model, stats):
    """The running statistics after the round: averaged into the server's with the round's
    weights, or each reporting client's own row (``Problem.state_policy``)."""
    if not ctx.stateful_model:
        return outputs, None
    if not isinstance(outputs.model_state, ModelState):
        raise ValueError(
            f"{ctx.algorithm.name}'s client_update took model_state but returned no "
            "ClientOutput.model_state: pass it to local_update / local_sgd (which "
            "return it advanced) and put that in the output."
        )
    present, value = rnd.cohort.present, outputs.model_state.value
    if "server" in model:
        # A row that does not report weighs 0; with none reporting the statistics stay.
        mean = weighted_mean(ctx.layout.constrain(value, "replicated"), outputs.weight)
        if present is not None:
            mean = optax.tree.where(jnp.any(present), mean, model["server"])
        new_model = {"server": mean}
    else:
        new_model = {"clients": ctx.layout.constrain(keep_absent(present, value, stats),
                                                     "replicated")}  # fmt: skip
    return outputs._replace(model_state=None), new_model


def client_messages(ctx, hparams, server_in, outputs, states, rnd: Round):
    """The clients' messages through the algorithm's message transforms
    (:mod:`scaffold_jax.messages`): what the server aggregates, the transforms'
    new states and what they release to the server."""
    # (At trace time, free: the message must be what the algorithm states it sends.)
    row = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), outputs.message)
    check_uplink(ctx.algorithm, ctx.problem.params, row)
    transform = ctx.algorithm.messages
    sent, states, released = outputs, states, {}
    if transform is not None:
        context = MessageContext(
            hparams, server_in, rnd.aggregation["cohort_size"], rnd.aggregation["key"],
            reporting_ids(rnd.draw), rnd.aggregation.get("run_key"),
            rnd.aggregation.get("num_clients"),
        )  # fmt: skip
        sent, states, released = transform.apply(outputs, states, context)
    return scaled(sent, rnd.scale), states, released


def scaled(outputs: ClientOutput, scale: jax.Array | None) -> ClientOutput:
    """``outputs`` with each client's Δy_i times its ``scale`` (None: unchanged)."""
    if scale is None:
        return outputs
    return outputs._replace(delta_params=jax.tree.map(
        lambda a: a * scale.reshape(scale.shape + (1,) * (a.ndim - 1)), outputs.delta_params
    ))  # fmt: skip


def aggregate(ctx, hparams, server_in, outputs, rnd: Round, released):
    """The algorithm's ``server_update``: the new server state and its metrics. A server
    update may also take the round's expected cohort S, its own key and what the message
    transforms released."""
    update = ctx.algorithm.server_update
    extra = {k: v for k, v in rnd.aggregation.items() if takes(update, k)}
    if takes(update, "released"):
        extra["released"] = released
    server = update(hparams, server_in, outputs, rnd.cohort.total_weight, **extra)
    if isinstance(server, ServerOutput):
        return server
    return server, {}


def client_sync(ctx, hparams, server_in, server, new_rows, outputs):
    """The sampled clients' step after aggregation (Scaffnew), where their rows still are
    (split over devices like their local work) and before they are written back."""
    sync = ctx.algorithm.client_sync
    if sync is not None:

        def one(row, output):
            return sync(hparams, server_in, server, row, output)

        synced = (new_rows, ctx.layout.constrain(outputs, "sampled"))
        new_rows = over_clients(one, synced, ctx.chunk)
    # A masked row's new values are dropped by the scatter (set_rows' `write`).
    return ctx.layout.constrain(new_rows, "replicated")


def round_metrics(ctx, outputs, server, server_metrics, rnd: Round):
    """The round's metrics: the clients' own (averaged over those who report), who took
    part, client drift, the update's norm, whether the new server state is finite, and
    the server update's."""
    present, part = rnd.cohort.present, ctx.participation
    if present is None:
        mean = jnp.mean
    else:
        taking_part = present.astype(jnp.float32)

        def mean(values):
            return masked_mean(values.astype(jnp.float32), taking_part)

    weights = rnd.cohort.weights
    metrics = {k: mean(v) for k, v in outputs.metrics.items()}
    # The ids of the clients sampled (−1 only for a varying cohort's empty slots), and with
    # dropouts which of them reported: a user sees who dropped.
    ids, sampled = rnd.draw.ids, rnd.draw.sampled
    metrics["client_ids"] = ids if sampled is None else jnp.where(sampled, ids, -1)
    if part.dropouts is not None or (part.profiles is not None and part.profiles.drops):
        metrics["reported"] = present
    if present is not None:
        metrics["participants"] = jnp.sum(taking_part)
    if rnd.cohort.planned is not None and part.stragglers is not None:  # (FedBuff's: at starts)
        metrics["steps_taken"] = mean(rnd.cohort.planned.astype(jnp.float32))
    # For the communication accounting (scaffold_jax.engine.communication): who uploaded
    # (reported) and who downloaded (took part: a dropped client too).
    uploads = jnp.float32(ids.shape[0]) if present is None else jnp.sum(taking_part)
    metrics["uploads"] = uploads
    lost = [rnd.cohort.metrics.get(k, jnp.float32(0)) for k in ("dropped", "late")]
    metrics["downloads"] = uploads + lost[0] + lost[1]
    metrics.update(rnd.cohort.metrics)
    # Client drift: mean ‖y_i − x‖ and the norm of the aggregated update ‖Δx‖.
    norms = jax.vmap(sq_norm, axis_size=ids.shape[0])(outputs.delta_params)  # Δy_i may be {}
    metrics["client_drift"] = mean(jnp.sqrt(norms))
    metrics["update_norm"] = jnp.sqrt(sq_norm(weighted_mean(outputs.delta_params, weights)))
    # Whether this round's new server state is finite: the single run's divergence check
    # reports the first round where it is not (the update norm squares the update, so it
    # overflows rounds before the state does).
    metrics["server_finite"] = all_finite(server)
    taken = sorted(set(server_metrics) & {*metrics, "finite"})
    if taken:
        raise ValueError(
            f"{ctx.algorithm.name}'s server_update reports the metric(s) {', '.join(taken)}, "
            "which the clients or the engine already report: rename them."
        )
    metrics.update({k: jnp.asarray(v, jnp.float32) for k, v in server_metrics.items()})
    return metrics


def freeze(metrics, diverged, before: tuple, after: tuple, present):
    """For a sweep's freeze policy: a round whose new server state or written-back rows
    hold a NaN/Inf is not applied (nor any round once the config has ``diverged``): the
    ``after`` trees (server, rows, statistics, message states) fall back to ``before``,
    and the metrics gain ``finite``."""
    server, new_rows, new_model, new_messages = after
    rows, messages = before[1], before[3]
    # Only the rows written back count (a masked row's values are discarded).
    finite = metrics["server_finite"] & all_finite(
        (
            keep_absent(present, new_rows, rows),
            new_model,
            keep_absent(present, new_messages, messages),
        )
    )
    keep = finite & ~diverged
    metrics["finite"] = finite
    return tuple(
        new if new is None else optax.tree.where(keep, new, old)
        for new, old in zip(after, before, strict=True)
    )


def scatter(ctx, rnd: Round, rows: Rows, new: tuple) -> SimState:
    """The new state: the reporting clients' rows (and statistics and message states)
    written back to their tables, the round counter advanced."""
    clients, model, messages = rows.clients, rows.model, rows.table
    server, new_rows, new_model, new_messages = new
    ids, present = rnd.draw.ids, rnd.cohort.present
    if isinstance(new_rows, PersonalState):  # personal state stays with who trained
        clients = PersonalState(
            set_rows(clients.shared, ids, new_rows.shared, present),
            set_rows(clients.own, ids, new_rows.own, rnd.cohort.trained),
        )
    else:
        clients = set_rows(clients, ids, new_rows, present)
    if new_model is not None and "clients" in new_model:
        # Masked rows are not written: a FedBuff step's free slot may hold the id of a
        # client that reports in the same step.
        new_model = {"clients": set_rows(model["clients"], ids, new_model["clients"], present)}
    if new_messages is not None:
        messages = set_rows(messages, ids, new_messages, present)
    new_state = SimState(
        server=server,
        clients=clients,
        round=rnd.round + 1,
        model=new_model,
        participation=rnd.draw.participation,
        messages=messages,
    )
    return ctx.layout.constrain(new_state, "state")


def server_side(ctx, rnd: Round, hparams, server_in, server_before, rows: Rows, work, diverged):
    """The rest of the round for one config, from the clients' work ``(new rows, outputs)``
    to the new state and the round's metrics (``rows``: the tables the round updates and
    their sampled rows, :class:`~scaffold_jax.engine.phases.Rows`)."""
    new_rows, outputs = work
    outputs = outputs._replace(weight=rnd.cohort.weights)
    outputs, new_model = model_statistics(ctx, rnd, outputs, rows.model, rows.stats)
    sent, new_messages, released = client_messages(
        ctx, hparams, server_in, outputs, rows.messages, rnd
    )
    server, server_metrics = aggregate(ctx, hparams, server_in, sent, rnd, released)
    new_rows = client_sync(ctx, hparams, server_in, server, new_rows, outputs)
    metrics = round_metrics(ctx, scaled(outputs, rnd.scale), server, server_metrics, rnd)
    metrics.update(released.get("metrics", {}))  # the transforms' records
    new = (server, new_rows, new_model, new_messages)
    if diverged is not None:
        model = rows.model
        kept = {"server": model["server"]} if "server" in model else {"clients": rows.stats}
        before = (server_before, rows.rows, None if new_model is None else kept, rows.messages)
        new = freeze(metrics, diverged, before, new, rnd.cohort.present)
    new_state = scatter(ctx, rnd, rows, new)
    return new_state, ctx.layout.constrain(metrics, "replicated")
