"""How the paper's protocols run: each as a grid of cells (:func:`fig3_grid`,
:func:`table_grid`), its run into one folder (:func:`reproduce_fig3`,
:func:`reproduce_table`) and its table (:func:`fig3_table`, :func:`format_table`)."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from scaffold_jax import results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.data import assembly, sources
from scaffold_jax.experiments import Cell, CellResult, Grid, RunConfig, run_grid
from scaffold_jax.models import MODELS
from scaffold_jax.paper.protocols import Fig3Protocol, TableProtocol, _one_step, table_target


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
