"""The algorithms, one module each, and the algorithm registry.

An entry of :data:`ALGORITHMS` (an :class:`AlgorithmSpec`, see
:mod:`scaffold_jax.algorithms.registry`) says how to build the algorithm and what the
layers above need to know about it without naming it: its display name, its default batch
plan, the factory options a config may set, and its declared hyper-parameters (given to
:func:`register`, or read from a built instance). A new algorithm is its own module ending
with ONE :func:`register` call that declares its options, as each built-in module does; a
built-in one is imported below, in its place in the registry's order, and one defined
outside the package registers itself when its module is imported (see
:mod:`scaffold_jax.registry`). An algorithm built from the registry is named by its
registry key, which is the name its runs record (a variant registered over :func:`scaffold`
is not recorded as "scaffold").

Examples:
  >>> from scaffold_jax import algorithms
  >>> spec = algorithms.ALGORITHMS["fedprox"]
  >>> spec.display_name, list(spec.hparams)
  ('FedProx', ['client_lr', 'server_lr', 'prox_mu'])
"""

from __future__ import annotations

from scaffold_jax.algorithms.registry import (
    ALGORITHMS,
    LOCAL_OPTIMIZER,
    SERVER_OPTIMIZER,
    AlgorithmSpec,
    make,
    optimizer_option,
    register,
)
from scaffold_jax.registry import Option

# Importing a module registers its algorithms, so the order of these imports is the order
# of ALGORITHMS, which the command line's help and the docs show.
# isort: off
from scaffold_jax.algorithms.scaffold import (
    ScaffoldClientState,
    ScaffoldServerState,
    client_controls,
    scaffold,
)
from scaffold_jax.algorithms.fedavg import fedavg
from scaffold_jax.algorithms.feddyn import feddyn
from scaffold_jax.algorithms.fednova import fednova
from scaffold_jax.algorithms.fedprox import fedprox
from scaffold_jax.algorithms.mime import mime, mimelite
from scaffold_jax.algorithms.sgd import sgd
from scaffold_jax.algorithms.scaffnew import scaffnew
from scaffold_jax.algorithms.fedexp import fedexp
from scaffold_jax.algorithms.ditto import ditto
from scaffold_jax.algorithms.fedrep import fedper, fedrep
from scaffold_jax.algorithms.apfl import apfl
from scaffold_jax.algorithms.pfedme import pfedme
from scaffold_jax.algorithms.perfedavg import perfedavg
# isort: on


__all__ = [
    "ALGORITHMS",
    "LOCAL_OPTIMIZER",
    "SERVER_OPTIMIZER",
    "AlgorithmSpec",
    "Option",
    "ScaffoldClientState",
    "ScaffoldServerState",
    "apfl",
    "client_controls",
    "ditto",
    "fedavg",
    "feddyn",
    "fedexp",
    "fedper",
    "fednova",
    "fedrep",
    "fedprox",
    "make",
    "mime",
    "mimelite",
    "optimizer_option",
    "perfedavg",
    "pfedme",
    "register",
    "scaffnew",
    "scaffold",
    "sgd",
]
