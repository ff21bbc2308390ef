"""Plotly figures of the dashboard: pure functions of DataFrames (no Streamlit), one per kind of chart.

Runs are told apart by color (the same on every chart); metrics of one run by dash. Text from the data set (prompt
ids) is HTML-escaped before it reaches plotly, which would otherwise render tags such as <b> in labels.
"""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from qae_app.names import REGIMES

SMOOTHING_METHODS = ("none", "ema", "rolling")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash")
REGIME_COLORS = {"hard": "#d62728", "easy": "#2ca02c", "all_correct": "#1f77b4", "all_wrong": "#7f7f7f",
                 "mixed": "#9467bd"}
REGIME_METRICS = {f"frac_{regime}": regime for regime in REGIMES}  # steps column -> regime
TIME_METRICS = ("rollout_s", "reward_s", "update_s")
TIME_COLORS = {"rollout_s": "#1f77b4", "reward_s": "#ff7f0e", "update_s": "#2ca02c"}
# legends go under the plot, where plotly makes room for however many rows they take
LAYOUT = dict(margin=dict(l=10, r=10, t=50, b=10), height=400, hovermode="x unified", uirevision="keep",
              legend=dict(orientation="h", yanchor="top", y=-0.28, xanchor="left", x=0, title=None))


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


def _layout(fig: go.Figure, title: str, y_title: str | None = None, **extra) -> go.Figure:
    fig.update_layout(title=dict(text=title, x=0, y=0.98, yanchor="top", font=dict(size=15)), **{**LAYOUT, **extra})
    fig.update_xaxes(title_text="step")
    if y_title:
        fig.update_yaxes(title_text=y_title)
    return fig


def lines(frames: dict[str, pd.DataFrame], metrics: list[str], colors: dict[str, str], title: str,
          smoothing: tuple[str, float] = ("none", 0.0), y_title: str | None = None) -> go.Figure:
    """One line per (run, metric) over steps: color = run, dash = metric; with smoothing, the raw values stay as a
    faint line under the smoothed one."""
    fig = go.Figure()
    for run_id, steps in frames.items():
        for i, metric in enumerate(metrics):
            if metric not in steps or steps[metric].isna().all():
                continue
            name = run_id if len(metrics) == 1 else f"{run_id} · {metric}"
            smoothed = smooth(steps[metric], *smoothing)
            if smoothing[0] != "none":
                fig.add_trace(go.Scatter(x=steps["step"], y=steps[metric], mode="lines", name=f"{name} (raw)",
                                         line=dict(color=colors[run_id], width=1, dash=DASHES[i % len(DASHES)]),
                                         opacity=0.25, showlegend=False, hoverinfo="skip", legendgroup=name))
            fig.add_trace(go.Scatter(x=steps["step"], y=smoothed, mode="lines", name=name, legendgroup=name,
                                     line=dict(color=colors[run_id], width=2, dash=DASHES[i % len(DASHES)]),
                                     hovertemplate=f"{html.escape(name)}: %{{y:.4g}}<extra></extra>"))
    return _layout(fig, title, y_title)


def entropy(frames: dict[str, pd.DataFrame], colors: dict[str, str], bands: dict[str, tuple[float, float]],
            warnings: dict[str, pd.DataFrame], smoothing: tuple[str, float] = ("none", 0.0)) -> go.Figure:
    """Token entropy per run, the warning band [entropy_low, entropy_high] of each run's config and the recorded
    warnings as markers (hover for the message)."""
    fig = lines(frames, ["entropy"], colors, "entropy", smoothing, y_title="nats / token")
    for low, high in sorted(set(bands.values())):
        fig.add_hline(y=low, line=dict(color="#d62728", dash="dot", width=1),
                      annotation_text=f"entropy_low {low:g}", annotation_position="bottom right")
        fig.add_hline(y=high, line=dict(color="#ff7f0e", dash="dot", width=1),
                      annotation_text=f"entropy_high {high:g}", annotation_position="top right")
    ymax = max([float(s["entropy"].max()) for s in frames.values() if s["entropy"].notna().any()] or [1.0])
    lows = [low for low, _ in bands.values()]
    highs = [high for _, high in bands.values() if high <= 1.5 * ymax]  # a far-away upper line would squash the curve
    fig.update_yaxes(range=[0, 1.15 * max([ymax, *lows, *highs])])
    for run_id, frame in warnings.items():
        if frame.empty:
            continue
        steps = frames[run_id].set_index("step")["entropy"]
        ys = [steps.get(step, np.nan) for step in frame["step"]]
        fig.add_trace(go.Scatter(
            x=frame["step"], y=ys, mode="markers", name=f"{run_id} · warnings ({len(frame)})",
            marker=dict(symbol="triangle-down", size=12, color=colors[run_id], line=dict(color="black", width=1)),
            text=[html.escape(f"{kind}: {message}") for kind, message in zip(frame["kind"], frame["message"])],
            hovertemplate="%{text}<extra></extra>"))
    return fig


def accuracy(frames: dict[str, pd.DataFrame], colors: dict[str, str],
             smoothing: tuple[str, float] = ("none", 0.0)) -> go.Figure:
    """accuracy (solid) and reward_mean (dash) per run; heldout_accuracy as diamonds on the steps it was measured."""
    fig = lines(frames, ["accuracy", "reward_mean"], colors, "accuracy and reward", smoothing)
    for run_id, steps in frames.items():
        held = steps.dropna(subset=["heldout_accuracy"]) if "heldout_accuracy" in steps else steps.iloc[:0]
        if held.empty:
            continue
        fig.add_trace(go.Scatter(x=held["step"], y=held["heldout_accuracy"], mode="lines+markers",
                                 name=f"{run_id} · heldout_accuracy",
                                 line=dict(color=colors[run_id], width=1, dash="dot"),
                                 marker=dict(symbol="diamond", size=10, color=colors[run_id],
                                             line=dict(color="black", width=1))))
    fig.update_yaxes(range=[0, 1.05])
    return fig


def stacked(frames: dict[str, pd.DataFrame], metrics: dict[str, str], metric_colors: dict[str, str], title: str,
            smoothing: tuple[str, float] = ("none", 0.0), y_title: str | None = None,
            y_max: float | None = None) -> go.Figure:
    """Stacked areas of `metrics` (column -> label) over steps, one panel per run (stacks can't be overlaid).
    Smoothing is linear, so smoothed fractions still sum to 1."""
    run_ids = list(frames)
    fig = make_subplots(rows=1, cols=max(len(run_ids), 1), shared_yaxes=True, subplot_titles=run_ids or None,
                        horizontal_spacing=0.03)
    for col, run_id in enumerate(run_ids, start=1):
        steps = frames[run_id]
        for metric, label in metrics.items():
            if metric not in steps or steps[metric].isna().all():
                continue
            fig.add_trace(go.Scatter(x=steps["step"], y=smooth(steps[metric].fillna(0), *smoothing), mode="lines",
                                     name=label,
                                     stackgroup=f"run{col}", legendgroup=label, showlegend=col == 1,
                                     line=dict(width=0.5, color=metric_colors[metric]),
                                     hovertemplate=f"{run_id} · {label}: %{{y:.3g}}<extra></extra>"),
                          row=1, col=col)
    _layout(fig, title, legend=dict(orientation="v", x=1.01, y=1, yanchor="top", xanchor="left"))
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    if y_max is not None:
        fig.update_yaxes(range=[0, y_max])
    return fig


def regimes(frames: dict[str, pd.DataFrame], smoothing: tuple[str, float] = ("none", 0.0)) -> go.Figure:
    colors = {metric: REGIME_COLORS[regime] for metric, regime in REGIME_METRICS.items()}
    return stacked(frames, REGIME_METRICS, colors, "regime fractions (of groups)", smoothing, "fraction of groups",
                   y_max=1.0)


def step_time(frames: dict[str, pd.DataFrame], smoothing: tuple[str, float] = ("none", 0.0)) -> go.Figure:
    return stacked(frames, {metric: metric for metric in TIME_METRICS}, TIME_COLORS, "step time", smoothing,
                   "seconds")


def evals(frames: dict[str, pd.DataFrame], colors: dict[str, str], title: str) -> go.Figure:
    """avg@k / pass@k / maj@k over steps, one panel per metric; color = run, dash = k."""
    metrics = ["avg@k", "pass@k", "maj@k"]
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=metrics, horizontal_spacing=0.03)
    ks = sorted({int(k) for frame in frames.values() for k in frame["k"]})
    for run_id, frame in frames.items():
        for col, metric in enumerate(metrics, start=1):
            for i, k in enumerate(ks):
                part = frame[(frame["metric"] == metric) & (frame["k"] == k)].sort_values("step")
                if part.empty:
                    continue
                name = f"{run_id} · k={k}"
                fig.add_trace(go.Scatter(x=part["step"], y=part["value"], mode="lines+markers", name=name,
                                         legendgroup=name, showlegend=col == 1,
                                         line=dict(color=colors[run_id], dash=DASHES[i % len(DASHES)]),
                                         customdata=part["n_problems"],
                                         hovertemplate=f"{metric.replace('k', str(k))} %{{y:.3f}} "
                                                       "(%{customdata} problems)<extra>" + run_id + "</extra>"),
                              row=1, col=col)
    _layout(fig, title)
    fig.update_yaxes(range=[0, 1.05])
    return fig


def prompt_history(history: pd.DataFrame, k: float | None) -> go.Figure:
    """Success rate of one prompt at each step it was sampled, colored by regime; above 1 - K QAE calls it easy."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=history["step"], y=history["success_rate"], mode="lines", showlegend=False,
                             line=dict(color="#bbbbbb"), hoverinfo="skip"))
    for regime in REGIMES:
        part = history[history["regime"] == regime]
        if part.empty:
            continue
        fig.add_trace(go.Scatter(x=part["step"], y=part["success_rate"], mode="markers", name=regime,
                                 marker=dict(size=11, color=REGIME_COLORS[regime]),
                                 customdata=np.stack([part["n_correct"], part["group_size"]], axis=-1),
                                 hovertemplate="%{customdata[0]}/%{customdata[1]} correct<extra>" + regime
                                               + "</extra>"))
    if k is not None and not pd.isna(k):
        fig.add_hline(y=1 - k, line=dict(dash="dot", color="#555555"), annotation_text=f"1 - K = {1 - k:g}")
    _layout(fig, "success rate of this prompt", "n_correct / group_size")
    fig.update_yaxes(range=[-0.05, 1.05])
    return fig


def prompt_heatmap(histories: pd.DataFrame, prompt_ids: list[str]) -> go.Figure:
    """Success rate (color) of the given prompts (rows) at each step they were sampled (columns)."""
    grid = histories.pivot_table(index="prompt_id", columns="step", values="success_rate", aggfunc="mean")
    grid = grid.reindex([p for p in prompt_ids if p in grid.index])
    labels = [html.escape(p if len(p) <= 40 else p[:39] + "…") for p in grid.index]
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=grid.columns, y=labels, zmin=0, zmax=1, colorscale="RdYlGn",
                               colorbar=dict(title="success"), hoverongaps=False,
                               hovertemplate="step %{x}<br>%{y}<br>success %{z:.2f}<extra></extra>"))
    _layout(fig, "success rate of the most-sampled prompts", height=max(300, 22 * len(labels) + 120),
            hovermode="closest")
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
    _layout(fig, "regime mix per step", "groups", barmode="stack", bargap=0.05)
    return fig
