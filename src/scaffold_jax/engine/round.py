"""The synchronous round, the paper's execution mode: the phases of
:mod:`scaffold_jax.engine.phases` and :mod:`scaffold_jax.engine.aggregation` in order, with
a sweep's configs axis applied around them (:mod:`scaffold_jax.engine.axes`).

An execution mode is a value with a ``step(ctx, hparams, state, data, key, diverged,
configs) -> (state, metrics)``, chosen once when a :class:`Simulation
<scaffold_jax.engine.simulation.Simulation>` is built: :data:`SYNCHRONOUS` here, FedBuff's
buffered server step in :mod:`scaffold_jax.engine.buffered`. Both run the same client
work (:func:`~scaffold_jax.engine.phases.local_work`) and the same server side
(:func:`~scaffold_jax.engine.aggregation.server_side`)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax

from scaffold_jax.engine import aggregation, phases
from scaffold_jax.engine.axes import at_once, over_configs
from scaffold_jax.engine.context import RoundContext
from scaffold_jax.types import HParams, SimState


@dataclasses.dataclass(frozen=True)
class Synchronous:
    """The paper's rounds: S clients sampled, trained from x^t, aggregated into x^{t+1}."""

    name = "sync"

    def step(self, ctx: RoundContext, hparams: HParams, state: SimState, data, key: jax.Array,
             diverged: jax.Array | None = None, configs: int | None = None):  # fmt: skip
        """One round; see :meth:`Simulation.round_fn
        <scaffold_jax.engine.simulation.Simulation.round_fn>`."""
        per_config = partial(over_configs, configs) if configs else at_once
        draw = phases.sample(ctx, state, data, key)
        rows = phases.gather(ctx, state, draw.ids, per_config, freeze=diverged is not None)
        cohort = phases.cohort(ctx, data, draw, key)
        shared = {**phases.shared(ctx, draw), **draw.run}
        rows_in, server_in = phases.pre_round(
            ctx, hparams, state.server, rows.rows_in, draw, cohort, data, per_config
        )
        # The clock's uplink sizes are one config's: a sweep's configs share the round's
        # cohort, so its configs send the same sizes (the sweep refuses others).
        timed = hparams if not configs else jax.tree.map(lambda a: a[0], hparams)
        cohort = phases.clock(ctx, timed, data, draw, phases.drop_out(ctx, draw, cohort), key)
        work = phases.local_work(
            ctx, hparams, server_in, rows._replace(rows_in=rows_in), draw, cohort, data, configs
        )
        rnd = aggregation.Round(draw, cohort, shared, state.round)
        new_state, metrics = per_config(partial(aggregation.server_side, ctx, rnd))(
            hparams, server_in, state.server, rows, work, diverged
        )
        if configs:
            # The round counter and the participation state stay the group's, shared.
            shared_state = new_state._replace(
                round=state.round + 1, participation=draw.participation
            )
            return ctx.layout.constrain(shared_state, "state"), metrics
        return new_state, metrics


#: The synchronous execution (``execution=None``).
SYNCHRONOUS = Synchronous()
