"""Text from a run folder reaches the terminal as text: a response, a prompt, an error or a config value carrying an
OSC 52 clipboard write or a clear-screen sequence is printed with its control characters shown as escapes."""

from __future__ import annotations

import duckdb
import pytest
from typer.testing import CliRunner

from qae_app.cli.console import visible_controls
from qae_app.cli.main import app
from tests.synthetic import write_run

CLIPBOARD = "\x1b]52;c;cHduZWQ=\x07"  # OSC 52: put 'pwned' on the clipboard
CLEAR = "\x1b[2J\x1b[H"


def test_control_characters_become_visible_escapes():
    assert visible_controls(f"a{CLIPBOARD}b{CLEAR}\tc\nd\x9b") == "a\\x1b]52;c;cHduZWQ=\\x07b\\x1b[2J\\x1b[H\tc\nd\\x9b"


@pytest.fixture
def planted(tmp_path):
    runs_dir = tmp_path / "runs"
    write_run(runs_dir, "r", steps=2, prompts_per_step=2, group_size=4, config={"data": f"math{CLIPBOARD}.jsonl"})
    with duckdb.connect(str(runs_dir / "r" / "qae.duckdb")) as con:
        con.execute("UPDATE rollouts SET response = ?", [f"the answer{CLIPBOARD}{CLEAR} is 4"])
        con.execute("UPDATE groups SET prompt = ?", [f"what{CLEAR} is 2+2?"])
        con.execute("UPDATE runs SET error = ?, status = 'failed'", [f"boom{CLIPBOARD}"])
    return runs_dir


@pytest.mark.parametrize("command", [["runs"], ["show", "r"], ["rollouts", "r", "--step", "2", "--full"]])
def test_no_escape_from_a_run_folder_reaches_the_terminal(planted, command):
    result = CliRunner().invoke(app, [*command, "--runs-dir", str(planted)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "\x1b]" not in result.output and "\x1b[2J" not in result.output and "\x07" not in result.output
    if command[0] == "rollouts":
        assert "\\x1b]52;c;cHduZWQ=" in result.output  # shown, not dropped: the user sees what the file holds


def test_an_error_naming_a_path_wider_than_the_terminal_keeps_the_path_whole(tmp_path):
    """A refusal is one soft-wrapped line (the terminal wraps it): at 40 columns a 150-character path in it reads
    whole, not folded mid-name by rich (which made a path copied from the message, or a test's check of it, depend on
    the temporary folder's length)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    missing = deep / "words.jsonl"
    result = CliRunner().invoke(
        app,
        ["train", "--data", str(missing), "--steps", "1", "--runs-dir", str(tmp_path / "runs")],
        env={"COLUMNS": "40"},
    )
    assert result.exit_code == 2, result.output
    assert str(missing) in result.output, result.output
