"""Experiments: configs, built runs, their identity, and the one host runner.

* :mod:`~scaffold_jax.experiments.config`: :class:`RunConfig`, validated in one place, and
  the option tables every registry declares;
* :mod:`~scaffold_jax.experiments.build`: :func:`build`, the data, problem, algorithm and
  simulation a config describes;
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
from scaffold_jax.experiments.config import (
    DATASETS,
    OPTION_OWNERS,
    RunConfig,
    config_reference,
    declared_hparams,
    declared_options,
    load_config_file,
    option_owners,
)
from scaffold_jax.experiments.identity import (
    CHECKPOINTS,
    RESUMABLE_CHANGES,
    canonical,
    check_resumable,
    data_fingerprint,
    run_identity,
)
from scaffold_jax.experiments.runner import Cell, CellResult, Grid, Outcome, run_grid
from scaffold_jax.loop import DivergenceError
from scaffold_jax.registry import ConfigError

__all__ = [
    "CHECKPOINTS", "DATASETS", "DIAGNOSE_FIELDS", "OPTION_OWNERS",
    "RESUMABLE_CHANGES", "Built", "Cell", "CellResult", "ConfigError",
    "DivergenceError", "Grid", "Outcome", "RunConfig", "build", "built_summary", "canonical",
    "check_resumable", "config_reference", "data_fingerprint", "declared_hparams",
    "declared_options", "diagnose", "format_run_summary", "load_config_file", "load_dataset",
    "make_problem", "option_owners", "run", "run_grid", "run_identity", "split_axes",
    "strict_json", "sweep", "sweep_grid",
]  # fmt: skip
