"""Options several commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _runs_dir_is_a_folder(value: Path) -> Path:
    from qae_app.core.host_faults import name_too_long

    long = name_too_long(value)
    if long is not None:
        raise typer.BadParameter(
            f"'{long}' has a name over 255 bytes, longer than the file system allows for one "
            "folder. Use a shorter name."
        )
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(
            f"'{value}' is a file, not a folder. Pass the folder that holds one sub-folder per "
            "run (it is created by the first `qae train`)."
        )
    return value


RunsDir = Annotated[
    Path, typer.Option("--runs-dir", help="Folder holding one sub-folder per run.", callback=_runs_dir_is_a_folder)
]
DEFAULT_RUNS_DIR = Path("runs")
