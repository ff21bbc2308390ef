"""`qae plan` on a model config or GGUF file it cannot read: one message naming the file and what to pass, exit 2 (a
RecursionError, a JSON list's later crash, and gguf's 'GGUF magic invalid' before)."""

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize(
    "plant, message",
    [
        ("deep/config.json", "nested deeper than any model config"),
        ("list/config.json", "holds a list, not a model config"),
        ("bad.gguf", "is not a GGUF file gguf can read"),
    ],
)
def test_qae_plan_on_a_model_file_it_cannot_read_is_one_message(tmp_path, plant, message):
    content = {
        "deep/config.json": '{"a":' * 100_000 + "1" + "}" * 100_000,
        "list/config.json": "[1, 2]",
        "bad.gguf": "not a gguf file",
    }[plant]
    path = tmp_path / plant
    path.parent.mkdir(exist_ok=True)
    path.write_text(content)
    model = path if plant.endswith(".gguf") else path.parent
    result = runner.invoke(app, ["plan", "--model", str(model)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    "table, message",
    [
        ("gpus = true", "[plan] gpus = True in {path} is not a whole number"),
        ("gpus = 2.5", "[plan] gpus = 2.5 in {path} is not a whole number"),
        ('gpu_memory_gb = "80"', "[plan] gpu_memory_gb = '80' in {path} is not a number"),
        ("prompt_tokens = false", "[plan] prompt_tokens = False in {path} is not a whole number"),
        ("sharding = 1", "[plan] sharding = 1 in {path} is not a name"),
    ],
)
def test_a_plan_table_value_of_another_kind_is_one_message_naming_it(tmp_path, table, message):
    """Issue 48 L11: `[plan] gpus = true` was planned as "True x 80 GB" (a TOML boolean is a Python int)."""
    path = tmp_path / "run.toml"
    path.write_text(f"[plan]\n{table}\n")
    result = runner.invoke(app, ["plan", "--config", str(path)], env={"COLUMNS": "300"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and said.count("error:") == 1 and message.format(path=path) in said, said
    assert "True x" not in said
