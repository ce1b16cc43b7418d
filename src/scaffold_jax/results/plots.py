"""Every plot of the package: run curves, a sweep's rounds to target and best curves,
client drift, G against similarity, the gradient-dissimilarity fit.

Each is a ``matplotlib.figure.Figure`` in one style (:func:`new_figure`,
:func:`style_axes`), never pyplot and never a change of the global backend. matplotlib is
the optional ``plots`` extra: only the plotting functions import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from scaffold_jax.results.records import _as_mapping, by_series, is_finite_number, summarize

# ----------------------------------------------------------------------------- plots
# The one plot style. Every plot of the package is a matplotlib ``Figure`` made by
# :func:`new_figure` (object API, Agg canvas, constrained layout: never pyplot and never
# ``matplotlib.use``, so a notebook's or script's backend is left alone) and finished by
# :func:`style_axes` (labels, grid, the legend outside the axes so it never covers a
# curve). matplotlib is the optional "plots" extra: it is imported by these functions only.
PANEL_SIZE = (4.8, 3.4)  # inches per panel, without the legend
LEGEND_WIDTH = 2.4  # inches added on the right for a legend beside a single panel
_LEGEND_ROW = 0.17  # inches per legend entry below a panel
_FONT = 8


def new_figure(
    num_panels: int = 1, *, title: str = "", legend: str = "right", legend_rows: int = 0
):
    """A new Figure in the package's one style, and its axes (one row of panels).

    Args:
      num_panels: panels side by side.
      title: the figure title (``suptitle``).
      legend: where :func:`style_axes` will put each panel's legend: ``"right"`` (beside
        the panel, the room is added to the width), ``"below"`` (under the panel, the room
        is added to the height: for several panels side by side) or ``"none"``.
      legend_rows: the most legend entries of a panel, for ``legend="below"``.

    Returns:
      ``(fig, axes)``: a ``matplotlib.figure.Figure`` with an Agg canvas (so
      ``fig.savefig`` works without pyplot) and a list of ``num_panels`` axes, gridded.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = PANEL_SIZE[0] * num_panels + (LEGEND_WIDTH if legend == "right" else 0.0)
    height = PANEL_SIZE[1] + (0.3 if title else 0.0)
    if legend == "below":
        height += 0.35 + _LEGEND_ROW * legend_rows
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, num_panels, squeeze=False)[0])
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=_FONT)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig, axes


def style_axes(
    ax, *, xlabel: str, ylabel: str, title: str = "", legend: str = "right", ncol: int = 1
) -> None:
    """Labels, grid and legend of one panel, in the package's one style.

    The legend (when the panel has labelled artists) sits outside the axes, beside
    (``"right"``) or under (``"below"``) them, so it never covers a curve; constrained
    layout (or the caller's ``tight_layout``) makes room for it and for the labels.
    """
    ax.set_xlabel(xlabel, fontsize=_FONT + 1)
    ax.set_ylabel(ylabel, fontsize=_FONT + 1)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if not handles or legend == "none":
        return
    if legend == "below":
        ax.legend(
            loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=7, frameon=False, ncol=ncol
        )
    else:
        ax.legend(
            loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=7,
            frameon=False, ncol=ncol,
        )  # fmt: skip


def _log_axis(ax, values: Sequence[float], axis: str = "x") -> None:
    """A log axis ticked at exactly ``values`` (a step-size grid) with plain labels: no
    minor-tick labels to collide with them, rotated when there are many, and a label left
    out where it would overlap the one before (a grid spanning many decades)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    which = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    ticks = sorted({float(v) for v in values if v > 0})
    logs = [math.log10(t) for t in ticks]
    span = (logs[-1] - logs[0]) if ticks else 0.0
    labelled, last = set(), -math.inf
    for tick, at in zip(ticks, logs, strict=True):
        if at - last >= _MIN_LABEL_GAP * span:
            labelled.add(tick)
            last = at
    which.set_major_locator(FixedLocator(ticks))
    which.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v in labelled else ""))
    which.set_minor_locator(NullLocator())
    if axis == "x" and len(ticks) > 5:
        ax.tick_params(axis="x", labelrotation=45)


#: The least distance between two labelled ticks of a log axis, as a fraction of its span.
_MIN_LABEL_GAP = 0.07


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Writes ``fig`` to ``path`` (format from the suffix); returns the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path


def _figure(ax, **new_figure_args):
    """``(fig, ax)``: the figure of the given axes (a notebook's), else a new one."""
    if ax is not None:
        return ax.figure, ax
    fig, (ax,) = new_figure(**new_figure_args)
    return fig, ax


def _target_lines(ax, targets: float | Sequence[float] | None) -> None:
    """A dashed line at each target level, one legend entry for them all."""
    levels = [] if targets is None else [float(t) for t in np.atleast_1d(targets)]
    for i, level in enumerate(levels):
        name = "target" if len(levels) == 1 else "targets"
        label = f"{name} {', '.join(f'{t:g}' for t in levels)}" if i == 0 else None
        ax.axhline(level, linestyle="--", color="gray", linewidth=1, label=label)


def _integer_axis(ax, axis: str = "x") -> None:
    """Ticks at whole numbers only (rounds): no 0.5-round ticks on a short run."""
    from matplotlib.ticker import MaxNLocator

    locator = MaxNLocator(integer=True, steps=[1, 2, 5, 10])
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(locator)


def _metric_label(metric: str) -> str:
    return metric.replace("_", " ")


class PlotSpec(NamedTuple):
    """A plot to write at the end of a run.

    Attributes:
      filename: e.g. ``"accuracy.png"``.
      metric: the record field on the y axis.
      ylabel: the y-axis label.
      logy: log-scale y axis (errors f(x) − f*).
      panels: panel title -> series in that panel (None: one panel with every series).
      title: the figure title.
      target: a target level of ``metric``, or several, drawn as dashed lines (None: none).
      legend: the legend label of a series name (None: the name itself), e.g. without
        what its panel's title already says.
      x: the record field on the x axis: ``"round"``, or a cumulative count of
        :data:`X_AXES` (``bytes_up_total``: the uplink's bytes, drawn in MB;
        ``virtual_time``: the virtual clock's seconds, drawn in minutes; round 0 is 0).
    """

    filename: str
    metric: str
    ylabel: str
    logy: bool = False
    panels: Mapping[str, Sequence[str]] | None = None
    title: str = ""
    target: float | Sequence[float] | None = None
    legend: Callable[[str], str] | None = None
    x: str = "round"


#: The x axes a curve may use besides rounds: field -> (label, scale).
X_AXES = {
    "bytes_up_total": ("uplink MB (cumulative, all clients)", 1e-6),
    "bytes_down_total": ("downlink MB (cumulative, all clients)", 1e-6),
    "virtual_time": ("virtual time (minutes on the clients' devices)", 1 / 60),
}


def plot_curves(
    records: Sequence[Mapping[str, Any]], spec: PlotSpec, path: str | os.PathLike | None = None
):
    """``spec.metric`` against rounds, one line per series (a panel per ``spec.panels``).

    Args:
      records: evaluation records, each with ``"series"`` and ``"round"``.
      spec: what to draw.
      path: where to write the image (None: only return the figure).

    Returns:
      The ``matplotlib.figure.Figure``, or None when there is nothing to draw.
    """
    groups = by_series(records)
    panels = spec.panels or {"": list(groups)}
    panels = {
        title: [s for s in names if any(spec.metric in r for r in groups.get(s, []))]
        for title, names in panels.items()
    }
    panels = {title: names for title, names in panels.items() if names}
    if not panels:
        return None
    where = "right" if len(panels) == 1 else "below"
    rows = max(len(names) for names in panels.values()) + (spec.target is not None)
    fig, axes = new_figure(len(panels), title=spec.title, legend=where, legend_rows=rows)
    for ax, (title, names) in zip(axes, panels.items(), strict=True):
        for name in names:
            points = [
                (_x(r, spec.x), r[spec.metric])
                for r in groups[name]
                if is_finite_number(r.get(spec.metric))
                and (not spec.logy or r[spec.metric] > 0)
                and is_finite_number(_x(r, spec.x))
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=name if spec.legend is None else spec.legend(name))
        _target_lines(ax, spec.target)
        if spec.logy:
            ax.set_yscale("log")
        if spec.x == "round":
            _integer_axis(ax)
        xlabel = X_AXES[spec.x][0] if spec.x in X_AXES else "communication rounds"
        style_axes(ax, xlabel=xlabel, ylabel=spec.ylabel, title=title, legend=where)
    if path is not None:
        save_figure(fig, path, dpi=110)
    return fig


def _x(record: Mapping[str, Any], field: str) -> Any:
    """A record's x value: its round, or a cumulative count scaled (0 before round 1)."""
    if field == "round":
        return record["round"]
    value = record.get(field, 0 if record.get("round") == 0 else None)
    return None if value is None else value * X_AXES[field][1]


DEFAULT_PLOTS = (
    PlotSpec("accuracy.png", "test_accuracy", "test accuracy"),
    PlotSpec("loss.png", "test_loss", "test loss"),
    PlotSpec("accuracy_vs_uplink.png", "test_accuracy", "test accuracy", x="bytes_up_total"),
)


def _varying(groups: Sequence[Mapping[str, Any]]) -> set[str]:
    names = groups[0]["hparams"].keys() if groups else ()
    return {k for k in names if len({g["hparams"][k] for g in groups}) > 1}


def _hparam_name(name: str) -> str:
    return {"client_lr": "η_l", "server_lr": "η_g"}.get(name, name)


def _label(name: str, hparams: Mapping[str, Any], show: Iterable[str]) -> str:
    parts = [f"{_hparam_name(k)} = {v:g}" for k, v in hparams.items() if k in set(show)]
    return f"{name} ({', '.join(parts)})" if parts else name


def _x_axis(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """The hyper-parameter a rounds-to-target plot puts on its x axis: the one with the
    most values within a grid (η_l on a tie, then the first declared). Within: a
    trade-off's value is one per series (:func:`~scaffold_jax.results.split_tradeoffs`),
    however many the sweep has."""
    counts: dict[str, int] = {}
    for entry in summary.values():
        within: dict[str, set] = {}
        for group in entry["groups"]:
            for k, v in group["hparams"].items():
                within.setdefault(k, set()).add(v)
        for k, values in within.items():
            counts[k] = max(counts.get(k, 0), len(values))
    if not counts:
        return "client_lr"
    most = max(counts.values())
    ties = [k for k, v in counts.items() if v == most]
    return "client_lr" if "client_lr" in ties else ties[0]


def plot_rounds_to_target(
    results: Mapping[str, Any] | Any,
    target: float,
    metric: str = "test_accuracy",
    ax=None,
    higher_is_better: bool = True,
):
    """A sweep's rounds to ``target`` against its swept hyper-parameter (η_l, or the one
    with the most values), per grid, mean ± std over seeds.

    One line per grid (and per value of the other hyper-parameters, when those vary too).
    A value whose seeds do not all reach the target is drawn as an ``x`` at the horizon
    (the last evaluated round), one that diverged on any seed as a ``v`` there, as the
    legend says.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric``.
      metric: the record field compared with the target.
      ax: draw into these axes (e.g. a notebook's) instead of a new figure.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    results = _as_mapping(results)
    summary = summarize(results, target, metric, higher_is_better)
    fig, ax = _figure(ax)
    x_name = _x_axis(summary)
    horizon = max(
        [r["round"] for res in results.values() for recs in res.records for r in recs] or [1]
    )
    xs, shown = [], set()
    for name, entry in summary.items():
        lines: dict[tuple, list[dict]] = {}
        for g in entry["groups"]:
            others = tuple((k, v) for k, v in g["hparams"].items() if k != x_name)
            lines.setdefault(others, []).append(g)
        varying = _varying(entry["groups"]) - {x_name}
        for others, groups in lines.items():
            groups = sorted(groups, key=lambda g: g["hparams"][x_name])
            xs += [g["hparams"][x_name] for g in groups]
            done = [g for g in groups if g["rounds_mean"] is not None and not g["num_diverged"]]
            label = _label(name, dict(others), varying)
            if done:
                line = ax.errorbar(
                    [g["hparams"][x_name] for g in done],
                    [g["rounds_mean"] for g in done],
                    yerr=[g["rounds_std"] for g in done],
                    marker="o",
                    capsize=3,
                    label=label,
                )
                color = line[0].get_color()
            else:
                (line,) = ax.plot([], [], marker="o", label=label)
                color = line.get_color()
            # A value that blew up on some seed is unusable even if it reached the target
            # first (the selection ranks it last): marked at the horizon, not on the line.
            for marker, failed in (
                ("v", [g for g in groups if g["num_diverged"]]),
                ("x", [g for g in groups if g["rounds_mean"] is None and not g["num_diverged"]]),
            ):
                if failed:
                    shown.add(marker)
                    at = [g["hparams"][x_name] for g in failed]
                    ax.scatter(at, [horizon] * len(at), marker=marker, color=color, zorder=3)
    for marker, text in (("x", "not reached"), ("v", "diverged")):
        if marker in shown:
            ax.scatter([], [], marker=marker, color="gray", label=f"{text} (at {horizon} rounds)")
    if all(x > 0 for x in xs):
        _log_axis(ax, xs)
    # From 0 to past the horizon: the "not reached" marks stay in view, and equal rounds
    # (a flat line) still get whole-number ticks.
    ax.set_ylim(0, horizon * 1.08)
    _integer_axis(ax, "y")
    relation = "≥" if higher_is_better else "≤"
    what = f"{_metric_label(metric)} {relation} {target:g}"
    kind = {"client_lr": "client step size ", "server_lr": "server step size "}
    xlabel = kind.get(x_name, "") + _hparam_name(x_name)
    style_axes(
        ax,
        xlabel=xlabel,
        ylabel=f"rounds to {what}",
        title=f"Rounds to {what}\n(mean ± std over seeds)",
    )
    return fig


def plot_best_curves(
    results: Mapping[str, Any] | Any,
    target: float | None,
    metric: str = "test_accuracy",
    ax=None,
    higher_is_better: bool = True,
):
    """``metric`` against rounds for each grid's chosen config (:func:`summarize`): the
    mean over its seeds, a band of ± 1 standard deviation over the seeds, and the target
    as a dashed line.

    Args:
      results: ``{grid name: SweepResult}`` or one SweepResult.
      target: the target of ``metric`` the choice was made for (None: best value alone).
      metric: the record field drawn.
      ax: draw into these axes instead of a new figure.
      higher_is_better: True for accuracies, False for losses and errors.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    results = _as_mapping(results)
    summary = summarize(results, target, metric, higher_is_better)
    fig, ax = _figure(ax)
    num_seeds = set()
    for name, entry in summary.items():
        best = entry["best"]
        runs = [results[name].records[j] for j in best["configs"]]
        length = min(len(r) for r in runs)
        curves = np.asarray(
            [[float(r.get(metric, np.nan)) for r in recs[:length]] for recs in runs]
        )
        rounds = [r["round"] for r in runs[0][:length]]
        mean, std = curves.mean(axis=0), curves.std(axis=0)
        num_seeds.add(len(runs))
        label = _label(name, best["hparams"], _varying(entry["groups"]) | {"client_lr"})
        (line,) = ax.plot(rounds, mean, label=label)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.25, color=line.get_color())
    _target_lines(ax, target)
    _integer_axis(ax)
    seeds = "/".join(str(n) for n in sorted(num_seeds))
    style_axes(
        ax,
        xlabel="communication rounds",
        ylabel=_metric_label(metric),
        title=f"The chosen config of each grid\nmean over {seeds} seeds, band ± 1 std",
    )
    return fig


#: The costs :func:`plot_tradeoffs` puts on an x axis, by record field.
_COST_LABELS = {
    "dp_epsilon": "ε spent",
    "bytes_up_total": "uplink bytes, total",
    "virtual_time": "virtual time (s)",
}


def plot_tradeoffs(rows: Sequence[Mapping[str, Any]], axes: Sequence[str]):
    """The curve of a trade-off sweep: each series' chosen config (the rows of
    :func:`~scaffold_jax.results.frontier_rows`), its final metric (mean ± std over its
    seeds) against the value of the first trade-off axis (``dp_epsilon``,
    ``compress_fraction``...), and, in a panel each, against every cost its records carry
    that differs between the values (ε spent, uplink bytes, virtual time). One line per
    algorithm and setting (and value of the other trade-off axes).

    Args:
      rows: :func:`~scaffold_jax.results.frontier_rows` of the sweep.
      axes: the trade-off axes swept (at least one).

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    from matplotlib.ticker import FixedLocator

    x_name = axes[0]
    metric = rows[0]["metric"] if rows else "test_accuracy"
    lines: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in rows:
        others = tuple((a, r["values"].get(a)) for a in axes[1:])
        lines.setdefault((r["label"], others), []).append(r)
    # A cost gets a panel where it moves along a line (the uplink of a compression sweep),
    # not where it only tells the algorithms apart.
    panels = [x_name]
    for field in _COST_LABELS:
        seen = [[r["costs"].get(field) for r in members] for members in lines.values()]
        moves = any(len(set(values)) > 1 for values in seen)
        if field != x_name and moves and all(None not in values for values in seen):
            panels.append(field)
    fig, axs = new_figure(
        len(panels), legend="below" if len(panels) > 1 else "right", legend_rows=len(lines)
    )
    for i, (ax, field) in enumerate(zip(axs, panels, strict=True)):
        xs = []
        for (label, others), members in lines.items():

            def x_of(r, field=field):
                return r["values"].get(field) if field == x_name else r["costs"].get(field)

            members = sorted((r for r in members if x_of(r) is not None), key=x_of)
            xs += [x_of(r) for r in members]
            name = " ".join([label, *(f"{a}={v:g}" for a, v in others if v is not None)])
            ax.errorbar(
                [x_of(r) for r in members],
                [r["group"]["final_value_mean"] for r in members],
                yerr=[r["group"]["final_value_std"] or 0.0 for r in members],
                marker="o",
                capsize=3,
                label=name if i == 0 else None,  # one legend, under the first panel
            )
        if xs and all(x > 0 for x in xs) and max(xs) > 3 * min(xs):
            if field == x_name:
                _log_axis(ax, xs)  # ticked at the values swept
            else:
                ax.set_xscale("log")
        elif field == x_name and xs:
            ax.xaxis.set_major_locator(FixedLocator(sorted(set(xs))))
        style_axes(
            ax,
            xlabel=x_name if field == x_name else _COST_LABELS[field],
            ylabel=f"final {_metric_label(metric)}",
            legend="below" if len(panels) > 1 else "right",
            ncol=1 if len(panels) == 1 else min(3, max(1, len(lines))),
        )
    fig.suptitle(
        f"Trade-off: final {_metric_label(metric)} of each value's chosen config\n"
        "(mean ± std over seeds)",
        fontsize=10,
    )
    return fig


def plot_drift(
    histories: Mapping[str, Any],
    path: str | os.PathLike | None = None,
    *,
    title: str = "Client drift",
    ylabel: str = "client drift, mean ‖yᵢ − x‖",
):
    """Per-round drift curves (e.g. FedAvg vs SCAFFOLD), log scale when all positive.

    Args:
      histories: name -> ``[R]`` per-round values (e.g. ``result.round_metrics
        ["client_drift"]``).
      path: where to write the image (the format follows the suffix); None: don't.
      title: figure title.
      ylabel: y-axis label.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    fig, (ax,) = new_figure()
    positive = True
    for name, values in histories.items():
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        positive &= bool(np.all(values > 0))
        ax.plot(np.arange(1, values.size + 1), values, label=str(name))
    if positive:
        ax.set_yscale("log")
    style_axes(ax, xlabel="communication rounds", ylabel=ylabel, title=title)
    _integer_axis(ax)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_G_vs_similarity(
    similarities: Sequence[float],
    G_values: Sequence[float],
    path: str | os.PathLike | None = None,
    *,
    title: str = "Gradient dissimilarity vs data similarity",
):
    """G (e.g. ``DiagnosticsReport.G_at_x``) against the s% similarity of the split.

    Returns:
      The ``matplotlib.figure.Figure`` (also written to ``path`` when given).

    Raises:
      ValueError: the two sequences do not pair up.
    """
    s = np.asarray(similarities, dtype=np.float64).reshape(-1)
    g = np.asarray(G_values, dtype=np.float64).reshape(-1)
    if s.shape != g.shape:
        raise ValueError(f"{s.size} similarities but {g.size} G values; they must pair up.")
    order = np.argsort(s)
    fig, (ax,) = new_figure(legend="none")
    ax.plot(s[order], g[order], marker="o")
    style_axes(ax, xlabel="similarity s (%)", ylabel="G", title=title)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_gradient_fit(
    points: Sequence[tuple[float, float]],
    G: float,
    B: float | None,
    path: str | os.PathLike | None = None,
    *,
    title: str = "Gradient dissimilarity (A1): (1/N) Σ‖∇f_i‖² ≤ G² + B²‖∇f‖²",
):
    """The points ``((1/N) Σ‖∇f_i(x)‖², ‖∇f(x)‖²)`` of ``scaffold-jax diagnose`` (x and
    the points of its gradient-descent path) and the bound fitted to them (B = 1 when
    ``B`` is None, a single point).

    Returns:
      The ``matplotlib.figure.Figure`` (also written to ``path`` when given).
    """
    import numpy as np

    pts = np.asarray(points, dtype=np.float64).reshape(-1, 2)
    slope = 1.0 if B is None else float(B) ** 2
    grid = np.linspace(0.0, max(float(pts[:, 1].max()), 1e-12) * 1.05, 50)
    fig, (ax,) = new_figure()
    ax.plot(pts[:, 1], pts[:, 0], marker="o", linestyle="none", label="measured")
    ax.plot(grid, G**2 + slope * grid, label=f"G = {G:.3g}, B = {1.0 if B is None else B:.3g}")
    style_axes(ax, xlabel="‖∇f(x)‖²", ylabel="(1/N) Σ‖∇f_i(x)‖²", title=title)
    if path is not None:
        save_figure(fig, path)
    return fig
