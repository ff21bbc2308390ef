"""The dashboard's controls (issue 38): the Training curves header stops a live run of this machine as `qae stop` does,
the Runs table edits tags and notes (labels.json, while the run trains), and a dashboard without controls
(`--read-only`, a --host other than loopback) shows none. AppTest on a run whose lock a small process holds (as a
trainer does), and a real browser on a real `qae train`."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from qae_app.cli.dashboard_command import dashboard_controls
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.store.labels import Labels, read_labels, tags_from_text, write_labels
from qae_app.store.reader import read_run, read_steps
from qae_app.store.run_folder import db_path, latest_checkpoint
from qae_app.store.writer import RunWriter
from tests.dashboard.helpers import _crafted_rows, make_app


def write_live_run(runs_dir: Path, run_id: str = "live") -> None:
    """A run stored as running with one step (its trainer: `hold_lock`)."""
    writer = RunWriter(db_path(runs_dir, run_id), run_id)
    writer.create_run(run_id, {"steps": 10}, "qae", 0.4, "builtin:tiny", "arith", 0)
    writer.add_step(1, **_crafted_rows(1))
    assert writer.flush()


def test_tags_typed_in_a_cell_are_checked_and_kept_once_in_order():
    assert tags_from_text("baseline, lr-too-high  paper,baseline") == ["baseline", "lr-too-high", "paper"]
    assert tags_from_text("") == [] and tags_from_text(" , ") == []
    with pytest.raises(QAEUserError, match="'lr/high' is not a tag"):
        tags_from_text("ok lr/high")


@pytest.mark.parametrize(
    "host, asked, shown",
    [
        ("127.0.0.1", None, True),
        ("localhost", None, True),
        ("::1", None, True),
        ("127.0.0.2", None, True),
        ("0.0.0.0", None, False),
        ("192.168.1.20", None, False),
        ("myhost", None, False),
        ("0.0.0.0", True, True),
        ("127.0.0.1", False, False),
    ],
)
def test_controls_only_on_loopback_unless_asked(host, asked, shown):
    """`qae dashboard`: controls on a loopback --host; none elsewhere unless --controls; none with --read-only."""
    assert dashboard_controls(host, asked) is shown


def test_the_header_stops_a_live_run_of_this_machine(tmp_path, hold_lock, monkeypatch):
    runs_dir = tmp_path / "runs"
    write_live_run(runs_dir)
    holder = hold_lock(runs_dir / "live")
    monkeypatch.setenv(names.DASHBOARD_CONTROLS_ENV, "1")
    at = make_app(runs_dir, monkeypatch)("curves", run=["live"])
    assert [button.label for button in at.button] == ["Stop live now"]
    assert [block.proto.popover.label for block in at.get("popover")] == ["Stop live"]
    assert holder.poll() is None  # opening the page (and the confirmation) signals nobody
    at.button(key="stop_live").click().run()
    assert not at.exception
    assert holder.wait(timeout=30) == 0 and holder.stdout.read().strip() == "SIGTERM"


@pytest.mark.parametrize("controls", [None, "0"])
def test_without_controls_a_live_run_has_no_stop_and_the_runs_table_no_edits(
    tmp_path, hold_lock, monkeypatch, controls
):
    runs_dir = tmp_path / "runs"
    write_live_run(runs_dir)
    holder = hold_lock(runs_dir / "live")
    if controls is not None:
        monkeypatch.setenv(names.DASHBOARD_CONTROLS_ENV, controls)
    else:
        monkeypatch.delenv(names.DASHBOARD_CONTROLS_ENV, raising=False)  # the app started by hand
    app = make_app(runs_dir, monkeypatch)
    at = app("curves", run=["live"])
    assert "live · running · step 1 / 10" in [text.value for text in at.text][0]
    assert list(at.button) == [] and list(at.get("popover")) == []
    runs_page = app(None)
    assert [frame.proto.editing_mode for frame in runs_page.dataframe][0] == 0  # READ_ONLY
    assert "Edit a run's" not in " ".join(caption.value for caption in runs_page.caption)
    assert holder.poll() is None


def test_with_controls_the_runs_table_edits_tags_and_notes_only(tmp_path, monkeypatch):
    runs_dir = tmp_path / "runs"
    write_live_run(runs_dir)
    monkeypatch.setenv(names.DASHBOARD_CONTROLS_ENV, "1")
    at = make_app(runs_dir, monkeypatch)(None)
    table = at.dataframe[0]
    assert table.proto.editing_mode != 0  # editable
    assert {"tags", "note"} <= set(table.value.columns)
    assert "Edit a run's **tags**" in " ".join(caption.value for caption in at.caption)


# ---------------------------------------------------------------------------------------------------------------
# a real browser on a real `qae train`


@pytest.fixture
def browser_page():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
    from tests.dashboard.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1600})
        finally:
            browser.close()


@pytest.fixture
def serve(start, tmp_path):
    """serve(runs_dir, *options) -> the URL of a `qae dashboard` with refresh off (a click never lands on a check)."""
    from tests.dashboard.helpers import free_port, wait_healthy
    from tests.dashboard.test_dashboard_browser import QAE

    def run(runs_dir: Path, *options: str) -> str:
        port = free_port()
        log = open(tmp_path / f"dashboard-{port}.log", "w")
        process = start(
            [str(QAE), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port), "--refresh", "off", *options],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_healthy(port, process)
        return f"http://127.0.0.1:{port}"

    return run


@pytest.fixture
def start(request):
    from tests.dashboard.test_dashboard_browser import stop

    def run(args: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(args, **kwargs)
        request.addfinalizer(lambda: stop(process))
        return process

    return run


# The grid draws on a canvas; beside it glide keeps an accessibility table that says which cell is selected, its
# column, whether it can be edited and its text: the tests steer and check by it, not by pixels.
SELECTED_CELL = """table => {
    const cell = table.querySelector('td[aria-selected=true]');
    if (!cell) return null;
    const header = table.querySelectorAll('th')[Number(cell.getAttribute('aria-colindex')) - 1];
    return {column: header ? header.textContent : null, readonly: cell.getAttribute('aria-readonly') === 'true',
            text: cell.textContent, row: cell.id};
}"""


def select_cell(page, table, column: str) -> dict:
    """Select the first row's cell under `column` as a hand does: click the run id (the first column: `shown` is in
    the column menu; the grid ignores a click that no pointer move led to the cell), then arrow right until the grid
    says that cell is selected; click again when an arrow moved nothing (the click went unnoticed: the grid has no
    keyboard focus). Returns what the grid says of the cell."""
    box = table.bounding_box()
    cell = box["x"] + 15, box["y"] + 35 + 17  # header 35 px, the first row's middle
    selected = None
    for _ in range(3):
        page.mouse.move(*cell)
        time.sleep(0.5)
        page.mouse.click(*cell)
        time.sleep(0.5)
        selected = table.evaluate(SELECTED_CELL)
        for _ in range(12):
            if selected is None or selected["column"] == column:
                break
            page.keyboard.press("ArrowRight")
            time.sleep(0.3)
            moved, selected = selected, table.evaluate(SELECTED_CELL)
            if selected == moved:
                break
        if selected is not None and selected["column"] == column:
            return selected
    raise AssertionError(f"no {column!r} cell right of the run id could be selected (last selected: {selected})")


def edit_cell(page, table, column: str, text: str) -> dict:
    """Type `text` into the first row's `column` cell: select it, Enter opens its editor (glide's textarea), the text
    goes into that textarea, Enter commits. Returns what the grid says of the cell afterwards (its text: what the grid
    took) and what the editor held before the commit. (Keys typed the moment the editor appeared could reach the grid
    before the editor had focus, on a loaded machine: CI saw an empty cell after three tries. `fill` focuses the
    editor and types there, as input events, as a user's typing arrives.)"""
    selected = select_cell(page, table, column)
    page.keyboard.press("Enter")
    editor = page.locator("textarea.gdg-input")
    editor.wait_for(state="visible", timeout=10_000)
    if editor.is_editable():
        editor.fill(text)
    else:  # a read-only cell's editor (it only shows the text): the keys a user would type, which must change nothing
        editor.focus()
        page.keyboard.type(text)
    typed = editor.input_value()
    editor.press("Enter")
    deadline = time.monotonic() + 10
    while (shown := table.evaluate(SELECTED_CELL) or selected)["text"] != text and time.monotonic() < deadline:
        time.sleep(0.2)
    return {**shown, "editor_held": typed}


def edit_until_kept(page, table, column: str, text: str, kept, tmp_path: Path, tries: int = 3) -> None:
    """Type `text` into the cell as `edit_cell` does until `kept()` says labels.json holds it: an edit that lands
    while the page reruns can be dropped, and a user types it again. Fails when no try was kept, with what the grid
    showed and a screenshot."""
    from tests.dashboard.test_dashboard_browser import wait_idle

    seen = []
    for attempt in range(tries):
        wait_idle(page)
        seen.append(edit_cell(page, table, column, text))
        deadline = time.monotonic() + 30
        while not kept() and time.monotonic() < deadline:
            time.sleep(0.5)
        if kept():
            return
        page.screenshot(path=str(tmp_path / f"edit-{column}-{attempt}.png"))
    logs = "".join(path.read_text()[-2000:] for path in tmp_path.glob("dashboard-*.log"))
    raise AssertionError(
        f"{text!r} typed {tries} times, never kept in labels.json; the grid's cell after each "
        f"try: {seen}; screenshots in {tmp_path}; the dashboard's log: {logs}"
    )


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is missing")
def test_edit_tags_and_a_note_then_stop_a_training_run_from_the_browser(start, serve, browser_page, tmp_path):
    """While `qae train` trains: a tag and a note typed into the Runs table land in labels.json and `qae runs`; the
    Training curves header's stop control (with its confirmation) ends the run `interrupted` at a step boundary."""
    from tests.dashboard.test_dashboard_browser import QAE, start_trainer, wait_for_steps

    pytest.importorskip("playwright.sync_api")
    expect = __import__("playwright.sync_api", fromlist=["expect"]).expect
    runs_dir = tmp_path / "runs"
    trainer = start_trainer(start, runs_dir, tmp_path, "live")
    wait_for_steps(db_path(runs_dir, "live"), trainer, tmp_path / "train-live.log", 1)
    url = serve(runs_dir)
    page = browser_page
    page.goto(url)
    table = page.get_by_test_id("stDataFrame").first
    expect(table).to_contain_text("live", timeout=90_000)
    expect(page.get_by_text("Edit a run's")).to_be_visible()
    # columns: shown, run, tags, note, ...
    edit_until_kept(
        page,
        table,
        "tags",
        "baseline lr-too-high",
        lambda: read_labels(runs_dir / "live").tags == ["baseline", "lr-too-high"],
        tmp_path,
    )
    expect(table).to_contain_text("baseline, lr-too-high", timeout=60_000)
    edit_until_kept(
        page, table, "note", "lr too high?", lambda: read_labels(runs_dir / "live").note == "lr too high?", tmp_path
    )
    assert trainer.poll() is None  # the run trained on through both edits
    listed = subprocess.run(
        [str(QAE), "runs", "--runs-dir", str(runs_dir), "--tag", "lr-too-high"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"},
    )
    assert listed.returncode == 0 and re.search(r"live .*baseline, lr-too-high", listed.stdout), listed.stdout

    page.goto(f"{url}/curves?run=live")
    expect(page.get_by_text(re.compile(r"live · running · step \d+ / 5000"))).to_be_visible(timeout=90_000)
    page.get_by_role("button", name="Stop live").click()
    page.get_by_role("button", name="Stop live now").click()
    assert trainer.wait(timeout=180) == 130  # the trainer's own exit for a stop it was asked for
    run = read_run(db_path(runs_dir, "live"))
    assert run["status"] == "interrupted"
    assert latest_checkpoint(runs_dir / "live").name == f"step-{run['last_step']}"  # written on the way out


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="/usr/bin/chromium is missing")
def test_a_read_only_dashboard_shows_no_controls(serve, browser_page, tmp_path, hold_lock):
    """`--read-only`, and a --host other than loopback: a live run of this machine has no stop control, and what is
    typed into the Runs table's tags cell changes nothing (the grid only shows a cell's text)."""
    from tests.dashboard.test_dashboard_browser import wait_idle

    expect = pytest.importorskip("playwright.sync_api").expect
    runs_dir = tmp_path / "runs"
    write_live_run(runs_dir)
    write_labels(runs_dir / "live", Labels(tags=["kept"]))  # (a tags column shows without controls only when set)
    holder = hold_lock(runs_dir / "live")
    page = browser_page
    for options in (["--read-only"], ["--host", "0.0.0.0"]):
        url = serve(runs_dir, *options)
        page.goto(f"{url}/curves?run=live")
        expect(page.get_by_text("live · running · step 1 / 10")).to_be_visible(timeout=90_000)
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 9", timeout=90_000)
        wait_idle(page)
        assert page.get_by_role("button", name=re.compile("^Stop")).count() == 0
        page.goto(url)
        table = page.get_by_test_id("stDataFrame").first
        expect(table).to_contain_text("live", timeout=90_000)
        wait_idle(page)
        assert page.get_by_text("Edit a run's").count() == 0
        assert select_cell(page, table, "tags")["readonly"]  # the grid itself says the cell cannot be edited
        edit_cell(page, table, "tags", "sneaky")
        page.keyboard.press("Escape")
        page.reload()  # a full round trip to the server after the typing: a saved edit would be read back
        expect(page.get_by_test_id("stDataFrame").first).to_contain_text("live", timeout=90_000)
        wait_idle(page)
        assert "sneaky" not in page.get_by_test_id("stDataFrame").first.inner_text()
        assert read_labels(runs_dir / "live").tags == ["kept"]
    assert holder.poll() is None


def test_curves_grouped_by_tags(tmp_path, monkeypatch):
    """Training curves' "Group by" offers the runs' tags: runs with the same tags form a group, whatever their config;
    the line is the mean of the group's runs as their DuckDB files hold them."""
    from tests.dashboard.helpers import plotly_specs
    from tests.synthetic import write_run

    runs_dir = tmp_path / "runs"
    tags = {"r-a": ["baseline"], "r-b": ["baseline"], "r-c": ["idea"]}
    for seed, run_id in enumerate(tags):
        write_run(runs_dir, run_id, steps=3, prompts_per_step=2, group_size=4, k=0.4 + 0.1 * seed, seed=seed)
        write_labels(runs_dir / run_id, Labels(tags=tags[run_id]))
    at = make_app(runs_dir, monkeypatch)("curves", run=list(tags), smooth="none", group="true", group_by="tags")
    assert set(at.multiselect(key="group_by").options[:3]) == {"k", "seed", "tags"}  # those that differ, first
    lines = {
        t["uid"]: t
        for t in plotly_specs(at)["entropy"]["data"]
        if not t["uid"].endswith("band") and "warning" not in t["uid"]
    }
    assert set(lines) == {"tags=baseline", "tags=idea"}
    entropy = {run_id: read_steps(db_path(runs_dir, run_id))["entropy"] for run_id in tags}
    assert lines["tags=baseline"]["y"] == pytest.approx(((entropy["r-a"] + entropy["r-b"]) / 2).tolist())
    assert lines["tags=idea"]["y"] == pytest.approx(entropy["r-c"].tolist())
