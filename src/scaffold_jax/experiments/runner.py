"""The one host runner: a grid of cells into a run folder.

Every command that runs rounds is a :class:`Grid` handed to :func:`run_grid`: ``run`` is a
grid of one cell with one config, ``sweep`` a cell per algorithm and data setting with its
hyper-parameter axes × seeds, ``reproduce`` a protocol's cells (:mod:`scaffold_jax.paper`).
:func:`run_grid` does, once for all of them, what a run folder needs: the folder and
resume checks (:mod:`~scaffold_jax.experiments.identity`), the writer, the progress bar,
TensorBoard, the data read once per source, one build per cell, its execution, and the
finished cells kept as parts so that ``--resume`` skips them (a part is kept only while
its identity, the data's fingerprint included, is the current cell's).

A cell is ONE program: a single config runs in the host loop (:func:`scaffold_jax.loop.run`,
which stops on divergence: a single run that diverged is a mistake to be seen), anything
more as one vmapped sweep (:func:`scaffold_jax.loop.sweep`; a diverged config freezes
while the others go on). What a command writes besides the records (a sweep's tables, a
protocol's table) is its ``report``, called with every cell's :class:`CellResult`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scaffold_jax import results
from scaffold_jax import sweep as sweeps
from scaffold_jax.data.federated import data_fingerprint
from scaffold_jax.experiments.build import Built, build, built_summary, load_dataset
from scaffold_jax.experiments.config import RunConfig
from scaffold_jax.experiments.cost import CostModel, cell_work
from scaffold_jax.experiments.identity import CHECKPOINTS, check_resumable, config_identity
from scaffold_jax.loop import DivergenceError, differences
from scaffold_jax.loop import run as run_loop
from scaffold_jax.loop import sweep as sweep_loop
from scaffold_jax.progress import Progress, format_seconds
from scaffold_jax.registry import ConfigError
from scaffold_jax.versions import check_versions


@dataclasses.dataclass(frozen=True)
class Cell:
    """One program of a grid.

    Attributes:
      key: its name: the series of its records (followed by each config's values when it
        has several), its part on resume and its checkpoint folder.
      config: what builds it (data, model, algorithm, plan, S) and its hyper-parameters.
      axes: hyper-parameter values to sweep (``{"client_lr": [0.1, 0.3]}``; others: the
        config's); each axis named in the series of its configs.
      seeds: the run seeds (default: the config's ``seed``); named in the series when given.
      labels: settings added to every record of the cell (``{"algorithm": "sgd", "G": 10}``).
    """

    key: str
    config: RunConfig
    axes: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
    seeds: Sequence[int] = ()
    labels: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def single(self) -> bool:
        """One config: no axis with more than one value, at most one seed."""
        return len(self.seeds) <= 1 and all(len(v) == 1 for v in self.axes.values())


@dataclasses.dataclass
class CellResult:
    """A finished cell, as kept in the run folder's parts (JSON-able).

    The attributes a :class:`~scaffold_jax.sweep.SweepResult` has for the summaries
    (``algorithm``, ``configs``, ``records``, ``diverged_round``, ``targets``), so
    :func:`scaffold_jax.results.summarize`, :func:`~scaffold_jax.results.sweep_table` and
    the plots take either.

    Attributes:
      key: the cell's key.
      algorithm: its algorithm.
      configs: per config, its hyper-parameters and seed.
      series: per config, the series of its records.
      settings: per config, what places its records (the cell's labels, the values of its
        axes), written in each record apart from the measurements.
      records: per config, its evaluation records (as written, with the cell's labels).
      diverged_round: per config, the round that produced a NaN/Inf, −1 if none.
      info: the built run's facts (dataset, N, S, partition, plan).
      identity: what fixes the cell's results (see
        :func:`~scaffold_jax.experiments.identity.config_identity`), data included.
      compile_seconds, run_seconds, eval_seconds: the cell's timing (every config).
      checkpoint_seconds: the time spent writing its checkpoints (outside run_seconds).
      resumed_from: the round of the checkpoint a single run resumed from, else None.
      horizon: ``[rounds, eval_every]`` it ran (a resume with another keeps none of it).
    """

    key: str
    algorithm: str
    configs: list[dict[str, Any]]
    series: list[str]
    settings: list[dict[str, Any]]
    records: list[list[dict[str, Any]]]
    diverged_round: list[int]
    info: dict[str, Any]
    identity: dict[str, Any]
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    eval_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    resumed_from: int | None = None
    targets: tuple[float, ...] = ()
    horizon: list[int] = dataclasses.field(default_factory=list)

    @property
    def diverged(self) -> np.ndarray:
        return np.asarray(self.diverged_round) >= 0

    def candidates(self) -> list[results.Candidate]:
        """Its configs for :func:`scaffold_jax.results.select` (grouped over seeds)."""
        return [
            results.Candidate(
                {k: v for k, v in c.items() if k != "seed"}, recs, bool(d), c.get("seed", 0)
            )
            for c, recs, d in zip(self.configs, self.records, self.diverged, strict=True)
        ]

    def choose(
        self,
        target: float | None,
        metric: str = "test_accuracy",
        higher_is_better: bool = True,
    ) -> tuple[int, int | None]:
        """The config chosen by the package's one selection policy
        (:func:`scaffold_jax.results.select`: a diverged config last, then the fewest
        rounds to ``target``, the best ``metric``, the lowest final loss, the smallest
        values) and its rounds to ``target`` (None: not reached, or no target)."""
        best, _ = results.select(self.candidates(), target, metric, higher_is_better)
        j = best["configs"][0]
        rounds = (
            None
            if target is None
            else results.rounds_to_target(self.records[j], target, metric, higher_is_better)
        )
        return j, rounds

    def to_part(self) -> dict[str, Any]:
        """All but the records (the part's entries hold them), JSON-able."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del values["records"]
        return json.loads(json.dumps(values, default=_json_default))

    @classmethod
    def from_part(cls, part: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]):
        """The finished cell a part holds, its records read back from the part's entries."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in part.items() if k in fields}
        of = {name: j for j, name in enumerate(values["series"])}
        records = [[] for _ in values["series"]]
        for entry in entries:
            records[of[entry["series"]]].append(dict(entry))
        return cls(**{**values, "records": records, "targets": tuple(values["targets"])})


@dataclasses.dataclass(frozen=True)
class Grid:
    """What a command runs: its cells, what its folder's ``config.json`` holds, the
    targets its summary counts rounds to and the curves it plots.

    Attributes:
      experiment: ``"run"``, ``"sweep"``, ``"fig3"``, ``"table3"``...
      cells: the programs, run in order.
      saved: the command's configuration as ``config.json`` holds it (what a resume must
        ask for again; see :func:`~scaffold_jax.experiments.identity.check_resumable`).
      targets: test accuracies whose rounds every series' summary reports.
      plots: :class:`~scaffold_jax.results.PlotSpec` s drawn at the end.
    """

    experiment: str
    cells: Sequence[Cell]
    saved: Mapping[str, Any]
    targets: Sequence[float] = ()
    plots: Sequence[Any] = ()

    def __post_init__(self):
        keys = [cell.key for cell in self.cells]
        if not keys:
            raise ConfigError(f"{self.experiment}: the grid has no cells.")
        if len(set(keys)) != len(keys):
            raise ConfigError(f"{self.experiment}: two cells share a key in {keys}.")

    @property
    def single(self) -> bool:
        """One cell of one config: a run, which stops on divergence."""
        return len(self.cells) == 1 and self.cells[0].single


@dataclasses.dataclass
class Outcome:
    """What :func:`run_grid` returns: the summary (``summary.json``), every cell's
    :class:`CellResult` by key, and the folder."""

    summary: dict[str, Any]
    cells: dict[str, CellResult]
    folder: Path
    files: list[str]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _prepare(folder: Path, saved: Mapping[str, Any], overwrite: bool, resume: bool) -> bool:
    """Checks the output folder before any work; returns whether to resume (a folder
    without a run simply starts it: a scheduler may always pass --resume)."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: give one of them.")
    if resume and not (folder / results.CONFIG_FILE).is_file():
        print(f"nothing to resume in {folder}: starting the run.", file=sys.stderr)
        resume = False
    if resume:
        check_resumable(folder, dict(saved))
        results.check_lock(folder)
    else:
        results.check_folder(folder, overwrite, dry_run=True)
    return resume


def _label(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}"
                    for k, v in values.items())  # fmt: skip


class _Runner:
    """The state of one :func:`run_grid` call (kept apart so that the function reads as
    the steps it takes)."""

    def __init__(self, grid: Grid, folder: Path, resume: bool, options: dict[str, Any]):
        self.grid, self.folder, self.resume = grid, folder, resume
        self.checkpoint = options["checkpoint"]
        self.checkpoint_every = options["checkpoint_every"]
        self.checkpoint_seconds = 60.0 * options["checkpoint_minutes"]
        self.loaded: dict[tuple, Any] = {}
        self.reuse: dict[tuple, Any] = {}  # data, models and simulations shared by cells
        self._fingerprinted: tuple[Any, str | None] = (None, None)  # (data, its fingerprint)
        if options["dataset"] is not None:
            first = grid.cells[0].config
            self.loaded[self._source(first)] = options["dataset"]
        self.rounds = sum(cell.config.rounds for cell in grid.cells)
        desc = grid.cells[0].config.algorithm if grid.single else grid.experiment
        self.progress = Progress(self.rounds, desc, enabled=not options["quiet"])
        self.writer = results.RunWriter(
            folder, grid.saved, grid.targets, options["overwrite"], grid.plots, resume
        )
        self.board = None
        self.done = 0.0  # weighted rounds of the cells before the current one
        self._weighted: dict[str, float] = {}
        self.cost: CostModel | None = None
        self._described = ""  # the last data line written (see build)
        # What the folder's summary said before this process: a resume with no round left
        # to run keeps the timing of the process that ran them.
        self.previous = (results.read_summary(folder) or {}) if resume else {}

    @staticmethod
    def _source(config: RunConfig) -> tuple:
        return (config.dataset, config.data_dir, json.dumps(config.resolved("dataset")))

    def build(self, cell: Cell) -> Built:
        config = cell.config
        source = self._source(config)
        # One phase line for the data and the build: the build (a partition, a natural
        # dataset's draw of clients) is part of getting the data ready.
        what = "the run" if self.grid.single else cell.key
        with self.progress.phase(f"loading {config.dataset} and building {what}"):
            try:
                if source not in self.loaded:
                    self.loaded[source] = load_dataset(config)
                built = build(config, dataset=self.loaded[source], reuse=self.reuse)
                _preflight(built, cell)
            except ConfigError:
                raise
            except ValueError as err:  # what the data, a builder or a check refuses: the
                raise ConfigError(str(err)) from err  # config's (exit 2 on the command line)
        info = built.info
        line = (
            f"{built_summary(built)}; {info['clients_per_round']} clients a round, up to "
            f"{info['max_local_steps']} local steps of {info['max_batch_size']} examples"
        )
        if line != self._described:  # a grid's cells on the same data: said once
            self.progress.write(line)
            self._described = line
        return built

    def plan(self, first: Built, kept: Mapping[str, CellResult]) -> None:
        """Sizes every cell's work on the first cell's data; a grid of several cells says
        its plan before it starts, and its progress moves by work, not by rounds."""
        params = sum(math.prod(np.shape(a)) for a in jax.tree.leaves(first.problem.params))
        self.cost = CostModel([cell_work(cell, first.data, params) for cell in self.grid.cells])
        self._finished = {i for i, cell in enumerate(self.grid.cells) if cell.key in kept}
        self._reweigh()
        if not self.grid.single:
            self.progress.write(self.cost.plan(self.grid.experiment))

    def _reweigh(self) -> None:
        """Each cell's rounds weighted by its share of the grid's work (in all as many
        as the grid's rounds); the progress then counts the finished cells' anew."""
        weights = self.cost.weights()
        total = sum(weights)
        self._weighted = {
            cell.key: self.rounds * w / total if total > 0 else cell.config.rounds
            for cell, w in zip(self.grid.cells, weights, strict=True)
        }
        self.done = sum(self._weighted[self.grid.cells[i].key] for i in self._finished)

    def weighted_rounds(self, cell: Cell) -> float:
        """The cell's rounds weighted by its work (a grid's progress units)."""
        return self._weighted.get(cell.key, cell.config.rounds)

    def cell_done(self, cell: Cell, result: CellResult) -> None:
        """Counts a cell that ran in the progress, and its timing in the estimate (the
        cells a resume keeps are counted from the start, by :meth:`plan`)."""
        index = self.grid.cells.index(cell)
        self._finished.add(index)
        self.cost.measured(index, result.run_seconds, result.eval_seconds,
                           result.compile_seconds)  # fmt: skip
        self._reweigh()  # an evaluation weighs what it was measured to cost, from now on
        self.progress.rebase(self.done)  # the rate counts from the new weights
        # The next cells' phases (building, compiling) only when they take a while: a
        # grid of hundreds of cells keeps one line per cell.
        self.progress.brief = not self.grid.single

    def finished(self, cell: Cell, result: CellResult) -> str:
        """The line a finished cell of a grid prints: its time, and the time left."""
        line = (
            f"{cell.key}: {len(result.configs)} config(s) x {cell.config.rounds} rounds in "
            f"{result.run_seconds:.1f} s (+{result.compile_seconds:.1f} s compile)"
        )
        left = self.cost.remaining_seconds(self._finished)
        cells_left = len(self.grid.cells) - len(self._finished)
        if left is not None and cells_left:
            line += f"; about {format_seconds(left)} left for {cells_left} cell(s)"
        return line

    def directory(self, cell: Cell) -> Path | None:
        if not self.checkpoint:
            return None
        base = self.folder / CHECKPOINTS
        return base if len(self.grid.cells) == 1 else base / cell.key.replace("/", "-")

    def open_board(self) -> None:
        if not self.resume:  # a replaced run's events would mix with this one's
            shutil.rmtree(self.folder / results.TENSORBOARD_DIR, ignore_errors=True)
        # Several configs: a TensorBoard run (folder) each, which TensorBoard overlays.
        self.board = results.TensorBoardSink(self.folder, per_series=not self.grid.single)
        self.writer.files.append(results.TENSORBOARD_DIR)

    def identity(self, cell: Cell, built: Built) -> dict[str, Any]:
        """The cell's :func:`~scaffold_jax.experiments.identity.config_identity`; the data's
        fingerprint is taken once per dataset the cells share (a table's rows share their
        column's)."""
        data = built.data
        if data is not self._fingerprinted[0]:
            self._fingerprinted = (data, data_fingerprint(data))
        return config_identity(cell.config, built, self._fingerprinted[1])

    def kept_cells(self) -> dict[str, CellResult]:
        """The finished cells of the folder a resume keeps: those of this grid run with
        the same horizon (another horizon runs the cell again, from its checkpoint), each
        checked against its cell's identity (built for that, then let go).

        Raises:
          ConfigError: a finished cell of another run (other data, model, options).
        """
        kept, parts = {}, results.read_parts(self.folder)
        for cell in self.grid.cells:
            part = parts.get(cell.key)
            horizon = [cell.config.rounds, cell.config.eval_every]
            if part is None or part["payload"].get("horizon") != horizon:
                continue
            result = CellResult.from_part(part["payload"], part["entries"])
            identity = self.identity(cell, self.build(cell))
            if "algorithm" not in result.identity:
                # A part from before parts held the simulation's identity: compared on what
                # it holds (config.json, compared already, fixes the rest).
                identity = {k: v for k, v in identity.items() if k in result.identity}
            _check_same(result.identity, identity, self.folder, f"a finished cell {cell.key!r}")
            kept[cell.key] = result
        return kept

    def check_checkpoints(self, cell: Cell, built: Built) -> None:
        """Refuses, before the folder is touched, a resume whose checkpoints (the cell's,
        or its chunks') belong to another run: other data, model, options or plugin code."""
        from scaffold_jax import checkpoint  # imported late: orbax is slow to import

        directory = self.directory(cell)
        if directory is None or not directory.is_dir():
            return
        identity = self.identity(cell, built)
        for where in [directory, *sorted(directory.glob("chunk-*"))]:
            saved = (checkpoint.latest_extra(where) or {}).get("identity")
            if saved is not None:
                _check_same(saved, identity, self.folder, f"checkpoints of {cell.key!r}")

    # ------------------------------------------------------------------ one cell
    def execute(self, cell: Cell, built: Built) -> CellResult:
        config = cell.config
        values = _grid_values(built, cell)
        seeds = list(cell.seeds) or [config.seed]
        hp, seed_array, configs = sweeps.grid(
            values.pop("client_lr"), values.pop("server_lr", 1.0), seeds, **values
        )
        if "server_lr" not in built.hparams:  # an algorithm without η_g (FedDyn)
            configs = [{k: v for k, v in c.items() if k != "server_lr"} for c in configs]
        named = [*cell.axes, *(["seed"] if cell.seeds else [])]
        series = [
            cell.key + (" " + _label({k: c[k] for k in named if k in c}) if named else "")
            for c in configs
        ]
        result = CellResult(
            key=cell.key,
            algorithm=config.algorithm,
            configs=configs,
            series=series,
            settings=[{**cell.labels, **{k: c[k] for k in named if k in c}} for c in configs],
            records=[[] for _ in configs],
            diverged_round=[-1] * len(configs),
            info=dict(built.info),
            identity=self.identity(cell, built),
            targets=tuple(self.grid.targets),
            horizon=[config.rounds, config.eval_every],
        )
        first_error = {}  # a known optimum f*: each config's error at round 0
        self.written = []  # the cell's records in the order written (its part's entries)

        def write(j: int, record: Mapping[str, Any], board: bool = True) -> None:
            metrics = {k: v for k, v in record.items() if k not in ("config", "config_index")}
            f_star = built.info.get("f_star")
            if f_star is not None and "test_loss" in metrics:
                metrics["error"] = metrics["test_loss"] - f_star
                first_error.setdefault(j, metrics["error"])
                metrics["relative_error"] = metrics["error"] / first_error[j]
            entry = self.writer.record(series[j], metrics, settings=result.settings[j])
            result.records[j].append(entry)
            self.written.append(entry)
            if board and self.board is not None:  # the measurements, not the settings
                self.board({"series": series[j], **metrics})

        directory = self.directory(cell)
        if self.grid.single:
            self._run_one(cell, built, result, write, directory)
        else:
            self._sweep(cell, built, result, write, directory, hp, seed_array)
        return result

    def _run_one(self, cell, built, result, write, directory) -> None:
        config = cell.config
        restore = self.resume and directory is not None and _has_checkpoint(directory)
        if self.resume and not restore and self.board is not None:
            self.board.purge_from(0)

        def on_restore(records):
            for record in records:  # TensorBoard has them from the interrupted process
                write(0, record, board=False)
            if self.board is not None:  # the rounds after the checkpoint run again
                self.board.purge_from(records[-1]["round"] + 1 if records else 0)
            # The rounds before the checkpoint ran in another process: not in the rate.
            self.progress.rebase(records[-1]["round"] if records else 0)

        def on_record(record):
            write(0, record)
            self.progress(record)

        try:
            run = run_loop(
                built.simulation,
                built.data,
                built.hparams,
                num_rounds=config.rounds,
                eval_every=config.eval_every,
                seed=config.seed,
                callback=on_record,
                checkpoint_dir=directory,
                checkpoint_every=self.checkpoint_every if directory is not None else None,
                keep_checkpoints=config.keep_checkpoints,
                resume=restore,
                identity=result.identity,
                on_restore=on_restore,
                checkpoint_seconds=self.checkpoint_seconds if directory is not None else None,
                phase=self.progress.phase,
            )
        except DivergenceError:
            result.diverged_round = [0]
            raise
        result.compile_seconds = run.compile_seconds
        result.run_seconds = run.run_seconds
        result.eval_seconds = run.eval_seconds
        result.checkpoint_seconds = run.checkpoint_seconds
        result.resumed_from = run.resumed_from
        if run.clients is not None:
            self.writer.write_clients(result.series[0], run.clients)

    def _sweep(self, cell, built, result, write, directory, hp, seeds) -> None:
        config = cell.config
        index = self.grid.cells.index(cell)
        if self.resume and self.board is not None:
            # The sweep hands every record again from round 0 (those its checkpoint
            # restores, then the rounds after it): what the interrupted process wrote to
            # TensorBoard goes, each round is shown once.
            for name in result.series:
                self.board.purge_from(0, series=name)

        def sink(record):
            write(record["config_index"], record)

        tenths = [-1]

        def advance(fraction):
            # At most ten lines a cell: a table's hundreds of cells stay readable in a log.
            if int(10 * fraction) == tenths[0]:
                return
            tenths[0] = int(10 * fraction)
            self.progress.update(
                self.done + fraction * self.weighted_rounds(cell),
                f"{cell.key} [{index + 1}/{len(self.grid.cells)}]",
            )

        swept = sweep_loop(
            built.simulation,
            built.data,
            hp,
            seeds,
            config.rounds,
            config.eval_every,
            targets=tuple(self.grid.targets),
            callback=sink,
            checkpoint_dir=directory,
            checkpoint_every=self.checkpoint_every,
            checkpoint_seconds=self.checkpoint_seconds,
            keep_checkpoints=config.keep_checkpoints,
            resume=self.resume,
            identity=result.identity,
            phase=self.progress.phase,
            progress=advance,
        )
        if self.board is not None:  # one open event file per config of this grid only
            self.board.close()
        result.diverged_round = [int(r) for r in swept.diverged_round]
        result.compile_seconds = swept.compile_seconds
        result.run_seconds = swept.run_seconds
        result.eval_seconds = swept.eval_seconds

    def describe(self, result: CellResult) -> None:
        """The summary's facts about each series of a cell."""
        for j, name in enumerate(result.series):
            info = {
                "algorithm": result.algorithm,
                "hparams": {k: v for k, v in result.configs[j].items() if k != "seed"},
                "settings": result.settings[j],
            }
            if self.grid.single and result.resumed_from == result.records[0][-1]["round"]:
                before = self.previous.get("runs", {}).get(name, {})
                info.update({k: before[k] for k in TIMING if k in before})
            elif self.grid.single:
                rounds = max(result.records[0][-1]["round"] - (result.resumed_from or 0), 1)
                round_seconds = result.run_seconds - result.eval_seconds
                info.update(
                    compile_seconds=round(result.compile_seconds, 3),
                    run_seconds=round(result.run_seconds, 3),
                    # The rounds alone: evaluations (a pass over the test set and a
                    # training subsample) are timed apart, so rounds/s measures the
                    # simulator.
                    round_seconds=round(round_seconds, 3),
                    eval_seconds=round(result.eval_seconds, 3),
                    checkpoint_seconds=round(result.checkpoint_seconds, 3),
                    seconds_per_round=round(round_seconds / rounds, 6),
                    rounds_per_second=round(rounds / max(round_seconds, 1e-9), 3),
                    resumed_from=result.resumed_from,
                )
            self.writer.describe(name, **info)


#: The summary's timing of a single run, from the process that ran its rounds.
TIMING = ("compile_seconds", "run_seconds", "round_seconds", "eval_seconds",
          "checkpoint_seconds", "seconds_per_round", "rounds_per_second",
          "resumed_from")  # fmt: skip


def _grid_values(built: Built, cell: Cell) -> dict[str, list[float]]:
    """The cell's hyper-parameter values: the built run's, each axis's over its values."""
    values = {k: [float(v)] for k, v in built.hparams.items()}
    values.update({k: [float(x) for x in v] for k, v in cell.axes.items()})
    return values


def _preflight(built: Built, cell: Cell) -> None:
    """What the run itself would refuse as it starts, refused while the cell is built
    (before its folder is touched, as the config's error): the simulation's checks of the
    data (an algorithm's needs such as Scaffnew's S = N, a sampler's bound, memory...) and
    the algorithm's report at round 0 for every config of the cell (a private run's noise
    settings). The run repeats neither (``Simulation.check`` remembers the data it passed).

    Raises:
      ValueError: what the run would raise at its start.
    """
    built.simulation.check(built.data)
    if built.algorithm.report is None:
        return
    values = _grid_values(built, cell)
    for combination in itertools.product(*values.values()):
        hparams = dict(zip(values, combination, strict=True))
        built.simulation.report(hparams, 0, built.data.num_clients)


def _has_checkpoint(directory: Path) -> bool:
    # Only a complete checkpoint counts (a save killed half-way leaves a temporary folder).
    from scaffold_jax import checkpoint  # imported late: orbax is slow to import

    return directory.is_dir() and checkpoint.latest_round(directory) is not None


def _check_same(saved: Mapping[str, Any], identity: Mapping[str, Any], folder: Path,
                what: str) -> None:  # fmt: skip
    diffs = [f"{k}: {then!r} then, {v!r} now" for k, then, v in differences(saved, identity)]
    if diffs:
        raise ConfigError(
            f"--resume: {folder} holds {what} of another run ({'; '.join(diffs)}). Resume "
            "with the same settings, data and plugin code, or start a new run in another "
            "folder (or with --overwrite)."
        )
    check_versions(saved, f"{what} in {folder}")


def run_grid(
    grid: Grid,
    out: str | Path,
    *,
    report: Callable[[dict[str, CellResult], results.RunWriter], None] | None = None,
    overwrite: bool = False,
    resume: bool = False,
    quiet: bool = False,
    checkpoint: bool = True,
    checkpoint_every: int | None = None,
    checkpoint_minutes: float = 5.0,
    tensorboard: bool = False,
    dataset: Any = None,
) -> Outcome:
    """Runs every cell of ``grid`` into the folder ``out``.

    Each cell's records go to ``metrics.jsonl`` as they are made (its series: the cell's
    key, then each config's values when it has several); each finished cell is a part of
    the folder (``parts.jsonl``), kept by ``resume=True``; an unfinished one continues from
    its checkpoints (``<out>/checkpoints``, a folder per cell when there are several)
    bit for bit. ``report(cells, writer)`` then writes the command's own files and
    summary fields before the summary and the plots.

    Args:
      grid: the cells, the saved config, targets and plots.
      out: the output folder.
      report: writes what the command adds (tables); called once every cell is done.
      overwrite: replace a folder that holds a run.
      resume: continue the run the folder holds (its config must agree; a folder without
        one simply starts).
      quiet: no progress.
      checkpoint: write checkpoints (orbax); False: none.
      checkpoint_every: checkpoint period in rounds (default: at evaluations, as often
        as keeps checkpoint writing within 10% of the run's time; see scaffold_jax.loop).
      checkpoint_minutes: save at least this often (at block ends).
      tensorboard: also write every record's metrics as TensorBoard scalars.
      dataset: the first cell's dataset, already loaded (skips reading it).

    Raises:
      ConfigError: an invalid cell, or a resume of another run.
      FileExistsError: the folder holds a run (or is in use by a live one).
      FileNotFoundError: a dataset is missing.
      scaffold_jax.loop.DivergenceError: a single run diverged (the folder says
        ``"status": "diverged"``).
    """
    for cell in grid.cells:  # every config is checked before anything runs
        cell.config.validate()
    folder = Path(out)
    resume = _prepare(folder, grid.saved, overwrite, resume)
    if tensorboard and importlib.util.find_spec("tensorboardX") is None:
        # Before the data loads: a missing extra fails in a second, not minutes.
        raise ConfigError(
            "--tensorboard needs tensorboardX: pip install 'scaffold-jax[tensorboard]'."
        )
    runner = _Runner(
        grid,
        folder,
        resume,
        dict(overwrite=overwrite, quiet=quiet, checkpoint=checkpoint, dataset=dataset,
             checkpoint_every=checkpoint_every, checkpoint_minutes=checkpoint_minutes),
    )  # fmt: skip
    writer, progress = runner.writer, runner.progress
    # Before the folder is touched: the finished cells a resume keeps (a part of another
    # run is refused, the folder as it was), and the first cell to run is built (a config
    # that only its build refuses, an algorithm's check or a missing dataset, leaves the
    # folder as it was too).
    kept = runner.kept_cells() if resume else {}
    todo = [cell for cell in grid.cells if cell.key not in kept]
    first = runner.build(todo[0]) if todo else None
    if resume and first is not None:  # the cell a kill interrupted: its checkpoints
        runner.check_checkpoints(todo[0], first)
    if first is not None:
        runner.plan(first, kept)
    done: dict[str, CellResult] = {}
    with writer:
        writer.add(experiment=grid.experiment)
        if tensorboard:
            runner.open_board()
        if resume:
            writer.keep_finished_parts(kept)
        try:
            for cell in grid.cells:
                if cell.key in kept:
                    done[cell.key] = kept[cell.key]
                    progress.write(f"{cell.key}: kept from the interrupted run")
                else:
                    built = first if first is not None else runner.build(cell)
                    first = None  # the next cells are built in turn: one cell's data at a time
                    done[cell.key] = result = runner.execute(cell, built)
                    if not grid.single:  # a run resumes from its checkpoint, every time
                        writer.save_part(cell.key, result.to_part(), runner.written)
                    runner.cell_done(cell, result)
                    if not grid.single:
                        progress.write(runner.finished(cell, result))
                progress.update(runner.done)
                runner.describe(done[cell.key])
                if len(grid.cells) == 1:
                    writer.add(**done[cell.key].info)
                else:
                    writer.add(dataset=done[cell.key].info["dataset"])
        except DivergenceError as err:
            writer.close("diverged", error=str(err))
            raise
        finally:
            progress.close()
            if runner.board is not None:
                runner.board.close()
        if report is not None:
            report(done, writer)
        summary = writer.finish()
    return Outcome(summary, done, folder, list(writer.files))
