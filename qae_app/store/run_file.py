"""Opening a run's database file, for the writer (qae_app/store/writer.py) and the readers (qae_app/store/reader.py).

`attach` waits out another process's lock on the file (DuckDB lets one process write a file, or several read it) and
says so when the wait is long. When DuckDB cannot read a file, `is_damage_error` tells a damaged, truncated or foreign
file from a busy one or a mistake in our own SQL, and `unreadable_run_error` says which file, why, and what in the run
folder is still usable (its checkpoints, its config).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import duckdb

from qae_app.core.errors import QAEUserError
from qae_app.core.host_faults import environment_errno, environment_error
from qae_app.store.run_folder import CONFIG_FILE, check_regular_file, list_checkpoints, lost_its_database
from qae_app.store.schema import TABLES, column_problem

_LOCK_ERROR = re.compile(r"lock|being used by another process|Conflicting lock", re.IGNORECASE)


# A run file may come from anyone, and a view or macro in it runs as SQL when a table of that name is read: nothing it
# names may install or load a DuckDB extension (httpfs would reach the network; an extension is native code). Every
# connection qae opens to attach run files is made with these settings.
SAFE_CONNECTION_CONFIG = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
}


def run_file_database() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB database to attach run files to, unable to fetch or load extensions."""
    return duckdb.connect(":memory:", config=SAFE_CONNECTION_CONFIG)


WAIT_NOTICE_S = 1.0  # a wait for the run file longer than this is said (RunWriter's on_wait)


def holder(err: Exception) -> str:
    """'held by PID 123' from DuckDB's lock error, when it says."""
    match = re.search(r"PID (\d+)", str(err))
    return f"held by process {match.group(1)}" if match else "held by another process"


def is_lock_error(err: Exception) -> bool:
    return isinstance(err, (duckdb.IOException, duckdb.ConnectionException)) and bool(_LOCK_ERROR.search(str(err)))


def attach(
    cursor: duckdb.DuckDBPyConnection, path: Path, alias: str, timeout_s: float, read_only: bool = True, on_wait=None
) -> None:
    """ATTACH the file (read-only unless told), retrying while another process holds its lock; `on_wait(holder)` is
    called once if that lasts more than WAIT_NOTICE_S (a long wait says why)."""
    # a planted link would point the writer at another run's file (or anything the user can write): the file and
    # its write-ahead log are attached only as regular files of the folder's own (for writing, not hard links either)
    check_regular_file(Path(path), writing=not read_only)
    check_regular_file(Path(f"{path}.wal"), writing=not read_only)
    literal = str(path).replace("'", "''")  # ATTACH takes no bound parameter; the path is quoted as a literal
    start = time.monotonic()
    deadline = start + timeout_s
    delay = 0.005
    told = on_wait is None
    while True:
        try:
            cursor.execute(f"ATTACH '{literal}' AS {alias}" + (" (READ_ONLY)" if read_only else ""))
            return
        except duckdb.Error as err:
            if not is_lock_error(err) or time.monotonic() >= deadline:
                raise
            if not told and time.monotonic() - start >= WAIT_NOTICE_S:
                on_wait(holder(err))
                told = True
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


class RunFileError(QAEUserError):
    """A run's database file cannot be opened or read: damaged, truncated or not a DuckDB file."""


class OldRunFormat(RunFileError):
    """A run folder written by a pre-release of qae, in a format this version does not read: `qae migrate` brings it
    to the current one."""


def migrate_hint(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    return (
        f"Bring it to this version's format with `qae migrate {run_dir.name} --runs-dir {run_dir.parent}`, then "
        "run the command again."
    )


def format_problem(columns: list[tuple[str, str, str]]) -> str | None:
    """What a run file lacks of the current format, from its (table, column, type) rows: 'has no previews table' or
    'has no rollouts.correct column'; None for a current file, and for one with none of qae's tables (a new file, or
    another program's: the other checks say which)."""
    found: dict[str, set[str]] = {}
    for table, column, _ in columns:
        found.setdefault(table, set()).add(column)
    if not set(found) & set(TABLES):
        return None
    for table, wanted in TABLES.items():
        if table not in found:
            return f"has no {table} table"
        missing = [column for column in wanted if column not in found[table]]
        if missing:
            return f"has no {table}.{missing[0]} column"
    return None


def old_format_error(path: Path, problem: str) -> OldRunFormat:
    path = Path(path)
    return OldRunFormat(
        f"run: {path.parent.name} was written by an older qae ({path} {problem}). {migrate_hint(path.parent)}"
    )


_VETTED: dict[tuple, bool] = {}  # (path, inode, size, mtime) of run files found free of views and macros


def refuse_crafted_objects(
    cursor: duckdb.DuckDBPyConnection, alias: str, path: Path, current_format: bool = True
) -> None:
    """qae writes tables only. A view or a macro in a run file runs as SQL when qae names it: a view called `steps`
    could read any file the user can (`read_text('/etc/...')`), a macro could shadow a function qae's queries call.
    Such a file is refused as crafted, before any query reads it; so is one whose columns qae did not write, and (with
    `current_format`, what every reader and writer asks) one of an older format (OldRunFormat). Checked once per
    version of the file."""
    info = os.stat(path)
    version = (str(path), info.st_ino, info.st_size, info.st_mtime_ns, current_format)
    if version in _VETTED:
        return
    views = [
        row[0]
        for row in cursor.execute(
            "SELECT view_name FROM duckdb_views() WHERE database_name = ? AND NOT internal", [alias]
        ).fetchall()
    ]
    macros = [
        row[0]
        for row in cursor.execute(
            "SELECT function_name FROM duckdb_functions() WHERE database_name = ? AND NOT internal", [alias]
        ).fetchall()
    ]
    if views or macros:
        named = ", ".join(repr(name) for name in [*views, *macros][:5])
        raise RunFileError(
            f"run: {path} holds views or macros ({named}), which qae never writes: SQL in it would run "
            "when qae reads the run. It is not a file qae made; it was not read. Remove it, or open it "
            "with DuckDB yourself if you trust it."
        )
    # a column of qae's retyped or dropped broke every reader that met it (`qae runs` for the whole folder)
    columns = cursor.execute(
        "SELECT table_name, column_name, data_type FROM duckdb_columns() WHERE "
        "database_name = ? AND schema_name = 'main'",
        [alias],
    ).fetchall()
    problem = column_problem(columns)
    if problem:
        raise RunFileError(
            f"run: {path} {problem}: it is not a file qae made, or one edited since; it was not read. "
            "Move it aside, or restore it from a backup."
        )
    if current_format and (old := format_problem(columns)):
        raise old_format_error(path, old)
    if len(_VETTED) > 4096:
        _VETTED.clear()
    _VETTED[version] = True


def unreadable_run_error(path: Path, err: Exception | str) -> RunFileError:
    """The error for a run file DuckDB cannot open or read (damaged, truncated, not DuckDB, missing): names the file,
    the reason, and what in the run folder is still usable."""
    path = Path(path)
    if isinstance(err, BaseException) and environment_errno(err) is not None:  # the machine's fault, not the file's
        if path.parent.name.startswith(".creating-"):  # a new run's staging folder (session.CREATING_PREFIX)
            return RunFileError(
                str(
                    environment_error(
                        f"run-name: cannot create the run in {path.parent.parent}",
                        err,
                        "Nothing was kept: the run does not exist yet.",
                        then="run the command again",
                    )
                )
            )
        return RunFileError(
            str(
                environment_error(
                    f"run: cannot open {path}",
                    err,
                    "The file is not damaged: nothing logged in it is lost. qae needs to "
                    "write it (a training run, or qae eval storing its samples).",
                )
            )
        )
    if not path.exists():
        err = "the file is missing (deleted or moved aside)"
    reason = str(err).strip().splitlines()[0].rstrip(".!") if str(err).strip() else type(err).__name__
    checkpoints = list_checkpoints(path.parent)
    if checkpoints:
        kept = (
            f"The model is safe in its checkpoints ({', '.join(p.name for p in checkpoints)}): evaluate the newest "
            f"with `qae eval --model {checkpoints[-1] / 'model'}`."
        )
    else:
        kept = "The run has no checkpoint to recover a model from."
    config = f" Its settings are in {CONFIG_FILE}." if (path.parent / CONFIG_FILE).exists() else ""
    silence = (
        "Move the file aside to silence this." if path.exists() else "Move the run's folder aside to silence this."
    )
    return RunFileError(
        f"run: cannot read {path}: {reason}. The steps logged in this file are lost unless you restore "
        f"it from a backup. {kept}{config} {silence}"
    )


def refuse_missing_file_of_training_run(path: Path) -> None:
    """A training run's folder (its config.json) without its database: the file was deleted or moved aside. Said as
    such, with its checkpoints, rather than 'no run' (`qae train --run-name` would say the run exists)."""
    if lost_its_database(path.parent):  # (`path` is always a run folder's DB_FILE)
        raise unreadable_run_error(path, "")


def is_damage_error(err: BaseException) -> bool:
    """DuckDB's errors for a file it cannot read (not a held lock, not a mistake in our SQL), or one that is not a qae
    run database (a DuckDB file without qae's tables)."""
    if not isinstance(err, duckdb.Error) or is_lock_error(err):
        return False
    return (
        type(err) is duckdb.Error
        or _missing_table(err) is not None
        or isinstance(
            err, (duckdb.IOException, duckdb.SerializationException, duckdb.InternalException, duckdb.FatalException)
        )
    )


def _missing_table(err: BaseException) -> str | None:
    """The qae table a query found missing from the file, if that is what `err` says."""
    match = re.search(r"Table with name (\w+) does not exist", str(err))
    return match.group(1) if isinstance(err, duckdb.CatalogException) and match and match.group(1) in TABLES else None


def damage_reason(err: BaseException) -> Exception | str:
    """What unreadable_run_error says of `err`."""
    table = _missing_table(err)
    return (
        f"it is not a qae run database (it has no {table} table): another program's DuckDB file, or one emptied"
        if table
        else err
    )
