"""`qae rm`: deleting run folders without racing a trainer or a reader. A run being trained is refused; a run
being deleted is first renamed to a hidden name in one atomic step (so `qae runs` and the dashboard stop listing it at
once, and a reader holding its file keeps reading what it opened), then removed. A run folder that is a symbolic link
is the link: it is removed, and the folder it points at, outside the runs dir, is left as it is."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.store.run_folder import CONFIG_FILE, DB_FILE, RunLock, trainer_alive, validated_run_dir

REMOVING_PREFIX = ".removing-"  # hidden from every listing (run_folder.listed_folder_name)


def folders_to_remove(runs_dir: Path, runs: list[str]) -> list[Path]:
    """The folders of `runs`, each checked before any is deleted: a run that is not there, or is being trained, is
    refused by name."""
    if not runs:
        raise QAEUserError("runs: name the runs to delete (see `qae runs`), or --sweep NAME for a sweep's runs.")
    folders = []
    for run in dict.fromkeys(runs):
        folder = validated_run_dir(runs_dir, run)
        if not folder.is_dir() or not ((folder / DB_FILE).exists() or (folder / CONFIG_FILE).exists()):
            raise QAEUserError(f"run: no run '{run}' in {runs_dir}. Nothing was deleted. See `qae runs`.")
        if trainer_alive(folder):
            raise QAEUserError(
                f"run: '{run}' is being trained right now. Stop it first with `qae stop {run}` (it "
                "stops after its current step), then delete it. Nothing was deleted."
            )
        folders.append(folder)
    return folders


def remove_run_folder(folder: Path) -> str | None:
    """Delete one run folder: under its lock (a trainer starting now is refused), renamed out of sight, removed. A
    linked run folder: the link is removed, never what it points at (nothing written there); returns where it
    pointed (None for a folder of the runs dir's own)."""
    if folder.is_symlink():
        target = os.path.realpath(folder)
        os.unlink(folder)
        return target
    lock = RunLock(folder).acquire("rm")
    try:
        hidden = folder.with_name(f"{REMOVING_PREFIX}{folder.name}-{os.getpid()}")
        os.rename(folder, hidden)
    finally:
        lock.release()
    shutil.rmtree(hidden)
    return None
