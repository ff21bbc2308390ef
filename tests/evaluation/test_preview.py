"""`qae preview` as a user runs it on the built-in tasks: what it prints equals what an independent computation makes
of the rows it stored (regimes by the README's count rule, and torch.quantile for the linear quantile), its first
groups are the responses `qae train` samples at step 1, a task without signal says so, and bad options are refused
before anything is written."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
import torch
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.evaluation.task_preview import PREVIEW_STEP, PreviewOptions, run_preview
from qae_app.store.reader import query, read_preview
from qae_app.store.run_folder import db_path
from tests.conftest import TINY_RUN_OPTIONS

runner = CliRunner()
G, N = 8, 16


def preview(runs_dir, name, *args):
    result = runner.invoke(
        app, ["preview", "--runs-dir", str(runs_dir), "--run-name", name, *args], env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """(runs_dir, printed text) of a preview of the built-in task: 16 prompts in 2 batches of 8, G=8."""
    runs_dir = tmp_path_factory.mktemp("preview")
    text = preview(
        runs_dir,
        "p",
        "--prompts",
        str(N),
        "--group-size",
        str(G),
        "--prompts-per-step",
        "8",
        "--ks",
        "0.2,0.5,0.8",
        "--seed",
        "3",
    )
    return runs_dir, text


def stored_rewards(path) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N, G] and verdicts [N, G] as the rollouts table holds them."""
    rows = query(path, "SELECT group_idx, sample_idx, reward, correct FROM rollouts ORDER BY group_idx, sample_idx")
    n = rows["group_idx"].nunique()
    return (
        torch.tensor(rows["reward"].tolist()).view(n, -1),  # [N, G]
        torch.tensor(rows["correct"].tolist()).view(n, -1),
    )  # [N, G]


def by_count_rule(correct: torch.Tensor, k: float) -> tuple[float, int, int]:
    """(gated share, hard groups, easy groups) by the README's table for 0/1 rewards and the paper quantile: a group
    of c successes of G is hard when c / G <= 1 - K (its failures gated), easy above (its successes gated); a group
    all correct or all wrong gates everything."""
    gated = hard = easy = 0
    for row in correct.tolist():
        c, g = sum(row), len(row)
        if c in (0, g):
            gated += g
        elif Fraction(c, g) <= 1 - Fraction(repr(k)):
            hard, gated = hard + 1, gated + g - c
        else:
            easy, gated = easy + 1, gated + c
    return gated / correct.numel(), hard, easy


def test_printed_numbers_equal_the_count_rule_on_the_stored_rows(paper):
    runs_dir, text = paper
    flat = " ".join(text.split())  # (a long line wraps)
    path = db_path(runs_dir, "p")
    rewards, correct = stored_rewards(path)
    assert rewards.shape == (N, G)
    view = read_preview(path)
    assert view.run["estimator"] == "preview" and view.run["status"] == "finished"
    by_k = {row["k"]: row for row in view.by_k.to_dict("records") if row["estimator"] == "qae"}
    accuracy = correct.float().mean().item()
    suggested = 0.3 if accuracy < 0.2 else 0.4 if accuracy < 0.5 else 0.5  # names.AUTO_K_RULE, by hand
    assert sorted(by_k) == sorted({0.2, 0.5, 0.8, suggested})
    for k, row in by_k.items():
        share, hard, easy = by_count_rule(correct, k)
        assert (row["frac_zero_adv"], row["n_hard"], row["n_easy"]) == (pytest.approx(share), hard, easy)
        assert row["suggested"] == (k == suggested)
        line = f"qae {k:g}{'*' if k == suggested else ''} {share:.1%}"
        assert line in flat, line
    # GRPO's baseline is the mean: with 0/1 rewards only the groups without signal are gated
    no_signal = correct.all(dim=1) | ~correct.any(dim=1)  # [N]
    grpo = view.by_k[view.by_k["estimator"] == "grpo"].iloc[0]
    assert grpo["frac_zero_adv"] == pytest.approx(no_signal.float().mean().item())
    n_signal = int((~no_signal).sum())
    assert f"learnable: {n_signal} of {N} groups ({n_signal / N:.0%}) have signal at G={G}" in flat
    assert view.summary["suggested_k"] == suggested
    assert f"success rate {accuracy:.3f}" in flat
    # groups by success rate: each count of correct responses, as printed
    for c in range(G + 1):
        count = int((correct.sum(dim=1) == c).sum())
        assert re.search(rf"^ *{c}/{G} +{count}\b", text, re.M), (c, count)
    tokens = query(path, "SELECT n_tokens, truncated FROM rollouts")
    assert f"{tokens['truncated'].mean():.1%} cut at max-new-tokens 8" in flat
    assert f"mean {tokens['n_tokens'].mean():.1f}" in flat


def test_the_linear_quantile_gates_what_torch_quantile_says(tmp_path):
    preview(tmp_path, "lin", "--prompts", "8", "--group-size", str(G), "--quantile", "linear", "--ks", "0.3,0.6")
    path = db_path(tmp_path, "lin")
    rewards, _ = stored_rewards(path)
    view = read_preview(path)
    for row in view.by_k[view.by_k["estimator"] == "qae"].to_dict("records"):
        baseline = torch.quantile(rewards, row["k"], dim=1, interpolation="linear", keepdim=True)  # [N, 1]
        assert row["frac_zero_adv"] == pytest.approx((rewards == baseline).float().mean().item(), abs=1e-6)
        differ = rewards.amax(dim=1) != rewards.amin(dim=1)  # [N]
        assert row["n_hard"] == int((differ & (baseline[:, 0] == rewards.amin(dim=1))).sum())
        assert row["n_easy"] == int((differ & (baseline[:, 0] == rewards.amax(dim=1))).sum())
        assert row["n_mixed"] == int(
            (differ & (baseline[:, 0] > rewards.amin(dim=1)) & (baseline[:, 0] < rewards.amax(dim=1))).sum()
        )


def test_the_stored_responses_are_the_run_estimators(paper):
    """The groups and rollouts rows carry the run's own estimator (QAE K=0.4 by default): gated where the count
    rule says, and `qae rollouts` lists them."""
    runs_dir, _ = paper
    path = db_path(runs_dir, "p")
    _, correct = stored_rewards(path)
    share, hard, _ = by_count_rule(correct, 0.4)
    rows = query(path, "SELECT gated, regime, step FROM rollouts")
    assert rows["gated"].mean() == pytest.approx(share)
    assert set(rows["step"]) == {PREVIEW_STEP}
    assert (query(path, "SELECT regime FROM groups")["regime"] == "hard").sum() == hard
    listed = runner.invoke(app, ["rollouts", "p", "--runs-dir", str(runs_dir)], env={"COLUMNS": "120"})
    assert listed.exit_code == 0, listed.output
    assert f"step {PREVIEW_STEP}" in listed.output


def test_its_first_groups_are_the_responses_train_samples_at_step_one(tiny_run, tmp_path):
    runs_dir, run_id = tiny_run
    cfg = build_config(**{**TINY_RUN_OPTIONS, "run_name": "same"})
    run_preview(cfg, tmp_path, PreviewOptions(prompts=cfg.prompts_per_step), device="cpu")
    sql = (
        "SELECT group_idx, sample_idx, prompt_id, response, reward FROM rollouts WHERE step = 1 "
        "ORDER BY group_idx, sample_idx"
    )
    trained = query(db_path(runs_dir, run_id), sql)
    previewed = query(db_path(tmp_path, "same"), sql)
    assert len(previewed) == cfg.prompts_per_step * cfg.group_size
    assert previewed.to_dict("records") == trained.to_dict("records")


USER_REWARD = """
def parity(completions, prompts, answer, **columns):
    # half credit for a response of even length, full for the gold answer
    return [1.0 if c.strip() == a else 0.5 if len(c) % 2 == 0 else 0.0 for c, a in zip(completions, answer)]
"""


def test_it_scores_with_the_rewards_the_user_names(tmp_path):
    """`qae preview --reward FILE:FN` scores with the user's function as `qae train` would: each stored reward is
    that function's score of the stored response (and its component row), not the task's own verifier's."""
    reward_file = tmp_path / "parity.py"
    reward_file.write_text(USER_REWARD)
    preview(tmp_path, "u", "--prompts", "8", "--group-size", "4", "--reward", f"{reward_file}:parity")
    path = db_path(tmp_path, "u")
    rows = query(
        path,
        "SELECT r.response, g.answer, r.reward, r.correct, c.name, c.value FROM rollouts r "
        "JOIN groups g USING (step, group_idx) LEFT JOIN reward_components c USING (step, group_idx, "
        "sample_idx) ORDER BY r.group_idx, r.sample_idx",
    )
    assert len(rows) == 32 and set(rows["name"]) == {"parity"}
    want = [
        1.0 if r.strip() == a else 0.5 if len(r) % 2 == 0 else 0.0
        for r, a in zip(rows["response"], rows["answer"], strict=True)
    ]
    assert rows["reward"].tolist() == want and rows["value"].tolist() == want
    assert rows["correct"].tolist() == [w == 1.0 for w in want]
    assert 0.5 in want  # (the check above would pass on the exact-int verifier's 0/1 without it)


def test_a_continuous_reward_without_a_success_has_signal_where_its_scores_differ(tmp_path):
    """No response gets full marks (success rate 0), yet a group whose scores differ has signal: no signal is every
    reward of a group equal, not every verdict, and the preview says learnable, not all-wrong."""
    (tmp_path / "longer.py").write_text(
        "def longer(completions, **kwargs):\n    return [min(0.9, len(c) / 10) for c in completions]\n"
    )
    text = preview(tmp_path, "c", "--prompts", "4", "--group-size", "4", "--reward", f"{tmp_path / 'longer.py'}:longer")
    path = db_path(tmp_path, "c")
    rewards = query(path, "SELECT group_idx, reward FROM rollouts ORDER BY group_idx, sample_idx")
    groups = [g["reward"].tolist() for _, g in rewards.groupby("group_idx")]
    assert len(groups) == 4 and any(min(g) < max(g) for g in groups)
    summary = query(path, "SELECT accuracy, frac_no_signal, verdict FROM previews").iloc[0]
    assert summary["accuracy"] == 0.0
    assert summary["frac_no_signal"] == sum(min(g) == max(g) for g in groups) / 4
    assert summary["verdict"].startswith("learnable:"), summary["verdict"]
    # the histogram agrees: its bucket of 0 correct (all four groups) counts the same groups with signal
    n_signal = sum(min(g) < max(g) for g in groups)
    flat = " ".join(text.split())
    assert f"0/4 4 {n_signal} " in flat and f"all wrong, yet {n_signal} with signal" in flat, flat
    assert "all wrong: no signal" not in flat


def test_a_task_without_signal_says_what_to_try(tmp_path):
    """One token cannot hold the chain task's ' so N': every group all-wrong."""
    text = preview(
        tmp_path, "none", "--data", "builtin:chain", "--max-new-tokens", "1", "--prompts", "4", "--group-size", "4"
    )
    view = read_preview(db_path(tmp_path, "none"))
    assert view.summary["frac_no_signal"] == 1.0 and view.summary["truncated_frac"] == 1.0
    assert math.isnan(view.summary["suggested_k"])
    assert (
        "no signal: every group all-wrong at G=4; 100% of the responses were cut at max-new-tokens: try a "
        "longer max-new-tokens, a larger G, an easier split, or a warm start" in " ".join(text.split())
    )
    assert "suggested" not in text and not re.search(r"^qae +[\d.]+\*", text, re.M)  # no K marked


BAD = {
    "prompts 0": (["--prompts", "0"], "prompts: 0 samples nothing"),
    "more prompts than problems": (["--prompts", "5000"], "prompts: 5000 is more than the 1059 training problems"),
    "a K of 1": (["--ks", "0.2,1"], "ks: 1.0 is outside (0, 1)"),
    "not numbers": (["--ks", "low,high"], "ks: 'low,high' is not a list of numbers"),
    "no K": (["--ks", ","], "ks: ',' names no K"),
    "show negative": (["--show", "-1"], "show: -1 is negative"),
    "group of one": (["--group-size", "1"], "group-size: 1 is less than 2"),
    "taken name": (["--run-name", "taken"], "run-name: 'taken' already exists"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, case):
    (tmp_path / "taken").mkdir()
    args, message = BAD[case]
    result = runner.invoke(app, ["preview", "--runs-dir", str(tmp_path), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_a_preview_is_listed_and_refused_where_a_training_run_is_needed(paper):
    runs_dir, _ = paper
    listed = runner.invoke(app, ["runs", "--runs-dir", str(runs_dir)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and re.search(r"\bp\b +finished +preview +- ", listed.output), listed.output
    shown = runner.invoke(app, ["show", "p", "--runs-dir", str(runs_dir)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert read_preview(db_path(runs_dir, "p")).summary["verdict"] in shown.output  # and the rest of its findings
    for args in (["train", "--resume", "p"], ["train", "--run-name", "p", "--steps", "1"], ["eval", "--model", "p"]):
        result = runner.invoke(app, [*args, "--runs-dir", str(runs_dir)], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        assert "'p' is a preview (qae preview)" in " ".join(result.output.split()), result.output


def test_a_chat_prompt_is_stored_as_the_text_training_stores(chat_folder, tmp_path):
    """A conversational row's messages are stored in `groups.prompt` as `qae train` stores them (prompts.prompt_text:
    the contents joined by blank lines), not as DuckDB's rendering of a list of structs. Checked to fail before:
    the column read "[{'role': user, 'content': What is 0 plus 3?}]"."""
    import json

    from qae_app.store.reader import query as read

    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [
                        {"role": "system", "content": "Be terse."},
                        {"role": "user", "content": f"What is {a} plus 3?"},
                    ],
                    "answer": str(a + 3),
                }
            )
            + "\n"
            for a in range(2)
        )
    )
    preview(
        tmp_path,
        "chat",
        "--model",
        str(chat_folder),
        "--data",
        str(data),
        "--prompts",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "2",
    )
    stored = read(db_path(tmp_path, "chat"), "SELECT prompt FROM groups ORDER BY group_idx")["prompt"].tolist()
    assert sorted(stored) == [f"Be terse.\n\nWhat is {a} plus 3?" for a in range(2)]
