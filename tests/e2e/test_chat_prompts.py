"""Chat-message prompts on a real model: a data file whose `prompt` column is a list of chat messages (TRL's
conversational format, verl's), encoded by SmolLM2-135M-Instruct's own tokenizer and chat template in a real one-step
run. The run's DuckDB file holds, for each group, the prompt as the model saw it (`model_prompt`: the data's system
message in place of SmolLM2's default one) and a readable text (`prompt`); `qae rollouts --model-prompt` prints it.
The same messages built from a user-only file and `--system-prompt` encode to the same tokens."""

import json

from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.data.prompt_format import PromptFormat
from qae_app.data.tasks import load_task
from qae_app.models.policy import load_policy
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path

runner = CliRunner()
SYSTEM = "You are a calculator. Reply with just the number."


def chat_rows(with_system: bool) -> list[dict]:
    system = [{"role": "system", "content": SYSTEM}] if with_system else []
    return [
        {
            "id": f"add-{a}",
            "prompt": system + [{"role": "user", "content": f"What is {a} + 3?"}],
            "answer": a + 3,
            "difficulty": "easy",
        }
        for a in range(4)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_prompts_reach_smollm2_as_they_are(smollm2_gguf, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(with_system=True))
    runs = tmp_path / "runs"
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            str(smollm2_gguf),
            "--data",
            str(data),
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--num-mini-batches",
            "1",
            "--max-new-tokens",
            "8",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "1",
            "--run-name",
            "chat",
            "--runs-dir",
            str(runs),
        ],
    )
    assert result.exit_code == 0, result.output
    groups = query(db_path(runs, "chat"), "SELECT prompt_id, prompt, model_prompt FROM groups ORDER BY group_idx")
    assert len(groups) == 2
    for row in groups.itertuples():
        question = f"What is {row.prompt_id.removeprefix('add-')} + 3?"
        assert row.model_prompt == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )  # SmolLM2's default system message gone
        assert row.prompt == f"{SYSTEM}\n\n{question}"
    shown = runner.invoke(
        app, ["rollouts", "chat", "--step", "1", "--model-prompt", "--runs-dir", str(runs)], env={"COLUMNS": "200"}
    )
    assert shown.exit_code == 0 and "<|im_start|>system" in shown.output and SYSTEM in shown.output

    # a user-only file with --system-prompt is the same conversation, token for token
    _, codec = load_policy(str(smollm2_gguf))
    with_system = load_task(str(data))
    user_only = load_task(
        str(write_jsonl(tmp_path / "user.jsonl", chat_rows(with_system=False))),
        prompt_format=PromptFormat(system_prompt=SYSTEM),
    )
    for mine, theirs in zip(with_system.train, user_only.train, strict=True):
        assert codec.encode(with_system.prompt(mine)) == codec.encode(user_only.prompt(theirs))
