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

from qae_app.store.reader import read_groups, read_last_step, read_rollouts, read_run, read_runs
from qae_app.store.run_folder import CONFIG_FILE, DB_FILE, db_path
from tests.dashboard.helpers import free_port, wait_healthy

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
QAE = Path(sys.executable).parent / "qae"
PLOTLY_PALETTE = ["#636EFA", "#EF553B", "#00CC96", "#AB63FA"]  # plotly.colors.qualitative.Plotly's first four

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,  # a real server and a real browser: 10-60 s a test
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
    """dashboard(runs_dir, refresh=...) -> base URL of a `qae dashboard` server on a free port.

    Tests of finished runs pass refresh="off" (`qae dashboard --refresh off`). Streamlit's browser side can drop what a
    click changed when the click lands while the page's periodic check for new steps (a `run_every` fragment) is in
    flight: the server opens the response, the page does not show it. Measured with the browser's CPU throttled 6x on
    a loaded machine: 4 of 8 clicks lost with the check every 2 s, 0 of 8 with it off (docs/dashboard.md)."""

    def run(runs_dir: Path, refresh: str | None = None) -> str:
        port = free_port()
        log = open(tmp_path / f"dashboard-{port}.log", "w")
        process = start(
            [
                str(QAE),
                "dashboard",
                "--runs-dir",
                str(runs_dir),
                "--port",
                str(port),
                *(["--refresh", refresh] if refresh else []),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
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


def wait_idle(page, timeout_s: float = 60, settled_s: float = 1.0) -> None:
    """Wait until Streamlit has finished running the script: its 'running' indicator absent for `settled_s` in a row
    (on a busy machine the indicator can appear late, so one look after a fixed pause can see a run not yet begun)."""
    page.wait_for_selector("[data-testid=stSidebar]", timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while time.monotonic() < deadline:
        if page.query_selector("[data-testid=stStatusWidget]"):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= settled_s:
            return
        time.sleep(0.1)


def pick_option(page, opener, option_name, timeout_s: float = 60) -> None:
    """Open a dropdown and click one of its options. A rerun that redraws the widget closes an open dropdown (CI saw
    the option never appear after one click on a busy machine), so the opening is retried until the option shows."""
    option = page.get_by_role("option", name=option_name)
    deadline = time.monotonic() + timeout_s
    while True:
        opener.click()
        try:
            option.first.wait_for(state="visible", timeout=5_000)
            break
        except sync_api.TimeoutError:
            if time.monotonic() > deadline:
                raise
            page.keyboard.press("Escape")
            wait_idle(page)
    option.first.click()


def test_browse_a_finished_run(tiny_run, dashboard, page, tmp_path):
    runs_dir, run_id = tiny_run
    url = dashboard(runs_dir, refresh="off")  # a finished run: no click may land on a refresh check
    page.goto(f"{url}/curves")
    wait_idle(page)
    # pick the run in the sidebar (the newest run is preselected: clear it first)
    picker = page.get_by_test_id("stSidebar").get_by_test_id("stMultiSelect")
    picker.get_by_role("button", name=re.compile("Clear all", re.I)).click()
    expect(page.get_by_text("Pick one or more runs in the sidebar")).to_be_visible(timeout=60_000)
    pick_option(page, picker, run_id)
    page.keyboard.press("Escape")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=60_000)
    expect(page.get_by_text(f"{run_id} · finished · step 6 / 6")).to_be_visible(timeout=30_000)
    assert f"run={run_id}" in page.url
    screenshot(page, tmp_path, "dashboard-curves.png")

    # the rollouts of step 3, through the URL the page keeps
    path = db_path(runs_dir, run_id)
    expected = read_rollouts(path, 3)
    page.goto(f"{url}/rollouts?run={run_id}&step=3")
    wait_idle(page)
    metrics = page.get_by_test_id("stMetricValue")
    expect(metrics.nth(1)).to_have_text(f"{int(expected['gated'].sum())} / {len(expected)}", timeout=60_000)
    expect(metrics.nth(0)).to_have_text(f"{len(expected)} / {len(expected)}")
    expect(page.get_by_test_id("stSlider").get_by_role("slider")).to_have_attribute("aria-valuetext", "3")
    groups = read_groups(path, 3)
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
    trainer = start(
        [
            str(QAE),
            "train",
            "--runs-dir",
            str(runs_dir),
            "--run-name",
            "live",
            "--steps",
            "400",
            "--prompts-per-step",
            "4",
            "--group-size",
            "8",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
        ],
        stdout=open(tmp_path / "train.log", "w"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    path = db_path(runs_dir, "live")
    deadline = time.monotonic() + 120
    while not (path.exists() and read_runs(runs_dir).shape[0]) and time.monotonic() < deadline:
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
    run = read_run(path)
    assert run["status"] in ("interrupted", "finished"), run
    assert run["last_step"] >= seen[-1]


# ---------------------------------------------------------------------------------------------------------------
# round two: run identity, liveness, chart state

PLOT_STATE = """(index) => { const gd = document.querySelectorAll('.js-plotly-plot')[index];
    return {range: gd.layout.xaxis.range, visible: gd.data.map(t => t.visible === 'legendonly' ? 'hidden' : 'shown'),
            points: gd._fullData[0].x.length}; }"""
COUNT_REDRAWS = """() => { window.qaeRedraws = 0; document.querySelectorAll('.js-plotly-plot').forEach(
    gd => gd.on('plotly_afterplot', () => window.qaeRedraws++)); }"""


def start_trainer(start, runs_dir: Path, tmp_path: Path, name: str) -> subprocess.Popen:
    """A real `qae train` of the built-in model, long enough to outlive the test; returns once its run exists."""
    trainer = start(
        [
            str(QAE),
            "train",
            "--runs-dir",
            str(runs_dir),
            "--run-name",
            name,
            "--steps",
            "5000",
            "--prompts-per-step",
            "4",
            "--group-size",
            "8",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
        ],
        stdout=open(tmp_path / f"train-{name}.log", "w"),
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    return trainer


def wait_for_steps(path: Path, trainer: subprocess.Popen, log: Path, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert trainer.poll() is None, log.read_text()[-3000:]
        if path.exists():
            try:
                last = read_last_step(path)
            except Exception:  # noqa: BLE001 - the trainer holds the file for a moment
                last = None
            if last is not None and last >= n:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{path} has not reached step {n}")


def test_a_copied_run_folder_is_its_own_run_and_a_click_opens_a_response(dashboard, page, tmp_path):
    from tests.dashboard.helpers import EVIL_RESPONSE, _write_crafted

    runs_dir = tmp_path / "runs"
    _write_crafted(runs_dir)
    shutil.copytree(runs_dir / "crafted", runs_dir / "crafted-copy")  # `cp -r runs/X runs/copy`
    url = dashboard(runs_dir, refresh="off")
    page.goto(f"{url}/?run=crafted-copy")
    wait_idle(page)
    table = page.get_by_test_id("stDataFrame").first
    expect(table).to_contain_text("crafted-copy", timeout=60_000)
    page.goto(f"{url}/curves?run=crafted-copy")
    expect(page.get_by_text("crafted-copy · finished · step 3 / 3")).to_be_visible(timeout=60_000)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=60_000)
    assert "no database" not in page.inner_text("body")
    screenshot(page, tmp_path, "dashboard-copied-run.png")
    page.goto(f"{url}/rollouts?run=crafted-copy&step=3")
    wait_idle(page)
    expect(page.get_by_test_id("stMetricValue").nth(0)).to_have_text("8 / 8", timeout=60_000)
    expect(page.get_by_text("live updates off")).to_be_visible()
    # click the response cell of sample 3 of group 0 (not the row's checkbox): the response opens in full
    grid = page.get_by_test_id("stDataFrame").nth(1)
    box = grid.bounding_box()
    grid.scroll_into_view_if_needed()
    box = grid.bounding_box()
    header_px, row_px = 35, 35
    cell = box["x"] + box["width"] * 0.75, box["y"] + header_px + row_px * 3.5
    page.mouse.move(*cell)  # as a hand does: the grid ignores a click that no pointer move led to the cell
    time.sleep(0.5)
    page.mouse.click(*cell)
    expect(page.get_by_test_id("stCode").filter(has_text="<script>alert('x')</script>")).to_be_visible(timeout=30_000)
    assert EVIL_RESPONSE.split(" ")[0] in page.inner_text("body")
    screenshot(page, tmp_path, "dashboard-copied-rollouts.png")


@pytest.mark.slow
def test_a_new_run_appears_on_an_open_empty_page(start, dashboard, page, tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    url = dashboard(runs_dir)
    page.goto(url)
    expect(page.get_by_text("No runs in")).to_be_visible(timeout=60_000)
    trainer = start_trainer(start, runs_dir, tmp_path, "fresh")
    # no reload: the watcher sees the new run folder and redraws the page
    expect(page.get_by_test_id("stDataFrame").first).to_contain_text("fresh", timeout=240_000)
    picker = page.get_by_test_id("stSidebar").get_by_test_id("stMultiSelect")
    expect(picker.get_by_text("fresh", exact=True)).to_be_visible(timeout=30_000)  # picked: nothing else was
    expect(page.get_by_test_id("stSidebar").get_by_text("live: fresh training")).to_be_visible(timeout=30_000)
    assert "run=fresh" in page.url  # the default pick is in the link
    screenshot(page, tmp_path, "dashboard-new-run.png")
    trainer.send_signal(signal.SIGTERM)
    trainer.wait(timeout=120)


@pytest.mark.slow
def test_zoom_survives_new_steps_and_a_killed_run_stops_redrawing(start, dashboard, page, tmp_path):
    runs_dir = tmp_path / "runs"
    trainer = start_trainer(start, runs_dir, tmp_path, "live")
    path = db_path(runs_dir, "live")
    wait_for_steps(path, trainer, tmp_path / "train-live.log", 3)
    url = dashboard(runs_dir)
    page.goto(f"{url}/curves?run=live&smooth=none")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=90_000)
    expect(page.get_by_text(re.compile(r"live · running · step \d+ / 5000"))).to_be_visible(timeout=60_000)

    # zoom the entropy chart with a mouse drag and hide a trace of the accuracy chart from its legend
    zoomed = zoom(page, 0)
    page.locator(".js-plotly-plot").nth(1).locator(".legendtoggle").first.click()
    # plotly waits out a possible double click before it hides the trace
    page.wait_for_function(
        "document.querySelectorAll('.js-plotly-plot')[1].data[0].visible === 'legendonly'", timeout=10_000
    )
    hidden = page.evaluate(PLOT_STATE, 1)
    assert zoomed["range"] is not None

    # new steps arrive and are drawn into the same charts: the zoom and the hidden trace stay
    page.wait_for_function(
        f"document.querySelectorAll('.js-plotly-plot')[0]._fullData[0].x.length >= {zoomed['points'] + 2}",
        timeout=120_000,
    )
    after, after_hidden = page.evaluate(PLOT_STATE, 0), page.evaluate(PLOT_STATE, 1)
    assert after["points"] > zoomed["points"]
    assert after["range"] == zoomed["range"]
    assert after_hidden["visible"] == hidden["visible"]
    screenshot(page, tmp_path, "dashboard-zoom-kept.png")

    # kill -9: the run is shown as stopped without a reload, and the page stops redrawing
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(timeout=30)
    expect(page.get_by_text(re.compile(r"live · stopped · step \d+ / 5000"))).to_be_visible(timeout=60_000)
    expect(page.get_by_text("no shown run is training")).to_be_visible(timeout=30_000)
    time.sleep(2)
    page.evaluate(COUNT_REDRAWS)
    shown = page.inner_text("body")
    time.sleep(15)  # three refresh intervals
    assert page.evaluate("window.qaeRedraws") == 0
    assert page.inner_text("body") == shown
    assert read_runs(runs_dir).set_index("run_id").loc["live", "status"] == "stopped"
    screenshot(page, tmp_path, "dashboard-killed.png")


def zoom(page, index: int) -> dict:
    """Drag a box over the middle of the `index`-th chart (as a hand zooms) and return its state once zoomed."""
    chart = page.locator(".js-plotly-plot").nth(index)
    chart.scroll_into_view_if_needed()
    area = chart.locator(".nsewdrag").first.bounding_box()
    page.mouse.move(area["x"] + area["width"] * 0.3, area["y"] + area["height"] * 0.2)
    page.mouse.down()
    page.mouse.move(area["x"] + area["width"] * 0.6, area["y"] + area["height"] * 0.8, steps=8)
    page.mouse.up()
    page.wait_for_function(
        f"document.querySelectorAll('.js-plotly-plot')[{index}].layout.xaxis.autorange === false", timeout=10_000
    )
    return page.evaluate(PLOT_STATE, index)


def test_zoom_survives_the_run_finishing(hold_lock, dashboard, page, tmp_path):
    """Issue 39: the zoom survived a live run's new steps but reset when the run finished. A run stored as running
    (its lock held by a small process, as a trainer holds it) is zoomed, then finishes: the page is redrawn for the
    new status and the zoom stays."""
    from qae_app.store.writer import RunWriter
    from tests.dashboard.helpers import _crafted_rows

    runs_dir = tmp_path / "runs"
    writer = RunWriter(db_path(runs_dir, "live"), "live")
    writer.create_run("live", {"steps": 3}, "qae", 0.4, "builtin:tiny", "arith", 0)
    for step in (1, 2, 3):
        writer.add_step(step, **_crafted_rows(step))
    assert writer.flush()
    holder = hold_lock(runs_dir / "live")
    url = dashboard(runs_dir, refresh="2")
    page.goto(f"{url}/curves?run=live&smooth=none")
    expect(page.get_by_text("live · running · step 3 / 3")).to_be_visible(timeout=90_000)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=90_000)
    wait_idle(page)
    zoomed = zoom(page, 0)

    assert writer.update_run(status="finished") or writer.flush(timeout_s=30)  # (a page may be reading the file)
    stop(holder)  # the trainer lets go of its lock as it exits
    expect(page.get_by_text("live · finished · step 3 / 3")).to_be_visible(timeout=60_000)
    expect(page.get_by_text("no shown run is training")).to_be_visible(timeout=30_000)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=30_000)
    wait_idle(page)
    assert page.evaluate(PLOT_STATE, 0)["range"] == zoomed["range"]
    screenshot(page, tmp_path, "dashboard-zoom-kept-finished.png")


ENTROPY_CHANGE_CHART = """(title) => { const gd = [...document.querySelectorAll('.js-plotly-plot')].find(
    gd => gd.layout.title.text.startsWith(title));
    const strokes = [...gd.querySelectorAll('.scatterlayer .trace path.js-line')].map(path => path.style.stroke);
    const subtitle = gd.querySelector('.gtitle-subtitle');
    return {strokes: strokes, sign: subtitle.textContent,
            inside: subtitle.getBoundingClientRect().right <= gd.getBoundingClientRect().right}; }"""


def test_entropy_change_charts_draw_a_color_per_regime_and_the_sign(dashboard, page, tmp_path):
    """Issue 39: the attribution charts, as the browser draws them: a stroke color per series (the hard update's,
    the easy update's, the update without advantage), each color twice (the line and its mean), and the sign
    convention under the title, whole within the chart's width."""
    from tests.dashboard.helpers import _write_crafted

    runs_dir = tmp_path / "runs"
    _write_crafted(runs_dir)
    url = dashboard(runs_dir, refresh="off")
    page.goto(f"{url}/curves?run=crafted&smooth=none")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 12", timeout=90_000)
    wait_idle(page)
    for title, n_series in (
        ("entropy change caused by one regime's update alone", 3),
        ("which regime's update moved which regime's responses", 4),
        ("entropy change of each regime's responses", 3),
    ):
        drawn = page.evaluate(ENTROPY_CHANGE_CHART, title)
        colors = set(drawn["strokes"])
        assert len(colors) == n_series and all(drawn["strokes"].count(c) == 2 for c in colors), (title, drawn)
        assert drawn["sign"].startswith("above 0: the update raised entropy") and drawn["inside"], (title, drawn)
    chart = page.locator(".js-plotly-plot").filter(has_text="caused by one regime's update alone")
    chart.scroll_into_view_if_needed()
    chart.screenshot(path=tmp_path / "dashboard-entropy-attribution.png")
    screenshot(page, tmp_path, "dashboard-entropy-change.png")


def test_evaluations_at_k_1_draw_one_panel_and_open_where_eval_samples_opens(dashboard, page, tmp_path):
    """Issue 39: a run evaluated at k = 1, while training and by `qae eval`: the Evaluations page draws one panel
    (three identical ones before) and both evaluation pages open on the training's own evaluation."""
    from tests.dashboard.test_dashboard_charts import write_k1_run

    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    write_k1_run(runs_dir)
    url = dashboard(runs_dir, refresh="off")
    opened = {}
    for view in ("evals", "eval-samples"):
        page.goto(f"{url}/{view}?run=k1")
        box = page.get_by_role("combobox", name="Benchmark")
        expect(box).to_have_value(re.compile("arith-heldout"), timeout=60_000)
        wait_idle(page)
        opened[view] = box.input_value()
        if view == "evals":
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 1", timeout=60_000)
            panels = page.evaluate(
                "Object.keys(document.querySelector('.js-plotly-plot')._fullLayout).filter(name => /^xaxis/.test(name))"
            )
            assert panels == ["xaxis"]
            screenshot(page, tmp_path, "dashboard-evals-k1.png")
    assert opened["evals"] == opened["eval-samples"] and "(during training)" in opened["evals"], opened


@pytest.mark.slow
def test_the_compare_page_of_a_sweep(dashboard, page, tmp_path):
    """A sweep of 2 estimators x 3 seeds: the table with its intervals, the three charts of mean curves with bands,
    and a baseline picked on the page: the paired differences appear and the choice goes into the URL."""
    from tests.dashboard.test_dashboard_compare import SWEEP_NAME, write_compare_runs

    url = dashboard(write_compare_runs(tmp_path / "runs"), refresh="off")
    page.goto(f"{url}/compare?sweep={SWEEP_NAME}")
    wait_idle(page)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=60_000)
    table = page.get_by_test_id("stDataFrame").first
    expect(table).to_contain_text("estimator=qae", timeout=60_000)
    expect(table).to_contain_text("0.700 [0.452, 0.948]")  # final_heldout of the qae seeds (0.6, 0.7, 0.8)
    # a row per metric, all in view: header, n, seeds, ten metrics, note and runs (a 10-row box hid step_s)
    assert table.bounding_box()["height"] >= 35 * 15
    expect(table).to_contain_text("step_s")
    titles = page.evaluate("[...document.querySelectorAll('.js-plotly-plot')].map(gd => gd.layout.title.text)")
    assert sorted(title.split(" · ")[0] for title in titles) == [
        "entropy",
        "held-out accuracy",
        "zero-advantage (gated) fraction",
    ]
    bands = page.evaluate(
        "[...document.querySelectorAll('.js-plotly-plot')].map(gd => gd.data.filter(t => t.fill === 'toself').length)"
    )
    assert bands == [2, 2, 2]  # one band per group on each chart
    expect(page.get_by_test_id("stDataFrame")).to_have_count(1)  # no baseline yet: no differences

    pick_option(page, page.get_by_test_id("stSelectbox").filter(has_text="Baseline"), "estimator=grpo")
    expect(page.get_by_test_id("stDataFrame").nth(1)).to_contain_text("+0.133 [-0.010, 0.277] p=0.0572", timeout=60_000)
    assert "baseline=estimator%3Dgrpo" in page.url and f"sweep={SWEEP_NAME}" in page.url
    screenshot(page, tmp_path, "dashboard-compare.png")


PLOT_COLORS = """(title) => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(gd => gd.layout.title.text === title || gd.layout.title.text.startsWith(title + ' '))
    .flatMap(gd => gd.data.filter(t => t.line && t.line.color && t.fill !== 'toself')
                          .map(t => [t.name, t.line.color]))"""


def write_loss_grid(runs_dir: Path) -> Path:
    """The bake-off `grid`: clip with the estimators and seeds of write_compare_runs' sweep, kl_cov with QAE's seeds
    0 and 1 only (its row gets no interval)."""
    from tests.dashboard.test_dashboard_compare import HELDOUT, entropy, frac_zero_adv, write_compare_run

    runs_dir.mkdir(parents=True, exist_ok=True)
    for loss in ("clip", "kl_cov"):
        for estimator, by_seed in HELDOUT.items():
            for seed, heldout in by_seed.items():
                if loss == "kl_cov" and estimator == "qae" and seed == 2:
                    continue
                write_compare_run(
                    runs_dir,
                    f"grid-{loss}-{estimator}-s{seed}",
                    heldout,
                    lambda step, e=estimator, s=seed: (entropy(e, s, step), frac_zero_adv(e, s, step)),
                    estimator=estimator,
                    seed=seed,
                    eval_every=2,
                    policy_loss=loss,
                    sweep_id="0123456789",
                    sweep_name="grid",
                )
    return runs_dir


def test_the_bake_off_in_the_paper_s_layout_and_qae_in_one_color_on_every_page(dashboard, page, tmp_path):
    """Issue 46: a grid of 2 policy losses x (grpo, qae): the Compare page's table per metric has a row per loss
    with base, + QAE and the paired difference (clip's as computed by hand in test_dashboard_compare.py, kl_cov's
    without an interval at 2 seeds), and small multiples per loss with both estimators overlaid; QAE is drawn in
    one color there and on Training curves, whichever order the runs were picked in."""
    from qae_app.core.estimators import ESTIMATORS

    qae_color, grpo_color = (PLOTLY_PALETTE[list(ESTIMATORS).index(name)] for name in ("qae", "grpo"))
    url = dashboard(write_loss_grid(tmp_path / "runs"), refresh="off")
    page.goto(f"{url}/compare?sweep=grid")
    wait_idle(page)
    expect(page.get_by_text("By policy loss, as the paper's Table 2")).to_be_visible(timeout=60_000)
    final = page.get_by_test_id("stDataFrame").filter(has_text="qae - grpo").first
    expect(final).to_contain_text("+0.133 [-0.010, 0.277] p=0.0572")  # clip: paired 0.1, 0.2, 0.1
    expect(final).to_contain_text("+0.150 (n=2: no interval)")  # kl_cov: paired 0.1, 0.2 on seeds 0 and 1
    page.wait_for_function(
        "[...document.querySelectorAll('.js-plotly-plot')].some(gd => "
        "gd.layout.title.text.startsWith('entropy and held-out accuracy per policy loss'))",
        timeout=60_000,
    )
    panels = page.evaluate(
        "Object.keys([...document.querySelectorAll('.js-plotly-plot')].find(gd => "
        "gd.layout.title.text.startsWith('entropy and held-out')).layout)"
        ".filter(name => /^xaxis/.test(name))"
    )
    assert len(panels) == 4  # 2 losses x (entropy, held-out accuracy)
    drawn = page.evaluate(PLOT_COLORS, "entropy and held-out accuracy per policy loss")
    assert len(drawn) == 8 and {color for name, color in drawn if name == "qae"} == {qae_color}
    assert {color for name, color in drawn if name == "grpo"} == {grpo_color}
    screenshot(page, tmp_path, "dashboard-compare-policy-losses.png")
    # Training curves, grpo picked first: QAE keeps its color
    page.goto(f"{url}/curves?run=grid-clip-grpo-s0&run=grid-clip-qae-s0&smooth=none")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3", timeout=90_000)
    wait_idle(page)
    drawn = dict(page.evaluate(PLOT_COLORS, "entropy"))
    assert drawn["grid-clip-qae-s0"] == qae_color and drawn["grid-clip-grpo-s0"] == grpo_color, drawn


# ---------------------------------------------------------------------------------------------------------------
# round three: dark mode, grouping, a link to a run that is not there

THEMED_PLOTS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => ({
    paper: gd.layout.paper_bgcolor, font: gd.layout.font.color, grid: gd.layout.xaxis.gridcolor}))"""


@pytest.fixture
def dark_page():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 2400}, color_scheme="dark")
        finally:
            browser.close()


def brightness(css_color: str) -> float:
    """Mean of the r, g, b of 'rgb(r, g, b)' / 'rgba(r, g, b, a)'."""
    return sum(float(v) for v in re.findall(r"[\d.]+", css_color)[:3]) / 3


def test_dark_mode_charts_follow_the_theme(dashboard, dark_page, tmp_path):
    """In a browser that prefers dark, Streamlit draws its dark theme: the charts were white panels. Now they have no
    background of their own and their text and grid are drawn in the theme's (light) text color."""
    from tests.dashboard.helpers import _write_crafted

    runs_dir = tmp_path / "runs"
    _write_crafted(runs_dir)
    url = dashboard(runs_dir, refresh="off")
    page = dark_page
    page.goto(f"{url}/curves?run=crafted")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=90_000)
    background = page.evaluate("getComputedStyle(document.querySelector('.stApp')).backgroundColor")
    assert brightness(background) < 60, background  # the dark theme is on
    plots = page.evaluate(THEMED_PLOTS)
    assert plots and all(p["paper"] == "rgba(0,0,0,0)" for p in plots), plots
    assert all(brightness(p["font"]) > 200 for p in plots), plots  # light text on the dark page
    assert all(p["grid"].startswith("rgba(") and brightness(p["grid"]) > 200 for p in plots), plots
    screenshot(page, tmp_path, "dashboard-dark-curves.png")
    page.goto(f"{url}/rollouts?run=crafted&step=1")
    expect(page.get_by_test_id("stMetricValue").nth(0)).to_have_text("8 / 8", timeout=60_000)
    screenshot(page, tmp_path, "dashboard-dark-rollouts.png")


def test_grouped_curves_and_a_runs_table_that_shows_every_run(dashboard, page, tmp_path):
    """Five runs of two setups (K 0.4: seeds 0-2; K 0.6: seeds 0-1) and six more: the Runs table shows all eleven
    (a 10-row box hid the eleventh), and grouping on Training curves turns five lines into two means with bands."""
    from tests.synthetic import write_run

    runs_dir = tmp_path / "runs"
    grid = []
    for k, seeds in ((0.4, (0, 1, 2)), (0.6, (0, 1))):
        for seed in seeds:
            grid.append(f"grid-k{k}-s{seed}")
            write_run(runs_dir, grid[-1], steps=4, prompts_per_step=2, group_size=4, k=k, seed=seed)
    for i in range(6):
        write_run(runs_dir, f"other-{i}", steps=1, prompts_per_step=1, group_size=4, seed=10 + i)
    url = dashboard(runs_dir, refresh="off")
    page.goto(url)
    table = page.get_by_test_id("stDataFrame").first
    expect(table).to_contain_text("grid-k0.4-s0", timeout=60_000)
    assert table.bounding_box()["height"] >= 35 * 12  # header and 11 rows, no inner scrolling
    expect(table).to_contain_text("other-0")  # the first run listed last (newest first): in view
    page.goto(f"{url}/curves?" + "&".join(f"run={run_id}" for run_id in grid) + "&smooth=none")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=90_000)
    names = "document.querySelectorAll('.js-plotly-plot')[0].data.map(t => t.name)"
    assert set(grid) <= set(page.evaluate(names))
    page.get_by_test_id("stCheckbox").filter(has_text="Group runs").locator("label").click()
    page.wait_for_function(f"{names}.includes('k=0.4')", timeout=60_000)
    traces = page.evaluate("document.querySelectorAll('.js-plotly-plot')[0].data.map(t => [t.name, t.fill || ''])")
    assert [name for name, fill in traces if not fill and "warnings" not in name] == ["k=0.4", "k=0.6"]
    assert len([name for name, fill in traces if fill == "toself"]) == 2  # one band a group
    assert "group=true" in page.url
    expect(page.get_by_text("Grouped by everything but the seed")).to_be_visible()
    screenshot(page, tmp_path, "dashboard-grouped.png")


def test_a_link_to_a_run_that_is_not_there_says_so_until_it_appears(dashboard, page, tmp_path):
    """`?run=ghost` drew the newest run and rewrote the URL to name it. Now the page says the run is not there, draws
    nothing else, keeps the link, and shows the run once it appears (a link to a run about to start)."""
    from tests.dashboard.helpers import _write_crafted

    runs_dir = tmp_path / "runs"
    _write_crafted(runs_dir, "newest")
    url = dashboard(runs_dir, refresh="2")
    page.goto(f"{url}/curves?run=ghost")
    warning = page.get_by_test_id("stAlert").filter(has_text="ghost")
    expect(warning).to_be_visible(timeout=60_000)
    time.sleep(5)  # two refresh intervals: nothing else is drawn and the link stays
    assert page.query_selector(".js-plotly-plot") is None
    assert "newest" not in page.get_by_test_id("stMain").inner_text()
    assert "run=ghost" in page.url and "run=newest" not in page.url
    screenshot(page, tmp_path, "dashboard-unknown-run.png")
    _write_crafted(runs_dir, "ghost")  # the run appears
    expect(page.get_by_text("ghost · finished · step 3 / 3")).to_be_visible(timeout=60_000)
    expect(warning).to_have_count(0)
    assert "run=ghost" in page.url


def test_runs_told_apart_at_1400_and_1920(dashboard, page, tmp_path, hold_lock):
    """Issue 39, in a real browser at both widths: the Runs table of a typical folder (a sweep of QAE K=0.4 and GRPO
    over seeds 0-2, two runs that differ only in a switch each, one still training, tags and a note, the controls
    on) fits without
    scrolling sideways and says what tells each run apart; the sidebar's chips show the picked seeds' whole ids (seed 0
    and seed 1 read alike when cut), with the id on hover, and under them what differs. A run caught halfway through
    `rm -r` (database gone) leaves the page at the next reload once the rest of it goes."""
    import json

    from tests.synthetic import write_run

    runs_dir = tmp_path / "runs"
    sweep = {"sweep_id": "3f9a1c77aa", "sweep_name": "sweep-3f9a1c"}
    for estimator in ("qae", "grpo"):
        for seed in (0, 1, 2):
            name = f"sweep-3f9a1c-{estimator}{'-k0.4' if estimator == 'qae' else ''}-s{seed}"
            write_run(
                runs_dir,
                name,
                steps=3,
                prompts_per_step=2,
                group_size=4,
                seed=seed,
                eval_every=3,
                config={**sweep, "estimator": estimator},
            )
    write_run(
        runs_dir,
        "20261130-113105-qae",
        steps=3,
        prompts_per_step=2,
        group_size=4,
        eval_every=3,
        config={"dynamic_sampling": True},
    )
    write_run(
        runs_dir,
        "20261130-113512-qae",
        steps=3,
        prompts_per_step=2,
        group_size=4,
        eval_every=3,
        config={"log_entropy_attribution": True},
    )
    write_run(
        runs_dir,
        "20261203-221500-qae",
        steps=3,
        prompts_per_step=2,
        group_size=4,
        eval_every=3,
        status=None,
        config={"steps": 300},
    )  # (a live run: its pace and ETA shown)
    hold_lock(runs_dir / "20261203-221500-qae")
    write_run(runs_dir, "half-removed", steps=1, prompts_per_step=1, group_size=4)
    (runs_dir / "half-removed" / CONFIG_FILE).write_text(json.dumps({"steps": 1}))
    (runs_dir / "half-removed" / DB_FILE).unlink()  # `rm -r` removed the database first
    labels = {"sweep-3f9a1c-qae-k0.4-s0": ["tag", "baseline"], "20261130-113105-qae": ["note", "dapo check"]}
    for run_id, (command, value) in labels.items():
        subprocess.run([str(QAE), command, run_id, value, "--runs-dir", str(runs_dir)], check=True, capture_output=True)
    seeds = ["sweep-3f9a1c-qae-k0.4-s0", "sweep-3f9a1c-qae-k0.4-s1"]
    url = dashboard(runs_dir, refresh="off")
    for width in (1400, 1920):
        page.set_viewport_size({"width": width, "height": 1200})
        page.goto(f"{url}/?" + "&".join(f"run={run_id}" for run_id in seeds))
        table = page.get_by_test_id("stDataFrame").first
        expect(table).to_contain_text("log_entropy_attribution", timeout=60_000)
        expect(table).to_contain_text("seed=2, estimator=grpo")
        wait_idle(page)
        scroll = table.evaluate(
            "d => { const s = d.querySelector('.dvn-scroller'); return [s.scrollWidth, s.clientWidth]; }"
        )
        assert scroll[0] <= scroll[1], (width, scroll)  # no scrolling sideways
        chips = page.get_by_test_id("stSidebar").locator("[data-tag] span[title]")
        expect(chips).to_have_count(2)
        for i, run_id in enumerate(seeds):
            shown = chips.nth(i).evaluate("s => [s.title, s.innerText, s.scrollWidth, s.clientWidth]")
            assert shown[0] == run_id and shown[1].replace("\n", "") == run_id and shown[2] <= shown[3], shown
        sidebar = page.get_by_test_id("stSidebar").inner_text()
        assert f"{seeds[0]}: seed=0" in sidebar and f"{seeds[1]}: seed=1" in sidebar
        screenshot(page, tmp_path, f"dashboard-runs-apart-{width}.png")
    expect(page.get_by_test_id("stMain")).to_contain_text("half-removed")  # listed, its database gone
    shutil.rmtree(runs_dir / "half-removed")
    page.reload()
    expect(table).to_contain_text("log_entropy_attribution", timeout=60_000)
    wait_idle(page)
    assert "half-removed" not in page.get_by_test_id("stMain").inner_text()


def test_an_opened_response_shows_every_token_coloured_with_its_numbers_on_hover(dashboard, page, tmp_path):
    """Issue 49: the token view in a real browser. The crafted run's tokens hold markup and a terminal escape: each
    token is a span of its own text (no <script> runs, no tag is made), its background the chosen number, and its
    numbers in the hover title."""
    from tests.dashboard.helpers import EVIL_RESPONSE, _write_crafted, crafted_tokens

    runs_dir = tmp_path / "runs"
    _write_crafted(runs_dir)
    url = dashboard(runs_dir, refresh="off")
    page.goto(f"{url}/rollouts?run=crafted&step=3&color=logprob")
    wait_idle(page)
    expect(page.get_by_test_id("stMetricValue").nth(0)).to_have_text("8 / 8", timeout=60_000)
    opener = page.get_by_test_id("stSelectbox").filter(has_text="Open a response in full").first
    pick_option(page, opener, re.compile(r"^sample 3 · "))
    tokens = page.locator(".qae-tokens .qae-token")
    expected = crafted_tokens(EVIL_RESPONSE)
    expect(tokens).to_have_count(len(expected), timeout=60_000)
    assert page.locator(".qae-tokens script, .qae-tokens b, .qae-tokens a").count() == 0
    assert [tokens.nth(i).text_content() for i in range(len(expected))] == expected
    first = tokens.nth(0)
    first.hover()
    shown = first.evaluate("e => getComputedStyle(e, '::after').content")  # what the hover shows
    assert shown.startswith('"#0 \\"\\\\u003cscript\\\\u003ealert') and "logprob -0.5 · entropy 0.25" in shown, shown
    shades = page.evaluate(
        "[...document.querySelectorAll('.qae-tokens .qae-token')].map(s => getComputedStyle(s).backgroundColor)"
    )
    assert shades[0] == "rgba(214, 39, 40, 0.08)" and shades[-1] != shades[0]  # -0.5 of -5: a tenth of the way
    screenshot(page, tmp_path, "dashboard-token-view.png")
