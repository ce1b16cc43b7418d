"""Dropouts: sampled clients whose update never reaches the server.

A client that drops after its local work (the phone leaves the network) is lost to the
round: its update is not aggregated and, since nothing it computed reached the server,
its own state is not updated either. The engine treats it as a row that takes no part
after the round's pre-round pass (Mime's full-batch gradients, which a client sends
before its local work, still count): weight 0 in the aggregate, its client row and
statistics written back unchanged, left out of the round's metrics. As its work could
change nothing, the engine does not spend it (its rows are grouped into chunks the round
skips). What each algorithm does with a lost client:

- FedAvg, FedProx, FedNova, SGD, Mime, MimeLite: the aggregate is the weighted mean (or
  FedNova's normalised sum) over the clients that reached the server.
- SCAFFOLD: x moves by the mean update of those clients; c by Σ Δc_i / N over them, and a
  dropped client's c_i keeps its old value, so c = mean_i c_i still holds.
- FedDyn: h moves by −α Σ (y_i − x) / N over those clients; a dropped client's gradient
  correction g_i is not updated.
- A round in which every sampled client drops aggregates a zero mean update; the server
  then applies its own rule to it (plain FedAvg and SCAFFOLD stay put, FedDyn still steps
  by −h/α, a server optimizer with momentum still moves).

A model is a frozen value with ``dropped(key, ids) -> bool [S]``, drawn from
``fold_in(key, client_id)`` like every per-client draw.

Registered (:data:`DROPOUTS`; ``--dropouts``): ``none`` (the default) and ``bernoulli``:
each sampled client drops independently with probability ``dropout_rate``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from scaffold_jax.participation.base import ModelSpec, per_client_uniform
from scaffold_jax.registry import Option, Registry

#: What a dropout rate may be: at 1 no update ever reaches the server.
RATE = (
    "a probability in [0, 1): at 1 every sampled client drops, so no update ever reaches "
    "the server and the model never trains"
)


@dataclasses.dataclass(frozen=True)
class Bernoulli:
    """Each sampled client drops with probability ``rate``, independently."""

    rate: float = 0.2
    name: ClassVar[str] = "bernoulli"

    def __post_init__(self):
        if not 0.0 <= self.rate < 1.0:
            raise ValueError(f"dropout_rate = {self.rate!r} is invalid: it must be {RATE}.")

    def dropped(self, key, ids):
        return per_client_uniform(key, ids) < self.rate


DROPOUTS: Registry[ModelSpec] = Registry("dropout model")
DROPOUTS.register("none", ModelSpec(None))
DROPOUTS.register(
    "bernoulli",
    ModelSpec(
        Bernoulli,
        {
            "dropout_rate": Option(
                0.2, "bernoulli dropouts: the probability a sampled client's update is lost",
                "float", low=0.0, high=math.nextafter(1.0, 0.0), argument="rate", what=RATE,
            ),
        },
    ),
)  # fmt: skip
