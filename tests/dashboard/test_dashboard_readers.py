"""The store readers the dashboard draws from, and its chart helpers, by hand: no page is run."""

from __future__ import annotations

import pandas as pd
import pytest

from qae_app.store.reader import (
    file_version,
    read_eval_checkpoints,
    read_eval_problem_grid,
    read_eval_samples,
    read_gate_breakdown,
    read_prompt_histories,
    read_prompt_rollouts,
    read_prompts,
    read_quantiles,
    read_regime_counts,
    read_rollout_steps,
    read_run_view,
    read_runs,
    read_step_tokens,
    read_steps,
)
from qae_app.store.run_folder import db_path
from tests.dashboard.helpers import MOVING_PROMPT, _crafted_rows, charts
from tests.synthetic import write_run

# ---------------------------------------------------------------------------------------------------------------
# store readers and chart helpers


def test_dashboard_readers_on_the_crafted_run(runs_dir):
    path = db_path(runs_dir, "crafted")
    view = read_run_view(path)
    assert view.run["status"] == "finished" and view.steps["step"].tolist() == [1, 2, 3]
    assert view.warnings["step"].tolist() == [2] and set(view.evals["subset"]) == {"all", "level=1"}
    assert read_rollout_steps(path) == [1, 2, 3]
    prompts = read_prompts(path).set_index("prompt_id")
    moving = prompts.loc[MOVING_PROMPT]
    assert (moving["times_sampled"], moving["first_regime"], moving["last_regime"]) == (3, "hard", "easy")
    assert (moving["first_success"], moving["last_success"]) == (0.25, 0.75)
    counts = read_regime_counts(path)
    assert counts.groupby("step")["n_groups"].sum().tolist() == [2, 2, 2]
    history = read_prompt_histories(path, [MOVING_PROMPT, "p-other-1"])
    assert sorted(history["prompt_id"].unique()) == [MOVING_PROMPT, "p-other-1"] and len(history) == 4


def test_round_two_readers_by_hand(small_dir):
    path = db_path(small_dir, "crafted")
    # step 3: group 0 easy (successes 0-2 gated), group 1 hard (failures 2-3 gated); step 1: hard 1/4 + all wrong
    breakdown = read_gate_breakdown(path)
    assert breakdown.query("step == 3").set_index("gate_reason")["n"].to_dict() == {
        "failure_in_hard_group": 2,
        "success_in_easy_group": 3,
    }
    assert breakdown.query("step == 1").set_index("gate_reason")["n"].to_dict() == {
        "all_wrong_group": 4,
        "failure_in_hard_group": 3,
    }
    quantiles = read_quantiles(path, "advantage").set_index("step")
    assert quantiles.loc[1, "mean"] == pytest.approx(1 / 8) and quantiles.loc[1, "q0.95"] == pytest.approx(0.65)
    with pytest.raises(ValueError, match="not one of"):
        read_quantiles(path, "response; DROP TABLE rollouts")
    tokens = read_step_tokens(path)
    assert tokens["n_responses"].tolist() == [8, 8, 8]
    assert tokens["n_tokens"].tolist() == [
        sum(len(r["response"]) for r in _crafted_rows(s)["rollouts"]) for s in (1, 2, 3)
    ]
    moving = read_prompt_rollouts(path, MOVING_PROMPT)
    assert moving["step"].tolist() == [1] * 4 + [2] * 4 + [3] * 4 and moving["regime"].tolist()[-1] == "easy"
    checkpoints = read_eval_checkpoints(path)
    assert checkpoints[["step", "n_problems", "n_samples"]].values.tolist() == [[1, 2, 4], [3, 2, 4]]
    assert checkpoints["accuracy"].tolist() == [0.25, 0.5]
    grid = read_eval_problem_grid(path, "mini", "eval")
    assert grid[["problem_id", "step", "n_correct"]].values.tolist() == [
        ["q1", 1, 0],
        ["q1", 3, 1],
        ["q2", 1, 1],
        ["q2", 3, 1],
    ]
    assert read_eval_samples(path, "mini", "eval", 3, search="SCRIPT")["problem_id"].tolist() == ["q2"]
    steps = read_steps(path)
    assert steps["logged_at"].notna().all() and steps["logged_at"].is_monotonic_increasing


def test_file_version_changes_with_each_commit_and_only_then(tmp_path):
    writer = write_run(tmp_path, "r", steps=2, status=None)
    path = db_path(tmp_path, "r")
    before = file_version(path)
    read_runs(tmp_path), read_steps(path)  # readers change nothing
    assert file_version(path) == before
    write_run(tmp_path, "r", steps=1, start_step=3, writer=writer, status=None)
    assert file_version(path) != before


def test_smoothing_by_hand():
    values = pd.Series([1.0, None, 3.0, 5.0])
    assert charts.smooth(values, "none").equals(values)
    # EMA with weight 0.5 on the past, debiased: 1, (0.5*1 + 3)/(1.5) ... as pandas ewm(adjust=True)
    ema = charts.smooth(values, "ema", 0.5)
    assert ema.tolist()[0] == 1.0 and pd.isna(ema[1])
    assert ema[2] == pytest.approx((3 + 0.5 * 1) / 1.5) and ema[3] == pytest.approx((5 + 0.5 * 3 + 0.25) / 1.75)
    rolling = charts.smooth(values, "rolling", 2)
    assert rolling.tolist()[2:] == [2.0, 4.0] and pd.isna(rolling[1])
    with pytest.raises(ValueError, match="EMA weight"):
        charts.smooth(values, "ema", 1.0)
