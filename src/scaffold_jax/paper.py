"""The paper's experiments as protocols: Figure 3 and Tables 3, 4 and 5.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020 (arXiv:1910.06378). :func:`reproduce` runs a named protocol: ``fig3`` (the
simulated quadratics of Figure 3) and ``table3`` / ``table4`` / ``table5`` (EMNIST in the
paper; Fashion-MNIST offline). η_l is tuned per algorithm over a grid, as the paper did,
with one vmapped program per grid (a cell of :func:`scaffold_jax.experiments.run_grid`); the chosen
values are reported next to the tables.

Choices the paper (Karimireddy et al., ICML 2020, Section 7) leaves open are fields of the protocol
dataclasses, documented where they are defined: :class:`Fig3Protocol` (the quadratic
family, start point, error target, η_l grid) and :class:`TableProtocol` (dataset, target,
η_l grids, hidden sizes, evaluation cadence).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import assembly, sources, synthetic
from scaffold_jax.data.batching import MAX_LOCAL_STEPS, BatchPlan
from scaffold_jax.engine import MAX_ROUNDS, MAX_SEED, ROUNDS_WHY, SEED_WHY
from scaffold_jax.experiments import (
    Cell,
    CellResult,
    ConfigError,
    Grid,
    RunConfig,
    run_grid,
)
from scaffold_jax.experiments.config import _Checker, _is_number
from scaffold_jax.experiments.identity import short_digest
from scaffold_jax.models import MODELS
from scaffold_jax.registry import in_one_line


# =====================================================================================
# Figure 3: the simulated quadratics
# =====================================================================================
@dataclasses.dataclass(frozen=True)
class Fig3Protocol:
    """Figure 3 of the paper: N = 2 quadratic clients, full-batch gradients, no sampling.

    The paper states N = 2, β = 1, δ = 1, G ∈ {1, 10, 100}, K ∈ {2, 10} and plots
    f(x) − f* against rounds for SGD, FedAvg and SCAFFOLD, not the functions. Ours come
    from :func:`scaffold_jax.data.synthetic.figure3_problem` (exact β, δ, G, μ), with
    these choices:

    * ``delta = 0.5``: δ = 1 is infeasible for two clients with β = 1 and a strongly
      convex f (δ ≤ β − μ), and every δ > β/2 makes one client non-convex. At the largest
      convex value, δ = β/2, the clients disagree along a direction that is not the
      slowest one, the regime the paper's figure shows. With ``delta=0.99`` (the
      problem's own default, client 0 has eigenvalue −0.98) FedAvg diverges for any
      η_l > 0.02 whatever G, and SCAFFOLD's gain from K = 10 local steps over SGD
      shrinks to ~1.7x, as the theory's optimal K ≈ β/δ ≈ 1 predicts.
    * ``start_distance = 10``: ‖x0 − x*‖, so f(x0) − f* ≈ 6; the heterogeneity G is only
      meaningful against this scale.
    * ``mu = 0.01``: strong convexity of f (condition number 100); ``dim = 10``.
    * ``target = 1e-2``: the error target, relative: rounds until
      f(x) − f* ≤ target · (f(x0) − f*).
    * η_l tuned per (algorithm, K, G) over ``lr_grid`` for the fewest rounds to the
      target; η_g = 1. SGD takes one full-gradient step per round (K does not apply).
    * SCAFFOLD's controls start at zero (Algorithm 1, Section 4, takes the initial c and
      c_i as inputs; zero is the choice that needs no extra pass over the data).
      ``warm_controls=True`` adds rows of SCAFFOLD with warm-started controls
      (``c_i = ∇f_i(x0)``, option I of Algorithm 1's control update at x0): with them
      SCAFFOLD's rounds no longer depend on
      G, and at δ close to 1 (``--set delta=0.99``) K = 10 is faster than K = 2 again.
    """

    gradient_dissimilarities: tuple[float, ...] = (1.0, 10.0, 100.0)
    local_steps: tuple[int, ...] = (2, 10)
    num_rounds: int = 1000
    eval_every: int = 1
    target: float = 1e-2
    lr_grid: tuple[float, ...] = (1.0, 0.5, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002)
    delta: float = 0.5
    mu: float = 0.01
    dim: int = 10
    start_distance: float = 10.0
    seed: int = 0
    methods: tuple[str, ...] = ("sgd", "fedavg", "scaffold")
    warm_controls: bool = False

    def validate(self) -> Fig3Protocol:
        errors: list[str] = []
        check = _Checker(errors)
        _check_rounds(check, self.num_rounds)
        check.integer("eval_every", self.eval_every, low=1)
        check.number("target", self.target, low=0.0, high=1.0, strict=True, what="in (0, 1)")
        check.number("delta", self.delta, low=0.0, what=">= 0")
        check.number("mu", self.mu, low=0.0, high=1.0, strict=True, what="in (0, 1)")
        if check.integer("dim", self.dim, low=2):
            try:  # the N = 2 Hessians d x d must fit in memory (dim = 10**8 would not)
                synthetic.check_quadratic_size(2, self.dim)
            except ValueError as err:
                errors.append(str(err))
        check.number("start_distance", self.start_distance, low=0.0, strict=True, what="> 0")
        _check_seed(check, self.seed)
        _check_list(errors, "gradient_dissimilarities", self.gradient_dissimilarities,
                    _finite_at_least_zero, "finite numbers >= 0")  # fmt: skip
        _check_list(errors, "local_steps", self.local_steps, _local_steps,
                    f"integers in [1, {MAX_LOCAL_STEPS}]")  # fmt: skip
        _check_lr_grid(errors, "lr_grid", self.lr_grid)
        if _check_list(errors, "methods", self.methods, _is_str, "algorithm names"):
            for m in self.methods:
                if m not in ALGORITHMS:
                    errors.append(f"methods = {self.methods!r} is invalid: unknown method {m!r}.")
        check.type("warm_controls", self.warm_controls, bool, "true or false")
        if errors:
            raise ConfigError(in_one_line("invalid fig3 protocol", errors))
        return self


def _check_seed(check: _Checker, seed: Any) -> None:
    check.integer(
        "seed", seed, low=0, high=MAX_SEED, what=f"an integer >= 0 and <= {MAX_SEED}{SEED_WHY}"
    )


def _check_rounds(check: _Checker, num_rounds: Any) -> None:
    check.integer(
        "num_rounds", num_rounds, low=1, high=MAX_ROUNDS,
        what=f"an integer >= 1 and <= {MAX_ROUNDS}{ROUNDS_WHY}",
    )  # fmt: skip


def _check_list(
    errors: list[str], name: str, values: Any, fits: Callable[[Any], bool], what: str
) -> bool:
    """``values`` must be a non-empty list (or tuple) of elements that ``fits``; False
    (with a message naming the field and what it takes) otherwise. A protocol field given
    the wrong type fails here, not later inside the grid (``similarities = 5`` is not a
    list to iterate)."""
    if isinstance(values, (list, tuple)) and values and all(fits(v) for v in values):
        return True
    errors.append(f"{name} = {values!r} is invalid: it must be a non-empty list of {what}.")
    return False


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _finite_at_least_zero(value: Any) -> bool:
    return _is_number(value) and 0 <= value < math.inf


def _is_percentage(value: Any) -> bool:
    return _is_number(value) and 0 <= value <= 100


def _local_steps(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LOCAL_STEPS


def _check_lr_grid(errors: list[str], name: str, grid: Any) -> None:
    """Step sizes: finite, > 0 and normal float32 numbers (hyper-parameters are float32)."""
    if _check_list(errors, name, grid, _is_number, "step sizes > 0"):
        for value in grid:
            if not _Checker(errors).number(
                name, value, low=0.0, strict=True, what="finite and > 0", float32=True
            ):
                return


def fig3_protocol(quick: bool = False, **overrides: Any) -> Fig3Protocol:
    """The Figure 3 protocol; ``quick`` keeps the problems and shortens the horizon to 150
    rounds and the grid to 8 step sizes (a test-sized run that still shows every
    finding)."""
    base = Fig3Protocol()
    if quick:
        base = dataclasses.replace(
            base, num_rounds=150, lr_grid=(1.0, 0.5, 0.3, 0.15, 0.1, 0.05, 0.02, 0.01)
        )
    return _override(base, overrides).validate()


def _chosen_cells(
    grid, done, writer, panels, *, panel, lead, tail, target, metric="test_accuracy",
    higher_is_better=True,
) -> list[dict[str, Any]]:  # fmt: skip
    """What a protocol reports of each cell: the config the one selection policy chooses
    (its rounds, η_l, series, the diverged η_l, timing) between the cell's own facts
    (``lead(cell)``, ``tail(chosen records)``); its series drawn in ``panels[panel(labels)]``
    and marked chosen in the summary."""
    cells = []
    for grid_cell in grid.cells:
        result = done[grid_cell.key]
        j, rounds = result.choose(target, metric, higher_is_better)
        diverged = sorted({c["client_lr"] for c, d in zip(result.configs, result.diverged,
                                                          strict=True) if d})  # fmt: skip
        cell = {
            **lead(grid_cell),
            "rounds": rounds,
            "client_lr": result.configs[j]["client_lr"],
            "series": result.series[j],
            "diverged_lrs": diverged,
            "compile_seconds": round(result.compile_seconds, 3),
            "run_seconds": round(result.run_seconds, 3),
            **tail(result.records[j]),
        }
        if grid_cell.seeds:  # the chosen η_l over every seed: means and spreads
            best, _ = results.select(result.candidates(), target, metric, higher_is_better)
            bests = [results.best_value(result.records[i], metric, higher_is_better)
                     for i in best["configs"]]  # fmt: skip
            cell.update(
                seeds=best["seeds"],
                rounds=best["rounds_mean"],
                rounds_std=best["rounds_std"],
                rounds_per_seed=best["rounds_to_target"],
                reached=best["reached"],
                best_per_seed=bests,
            )
        panels[panel(grid_cell.labels)].append(cell["series"])
        writer.describe(cell["series"], chosen=True, **cell)
        cells.append(cell)
    return cells


def _one_step(method: str) -> bool:
    """Whether ``method`` takes one full-batch step a round (its registered default plan is
    ``"full"``: large-batch SGD), so K and epochs do not apply to it."""
    return method in ALGORITHMS and ALGORITHMS[method].default_plan == "full"


def _display(method: str) -> str:
    return ALGORITHMS[method].display_name if method in ALGORITHMS else method


def _label(method: str, local_steps: int | None, warm: bool = False) -> str:
    name = _display(method) + (" (warm c)" if warm else "")
    return name if local_steps is None else f"{name} K={local_steps}"


def _fig3_legend(series: str) -> str:
    """``"SCAFFOLD K=10 · G=1 lr=0.5"`` → ``"SCAFFOLD K=10, η_l = 0.5"``: the panel's title
    says G."""
    setting, _, rest = series.partition(" · ")
    return f"{setting}, η_l = {rest.rpartition('lr=')[2]}"


def fig3_grid(protocol: Fig3Protocol) -> Grid:
    """Figure 3 as a grid: a cell per (method, K, G) over the η_l grid, each a config of
    the ``quadratic`` family (N = 2, β = 1, full batch, every client every round)."""
    settings = [
        (m, None, False) if _one_step(m) else (m, k, False)
        for m in protocol.methods
        for k in protocol.local_steps
    ]
    if protocol.warm_controls:  # the methods that offer warm-started controls (SCAFFOLD)
        settings += [
            (m, k, True)
            for m in protocol.methods
            if "warm_controls" in ALGORITHMS[m].options
            for k in protocol.local_steps
        ]
    cells = []
    for method, local_steps, warm in dict.fromkeys(settings):
        for G in protocol.gradient_dissimilarities:
            # Every G shares the Hessians and the start point (the family draws them from
            # the same seed), so one compiled program serves every G of a method.
            config = RunConfig(
                algorithm=method, dataset="quadratic", num_clients=2, clients_per_round=2,
                batch_plan="full", local_steps=local_steps or 1, rounds=protocol.num_rounds,
                eval_every=protocol.eval_every, seed=protocol.seed, targets=[],
                quad_beta=1.0, quad_delta=protocol.delta, quad_G=G, quad_mu=protocol.mu,
                quad_dim=protocol.dim, quad_start=protocol.start_distance,
                **({"warm_controls": True} if warm else {}),
            )  # fmt: skip
            labels = {"algorithm": method, "local_steps": local_steps, "G": G}
            key = f"{_label(method, local_steps, warm)} · G={G:g}"
            cells.append(Cell(key, config, {"client_lr": protocol.lr_grid}, labels=labels))
    # The relative error, against the table's target: every panel starts at 1 and the
    # dashed line is where fig3.md counts the rounds. The panels fill as cells finish.
    plot = results.PlotSpec(
        "fig3.png",
        "relative_error",
        "(f(x) − f*) / (f(x⁰) − f*)",
        logy=True,
        panels={f"G = {G:g}": [] for G in protocol.gradient_dissimilarities},
        title="Figure 3: SGD vs FedAvg vs SCAFFOLD on quadratics (N = 2, β = 1, "
        f"δ = {protocol.delta:g}, full batch); chosen η_l per method",
        target=protocol.target,
        legend=_fig3_legend,
    )
    saved = {"experiment": "fig3", "protocol": dataclasses.asdict(protocol)}
    return Grid("fig3", cells, saved, plots=(plot,))


def reproduce_fig3(
    protocol: Fig3Protocol,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    quiet: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Runs Figure 3: error vs rounds per G, step sizes tuned per (algorithm, K, G).

    Writes the usual run files plus ``fig3.png`` (one panel per G, log-scale relative
    error with the target, the chosen η_l of each method) and ``fig3.md`` (rounds to the
    target with the speed-up over SGD, and the chosen η_l). Every η_l's records are in
    ``metrics.jsonl``.

    Returns:
      The summary; ``summary["cells"]`` holds one dict per (method, K, G) with
      ``rounds`` (None: not reached within the horizon) and ``client_lr``.
    """
    protocol.validate()
    grid = fig3_grid(protocol)
    start = time.perf_counter()
    (plot,) = grid.plots
    table = ""

    def report(done: Mapping[str, CellResult], writer: results.RunWriter) -> None:
        nonlocal table
        cells = _chosen_cells(
            grid, done, writer, plot.panels,
            panel=lambda labels: f"G = {labels['G']:g}",
            lead=lambda cell: {
                "method": cell.labels["algorithm"],
                "local_steps": cell.labels["local_steps"],
                "warm_controls": bool(cell.config.options.get("warm_controls")),
                "G": cell.labels["G"],
            },
            tail=lambda records: {"final_error": records[-1]["error"]},
            target=protocol.target, metric="relative_error", higher_is_better=False,
        )  # fmt: skip
        table = fig3_table(cells, protocol)
        wall = time.perf_counter() - start
        problems = {
            f"G={r.info['G']:g}": {k: r.info[k] for k in ("beta", "delta", "G", "mu", "f_star")}
            for r in done.values()
        }
        writer.add(dataset="quadratic (scaffold_jax.data.synthetic.quadratic_problem)",
                   problem=problems, cells=cells, table=table,
                   wall_seconds_total=round(wall, 3))  # fmt: skip
        writer.write_text("fig3.md", table + f"\n\nWall time: {wall:.1f} s.\n")

    # A protocol resumes by cell (its parts): checkpoints inside cells this short cost more
    # than they save (one orbax save per evaluation made fig3 --quick 9x slower).
    outcome = run_grid(
        grid, out, report=report, overwrite=overwrite, quiet=quiet, resume=resume,
        checkpoint=False,
    )  # fmt: skip
    if not quiet:
        print(table)
        wall = outcome.summary["wall_seconds_total"]
        print(f"\nWall time: {wall:.1f} s. Wrote {out}/: {', '.join(outcome.files)}")
    return outcome.summary


def fig3_table(cells: Sequence[Mapping[str, Any]], protocol: Fig3Protocol) -> str:
    """Rounds to the error target per (method, K) and G, speed-up over SGD; chosen η_l."""
    table_cells = [
        results.Cell(
            row=(
                _display(c["method"]) + (" (warm c)" if c.get("warm_controls") else ""),
                "—" if c["local_steps"] is None else c["local_steps"],
            ),
            column=f"G = {c['G']:g}",
            rounds=c["rounds"],
            horizon=protocol.num_rounds,
            client_lr=c["client_lr"],
        )
        for c in cells
    ]
    header = ("method", "K")
    return "\n".join(
        [
            "### Figure 3: rounds to f(x) − f* ≤ "
            f"{protocol.target:g} · (f(x0) − f*) (speed-up over SGD)",
            "",
            f"Quadratics: N = 2, β = 1, δ = {protocol.delta:g}, μ = {protocol.mu:g}, "
            f"d = {protocol.dim}, ‖x0 − x*‖ = {protocol.start_distance:g}; full batch, no "
            f"sampling, η_g = 1, horizon {protocol.num_rounds} rounds.",
            "",
            results.rounds_table(table_cells, header),
            "",
            "Chosen η_l (grid " + ", ".join(f"{v:g}" for v in protocol.lr_grid) + "):",
            "",
            results.value_table(table_cells, header, fmt="g", field="client_lr"),
        ]
    )


# =====================================================================================
# Tables 3-5: EMNIST (or Fashion-MNIST offline)
# =====================================================================================
class Row(NamedTuple):
    """A row of a paper table: the method, its local epochs and the sampled fraction."""

    method: str
    epochs: int
    sampled: float = 0.2


# Targets: the paper's for EMNIST; for other datasets a level at about the same fraction
# of what logistic regression reaches (EMNIST-47 ~0.68 -> 0.5; Fashion-MNIST ~0.84 -> 0.7).
_TARGETS = {
    "table3": {"emnist": 0.5, "default": 0.7},
    "table4": {"emnist": 0.45, "default": 0.65},
}
# η_l grids (the paper does not give its grid). SGD's single full-batch step tolerates
# larger steps than K local steps do.
_LR_GRIDS = {
    "sgd": (0.3, 1.0, 3.0, 10.0),
    "scaffold": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
    "fedavg": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
    "fedprox": (0.01, 0.03, 0.1, 0.3, 1.0),
    "feddyn": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
    "fednova": (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
    # Mime's default base optimizer, optax.trace(0.9), scales steps by up to 1/(1 − 0.9).
    "mime": (0.003, 0.01, 0.03, 0.1, 0.3),
    "mimelite": (0.003, 0.01, 0.03, 0.1, 0.3),
}


@dataclasses.dataclass(frozen=True)
class TableProtocol:
    """One of the paper's EMNIST tables (3, 4 or 5) as a protocol.

    The paper's settings: N = 100 clients from the s%-similarity split; local methods
    take 5 steps per epoch with batches of 0.2 of the client's data; SGD one step on the
    client's full data; 20% of clients sampled (Table 4 varies it); η_g = 1; FedProx
    μ = 1; SCAFFOLD option II; logistic regression (Table 5: a 2-layer MLP); η_l tuned per
    algorithm and cell for the fewest rounds to the target (Table 5: the best accuracy).

    Our choices (not stated in Section 7 of the paper): ``dataset`` ("auto" = EMNIST
    balanced, 47 classes, when it can be loaded, else Fashion-MNIST), ``target`` (the
    paper's for EMNIST; 0.7 / 0.65 on Fashion-MNIST, the same fraction of what the
    model reaches), the η_l grids (``lr_grids``), MLP hidden sizes (256, 256), one seed,
    evaluation every round (``eval_every``; rounds to target are exact multiples of it).

    ``seeds`` (``--set 'seeds=[0,1,2]'``) runs every η_l of a cell with each of these run
    seeds (client sampling and minibatches; the data and initial params stay those of
    ``seed``), in the cell's one vmapped program: the η_l is chosen on the mean over seeds
    (every seed must reach the target), and the table gives mean ± std.

    ``extra_methods`` adds rows for other registered algorithms (``--set
    extra_methods='["feddyn","mime"]'``), one per (epochs, sampled) of the SCAFFOLD rows,
    each with its declared defaults (FedDyn α = 0.01, Mime's momentum 0.9) and its
    ``lr_grids`` entry.
    """

    name: str
    title: str
    rows: tuple[Row, ...]
    similarities: tuple[float, ...]
    target: float | None
    dataset: str = "auto"
    num_clients: int = 100
    batch_fraction: float = 0.2
    num_rounds: int = 1000
    eval_every: int = 1
    model: str = "logreg"
    hidden_sizes: tuple[int, ...] = (256, 256)
    lr_grids: Mapping[str, tuple[float, ...]] = dataclasses.field(
        default_factory=lambda: dict(_LR_GRIDS)
    )
    prox_mu: float = 1.0
    seed: int = 0
    seeds: tuple[int, ...] = ()
    max_train_examples: int | None = None
    max_test_examples: int | None = None
    data_dir: str | None = None
    download: bool = False
    extra_methods: tuple[str, ...] = ()

    @property
    def all_rows(self) -> tuple[Row, ...]:
        """:attr:`rows` followed by the rows of :attr:`extra_methods`."""
        shapes = [(r.epochs, r.sampled) for r in self.rows if not _one_step(r.method)]
        shapes = list(dict.fromkeys(shapes)) or [(1, 0.2)]
        extra = [Row(m, e, s) for m in self.extra_methods for e, s in shapes]
        return tuple(dict.fromkeys([*self.rows, *extra]))

    def lr_grid(self, method: str) -> tuple[float, ...]:
        """The η_l grid of ``method``: its :attr:`lr_grids` entry, else the default one
        (so ``extra_methods`` work with a protocol whose grids name only its own rows)."""
        return tuple(self.lr_grids.get(method) or _LR_GRIDS.get(method, ()))

    def validate(self) -> TableProtocol:
        errors: list[str] = []
        check = _Checker(errors)
        check.integer("num_clients", self.num_clients, low=1)
        fraction = check.number(
            "batch_fraction", self.batch_fraction, low=0.0, high=1.0, strict=True, what="in (0, 1]"
        )
        _check_rounds(check, self.num_rounds)
        check.integer("eval_every", self.eval_every, low=1)
        check.choice("model", self.model, MODELS)
        _check_list(errors, "hidden_sizes", self.hidden_sizes, _positive_int, "integers >= 1")
        check.number("prox_mu", self.prox_mu, low=0.0, what=">= 0", float32=True)
        _check_seed(check, self.seed)
        seeds_ok = self.seeds == () or _check_list(
            errors, "seeds", self.seeds, _is_seed, f"integers in [0, {MAX_SEED}]"
        )
        if seeds_ok and len(set(self.seeds)) != len(self.seeds):
            errors.append(f"seeds = {list(self.seeds)} repeats a seed; give each once.")
        check.integer("max_train_examples", self.max_train_examples, low=1, optional=True)
        check.integer("max_test_examples", self.max_test_examples, low=1, optional=True)
        check.type("data_dir", self.data_dir, str, "a folder path", optional=True)
        check.type("download", self.download, bool, "true or false")
        if self.target is not None:
            check.number("target", self.target, low=0.0, high=1.0, strict=True, what="in (0, 1]")
        _check_list(
            errors, "similarities", self.similarities, _is_percentage, "percentages in [0, 100]"
        )
        extra_ok = self.extra_methods == () or _check_list(
            errors, "extra_methods", self.extra_methods, _is_str, "algorithm names"
        )
        grids_ok = isinstance(self.lr_grids, Mapping)
        if not grids_ok:
            errors.append(
                f"lr_grids = {self.lr_grids!r} is invalid: it must be a table of method names "
                'and step sizes, e.g. {"scaffold": [0.1, 0.3]}.'
            )
        what = "[method, epochs, sampled] rows (epochs an integer >= 1)"
        rows_ok = _check_list(errors, "rows", self.rows, _is_row, what)
        for row in self.all_rows if rows_ok and extra_ok else ():
            if row.method not in ALGORITHMS:
                errors.append(f"rows: method {row.method!r} is unknown.")
            elif grids_ok and not self.lr_grid(row.method):
                errors.append(
                    f"lr_grids has no step sizes for method {row.method!r}: give them, e.g. "
                    f"--set 'lr_grids={{\"{row.method}\":[0.03,0.1,0.3]}}'."
                )
            if not (_is_number(row.sampled) and 0 < row.sampled <= 1):
                errors.append(f"rows: sampled = {row.sampled!r} must be in (0, 1].")
        epochs = [r.epochs for r in self.all_rows if not _one_step(r.method)] if (
            rows_ok and extra_ok and fraction
        ) else []  # fmt: skip
        if epochs:
            try:  # K = epochs x round(1 / batch_fraction) local steps must stay bounded
                BatchPlan.fraction_of_data(self.batch_fraction, max(epochs))
            except ValueError as err:
                errors.append(f"rows: the largest epochs = {max(epochs)}: {err}")
        for method, grid in self.lr_grids.items() if grids_ok else ():
            _check_lr_grid(errors, f"lr_grids[{method!r}]", grid)
        check.type("dataset", self.dataset, str, "'auto' or a dataset name")
        if isinstance(self.dataset, str) and self.dataset != "auto":
            try:
                sources.canonical_name(self.dataset)
            except ValueError:
                errors.append(
                    f"dataset = {self.dataset!r} is invalid: it must be 'auto' or one of "
                    f"{', '.join(sources.DATASETS)}."
                )
        if errors:
            raise ConfigError(in_one_line(f"invalid {self.name} protocol", errors))
        return self


def _is_seed(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_row(row: Any) -> bool:
    return isinstance(row, Row) and isinstance(row.method, str) and _positive_int(row.epochs)


def _table_rows(methods_epochs: Sequence[tuple[str, Sequence[int]]], sampled=(0.2,)):
    return tuple(Row(m, e, s) for m, epochs in methods_epochs for e in epochs for s in sampled)


def table3_protocol(quick: bool = False, **overrides: Any) -> TableProtocol:
    """Table 3: logistic regression, rounds to the target, epochs x similarity.

    ``quick``: a test-sized run: 1 epoch, the 0% column, 60 rounds evaluated every 2,
    η_l grids of two values for SCAFFOLD and FedAvg and one for SGD and FedProx, around
    the values that work at 1 epoch (on Fashion-MNIST SCAFFOLD reaches 0.7 in ~14 rounds,
    FedAvg and SGD in ~40).
    """
    base = TableProtocol(
        name="table3",
        title="Table 3: rounds to the target accuracy, logistic regression",
        rows=(
            Row("sgd", 1),
            *_table_rows([("scaffold", (1, 5, 10, 20)), ("fedavg", (1, 5, 10, 20))]),
            *_table_rows([("fedprox", (1, 5, 10, 20))]),
        ),
        similarities=(0.0, 10.0, 100.0),
        target=None,  # resolved per dataset (see _TARGETS) unless given
    )
    if quick:
        base = dataclasses.replace(
            base,
            rows=(Row("sgd", 1), Row("scaffold", 1), Row("fedavg", 1), Row("fedprox", 1)),
            similarities=(0.0,),
            num_rounds=60,
            eval_every=2,
            # Two values for the pair the test compares, one for the others.
            lr_grids={
                "sgd": (3.0,),
                "scaffold": (0.1, 0.3),
                "fedavg": (1.0, 3.0),
                "fedprox": (0.3,),
            },
        )
    return _override(base, overrides)


def table4_protocol(quick: bool = False, **overrides: Any) -> TableProtocol:
    """Table 4: client sampling (20%, 5%, 1%), 5 epochs, rounds to the target."""
    base = TableProtocol(
        name="table4",
        title="Table 4: rounds to the target accuracy with client sampling",
        rows=_table_rows([("scaffold", (5,)), ("fedavg", (5,))], sampled=(0.2, 0.05, 0.01)),
        similarities=(0.0, 10.0),
        target=None,
    )
    if quick:
        base = dataclasses.replace(
            base,
            rows=_table_rows([("scaffold", (1,)), ("fedavg", (1,))], sampled=(0.2, 0.05)),
            similarities=(0.0,),
            num_rounds=40,
            lr_grids={"scaffold": (0.1,), "fedavg": (1.0,)},
        )
    return _override(base, overrides)


def table5_protocol(quick: bool = False, **overrides: Any) -> TableProtocol:
    """Table 5: 2-layer MLP, 5 epochs, 20% sampled, best test accuracy in the horizon."""
    base = TableProtocol(
        name="table5",
        title="Table 5: best test accuracy within the horizon, 2-layer MLP",
        rows=(Row("sgd", 1), Row("fedavg", 5), Row("scaffold", 5)),
        similarities=(0.0, 10.0),
        target=None,
        model="mlp",
        eval_every=5,
        lr_grids={"sgd": (0.3, 1.0, 3.0), "fedavg": (0.03, 0.1, 0.3), "scaffold": (0.03, 0.1, 0.3)},
    )
    if quick:
        base = dataclasses.replace(
            base,
            rows=(Row("sgd", 1), Row("fedavg", 1), Row("scaffold", 1)),
            similarities=(0.0,),
            num_rounds=20,
            hidden_sizes=(32,),
            lr_grids={"sgd": (1.0,), "fedavg": (0.1,), "scaffold": (0.1,)},
        )
    return _override(base, overrides)


def _override(protocol, overrides: Mapping[str, Any]):
    """``dataclasses.replace`` with a named error for unknown fields and lists -> tuples."""
    known = {f.name for f in dataclasses.fields(protocol)}
    unknown = [k for k in overrides if k not in known]
    if unknown:
        raise ConfigError(
            f"unknown protocol field(s) {unknown} for {type(protocol).__name__}; known: "
            f"{', '.join(sorted(known))}."
        )
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    if isinstance(fixed.get("rows"), tuple):
        try:
            fixed["rows"] = tuple(r if isinstance(r, Row) else Row(*r) for r in fixed["rows"])
        except TypeError:  # not [method, epochs(, sampled)] triples: validate() says so
            pass
    return dataclasses.replace(protocol, **fixed)


def resolve_dataset(
    name: str, data_dir: str | None = None, download: bool = False, quiet: bool = False
) -> sources.Dataset:
    """Loads the tables' dataset: ``"auto"`` is EMNIST (balanced) when it can be loaded
    (IDX folder, cache or TFDS), else Fashion-MNIST, and says which."""
    if name != "auto":
        return sources.load(name, data_dir, allow_download=download)
    try:
        return sources.load("emnist/balanced", data_dir, allow_download=download)
    except FileNotFoundError:
        if not quiet:
            print(
                "EMNIST is not available offline (pass --download to fetch it through TFDS, "
                "or --data-dir with NIST's IDX files); using Fashion-MNIST.",
                file=sys.stderr,
            )
        return sources.load("fashion_mnist", data_dir, allow_download=download)


def table_target(protocol: TableProtocol, dataset_name: str) -> float | None:
    """The protocol's target, or the default for its table and dataset (None: Table 5)."""
    if protocol.target is not None or protocol.name not in _TARGETS:
        return protocol.target
    targets = _TARGETS[protocol.name]
    return targets["emnist"] if dataset_name.startswith("emnist") else targets["default"]


def _percent(value: float) -> str:
    return f"{value * 100:g}%"


def table_grid(protocol: TableProtocol, dataset: sources.Dataset) -> Grid:
    """A table as a grid: a cell per column (similarity) and row (method, epochs, sampled)
    over the row's η_l grid, on ``dataset`` (resolved from ``"auto"``)."""
    target = table_target(protocol, dataset.name)
    model_options = (
        {"hidden_sizes": protocol.hidden_sizes}
        if "hidden_sizes" in MODELS[protocol.model].options
        else {}
    )
    vary_sampling = len({r.sampled for r in protocol.all_rows}) > 1
    # An in-memory dataset (not registered) is handed to the runner in place of the
    # configs' default one: the records and tables name it.
    name = dataset.name if assembly.kind_of(dataset.name) == "pooled" else RunConfig().dataset
    cells = []
    for similarity in protocol.similarities:
        for row in protocol.all_rows:
            if _one_step(row.method):
                plan = {"batch_plan": "full", "local_steps": 1}
            else:
                plan = {"batch_plan": "fraction", "batch_fraction": protocol.batch_fraction,
                        "local_epochs": row.epochs}  # fmt: skip
            declared = ALGORITHMS[row.method].hparams
            config = RunConfig(
                algorithm=row.method, dataset=name, data_dir=protocol.data_dir,
                download=protocol.download, max_train_examples=protocol.max_train_examples,
                max_test_examples=protocol.max_test_examples, num_clients=protocol.num_clients,
                clients_per_round=max(1, round(row.sampled * protocol.num_clients)),
                partition="similarity", similarity=similarity, model=protocol.model,
                seed=protocol.seed, rounds=protocol.num_rounds, eval_every=protocol.eval_every,
                targets=[target] if target else [],
                hparams={"prox_mu": protocol.prox_mu} if "prox_mu" in declared else {},
                **model_options, **plan,
            )  # fmt: skip
            key = f"{_display(row.method)} E={row.epochs}"
            key += f" S={_percent(row.sampled)}" if vary_sampling else ""
            key += f" s={similarity:g}%"
            labels = {"algorithm": row.method, "epochs": row.epochs, "sampled": row.sampled,
                      "similarity": similarity}  # fmt: skip
            cells.append(Cell(key, config, {"client_lr": protocol.lr_grid(row.method)},
                              seeds=protocol.seeds, labels=labels))  # fmt: skip
    # The chosen series, one panel per similarity: filled as the report chooses them.
    panels = {f"s = {s:g}%": [] for s in protocol.similarities}
    plots = tuple(
        spec._replace(panels=panels, title=f"{protocol.name} on {dataset.name}")
        for spec in results.DEFAULT_PLOTS
    )
    saved = {
        "experiment": protocol.name,
        "protocol": dataclasses.asdict(protocol),
        "dataset": dataset.name,
        "target": target,
    }
    return Grid(protocol.name, cells, saved, [target] if target else (), plots)


def _resolved_before(out: str | os.PathLike) -> str | None:
    """The dataset a protocol folder's run resolved ``"auto"`` to (None: no such run)."""
    try:
        saved = json.loads((Path(out) / results.CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if saved.get("protocol", {}).get("dataset") != "auto":
        return None
    return saved.get("dataset") if isinstance(saved.get("dataset"), str) else None


def reproduce_table(
    protocol: TableProtocol,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    quiet: bool = False,
    dataset: sources.Dataset | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Runs one of Tables 3-5 and writes its folder, including ``<name>.md``.

    For every column (similarity) and row (method, epochs, sampling) the η_l grid runs as
    one vmapped program; the chosen η_l is the one with the fewest rounds to the target
    (Table 5: the best accuracy). Every η_l's records go to ``metrics.jsonl``; the plots
    show the chosen runs, one panel per similarity.

    Returns:
      The summary; ``summary["cells"]`` has one dict per (row, similarity) with
      ``rounds`` / ``best_accuracy`` and ``client_lr``.
    """
    protocol.validate()
    start = time.perf_counter()
    if dataset is None:
        name = protocol.dataset
        if resume and name == "auto":
            # What 'auto' chose for the run being resumed, even if EMNIST appeared since:
            # one table holds one dataset's cells.
            name = _resolved_before(out) or name
        dataset = resolve_dataset(name, protocol.data_dir, protocol.download, quiet)
    grid = table_grid(protocol, dataset)
    target = table_target(protocol, dataset.name)
    panels = grid.plots[0].panels
    table = ""

    def report(done: Mapping[str, CellResult], writer: results.RunWriter) -> None:
        nonlocal table
        cells = _chosen_cells(
            grid, done, writer, panels,
            panel=lambda labels: f"s = {labels['similarity']:g}%",
            lead=lambda cell: {
                "method": cell.labels["algorithm"],
                **{k: cell.labels[k] for k in ("epochs", "sampled", "similarity")},
            },
            tail=lambda records: {"best_accuracy": results.best_value(records)},
            target=target,
        )  # fmt: skip
        for cell in cells:  # several seeds: the chosen η_l's best accuracy, mean ± std
            if "best_per_seed" in cell:
                values = [float(v) for v in cell["best_per_seed"]]
                cell["best_accuracy"] = statistics.fmean(values)
                cell["best_accuracy_std"] = statistics.pstdev(values)
        wall = time.perf_counter() - start
        info = next(iter(done.values())).info
        table = format_table(protocol, cells, info, target, wall)
        writer.add(target=target, cells=cells, table=table, wall_seconds_total=round(wall, 3))
        writer.write_text(f"{protocol.name}.md", table)

    outcome = run_grid(
        grid, out, report=report, overwrite=overwrite, quiet=quiet, resume=resume,
        dataset=dataset, checkpoint=False,  # resumed by cell, as Figure 3
    )  # fmt: skip
    if not quiet:
        print(table)
        print(f"Wrote {out}/: {', '.join(outcome.files)}")
    return outcome.summary


def format_table(
    protocol: TableProtocol,
    cells: Sequence[Mapping[str, Any]],
    info: Mapping[str, Any],
    target: float | None,
    wall_seconds: float,
) -> str:
    """The table in the paper's layout, as markdown, with its dataset, target, chosen η_l
    and wall time."""
    vary_sampling = len({r.sampled for r in protocol.all_rows}) > 1
    header = ("method", "sampled" if vary_sampling else "epochs")

    def row_of(c):
        second = _percent(c["sampled"]) if vary_sampling else c["epochs"]
        return (_display(c["method"]), second)

    table_cells = [
        results.Cell(
            row=row_of(c),
            column=f"{c['similarity']:g}%",
            rounds=c["rounds"],
            horizon=protocol.num_rounds,
            value=c["best_accuracy"],
            client_lr=c["client_lr"],
            seeds=len(c.get("seeds", [protocol.seed])),
            rounds_std=c.get("rounds_std"),
            value_std=c.get("best_accuracy_std"),
            reached=c.get("reached"),
        )
        for c in cells
    ]
    methods = list(dict.fromkeys(r.method for r in protocol.all_rows))
    if target is None:
        what = f"best test accuracy within {protocol.num_rounds} rounds"
        body = results.value_table(table_cells, header, fmt=".3f")
    else:
        what = f"rounds to {target:g} test accuracy"
        baseline = next((_display(m) for m in methods if _one_step(m)), None)
        what += f" (speed-up over {baseline})" if baseline else ""
        body = results.rounds_table(table_cells, header, baseline_row=baseline)
    model = MODELS[protocol.model].display_name
    if "hidden_sizes" in MODELS[protocol.model].options:
        model += f" with hidden layers {'-'.join(str(h) for h in protocol.hidden_sizes)}"
    grids = "; ".join(
        f"{_display(m)}: {', '.join(f'{v:g}' for v in protocol.lr_grid(m))}" for m in methods
    )
    sampled = ", ".join(_percent(v) for v in sorted({r.sampled for r in protocol.all_rows})[::-1])
    epochs = ", ".join(
        str(e) for e in sorted({r.epochs for r in protocol.all_rows if not _one_step(r.method)})
    )
    settings = []
    if any(not _one_step(m) for m in methods):
        settings.append(
            f"local methods: {epochs} epoch(s) of batches of {protocol.batch_fraction:g} of "
            f"the client's data ({round(1 / protocol.batch_fraction)} steps per epoch)"
        )
    settings += [f"{_display(m)}: one step on the client's full data" for m in methods
                 if _one_step(m)]  # fmt: skip
    settings.append(f"{sampled} of clients sampled per round; η_g = 1")
    settings += [f"{_display(m)} μ = {protocol.prox_mu:g}" for m in methods
                 if "prox_mu" in ALGORITHMS[m].hparams]  # fmt: skip
    settings += [f"{_display(m)} option {ALGORITHMS[m].options['scaffold_option'].default}"
                 for m in methods if "scaffold_option" in ALGORITHMS[m].options]  # fmt: skip
    return "\n".join(
        [
            f"### {protocol.title} — {info['dataset']}",
            "",
            f"Dataset: {info['dataset']} ({info['dataset_source']}), "
            f"{info['num_train_examples']} training "
            f"examples over {protocol.num_clients} clients (s% similarity split; columns: "
            f"s); {model}; {what}. " + "; ".join(settings) + ". Horizon "
            f"{protocol.num_rounds} rounds, evaluated every {protocol.eval_every}; "
            + (
                f"seeds {', '.join(str(x) for x in protocol.seeds)} (mean ± std over the "
                "seeds of the η_l chosen on their mean; data and initial params of seed "
                f"{protocol.seed})."
                if protocol.seeds
                else f"seed {protocol.seed}."
            ),
            "",
            body,
            "",
            *(
                []
                if target is None
                else [
                    f"Best test accuracy within {protocol.num_rounds} rounds (the chosen η_l):",
                    "",
                    results.value_table(table_cells, header, fmt=".3f"),
                    "",
                ]
            ),
            f"Chosen η_l (grids — {grids}):",
            "",
            results.value_table(table_cells, header, fmt="g", field="client_lr"),
            "",
            f"Wall time: {wall_seconds:.1f} s ({jax.default_backend()}, "
            f"{len(jax.devices())} device(s)).",
            "",
        ]
    )


# =====================================================================================
# The registry used by `scaffold-jax reproduce`
# =====================================================================================
PROTOCOLS: dict[str, Callable[..., Any]] = {
    "fig3": fig3_protocol,
    "table3": table3_protocol,
    "table4": table4_protocol,
    "table5": table5_protocol,
}


#: Protocol fields a ``--resume`` may change (a cell run with another horizon runs again):
#: left out of the default folder's name, so that the resumed command finds its folder.
_RESUMABLE = ("num_rounds", "eval_every", "data_dir", "download")


def default_folder(name: str, quick: bool, overrides: Mapping[str, Any]) -> Path:
    """``results/<name>`` (``-quick``), followed by a digest of the protocol fields set
    (those a resume may change aside) when there are any: two protocols never share a
    folder, and the same command with ``--resume`` finds its own.

    Examples:
      >>> str(default_folder("table3", True, {"num_rounds": 50}))
      'results/table3-quick'
      >>> str(default_folder("table3", False, {"seeds": (0, 1, 2)}))
      'results/table3-3dc3171d'
    """
    folder = name + ("-quick" if quick else "")
    fixed = {k: v for k, v in overrides.items() if k not in _RESUMABLE}
    if fixed:
        folder += "-" + short_digest(fixed)
    return Path("results") / folder


def reproduce(
    name: str,
    out: str | os.PathLike | None = None,
    *,
    quick: bool = False,
    overwrite: bool = False,
    quiet: bool = False,
    resume: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Runs a named protocol (``fig3``, ``table3``, ``table4``, ``table5``).

    Args:
      name: the protocol.
      out: the output folder (default: :func:`default_folder`).
      quick: the test-sized variant.
      overwrite: replace a folder that holds a run.
      quiet: print nothing but errors.
      resume: continue the protocol the folder holds: its finished cells (one η_l grid
        each, recorded in ``parts.jsonl``) are kept, the others run again.
      **overrides: protocol fields to change (e.g. ``dataset="fashion_mnist"``,
        ``num_rounds=300``, ``target=0.6``).

    Returns:
      The summary written to ``summary.json``.
    """
    if name not in PROTOCOLS:
        raise ConfigError(f"experiment = {name!r} is unknown: it must be one of {list(PROTOCOLS)}.")
    protocol = PROTOCOLS[name](quick=quick, **overrides)
    out = Path(out) if out is not None else default_folder(name, quick, overrides)
    if name == "fig3":
        return reproduce_fig3(protocol, out, overwrite=overwrite, quiet=quiet, resume=resume)
    return reproduce_table(protocol, out, overwrite=overwrite, quiet=quiet, resume=resume)
