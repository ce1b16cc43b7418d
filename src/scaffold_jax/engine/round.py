"""One round, ``round_fn(sim, hparams, state, data, key) -> (state, metrics)``: the phases
of :mod:`scaffold_jax.engine.phases` and :mod:`scaffold_jax.engine.aggregation` in order,
with a sweep's configs axis applied around them (:mod:`scaffold_jax.engine.axes`)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from scaffold_jax.engine import aggregation, phases
from scaffold_jax.engine.axes import at_once, over_configs
from scaffold_jax.engine.keys import server_key
from scaffold_jax.types import HParams, SimState


def round_fn(
    sim,
    hparams: HParams,
    state: SimState,
    data,
    key: jax.Array,
    diverged: jax.Array | None = None,
    configs: int | None = None,
):
    """One round; see :meth:`Simulation.round_fn
    <scaffold_jax.engine.simulation.Simulation.round_fn>`."""
    per_config = partial(over_configs, configs) if configs else at_once
    draw = phases.sample(sim, state, data, key)
    rows = phases.gather(sim, state, draw.ids, per_config, freeze=diverged is not None)
    chunk = sim.resolve_client_chunk(data)
    cohort = phases.cohort(sim, data, draw, key, chunk)
    shared = {
        "cohort_size": jnp.float32(sim.clients_per_round),
        "key": server_key(draw.round_key),
    }
    rows_in, server_in = phases.pre_round(
        sim, hparams, state.server, rows.rows_in, draw, cohort, shared, data, chunk, per_config
    )
    cohort = phases.clock(sim, data, draw, phases.drop_out(sim, draw, cohort), key)
    new_rows, outputs = phases.local_work(
        sim, hparams, server_in, state, rows._replace(rows_in=rows_in), draw, cohort, data,
        chunk, configs,
    )  # fmt: skip
    rnd = aggregation.Round(draw, cohort, shared, chunk, state.model is not None)
    new_state, metrics = per_config(partial(aggregation.server_side, sim, rnd, state.round))(
        hparams, server_in, state.server, outputs, new_rows, rows.rows, rows.clients,
        rows.model, rows.stats, rows.messages, state.messages, diverged,
    )  # fmt: skip
    if configs:
        # The round counter and the participation state stay the group's, shared.
        shared_state = new_state._replace(round=state.round + 1, participation=draw.participation)
        return sim.layout.constrain(shared_state, "state"), metrics
    return new_state, metrics
