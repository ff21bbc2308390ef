"""`qae train --prompt-template / --system-prompt` on the built-in model: the stored prompts are the template filled,
the run's config keeps both, a resume keeps them (a change is refused, as for any option a resume cannot change), and a
TOML file sets them as the command line does."""

import json

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config, load_toml
from qae_app.core.errors import QAEUserError
from qae_app.data.tasks import arith_task
from qae_app.store.reader import query
from qae_app.store.run_folder import CONFIG_FILE, db_path, run_dir

runner = CliRunner()
ONE_STEP = [
    "--steps",
    "1",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "1",
]


def train_with_template(runs) -> None:
    result = runner.invoke(
        app,
        ["train", *ONE_STEP, "--prompt-template", "compute {question}", "--run-name", "tpl", "--runs-dir", str(runs)],
    )
    assert result.exit_code == 0, result.output


def test_one_step_with_a_template_stores_the_prompts_it_made(tmp_path):
    runs = tmp_path / "runs"
    train_with_template(runs)
    path = db_path(runs, "tpl")
    questions = {p.prompt_id: p.question for p in arith_task().train}
    groups = query(path, "SELECT prompt_id, prompt, model_prompt FROM groups")
    assert len(groups) == 2
    for row in groups.itertuples():
        assert row.prompt == "compute " + questions[row.prompt_id]  # e.g. "compute 3+4="
        assert row.model_prompt is None  # the built-in model has no chat template: `prompt` is what it read
    stored = json.loads((run_dir(runs, "tpl") / CONFIG_FILE).read_text())
    assert (stored["prompt_template"], stored["system_prompt"]) == ("compute {question}", None)
    shown = runner.invoke(app, ["rollouts", "tpl", "--step", "1", "--runs-dir", str(runs)])
    assert "compute " + groups["prompt"][0].removeprefix("compute ") in shown.output


@pytest.mark.slow
def test_a_resume_keeps_the_runs_template(tmp_path):
    """A new template on resume is refused, saying which and what a resume may change; without one the run goes on
    with its own."""
    runs = tmp_path / "runs"
    train_with_template(runs)
    changed = runner.invoke(
        app, ["train", "--resume", "tpl", "--steps", "2", "--prompt-template", "do {question}", "--runs-dir", str(runs)]
    )
    assert changed.exit_code == 2
    assert (
        "resume: --prompt-template do {question} conflicts with run 'tpl', which was started with compute "
        "{question}" in " ".join(changed.output.split())
    )
    resumed = runner.invoke(app, ["train", "--resume", "tpl", "--steps", "2", "--runs-dir", str(runs)])
    assert resumed.exit_code == 0, resumed.output
    prompts = query(db_path(runs, "tpl"), "SELECT prompt FROM groups WHERE step = 2")["prompt"]
    assert prompts.str.startswith("compute ").all() and len(prompts) == 2


def test_toml_sets_the_prompt_options(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[prompt]\nprompt_template = """\n{question}\nPut it in \\\\boxed{}."""\nsystem-prompt = "Be brief."\n'
    )
    assert load_toml(toml) == {"prompt_template": "{question}\nPut it in \\boxed{}.", "system_prompt": "Be brief."}
    cfg = build_config(toml)
    assert (cfg.prompt_format.template, cfg.prompt_format.system_prompt) == (
        "{question}\nPut it in \\boxed{}.",
        "Be brief.",
    )
    assert build_config(toml, system_prompt="Other.").system_prompt == "Other."  # the command line wins


@pytest.mark.parametrize(
    "template, message",
    [
        (
            "Solve it. \\boxed{}",
            "prompt-template: 'Solve it. \\boxed{}' names no column, so every prompt would be this same text.",
        ),
        ("{question} \udc80", "prompt-template: '{question} \udc80' is not UTF-8 text (character 12"),
    ],
)
def test_template_checked_before_anything_runs(template, message):
    with pytest.raises(QAEUserError) as e:
        build_config(prompt_template=template)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("size", [100_000, 1_000_000], ids=["100KB-command-line", "1MB-toml"])
def test_a_system_prompt_longer_than_the_context_is_measured_once_and_refused_as_itself(tmp_path, monkeypatch, size):
    """Issue 48 L7: a 100 KB --system-prompt was refused after 31 s as "prompt 'd-1' is 100,017 tokens ... remove or
    shorten those problems" (every problem's prompt, which holds it, encoded in turn), and 1 MB (a TOML file's) had
    no answer in 120 s. The system prompt is measured first, once, and refused as what is too long."""
    from qae_app.models import policy

    encoded = []
    real_encode = policy.CharTokenizer.encode
    monkeypatch.setattr(
        policy.CharTokenizer,
        "encode",
        lambda self, prompt: encoded.append(len(str(prompt))) or real_encode(self, prompt),
    )
    text = ("Be brief. " * (size // 10 + 1))[:size]
    if size > 100_000:  # (a command-line argument holds at most 128 KiB: a megabyte comes from a TOML file)
        (tmp_path / "run.toml").write_text(f"system_prompt = {json.dumps(text)}\n")
        given = ["--config", str(tmp_path / "run.toml")]
    else:
        given = ["--system-prompt", text]
    result = runner.invoke(
        app, ["train", *ONE_STEP, *given, "--runs-dir", str(tmp_path / "runs")], env={"COLUMNS": "300"}
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and said.count("error:") == 1, said[-2000:]
    assert f"system-prompt: it is {size + 1:,} tokens on its own, and every prompt holds it" in said
    assert "the model's context is 128" in said and "Remove or shorten those problems" not in said
    assert sum(1 for length in encoded if length >= size) == 1  # measured once, not once per problem
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))
