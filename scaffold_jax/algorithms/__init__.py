"""The algorithms, one module each: SCAFFOLD, FedAvg, FedProx and large-batch SGD."""

from scaffold_jax.algorithms.fedavg import fedavg
from scaffold_jax.algorithms.fedprox import fedprox
from scaffold_jax.algorithms.scaffold import (
    ScaffoldClientState,
    ScaffoldServerState,
    client_controls,
    scaffold,
)
from scaffold_jax.algorithms.sgd import sgd

ALGORITHMS = {"scaffold": scaffold, "fedavg": fedavg, "fedprox": fedprox, "sgd": sgd}


def make(name: str, loss_fn, **options):
    """Builds an algorithm by name (``"scaffold"``, ``"fedavg"``, ``"fedprox"``, ``"sgd"``)."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is unknown; use one of {sorted(ALGORITHMS)}.")
    return ALGORITHMS[name](loss_fn, **options)


__all__ = [
    "ALGORITHMS",
    "ScaffoldClientState",
    "ScaffoldServerState",
    "client_controls",
    "fedavg",
    "fedprox",
    "make",
    "scaffold",
    "sgd",
]
