"""Runs told apart on the dashboard (issue 39): the Runs page follows the folder (a deleted run disappears on the next
refresh), the Runs table and the sidebar say what tells each run apart (analysis.differences, as `qae runs` does).
AppTest on runs written through the real store; the browser's side (widths, hover) is in test_dashboard_browser.py."""

from __future__ import annotations

import json
import shutil

import pytest

from qae_app.store.run_folder import CONFIG_FILE, DB_FILE
from tests.dashboard.helpers import frames, make_app, texts
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
        (folder / CONFIG_FILE).write_text(json.dumps({"steps": 2}))
        (folder / DB_FILE).unlink()  # `rm -r` removed the database first
    app = make_app(runs, monkeypatch)
    assert sorted(listed(app())) == ["gone", "kept"]
    shutil.rmtree(folder)
    assert listed(app()) == ["kept"]  # a new session (a reload) on the same server


DYNAMIC, ATTRIBUTION = "20261130-113105-qae", "20261130-113512-qae"
SEEDS = {f"sweep-3f9a1c-qae-k0.4-s{seed}": seed for seed in (0, 1)}


@pytest.fixture(scope="module")
def apart_dir(tmp_path_factory):
    """As tests/cli/test_runs_apart.py: two runs that differ only in a switch each, and two seeds of a sweep."""
    runs = tmp_path_factory.mktemp("apart") / "runs"
    write_run(runs, DYNAMIC, steps=20, prompts_per_step=2, group_size=4, config={"dynamic_sampling": True})
    write_run(runs, ATTRIBUTION, steps=20, prompts_per_step=2, group_size=4, config={"log_entropy_attribution": True})
    for run_id, seed in SEEDS.items():
        write_run(
            runs,
            run_id,
            steps=4,
            prompts_per_step=2,
            group_size=4,
            seed=seed,
            config={"sweep_id": "3f9a1c77aa", "sweep_name": "sweep-3f9a1c"},
        )
    return runs


def test_the_runs_table_says_what_tells_each_run_apart(apart_dir, monkeypatch):
    """The same words as `qae runs` (analysis.differences): what varies across the runs listed, per run; what they all
    share and is not the default, once above the table, with the estimator and K they all train with."""
    at = make_app(apart_dir, monkeypatch)()
    table = frames(at)[0].set_index("run_id")
    # the seed first: the column is cut at its width (190 px), and the seed tells a sweep's runs apart (it was last,
    # and cut, before)
    assert table.loc[DYNAMIC, "differs"] == "seed=0, dynamic_sampling"
    assert table.loc[ATTRIBUTION, "differs"] == "seed=0, log_entropy_attribution"
    assert table.loc["sweep-3f9a1c-qae-k0.4-s1", "differs"] == "seed=1"
    assert (
        "Every run listed: qae K=0.4; group_size=4, prompts_per_step=2, lr=1e-05, entropy_low=0.5, entropy_high=3, "
        "eval_every=0 (not the defaults)"
    ) in texts(at).replace("\\", "")  # (markdown's escapes dropped)


def sidebar_text(at) -> str:
    """The sidebar's captions, as read (markdown's escapes dropped)."""
    return "\n".join(str(caption.value) for caption in at.sidebar.caption).replace("\\", "")


def test_the_sidebar_says_what_tells_the_picked_runs_apart(apart_dir, monkeypatch):
    """Seed 0 and seed 1 of a sweep: their whole ids and what differs between the two picked, under the picker."""
    said = sidebar_text(make_app(apart_dir, monkeypatch)(run=list(SEEDS)))
    for run_id, seed in SEEDS.items():
        assert f"{run_id}**: seed={seed}" in said
    assert "dynamic_sampling" not in said  # (what differs among the picked runs, not the whole folder)
    said = sidebar_text(make_app(apart_dir, monkeypatch)(run=[DYNAMIC]))  # one run: its options not at their default
    assert f"{DYNAMIC}**: steps=20, group_size=4, prompts_per_step=2, dynamic_sampling, lr=1e-05" in said
