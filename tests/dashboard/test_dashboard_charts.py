"""The charts of issue 39: attribution charts readable at a glance (a colour per regime, a mean over the steps, the
sign convention on the chart), every training curve's y axis titled with its unit, the zoom kept when a run
finishes, and the Evaluations page at k = 1. AppTest on runs written through the real store; the figures as plotly
JSON. The browser's side of each is in test_dashboard_browser.py."""

from __future__ import annotations

import plotly.colors
import pytest

from qae_app.core import names
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter
from tests.dashboard.helpers import _crafted_rows, charts, make_app, plot_places, plotly_specs, texts


def test_a_run_that_finishes_leaves_every_chart_in_its_place(tmp_path, hold_lock, monkeypatch):
    """The zoom survived new steps but not the run finishing: the stop button and the pace line, drawn only while
    the run trains, sat above the charts, and when they went every chart in columns below moved up a place, which
    the browser draws as a new, unzoomed plot. Each chart keeps its place now."""
    runs_dir = tmp_path / "runs"
    writer = RunWriter(db_path(runs_dir, "live"), "live")
    writer.create_run("live", {"steps": 2}, "qae", 0.4, "builtin:tiny", "arith", 0)
    for step in (1, 2):
        writer.add_step(step, **_crafted_rows(step))
    assert writer.flush()
    holder = hold_lock(runs_dir / "live")
    monkeypatch.setenv(names.DASHBOARD_CONTROLS_ENV, "1")  # `qae dashboard` on loopback: a stop button
    at = make_app(runs_dir, monkeypatch)("curves", run="live")
    assert "live · running · step 2 / 2" in texts(at) and [b.label for b in at.button] == ["Stop live now"]
    running, revisions = plot_places(at), {key: spec["layout"]["uirevision"] for key, spec in plotly_specs(at).items()}
    assert len(running) >= 9
    assert writer.update_run(status="finished")
    holder.kill()
    holder.wait()
    at.run()
    assert "live · finished · step 2 / 2" in texts(at) and not at.button
    assert plot_places(at) == running
    assert {key: spec["layout"]["uirevision"] for key, spec in plotly_specs(at).items()} == revisions  # (as before)


# ---------------------------------------------------------------------------------------------------------------
# the entropy-change charts: a color per regime, the mean over the steps, the sign on the chart

# the crafted run's values (helpers._crafted_rows), steps 1..3, and their means over the steps by hand
CRAFTED_MEANS = {
    "entropy_delta": {"dH_easy": 0.02, "dH_hard": -0.03, "dH": (0.01 + 0.02 + 0.03) / 3},
    "entropy_attribution": {"dH_from_hard": -0.04, "dH_from_easy": (0.01 + 0.02 + 0.03) / 3, "dH_from_none": 0.001},
    "entropy_attribution_matrix": {
        "dH_hard_from_hard": -0.05,
        "dH_easy_from_hard": -0.02,
        "dH_hard_from_easy": 0.005,
        "dH_easy_from_easy": 0.03,
    },
}


def series(spec: dict, run_id: str) -> tuple[dict, dict]:
    """metric -> the run's line, and metric -> its mean line, of an entropy-change chart."""
    lines, means = {}, {}
    for trace in spec["data"]:
        run, _, rest = trace["uid"].partition(" · ")
        if run != run_id or rest.endswith(("(raw)", "band")):
            continue
        if rest.endswith(" · mean"):
            means[rest.removesuffix(" · mean")] = trace
        else:
            lines[rest] = trace
    return lines, means


def test_entropy_change_charts_color_each_regime_and_draw_its_mean_and_sign(small_app):
    """Issue 39: the entropy-attribution charts were 3-4 lines in the run's one color, told apart by dash alone, with
    no mean over the steps and nothing saying which sign means what. Now each series has a color of its own (a
    regime's, none of them a run's), a dotted line at its mean over the steps, and the title's second line says
    what above 0 means."""
    specs = plotly_specs(small_app("curves", run="crafted", smooth="none"))
    for key, means_by_hand in CRAFTED_MEANS.items():
        lines, means = series(specs[key], "crafted")
        assert set(lines) == set(means) == set(means_by_hand), key
        colors = [line["line"]["color"] for line in lines.values()]
        assert len(set(colors)) == len(colors), (key, colors)
        assert not set(colors) & set(plotly.colors.qualitative.Plotly), (key, colors)  # no run's color
        for metric, mean in means_by_hand.items():
            assert means[metric]["y"] == pytest.approx([mean, mean]), (key, metric)
            assert means[metric]["x"] == [1, 3]  # across the steps that have it
            assert means[metric]["line"] == {**lines[metric]["line"], "dash": "dot", "width": 1.5}
        layout = specs[key]["layout"]
        assert "above 0: the update raised entropy" in layout["title"]["subtitle"]["text"]
        assert layout["yaxis"]["title"]["text"] == "nats / token" and layout["yaxis"]["zeroline"] is True
    # the regimes keep their colors from chart to chart: the hard groups' update, the hard groups' responses
    hard = {
        series(specs[key], "crafted")[0][metric]["line"]["color"]
        for key, metric in [
            ("entropy_delta", "dH_hard"),
            ("entropy_attribution", "dH_from_hard"),
            ("entropy_attribution_matrix", "dH_hard_from_hard"),
        ]
    }
    assert hard == {charts.REGIME_COLORS["hard"]}


def test_entropy_change_charts_give_each_run_a_panel(small_app):
    """Colors name regimes, so runs are told apart by panel: one a run, on one y scale, each series once in the
    legend (it shows and hides the series in every panel)."""
    spec = plotly_specs(small_app("curves", run=["crafted", "crafted-copy"], smooth="none"))["entropy_attribution"]
    assert [a["text"] for a in spec["layout"]["annotations"]] == ["crafted", "crafted-copy"]
    for run_id, axis in (("crafted", "y"), ("crafted-copy", "y2")):
        lines, means = series(spec, run_id)
        assert {trace["yaxis"] or "y" for trace in [*lines.values(), *means.values()]} == {axis}
        assert lines["dH_from_easy"]["y"] == pytest.approx([0.01, 0.02, 0.03])
    assert spec["layout"]["yaxis"]["matches"] == "y2"  # one y scale for both panels
    shown = [trace["name"] for trace in spec["data"] if trace.get("showlegend") is not False]
    assert sorted(shown) == ["dH_from_easy", "dH_from_hard", "dH_from_none"]


# ---------------------------------------------------------------------------------------------------------------
# units


def y_titles(spec: dict) -> list[str]:
    return [
        (axis.get("title") or {}).get("text") or "" for name, axis in spec["layout"].items() if name.startswith("yaxis")
    ]


def test_every_training_curve_titles_its_y_axis_with_a_unit_not_a_name(small_app):
    """Issue 39: every chart's y axis titled with its unit. A chart picked under More metrics titled its axis with
    the metric's own name where metric_unit knew no unit (loss, grad_norm, kl, lr, ...): the name is already the
    chart's title and says nothing of what a tick counts. Every chart the page builds, with every metric picked."""
    others = [metric for metric in STEP_METRICS if metric not in charts.TIME_METRICS]
    specs = plotly_specs(small_app("curves", run="crafted", other=others))
    assert {f"other_{metric}" for metric in others} <= set(specs)
    bare = {
        key: y_titles(spec)
        for key, spec in specs.items()
        if not any(y_titles(spec)) or key.removeprefix("other_") in y_titles(spec)
    }
    assert bare == {}
    assert {metric: charts.metric_unit(metric) for metric in STEP_METRICS if charts.metric_unit(metric) == metric} == {}


# ---------------------------------------------------------------------------------------------------------------
# the Evaluations page at k = 1, and the benchmark both evaluation pages open on


def write_k1_run(runs_dir, maj_at_step_2: float = 0.5) -> None:
    """A run evaluated with one sample a problem (k = 1) on its held-out split while training (steps 1, 2: avg@1 0.25
    then 0.5), and by `qae eval` on the same benchmark at step 2 (0.75); every evaluation stores its samples."""
    writer = RunWriter(db_path(runs_dir, "k1"), "k1")
    writer.create_run("k1", {"steps": 2}, "qae", 0.4, "builtin:tiny", "arith", 0)
    for step, value, extra in ((1, 0.25, []), (2, 0.5, [("eval", 0.75)])):
        evals, samples = [], []
        for source, score in [("train", value), *extra]:
            maj = maj_at_step_2 if (step, source) == (2, "train") else score
            evals += [
                dict(benchmark="arith-heldout", subset="all", metric=metric, k=1, value=v, n_problems=4, source=source)
                for metric, v in (("avg@k", score), ("pass@k", score), ("maj@k", maj))
            ]
            samples += [
                dict(
                    benchmark="arith-heldout",
                    problem_id=f"q{i}",
                    sample_idx=0,
                    source=source,
                    verified=True,
                    n_tokens=2,
                    response=str(i),
                    extracted=str(i),
                    correct=i < 4 * score,
                    answer=str(i),
                )
                for i in range(4)
            ]
        writer.add_step(step, steps=[{name: None for name in STEP_METRICS}], evals=evals, eval_samples=samples)
    assert writer.flush()
    writer.update_run(status="finished")


def test_evaluations_at_k_1_are_one_panel(tmp_path, monkeypatch):
    """Issue 39: with one sample a problem, avg@1, pass@1 and maj@1 are one number, and the page drew it three
    times side by side. Now one panel says so, with the run's avg@1 as stored."""
    write_k1_run(tmp_path)
    spec = plotly_specs(make_app(tmp_path, monkeypatch)("evals", run="k1"))["evals_chart"]
    assert [name for name in spec["layout"] if name.startswith(("xaxis", "yaxis"))] == ["xaxis", "yaxis"]
    assert "avg@1 = pass@1 = maj@1" in spec["layout"]["title"]["text"]
    [line] = spec["data"]
    assert line["x"] == [1, 2] and line["y"] == pytest.approx([0.25, 0.5])
    assert spec["layout"]["yaxis"]["title"]["text"] == "fraction correct"


def test_a_maj_at_1_that_differs_is_drawn_apart(tmp_path, monkeypatch):
    """maj@1 differs from avg@1 where a sample was judged correct without an extracted answer (no answer never
    wins a vote): then it is a line of its own in the one panel, not hidden behind avg@1."""
    write_k1_run(tmp_path, maj_at_step_2=0.25)
    spec = plotly_specs(make_app(tmp_path, monkeypatch)("evals", run="k1"))["evals_chart"]
    lines = {trace["uid"]: trace for trace in spec["data"]}
    assert set(lines) == {"k1 · k=1", "k1 · maj@1"}
    assert lines["k1 · maj@1"]["y"] == pytest.approx([0.25, 0.25])


def test_both_evaluation_pages_open_on_the_same_benchmark(tmp_path, monkeypatch):
    """Issue 39: Evaluations opened on the training's held-out split and Eval samples on `qae eval`'s run of it
    (each page sorted its own way). Both now list the evaluations as board.eval_choices orders them and open on the
    first: the training's own evaluations first."""
    write_k1_run(tmp_path)
    app = make_app(tmp_path, monkeypatch)
    evals, samples = app("evals", run="k1"), app("eval_samples", run="k1")
    assert evals.selectbox(key="benchmark").value == samples.selectbox(key="benchmark").value
    assert (
        evals.selectbox(key="benchmark").options
        == samples.selectbox(key="benchmark").options
        == ["arith-heldout (during training)", "arith-heldout (qae eval)"]
    )
    assert samples.select_slider(key="step").value == 2


def test_two_runs_entropy_bands_are_each_labelled_with_their_run():
    """Two runs with different --entropy-low/--entropy-high: each band's lines carry the run's color and its id in
    the label; one band shared by every run stays unnamed. Checked to fail before: four dotted lines in two colors,
    labelled `entropy_low 0.5` and `entropy_low 1` with no run."""
    import pandas as pd

    chart_module = charts
    from qae_app.core.formatting import number

    frames = {run: pd.DataFrame({"step": [1, 2], "entropy": [2.5, 2.8]}) for run in ("a", "b")}
    colors = {"a": "#1f77b4", "b": "#2ca02c"}
    fig = chart_module.entropy(frames, colors, {"a": (0.5, 2.0), "b": (1.0, 3.0)}, {})
    lines = {note.text: line.line.color for note, line in zip(fig.layout.annotations, fig.layout.shapes, strict=True)}
    assert lines == {
        f"entropy_low {number(0.5)} · a": "#1f77b4",
        f"entropy_high {number(2.0)} · a": "#1f77b4",
        f"entropy_low {number(1.0)} · b": "#2ca02c",
        f"entropy_high {number(3.0)} · b": "#2ca02c",
    }
    shared = chart_module.entropy(frames, colors, {"a": (0.5, 2.0), "b": (0.5, 2.0)}, {})
    assert sorted(note.text for note in shared.layout.annotations) == [
        f"entropy_high {number(2.0)}",
        f"entropy_low {number(0.5)}",
    ]
