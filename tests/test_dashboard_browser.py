"""The real dashboard (`qae dashboard`, a real Streamlit server) driven by a real headless Chromium: on the finished
tiny run, and live on a run that `qae train` is writing while the page is open."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qae_app import store

from test_dashboard import free_port, wait_healthy

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
QAE = Path(sys.executable).parent / "qae"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
expect = sync_api.expect


def stop(process: subprocess.Popen, timeout_s: float = 30) -> int:
    """Terminate a process we started and wait for it; kill it if it does not stop in time."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@pytest.fixture
def start(request):
    """start(args, **popen) -> a subprocess that is stopped when the test ends, whatever happens."""

    def run(args: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(args, **kwargs)
        request.addfinalizer(lambda: stop(process))
        return process

    return run


@pytest.fixture
def dashboard(start, tmp_path):
    """dashboard(runs_dir) -> base URL of a `qae dashboard` server on a free port."""

    def run(runs_dir: Path) -> str:
        port = free_port()
        log = open(tmp_path / f"dashboard-{port}.log", "w")
        process = start([str(QAE), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)], stdout=log,
                        stderr=subprocess.STDOUT)
        wait_healthy(port, process)
        return f"http://127.0.0.1:{port}"

    return run


@pytest.fixture
def page():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 2400})
        finally:
            browser.close()


def screenshot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=tmp_path / name)
    if os.environ.get("QAE_SCREENSHOT_DIR"):
        out = Path(os.environ["QAE_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, out / name)


def wait_idle(page, timeout_s: float = 60) -> None:
    """Wait until Streamlit has finished running the script (its 'running' indicator is gone)."""
    page.wait_for_selector("[data-testid=stSidebar]", timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    time.sleep(0.5)
    while page.query_selector("[data-testid=stStatusWidget]") and time.monotonic() < deadline:
        time.sleep(0.2)


def test_browse_a_finished_run(tiny_run, dashboard, page, tmp_path):
    runs_dir, run_id = tiny_run
    url = dashboard(runs_dir)
    page.goto(f"{url}/curves")
    wait_idle(page)
    # pick the run in the sidebar (the newest run is preselected: clear it first)
    picker = page.get_by_test_id("stSidebar").get_by_test_id("stMultiSelect")
    picker.get_by_role("button", name=re.compile("Clear all", re.I)).click()
    expect(page.get_by_text("Pick one or more runs in the sidebar")).to_be_visible(timeout=60_000)
    picker.click()
    page.get_by_role("option", name=run_id).click()
    page.keyboard.press("Escape")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=60_000)
    expect(page.get_by_text(f"{run_id} · finished · step 6 / 6")).to_be_visible(timeout=30_000)
    assert f"run={run_id}" in page.url
    screenshot(page, tmp_path, "dashboard-curves.png")

    # the rollouts of step 3, through the URL the page keeps
    path = store.db_path(runs_dir, run_id)
    expected = store.read_rollouts(path, 3)
    page.goto(f"{url}/rollouts?run={run_id}&step=3")
    wait_idle(page)
    metrics = page.get_by_test_id("stMetricValue")
    expect(metrics.nth(1)).to_have_text(f"{int(expected['gated'].sum())} / {len(expected)}", timeout=60_000)
    expect(metrics.nth(0)).to_have_text(f"{len(expected)} / {len(expected)}")
    expect(page.get_by_test_id("stSlider").get_by_role("slider")).to_have_attribute("aria-valuetext", "3")
    groups = store.read_groups(path, 3)
    expect(page.get_by_text(re.compile(r"^Group \d+"))).to_have_count(len(groups))
    body = page.inner_text("body")
    for g, rows in expected.groupby("group_idx"):
        assert re.search(rf"Group {g} \w+ · .* · {int(rows['gated'].sum())} of {len(rows)} shown gated", body)
    # filter to the gated responses: the counts follow, and the filter is in the URL
    page.get_by_test_id("stButtonGroup").get_by_role("radio", name="gated", exact=True).click()
    expect(metrics.nth(0)).to_have_text(f"{int(expected['gated'].sum())} / {len(expected)}", timeout=30_000)
    assert "gated=gated" in page.url
    screenshot(page, tmp_path, "dashboard-rollouts.png")


def test_curves_grow_while_qae_train_writes(start, dashboard, page, tmp_path):
    runs_dir = tmp_path / "runs"
    trainer = start([str(QAE), "train", "--runs-dir", str(runs_dir), "--run-name", "live", "--steps", "400",
                     "--prompts-per-step", "4", "--group-size", "8", "--eval-every", "0", "--checkpoint-every", "0"],
                    stdout=open(tmp_path / "train.log", "w"), stderr=subprocess.STDOUT, cwd=tmp_path)
    path = store.db_path(runs_dir, "live")
    deadline = time.monotonic() + 120
    while not (path.exists() and store.read_runs(runs_dir).shape[0]) and time.monotonic() < deadline:
        assert trainer.poll() is None, (tmp_path / "train.log").read_text()
        time.sleep(0.5)
    url = dashboard(runs_dir)
    page.goto(f"{url}/curves?run=live")

    def shown_step() -> int | None:
        match = re.search(r"live · running · step (\d+) / 400", page.inner_text("body"))
        return int(match.group(1)) if match else None

    seen: list[int] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(set(seen)) < 3:
        step = shown_step()
        if step is not None and (not seen or step != seen[-1]):
            seen.append(step)
        time.sleep(1)
    assert len(set(seen)) >= 3 and seen == sorted(seen), f"steps shown: {seen}"
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=30_000)
    screenshot(page, tmp_path, "dashboard-live.png")

    # the trainer was not hurt: it keeps going, and stops cleanly when asked
    assert trainer.poll() is None, (tmp_path / "train.log").read_text()
    trainer.send_signal(signal.SIGTERM)
    trainer.wait(timeout=60)
    run = store.read_run(path)
    assert run["status"] in ("interrupted", "finished"), run
    assert run["last_step"] >= seen[-1]
