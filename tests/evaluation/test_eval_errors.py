"""`qae eval --model NAME` for a name that is no run, no folder and no cached Hugging Face model says so at once: it
was taken for a Hub id and retried offline for 59 s, never saying there is no run of that name."""

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app


@pytest.mark.parametrize("existing_runs", [False, True])
def test_a_mistyped_run_id_is_named_at_once(tmp_path, monkeypatch, existing_runs):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    runs = tmp_path / "runs"
    if existing_runs:
        trained = CliRunner().invoke(
            app,
            [
                "train",
                "--run-name",
                "mine",
                "--steps",
                "1",
                "--prompts-per-step",
                "2",
                "--group-size",
                "4",
                "--eval-every",
                "0",
                "--cpu",
                "--runs-dir",
                str(runs),
            ],
        )
        assert trained.exit_code == 0, trained.output
    result = CliRunner().invoke(app, ["eval", "--model", "nope", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and f"model: there is no run 'nope' in {runs}" in output, output
    assert ("last written first: mine" if existing_runs else "last written first: none") in output
