"""scaffold_jax: SCAFFOLD, FedAvg, FedProx and large-batch SGD as a vectorized JAX simulator.

Client state is stacked along a leading client axis, the local steps are a ``lax.scan``
vmapped across the sampled clients, and a whole round (many rounds, in fact) compiles into
one XLA program.
"""

from scaffold_jax import algorithms, checkpoint, data, diagnostics, layout, loop, models, sweep
from scaffold_jax.algorithms import fedavg, feddyn, fednova, fedprox, scaffold, sgd
from scaffold_jax.data import BatchPlan, FederatedData, from_client_arrays, from_partition
from scaffold_jax.engine import Simulation, init_state
from scaffold_jax.layout import ClientMesh, SingleDevice
from scaffold_jax.loop import DivergenceError, RunResult, RunTerminated
from scaffold_jax.types import (
    Algorithm,
    ClientOutput,
    HParam,
    HParams,
    Problem,
    SimState,
    check_hparams,
    hparams,
)

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "BatchPlan",
    "ClientMesh",
    "ClientOutput",
    "DivergenceError",
    "FederatedData",
    "HParam",
    "HParams",
    "Problem",
    "RunResult",
    "RunTerminated",
    "SimState",
    "Simulation",
    "SingleDevice",
    "algorithms",
    "check_hparams",
    "checkpoint",
    "data",
    "diagnostics",
    "fedavg",
    "feddyn",
    "fednova",
    "fedprox",
    "from_client_arrays",
    "from_partition",
    "hparams",
    "init_state",
    "layout",
    "loop",
    "models",
    "scaffold",
    "sgd",
    "sweep",
]
