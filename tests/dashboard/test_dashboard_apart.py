"""Runs told apart on the dashboard (issue 39): the Runs page follows the folder (a deleted run disappears on the next
refresh), the Runs table and the sidebar say what tells each run apart (analysis.differences, as `qae runs` does).
AppTest on runs written through the real store; the browser's side (widths, hover) is in test_dashboard_browser.py."""

from __future__ import annotations

import json
import shutil

import pytest

from qae_app.store import run_folder as rundir
from tests.dashboard.helpers import frames, make_app
from tests.synthetic import write_run


def listed(at) -> list[str]:
    return [str(run_id) for run_id in frames(at)[0]["run_id"]]


@pytest.mark.parametrize("kind", ["not a run", "lost its database"])
def test_a_deleted_folder_leaves_the_runs_page_on_the_next_draw(tmp_path, monkeypatch, kind):
    """The page's cached listing was keyed by the run folders (those holding a database) only: a folder listed as not
    a run, or a run caught by the page halfway through `rm -r` (its database gone, its config.json not yet), stayed
    listed after it was gone, across reloads."""
    runs = tmp_path / "runs"
    write_run(runs, "kept", steps=2, prompts_per_step=1, group_size=4)
    folder = runs / "gone"
    if kind == "not a run":
        folder.mkdir()
        (folder / "notes.txt").write_text("not a run")
    else:
        write_run(runs, "gone", steps=2, prompts_per_step=1, group_size=4)
        (folder / rundir.CONFIG_FILE).write_text(json.dumps({"steps": 2}))
        (folder / rundir.DB_FILE).unlink()  # `rm -r` removed the database first
    app = make_app(runs, monkeypatch)
    assert sorted(listed(app())) == ["gone", "kept"]
    shutil.rmtree(folder)
    assert listed(app()) == ["kept"]  # a new session (a reload) on the same server
