"""The dashboard (dashboard/, installed as qae_app.dashboard): its pages run with Streamlit's AppTest, its readers and
charts, the real server, and a real browser on it. The run folders the pages are tested on, and AppTest runners on
them, are fixtures here (on tests/conftest.py's tiny_run), and so is a process that holds a run's lock as its
trainer does; the plain helpers are in helpers.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qae_app.store.run_folder import LOCK_FILE, db_path
from qae_app.store.writer import RunWriter
from tests.dashboard.helpers import HOLDER, _write_crafted, make_app
from tests.synthetic import write_run

try:
    from playwright.sync_api import expect
except ImportError:  # the browser tests skip themselves
    pass
else:
    # Playwright's default wait is 5 s per assertion. The page can show its heading before a big dataframe below it
    # has drawn, and on CI's busy 2 cores that took longer than 5 s (issue 50 item 6's CI run): every assertion
    # waits up to a minute, as wait_idle does. A passing wait returns as soon as the text is there.
    expect.set_options(timeout=60_000)


@pytest.fixture(scope="module")
def runs_dir(tiny_run, tmp_path_factory) -> Path:
    """A runs dir with a copy of the real tiny run, a crafted finished run and a crafted empty running run."""
    tiny_dir, tiny_id = tiny_run
    out = tmp_path_factory.mktemp("dash_runs")
    (out / tiny_id).mkdir()
    shutil.copy(db_path(tiny_dir, tiny_id), db_path(out, tiny_id))  # the database only, not checkpoints
    _write_crafted(out)
    empty = RunWriter(db_path(out, "empty"), "empty")
    empty.create_run("empty", {"steps": 10}, "grpo", None, "builtin:tiny", "arith", 0)
    return out


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> Path:
    """Runs without training (quick): the crafted run, a copy of its folder, and a synthetic run of 12 groups a
    step over 6 prompts (so prompts come back at irregular steps and the rollouts page has two pages of groups)."""
    out = tmp_path_factory.mktemp("small_runs")
    _write_crafted(out)
    shutil.copytree(out / "crafted", out / "crafted-copy")
    write_run(out, "syn", steps=8, prompts_per_step=12, group_size=4, n_prompts=18, eval_every=4, seed=3)
    return out


@pytest.fixture
def app(runs_dir, monkeypatch):
    return make_app(runs_dir, monkeypatch)


@pytest.fixture
def small_app(small_dir, monkeypatch):
    return make_app(small_dir, monkeypatch)


@pytest.fixture
def hold_lock(request):
    """hold_lock(run_dir) -> a process holding the run's lock, ended when the test ends."""

    def hold(run_dir: Path) -> subprocess.Popen:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir / LOCK_FILE)], stdout=subprocess.PIPE, text=True
        )
        request.addfinalizer(holder.kill)
        assert holder.stdout.readline().strip() == "held"
        return holder

    return hold
