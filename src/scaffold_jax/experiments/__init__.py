"""Experiments: configs, built runs, their identity, and the one host runner.

* :mod:`~scaffold_jax.experiments.config`: :class:`RunConfig`, config files and the key
  reference; the fields in :mod:`~scaffold_jax.experiments.schema`, the checks in
  :mod:`~scaffold_jax.experiments.validation`, the resolution into a frozen
  :class:`ResolvedConfig` in :mod:`~scaffold_jax.experiments.resolve`;
* :mod:`~scaffold_jax.experiments.build`: :func:`build`, the data, problem, algorithm and
  simulation a resolved config describes;
* :mod:`~scaffold_jax.experiments.identity`: what a resume must agree on;
* :mod:`~scaffold_jax.experiments.runner`: :func:`run_grid`, a :class:`Grid` of
  :class:`Cell` s (one program each) into a run folder: every command runs through it;
* :mod:`~scaffold_jax.experiments.commands`: ``run``, ``sweep`` and ``diagnose`` as grids.

Used by the ``scaffold-jax`` command (:mod:`scaffold_jax.cli`), by the paper's protocols
(:mod:`scaffold_jax.paper`) and from Python or a notebook.
"""

from scaffold_jax.experiments.build import Built, build, built_summary, load_dataset, make_problem
from scaffold_jax.experiments.commands import (
    DIAGNOSE_FIELDS,
    diagnose,
    format_run_summary,
    run,
    split_axes,
    strict_json,
    sweep,
    sweep_grid,
)
from scaffold_jax.experiments.config import RunConfig, config_reference, load_config_file
from scaffold_jax.experiments.identity import (
    CHECKPOINTS,
    RESUMABLE_CHANGES,
    canonical,
    check_resumable,
    config_identity,
    data_fingerprint,
)
from scaffold_jax.experiments.resolve import ResolvedConfig
from scaffold_jax.experiments.runner import Cell, CellResult, Grid, Outcome, run_grid
from scaffold_jax.experiments.schema import (
    DATASETS,
    OPTION_OWNERS,
    declared_hparams,
    declared_options,
    option_owners,
)
from scaffold_jax.loop import DivergenceError
from scaffold_jax.registry import ConfigError

__all__ = [
    "CHECKPOINTS", "DATASETS", "DIAGNOSE_FIELDS", "OPTION_OWNERS",
    "RESUMABLE_CHANGES", "Built", "Cell", "CellResult", "ConfigError",
    "DivergenceError", "Grid", "Outcome", "ResolvedConfig", "RunConfig", "build",
    "built_summary", "canonical", "check_resumable", "config_reference", "data_fingerprint",
    "declared_hparams", "declared_options", "diagnose", "format_run_summary",
    "load_config_file", "load_dataset", "make_problem", "option_owners", "run", "run_grid",
    "config_identity", "split_axes", "strict_json", "sweep", "sweep_grid",
]  # fmt: skip
