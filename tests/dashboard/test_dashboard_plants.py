"""The plant harness (tests/plants.py) on the dashboard: a real `qae dashboard` server and a real headless Chromium on a
runs folder holding one run per plant in the files the dashboard reads (the database, its WAL, config.json,
labels.json, trainer.lock, a pending write) beside an untouched run. Every page, with every run picked, must draw
(waited for, never timed), raise no exception, print nothing from outside the folder, and run no payload; the Runs
page lists every run, a planted one with why it is not read."""

from __future__ import annotations

import shutil
import subprocess
from urllib.parse import urlencode

import pytest

from tests.dashboard.helpers import free_port, wait_healthy
from tests.dashboard.test_dashboard_browser import CHROMIUM, QAE, sync_api, wait_idle
from tests.plants import (
    DB_VARIANTS,
    FILE_VARIANTS,
    MARKER,
    OTHER,
    PENDING,
    RUN,
    SECRET,
    Plant,
    make_base_run,
    plant_file,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing"),
]

PAGES = ("", "curves", "distributions", "rollouts", "prompts", "evals", "eval_samples", "compare")
DASHBOARD_FILES = ("qae.duckdb", "config.json", "labels.json", "trainer.lock", PENDING)


def dashboard_plants() -> list[Plant]:
    plants = [Plant(target, variant) for target in DASHBOARD_FILES for variant in FILE_VARIANTS]
    plants += [Plant("qae.duckdb", variant) for variant in DB_VARIANTS]
    return plants + [Plant("qae.duckdb.wal", variant) for variant in ("link-out", "fifo", "garbage")]


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory):
    """(runs dir, case folder, run ids): `ok` and one run folder per plant (checkpoints left out: no page reads
    them), all in one runs dir."""
    base = make_base_run(tmp_path_factory.mktemp("base"))
    case = tmp_path_factory.mktemp("dash-plants")
    runs, outside = case / "runs", case / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    ignore = shutil.ignore_patterns("checkpoints")
    shutil.copytree(base / RUN, runs / OTHER, ignore=ignore)
    ids = [OTHER]
    for i, plant in enumerate(dashboard_plants()):
        run = f"p{i:03d}"
        shutil.copytree(base / RUN, runs / run, ignore=ignore)
        plant_file(runs / run, plant, case / MARKER, outside)
        ids.append(run)
    return runs, case, ids


def test_every_page_draws_over_a_folder_of_plants(planted_runs, tmp_path):
    runs, case, ids = planted_runs
    port = free_port()
    log = open(tmp_path / "dashboard.log", "w")
    server = subprocess.Popen(
        [str(QAE), "dashboard", "--runs-dir", str(runs), "--port", str(port), "--refresh", "off"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    found = []
    try:
        wait_healthy(port, server)
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            for view in PAGES:
                page.goto(f"http://127.0.0.1:{port}/{view}?" + urlencode([("run", run) for run in ids]))
                # drawn: its header, then the script done (a page that never draws fails here: a hang)
                page.wait_for_selector("[data-testid=stMain] [data-testid=stHeading]", timeout=300_000)
                wait_idle(page, timeout_s=300)
                body, main = page.inner_text("body"), page.inner_text("[data-testid=stMain]")
                if page.query_selector("[data-testid=stException]"):
                    found.append(f"{view or 'runs'}: an exception: {main[:600]}")
                if SECRET in body:
                    found.append(f"{view or 'runs'}: a file from outside the run folder is shown")
                if view == "" and f"{len(ids)} runs: " not in main:  # every run listed, a planted one with why
                    found.append(f"runs: not every run is listed: {main[-600:]}")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert not (case / MARKER).exists(), "a planted payload ran"
    assert found == [], "\n".join(found) + "\n" + (tmp_path / "dashboard.log").read_text()[-3000:]
