"""Federated datasets: the device-resident container, batch plans, sources, partitioners
and synthetic problems."""

from scaffold_jax.data import partition, sources, synthetic
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData, from_client_arrays, from_partition

__all__ = [
    "BatchPlan",
    "FederatedData",
    "from_client_arrays",
    "from_partition",
    "partition",
    "sources",
    "synthetic",
]
