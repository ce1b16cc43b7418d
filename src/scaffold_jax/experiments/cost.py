"""What a grid will cost: its plan before it starts, and an estimate of the time left from
the cells it has measured.

The cells of a grid differ in their local work (Table 3's rows run 1 to 20 epochs, a
sweep's settings other client counts), so a rate in rounds per second, measured on the
first cell, is wrong for the next. :class:`CostModel` counts each cell's work in
parameter-examples instead: a round of one config is S · K · B gradient examples (its
plan's shape for the data's mean client) times the model's P parameters, plus a fixed
:data:`ROUND_OVERHEAD` (dispatch, sampling, aggregation, the host's work per round: what
a round of a tiny model such as Figure 3's quadratics costs whatever its K), and an
evaluation the examples it reads (the test set and the training-loss subsample, a forward
pass each) times P plus :data:`EVAL_OVERHEAD`. Two rates, seconds per unit of round work
and of evaluation work, are fitted on the cells already run (their round and evaluation
time, measured apart), and a compilation is counted once per program the grid has not
compiled yet. The progress bar of a grid moves by the same work, so its ETA is right too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

#: An evaluated example costs a forward pass: about a third of a gradient example. Only
#: the progress bar's weights use it; the estimate fits both rates on measured cells.
_FORWARD_SHARE = 1.0 / 3.0

#: A round's fixed cost per config, in parameter-examples: on a 2-core CPU a config-round
#: of Figure 3's quadratics (a handful of parameters) takes ~0.1 ms whatever its K, about
#: what 1e5 parameter-examples of an MLP's gradient take; on an accelerator both shrink.
#: Only the split between the two terms rests on it: the rate is measured.
ROUND_OVERHEAD = 1e5
#: An evaluation's fixed cost per config (the host's records included), likewise.
EVAL_OVERHEAD = 1e5


@dataclasses.dataclass(frozen=True)
class CellWork:
    """A cell's work: ``configs`` programs' worth of ``rounds`` rounds of ``round_examples``
    gradient examples and ``evaluations`` evaluations of ``eval_examples`` examples."""

    configs: int
    rounds: int
    round_examples: float
    evaluations: int
    eval_examples: float
    program: tuple  # what its compiled program depends on: equal programs compile once
    params: int = 1  # P, the model's parameters: an example's cost scales with it

    @property
    def gradient_examples(self) -> float:
        return self.configs * self.rounds * self.round_examples

    @property
    def evaluated_examples(self) -> float:
        return self.configs * self.evaluations * self.eval_examples

    @property
    def round_work(self) -> float:
        """Its rounds' work in parameter-examples, the fixed cost of each included."""
        return self.configs * self.rounds * (ROUND_OVERHEAD + self.round_examples * self.params)

    @property
    def eval_work(self) -> float:
        """Its evaluations' work in parameter-examples, the fixed cost of each included."""
        return self.configs * self.evaluations * (EVAL_OVERHEAD + self.eval_examples * self.params)

    def weight(self, eval_share: float) -> float:
        """Its work in round-work units (the progress bar's), a unit of evaluation work
        counted as ``eval_share`` of one."""
        return self.round_work + eval_share * self.eval_work


def cell_work(cell: Any, data: Any, params: int = 1) -> CellWork:
    """A cell's work, for the data of the grid's first cell (``FederatedData``) and its
    model's ``params`` P: each cell's client count rescales the mean client size (the
    same pool split N ways)."""
    config = cell.config
    configs = max(len(cell.seeds), 1) * math.prod(len(v) for v in cell.axes.values())
    counts = data.counts
    total = float(sum(int(c) for c in counts))
    mean_size = max(1, round(total / config.num_clients))
    plan = config.resolved_plan()
    steps, batch = plan.shape(mean_size)
    clients = config.resolved_clients_per_round()
    test = 0 if data.test is None else len(_first_leaf(data.test))
    train_eval = total if not config.train_eval_examples else min(total, config.train_eval_examples)
    evaluations = config.rounds // config.eval_every + 1
    program = (config.algorithm, repr(plan), clients, config.num_clients, config.model)
    return CellWork(
        configs, config.rounds, float(clients * steps * batch), evaluations,
        float(test + train_eval), program, max(int(params), 1),
    )  # fmt: skip


def _first_leaf(tree: Any) -> Any:
    import jax

    return jax.tree.leaves(tree)[0]


class CostModel:
    """The plan of a grid's cells and the time its remaining cells will take."""

    def __init__(self, works: Sequence[CellWork]):
        self.works = list(works)
        self._measured: list[tuple[CellWork, float, float, float]] = []

    def weights(self) -> list[float]:
        """Each cell's work in round-work units, evaluation work weighed as measured once
        a cell ran (a forward pass, a third of a gradient one, before)."""
        rates = self._rates()
        share = _FORWARD_SHARE if rates is None or rates[0] <= 0 else rates[1] / rates[0]
        return [w.weight(share) for w in self.works]

    def _rates(self) -> tuple[float, float, float] | None:
        """Seconds per unit of round work, of evaluation work and per compilation,
        fitted on the measured cells; None before the first."""
        if not self._measured:
            return None
        gradient = sum(w.round_work for w, *_ in self._measured)
        evaluated = sum(w.eval_work for w, *_ in self._measured)
        per_gradient = sum(r for _, r, _, _ in self._measured) / max(gradient, 1.0)
        per_evaluated = sum(e for _, _, e, _ in self._measured) / max(evaluated, 1.0)
        compiles = [c for *_, c in self._measured if c > 0]
        per_compile = sum(compiles) / len(compiles) if compiles else 0.0
        return per_gradient, per_evaluated, per_compile

    def plan(self, experiment: str) -> str:
        """One line: cells, configs, rounds and the work they hold."""
        configs = sum(w.configs for w in self.works)
        rounds = sorted({w.rounds for w in self.works})
        per = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
        config_rounds = sum(w.configs * w.rounds for w in self.works)
        gradient = sum(w.gradient_examples for w in self.works)
        programs = len({w.program for w in self.works})
        return (
            f"{experiment}: plan: {len(self.works)} cell(s), {configs} config(s) x {per} "
            f"rounds = {config_rounds:,} config-rounds, {_si(gradient)} gradient examples, "
            f"{programs} program(s) to compile; the time left is estimated after each cell"
        )

    def measured(self, index: int, run_seconds: float, eval_seconds: float,
                 compile_seconds: float) -> None:  # fmt: skip
        """Records the timing of cell ``index`` (its rounds, evaluations and compile)."""
        rounds = max(run_seconds - eval_seconds, 0.0)
        self._measured.append((self.works[index], rounds, eval_seconds, compile_seconds))

    def remaining_seconds(self, done: set[int]) -> float | None:
        """The estimated seconds of the cells not in ``done``; None before a measurement."""
        rates = self._rates()
        if rates is None:
            return None
        per_gradient, per_evaluated, per_compile = rates
        seen = {w.program for i, w in enumerate(self.works) if i in done}
        left = 0.0
        for i, w in enumerate(self.works):
            if i in done:
                continue
            left += w.round_work * per_gradient + w.eval_work * per_evaluated
            if w.program not in seen:
                seen.add(w.program)
                left += per_compile
        return left


def _si(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"
