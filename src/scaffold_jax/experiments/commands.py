"""The commands as grids: ``run`` (one cell of one config), ``sweep`` (a cell per algorithm
and data setting, its hyper-parameter axes × seeds vmapped) and ``diagnose`` (the
heterogeneity constants of a config's data and model). Each builds its :class:`Grid` and
its report; :func:`~scaffold_jax.experiments.runner.run_grid` does the rest. The command
line (:mod:`scaffold_jax.cli`) only parses into these calls.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scaffold_jax import participation, results
from scaffold_jax.algorithms import ALGORITHMS
from scaffold_jax.compression import COMPRESSORS
from scaffold_jax.data import assembly
from scaffold_jax.experiments.build import build, built_summary
from scaffold_jax.experiments.config import (
    DEFAULT_MECHANISM,
    RunConfig,
    declared_hparams,
    declared_options,
)
from scaffold_jax.experiments.identity import RESUMABLE_CHANGES, canonical, short_digest
from scaffold_jax.experiments.runner import Cell, CellResult, Grid, run_grid
from scaffold_jax.privacy import MECHANISMS
from scaffold_jax.progress import Progress
from scaffold_jax.registry import ConfigError
from scaffold_jax.types import STEP_SIZES, format_hparams
from scaffold_jax.wrappers import chosen_hparams


# =====================================================================================
# Default output folders
# =====================================================================================
def default_folder(command: str, config: RunConfig, saved: Mapping[str, Any]) -> Path:
    """The folder of a command given no ``out``: ``results/<command>-<dataset>-<digest>``
    (``command``: the algorithm for ``run``, ``sweep``, ``diagnose``), the digest that of
    what a resume compares (:func:`config_digest` of ``saved``, what ``config.json``
    holds). The same command finds its folder again (``--resume``, with more ``--rounds``
    too), and two commands that compute different things never share one."""
    return Path("results") / f"{command}-{dataset_label(config)}-{config_digest(saved)}"


def dataset_label(config: RunConfig) -> str:
    """The dataset as a folder name: its registered name (aliases resolved), ``/`` as
    ``-`` (``emnist-balanced``): :func:`~scaffold_jax.data.assembly.dataset_slug`."""
    return assembly.dataset_slug(config.dataset)


def config_digest(saved: Mapping[str, Any]) -> str:
    """8 hex digits of SHA-256 over what a resume of ``saved`` (a command's ``config.json``)
    compares: its canonical form (:func:`~scaffold_jax.experiments.identity.canonical`:
    an explicit default equals an omitted one) without the fields a resume may change
    (``rounds``, ``eval_every``, ``targets``, the data's folder...), and without the values
    that equal :class:`RunConfig`'s defaults, so that a field added in a later version at
    its default keeps every earlier command's folder."""
    values = canonical(saved)
    defaults = canonical(RunConfig().to_dict())
    distinct = {
        k: v
        for k, v in values.items()
        if k not in RESUMABLE_CHANGES and (k not in defaults or defaults[k] != v)
    }
    return short_digest(distinct)


# =====================================================================================
# scaffold-jax run
# =====================================================================================
def run(
    config: RunConfig,
    out: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    quiet: bool = False,
    dataset: Any = None,
    resume: bool = False,
    checkpoint: bool = True,
    checkpoint_every: int | None = None,
    checkpoint_minutes: float = 5.0,
    tensorboard: bool = False,
) -> dict[str, Any]:
    """Runs one experiment and writes its folder (see :mod:`scaffold_jax.results`): a
    grid of one cell of one config (:func:`~scaffold_jax.experiments.runner.run_grid`).

    The run checkpoints into ``<out>/checkpoints`` (every ``checkpoint_every`` rounds,
    default at evaluations as often as keeps checkpoint writing within 10% of the run's
    time, and at the end of any block once ``checkpoint_minutes``
    have passed since the last save; the newest two are kept while it runs, and
    ``config.keep_checkpoints``, default its final state only, once it is finished), so a
    killed run continues
    with ``resume=True`` (``--resume``) bit for bit: the records are cut back to the
    restored checkpoint and rewritten from there (each evaluation round exactly once),
    and the summary and plots are an uninterrupted run's. A resume with other data,
    partition, model, algorithm options or hyper-parameters is refused naming each
    difference; more rounds or another evaluation cadence are allowed. A finished run
    resumed with the same horizon is kept as it is.

    Args:
      config: the run's configuration (validated here).
      out: the output folder (default ``config.out``, else
        ``results/<algorithm>-<dataset>-<digest>``: see :func:`default_folder`).
      overwrite: replace a folder that holds a run.
      quiet: no progress bar and no printed summary.
      dataset: an already loaded dataset (e.g. in a notebook).
      resume: continue the run the folder holds (from its newest checkpoint; from round 0
        when it holds none; a folder without a run simply starts it).
      checkpoint: write checkpoints (orbax); False: none.
      checkpoint_every: checkpoint period in rounds (default: ``config.eval_every``).
      checkpoint_minutes: save at least this often (at block ends).
      tensorboard: also write every record's metrics as TensorBoard scalars (step: the
        round) into ``<out>/tensorboard`` (:class:`scaffold_jax.results.TensorBoardSink`).

    Returns:
      The summary (what ``summary.json`` holds).

    Raises:
      ConfigError: an invalid config, or a resume with another configuration.
      FileExistsError: the folder holds a run (or is in use by a live one).
      FileNotFoundError: the dataset is missing.
      scaffold_jax.loop.DivergenceError: the model became NaN/Inf (the folder keeps
        the records made before and says ``"status": "diverged"``).
      scaffold_jax.results.RunFolderError: the folder cannot be written (full disk...).
    """
    config.validate()
    if out is None:
        out = config.out or default_folder(config.algorithm, config, config.to_dict())
    folder = Path(out)
    saved = {**config.to_dict(), "out": str(folder)}
    # The horizon is part of the cell: a resume with more rounds runs it again (from its
    # checkpoint), one with the same horizon keeps it.
    cell = Cell(f"{config.algorithm}", config)

    def report(cells: Mapping[str, CellResult], writer: results.RunWriter) -> None:
        (result,) = cells.values()
        info = result.info
        title = (
            f"{config.algorithm} on {info['dataset']}: N = {info['num_clients']}, "
            f"S = {info['clients_per_round']}, η_l = {config.client_lr:g}"
        )
        accuracy, loss, uplink = results.DEFAULT_PLOTS
        writer.plots = (
            accuracy._replace(title=title, target=tuple(config.targets)),
            loss._replace(title=title),
            uplink._replace(title=title, target=tuple(config.targets)),
        )
        if config.profiles != "none":  # the virtual clock's time (participation.clock)
            timed = accuracy._replace(filename="accuracy_vs_time.png", x="virtual_time")
            writer.plots += (timed._replace(title=title, target=tuple(config.targets)),)

    grid = Grid("run", [cell], saved, config.targets)
    outcome = run_grid(
        grid, folder, report=report, overwrite=overwrite, resume=resume, quiet=quiet,
        checkpoint=checkpoint, checkpoint_every=checkpoint_every,
        checkpoint_minutes=checkpoint_minutes, tensorboard=tensorboard, dataset=dataset,
    )  # fmt: skip
    if not quiet:
        print(format_run_summary(outcome.summary, folder))
    return outcome.summary


#: The round metrics of partial participation, as the run summary words them.
PARTICIPATION_WORDS = {
    "available": "available",
    "participants": "reached the server",
    "dropped": "dropped",
    "late": "too late (the clock's deadline or over-selection)",
    "steps_taken": "local steps taken",
}


def _participation_line(final: Mapping[str, Any]) -> str | None:
    """Who took part in the rounds of the last record (their means), when it says."""
    said = [f"{final[k]:.3g} {w}" for k, w in PARTICIPATION_WORDS.items() if k in final]
    return (
        f"participation (mean a round, since the previous evaluation): {', '.join(said)}"
        if said
        else None
    )


def _bytes_line(info: Mapping[str, Any]) -> str | None:
    """What the rounds cost on the network: uplink and downlink MB in all, and the uplink
    MB to each target reached (scaffold_jax.engine.communication)."""
    final = info.get("final", {})
    if "bytes_up_total" not in final:
        return None
    mb = lambda b: f"{b / 1e6:.4g}"  # noqa: E731
    to_target = ", ".join(
        f"{t}: {mb(b)}" for t, b in info.get("bytes_up_to_target", {}).items() if b is not None
    )
    return (
        f"communication: uplink {mb(final['bytes_up_total'])} MB, downlink "
        f"{mb(final['bytes_down_total'])} MB"
        + (f"; uplink MB to target accuracy: {to_target}" if to_target else "")
    )


def _time_line(info: Mapping[str, Any]) -> str | None:
    """What the rounds took on the clients' devices (scaffold_jax.participation.clock):
    the virtual time in all and to each target reached."""
    final = info.get("final", {})
    if "virtual_time" not in final:
        return None
    to_target = ", ".join(
        f"{t}: {results.format_seconds(s)}"
        for t, s in info.get("time_to_target", {}).items()
        if s is not None
    )
    return f"virtual time: {results.format_seconds(final['virtual_time'])}" + (
        f"; to target accuracy: {to_target}" if to_target else ""
    )


def format_run_summary(summary: Mapping[str, Any], folder: Path | str) -> str:
    """A few lines for the terminal: dataset, rounds to targets, timing, files."""
    (name, info), *_ = summary["runs"].items()
    reached = ", ".join(
        f"{t}: {results.format_rounds(r, info.get('last_round', 0))}"
        for t, r in info.get("rounds_to_target", {}).items()
    )
    best = info.get("best_test_accuracy")
    where = f"{name} on {summary.get('dataset')} ({summary.get('dataset_source')})"
    # A problem without accuracy (the quadratics) reports its best test loss instead.
    loss = info.get("best_test_loss")
    lines = [
        f"{where}: best test accuracy {best:.4f}"
        if best is not None
        else f"{where}: best test loss {loss:.6g}"
        if loss is not None
        else where,
        f"hyper-parameters: {format_hparams(info.get('hparams', {}))}",
        f"privacy: epsilon {final['dp_epsilon']:.4g} at delta {final['dp_delta']:.3g} after "
        f"{info.get('last_round', 0)} rounds"
        if "dp_epsilon" in (final := info.get("final", {})) and "dp_delta" in final
        else None,
        _participation_line(final),
        f"rounds to target accuracy: {reached}" if best is not None else None,
        _bytes_line(info),
        _time_line(info),
        f"compile {info.get('compile_seconds', 0):.1f} s, rounds "
        f"{info.get('round_seconds', 0):.1f} s ({info.get('rounds_per_second', 0):.1f} "
        f"rounds/s), evaluation {info.get('eval_seconds', 0):.1f} s"
        + (
            f", checkpoints {info['checkpoint_seconds']:.1f} s"
            if "checkpoint_seconds" in info
            else ""
        ),
        f"wrote {folder}/: {', '.join(summary.get('files', []))}",
    ]
    return "\n".join(line for line in lines if line is not None)


# =====================================================================================
# scaffold-jax sweep
# =====================================================================================
#: RunConfig fields that are no axis of a sweep, and what to use instead.
NOT_AXES = {
    "seed": "the run seeds are --seeds; --grid partition_seed=... re-partitions the data",
    "rounds": "the horizon is one for the whole sweep (--rounds)",
    "eval_every": "the evaluation cadence is one for the whole sweep (--eval-every)",
}
#: Whose options shape the data and the model (what ``diagnose`` measures).
DATA_OWNERS = ("model", "partition", "dataset")
#: Whose numeric options are a sweep's outer (data / shape / participation) axes.
SETTING_OWNERS = (*DATA_OWNERS, "batch_plan", *participation.KINDS, "execution")
#: The tidy table of a sweep: one row per config × seed (results.sweep_table).
SWEEP_CSV = "sweep.csv"


def setting_fields() -> dict[str, str]:
    """``{name: kind}`` of the numeric settings a sweep takes as an outer axis: RunConfig's
    data and shape fields (num_clients, local_epochs...) and the numeric options models,
    partitioners and datasets declare (similarity, a plugin model's dropout rate...)."""
    import dataclasses

    fields = {
        f.name: f.metadata["kind"]
        for f in dataclasses.fields(RunConfig)
        if f.metadata["kind"] in ("int", "float") and f.name not in (*STEP_SIZES, *NOT_AXES)
    }
    options = declared_options(SETTING_OWNERS)
    return {**fields, **{k: o.kind for k, o in options.items() if o.is_number}}


def split_axes(
    axes: Mapping[str, Sequence[float]],
    algorithms: Sequence[str],
    privacy: str | None = None,
    compression: str = "none",
    wrapped: Sequence[str] = (),
) -> tuple[dict[str, list[float]], dict[str, list[float | int]]]:
    """``(hyper-parameter axes, setting axes)``: the names the sweep's algorithms declare
    (vmapped in one program per grid) and the data/shape settings (an outer product of
    separate programs). With a ``privacy`` mechanism its hyper-parameters are vmapped
    axes too, and so is ``dp_epsilon``: each target is calibrated to its noise
    multiplier, one config each. ``wrapped``: the hyper-parameters the config's other
    wrappers add (an attack's ``byzantine_fraction``, an aggregator's ``trim_fraction``),
    vmapped axes as well.

    Raises:
      ConfigError: a name that is neither (naming what it is and what to do), or an
        integer setting given a non-integer.
    """
    declared = list(dict.fromkeys(h for n in algorithms for h in ALGORITHMS[n].hparams))
    if privacy is not None:
        declared += [*MECHANISMS[privacy].hparams, EPSILON_AXIS]
    if compression in COMPRESSORS:  # qsgd's bits, topk's fraction: one program's configs
        declared += list(COMPRESSORS[compression].hparams)
    declared += [name for name in wrapped if name not in declared]
    settings = setting_fields()
    inner, outer = {}, {}
    for name, values in axes.items():
        if name in declared:
            inner[name] = list(values)
            continue
        if name in settings:
            if settings[name] == "int":
                bad = [v for v in values if not float(v).is_integer()]
                if bad:
                    raise ConfigError(
                        f"--grid {name}: {name} takes integers; {bad[0]:g} is not one."
                    )
                values = [int(v) for v in values]
            outer[name] = list(values)
            continue
        which = ", ".join(algorithms)
        if name in NOT_AXES:
            raise ConfigError(f"--grid {name}: {name} is not an axis of a sweep: {NOT_AXES[name]}.")
        owners = [n for n, spec in ALGORITHMS.items() if name in spec.hparams]
        if owners:
            raise ConfigError(
                f"--grid {name}: no algorithm of this sweep ({which}) declares the "
                f"hyper-parameter {name} ({', '.join(owners)} does); add one with --algorithms "
                "or remove the axis."
            )
        compressors = [n for n, spec in COMPRESSORS.items() if name in spec.hparams]
        if compressors:  # as run says of compress_bits without qsgd
            raise ConfigError(
                f"--grid {name}: {name} is a hyper-parameter of compression "
                f"{' and '.join(compressors)}, not of compression = {compression!r}; choose "
                f"that compression (--compression {compressors[0]}) or remove the axis."
            )
        close = difflib.get_close_matches(name, [*declared, *settings], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"--grid {name}: unknown name {name!r}{hint}. An axis is a hyper-parameter an "
            f"algorithm of this sweep ({which}) declares: {', '.join(declared)}; or a data / "
            f"shape setting: {', '.join(settings)}."
        )
    return inner, outer


#: The axis of target epsilons, swept as the noise multipliers they calibrate to.
EPSILON_AXIS = "dp_epsilon"


def tradeoff_names() -> set[str]:
    """The settings declared trade-offs (``tradeoff=True`` on their
    :class:`~scaffold_jax.types.HParam` or :class:`~scaffold_jax.registry.Option`: privacy's
    ε and noise, compression's bits and fraction, a deadline...): costs traded against
    accuracy, not knobs tuned for it. A sweep reports one row per value of such an axis
    and chooses only over the others. Read at each call: plugins may declare some."""
    declared = {**declared_hparams(), **declared_options()}
    return {name for name, entry in declared.items() if getattr(entry, "tradeoff", False)}


def _metric_words(metric: str) -> str:
    return metric.replace("_", " ")


def with_epsilons(
    cells: Mapping[str, CellResult], epsilons: Mapping[str, Mapping[float, float]]
) -> dict[str, CellResult]:
    """``cells`` with each config of a ``--grid dp_epsilon`` sweep holding its target
    ``dp_epsilon`` first, the value the user gave (``epsilons``: per cell, noise multiplier
    -> target; the configs hold the noise it was calibrated to)."""

    def target(of: Mapping[float, float], noise: float | None) -> float | None:
        # The noise as the config holds it (a part read back from JSON: the same float).
        return next((t for z, t in of.items() if noise is not None and math.isclose(z, noise)),
                    None)  # fmt: skip

    out = dict(cells)
    for key, of in epsilons.items():
        if key in out:
            configs = [
                {EPSILON_AXIS: target(of, c.get("dp_noise_multiplier")), **c}
                for c in out[key].configs
            ]
            out[key] = dataclasses.replace(out[key], configs=configs)
    return out


def _setting_label(setting: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in setting.items())


def sweep_grid(
    given: RunConfig,
    algorithms: Sequence[str],
    axes: Mapping[str, Sequence[float]],
    seeds: Sequence[int],
    target: float,
) -> tuple[Grid, dict[str, dict[str, Any]], dict[str, dict[float, float]]]:
    """The grid of a sweep: a cell per algorithm × data setting (outer product of the
    setting axes, first slowest), each with the hyper-parameter axes its algorithm
    declares × ``seeds``; each cell's setting by key; and, for a ``dp_epsilon`` axis, per
    cell the target ε of each noise multiplier it was calibrated to (else empty). Every
    config is checked here, before anything runs.

    Raises:
      ConfigError: an unknown algorithm or axis, a value invalid for its config, or a
        hyper-parameter or option that no algorithm of the sweep declares.
    """
    if not (isinstance(target, (int, float)) and 0.0 < target <= 1.0):
        raise ConfigError(
            f"--target = {target:g} is invalid: it must be a test accuracy in (0, 1], "
            "e.g. --target 0.7."
        )
    names = list(algorithms) or [given.algorithm]
    # Up front: a repeated algorithm would fail only after the whole grid ran (two cells
    # share its key), and a repeated seed is the same run counted twice (std 0).
    for flag, values, why in (
        ("--algorithms", names, "give each algorithm once"),
        ("--seeds", list(seeds), "give each seed once (a repeated seed is the same run "
         "counted twice, which shrinks the spread over seeds)"),
    ):  # fmt: skip
        repeated = dict.fromkeys(v for i, v in enumerate(values) if v in values[:i])
        if repeated:
            raise ConfigError(f"{flag} repeats {' '.join(map(str, repeated))}: {why}.")
    for name in names:
        if name not in ALGORITHMS:
            raise ConfigError(ALGORITHMS.unknown_message(name))
    algorithm_options = declared_options(("algorithm",))
    if given.privacy is None and any(
        name == EPSILON_AXIS or name in spec.hparams
        for name in axes
        for _, spec in MECHANISMS.items()
    ):
        # An axis of privacy settings chooses a mechanism, as a --dp-* flag does.
        given = given.replace(privacy=DEFAULT_MECHANISM)
    private = chosen_hparams(given, strict=False)  # its wrappers': privacy's, compression's
    for table in ("hparams", "options"):
        for key in getattr(given, table):
            if table == "options" and key not in algorithm_options:
                continue  # a model's, partitioner's or dataset's: checked with each config
            if table == "hparams" and key in private:
                continue
            if not any(key in getattr(ALGORITHMS[n], table) for n in names):
                raise ConfigError(
                    f"{key} does not apply to any algorithm of this sweep ({', '.join(names)})."
                )
    inner, outer = split_axes(axes, names, given.privacy, given.compression, list(private))
    targets = inner.pop(EPSILON_AXIS, None)
    if targets is not None and "dp_noise_multiplier" in inner:
        raise ConfigError(
            "--grid dp_epsilon and --grid dp_noise_multiplier are both given: sweep one (a "
            "target epsilon is calibrated to a noise multiplier)."
        )
    settings = [dict(zip(outer, c, strict=True)) for c in itertools.product(*outer.values())]
    cells, setting_of, epsilons = [], {}, {}
    for setting in settings:
        for name in names:
            spec = ALGORITHMS[name]
            config = given.replace(
                algorithm=name,
                hparams={
                    k: v for k, v in given.hparams.items() if k in spec.hparams or k in private
                },
                options={
                    k: v
                    for k, v in given.options.items()
                    if k in spec.options or k not in algorithm_options
                },
                **setting,
            ).validate()
            swept = dict(inner)
            if targets is not None:
                # Each target epsilon as the noise it calibrates to for this cell's N, S,
                # sampler and rounds; the cell's config holds the first.
                noises = [
                    float(config.replace(dp_epsilon=t).resolved_hparams()["dp_noise_multiplier"])
                    for t in targets
                ]
                swept["dp_noise_multiplier"] = noises
                config = config.replace(dp_epsilon=None, dp_noise_multiplier=noises[0])
            declared = config.resolved_hparams()
            swept = {k: v for k, v in swept.items() if k in declared}
            for axis, values in swept.items():  # each value as its config would hold it
                for value in values:
                    if axis in STEP_SIZES:
                        config.replace(**{axis: value}).validate()
                    else:
                        config.replace(hparams={**config.hparams, axis: value}).validate()
            # Every declared hyper-parameter is an axis (one value when not swept): the
            # series and records name them all.
            cell_axes = {k: swept.get(k, [float(v)]) for k, v in declared.items()}
            key = f"{name} {_setting_label(setting)}" if setting else name
            cells.append(Cell(key, config, cell_axes, tuple(seeds),
                              {"algorithm": name, **setting}))  # fmt: skip
            setting_of[key] = setting
            if targets is not None:
                epsilons[key] = dict(zip(swept["dp_noise_multiplier"], targets, strict=True))
    first = cells[0].config
    saved = {
        **first.to_dict(),
        **{k: getattr(given, k) for k in outer},  # as given: the grid holds their values
        "algorithms": names,
        "grid": {**inner, **outer},
        "seeds": list(seeds),
    }
    return Grid("sweep", cells, saved, (target,)), setting_of, epsilons


def sweep(
    config: RunConfig,
    algorithms: Sequence[str] = (),
    axes: Mapping[str, Sequence[float]] | None = None,
    seeds: Sequence[int] = (0,),
    target: float = 0.7,
    out: str | os.PathLike | None = None,
    *,
    quiet: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Runs a sweep: every algorithm × data setting a program over its hyper-parameter
    axes × seeds; writes ``sweep.json``, ``sweep.csv``, ``summary.md`` (the chosen values
    per algorithm, warnings for a choice at the edge of its grid) and the plots.

    A trade-off axis (:func:`tradeoff_names`: ``dp_epsilon``, ``compress_fraction``,
    ``round_deadline``, ...) is a cost, not a knob: the summary has one row per value of
    it (its column as given, with the ε spent, the uplink bytes and the virtual time the
    records carry), the choice is made per value, over the other axes, and
    ``tradeoffs.png`` plots the curve. A problem without accuracy (the quadratics) is
    ranked by its test loss, and no target applies to it (the summary says so).

    Args:
      config: the base config (data, model, plan, rounds...).
      algorithms: the algorithms (default: the config's).
      axes: ``{name: values}``: hyper-parameters the algorithms declare (vmapped) and
        numeric data / shape settings (separate programs).
      seeds: the run seeds of every config.
      target: the test accuracy the summary counts rounds to (not used for a problem
        without accuracy).
      out: the folder (default ``config.out``, else ``results/sweep-<dataset>-<digest>``:
        see :func:`default_folder`).
      quiet: print nothing but warnings.
      **options: ``overwrite``, ``resume``, ``checkpoint``, ``checkpoint_every``,
        ``checkpoint_minutes``, ``tensorboard`` (see :func:`run_grid`).

    Returns:
      The summary.
    """
    grid, setting_of, epsilons = sweep_grid(config, algorithms, axes or {}, seeds, target)
    folder = Path(out or config.out or default_folder("sweep", config, grid.saved))
    edges: list[str] = []
    table = ""
    hidden = tradeoff_names()
    # The trade-off axes as the user gave them (dp_epsilon, not the noise it calibrates to).
    swept = [name for name in (axes or {}) if name in hidden]

    def report(cells: Mapping[str, CellResult], writer: results.RunWriter) -> None:
        nonlocal table
        cells = with_epsilons(cells, epsilons)
        metric, higher = results.summary_metric(cells)
        goal = target if metric == "test_accuracy" else None
        split = results.split_tradeoffs(cells, swept, setting_of)
        summary = results.summarize(split, goal, metric, higher)
        for edge in results.grid_edges(split, summary, hidden):
            edges.append(results.format_grid_edge(edge))
        rows = results.frontier_rows(summary, split, swept, hidden, setting_of)
        table = results.format_frontier(rows, swept)
        dataset = next(iter(cells.values())).info["dataset"]
        if goal is None:
            table = (
                f"{dataset} has no test accuracy: each series' choice is by its lowest "
                f"{_metric_words(metric)}, and no target applies (--target {target:g} is an "
                "accuracy).\n\n" + table
            )
        record = {
            "config": dict(grid.saved),
            "target": goal,
            "metric": metric,
            "tradeoffs": swept,
            "dataset": dataset,
            "settings": setting_of,
            "results": {
                key: {
                    "configs": r.configs,
                    "records": r.records,
                    "diverged_round": r.diverged_round,
                    "compile_seconds": r.compile_seconds,
                    "run_seconds": r.run_seconds,
                }
                for key, r in cells.items()
            },
            "summary": summary,
            "edge_of_grid": edges,
        }
        # Strict JSON (NaN/Inf, e.g. a diverged config's loss, as null): any parser reads it.
        writer.write_text("sweep.json", json.dumps(strict_json(record), indent=1, allow_nan=False))
        tidy = results.sweep_table(cells, goal, setting_of, metric, higher, swept)
        writer.write_text(SWEEP_CSV, results.csv_text(strict_json(tidy)))
        warnings = "".join(f"\n- {line}" for line in edges)
        head = f"Sweep on {dataset}" + ("" if goal is None else f", target {goal:g}")
        writer.write_text(
            "summary.md",
            f"{head}\n\n{table}\n"
            + (f"\nChosen values at the edge of their grid:\n{warnings}\n" if edges else ""),
        )
        # Rounds to a target only where one applies; the trade-off's curve where one is swept.
        named = {"higher_is_better": higher}
        if goal is not None:
            figure = results.plot_rounds_to_target(split, goal, metric, **named)
            writer.write_figure("rounds_to_target.png", figure)
        writer.write_figure(
            "best_curves.png", results.plot_best_curves(split, goal, metric, **named)
        )
        if swept:
            writer.write_figure("tradeoffs.png", results.plot_tradeoffs(rows, swept))
        writer.add(
            best={n: e["best"] for n, e in summary.items()},
            edge_of_grid=edges,
            **({"tradeoffs": swept} if swept else {}),
        )

    outcome = run_grid(grid, folder, report=report, quiet=quiet, **options)
    for line in edges:  # a warning, not a table: printed even with --quiet
        print(f"warning: {line}", file=sys.stderr)
    if not quiet:
        print(table)
        print(f"wrote {folder}/: {', '.join(outcome.files)}")
    return outcome.summary


def strict_json(value: Any) -> Any:
    """``value`` with every NaN/Inf float (numpy's included, in arrays too) as None, and
    numpy values as Python ones, so that ``json.dumps(..., allow_nan=False)`` writes
    strict JSON (null)."""
    import numpy as np

    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


# =====================================================================================
# scaffold-jax diagnose
# =====================================================================================
#: The most full-gradient steps and power iterations `diagnose` takes: each is a pass over
#: all the data (a larger count runs for hours and keeps every point in memory).
MAX_GD_STEPS = 10_000
MAX_POWER_ITERS = 10_000


def diagnose(
    config: RunConfig,
    out: str | os.PathLike | None = None,
    *,
    gd_steps: int = 0,
    num_iters: int = 30,
    overwrite: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """Measures the paper's heterogeneity constants of a config's data and model (G, B,
    δ, β, the suggested K; :func:`scaffold_jax.diagnostics.diagnose`) and writes
    ``diagnose.json`` and ``gradient_fit.png``.

    Args:
      config: the data, partition and model (and ``client_lr``, the step size of the
        gradient-descent path).
      out: the folder (default ``results/diagnose-<dataset>-<digest>``: see
        :func:`default_folder`).
      gd_steps: points along a full-gradient descent path, to fit (G, B).
      num_iters: power iterations.
      overwrite: replace a folder that holds a run.
      quiet: print nothing.

    Returns:
      The summary.
    """
    import jax

    from scaffold_jax import diagnostics

    if gd_steps < 0:
        raise ConfigError(f"--gd-steps = {gd_steps} is invalid: it must be >= 0.")
    if gd_steps > MAX_GD_STEPS:  # 2**31 ran for hours (found by tests/test_fuzz.py)
        raise ConfigError(
            f"--gd-steps = {gd_steps} is too many: use at most {MAX_GD_STEPS} (each step is a "
            "pass over all the data, and each point is kept for the fit; a few dozen suffice)."
        )
    if not 1 <= num_iters <= MAX_POWER_ITERS:
        raise ConfigError(
            f"--num-iters = {num_iters} is invalid: use 1 to {MAX_POWER_ITERS} (each power "
            "iteration is a Hessian-vector product over all the data; the default is 30)."
        )
    config.validate()
    saved = {
        **{name: getattr(config, name) for name in DIAGNOSE_FIELDS},
        **config.resolved("model"),
        **config.resolved("dataset"),
        **config.resolved("partition"),
        "gd_steps": gd_steps,
        "num_iters": num_iters,
        "plugins": list(config.plugins),
    }
    folder = Path(out or default_folder("diagnose", config, saved))
    results.check_folder(folder, overwrite, dry_run=True)  # before minutes of work
    progress = Progress(gd_steps, "gradient descent", unit="step", enabled=not quiet)
    with progress.phase(f"loading {config.dataset}"):
        built = build(config)
    progress.write(built_summary(built))
    problem, data = built.problem, built.data
    trajectory, params = [], problem.params
    for step in range(gd_steps):  # points along a full-gradient path, to fit (G, B)
        grad = diagnostics.full_gradient(problem, data, params)
        params = jax.tree.map(lambda p, g: p - config.client_lr * g, params, grad)
        trajectory.append(params)
        progress.update(step + 1)
    progress.close()
    report = diagnostics.diagnose(
        problem, data, problem.params, trajectory=trajectory, num_iters=num_iters,
        phase=progress.phase,
    )  # fmt: skip
    with results.RunWriter(folder, saved, overwrite=overwrite, plots=()) as writer:
        reported = {"experiment": "diagnose", **built.info, "report": report._asdict()}
        writer.add(**reported)
        writer.write_text(  # diagnose's result: its failure fails the command
            "diagnose.json", json.dumps(strict_json(reported), indent=1) + "\n", required=True
        )
        try:
            fig = results.plot_gradient_fit(report.points, report.G, report.B)
        except ImportError:  # matplotlib is the optional "plots" extra
            progress.write("matplotlib is not installed: no plot written.")
        else:
            writer.write_figure("gradient_fit.png", fig)
        summary = writer.finish(plots=())
    if not quiet:
        print(f"{built.info['dataset']}, {data.num_clients} clients, {built.info['partition']}")
        print(diagnostics.format_report(report))
        print(f"wrote {folder}/: {', '.join(writer.files)}")
    return summary


#: The config fields that mean something to ``diagnose``: those that build the data and
#: the model (RunConfig's fields marked ``builds``), and the step size of the --gd-steps
#: path. The algorithm, sampling, local plan and horizon do not enter G, B, δ or β.
DIAGNOSE_FIELDS = (*RunConfig.data_fields(), "client_lr")
