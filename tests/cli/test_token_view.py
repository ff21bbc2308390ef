"""`qae rollouts RUN --step N --tokens`: every token of the shown responses with its numbers, coloured on a colour
terminal and as plain tab-separated numbers in a pipe, the model's text never reaching the terminal as control
sequences (the crafted run's tokens hold markup and an ESC [2J)."""

import json

from typer.testing import CliRunner

from qae_app.cli.main import app
from tests.dashboard.helpers import EVIL_RESPONSE, _write_crafted, crafted_tokens

runner = CliRunner()


def rollouts(runs, *options, env=None):
    result = runner.invoke(
        app,
        ["rollouts", "crafted", "--runs-dir", str(runs), "--step", "3", "--tokens", *options],
        env={"COLUMNS": "100", **(env or {})},
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_piped_every_token_is_a_line_of_plain_numbers(tmp_path):
    _write_crafted(tmp_path)
    lines = rollouts(tmp_path, "--regime", "easy").splitlines()
    assert lines[0] == "group\tsample\tposition\ttoken\tlogprob\tentropy\told_logprob\tgap"
    rows = [line.split("\t") for line in lines[1:]]
    evil = crafted_tokens(EVIL_RESPONSE)
    mine = [row for row in rows if row[:2] == ["0", "3"]]
    assert len(mine) == len(evil)  # a line per token, none cut at the width
    assert [json.loads(row[3]) for row in mine] == evil  # (JSON writes the ESC as \\u001b)
    assert [float(row[4]) for row in mine] == [-0.5 * (i + 1) for i in range(len(evil))]
    assert all(row[6] == row[7] == "" for row in mine)  # no trainer numbers in this run
    assert "\x1b" not in "\n".join(lines)  # the escape is written out, never sent


def test_on_a_colour_terminal_tokens_are_coloured_and_control_characters_escaped(tmp_path):
    _write_crafted(tmp_path)
    out = rollouts(
        tmp_path,
        "--regime",
        "easy",
        "--color-by",
        "logprob",
        env={"FORCE_COLOR": "1", "TERM": "xterm-256color", "COLORTERM": "truecolor"},
    )
    assert "background: the sampler's log-prob of the token" in out
    assert "\x1b[2J" not in out and "\\x1b[2J" in out
    assert "48;2;" in out  # a truecolor background on the tokens
    assert "<script>alert('x')</script>" in out


def test_a_response_without_stored_tokens_says_so_and_a_bad_color_by_is_refused(tmp_path):
    _write_crafted(tmp_path)
    result = runner.invoke(
        app,
        ["rollouts", "crafted", "--runs-dir", str(tmp_path), "--step", "1", "--tokens", "--limit", "1"],
        env={"COLUMNS": "100"},
    )
    assert "its tokens were not stored (--store-tokens)" in result.output
    result = runner.invoke(app, ["rollouts", "crafted", "--runs-dir", str(tmp_path), "--tokens", "--color-by", "hue"])
    assert result.exit_code == 2 and "color-by: unknown value 'hue'. Choose one of: logprob, entropy, gap" in " ".join(
        result.output.split()
    )
