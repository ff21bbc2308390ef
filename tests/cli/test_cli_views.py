"""`qae runs`, `qae show` and `qae rollouts` at 80 and 200 columns: snapshots of the whole output (runs written
through the real store, no training), plus what must hold at any width: no line wider than the terminal, no number
or id cut short, the status and the config printed, and the gating breakdown equal to the database's.

Snapshots live in tests/cli/snapshots/; after a deliberate change of the views, rewrite them with
`QAE_UPDATE_SNAPSHOTS=1 python -m pytest tests/cli/test_cli_views.py` and read the diff.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.views import shared_prefix
from qae_app.core.formatting import number
from qae_app.core.names import GATE_REASONS
from qae_app.store.reader import (
    last_logged_step,
    query,
    read_gate_breakdown,
    read_last_step,
    read_rollouts,
    read_runs,
    read_steps,
    run_summaries,
)
from qae_app.store.run_folder import db_path
from qae_app.store.writer import RunWriter
from tests.synthetic import write_run

SNAPSHOTS = Path(__file__).parent / "snapshots"
WIDTHS = (80, 200)
LONG_A, LONG_B = "20261130-113105-qae", "20261130-114512-qae-k0.3"
runner = CliRunner()


@pytest.fixture(scope="module")
def runs_cwd(tmp_path_factory) -> Path:
    """A folder holding `runs/`: two finished runs with default-style ids that share their date and a run whose
    trainer died (stored running, nobody holds it)."""
    cwd = tmp_path_factory.mktemp("cli")
    runs = cwd / "runs"
    write_run(runs, LONG_A, steps=30, prompts_per_step=4, group_size=8, n_prompts=20, eval_every=10, seed=1)
    write_run(runs, LONG_B, steps=12, prompts_per_step=4, group_size=8, n_prompts=20, k=0.3, seed=2)
    write_run(runs, "killed", steps=5, prompts_per_step=2, group_size=4, status=None, config={"steps": 50})
    return cwd


@pytest.fixture(scope="module")
def broken_cwd(runs_cwd, tmp_path_factory) -> Path:
    """The same runs and a file that is not a database (its reason names a path, so it is kept out of snapshots)."""
    cwd = tmp_path_factory.mktemp("cli_broken")
    shutil.copytree(runs_cwd / "runs", cwd / "runs")
    (cwd / "runs" / "broken").mkdir()
    (cwd / "runs" / "broken" / "qae.duckdb").write_bytes(b"not a duckdb file " * 300)
    return cwd


def invoke(cwd: Path, width: int, *args: str) -> str:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = runner.invoke(app, [*args, "--runs-dir", "runs"], env={"COLUMNS": str(width)})
    finally:
        os.chdir(old)
    assert result.exit_code == 0, result.output
    return result.output


def normalized(text: str) -> str:
    """Times change from run to run: replace them (same width, so the layout is kept)."""
    text = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d", "YYYY-MM-DD HH:MM", text)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("QAE_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}: run with QAE_UPDATE_SNAPSHOTS=1 to write it, then read it"
    assert text == path.read_text(), f"{name} differs from {path} (QAE_UPDATE_SNAPSHOTS=1 rewrites it)"


def check_fits(text: str, width: int) -> None:
    too_wide = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert not too_wide, f"lines wider than {width}: {too_wide}"


COMMANDS = {
    "runs": ("runs",),
    "show": ("show", LONG_A),
    "show-killed": ("show", "killed"),
    "rollouts": ("rollouts", LONG_A, "--step", "30", "--limit", "12"),
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", COMMANDS)
def test_views_match_their_snapshots_and_fit(runs_cwd, name, width):
    text = normalized(invoke(runs_cwd, width, *COMMANDS[name]))
    check_fits(text, width)
    check_snapshot(f"{name}-{width}", text)


@pytest.mark.parametrize("width", WIDTHS)
def test_runs_shows_every_run_whole_its_status_and_why_one_is_unreadable(broken_cwd, width):
    text = invoke(broken_cwd, width, "runs")
    check_fits(text, width)
    assert "…" not in text
    frame = read_runs(broken_cwd / "runs")
    for run_id in frame["run_id"]:
        assert run_id in text
    assert re.search(r"killed\s+stopped", text) and re.search(r"broken\s+unreadable", text)
    assert "stopped: stored as running, but no trainer holds the run" in " ".join(text.split())
    assert "unreadable: broken: run: cannot read runs/broken/qae.duckdb" in " ".join(text.split())
    finished = frame.set_index("run_id").loc[LONG_A]
    assert number(finished["reward_mean"]) in text
    # at 80 too: accuracy, the same as reward_mean with 0/1 rewards, no longer takes the room
    assert number(finished["heldout_accuracy"]) in text
    assert ("not shown at 80 columns: entropy" in text) == (width == 80)  # (`unreadable` widens the status)


@pytest.mark.parametrize("width", WIDTHS)
def test_show_prints_status_config_and_whole_numbers(runs_cwd, width):
    text = invoke(runs_cwd, width, "show", LONG_A)
    lines = text.splitlines()
    assert lines[0].split() == [LONG_A, "finished"]  # the status is printed, not eaten as markup
    flat = " ".join(text.split())
    for key, value in [("steps", "30"), ("group_size", "8"), ("k", "0.4"), ("eval_every", "10")]:
        assert f"{key} = {value}" in flat
    assert "…" not in text
    steps = read_steps(db_path(runs_cwd / "runs", LONG_A)).set_index("step")
    rows = {int(line.split()[0]): line.split() for line in lines if re.match(r"^\s*\d+\s+\d", line)}
    assert 30 in rows and 1 in rows
    for step, cells in rows.items():
        assert cells[1] == number(steps.loc[step, "reward_mean"])  # reward_mean is the first metric column
    if width == 80:
        assert "not shown at 80 columns:" in text and "--metrics" in text
    narrow = invoke(runs_cwd, 80, "show", LONG_A, "--metrics", "kl,lr")
    header = next(line for line in narrow.splitlines() if re.match(r"^\s*step\s", line))
    assert header.split() == ["step", "kl", "lr"]


def test_show_of_a_dead_run_says_how_to_continue_it(runs_cwd):
    text = " ".join(invoke(runs_cwd, 80, "show", "killed").split())
    assert text.startswith("killed stopped") and "qae train --resume killed" in text


def test_show_counts_the_steps_still_under_pending(runs_cwd, tmp_path):
    """A killed trainer's last steps wait under pending/ until a writer puts them in the database: `qae show` said
    0 of them (the dashboard's Runs page counts them)."""
    import shutil

    cwd = tmp_path
    shutil.copytree(runs_cwd / "runs" / "killed", cwd / "runs" / "killed")
    pending = cwd / "runs" / "killed" / "pending"
    pending.mkdir(exist_ok=True)
    for step in (6, 7):
        (pending / f"{step:08d}-step.json").write_text("{}")
    text = " ".join(invoke(cwd, 80, "show", "killed").split())
    assert (
        "2 writes saved under pending/ are not in the database yet: `qae train --resume killed` writes them" in text
    ), text


def test_show_refuses_an_unknown_metric(runs_cwd):
    old = Path.cwd()
    os.chdir(runs_cwd)
    try:
        result = runner.invoke(app, ["show", LONG_A, "--metrics", "reward", "--runs-dir", "runs"])
    finally:
        os.chdir(old)
    assert result.exit_code == 2
    assert "metrics: reward not a step metric" in " ".join(result.output.split())


@pytest.mark.parametrize("width", WIDTHS)
def test_rollouts_break_down_why_responses_were_gated(runs_cwd, width):
    text = invoke(runs_cwd, width, "rollouts", LONG_A, "--step", "30", "--limit", "200")
    path = db_path(runs_cwd / "runs", LONG_A)
    breakdown = read_gate_breakdown(path).query("step == 30")
    for reason, n in zip(breakdown["gate_reason"], breakdown["n"], strict=True):
        assert re.search(rf"^{reason}\s+{n}\s", text, re.MULTILINE), reason
    rows = read_rollouts(path, 30)
    table_rows = [line.split() for line in text.splitlines() if re.match(r"^\d+\s+[01]\s+[+-]\d", line)]
    assert len(table_rows) == len(rows)
    reasons = [cells[3] for cells in table_rows]
    assert reasons == [r if g else "kept" for r, g in zip(rows["gate_reason"], rows["gated"], strict=True)]
    gated_only = invoke(runs_cwd, width, "rollouts", LONG_A, "--step", "30", "--why", "failure_in_hard_group")
    kept = [line.split() for line in gated_only.splitlines() if re.match(r"^\d+\s+[01]\s+[+-]\d", line)]
    assert len(kept) == int((rows["gate_reason"] == "failure_in_hard_group").sum()) and {
        cells[3] for cells in kept
    } == {"failure_in_hard_group"}


def test_ids_that_share_a_prefix_show_the_part_that_differs(tmp_path):
    from rich.console import Console

    from qae_app.cli.views import runs_view

    ids = [f"20261130-1131{i:02d}-qae-k0.4-seed{i}-lr1e-6-b" for i in range(3)]  # 35 characters: too long
    for run_id in ids:
        write_run(tmp_path, run_id, steps=2, prompts_per_step=2, group_size=4)
    console = Console(width=80, record=True)
    console.print(runs_view(run_summaries(tmp_path), "runs", 80))
    text = console.export_text()
    check_fits(text, 80)
    assert "every run id below starts with 20261130-" in text
    for run_id in ids:
        assert re.search(rf"^{re.escape(run_id.removeprefix('20261130-'))}\s+finished", text, re.MULTILINE)
    assert "…" not in text


def test_shared_prefix_cuts_at_a_separator():
    assert shared_prefix(["20261130-113105-qae", "20261130-114512-qae"]) == "20261130-"
    assert shared_prefix(["run-a", "run-b", "other"]) == ""
    assert shared_prefix(["same", "same"]) == ""  # nothing would be left of an id
    assert shared_prefix(["alone"]) == ""


def test_cli_page_defines_every_gate_reason():
    cli_page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", cli_page, re.M))
    assert {name: rows.get(name) for name in GATE_REASONS} == GATE_REASONS


def test_rollouts_of_a_run_without_steps_say_so(tmp_path):
    """A run created but not past its first step (or an eval-only run): DuckDB's max(step) over no rows comes back as
    pandas' NA, which is neither None nor NaN."""
    writer = RunWriter(db_path(tmp_path, "new"), "new")
    writer.create_run("new", {"steps": 10}, "qae", 0.4, "builtin:tiny", "arith", 0)
    assert read_last_step(db_path(tmp_path, "new")) is None
    assert last_logged_step(tmp_path / "new") == 0
    result = runner.invoke(app, ["rollouts", "new", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "run: 'new' has no steps yet." in " ".join(result.output.split())


def test_show_at_80_columns_has_the_held_out_steps_and_runs_keeps_entropy(runs_cwd):
    """At 80 columns `qae show` sampled steps 1, 3, 5, ... so the held-out accuracy of steps 10, 20 was never shown,
    and `qae runs` kept reward_mean and accuracy (the same with 0/1 rewards) and dropped entropy."""
    shown = invoke(runs_cwd, 80, "show", LONG_A)
    rows = {line.split()[0]: line.split() for line in shown.splitlines() if re.match(r"^\s+\d+\s+\d", line)}
    heldout = query(
        db_path(runs_cwd / "runs", LONG_A),
        "SELECT step, heldout_accuracy FROM steps WHERE heldout_accuracy IS NOT NULL",
    )
    assert sorted(heldout["step"]) == [10, 20, 30]
    for step, value in zip(heldout["step"], heldout["heldout_accuracy"], strict=True):
        assert number(value) in rows[str(step)]
    listed = invoke(runs_cwd, 80, "runs")
    header = " ".join(listed.split("─")[0].split())
    assert "entropy" in header and "reward_" in header and header.count("accuracy") == 1  # heldout_ accuracy
    assert "reward_mean is also the accuracy here" in listed


def test_picked_steps_keep_the_evaluations_of_a_long_run():
    import pandas as pd

    from qae_app.cli.views import picked_steps

    steps = pd.DataFrame(
        {"step": range(1, 1001), "heldout_accuracy": [0.5 if s % 10 == 0 else None for s in range(1, 1001)]}
    )
    picked, title = picked_steps(steps, 0)
    shown = [int(steps["step"].iloc[i]) for i in picked]
    assert shown == [1, *range(70, 1001, 70), 1000] and "every 70" in title  # 70 = 10 x ceil(1000 / 150)
    assert all(not pd.isna(steps["heldout_accuracy"].iloc[i]) for i in picked[1:])
    assert [int(steps["step"].iloc[i]) for i in picked_steps(steps, 100)[0]][:3] == [1, 101, 201]  # --every wins


def test_no_values_line_names_each_option_once_for_the_columns_it_records():
    from qae_app.cli.views import empty_metrics_note
    from qae_app.store.schema import STEP_METRICS

    attribution = [m for m in STEP_METRICS if "_from_" in m]
    assert len(attribution) == 9
    note = empty_metrics_note(["gen_batches", "dH", "dH_hard", "dH_easy", *attribution])
    assert note == (
        "gen_batches; dH, dH_hard, dH_easy (recorded with --log-entropy-delta); "
        "the 9 dH_*from_* columns (recorded with --log-entropy-attribution)"
    )
    # a family only partly empty is not folded: each empty column keeps its own name
    assert empty_metrics_note(["dH_easy", "dH_from_none"]) == "dH_easy, dH_from_none"
