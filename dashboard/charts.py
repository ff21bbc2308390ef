"""Plotly figures of the dashboard: pure functions of DataFrames (no Streamlit), one per kind of chart.

Runs are told apart by color (the same on every chart); metrics of one run by dash. Text from the data set (prompt
ids) is HTML-escaped before it reaches plotly, which would otherwise render tags such as <b> in labels.

Live charts keep the user's zoom and hidden legend entries across redraws: every figure has a constant `uirevision`,
every trace a stable `uid` (its name), and no axis range depends on the data (plotly keeps a user's zoom only while
the figure's own range input is unchanged).
"""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from qae_app.analysis.run_comparison import CONFIDENCE, student_t_ppf
from qae_app.core.alert_levels import ALERT_CHARTS
from qae_app.core.formatting import as_float, number
from qae_app.core.names import GATE_REASONS, REGIMES

SMOOTHING_METHODS = ("none", "ema", "rolling")
# the band around a group's mean curve (Compare, grouped Training curves): the mean's 95% Student-t interval, the
# seeds' range, or (auto, the pages' default) the range below AUTO_T_FROM seeds and the interval from there on
SEED_BANDS = {
    "auto": "lowest to highest seed with 3 or fewer seeds, else the 95% Student-t interval of the mean",
    "t-interval": "95% Student-t interval of the mean over seeds",
    "min-max": "lowest to highest seed",
}
AUTO_T_FROM = 4  # with 2 or 3 seeds t_0.975 is 12.71 or 4.30: the interval dwarfs the curves and the axis follows it
BAND_LOW, BAND_HIGH, BAND_N = ":low", ":high", ":n"  # a grouped frame's columns beside each metric's mean
# x axes of the curves: column of the prepared steps frame -> axis title
X_AXES = {"step": "step", "wall_time": "wall time (hours since the run started)", "tokens": "tokens generated"}
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
# Foreground colors of the light theme. Backgrounds are transparent, so a chart takes the page's; the browser swaps
# these exact strings for the Streamlit theme's text color (board.plot), so dark mode draws light ink on dark.
INK = "#31333f"  # text, axis titles, marker outlines, marker lines (Streamlit's light text color)
GRID = "#e6e9ef"  # grid lines (INK at ~12% in the browser)
AXIS_LINE = "#c8ccd4"  # axis lines and ticks (INK at ~30% in the browser)
THEMED = {"ink": INK, "grid": GRID, "axis_line": AXIS_LINE}
# Regimes (and why a response was gated) in earthy tones from brown (failing) to teal (succeeding): none is one of
# the run colors (board.RUN_COLORS, plotly's bright qualitative palette), so a regime never reads as a run.
REGIME_COLORS = {
    "all_wrong": "#6b4226",
    "hard": "#a6761d",
    "mixed": "#9e9e9e",
    "easy": "#5ab4ac",
    "all_correct": "#01665e",
}
GATE_COLORS = {
    "all_wrong_group": REGIME_COLORS["all_wrong"],
    "failure_in_hard_group": REGIME_COLORS["hard"],
    "reward_at_baseline": REGIME_COLORS["mixed"],
    "success_in_easy_group": REGIME_COLORS["easy"],
    "all_correct_group": REGIME_COLORS["all_correct"],
}
REGIME_METRICS = {f"frac_{regime}": regime for regime in REGIMES}  # steps column -> regime
# parts of step_s, stacked
TIME_METRICS = ("rollout_s", "reward_s", "update_s", "sync_s", "eval_s", "write_s", "checkpoint_s")
TIME_COLORS = {
    "rollout_s": "#1f77b4",
    "reward_s": "#ff7f0e",
    "update_s": "#2ca02c",
    "sync_s": "#17becf",
    "eval_s": "#9467bd",
    "write_s": "#8c564b",
    "checkpoint_s": "#7f7f7f",
}
PANELS_PER_ROW = 4  # per-run panels (stacked areas, drawn full width) wrap after this many
MAX_LEGEND_ENTRIES = 6  # more (run, metric) lines than this: the legend lists runs and the title names the dashes
# The legend sits at the bottom of the figure (container coordinates), below a margin that holds the x axis's tick
# labels and title: however many rows the legend takes, it never overlaps the axis title (a legend placed relative to
# the plot area moved up into the title as it wrapped and the plot shrank).
AXIS_TITLE_PX = 62  # under the plot: tick labels and the x axis title
LEGEND_ROW_PX = 21  # one row of a horizontal legend
TRANSPARENT = "rgba(0,0,0,0)"
LAYOUT = dict(
    margin=dict(l=10, r=10, t=50, b=AXIS_TITLE_PX + LEGEND_ROW_PX),
    height=400,
    hovermode="x unified",
    uirevision="keep",
    paper_bgcolor=TRANSPARENT,
    plot_bgcolor=TRANSPARENT,
    font=dict(color=INK),
    legend=dict(
        orientation="h", yref="container", y=0, yanchor="bottom", xanchor="left", x=0, title=None, bgcolor=TRANSPARENT
    ),
    hoverlabel=dict(namelength=-1),
)
AXES = dict(
    showgrid=True,
    gridcolor=GRID,
    zeroline=False,
    linecolor=AXIS_LINE,
    ticks="outside",
    tickcolor=AXIS_LINE,
    automargin=True,
    exponentformat="e",
)  # ticks read 5e-05 as tables do, not plotly's 50µ
# Figures are styled by LAYOUT and AXES alone: plotly's default template is deep-copied into every figure built,
# which was two thirds of the time to build the curves page of a 1,000-step run.
pio.templates.default = "none"


def smooth(values: pd.Series, method: str = "none", amount: float = 0.0) -> pd.Series:
    """Smoothed copy of `values`: 'ema' with weight `amount` in [0, 1) on the past (debiased, as TensorBoard) or a
    'rolling' mean over `amount` steps; NaN (steps without the metric) stay NaN and don't enter the average."""
    if method == "none" or values.empty:
        return values
    if method == "ema":
        if not 0 <= amount < 1:
            raise ValueError(f"smoothing: EMA weight {amount} must be in [0, 1)")
        present = values.dropna()
        out = present.ewm(alpha=1 - amount, adjust=True).mean() if amount > 0 else present
        return out.reindex(values.index)
    if method == "rolling":
        present = values.dropna()
        return present.rolling(max(int(amount), 1), min_periods=1).mean().reindex(values.index)
    raise ValueError(f"smoothing: unknown method {method!r}; use one of {SMOOTHING_METHODS}")


def with_x_axes(steps: pd.DataFrame, created_at, tokens: pd.DataFrame | None) -> pd.DataFrame:
    """The steps frame plus the other x axes: `wall_time` (hours from the run's creation to the step's commit) and
    `tokens` (generated tokens up to and including the step)."""
    frame = steps.copy()
    if "logged_at" in frame and frame["logged_at"].notna().any() and created_at is not None and not pd.isna(created_at):
        frame["wall_time"] = (pd.to_datetime(frame["logged_at"]) - pd.Timestamp(created_at)).dt.total_seconds() / 3600
    else:
        frame["wall_time"] = np.nan
    if tokens is not None and not tokens.empty:
        frame["tokens"] = frame["step"].map(tokens.set_index("step")["n_tokens"].cumsum()).astype(float)
    else:
        frame["tokens"] = np.nan
    return frame


CHART_PX = 470  # the width of a chart in one of two columns at 1400 px with the sidebar open (rows: a safe count)


def _legend_rows(fig: go.Figure, width_px: int = CHART_PX) -> int:
    """Rows the horizontal legend takes at `width_px` (entries of ~40 px plus ~7 px a character, as plotly lays them
    out: one width for all, that of the longest)."""
    names = [t.name or "" for t in fig.data if t.showlegend is not False]
    if not names or (len(fig.data) == 1 and fig.data[0].showlegend is None):  # plotly shows no legend for one trace
        return 0
    per_row = max(1, width_px // (40 + 7 * max(len(name) for name in names)))
    return -(-len(names) // per_row)


def apply_layout(
    fig: go.Figure, title: str, y_title: str | None = None, x: str = "step", log_y: bool = False, **extra
) -> go.Figure:
    """Title, axes and the shared layout; the legend's rows get room of their own below the x axis title, and the
    figure grows by them instead of squashing its plot."""
    rows = _legend_rows(fig) if extra.get("legend", LAYOUT["legend"]).get("orientation", "h") == "h" else 0
    extra.setdefault("height", LAYOUT["height"] + LEGEND_ROW_PX * max(0, rows - 1))
    margin = {**LAYOUT["margin"], "b": AXIS_TITLE_PX + LEGEND_ROW_PX * rows}
    title, _, subtitle = title.partition("<br>")  # a second line: plotly's subtitle (a <br> title was cut at the top)
    subtitle = subtitle.removeprefix("<sup>").removesuffix("</sup>")
    if subtitle:
        margin["t"] = 70
    extra["margin"] = {**margin, **extra.get("margin", {})}
    fig.update_layout(
        title=dict(
            text=title, x=0, y=0.98, yanchor="top", font=dict(size=15), subtitle=dict(text=subtitle, font=dict(size=11))
        ),
        **{**LAYOUT, **extra},
    )
    fig.update_xaxes(title_text=X_AXES.get(x, x), **AXES)
    fig.update_yaxes(**AXES)
    if y_title:
        fig.update_yaxes(title_text=y_title)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def lines(
    frames: dict[str, pd.DataFrame],
    metrics: list[str],
    colors: dict[str, str],
    title: str,
    smoothing: tuple[str, float] = ("none", 0.0),
    y_title: str | None = None,
    x: str = "step",
    log_y: bool = False,
    banded: tuple[str, ...] | None = None,
) -> go.Figure:
    """One line per (run, metric) over `x` (a column of each frame: a key of X_AXES): color = run, dash =
    metric; with smoothing, the raw values stay as a faint line under the smoothed one."""
    fig = go.Figure()
    # many runs x metrics: one legend entry per run (it shows and hides all of the run's lines), dashes in the title
    per_run = len(metrics) > 1 and len(frames) * len(metrics) > MAX_LEGEND_ENTRIES
    for run_id, steps in frames.items():
        shown_in_legend = False
        for i, metric in enumerate(metrics):
            if metric not in steps or steps[metric].isna().all():
                continue
            name = run_id if len(metrics) == 1 else f"{run_id} · {html.escape(metric)}"  # (a component's name)
            group = run_id if per_run else name
            smoothed = smooth(steps[metric], *smoothing)
            if (
                metric + BAND_LOW in steps
                and steps[metric + BAND_LOW].notna().any()  # a group's band
                and (banded is None or metric in banded)
            ):
                _band(
                    fig,
                    steps[x],
                    smooth(steps[metric + BAND_LOW], *smoothing),
                    smooth(steps[metric + BAND_HIGH], *smoothing),
                    colors[run_id],
                    name,
                    group,
                )
            if smoothing[0] != "none":
                _raw_line(fig, steps[x], steps[metric], colors[run_id], DASHES[i % len(DASHES)], name, group)
            fig.add_trace(
                go.Scatter(
                    x=steps[x],
                    y=smoothed,
                    mode="lines",
                    name=run_id if per_run else name,
                    legendgroup=group,
                    uid=name,
                    showlegend=not (per_run and shown_in_legend),
                    line=dict(color=colors[run_id], width=2, dash=DASHES[i % len(DASHES)]),
                    customdata=steps["step"],
                    hovertemplate=f"{html.escape(name)}: %{{y:.4g}} (step %{{customdata}})<extra></extra>",
                )
            )
            if metric + BAND_N in steps:  # a group: hover says over how many runs, and the band
                _hover_over_group(fig.data[-1], steps, metric, name)
            shown_in_legend = True
    if per_run:
        title += "<br><sup>" + " · ".join(f"{DASHES[i % len(DASHES)]}: {m}" for i, m in enumerate(metrics)) + "</sup>"
    return apply_layout(fig, title, y_title, x, log_y)


def _raw_line(fig: go.Figure, xs: pd.Series, values: pd.Series, color: str, dash: str, name: str, group: str) -> None:
    """The unsmoothed values, a faint line under the smoothed one."""
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=values,
            mode="lines",
            name=f"{name} (raw)",
            uid=f"{name} (raw)",
            line=dict(color=color, width=1, dash=dash),
            opacity=0.25,
            showlegend=False,
            hoverinfo="skip",
            legendgroup=group,
        )
    )


def _hover_over_group(trace, steps: pd.DataFrame, metric: str, name: str) -> None:
    """A group's line: its hover says over how many runs, and the band."""
    trace.customdata = np.stack(
        [steps["step"], steps[metric + BAND_N], steps[metric + BAND_LOW], steps[metric + BAND_HIGH]], axis=-1
    )
    trace.hovertemplate = (
        f"{html.escape(name)}: %{{y:.4g}} [%{{customdata[2]:.4g}}, %{{customdata[3]:.4g}}] "
        "(%{customdata[1]} runs, step %{customdata[0]})<extra></extra>"
    )


def _band(fig: go.Figure, xs: pd.Series, low: pd.Series, high: pd.Series, color: str, name: str, group: str) -> None:
    """A filled band from `low` to `high` over `xs` (NaN: no band there), in `color`, shown and hidden with its line."""
    keep = low.notna() & high.notna()
    xs, low, high = xs[keep], low[keep], high[keep]
    fig.add_trace(
        go.Scatter(
            x=pd.concat([xs, xs[::-1]]),
            y=pd.concat([high, low[::-1]]),
            fill="toself",
            fillcolor=_rgba(color, 0.2),
            line=dict(width=0),
            mode="lines",
            name=f"{name} · band",
            uid=f"{name} · band",
            legendgroup=group,
            showlegend=False,
            hoverinfo="skip",
        )
    )


def entropy(
    frames: dict[str, pd.DataFrame],
    colors: dict[str, str],
    bands: dict[str, tuple],
    warnings: dict[str, pd.DataFrame],
    smoothing: tuple[str, float] = ("none", 0.0),
    x: str = "step",
    log_y: bool = False,
) -> go.Figure:
    """Token entropy per run, the warning band [entropy_low, entropy_high] of each run's config (when it is given in
    nats) and the recorded warnings as markers (hover for the message)."""
    fig = lines(frames, ["entropy"], colors, "entropy", smoothing, y_title="nats / token", x=x, log_y=log_y)
    ymax = max([float(s["entropy"].max()) for s in frames.values() if s["entropy"].notna().any()] or [1.0])
    above = []
    runs_of: dict[tuple, list[str]] = {}  # each distinct band -> the runs that have it
    for run_id, (low, high) in bands.items():
        runs_of.setdefault((as_float(low), as_float(high)), []).append(run_id)
    for (low, high), run_ids in sorted(runs_of.items(), key=lambda item: str(item[0])):
        # several bands: each line in its run's color and labelled with the runs it is theirs (one color where
        # several runs share it); a single band is every run's
        whose = f" · {', '.join(run_ids)}" if len(runs_of) > 1 else ""
        color = colors.get(run_ids[0]) if len(runs_of) > 1 and len(run_ids) == 1 else None
        if low is not None:
            fig.add_hline(
                y=low,
                line=dict(color=color or "#d62728", dash="dot", width=1),
                annotation_text=f"entropy_low {number(low)}{whose}",
                annotation_position="bottom right",
            )
        if high is not None and high <= 1.5 * ymax:
            fig.add_hline(
                y=high,
                line=dict(color=color or "#ff7f0e", dash="dot", width=1),
                annotation_text=f"entropy_high {number(high)}{whose}",
                annotation_position="top right",
            )
        elif high is not None:  # a line far above would squash the curve (autorange includes lines): say it
            above.append((high, f"{number(high)}{whose}"))
    if above:  # one note for every run's line above the plot (several notes at one place overprinted)
        fig.add_annotation(
            text=f"entropy_high {'; '.join(text for _, text in sorted(above))} (above)",
            xref="paper",
            yref="paper",
            x=1,
            y=1,
            xanchor="right",
            yanchor="bottom",
            showarrow=False,
            font=dict(color="#ff7f0e"),
        )
    if not log_y:
        fig.update_yaxes(rangemode="tozero")
    # the entropy alerts, and the warnings that belong to no chart of their own (auto_k, dynamic sampling's cap, ...)
    own = {
        run_id: frame[frame["kind"].map(ALERT_CHARTS).fillna("entropy") == "entropy"]
        for run_id, frame in warnings.items()
    }
    return mark_warnings(fig, frames, colors, own, ["entropy"], x)


def mark_warnings(
    fig: go.Figure,
    frames: dict[str, pd.DataFrame],
    colors: dict[str, str],
    warnings: dict[str, pd.DataFrame],
    metrics: list[str],
    x: str = "step",
    chart: str | None = None,
) -> go.Figure:
    """The runs' recorded warnings (step, kind, message) as markers on `fig`, at the highest of `metrics` at their
    step (hover for the message). `chart`: only the alerts drawn on it (core.alert_levels.ALERT_CHARTS), else every
    warning given."""
    for run_id, frame in warnings.items():
        if chart is not None:
            frame = frame[frame["kind"].map(ALERT_CHARTS) == chart]
        if frame.empty or run_id not in frames:
            continue
        by_step = frames[run_id].set_index("step")
        shown = [m for m in metrics if m in by_step]
        ys = [by_step.loc[step, shown].max() if step in by_step.index and shown else np.nan for step in frame["step"]]
        xs = [by_step[x].get(step, np.nan) if x != "step" else step for step in frame["step"]]
        name = f"{run_id} · warnings"
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="markers",
                name=f"{name} ({len(frame)})",
                uid=name,
                marker=dict(symbol="triangle-down", size=12, color=colors[run_id], line=dict(color=INK, width=1)),
                text=[
                    html.escape(f"{kind}: {message}")
                    for kind, message in zip(frame["kind"], frame["message"], strict=True)
                ],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    return fig


def accuracy(
    frames: dict[str, pd.DataFrame],
    colors: dict[str, str],
    heldout: dict[str, pd.DataFrame],
    smoothing: tuple[str, float] = ("none", 0.0),
    x: str = "step",
    log_y: bool = False,
) -> go.Figure:
    """accuracy (solid) and reward_mean (dash) per run; held-out accuracy (`heldout`: step, value per run, from the
    evals table, so the step-0 evaluation before training is included) as diamonds."""
    # grouped runs: a band for accuracy only (reward_mean's, the same for 0/1 rewards, doubled the shading)
    fig = lines(
        frames,
        ["accuracy", "reward_mean"],
        colors,
        "accuracy and reward",
        smoothing,
        y_title="fraction correct / mean reward",
        x=x,
        log_y=log_y,
        banded=("accuracy",),
    )
    if len(frames) * 3 > MAX_LEGEND_ENTRIES:
        fig.update_layout(title_subtitle_text="solid: accuracy · dash: reward_mean · ◆: held-out", margin_t=70)
    for run_id, held in heldout.items():
        if held.empty:
            continue
        steps = frames[run_id]
        xs = (
            held["step"]
            if x == "step"
            else held["step"].map(pd.concat([pd.Series({0: 0.0}), steps.set_index("step")[x]]))
        )  # step 0 is the start of every axis
        name = f"{run_id} · heldout_accuracy"
        per_run = len(frames) * 3 > MAX_LEGEND_ENTRIES  # the run's legend entry also shows and hides this
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=held["value"],
                mode="lines+markers",
                name=name,
                uid=name,
                legendgroup=run_id if per_run else name,
                showlegend=not per_run,
                line=dict(color=colors[run_id], width=1, dash="dot"),
                customdata=held["step"],
                hovertemplate=f"{html.escape(name)}: %{{y:.4g}} (step %{{customdata}})<extra></extra>",
                marker=dict(symbol="diamond", size=10, color=colors[run_id], line=dict(color=INK, width=1)),
            )
        )
    if not log_y:
        fig.update_yaxes(range=[0, 1.05])
    return fig


# step metrics whose name says no unit -> the y-axis title of their own chart (the rest: by name, in metric_unit)
UNITS = {
    "reward_mean": "reward",
    "gen_batches": "generation batches",
    "cov_logp_adv": "nats x advantage",
    "adv_abs_mean": "|advantage|",
    "k": "quantile level",
    "loss": "advantage x ratio",
    "pg_loss": "advantage x ratio",
    "kl": "nats / token",
    "grad_norm": "L2 norm",
    "lr": "learning rate",
    "n_updates": "optimizer updates",
    "mismatch_capped": "tokens",
}


def metric_unit(metric: str) -> str:
    """The y-axis title of a step metric's own chart: its unit (UNITS, or where the name says it), else the metric
    itself (a column no step metric names)."""
    if metric in UNITS:
        return UNITS[metric]
    if metric.endswith("_s"):
        return "seconds"
    if metric.startswith(("entropy", "dH", "mismatch_logp", "mismatch_k3")):
        return "nats / token"
    if metric.startswith("frac_") or "_frac" in metric or metric in ("accuracy", "heldout_accuracy"):
        return "fraction"
    if metric in ("response_len", "tokens"):
        return "tokens"
    if "ratio" in metric:
        return "ratio"
    return metric


def stacked(
    frames: dict[str, pd.DataFrame],
    metrics: dict[str, str],
    metric_colors: dict[str, str],
    title: str,
    smoothing: tuple[str, float] = ("none", 0.0),
    y_title: str | None = None,
    y_max: float | None = None,
    x: str = "step",
) -> go.Figure:
    """Stacked areas of `metrics` (column -> label) over `x`, one panel per run (stacks can't be overlaid), at most
    PANELS_PER_ROW panels a row. Smoothing is linear, so smoothed fractions still sum to 1."""
    run_ids = list(frames) or [""]
    cols = min(len(run_ids), PANELS_PER_ROW)
    rows = math.ceil(len(run_ids) / cols)
    titles = [html.escape(r if len(r) <= 36 else r[:17] + "…" + r[-18:]) for r in run_ids]
    fig = make_subplots(
        rows=rows,
        cols=cols,
        shared_yaxes=True,
        subplot_titles=titles,
        horizontal_spacing=0.04,
        vertical_spacing=0.12 / rows + 0.06,
    )
    for i, run_id in enumerate(frames):
        row, col = divmod(i, cols)
        steps = frames[run_id]
        for metric, label in metrics.items():
            if metric not in steps or steps[metric].isna().all():
                continue
            fig.add_trace(
                go.Scatter(
                    x=steps[x],
                    y=smooth(steps[metric].fillna(0), *smoothing),
                    mode="lines",
                    name=label,
                    uid=f"{run_id} · {label}",
                    stackgroup=f"run{i}",
                    legendgroup=label,
                    showlegend=i == 0,
                    line=dict(width=0.5, color=metric_colors[metric]),
                    hovertemplate=f"{html.escape(run_id)} · {label}: %{{y:.3g}}<extra></extra>",
                ),
                row=row + 1,
                col=col + 1,
            )
    apply_layout(
        fig,
        title,
        x=x,
        height=120 + 280 * rows,
        legend=dict(orientation="v", yanchor="top", y=1, xanchor="left", x=1.02),
    )
    fig.update_annotations(font=dict(size=12))
    fig.update_xaxes(title_text=None, nticks=4)
    fig.update_xaxes(title_text=X_AXES.get(x, x), row=rows)
    fig.update_yaxes(title_text=y_title, col=1)
    if y_max is not None:
        fig.update_yaxes(range=[0, y_max])
    return fig


def regimes(
    frames: dict[str, pd.DataFrame], smoothing: tuple[str, float] = ("none", 0.0), x: str = "step"
) -> go.Figure:
    colors = {metric: REGIME_COLORS[regime] for metric, regime in REGIME_METRICS.items()}
    return stacked(
        frames, REGIME_METRICS, colors, "regime fractions (of groups)", smoothing, "fraction of groups", y_max=1.0, x=x
    )


def step_time(
    frames: dict[str, pd.DataFrame], smoothing: tuple[str, float] = ("none", 0.0), x: str = "step"
) -> go.Figure:
    return stacked(
        frames, {metric: metric for metric in TIME_METRICS}, TIME_COLORS, "step time", smoothing, "seconds", x=x
    )


def evals(frames: dict[str, pd.DataFrame], colors: dict[str, str], title: str) -> go.Figure:
    """avg@k / pass@k / maj@k over steps, one panel per metric; color = run, dash = k. With one sample a problem
    (every k is 1) the three are one number: one panel (evals_at_1)."""
    metrics = ["avg@k", "pass@k", "maj@k"]
    ks = sorted({int(k) for frame in frames.values() for k in frame["k"]})
    if ks == [1]:
        return evals_at_1(frames, colors, title)
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=metrics, horizontal_spacing=0.03)
    for run_id, frame in frames.items():
        for col, metric in enumerate(metrics, start=1):
            for i, k in enumerate(ks):
                part = frame[(frame["metric"] == metric) & (frame["k"] == k)].sort_values("step")
                if part.empty:
                    continue
                name = f"{run_id} · k={k}"
                fig.add_trace(
                    go.Scatter(
                        x=part["step"],
                        y=part["value"],
                        mode="lines+markers",
                        name=name,
                        uid=f"{name} · {metric}",
                        legendgroup=name,
                        showlegend=col == 1,
                        line=dict(color=colors[run_id], dash=DASHES[i % len(DASHES)]),
                        customdata=part["n_problems"],
                        hovertemplate=f"{metric.replace('k', str(k))} %{{y:.3f}} "
                        "(%{customdata} problems)<extra>" + run_id + "</extra>",
                    ),
                    row=1,
                    col=col,
                )
    apply_layout(fig, title)
    fig.update_yaxes(range=[0, 1.05])
    fig.update_yaxes(title_text=EVAL_Y_TITLE, col=1)
    return fig


EVAL_Y_TITLE = "fraction correct"


def evals_at_1(frames: dict[str, pd.DataFrame], colors: dict[str, str], title: str) -> go.Figure:
    """Evaluations of one sample a problem: avg@1 = pass@1 (the one sample correct), and maj@1 the same unless a
    sample was judged correct without an extracted answer (no answer never wins a vote): one panel, a line per run,
    maj@1 a dashed line of its own only where it differs."""
    fig = go.Figure()
    for run_id, frame in frames.items():
        wide = frame.pivot_table(index="step", columns="metric", values="value", aggfunc="mean", dropna=False)
        wide = wide.reindex(columns=["avg@k", "maj@k"])
        problems = frame.groupby("step")["n_problems"].max().reindex(wide.index)
        name = f"{run_id} · k=1"
        fig.add_trace(
            go.Scatter(
                x=wide.index,
                y=wide["avg@k"],
                mode="lines+markers",
                name=name,
                uid=name,
                line=dict(color=colors[run_id]),
                customdata=problems,
                hovertemplate="avg@1 = pass@1 %{y:.3f} (%{customdata} problems)<extra>"
                + html.escape(run_id)
                + "</extra>",
            )
        )
        if ((wide["maj@k"] - wide["avg@k"]).abs() > 1e-9).any():
            name = f"{run_id} · maj@1"
            fig.add_trace(
                go.Scatter(
                    x=wide.index,
                    y=wide["maj@k"],
                    mode="lines+markers",
                    name=name,
                    uid=name,
                    line=dict(color=colors[run_id], dash="dash"),
                    customdata=problems,
                    hovertemplate="maj@1 %{y:.3f} (%{customdata} problems)<extra>" + html.escape(run_id) + "</extra>",
                )
            )
    apply_layout(
        fig,
        f"{title} · k = 1: avg@1 = pass@1 = maj@1<br><sup>one sample a problem, so the three are one "
        "number (maj@1 drawn apart where it differs)</sup>",
        EVAL_Y_TITLE,
        hovermode="closest",
    )
    fig.update_yaxes(range=[0, 1.05])
    return fig


def prompt_history(history: pd.DataFrame, k: float | None) -> go.Figure:
    """Success rate of one prompt at each step it was sampled, colored by regime; above 1 - K QAE calls it easy."""
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=history["step"],
            y=history["success_rate"],
            mode="lines",
            showlegend=False,
            line=dict(color=AXIS_LINE),
            hoverinfo="skip",
        )
    )
    for regime in REGIMES:
        part = history[history["regime"] == regime]
        if part.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=part["step"],
                y=part["success_rate"],
                mode="markers",
                name=regime,
                marker=dict(size=11, color=REGIME_COLORS[regime]),
                customdata=np.stack([part["n_correct"], part["group_size"]], axis=-1),
                hovertemplate="%{customdata[0]}/%{customdata[1]} correct<extra>" + regime + "</extra>",
            )
        )
    if k is not None and not pd.isna(k):
        fig.add_hline(y=1 - k, line=dict(dash="dot", color=INK), annotation_text=f"1 - K = {1 - k:g}")
    apply_layout(fig, "success rate of this prompt", "n_correct / group_size")
    fig.update_yaxes(range=[-0.05, 1.05])
    return fig


def prompt_heatmap(histories: pd.DataFrame, prompt_ids: list[str]) -> go.Figure:
    """Success rate (color) of the given prompts (rows) at each step they were sampled; one column per step of the
    whole range, so a cell never stretches over steps where the prompt was not sampled (those stay blank)."""
    grid = histories.pivot_table(index="prompt_id", columns="step", values="success_rate", aggfunc="mean")
    grid = grid.reindex([p for p in prompt_ids if p in grid.index])
    if len(grid.columns):
        grid = grid.reindex(columns=range(int(grid.columns.min()), int(grid.columns.max()) + 1))
    labels = [html.escape(p if len(p) <= 40 else p[:39] + "…") for p in grid.index]
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=list(grid.columns),
            y=labels,
            zmin=0,
            zmax=1,
            colorscale="RdYlGn",
            colorbar=dict(title="success"),
            hoverongaps=False,
            hovertemplate="step %{x}<br>%{y}<br>success %{z:.2f}<extra></extra>",
        )
    )
    apply_layout(
        fig,
        "success rate of the most-sampled prompts (blank: not sampled at that step)",
        height=max(300, 22 * len(labels) + 120),
        hovermode="closest",
    )
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def regime_mix(counts: pd.DataFrame) -> go.Figure:
    """Groups per regime at each step (stacked bars)."""
    fig = go.Figure()
    for regime in REGIMES:
        part = counts[counts["regime"] == regime]
        if part.empty:
            continue
        fig.add_trace(go.Bar(x=part["step"], y=part["n_groups"], name=regime, marker_color=REGIME_COLORS[regime]))
    apply_layout(fig, "regime mix per step", "groups", barmode="stack", bargap=0.05)
    return fig


def gate_breakdown(breakdown: pd.DataFrame, totals: pd.DataFrame, step: int | None = None) -> go.Figure:
    """Fraction of each step's trained responses gated, split by why (stacked bars; groups filtered out by dynamic
    sampling are not trained, so neither counted nor in the denominator, as in frac_zero_adv); the shown step is
    marked."""
    fig = go.Figure()
    n = breakdown.merge(totals[["step", "n_trained"]], on="step")
    for reason in GATE_REASONS:
        part = n[n["gate_reason"] == reason]
        if part.empty:
            continue
        fig.add_trace(
            go.Bar(
                x=part["step"],
                y=part["n"] / part["n_trained"],
                name=reason.replace("_", " "),
                uid=reason,
                marker_color=GATE_COLORS[reason],
                customdata=part["n"],
                hovertemplate="%{y:.1%} (%{customdata} responses)<extra>" + reason + "</extra>",
            )
        )
    if step is not None:
        fig.add_vline(x=step, line=dict(color=INK, dash="dot", width=1))
    apply_layout(
        fig,
        "why responses were gated, per step",
        "fraction of the step's trained responses",
        barmode="stack",
        bargap=0.05,
    )
    fig.update_yaxes(range=[0, 1])
    return fig


def quantile_bands(
    frames: dict[str, pd.DataFrame],
    colors: dict[str, str],
    title: str,
    y_title: str,
    step: int | None = None,
    log_y: bool = False,
) -> go.Figure:
    """Per run, over steps: the median (line), the 25-75% band (darker) and the 5-95% band (lighter) of a quantity
    over each step's responses (frames from reader.read_quantiles); the step shown in the histogram is marked."""
    fig = go.Figure()
    for run_id, q in frames.items():
        color = colors[run_id]
        for low, high, opacity in (("q0.05", "q0.95", 0.15), ("q0.25", "q0.75", 0.3)):
            band = f"{run_id} · {float(low[1:]):.0%}-{float(high[1:]):.0%}".replace("%-", "-")
            fig.add_trace(
                go.Scatter(
                    x=q["step"],
                    y=q[high],
                    mode="lines",
                    line=dict(width=0, color=color),
                    showlegend=False,
                    hoverinfo="skip",
                    legendgroup=band,
                    uid=f"{band} high",
                )
            )
            fig.add_trace(
                go.Scatter(
                    x=q["step"],
                    y=q[low],
                    mode="lines",
                    line=dict(width=0, color=color),
                    fill="tonexty",
                    fillcolor=_rgba(color, opacity),
                    name=f"{band} quantiles",
                    legendgroup=band,
                    uid=band,
                    hoverinfo="skip",
                )
            )
        name = f"{run_id} · median"
        fig.add_trace(
            go.Scatter(
                x=q["step"],
                y=q["q0.5"],
                mode="lines",
                name=name,
                uid=name,
                line=dict(color=color, width=2),
                customdata=np.stack([q["q0.05"], q["q0.25"], q["q0.75"], q["q0.95"], q["mean"]], axis=-1),
                hovertemplate="median %{y:.4g} · 25-75%: %{customdata[1]:.4g} to "
                "%{customdata[2]:.4g} · 5-95%: %{customdata[0]:.4g} to "
                "%{customdata[3]:.4g} · mean %{customdata[4]:.4g}<extra>" + html.escape(run_id) + "</extra>",
            )
        )
    if step is not None:
        fig.add_vline(x=step, line=dict(color=INK, dash="dot", width=1))
    return apply_layout(fig, title, y_title, log_y=log_y)


def histogram(values: dict[str, pd.Series], colors: dict[str, str], title: str, x_title: str) -> go.Figure:
    """Histogram of a quantity over one step's responses, one overlaid histogram per run."""
    fig = go.Figure()
    for run_id, series in values.items():
        fig.add_trace(
            go.Histogram(
                x=series.dropna(),
                name=run_id,
                uid=run_id,
                marker_color=colors[run_id],
                opacity=0.6 if len(values) > 1 else 0.9,
                hovertemplate="%{x}: %{y} responses<extra>" + html.escape(run_id) + "</extra>",
            )
        )
    apply_layout(fig, title, "responses", barmode="overlay", hovermode="closest")
    fig.update_xaxes(title_text=x_title)
    return fig


def eval_problem_grid(grid: pd.DataFrame, title: str) -> go.Figure:
    """Fraction of samples correct (color) of each problem (rows) at each evaluated step (columns)."""
    table = grid.assign(rate=grid["n_correct"] / grid["n_samples"]).pivot_table(
        index="problem_id", columns="step", values="rate", aggfunc="mean"
    )
    counts = grid.pivot_table(index="problem_id", columns="step", values="n_correct", aggfunc="sum")
    labels = [html.escape(p if len(p) <= 40 else p[:39] + "…") for p in table.index]
    fig = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=[str(s) for s in table.columns],
            y=labels,
            zmin=0,
            zmax=1,
            colorscale="RdYlGn",
            colorbar=dict(title="correct"),
            hoverongaps=False,
            customdata=counts.reindex_like(table).to_numpy(),
            hovertemplate="step %{x}<br>%{y}<br>%{z:.0%} correct (%{customdata})<extra></extra>",
        )
    )
    apply_layout(fig, title, height=max(300, min(14 * len(labels), 1400) + 140), hovermode="closest")
    fig.update_xaxes(type="category", title_text="evaluated at step")
    fig.update_yaxes(autorange="reversed", type="category", showticklabels=len(labels) <= 80)
    return fig


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


# ---------------------------------------------------------------------------------------------------------------
# across seeds (Compare page)


def resolve_band(band: str, n_seeds: int) -> tuple[str, str | None]:
    """The band drawn for `band` (a key of SEED_BANDS) when the largest group has `n_seeds` runs, and why, when
    "auto" chose the seeds' range: the t-interval of 2 or 3 seeds is too wide to read."""
    if band not in SEED_BANDS:
        raise ValueError(f"band: unknown {band!r}; use one of {', '.join(SEED_BANDS)}")
    if band != "auto":
        return band, None
    if n_seeds >= AUTO_T_FROM or n_seeds < 2:
        return "t-interval", None
    t = student_t_ppf(0.5 + CONFIDENCE / 2, n_seeds - 1)
    return "min-max", (
        f"band: lowest to highest seed, as no group has more than {n_seeds} seeds: their 95% "
        f"t-interval is the mean ± {t:.2f} standard errors (t at {n_seeds - 1} degree(s) of freedom), "
        f"far wider than the seeds' spread; pick t-interval to draw it anyway"
    )


def across_seeds(
    curves: list[pd.DataFrame], band: str = "t-interval", bounds: tuple[float | None, float | None] = (None, None)
) -> pd.DataFrame:
    """One group's curve: per step, over the runs (frames of step, value) that have a value at that step, `n`, the
    `mean` and the band [`low`, `high`]: the mean's 95% Student-t interval (the interval `qae compare` gives a metric:
    run_comparison.mean_interval of those values) or the lowest and highest value. No band (NaN) where fewer than two
    runs have the step: one seed says nothing about the spread. `bounds` (lower, upper; None: none) are the values the
    metric can take: the band is cut there (with 3 seeds a fraction's t-interval easily reaches below 0)."""
    if band not in SEED_BANDS or band == "auto":  # (auto is resolved per page: one band for every group)
        raise ValueError(f"band: unknown {band!r}; use one of t-interval, min-max")
    parts = [curve[["step", "value"]].dropna() for curve in curves]
    values = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"step": [], "value": []})
    out = values.groupby("step")["value"].agg(n="count", mean="mean", sd="std", low="min", high="max").reset_index()
    if band == "t-interval":
        # the t quantile depends on n alone: one bisection per distinct n, not one per step
        quantile = {n: student_t_ppf(0.5 + CONFIDENCE / 2, n - 1) for n in set(out["n"]) if n >= 2}
        half = out["n"].map(quantile) * out["sd"] / np.sqrt(out["n"])
        out["low"], out["high"] = out["mean"] - half, out["mean"] + half
    lower, upper = bounds
    out["low"], out["high"] = out["low"].clip(lower, upper), out["high"].clip(lower, upper)
    few = out["n"] < 2
    out.loc[few, ["low", "high"]] = np.nan
    return out[["step", "n", "mean", "low", "high"]].astype({"step": int, "n": int})


def seed_bands(
    groups: dict[str, pd.DataFrame],
    colors: dict[str, str],
    title: str,
    y_title: str | None = None,
    band: str = "t-interval",
) -> go.Figure:
    """Per group (frames from `across_seeds`): the mean over seeds as a line and the band (named in the title) as a
    filled area in the group's color; hover gives the band and how many seeds have the step."""
    fig = go.Figure()
    for label, curve in groups.items():
        if curve.empty:
            continue
        color, name = colors[label], html.escape(label)
        banded = curve.dropna(subset=["low", "high"])
        if not banded.empty:  # the band's outline: along the upper edge, then back along the lower one
            fig.add_trace(
                go.Scatter(
                    x=pd.concat([banded["step"], banded["step"][::-1]]),
                    y=pd.concat([banded["high"], banded["low"][::-1]]),
                    fill="toself",
                    fillcolor=_rgba(color, 0.2),
                    line=dict(width=0),
                    mode="lines",
                    name=f"{name} · band",
                    uid=f"{label} · band",
                    legendgroup=label,
                    showlegend=False,
                    hoverinfo="skip",
                )
            )
        fig.add_trace(
            go.Scatter(
                x=curve["step"],
                y=curve["mean"],
                mode="lines+markers" if len(curve) <= 30 else "lines",
                name=name,
                uid=label,
                legendgroup=label,
                line=dict(color=color, width=2),
                marker=dict(size=6, color=color),
                customdata=np.stack([curve["n"], curve["low"], curve["high"]], axis=-1),
                hovertemplate=f"{name}: %{{y:.4g}} [%{{customdata[1]:.4g}}, %{{customdata[2]:.4g}}] "
                "(%{customdata[0]} seeds, step %{x})<extra></extra>",
            )
        )
    return apply_layout(fig, f"{title} · band: {band}", y_title)


# ---------------------------------------------------------------------------------------------------------------
# a preview (`qae preview`): its groups by success rate, and what QAE at each K would gate against GRPO

PREVIEW_MIDDLE = "#1f77b4"  # groups with signal (the two ends, no signal, take the all-wrong / all-correct colors)


def preview_success(groups: pd.DataFrame, group_size: int, signal: dict[int, bool] | None = None) -> go.Figure:
    """A preview's groups by their number of correct responses, 0..G (stacked bars): those with signal (their
    rewards differ, as the verdict counts them: `signal`, group_idx -> bool) and those without. With shaped or
    weighted rewards a group the verifier calls all wrong (0) or all correct (G) may have signal."""
    xs = list(range(group_size + 1))
    signal = signal or {}
    has = groups["group_idx"].map(lambda g: signal.get(int(g), False))
    with_signal = groups.loc[has, "n_correct"].value_counts()
    without = groups.loc[~has, "n_correct"].value_counts()
    colors = [
        REGIME_COLORS["all_wrong"]
        if c == 0
        else REGIME_COLORS["all_correct"]
        if c == group_size
        else REGIME_COLORS["mixed"]
        for c in xs
    ]
    fig = go.Figure(
        [
            go.Bar(
                x=xs,
                y=[int(without.get(c, 0)) for c in xs],
                marker_color=colors,
                name="no signal (equal rewards)",
                uid="no_signal",
                hovertemplate="%{x} of " + str(group_size) + " correct: %{y} groups without signal<extra></extra>",
            ),
            go.Bar(
                x=xs,
                y=[int(with_signal.get(c, 0)) for c in xs],
                marker_color=PREVIEW_MIDDLE,
                name="with signal",
                uid="with_signal",
                hovertemplate="%{x} of " + str(group_size) + " correct: %{y} groups with signal<extra></extra>",
            ),
        ]
    )
    apply_layout(fig, f"groups by success rate (correct of G={group_size})", "groups", bargap=0.1)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="correct responses in the group", dtick=1)
    return fig


def preview_gating(by_k: pd.DataFrame) -> go.Figure:
    """The share of responses QAE gates (advantage exactly 0) at each K, the suggested K marked, against GRPO's
    (one value: a mean baseline reads no K); by_k: the preview_k rows."""
    qae = by_k[by_k["estimator"] == "qae"].sort_values("k")
    fig = go.Figure(
        go.Scatter(
            x=qae["k"],
            y=qae["frac_zero_adv"],
            mode="lines+markers",
            name="QAE",
            uid="qae",
            line=dict(color=PREVIEW_MIDDLE, width=2),
            hovertemplate="K=%{x}: %{y:.1%} gated<extra>QAE</extra>",
        )
    )
    grpo = by_k.loc[by_k["estimator"] == "grpo", "frac_zero_adv"]
    if len(grpo):
        fig.add_trace(
            go.Scatter(
                x=[qae["k"].min(), qae["k"].max()],
                y=[grpo.iloc[0]] * 2,
                mode="lines",
                name="GRPO",
                uid="grpo",
                line=dict(color=INK, dash="dash", width=1.5),
                hovertemplate="%{y:.1%} gated<extra>GRPO</extra>",
            )
        )
    suggested = qae[qae["suggested"].astype(bool)]
    if len(suggested):
        fig.add_trace(
            go.Scatter(
                x=suggested["k"],
                y=suggested["frac_zero_adv"],
                mode="markers",
                name="suggested K",
                uid="suggested",
                marker=dict(symbol="star", size=16, color="#d62728"),
                hovertemplate="suggested K=%{x}: %{y:.1%} gated<extra></extra>",
            )
        )
    apply_layout(fig, "responses gated (advantage exactly 0) by K", "fraction of the responses", x="K")
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    return fig


def preview_regimes(by_k: pd.DataFrame) -> go.Figure:
    """Groups per regime under QAE at each K (stacked bars): which groups K makes hard and which easy."""
    qae = by_k[by_k["estimator"] == "qae"].sort_values("k")
    fig = go.Figure()
    for regime in REGIMES:
        if qae[f"n_{regime}"].sum():
            fig.add_trace(
                go.Bar(
                    x=[f"{k:g}" for k in qae["k"]],
                    y=qae[f"n_{regime}"],
                    name=regime,
                    uid=regime,
                    marker_color=REGIME_COLORS[regime],
                )
            )
    apply_layout(fig, "groups by regime under QAE at each K", "groups", x="K", barmode="stack", bargap=0.1)
    fig.update_xaxes(type="category")  # one bar per K shown, side by side
    return fig
