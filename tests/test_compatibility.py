"""The one compatibility matrix (scaffold_jax.compatibility): every "yes" cell runs, every
"no" cell is refused with its reason, and the manual's composition table is the matrix."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import pytest

import scaffold_jax as sj
from scaffold_jax import compatibility, participation
from scaffold_jax.privacy import private
from tests.conftest import binary_clients
from tests.test_model_state import make_data, make_problem

PLAN = sj.BatchPlan.fixed(batch_size=2, num_steps=2)


def _setting(feature: str, mode: str):
    """The algorithm, problem, participation and hyper-parameters of a run with ``feature``
    on (device profiles always under FedBuff, which times its clients with them)."""
    if feature == "model_statistics":
        problem, data = make_problem(), make_data(sizes=(3, 7, 5, 9, 4, 6))[1]
    else:
        problem = sj.models.logistic_regression((3,), 2)
        data = binary_clients([4, 6, 3, 5, 8, 4], 1)
    algorithm = sj.scaffold(problem.loss_fn)
    hparams = {"client_lr": 0.1}
    models, options = {}, {}
    if feature in ("profiles", "deadline", "over_selection") or mode == "fedbuff":
        models["profiles"] = "lognormal"
    if feature == "availability":
        models["availability"], options["availability_rate"] = "markov", 0.5
    if feature == "stragglers":
        models["stragglers"], options["straggler_min_steps"] = "uniform", 1
    if feature == "dropouts":
        models["dropouts"], options["dropout_rate"] = "bernoulli", 0.3
    if feature == "deadline":
        options["round_deadline"] = 0.06
    if feature == "over_selection":
        options["over_selection"] = 1.5
    if feature == "compression":
        algorithm = sj.compression.compressed(algorithm, "topk")
        hparams["compress_fraction"] = 0.5
    if feature == "privacy":
        algorithm = private(algorithm)
        hparams.update(dp_noise_multiplier=0.1, dp_clip=1.0)
    if feature == "attack":
        algorithm = sj.robust.attacked(algorithm, "signflip")
    if feature == "robust_aggregation":
        algorithm = sj.robust.robustly_aggregated(algorithm, "median")
    part = participation.make(**models, options=options)
    execution = sj.FedBuff(4, 2) if mode == "fedbuff" else None
    sim = sj.Simulation(algorithm, problem, PLAN, 2, participation=part, execution=execution)
    return sim, data, hparams


def test_every_feature_is_one_the_simulation_reports():
    for feature in compatibility.FEATURES:
        sim, _, _ = _setting(feature, "sync")
        on = compatibility.features_of(sim.algorithm, sim.participation, sim.problem)
        assert feature in on, feature


def _cells():
    """Every (feature, mode) cell; the cells that run are in the slow tier (the "no" cells
    are refused before anything compiles; the quick tier runs FedBuff with every feature at
    once in tests/test_fedbuff_compose.py and from the command line)."""
    for feature in compatibility.FEATURES:
        for mode in compatibility.MODES:
            quick = compatibility.MATRIX[mode][feature] is not None
            yield pytest.param(feature, mode, marks=() if quick else pytest.mark.slow)


@pytest.mark.parametrize(("feature", "mode"), _cells())
def test_each_cell_runs_or_is_refused_with_its_reason(mode, feature):
    sim, data, hparams = _setting(feature, mode)
    why = compatibility.MATRIX[mode][feature]
    if why is not None:
        with pytest.raises(ValueError) as refused:
            sim.run(data, hparams, num_rounds=3)
        assert why in str(refused.value) and "\n" not in str(refused.value)
        return
    result = sim.run(data, hparams, num_rounds=3, eval_every=3)
    assert result.records[-1]["round"] == 3
    assert all(math.isfinite(float(np.sum(a))) for a in jax.tree.leaves(result.state.server))
    if feature == "deadline":  # the cell's feature acts: a client slower than D is lost
        assert "late" in result.records[-1]


def test_the_manual_shows_the_matrix():
    page = (Path(__file__).parent.parent / "docs" / "how-to" / "time.md").read_text()
    assert compatibility.table() in page, (
        "docs/how-to/time.md's composition table is not the matrix: paste "
        "scaffold_jax.compatibility.table() there"
    )
