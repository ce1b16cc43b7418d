"""A grid's plan and the time it says is left (scaffold_jax.experiments.cost).

The work of a cell is counted from its config and the data's sizes; the estimate of the
time left comes from the cells measured, so a grid whose cells differ in local work (a
table's 1 to 20 epochs) is not estimated at the first cell's rate in rounds.
"""

import numpy as np
import pytest

from scaffold_jax.data.federated import from_client_arrays
from scaffold_jax.experiments import RunConfig
from scaffold_jax.experiments.cost import EVAL_OVERHEAD, ROUND_OVERHEAD, CostModel, cell_work
from scaffold_jax.experiments.runner import Cell


def _data(num_clients=10, size=60, test=100):
    rng = np.random.default_rng(0)
    clients = [
        {"x": rng.normal(size=(size, 3)).astype(np.float32), "y": np.zeros(size, np.int32)}
        for _ in range(num_clients)
    ]
    held_out = {"x": np.zeros((test, 3), np.float32), "y": np.zeros(test, np.int32)}
    return from_client_arrays(clients, test=held_out)


def _cell(key="c", axes=None, seeds=(), **fields):
    config = RunConfig(**{"num_clients": 10, "clients_per_round": 4, "rounds": 20,
                          "eval_every": 5, "train_eval_examples": 200, **fields})  # fmt: skip
    return Cell(key, config, axes=axes or {}, seeds=seeds)


def test_a_cell_counts_its_configs_gradient_examples_and_evaluations():
    # fraction 0.2 of 60 examples for 2 epochs: K = 10 steps of B = 12, S = 4 clients.
    cell = _cell(axes={"client_lr": [0.1, 0.3, 1.0]}, seeds=(0, 1), local_epochs=2)
    work = cell_work(cell, _data())
    assert work.configs == 6 and work.rounds == 20
    assert work.round_examples == 4 * 10 * 12
    assert work.evaluations == 20 // 5 + 1
    assert work.eval_examples == 100 + 200  # the test set and the training-loss subsample
    assert work.gradient_examples == 6 * 20 * 480
    # Its work in parameter-examples: each round and evaluation has a fixed cost too.
    weighed = cell_work(cell, _data(), params=1000)
    assert weighed.round_work == 6 * 20 * (ROUND_OVERHEAD + 480 * 1000)
    assert weighed.eval_work == 6 * 5 * (EVAL_OVERHEAD + 300 * 1000)
    # The same pool split over 5 clients: each holds 120 examples, a round twice the work.
    halves = cell_work(_cell(local_epochs=2, num_clients=5), _data())
    assert halves.round_examples == 4 * 10 * 24


def test_the_time_left_scales_each_cell_by_its_work_and_compiles_each_program_once():
    data = _data()
    cells = [_cell("a", local_epochs=1), _cell("b", local_epochs=4), _cell("c", local_epochs=4),
             _cell("d", local_epochs=1, train_eval_examples=0)]  # fmt: skip
    model = CostModel([cell_work(c, data, params=100_000) for c in cells])
    assert model.remaining_seconds(set()) is None  # nothing measured yet
    # Cell a: 2 s of rounds, 1 s of evaluations (inside run_seconds), 5 s compiling.
    model.measured(0, run_seconds=3.0, eval_seconds=1.0, compile_seconds=5.0)
    left = model.remaining_seconds({0})
    a, b, c, d = model.works
    per_gradient, per_eval = 2.0 / a.round_work, 1.0 / a.eval_work
    expected = sum(w.round_work * per_gradient + w.eval_work * per_eval
                   for w in (b, c, d))  # fmt: skip
    expected += 5.0  # b and c share a program (it compiles once); d is a's program
    assert b.gradient_examples == 4 * a.gradient_examples
    # A big model: the rounds' fixed cost is small beside their examples' (4x the work).
    assert 3.9 < b.round_work / a.round_work < 4.0
    assert left == pytest.approx(expected)
    assert model.remaining_seconds({0, 1, 2, 3}) == 0.0


def test_the_progress_weights_follow_the_measured_cost_of_an_evaluation():
    data = _data()
    model = CostModel([cell_work(_cell("a"), data), cell_work(_cell("b", eval_every=1), data)])
    before = model.weights()
    a, b = model.works
    assert before[0] == pytest.approx(a.round_work + a.eval_work / 3)
    # Measured: the evaluations took as long as the rounds.
    model.measured(0, run_seconds=2.0 * 1.0, eval_seconds=1.0, compile_seconds=0.0)
    share = (1.0 / a.eval_work) / (1.0 / a.round_work)
    assert model.weights()[1] == pytest.approx(b.round_work + share * b.eval_work)


def test_a_tiny_model_costs_by_the_round_not_by_its_local_steps():
    """Figure 3's quadratics: a round of K = 10 costs about what a round of K = 1 does
    (the fixed cost per round dominates), so after the SGD cell the time left for the
    K = 10 cells is not 10x too long (it was 4-7x, the issue 40 report)."""
    data = _data()
    cells = [_cell("sgd", local_steps=1, batch_size=1), _cell("k10", local_steps=10, batch_size=1)]
    model = CostModel([cell_work(c, data, params=10) for c in cells])
    model.measured(0, run_seconds=2.0, eval_seconds=1.0, compile_seconds=0.0)
    assert model.remaining_seconds({0}) == pytest.approx(2.0, rel=0.02)


def test_the_plan_line_names_cells_configs_rounds_and_programs():
    data = _data()
    cells = [_cell("a", axes={"client_lr": [0.1, 0.3]}), _cell("b", local_epochs=3)]
    line = CostModel([cell_work(c, data) for c in cells]).plan("table3")
    assert line.startswith("table3: plan: 2 cell(s), 3 config(s) x 20 rounds = 60 config-rounds")
    assert "2 program(s) to compile" in line
