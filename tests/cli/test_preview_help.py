"""`qae preview --help`: its own options, snapshotted (the `qae train` options it shares follow, generated from
TrainConfig as train's are, and are left out of the snapshot). Rewrite after a deliberate change with
`QAE_UPDATE_SNAPSHOTS=1 python -m pytest tests/cli/test_preview_help.py` and read the diff."""

from __future__ import annotations

import dataclasses

import typer
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import TrainConfig
from tests.cli.test_cli_views import check_snapshot, normalized

runner = CliRunner()


def test_preview_help_matches_its_snapshot_and_takes_every_train_option():
    result = runner.invoke(app, ["preview", "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    own, _, _ = result.output.partition("╭─ Run ")
    check_snapshot("preview-help-100", normalized(own))
    commands = typer.main.get_command(app).commands
    flags = {name: {flag for p in commands[name].params for flag in p.opts} for name in ("train", "preview")}
    for field in dataclasses.fields(TrainConfig):  # the run's own options, as `qae train` takes them
        flag = f"--{field.name.replace('_', '-')}"
        assert flag in flags["train"] and flag in flags["preview"], flag
