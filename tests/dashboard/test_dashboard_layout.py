"""The dashboard's third round (issue 27): runs grouped on Training curves, the Runs table's seed and sweep columns
and its height, charts that follow the theme, legends that keep clear of the axis title and regime colors that are
not run colors. AppTest on runs written through the real store; the charts' figures as plotly JSON."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.colors
import pytest

from qae_app.store.reader import read_steps
from qae_app.store.run_folder import db_path
from tests.dashboard.helpers import charts, frames, make_app, plotly_specs, texts
from tests.synthetic import write_run

SWEEP = {"sweep_id": "0123456789", "sweep_name": "grid"}


@pytest.fixture(scope="module")
def grid_dir(tmp_path_factory) -> Path:
    """Five runs of a sweep `grid`: K 0.4 with seeds 0, 1, 2 and K 0.6 with seeds 0, 1 (4 steps each), and six
    runs outside it, so the Runs page has eleven."""
    out = tmp_path_factory.mktemp("grid_runs")
    for k, seeds in ((0.4, (0, 1, 2)), (0.6, (0, 1))):
        for seed in seeds:
            write_run(
                out, f"grid-k{k}-s{seed}", steps=4, prompts_per_step=2, group_size=4, k=k, seed=seed, config=SWEEP
            )
    for i in range(6):
        write_run(out, f"other-{i}", steps=1, prompts_per_step=1, group_size=4, seed=10 + i)
    return out


@pytest.fixture
def grid_app(grid_dir, monkeypatch):
    return make_app(grid_dir, monkeypatch)


def entropy_of(grid_dir: Path, run_id: str) -> pd.Series:
    return read_steps(db_path(grid_dir, run_id)).set_index("step")["entropy"]


GRID_RUNS = ["grid-k0.4-s0", "grid-k0.4-s1", "grid-k0.4-s2", "grid-k0.6-s0", "grid-k0.6-s1"]


def test_grouped_curves_are_the_mean_and_range_of_each_config(grid_app, grid_dir):
    """Grouped by everything but the seed: one line per K, the mean of its runs at each step, and (auto band, at
    most 3 seeds) a band from the lowest to the highest run; the groups are named by what differs."""
    at = grid_app("curves", run=GRID_RUNS, smooth="none", group="true")
    entropy = {trace["uid"]: trace for trace in plotly_specs(at)["entropy"]["data"]}
    assert {"k=0.4", "k=0.6", "k=0.4 · band", "k=0.6 · band"} <= set(entropy)
    runs = pd.DataFrame({run_id: entropy_of(grid_dir, run_id) for run_id in GRID_RUNS})
    k4 = runs[GRID_RUNS[:3]]
    assert list(entropy["k=0.4"]["x"]) == [1, 2, 3, 4]
    assert entropy["k=0.4"]["y"] == pytest.approx(k4.mean(axis=1).tolist())
    assert entropy["k=0.6"]["y"] == pytest.approx(runs[GRID_RUNS[3:]].mean(axis=1).tolist())
    band = entropy["k=0.4 · band"]
    assert band["y"] == pytest.approx(k4.max(axis=1).tolist() + k4.min(axis=1).tolist()[::-1])
    said = texts(at)
    assert "Grouped by everything but the seed" in said and "no group has more than 3 seeds" in said
    assert "grid-k0.4-s2" in said  # which runs each group holds
    # every other chart is grouped too: the regimes' panels are the groups'
    assert {trace["uid"].split(" · ")[0] for trace in plotly_specs(at)["regimes"]["data"]} == {"k=0.4", "k=0.6"}


def test_curves_grouped_by_a_picked_key(grid_app, grid_dir):
    at = grid_app("curves", run=GRID_RUNS, smooth="none", group="true", group_by="seed", band="t-interval")
    lines = {t["uid"]: t for t in plotly_specs(at)["entropy"]["data"] if not t["uid"].endswith("band")}
    assert set(lines) == {"seed=0", "seed=1", "seed=2"}
    seed2 = entropy_of(grid_dir, "grid-k0.4-s2")
    assert lines["seed=2"]["y"] == pytest.approx(seed2.tolist())  # one run: its own curve, and no band
    assert "seed=2 · band" not in {t["uid"] for t in plotly_specs(at)["entropy"]["data"]}
    # the keys that differ between the picked runs are offered first
    assert at.multiselect(key="group_by").options[:2] == ["k", "seed"]


def test_runs_table_shows_every_run_with_seed_and_sweep(grid_app):
    at = grid_app(run="grid-k0.4-s0")
    table = frames(at)[0].set_index("run_id")
    assert len(table) == 11
    assert table.loc["grid-k0.6-s1", "seed"] == 1 and table.loc["grid-k0.6-s1", "sweep"] == "grid"
    assert pd.isna(table.loc["other-0", "sweep"]) and table.loc["other-0", "seed"] == 10
    # the latest metrics come before the setup and the pace columns, so they stay in view at 1400 px
    columns = list(frames(at)[0].columns)
    assert columns.index("entropy") < columns.index("estimator") < columns.index("seed")
    assert "11 runs: 11 finished" in texts(at)  # (the table's height, every row in view: the browser test)


def test_figures_follow_the_theme_and_keep_the_legend_clear_of_the_axis_title():
    """Figures have no background of their own and draw text, grid and outlines in charts.THEMED colors, which the
    browser swaps for the theme's text color (test_dashboard_browser checks the swap in dark mode). The legend sits in
    a margin of its own below the x axis title, as tall as its rows."""
    frame = pd.DataFrame({"step": [1, 2, 3], "entropy": [0.5, 0.4, 0.45]})
    names = [f"a-long-run-name-{i}" for i in range(8)]
    colors = dict(zip(names, plotly.colors.qualitative.Plotly, strict=False))  # the palette has more colours than runs
    fig = charts.lines({name: frame for name in names}, ["entropy"], colors, "entropy")
    layout = fig.layout
    assert layout.paper_bgcolor == layout.plot_bgcolor == charts.TRANSPARENT
    assert layout.font.color == charts.INK and layout.xaxis.gridcolor == charts.GRID
    rows = charts._legend_rows(fig)
    assert rows > 1  # the case: a legend that wraps
    assert layout.legend.yref == "container" and layout.legend.y == 0 and layout.legend.yanchor == "bottom"
    assert layout.margin.b == charts.AXIS_TITLE_PX + charts.LEGEND_ROW_PX * rows
    assert layout.height == 400 + charts.LEGEND_ROW_PX * (rows - 1)  # the plot keeps its height


def test_a_component_name_in_a_trace_name_is_text_not_markup():
    """A reward component's name is the user's (a function's named parts): plotly renders trace names as HTML."""
    frame = pd.DataFrame({"step": [1, 2], "signal:<b>fmt</b>": [0.5, 1.0], "signal:ok": [0.5, 0.0]})
    fig = charts.lines({"r": frame}, ["signal:<b>fmt</b>", "signal:ok"], {"r": "#1f77b4"}, "signal")
    assert [trace.name for trace in fig.data] == ["r · signal:&lt;b&gt;fmt&lt;/b&gt;", "r · signal:ok"]


def test_regime_colors_are_not_run_colors():
    """Red was the regime `hard` and the second run: no regime color is near any run color."""

    def rgb(color: str) -> tuple[int, ...]:
        return tuple(int(color.lstrip("#")[i : i + 2], 16) for i in (0, 2, 4))

    runs = [rgb(c) for c in plotly.colors.qualitative.Plotly]
    for regime, color in charts.REGIME_COLORS.items():
        nearest = min(sum((a - b) ** 2 for a, b in zip(rgb(color), run, strict=True)) ** 0.5 for run in runs)
        assert nearest > 60, (regime, color, nearest)
    assert set(charts.GATE_COLORS.values()) == set(charts.REGIME_COLORS.values())


def test_gated_rows_are_dimmed_without_a_background(small_app):
    """A light background made the gated rows the brightest rows in dark mode: grey text only, on the page's own
    background."""
    at = small_app("rollouts", run="crafted", step="1")
    styles = [frame.proto.arrow_data.styler.styles for frame in at.dataframe if frame.proto.arrow_data.styler.styles]
    assert styles and all("#8a8a8a" in css and "background" not in css for css in styles), styles
