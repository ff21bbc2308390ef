"""The charts of issue 39: attribution charts readable at a glance (a colour per regime, a mean over the steps, the
sign convention on the chart), every training curve's y axis titled with its unit, the zoom kept when a run
finishes, and the Evaluations page at k = 1. AppTest on runs written through the real store; the figures as plotly
JSON. The browser's side of each is in test_dashboard_browser.py."""

from __future__ import annotations

from qae_app.core import names
from qae_app.store import run_folder as rundir
from qae_app.store import writer as store_write
from tests.dashboard.helpers import _crafted_rows, make_app, plot_places, plotly_specs, texts


def test_a_run_that_finishes_leaves_every_chart_in_its_place(tmp_path, hold_lock, monkeypatch):
    """The zoom survived new steps but not the run finishing: the stop button and the pace line, drawn only while
    the run trains, sat above the charts, and when they went every chart in columns below moved up a place, which
    the browser draws as a new, unzoomed plot. Each chart keeps its place now."""
    runs_dir = tmp_path / "runs"
    writer = store_write.RunWriter(rundir.db_path(runs_dir, "live"), "live")
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
