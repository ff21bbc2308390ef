"""The entropy-change charts of Training curves (--log-entropy-delta, --log-entropy-attribution): how each regime's
responses' entropy changed under the whole update, and which regime's update changed it. Pure functions of
DataFrames (no Streamlit), as charts.py.

Made to be read at a glance: a color per regime (hard ochre, easy teal, the update with no advantage grey, every
response in ink), so a color names a regime and never a run; a panel per run instead (one scale for all); each
series' mean over the steps as a dotted line; a zero line; and what the sign means written under the title.
"""

from __future__ import annotations

import html

import charts
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# under the title, one line at the width of a chart in one of two columns (charts.CHART_PX); the metrics' definitions
# below the chart say it in full (after minus before)
SIGN = "above 0: the update raised entropy · below 0: lowered it · dotted: mean over steps"
# column -> (color, dash). The color is the regime a series is named after: whose responses (dH_hard, dH_easy), or
# whose update (dH_from_*; in the 2 x 2 matrix a lighter or darker shade of the update's regime, dashed, for the
# other regime's responses). Regimes take charts.REGIME_COLORS, which are none of the run colors.
HARD, EASY = charts.REGIME_COLORS["hard"], charts.REGIME_COLORS["easy"]
SERIES = {
    "dH": (charts.INK, "solid"),
    "dH_hard": (HARD, "solid"),
    "dH_easy": (EASY, "solid"),
    "dH_from_hard": (HARD, "solid"),
    "dH_from_easy": (EASY, "solid"),
    "dH_from_none": (charts.REGIME_COLORS["mixed"], "solid"),
    "dH_hard_from_hard": (HARD, "solid"),
    "dH_easy_from_hard": ("#dfc27d", "dash"),
    "dH_easy_from_easy": (EASY, "solid"),
    "dH_hard_from_easy": ("#35978f", "dash"),
}
PANEL_PX = 230  # each run's panel after the first


def measured(steps: pd.DataFrame, metric: str) -> bool:
    return metric in steps and steps[metric].notna().any()


def chart(
    frames: dict[str, pd.DataFrame],
    metrics: list[str],
    title: str,
    smoothing: tuple[str, float] = ("none", 0.0),
    x: str = "step",
) -> go.Figure:
    """`metrics` (keys of SERIES) over `x`, a panel per run that measured any of them, colored by regime; the
    y axis stays linear (the changes are signed, so a log axis would drop half of them)."""
    measuring = {run_id: steps for run_id, steps in frames.items() if any(measured(steps, m) for m in metrics)}
    run_ids = list(measuring) or [""]
    titles = [html.escape(run_id) for run_id in run_ids] if len(run_ids) > 1 else None
    fig = make_subplots(
        rows=len(run_ids),
        cols=1,
        shared_xaxes=True,
        shared_yaxes="all",
        subplot_titles=titles,
        vertical_spacing=min(0.12, 0.3 / len(run_ids)),
    )
    in_legend: set[str] = set()
    for row, (run_id, steps) in enumerate(measuring.items(), start=1):
        for metric in metrics:
            if measured(steps, metric):
                _series(fig, steps, run_id, metric, row, smoothing, x, show=metric not in in_legend)
                in_legend.add(metric)
    charts.apply_layout(
        fig,
        f"{title}<br><sup>{SIGN}</sup>",
        "nats / token",
        x,
        height=charts.LAYOUT["height"] + PANEL_PX * (len(run_ids) - 1),
    )
    fig.update_xaxes(title_text=None)
    fig.update_xaxes(title_text=charts.X_AXES.get(x, x), row=len(run_ids), col=1)
    fig.update_yaxes(zeroline=True, zerolinecolor=charts.AXIS_LINE, zerolinewidth=2)
    fig.update_annotations(font=dict(size=12))
    return fig


def _series(
    fig: go.Figure,
    steps: pd.DataFrame,
    run_id: str,
    metric: str,
    row: int,
    smoothing: tuple[str, float],
    x: str,
    show: bool,
) -> None:
    """One run's series in its panel: the band of a group's runs (grouped curves), the raw values faint under the
    smoothed line, the line, and the mean over the steps that have the metric as a dotted line across them."""
    color, dash = SERIES[metric]
    uid, at = f"{run_id} · {metric}", dict(row=row, col=1)
    _band(fig, steps, metric, uid, at, smoothing, x, color)
    if smoothing[0] != "none":
        fig.add_trace(
            go.Scatter(
                x=steps[x],
                y=steps[metric],
                mode="lines",
                name=f"{metric} (raw)",
                uid=f"{uid} (raw)",
                line=dict(color=color, width=1, dash=dash),
                opacity=0.25,
                showlegend=False,
                hoverinfo="skip",
                legendgroup=metric,
            ),
            **at,
        )
    fig.add_trace(
        go.Scatter(
            x=steps[x],
            y=charts.smooth(steps[metric], *smoothing),
            mode="lines",
            name=metric,
            uid=uid,
            legendgroup=metric,
            showlegend=show,
            line=dict(color=color, width=2, dash=dash),
            customdata=steps["step"],
            hovertemplate=f"{html.escape(uid)}: %{{y:.4g}} (step %{{customdata}})<extra></extra>",
        ),
        **at,
    )
    _mean_line(fig, steps, metric, uid, at, x, color)


def _band(
    fig: go.Figure,
    steps: pd.DataFrame,
    metric: str,
    uid: str,
    at: dict,
    smoothing: tuple[str, float],
    x: str,
    color: str,
) -> None:
    """The band between the lowest and highest of a group's runs (grouped curves; nothing for one run)."""
    low, high = metric + charts.BAND_LOW, metric + charts.BAND_HIGH
    if measured(steps, low):
        keep = steps[low].notna() & steps[high].notna()
        xs, lows, highs = (
            steps.loc[keep, x],
            charts.smooth(steps[low], *smoothing)[keep],
            charts.smooth(steps[high], *smoothing)[keep],
        )
        fig.add_trace(
            go.Scatter(
                x=pd.concat([xs, xs[::-1]]),
                y=pd.concat([highs, lows[::-1]]),
                fill="toself",
                fillcolor=_rgba(color, 0.2),
                line=dict(width=0),
                mode="lines",
                name=f"{uid} · band",
                uid=f"{uid} · band",
                legendgroup=metric,
                showlegend=False,
                hoverinfo="skip",
            ),
            **at,
        )


def _mean_line(fig: go.Figure, steps: pd.DataFrame, metric: str, uid: str, at: dict, x: str, color: str) -> None:
    """The mean over the steps that have the metric, a dotted line across them."""
    present = steps[metric].notna()
    mean = float(steps.loc[present, metric].mean())
    span = [steps.loc[present, x].min(), steps.loc[present, x].max()]
    fig.add_trace(
        go.Scatter(
            x=span,
            y=[mean, mean],
            mode="lines",
            name=f"{metric} mean",
            uid=f"{uid} · mean",
            legendgroup=metric,
            showlegend=False,
            line=dict(color=color, width=1.5, dash="dot"),
            hovertemplate=f"{html.escape(uid)}: mean over the steps {mean:+.4g}<extra></extra>",
        ),
        **at,
    )


def _rgba(color: str, alpha: float) -> str:
    r, g, b = plotly.colors.hex_to_rgb(color)
    return f"rgba({r},{g},{b},{alpha})"
