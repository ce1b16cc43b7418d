"""Federated datasets: the device-resident container, batch plans, sources, partitioners,
naturally federated datasets (Shakespeare, FEMNIST) and synthetic problems."""

from scaffold_jax.data import femnist, natural, partition, shakespeare, sources, synthetic
from scaffold_jax.data.batching import BatchPlan
from scaffold_jax.data.federated import FederatedData, from_client_arrays, from_partition

__all__ = [
    "BatchPlan",
    "FederatedData",
    "from_client_arrays",
    "femnist",
    "from_partition",
    "natural",
    "partition",
    "shakespeare",
    "sources",
    "synthetic",
]
