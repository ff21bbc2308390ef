"""The one place that knows the store formats of qae's pre-releases: what a run database written by one lacks, and the
pending writes they saved as Python pickles. `qae migrate RUN` (train/run_migration.py) brings such a folder to the
current format with the functions here; every reader and writer knows the current format only, and refuses an older
file with run_file.OldRunFormat, which names `qae migrate`.

A database is of the current format when it has every table and column of `schema.TABLES`. A pre-release file lacks
some: tables and columns added since, each added here, and in the rows written before a column existed the value
`FILLED` gives it (NULL where none is known: a gold answer nobody stored). Pending writes were pickled before they
were JSON: unpickling can run code, so they are converted only for a folder its user vouches for (--trust-pickles).
"""

from __future__ import annotations

import json
import os
import pickle
from datetime import datetime, timezone
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.store.run_file import OldRunFormat, attach, migrate_hint, refuse_crafted_objects, run_file_database
from qae_app.store.run_folder import CONFIG_FILE, DB_FILE, PENDING_DIR, read_run_config, replace_run_file
from qae_app.store.schema import PENDING_SUFFIX, TABLES, pending_write_json

# the value, as SQL over the row, of a column added after its table's first version, in the rows written before it
FILLED = {
    ("evals", "source"): "'train'",
    ("eval_samples", "source"): "'train'",
    ("groups", "filtered"): "FALSE",
    ("rollouts", "filtered"): "FALSE",
    ("rollouts", "correct"): "reward = 1",
}
PICKLED_PENDING_SUFFIX = ".pkl"  # how pre-releases saved a pending write (a pickled PendingWrite)


def migrate_database(path: Path) -> list[str]:
    """Add to the run file at `path` the tables and columns of the current format it lacks, filling the rows written
    before a column existed (FILLED), in one transaction. Returns what it added."""
    con = run_file_database()
    try:
        attach(con, Path(path), "run", timeout_s=5.0, read_only=False)
        refuse_crafted_objects(con, "run", Path(path), current_format=False)
        con.execute("USE run")
        have: dict[str, set[str]] = {}
        for table, column in con.execute(
            "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = 'run' AND schema_name = 'main'"
        ).fetchall():
            have.setdefault(table, set()).add(column)
        changes = []
        con.execute("BEGIN TRANSACTION")
        for table, columns in TABLES.items():
            if table not in have:
                con.execute(
                    f"CREATE TABLE {table} ("
                    + ", ".join(f"{name} {sql_type}" for name, sql_type in columns.items())
                    + ")"
                )
                changes.append(f"added the {table} table")
                continue
            for name, sql_type in columns.items():
                if name in have[table]:
                    continue
                con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {sql_type.split(' USING ')[0]}")
                if (table, name) in FILLED:
                    con.execute(f"UPDATE {table} SET {name} = {FILLED[table, name]}")
                changes.append(
                    f"added {table}.{name}"
                    + (f" (earlier rows: {FILLED[table, name]})" if (table, name) in FILLED else "")
                )
        con.execute("COMMIT")
        return changes
    finally:
        con.close()


# ---------------------------------------------------------------------------------------------------------------
# pending writes a pre-release pickled


def pickled_pending_files(run_dir: Path) -> list[Path]:
    return sorted((Path(run_dir) / PENDING_DIR).glob(f"*{PICKLED_PENDING_SUFFIX}"))


def pickled_pending_error(run_dir: Path, pickled: list[Path]) -> QAEUserError:
    """A writer meeting them: the folder is of an older format."""
    return OldRunFormat(
        f"store: {Path(run_dir) / PENDING_DIR} holds {len(pickled)} write(s) an older qae saved as Python pickles "
        f"({pickled[0].name}{', ...' if len(pickled) > 1 else ''}); this version reads JSON only. "
        f"{migrate_hint(run_dir)} (`qae migrate` reads pickles only with --trust-pickles, for a folder you made "
        "yourself; for one from someone else, delete those files: the steps they held are trained again from the "
        "newest checkpoint.)"
    )


class _PendingUnpickler(pickle.Unpickler):
    """A pre-release pickled `PendingWrite` where it lived then, the flat module `qae_app.store`: its class is looked
    up in store.schema."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("qae_app.store", "PendingWrite"):
            module = "qae_app.store.schema"
        return super().find_class(module, name)


def convert_pickled_pending(run_dir: Path) -> list[str]:
    """Rewrite a pre-release's pickled pending writes as JSON (each atomically, then the pickle removed). Only for a
    folder its user vouched for (`qae migrate --trust-pickles`): unpickling can run code. Returns what it converted."""
    converted = []
    for path in pickled_pending_files(run_dir):
        with open(path, "rb") as f:  # the user vouched for this folder (--trust-pickles)
            write = _PendingUnpickler(f).load()
        write.spilled = None
        if getattr(write, "logged_at", None) is None:  # (saved before writes carried it: the conversion's time)
            write.logged_at = datetime.now(timezone.utc).replace(tzinfo=None)
        final = path.with_suffix(PENDING_SUFFIX)
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(pending_write_json(write))
        os.replace(tmp, final)
        path.unlink()
        converted.append(f"converted pending/{path.name} to JSON")
    return converted


# ---------------------------------------------------------------------------------------------------------------
# settings a pre-release stored and this version has no option for


def drop_config_keys(run_dir: Path, known: set[str]) -> list[str]:
    """Drop from the run's config.json and its runs row's `config` the keys not in `known` (options a pre-release
    had). Returns what it dropped."""
    run_dir = Path(run_dir)
    stored = read_run_config(run_dir) if (run_dir / CONFIG_FILE).exists() else {}
    dropped = sorted(set(stored) - known)
    if dropped:
        replace_run_file(run_dir / CONFIG_FILE, json.dumps({k: v for k, v in stored.items() if k in known}, indent=2))
    if (run_dir / DB_FILE).exists():
        con = run_file_database()
        try:
            attach(con, run_dir / DB_FILE, "run", timeout_s=5.0, read_only=False)
            refuse_crafted_objects(con, "run", run_dir / DB_FILE, current_format=False)
            for run_id, text in con.execute("SELECT run_id, config FROM run.runs").fetchall():
                config = json.loads(text) if text else {}
                extra = sorted(set(config) - known) if isinstance(config, dict) else []
                if extra:
                    con.execute(
                        "UPDATE run.runs SET config = ? WHERE run_id = ?",
                        [json.dumps({k: v for k, v in config.items() if k in known}), run_id],
                    )
                    dropped = sorted(set(dropped) | set(extra))
        finally:
            con.close()
    return [f"dropped the setting {key}, which this version has no option for" for key in dropped]
