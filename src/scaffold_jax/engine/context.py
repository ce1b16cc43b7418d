"""The round's frozen context: what every phase of a round reads and nothing changes, built
once per compiled program (:meth:`Simulation.context
<scaffold_jax.engine.simulation.Simulation.context>`) from the simulation and the data's
shapes. The phases take it instead of the simulation: they call back into nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.engine.communication import Traffic, uplink_bytes
from scaffold_jax.participation import Participation
from scaffold_jax.types import Algorithm, HParams, Problem


def weights_of(weigh, data, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The aggregation weights of clients ``ids`` and the total weight of all N under the
    weighting ``weigh`` (None: equal weights, no ``[N]`` vector made): ``(1, N)`` uniform,
    ``(n_i, Σ n_j)`` with ``weighting="num_examples"``."""
    if weigh is None:
        return jnp.ones(ids.shape, jnp.float32), jnp.asarray(data.num_clients, jnp.float32)
    weights = weigh(data.counts.astype(jnp.float32))
    return weights[ids], jnp.sum(weights)


@dataclasses.dataclass(frozen=True)
class RoundContext:
    """The round's fixed facts.

    Attributes:
      algorithm, problem, plan, participation, sampler, layout: the simulation's.
      clients_per_round: S.
      chunk: sampled clients per vmapped chunk of the local work (None: all at once;
        :func:`scaffold_jax.resources.client_chunk`).
      configs_one_at_a_time: whether a sweep's configs run one after another inside each
        client's work (a convolutional or recurrent model on CPU).
      traffic: the bytes a participating client receives and sends
        (:func:`scaffold_jax.engine.communication.traffic`; ``up`` is for an uplink whose
        size is no hyper-parameter, see :meth:`up_bytes`).
      weigh: every client's weight from its example count; None: equal weights (no
        ``[N]`` vector is made: a million procedural clients).
    """

    algorithm: Algorithm
    problem: Problem
    plan: BatchPlan
    participation: Participation
    sampler: Callable
    layout: Any
    clients_per_round: int
    chunk: int | None
    configs_one_at_a_time: bool
    traffic: Traffic
    weigh: Callable[[jax.Array], jax.Array] | None

    @property
    def stateful_model(self) -> bool:
        """Whether the model keeps running statistics (``SimState.model``)."""
        return self.problem.model_state is not None

    def weights(self, data, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """See :func:`weights_of`."""
        return weights_of(self.weigh, data, ids)

    def up_bytes(self, hparams: HParams) -> jax.Array | int:
        """The bytes a reporting client sends with one config's ``hparams`` (traced): a
        compressor's size follows its bits or fraction, exactly as the accounting counts
        it (float32 in the program)."""
        if getattr(self.algorithm.messages, "sizes", None) is None:
            return self.traffic.up
        return uplink_bytes(self.algorithm, self.problem.params, hparams)
