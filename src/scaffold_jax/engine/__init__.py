"""The pure programs of a simulation: init, sample, round, multi-round scan, evaluate.

A round is one pure function ``round(hparams, state, data, key) -> (state, metrics)``, a
sequence of named phases (:mod:`~scaffold_jax.engine.phases`, then
:mod:`~scaffold_jax.engine.aggregation` for the server side):

1. ``sample``: ``round_key = fold_in(key, state.round)``; an availability model's step;
   the sampler draws S of N clients (uniformly without replacement by default); client
   i's key is ``fold_in(clients_key, i)``, so what a client does depends on its id, never
   on its position in the sampled set or on how the client axis is laid out
   (:mod:`~scaffold_jax.engine.keys`).
2. ``gather`` the sampled rows of the client table; ``cohort``: weights and planned steps;
   ``pre_round``: an algorithm's pass over each sampled client's whole data (Mime);
   ``drop_out``: dropped clients become masked rows.
3. ``local_work``: ``vmap(client_update)`` over the S clients (chunks under ``lax.map`` on
   CPU), each drawing its own batches.
4. ``client_messages``: what the clients send passes through the algorithm's chain of
   message transforms (:mod:`~scaffold_jax.messages`; differential privacy's
   clipping and noise); ``aggregate`` with the algorithm's pure ``server_update``;
   ``client_sync`` (Scaffnew); ``round_metrics``; ``scatter`` the new rows back.

A model's running statistics (``SimState.model``, BatchNorm's) go to every sampled client's
local steps and come back averaged or written back to the clients' rows
(``Problem.state_policy``). A sampler of varying cohorts (Poisson sampling) returns
``(ids, present)``: the round keeps its fixed width, and a row whose ``present`` is False
has weight 0, keeps its rows and is left out of the metrics. Participation models
(:mod:`scaffold_jax.participation`) use the same masked rows, drawing from
:func:`~scaffold_jax.engine.keys.participation_key`. An algorithm's ``warm_start`` pass
(SCAFFOLD's warm controls) runs once over all N clients when the initial state is built.

The phases take a frozen :class:`~scaffold_jax.engine.context.RoundContext` (what they read
and nothing changes), and an execution mode is a value with a ``step``: the synchronous
round (:mod:`~scaffold_jax.engine.round`) or FedBuff's buffered server step
(:mod:`~scaffold_jax.engine.buffered`), which trains its clients and aggregates them with
the same phases. Many rounds run as one loop
(:func:`~scaffold_jax.engine.axes.repeat_rounds`) inside one ``jit`` whose state argument
is donated, so the ``[N, ...]`` client table is updated in place. Nothing per client or
per step happens in Python. This package and :mod:`scaffold_jax.layout` are the only ones
that know the client axis; the host loop that runs these programs is
:mod:`scaffold_jax.loop`.
"""

from scaffold_jax.engine.axes import one_after_another, over_clients, repeat_rounds
from scaffold_jax.engine.checks import (
    MAX_ROUNDS,
    MAX_SEED,
    ROUNDS_WHY,
    SEED_WHY,
    check_count,
    check_rounds_fit,
)
from scaffold_jax.engine.context import RoundContext
from scaffold_jax.engine.evaluation import (
    DEFAULT_EVALUATORS,
    TRAIN_EVAL_EXAMPLES,
    heldout_metrics,
    train_objective,
)
from scaffold_jax.engine.keys import (
    AVAILABILITY_STREAM,
    DROPOUT_STREAM,
    STRAGGLER_STREAM,
    client_keys,
    constants_key,
    participation_key,
    round_key_and_ids,
    server_key,
    shared_key,
)
from scaffold_jax.engine.personal import Personalization, client_evaluation
from scaffold_jax.engine.phases import FULL_DATA, keep_absent
from scaffold_jax.engine.round import SYNCHRONOUS, Synchronous
from scaffold_jax.engine.simulation import Simulation
from scaffold_jax.engine.state import init_state, initial_state
from scaffold_jax.messages import MessageContext, MessageTransform, chain, stateless

__all__ = [
    "AVAILABILITY_STREAM",
    "DROPOUT_STREAM",
    "STRAGGLER_STREAM",
    "DEFAULT_EVALUATORS",
    "FULL_DATA",
    "MAX_ROUNDS",
    "MAX_SEED",
    "ROUNDS_WHY",
    "SEED_WHY",
    "TRAIN_EVAL_EXAMPLES",
    "MessageContext",
    "MessageTransform",
    "RoundContext",
    "SYNCHRONOUS",
    "Synchronous",
    "Simulation",
    "chain",
    "check_count",
    "check_rounds_fit",
    "client_keys",
    "client_evaluation",
    "Personalization",
    "constants_key",
    "heldout_metrics",
    "init_state",
    "initial_state",
    "keep_absent",
    "one_after_another",
    "over_clients",
    "participation_key",
    "repeat_rounds",
    "round_key_and_ids",
    "server_key",
    "shared_key",
    "stateless",
    "train_objective",
]
