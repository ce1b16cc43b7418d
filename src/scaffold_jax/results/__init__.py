"""Run records on disk: the per-run folder, rounds-to-target, the step-size selection,
paper-style tables, and every plot.

One of each: :func:`rounds_to_target` is the package's only rounds-to-target;
:func:`select` is the only step-size selection policy (``reproduce`` reaches it through
:meth:`scaffold_jax.experiments.CellResult.choose`, ``sweep`` through :func:`summarize`); every plot
(run curves, a sweep's rounds to target and best curves, client drift, G against
similarity) is a ``matplotlib.figure.Figure`` in one style (:func:`new_figure`,
:func:`style_axes`), never pyplot and never a change of the global backend.

Every run (``scaffold-jax run`` or one ``scaffold-jax reproduce`` protocol) owns one output
folder, written by a :class:`RunWriter`:

* ``config.json``: the full configuration, as given and resolved;
* ``metrics.jsonl``: one JSON object per evaluation, appended and flushed as it is made,
  so a run killed at any point keeps every record it finished;
* ``summary.json``: written at the start (``"status": "running"``) and rewritten at the
  end: status (``finished``, ``failed`` or ``interrupted``), rounds to each target, best
  accuracy, compile and steady-state time, the jax version and devices;
* ``metrics.csv``: the same records as a table;
* ``accuracy.png`` / ``loss.png`` / ``accuracy_vs_uplink.png`` (or the plots an
  experiment asks for): one line per
  series (algorithm, or algorithm and setting).

A record is a flat dict with at least ``"series"`` (which curve it belongs to) and
``"round"``, plus whatever the evaluation measured (``test_accuracy``, ``test_loss``,
``train_loss``, ``error``...).

Tables follow the paper's layout (Karimireddy et al. 2020, Tables 3-5): rounds to reach a
target with the speed-up over SGD in parentheses, and ``"1k+"`` (``"<horizon>+"``) when the
target was not reached within the horizon.

One module per concern; every public name is re-exported here (``results.RunWriter``):

* :mod:`scaffold_jax.results.records`: reading and summarising records: rounds to target,
  best values, the step-size selection (:func:`select`, :func:`summarize`), a sweep's
  rows, a run folder's records and summary (:func:`read_records`, :func:`read_summary`);
* :mod:`scaffold_jax.results.tables`: Markdown and CSV tables: a sweep's summary
  (:func:`format_summary`; one row per value of a trade-off axis, :func:`split_tradeoffs`,
  :func:`frontier_rows`) and tidy table (:func:`sweep_table`, :func:`csv_text`), the
  grid-edge warnings (:func:`grid_edges`), the paper's tables (:func:`rounds_table`,
  :func:`value_table`);
* :mod:`scaffold_jax.results.plots`: every plot (matplotlib, imported by the plotting
  functions only: it is the optional ``plots`` extra);
* :mod:`scaffold_jax.results.folder`: the run folder: :class:`RunWriter`;
* :mod:`scaffold_jax.results.files`: its files' names, the run's statuses, writing them
  atomically, :class:`RunFolderError`, :func:`read_parts`;
* :mod:`scaffold_jax.results.lock`: its lock (:func:`check_lock`) and :func:`check_folder`;
* :mod:`scaffold_jax.results.provenance`: the environment a summary records
  (:func:`environment`, :func:`git_revision`);
* :mod:`scaffold_jax.results.tensorboard`: :class:`TensorBoardSink`.

``records`` and ``tables`` are at the bottom, ``plots`` imports ``records``, ``files``
``records``, ``lock`` ``files``; ``folder`` imports them all; ``provenance`` and
``tensorboard`` stand alone.
"""

from scaffold_jax.results import folder, plots, records, tables, tensorboard
from scaffold_jax.results.files import (
    CONFIG_FILE,
    CSV_FILE,
    FAILED,
    FINISHED,
    INTERRUPTED,
    PARTS_FILE,
    RUNNING,
    RunFolderError,
    read_parts,
)
from scaffold_jax.results.folder import RunWriter
from scaffold_jax.results.lock import LOCK_FILE, check_folder, check_lock
from scaffold_jax.results.plots import (
    DEFAULT_PLOTS,
    LEGEND_WIDTH,
    PANEL_SIZE,
    PlotSpec,
    new_figure,
    plot_best_curves,
    plot_curves,
    plot_drift,
    plot_G_vs_similarity,
    plot_gradient_fit,
    plot_rounds_to_target,
    plot_tradeoffs,
    save_figure,
    style_axes,
)
from scaffold_jax.results.provenance import environment, git_revision
from scaffold_jax.results.records import (
    METRICS_FILE,
    PLACE_KEYS,
    SUMMARY_FILE,
    Candidate,
    Record,
    best_value,
    by_series,
    group_runs,
    is_finite_number,
    mean_over_rounds,
    read_records,
    read_summary,
    rounds_to_target,
    select,
    selection_key,
    series_summary,
    summarize,
    sweep_rows,
)
from scaffold_jax.results.tables import (
    COSTS,
    Cell,
    Series,
    csv_text,
    format_bytes,
    format_frontier,
    format_grid_edge,
    format_rounds,
    format_seconds,
    format_speedup,
    format_summary,
    frontier_rows,
    grid_edges,
    markdown_table,
    rounds_cell,
    rounds_table,
    split_tradeoffs,
    summary_metric,
    sweep_table,
    value_table,
)
from scaffold_jax.results.tensorboard import TENSORBOARD_DIR, TensorBoardSink

__all__ = [
    # records
    "METRICS_FILE",
    "PLACE_KEYS",
    "SUMMARY_FILE",
    "Candidate",
    "Record",
    "best_value",
    "by_series",
    "group_runs",
    "is_finite_number",
    "read_records",
    "read_summary",
    "rounds_to_target",
    "select",
    "selection_key",
    "mean_over_rounds",
    "series_summary",
    "summarize",
    "sweep_rows",
    # tables
    "COSTS",
    "Cell",
    "Series",
    "csv_text",
    "format_bytes",
    "format_frontier",
    "format_grid_edge",
    "format_rounds",
    "format_seconds",
    "format_speedup",
    "format_summary",
    "frontier_rows",
    "grid_edges",
    "markdown_table",
    "rounds_cell",
    "rounds_table",
    "split_tradeoffs",
    "summary_metric",
    "sweep_table",
    "value_table",
    # plots
    "DEFAULT_PLOTS",
    "LEGEND_WIDTH",
    "PANEL_SIZE",
    "PlotSpec",
    "new_figure",
    "plot_G_vs_similarity",
    "plot_best_curves",
    "plot_curves",
    "plot_drift",
    "plot_gradient_fit",
    "plot_rounds_to_target",
    "plot_tradeoffs",
    "save_figure",
    "style_axes",
    # folder
    "CONFIG_FILE",
    "CSV_FILE",
    "FAILED",
    "FINISHED",
    "INTERRUPTED",
    "LOCK_FILE",
    "PARTS_FILE",
    "RUNNING",
    "RunFolderError",
    "RunWriter",
    "check_folder",
    "read_parts",
    "check_lock",
    "environment",
    "git_revision",
    # tensorboard
    "TENSORBOARD_DIR",
    "TensorBoardSink",
    # the modules
    "folder",
    "plots",
    "records",
    "tables",
    "tensorboard",
]
