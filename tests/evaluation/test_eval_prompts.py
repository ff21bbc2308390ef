"""`qae eval` takes `qae train`'s --prompt-template and --system-prompt, and the two render a problem's prompt the
same way: on a small Llama with a ChatML template (the `chat_folder` fixture), the prompt the model saw
(`model_prompt`) of each problem is the same in the training run's held-out evaluation and in `qae eval` of its
checkpoint, given the options or not (a run's are `qae eval --model RUN`'s defaults); and a template's error names the
option and the file."""

import json

from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path

runner = CliRunner()
ROWS = [{"id": f"p{i}", "question": f"What is {i} plus 3?", "answer": str(i + 3), "unit": "apples"} for i in range(6)]
PROMPTS = ["--prompt-template", "{question} Count {unit}; put it in \\boxed{}.", "--system-prompt", "Be terse."]


def invoke(*args) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_train_and_eval_render_the_prompt_alike(chat_folder, tmp_path):
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    runs = tmp_path / "runs"
    invoke(
        "train",
        "--model",
        chat_folder,
        "--data",
        data,
        "--heldout-fraction",
        "0.5",
        "--eval-every",
        "1",
        "--steps",
        "1",
        "--prompts-per-step",
        "1",
        "--group-size",
        "2",
        "--num-mini-batches",
        "1",
        "--max-new-tokens",
        "2",
        "--checkpoint-every",
        "1",
        "--run-name",
        "chat",
        "--runs-dir",
        runs,
        *PROMPTS,
    )
    invoke(
        "eval",
        "--model",
        "chat",
        "--bench",
        data,
        "--samples",
        "1",
        "--max-new-tokens",
        "2",
        "--runs-dir",
        runs,
        *PROMPTS,
    )
    samples = query(db_path(runs, "chat"), "SELECT source, problem_id, model_prompt FROM eval_samples")
    by_source = {
        source: dict(zip(rows["problem_id"], rows["model_prompt"], strict=True))
        for source, rows in samples.groupby("source")
    }
    held_out = by_source["train"]
    assert len(held_out) == 3 and len(by_source["eval"]) == 6  # half held out; qae eval reads the whole file
    for problem_id, seen in held_out.items():
        assert seen == by_source["eval"][problem_id]
        i = int(problem_id[1:])
        assert seen == (
            f"<s><|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is {i} plus 3? Count "
            "apples; put it in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
        )
    groups = query(db_path(runs, "chat"), "SELECT prompt, model_prompt FROM groups")
    [prompt] = groups["prompt"]  # readable: the system message, a blank line, the user message
    assert prompt.startswith("Be terse.\n\nWhat is ") and prompt.endswith(" Count apples; put it in \\boxed{}.")
    assert groups["model_prompt"][0].startswith("<s><|im_start|>system\nBe terse.<|im_end|>")
    # evaluated without them, qae eval prompts as the run trained (the run's options are its defaults), and says so
    said = " ".join(
        invoke("eval", "--model", "chat", "--bench", data, "--samples", "1", "--limit", "1", "--runs-dir", runs).split()
    )
    assert "prompt-template, system-prompt as run chat trained" in said, said
    latest = query(
        db_path(runs, "chat"),
        "SELECT model_prompt FROM eval_samples WHERE source = 'eval' AND "
        "problem_id = 'p0' ORDER BY step DESC, sample_idx",
    )
    assert set(latest["model_prompt"]) == {by_source["eval"]["p0"]}


def test_eval_refuses_a_template_the_bench_cannot_fill(tmp_path):
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = runner.invoke(
        app,
        [
            "eval",
            "--bench",
            str(data),
            "--prompt-template",
            "{question} in {units}",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
    )
    assert result.exit_code == 2
    said = "".join(result.output.split())  # (the console wraps a long path anywhere)
    for part in (
        "prompt-template: '{question} in {units}' names column 'units', but",
        "plus.jsonl' line 1 has no such column (its columns: id, question, answer, unit)",
    ):
        assert "".join(part.split()) in said, result.output
    assert not (tmp_path / "runs").exists()
