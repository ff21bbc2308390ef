"""A resume checks that every step up to its checkpoint is stored, and says which are not: a saved write moved aside (or
lost) before it reached the file leaves its step's rows missing, and a resume must not keep silent about it."""

import duckdb
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import logged_steps

runner = CliRunner()
SMALL = ["--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--cpu"]


def test_steps_missing_before_the_checkpoint_are_named_on_resume(tmp_path):
    runs = tmp_path / "runs"
    first = runner.invoke(
        app, ["train", "--run-name", "r", "--steps", "4", "--checkpoint-every", "4", *SMALL, "--runs-dir", str(runs)]
    )
    assert first.exit_code == 0, first.output
    with duckdb.connect(str(runs / "r" / "qae.duckdb")) as con:  # as if steps 2 and 3's saved write were lost
        for table in ("steps", "groups", "rollouts"):
            con.execute(f"DELETE FROM {table} WHERE step IN (2, 3)")
    assert logged_steps(runs / "r") == {1, 4}
    resumed = runner.invoke(
        app, ["train", "--resume", "r", "--steps", "5", "--runs-dir", str(runs)], env={"COLUMNS": "300"}
    )
    output = " ".join(resumed.output.split())
    assert resumed.exit_code == 0, resumed.output
    assert (
        "resumes after its checkpoint at step 4, but the rows of step(s) 2-3 are in neither qae.duckdb nor "
        "pending/" in output
    )
    assert logged_steps(runs / "r") == {1, 4, 5}


def test_a_complete_run_resumes_without_a_word_about_missing_steps(tmp_path):
    runs = tmp_path / "runs"
    assert (
        runner.invoke(
            app,
            ["train", "--run-name", "r", "--steps", "2", "--checkpoint-every", "2", *SMALL, "--runs-dir", str(runs)],
        ).exit_code
        == 0
    )
    resumed = runner.invoke(app, ["train", "--resume", "r", "--steps", "3", "--runs-dir", str(runs)])
    assert resumed.exit_code == 0 and "are in neither" not in resumed.output
