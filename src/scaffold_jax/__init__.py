"""scaffold_jax: SCAFFOLD and its baselines as a vectorized JAX federated-learning simulator.

SCAFFOLD (Karimireddy et al. 2020), FedAvg, FedProx, large-batch SGD, FedDyn, FedNova,
Mime, MimeLite, Scaffnew and FedExP, with server (FedOpt) and local optimizers. Client state
is stacked along a leading client axis, the local steps are a ``lax.while_loop`` vmapped
across the sampled clients, and a whole round (many rounds, in fact) compiles into one XLA
program.
"""

# First, before anything imports jax: a dependency too old for the imports below (left by
# `pip install --no-deps`) fails here, naming the versions found and needed, rather than
# deep inside jax.
from scaffold_jax import _requirements

_requirements.check()

from scaffold_jax import (
    algorithms,
    checkpoint,
    compression,
    data,
    diagnostics,
    layout,
    loop,
    models,
    optimizers,
    participation,
    privacy,
    robust,
    sampling,
    sweep,
)
from scaffold_jax.algorithms import (
    fedavg,
    feddyn,
    fedexp,
    fednova,
    fedprox,
    mime,
    mimelite,
    scaffnew,
    scaffold,
    sgd,
)
from scaffold_jax.data import BatchPlan, FederatedData, from_client_arrays, from_partition
from scaffold_jax.engine import init_state
from scaffold_jax.engine.buffered import FedBuff
from scaffold_jax.layout import ClientMesh, SingleDevice
from scaffold_jax.loop import DivergenceError, RunResult, RunTerminated, Simulation

# A sweep's host half sits beside the host loop, above the vmapped program it drives
# (scaffold_jax.sweep, which cannot import it); its names stay where sweeps find them.
sweep.Sweep, sweep.SweepResult, sweep.sweep = loop.Sweep, loop.SweepResult, loop.sweep
from scaffold_jax.types import (
    Algorithm,
    ClientOutput,
    HParam,
    HParams,
    ModelState,
    PersonalState,
    Problem,
    ServerOutput,
    SimState,
    check_hparams,
    hparams,
)

__version__ = "0.1.0"
#: The project's canonical repository: the README's and notebooks' Colab badges and install
#: cells use it (tests/test_notebooks.py checks that they agree with it).
REPOSITORY = "https://github.com/scaffold-jax/scaffold_jax"

__all__ = [
    "Algorithm",
    "BatchPlan",
    "ClientMesh",
    "FedBuff",
    "ClientOutput",
    "DivergenceError",
    "FederatedData",
    "HParam",
    "HParams",
    "ModelState",
    "Problem",
    "RunResult",
    "RunTerminated",
    "ServerOutput",
    "PersonalState",
    "SimState",
    "Simulation",
    "SingleDevice",
    "algorithms",
    "check_hparams",
    "checkpoint",
    "compression",
    "data",
    "diagnostics",
    "fedavg",
    "feddyn",
    "fedexp",
    "fednova",
    "fedprox",
    "from_client_arrays",
    "from_partition",
    "hparams",
    "init_state",
    "layout",
    "loop",
    "mime",
    "mimelite",
    "models",
    "optimizers",
    "participation",
    "privacy",
    "robust",
    "sampling",
    "scaffnew",
    "scaffold",
    "sgd",
    "sweep",
]

#: Sub-packages imported on first use, as attributes (``sj.results.TensorBoardSink``,
#: ``sj.experiments.RunConfig``): the layers above the simulator, which a script of the API
#: need not load at ``import scaffold_jax``.
_LAZY_SUBMODULES = ("compilation_cache", "experiments", "paper", "progress", "results")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
