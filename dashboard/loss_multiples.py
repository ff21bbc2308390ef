"""The bake-off on the Compare page: the paper's Table 2 layout (analysis/loss_table.py) as tables, and small multiples
of entropy and held-out accuracy per policy loss with both estimators overlaid, each estimator in its method color
(board.METHOD_COLORS, the same on every page). Pure functions of the table and DataFrames (no Streamlit), as charts.py.
"""

from __future__ import annotations

import html

import charts
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from qae_app.analysis.loss_table import LossTable
from qae_app.analysis.run_comparison import RunGroup, shown
from qae_app.core.formatting import number

# the curves of each loss's panels: steps column -> (panel title, the values it can take)
PANELS = {"entropy": ("entropy (nats / token)", (0.0, None)), "heldout_accuracy": ("held-out accuracy", (0.0, 1.0))}
PANEL_PX = 210  # each loss's row of panels after the first


def cell_text(estimate, sign: bool = False) -> str:
    """'0.700 [0.452, 0.948]', '0.700 (n=2: no interval)' or, for a difference, '+0.133 [-0.010, 0.277] p=0.0572':
    `run_comparison.shown` rules it, as everywhere."""
    rule = shown(estimate)
    if rule.mean is None:
        return "-"
    text = ("+" if sign and rule.mean > 0 else "") + number(rule.mean)
    if rule.interval is not None:
        text += f" [{number(rule.interval[0])}, {number(rule.interval[1])}]"
    elif rule.no_interval is not None:
        text += f" ({rule.no_interval})"
    return text + (f" p={rule.p_value:.3g}" if rule.p_value is not None else "")


def metric_frame(table: LossTable, metric: str) -> pd.DataFrame:
    """One metric in the paper's layout: a row per policy loss; the base, + QAE and QAE minus base paired by seed."""
    base = table.base_estimator
    return pd.DataFrame(
        [
            {
                "policy loss": row.policy_loss,
                base: cell_text(row.cells[metric][0]),
                "+ qae": cell_text(row.cells[metric][1]),
                f"qae - {base}": cell_text(row.cells[metric][2], sign=True),
            }
            for row in table.rows
        ]
    )


def seed_curves(group: RunGroup, metric: str, band: str) -> pd.DataFrame:
    """The group's mean over seeds at each step, with its band (charts.across_seeds)."""
    return charts.across_seeds(
        [run.steps.rename(columns={metric: "value"}) for run in group.runs if metric in run.steps],
        band,
        PANELS[metric][1],
    )


def small_multiples(table: LossTable, colors: dict[str, str], band: str) -> go.Figure:
    """A row per policy loss, a column per PANELS metric; in each panel the base and QAE means over seeds with their
    bands, in `colors` (estimator -> color), one legend entry per estimator."""
    fig = make_subplots(
        rows=len(table.rows),
        cols=len(PANELS),
        shared_xaxes=True,
        subplot_titles=[
            f"{html.escape(row.policy_loss)}: {title}" for row in table.rows for title, _ in PANELS.values()
        ],
        vertical_spacing=min(0.12, 0.35 / len(table.rows)),
        horizontal_spacing=0.1,
    )
    for r, row in enumerate(table.rows, start=1):
        for c, metric in enumerate(PANELS, start=1):
            for estimator, group in ((table.base_estimator, row.base), ("qae", row.qae)):
                curve = seed_curves(group, metric, band)
                if curve.empty:
                    continue
                color = colors[estimator]
                _band(fig, curve.dropna(subset=["low", "high"]), color, estimator, r, c)
                fig.add_trace(
                    go.Scatter(
                        x=curve["step"],
                        y=curve["mean"],
                        mode="lines",
                        name=estimator,
                        uid=f"{row.policy_loss} · {metric} · {estimator}",
                        legendgroup=estimator,
                        showlegend=r == 1 and c == 1,
                        line=dict(color=color, width=2),
                        hovertemplate=f"{html.escape(row.policy_loss)} {estimator}: %{{y:.4g}} "
                        "(step %{x})<extra></extra>",
                    ),
                    row=r,
                    col=c,
                )
    charts.apply_layout(
        fig,
        f"entropy and held-out accuracy per policy loss · band: {band}",
        None,
        height=charts.LAYOUT["height"] + PANEL_PX * (len(table.rows) - 1),
    )
    fig.update_xaxes(title_text=None)
    for c in range(1, len(PANELS) + 1):
        fig.update_xaxes(title_text="step", row=len(table.rows), col=c)
    fig.update_annotations(font=dict(size=12))
    return fig


def _band(fig: go.Figure, banded: pd.DataFrame, color: str, estimator: str, row: int, col: int) -> None:
    """The band of one estimator's seeds in one panel (nothing where no step has one)."""
    if not banded.empty:
        fig.add_trace(
            go.Scatter(
                x=pd.concat([banded["step"], banded["step"][::-1]]),
                y=pd.concat([banded["high"], banded["low"][::-1]]),
                fill="toself",
                fillcolor=_rgba(color, 0.15),
                line=dict(width=0),
                mode="lines",
                legendgroup=estimator,
                showlegend=False,
                hoverinfo="skip",
            ),
            row=row,
            col=col,
        )


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = plotly.colors.hex_to_rgb(hex_color)
    return f"rgba({r},{g},{b},{alpha})"
