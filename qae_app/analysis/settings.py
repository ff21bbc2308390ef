"""A run's stored settings (its config.json, and the `config` column of its database's `runs` row), checked as qae
writes them before anything reads them: each option of its TrainConfig field's type and in its range, and the record
of how the run was launched and of its reward files in the shape qae writes. A run folder can come from anyone, and
what reads its settings compares, sums and formats them: `qae show`, `qae runs`, `qae compare`, the dashboard and a
resume. Torch-free."""

from __future__ import annotations

from pathlib import Path

from qae_app.config import FIELDS, NUMERIC_RANGES, check_range, coerce_option, k_number
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.store.reader import DB_FILE, READ_STATUSES, UNREADABLE, stored_config

# what a training session records in the settings beside the options: how it was launched (models.sharding's
# DistributedSetup) and its reward functions' files (train.reward_record)
STORED_BESIDE_OPTIONS = frozenset({"distributed", "reward_files"})


def settings_problem(settings: dict) -> str | None:
    """What in `settings` qae did not write ("'steps' = 'NaN' is a str, expected int. ..."), or None. Keys it does not
    know are left to the caller (a resume refuses them; a view shows them as they are)."""
    for key, value in settings.items():
        if key in FIELDS:
            problem = _option_problem(key, value)
        elif key == "distributed":
            problem = _launch_problem(value)
        elif key == "reward_files":
            problem = _reward_files_problem(value)
        else:
            continue
        if problem:
            return problem
    return None


def _option_problem(key: str, value) -> str | None:
    if value is None:
        return None if "None" in str(FIELDS[key].type) else f"'{key}' = null, expected {FIELDS[key].type}"
    try:
        value = coerce_option(key, value, "settings")
        if key in NUMERIC_RANGES:
            check_range(key, value)
        choices = FIELDS[key].metadata.get("choices")
        if choices and value not in choices:
            return f"'{key}' = {clipped(repr(value))}, not one of {', '.join(choices)}"
        if key == "k" and (k := k_number(value)) is not None and not 0.0 < k < 1.0:  # (nan too)
            return f"'k' = {clipped(repr(value))}, outside (0, 1)"
    except QAEUserError as err:
        return str(err).removeprefix("settings: ")
    return None


def _launch_problem(value) -> str | None:
    """'distributed': {"sharding": text, "processes": n, "machines": n, "mixed_precision": text, ...}."""
    if not isinstance(value, dict):
        return f"'distributed' = {clipped(repr(value))} is not a record of how the run was launched"
    for name in ("processes", "machines"):
        count = value.get(name, 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count < 1 << 31:
            return f"'distributed' holds {name} = {clipped(repr(count))}, not a count of {name}"
    for name in ("sharding", "mixed_precision", "sharded_by"):
        if not isinstance(value.get(name), (str, type(None))):
            return f"'distributed' holds {name} = {clipped(repr(value.get(name)))}, not a name"
    return None


def _reward_files_problem(value) -> str | None:
    """'reward_files': {spec: {"path": text, "sha256": text, "earlier": [{"sha256": text, "until_step": n}]}}."""
    if not isinstance(value, dict):
        return f"'reward_files' = {clipped(repr(value))} is not a record of the reward functions' files"
    for spec, entry in value.items():
        earlier = entry.get("earlier", []) if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or not all(isinstance(entry.get(name), (str, type(None))) for name in ("path", "sha256"))
            or not isinstance(earlier, list)
            or not all(isinstance(e, dict) for e in earlier)
        ):
            return f"'reward_files' holds {clipped(repr(spec))}: {clipped(repr(entry))}, not a file's path and sha256"
    return None


def settings_error(path: Path, problem: str) -> QAEUserError:
    """The refusal of a run whose database (`path`) holds settings qae did not write."""
    return QAEUserError(
        f"run: {path} holds settings qae did not write ({problem.rstrip('.')}): the file was edited or "
        "crafted. "
        "Restore it from a backup, or move the run's folder out of the runs dir."
    )


def checked_settings(row: dict, path: Path) -> dict:
    """The settings of a run's row (reader.read_run), refused by name (settings_error) when qae did not write them."""
    settings = stored_config(row)
    problem = settings_problem(settings)
    if problem:
        raise settings_error(path, problem)
    return settings


def listed_with_settings_checked(row: dict, runs_dir: Path) -> dict:
    """A `run_summaries` row as `qae runs` lists it: a run whose settings qae did not write is unreadable, with why."""
    if row.get("status") in READ_STATUSES:
        return row
    problem = settings_problem(stored_config(row))
    if problem is None:
        return row
    error = str(settings_error(Path(runs_dir) / str(row["run_id"]) / DB_FILE, problem))
    return {
        "run_id": row["run_id"],
        "name": row["run_id"],
        "status": UNREADABLE,
        "error": error,
        "created_at": row.get("created_at"),
        "steps": None,
    }
