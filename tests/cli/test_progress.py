"""What `qae train` prints while it trains and after: the progress line fitted to the terminal's width (the least
useful fields dropped first, "step N/M" and the ETA kept, no number cut), and the commands it suggests each on one
line whatever the width, so a paste runs the whole command."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.progress import DROP_ORDER, StepPace, TrainProgress

METRICS = dict(reward_mean=0.531, entropy=0.412, frac_zero_adv=0.62, heldout_accuracy=0.41)
# every field of step 120 of 300 at 3 steps/min, by name (as `DROP_ORDER` names them)
FIELDS = {
    "step": "step 120/300",
    "bar": "━" * 20,
    "elapsed": re.compile(r"\d+:\d\d:\d\d"),
    "reward": "reward 0.531",
    "entropy": "H 0.412",
    "gated": "gated 0.620",
    "heldout": "held-out 0.410",
    "pace": "· 3 steps/min",
    "eta": "· ETA 60 min",
}


def progress_line(width: int) -> str:
    """The live progress line as a terminal `width` columns wide shows it, after steps 118-120 of 300, 20 s apart."""
    console = Console(width=width, force_terminal=True, file=io.StringIO(), color_system=None)
    progress = TrainProgress(console, 300, 0, show=True)
    times = iter([0.0, 20.0, 40.0])
    progress.pace = StepPace(300, clock=lambda: next(times))
    for step in (118, 119, 120):
        progress.update(step, METRICS)
    console.print(progress.bar.get_renderable())
    return console.file.getvalue()


def shown_fields(line: str) -> list[str]:
    return [
        name
        for name, field in FIELDS.items()
        if (field.search(line) if isinstance(field, re.Pattern) else field in line)
    ]


@pytest.mark.parametrize(
    "width, dropped",
    [(160, []), (100, ["bar"]), (80, ["bar", "pace", "elapsed"]), (60, ["bar", "pace", "elapsed", "gated", "entropy"])],
)
def test_the_progress_line_drops_the_least_useful_fields_first(width, dropped):
    """At 80 columns rich's columns squeezed each other: the step counter, bar and elapsed time went first, and at
    100 '300' read '3…'. Now whole fields go, least useful first, and the step and ETA stay down to 60 columns."""
    text = progress_line(width)
    assert text.count("\n") == 1 and len(text.rstrip("\n")) <= width, text
    assert "…" not in text, text  # no field cut short
    assert shown_fields(text) == [name for name in FIELDS if name not in dropped], text
    assert dropped == [name for name in DROP_ORDER if name in FIELDS][: len(dropped)]  # least useful first
    assert text.startswith("step 120/300 ") and text.rstrip().endswith("· ETA 60 min"), text


def test_suggested_commands_stay_on_one_line_at_80_columns(tmp_path):
    """A --runs-dir longer than the terminal: each command `qae train` suggests is one line (the terminal may show
    it folded; a paste is the whole command), where rich broke it before the path."""
    runs_dir = tmp_path / "a-rather-long-folder-name-for-the-runs" / "of-this-study" / "with-more-levels" / "runs"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--run-name",
            "r",
            "--runs-dir",
            str(runs_dir),
        ],
        env={"COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for command in (
        f"qae show r --runs-dir {runs_dir}",
        f"qae rollouts r --gated --runs-dir {runs_dir}",
        f"qae dashboard --runs-dir {runs_dir}",
    ):
        assert len(command) > 80 and f"  {command}" in lines, result.output
