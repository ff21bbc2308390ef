"""TRL's own reward functions (`trl.rewards`, unchanged) on TRL's own conversational data: a data file whose `prompt`
column is a list of chat messages and whose gold answer is a `solution` column (no `answer`). As TRL's GRPOTrainer
does for such data, qae hands each function the completion as a list of one assistant message and the prompt as
the row's messages; for plain-text data both stay text (scoring/reward_path.reward_prompt,
rewards/registry.reward_inputs).

Checked to fail without reward_inputs: every completion went in as a string, and `think_format_reward` raised
(`completion[0]["content"]` on a str), so the run stopped failed at step 1."""

import json

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.data.prompt_format import PromptFormat
from qae_app.data.tasks import load_task
from qae_app.rewards.registry import RewardSet, data_columns, reward_inputs
from qae_app.rewards.specs import parse_reward_specs
from qae_app.scoring.reward_path import reward_prompt
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path

pytest.importorskip("trl.rewards", reason="TRL is in the dev extra")
from trl.rewards import accuracy_reward, think_format_reward  # noqa: E402 - after the skip

runner = CliRunner()
TRL_REWARDS = ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"]


def trl_rows(n: int = 4) -> list[dict]:
    """TRL's conversational prompt-only format, with the gold answer in `solution` as trl.rewards.accuracy_reward
    reads it."""
    return [
        {"prompt": [{"role": "user", "content": f"What is {a} plus 3?"}], "solution": f"${a + 3}$"} for a in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_conversational_rows_inputs_are_trls_and_a_text_rows_are_text(tmp_path):
    chat = load_task(str(write_jsonl(tmp_path / "chat.jsonl", trl_rows(1))), require_answer=False)
    [problem] = chat.train
    assert reward_inputs("5", reward_prompt(chat.prompt(problem), problem)) == (
        [{"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "What is 0 plus 3?"}],
    )
    # --system-prompt goes before the row's messages: the prompt is what the model was sent
    system = load_task(
        str(tmp_path / "chat.jsonl"), prompt_format=PromptFormat(system_prompt="Be terse."), require_answer=False
    )
    assert reward_inputs("5", reward_prompt(system.prompt(problem), problem))[1] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 0 plus 3?"},
    ]
    # a --prompt-template replaces the row's messages: text, as for any plain-text row
    templated = load_task(
        str(tmp_path / "chat.jsonl"), prompt_format=PromptFormat("Q: {solution}"), require_answer=False
    )
    assert reward_inputs("5", reward_prompt(templated.prompt(problem), problem)) == ("5", "Q: $3$")
    text = load_task(
        str(write_jsonl(tmp_path / "text.jsonl", [{"question": "1+1?", "answer": "2"}])),
        prompt_format=PromptFormat(system_prompt="Be terse."),
    )
    [plain] = text.train
    assert reward_inputs("2", reward_prompt(text.prompt(plain), plain)) == (
        "2",
        "Be terse.\n\n1+1?\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
    )


def test_trls_functions_score_literal_completions_as_in_trl(tmp_path):
    task = load_task(str(write_jsonl(tmp_path / "chat.jsonl", trl_rows(2))), require_answer=False)
    problems = [task.train[0], task.train[0], task.train[1], task.train[1]]
    completions = [
        "<think>\n0 and 3\n</think>\nThe answer is $\\boxed{3}$.",
        "The answer is $\\boxed{3}$.",
        "<think>\nhm\n</think>\n$\\boxed{5}$",
        "no idea",
    ]
    with RewardSet(parse_reward_specs(TRL_REWARDS)) as rewards:
        rewards.check(data_columns(problems))
        totals, components = rewards.score(completions, [reward_prompt(task.prompt(p), p) for p in problems], problems)
    assert components == {"think_format_reward": [1.0, 0.0, 1.0, 0.0], "accuracy_reward": [1.0, 1.0, 0.0, 0.0]}
    assert totals == [2.0, 1.0, 1.0, 0.0]
    # what TRL itself computes from the same conversational completions
    as_trl = [[{"role": "assistant", "content": c}] for c in completions]
    assert think_format_reward(as_trl) == components["think_format_reward"]
    assert accuracy_reward(as_trl, [p.columns["solution"] for p in problems]) == components["accuracy_reward"]


@pytest.mark.slow
def test_a_run_trains_with_trls_functions_on_trls_conversational_data(chat_folder, tmp_path):
    data = write_jsonl(tmp_path / "trl.jsonl", trl_rows())
    runs = tmp_path / "runs"
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            str(chat_folder),
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--num-mini-batches",
            "1",
            "--max-new-tokens",
            "6",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
            "--run-name",
            "trl",
            "--runs-dir",
            str(runs),
            *[part for spec in TRL_REWARDS for part in ("--reward", spec)],
        ],
    )
    assert result.exit_code == 0, result.output
    stored = query(
        db_path(runs, "trl"),
        "SELECT r.step, r.response, g.prompt_id, c.name, c.value, r.reward "
        "FROM reward_components c JOIN rollouts r USING (step, group_idx, sample_idx) "
        "JOIN groups g USING (step, group_idx) ORDER BY c.name, r.step, "
        "r.group_idx, r.sample_idx",
    )
    assert sorted(set(stored["name"])) == ["accuracy_reward", "think_format_reward"] and len(stored) == 2 * 2 * 4
    solutions = {row["prompt"][0]["content"]: row["solution"] for row in trl_rows()}
    task = load_task(str(data), require_answer=False)
    by_id = {p.prompt_id: p for p in task.train}
    for name, rows in stored.groupby("name"):
        as_trl = [[{"role": "assistant", "content": text}] for text in rows["response"]]
        if name == "think_format_reward":
            expected = think_format_reward(as_trl)
        else:
            expected = accuracy_reward(as_trl, [solutions[by_id[i].messages[0]["content"]] for i in rows["prompt_id"]])
        assert list(rows["value"]) == expected
