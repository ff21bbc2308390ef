"""The Preview page on a real `qae preview` of the built-in task: its charts are the stored rows (groups by success
rate, the gated share by K against GRPO), in AppTest and in a real browser; a page of no preview says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from qae_app.config import build_config
from qae_app.evaluation.task_preview import PreviewOptions, run_preview
from qae_app.store.reader import read_preview
from qae_app.store.run_folder import db_path
from tests.dashboard.helpers import make_app, plotly_specs, texts
from tests.synthetic import write_run

try:  # the real server and browser, as the browser tests drive them (fixtures: dashboard, page, start)
    from tests.dashboard.test_dashboard_browser import (  # noqa: F401
        CHROMIUM,
        dashboard,
        expect,
        page,
        screenshot,
        start,
        wait_idle,
    )
except pytest.skip.Exception:  # playwright is not installed
    CHROMIUM = None


@pytest.fixture(scope="module")
def preview_dir(tmp_path_factory) -> Path:
    """A runs dir with a preview of the built-in task (12 prompts x G=8) and a synthetic training run."""
    out = tmp_path_factory.mktemp("preview_runs")
    run_preview(
        build_config(run_name="pv", group_size=8, seed=2),
        out,
        PreviewOptions(prompts=12, ks=(0.25, 0.75)),
        device="cpu",
    )
    write_run(out, "trained", steps=3, prompts_per_step=2, group_size=4, n_prompts=4)
    return out


@pytest.fixture
def preview_app(preview_dir, monkeypatch):
    return make_app(preview_dir, monkeypatch)


def test_the_preview_page_draws_the_stored_rows(preview_app, preview_dir):
    view = read_preview(db_path(preview_dir, "pv"))
    at = preview_app("preview", run="pv")
    specs = plotly_specs(at)
    without, with_signal = specs["preview_success"]["data"]  # stacked: the verdict's groups with signal on top
    counts = view.groups["n_correct"].value_counts()
    stacked = [a + b for a, b in zip(without["y"], with_signal["y"], strict=True)]
    assert stacked == [int(counts.get(c, 0)) for c in range(9)]
    n_signal = round((1 - view.summary["frac_no_signal"]) * len(view.groups))
    assert sum(with_signal["y"]) == n_signal
    qae, grpo, *suggested = specs["preview_gating"]["data"]
    by_k = view.by_k[view.by_k["estimator"] == "qae"].sort_values("k")
    assert list(qae["x"]) == pytest.approx(by_k["k"].tolist())
    assert list(qae["y"]) == pytest.approx(by_k["frac_zero_adv"].tolist())
    assert list(grpo["y"]) == pytest.approx([view.by_k.query("estimator == 'grpo'")["frac_zero_adv"].item()] * 2)
    assert [s["x"] for s in suggested] == [[view.summary["suggested_k"]]]
    assert at.success[0].value == view.summary["verdict"]
    assert view.summary["suggested_why"] in texts(at)


def test_a_page_of_no_preview_says_how_to_make_one(preview_app):
    at = preview_app("preview", run="trained")
    assert "None of the picked runs is a preview" in texts(at)


@pytest.mark.slow  # a real server and a real browser
@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None or not CHROMIUM.exists(), reason="playwright or chromium is missing")
def test_the_preview_page_in_a_real_browser(preview_dir, dashboard, page, tmp_path):  # noqa: F811
    """`qae dashboard` serving the preview to Chromium: the verdict and the four charts appear, and the suggested K
    and the share of groups without signal are the stored ones."""
    view = read_preview(db_path(preview_dir, "pv"))
    url = dashboard(preview_dir, refresh="off")
    page.goto(f"{url}/preview?run=pv")
    wait_idle(page)
    expect(page.get_by_text(view.summary["verdict"])).to_be_visible(timeout=60_000)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=60_000)
    metrics = page.get_by_test_id("stMetricValue")
    expect(metrics.nth(4)).to_have_text(f"{view.summary['suggested_k']:g}", timeout=30_000)
    expect(metrics.nth(1)).to_have_text(f"{view.summary['frac_no_signal']:.1%}")
    screenshot(page, tmp_path, "dashboard-preview.png")
