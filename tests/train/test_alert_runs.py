"""Reward hacking seen while it happens, on real runs of the built-in model (issue 49): a correctness reward that never
fires (tests/hacking_rewards.py:exact_with_unit) and a format reward of weight 0.2 (one_char). `qae preview` names the
format component as the only signal, with a histogram that agrees; 4 training steps store a warning naming it, print
it under the progress line, and store every response's per-token numbers; and the alerts a real run can be built to
trip (no signal, saturation, the sampler/trainer mismatch, entropy moving fast, response length collapsing or running
away, a truncation jump) trip on such a run and stay quiet on one that is not (each alert's own trip/no-trip
sequences: tests/train/test_alerts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path

runner = CliRunner()
REWARDS = Path(__file__).resolve().parents[1] / "hacking_rewards.py"
HACKED = ["--reward", f"{REWARDS}:exact_with_unit", "--reward", f"{REWARDS}:one_char", "--reward-weights", "1,0.2"]
SMALL = ["--eval-every", "0", "--checkpoint-every", "0", "--cpu"]

pytestmark = pytest.mark.slow  # real runs of 3-4 steps: 20-90 s each on the shared machine


def train(runs: Path, name: str, *options: str) -> tuple[str, list[tuple[int, str, str]]]:
    result = runner.invoke(
        app, ["train", "--run-name", name, "--runs-dir", str(runs), *SMALL, *options], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    warnings = query(db_path(runs, name), "SELECT step, kind, message FROM warnings ORDER BY step, kind")
    return result.output, list(warnings.itertuples(index=False, name=None))


def test_the_preview_names_the_format_reward_as_the_only_signal_and_its_histogram_agrees(tmp_path):
    result = runner.invoke(
        app,
        ["preview", "--run-name", "p", "--runs-dir", str(tmp_path), "--prompts", "16", "--show", "0", *HACKED, "--cpu"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    verdict = query(db_path(tmp_path, "p"), "SELECT verdict FROM previews")["verdict"].item()
    assert verdict.startswith("learnable: ") and verdict.endswith(
        "; all signal comes from one_char (weight 0.2); exact_with_unit never differs within a group"
    ), verdict
    n_signal = int(verdict.split("learnable: ")[1].split(" of ")[0])
    # the histogram's bucket of 0 correct counts the same groups with signal as the verdict, and says so
    assert f"0/16 16 {n_signal} " in said and "all wrong: no signal" not in said, said
    assert f"all wrong, yet {n_signal} with signal" in said
    signal = query(db_path(tmp_path, "p"), "SELECT name, adv_share, frac_differs FROM component_signal ORDER BY name")
    assert signal.to_dict("records") == [
        {"name": "exact_with_unit", "adv_share": 0.0, "frac_differs": 0.0},
        {"name": "one_char", "adv_share": 1.0, "frac_differs": pytest.approx(n_signal / 16)},
    ]


def test_four_steps_of_a_hacked_reward_store_a_warning_naming_it_and_every_token(tmp_path):
    output, warnings = train(tmp_path, "hacked", "--steps", "4", *HACKED)
    assert [kind for _, kind, _ in warnings] == ["reward_signal"]  # and no other alert on this run
    step, _, message = warnings[0]
    assert step <= 4 and message.startswith(
        "one_char (weight 0.2) carried 100% of the advantage, and exact_with_unit, the primary reward, none of it"
    )
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"step {step}/4 "))
    assert lines[at + 1].startswith("warning: reward_signal: one_char (weight 0.2)")  # under its progress line
    # every stored response has its tokens' numbers, as many as its tokens (the default --store-tokens, a CPU run)
    path = db_path(tmp_path, "hacked")
    joined = query(
        path,
        "SELECT r.n_tokens, len(t.tokens) AS texts, len(t.logprob) AS logprobs, "
        "len(t.entropy) AS entropies, len(t.old_logprob) AS olds, r.advantage "
        "FROM rollouts r LEFT JOIN token_values t USING (step, group_idx, sample_idx)",
    )
    assert len(joined) == 4 * 8 * 16
    for column in ("texts", "logprobs", "entropies"):
        assert (joined[column] == joined["n_tokens"]).all(), column
    trained = joined[joined["advantage"] != 0]  # the responses the update forwarded have the trainer's numbers
    assert len(trained) and (trained["olds"] == trained["n_tokens"]).all()
    shown = runner.invoke(app, ["show", "hacked", "--runs-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert "which reward carries the signal" in shown.output
    assert "all signal comes from one_char (weight 0.2)" in " ".join(shown.output.split())


def test_the_same_task_with_the_format_reward_as_primary_raises_nothing(tmp_path):
    _, warnings = train(tmp_path, "honest", "--steps", "4", *HACKED, "--primary-reward", "one_char")
    assert warnings == []


def test_no_signal_and_saturation_trip_on_runs_built_for_them(tmp_path):
    _, never = train(tmp_path, "never", "--steps", "3", "--reward", f"{REWARDS}:exact_with_unit")
    assert [(step, kind) for step, kind, _ in never] == [(3, "no_signal")]
    _, always = train(tmp_path, "always", "--steps", "3", "--reward", f"{REWARDS}:anything")
    assert sorted(kind for _, kind, _ in always) == ["no_signal", "reward_saturation"]


def test_a_bfloat16_sampler_trips_the_mismatch_alert_and_a_moving_entropy_its_slope(tmp_path):
    _, warnings = train(
        tmp_path,
        "bf16",
        "--steps",
        "3",
        *HACKED,
        "--rollout-dtype",
        "bfloat16",
        "--rollout-correction-cap",
        "1.0001",
        "--alerts",
        "window=2,entropy_slope=0.000001,mismatch_capped=0.000001,reward_signal=off",
    )
    kinds = [kind for _, kind, _ in warnings]
    assert "mismatch" in kinds and "entropy_slope" in kinds, warnings
    message = next(m for _, kind, m in warnings if kind == "mismatch")
    capped = query(db_path(tmp_path, "bf16"), "SELECT mismatch_capped FROM steps ORDER BY step")["mismatch_capped"]
    assert message.startswith(f"the sampler is not the trainer: {capped.iloc[0]:.0f} tokens capped")


def test_length_and_truncation_alerts_trip_on_runs_built_for_them(tmp_path):
    """A reward that pays for length at a high learning rate: replies grow from ~3 tokens to the cap of 8 in 3 steps.
    The built-in task as it is: replies shrink a little (3.15 -> 2.96 tokens over two windows of 2 steps). The hacked
    run above is the one that does not trip them (only reward_signal fires there, at the default levels)."""
    _, grown = train(
        tmp_path,
        "grown",
        "--steps",
        "4",
        "--reward",
        f"{REWARDS}:longer",
        "--lr",
        "0.003",
        "--max-new-tokens",
        "8",
        "--alerts",
        "window=2,length_ratio=1.5,entropy_slope=off",
    )
    assert [(step, kind) for step, kind, _ in grown] == [(2, "truncation_jump"), (4, "length_runaway")], grown
    _, shrunk = train(
        tmp_path,
        "shrunk",
        "--steps",
        "4",
        "--max-new-tokens",
        "6",
        "--alerts",
        "window=2,length_ratio=1.03,entropy_slope=off",
    )
    assert [(step, kind) for step, kind, _ in shrunk] == [(4, "length_collapse")], shrunk
    lengths = query(db_path(tmp_path, "shrunk"), "SELECT response_len FROM steps ORDER BY step")["response_len"]
    assert lengths.iloc[:2].mean() / lengths.iloc[2:].mean() >= 1.03  # (what the alert compared)


def test_the_preview_refuses_a_primary_reward_that_names_no_component(tmp_path):
    result = runner.invoke(
        app,
        [
            "preview",
            "--run-name",
            "p",
            "--runs-dir",
            str(tmp_path),
            "--prompts",
            "2",
            "--show",
            "0",
            *HACKED,
            "--primary-reward",
            "exact",
            "--cpu",
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "primary-reward: 'exact' is not a component of this run's rewards (exact_with_unit, one_char)" in said
