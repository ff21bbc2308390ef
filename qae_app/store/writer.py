"""The single writer of a run's database, `runs/<run_id>/qae.duckdb` (its tables: qae_app/store/schema.py).

Only this module writes the database. The trainer and `qae eval` write through `RunWriter`: it saves each step's rows
under `pending/` and every few seconds opens the file, writes the steps since the last write in one transaction (so
readers see whole steps only, and a kill mid-write loses nothing saved) and closes it again, so readers can get in
between. A reader holding the file makes the writer retry; if the file stays busy the rows stay saved and go out with a
later write, never dropped.

Saved is not synced: a file under `pending/` is whole once it has its name (written under another, then renamed), and
a killed process's writes stay in the OS's cache, so a kill -9 loses nothing saved. Only the OS going down can lose
what is not synced yet, and that matters only for steps a resume does not train again, those up to its checkpoint:
`sync_pending()`, called before each checkpoint, syncs them. (An fsync per step cost 3-45 ms of disk wait a step on
the shared machine, about as long as a whole step at small groups.)
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

if TYPE_CHECKING:  # numpy is imported where rows are written: `qae runs` never writes
    import numpy as np

from qae_app.core.errors import QAEUserError
from qae_app.core.faults import fault_point
from qae_app.store.format_migration import pickled_pending_error, pickled_pending_files
from qae_app.store.run_file import (
    attach,
    damage_reason,
    holder,
    is_damage_error,
    is_lock_error,
    refuse_crafted_objects,
    run_file_database,
    unreadable_run_error,
)
from qae_app.store.run_folder import PENDING_DIR, STORED_STATUSES, check_own_folder
from qae_app.store.schema import (
    EVAL_TABLES,
    PENDING_SUFFIX,
    RUN_UPDATE_FIELDS,
    STEP_METRICS,
    STEP_TABLES,
    TABLES,
    PendingWrite,
    pending_write_json,
    read_pending_write,
    row_columns,
    schema_statements,
)

# When queued steps go to the database. Attaching the file and detaching it (a checkpoint of DuckDB's log) and each
# INSERT cost about as much for one step as for twenty, so steps are written together: after a write that took c
# seconds, the next is due c / WRITE_SHARE later (at most MAX_ROW_DELAY_S, so live views stay live). c is wall time:
# DuckDB does about half a write's work on threads of its own, which the writer thread's CPU time left out (measured:
# 25 of 50 ms CPU), and a write that waits for the CPU or the disk is waited for by whoever waits for the store. At the
# defaults a write of ~20 steps takes ~50 ms, so one is due every ~5 s. Until then each step's rows are saved under
# pending/ (under a millisecond: not synced, see above), where a kill -9 cannot lose them. The file is attached only
# while a write runs, so readers get in between.
WRITE_SHARE = 0.01
MAX_ROW_DELAY_S = 5.0
# ... unless the queued rows are big: a step of the paper's size (512 x 16 responses, ~60 MB of text) costs as much to
# save under pending/ as to write to the database, and its write's fixed cost is nothing beside it. So queued text
# above this goes to the database at once, and pending/ never holds a second copy of it (unless a reader holds the
# file: then it is saved there, as always, until a write gets in).
WRITE_NOW_CHARS = 4_000_000


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


_LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _storable(value):
    """Strings with lone surrogates (a JSON "\\ud800" escape in a data file, a tokenizer's broken decode) cannot be
    encoded as UTF-8, so DuckDB refuses them: each becomes U+FFFD. Anything else is returned as is."""
    if isinstance(value, str) and _LONE_SURROGATE_RE.search(value):
        return _LONE_SURROGATE_RE.sub("\ufffd", value)
    return value


def _column(values: list) -> np.ndarray:
    """One column of rows as DuckDB's NumPy scan takes it, typed as pandas' `from_records` would type it (so the file
    holds what it held when the rows went in as a frame): numbers as float64 (None and NaN become NULL, ints only when
    none is missing), bools as bool when none is missing, anything else (text with `_storable` text, timestamps) as
    Python objects. The values are looked at by type, not one by one: a write holds thousands of rows."""
    import numpy as np  # (here: `qae runs` never writes, and starts faster without it)

    kinds = set(map(type, values))
    missing = type(None) in kinds
    kinds.discard(type(None))
    if str in kinds and not all(value.isascii() for value in values if isinstance(value, str)):
        try:  # (UTF-8 encoding fails exactly on a lone surrogate, and runs at memory speed: a regex over 60 MB of a
            # paper-scale step's text took 0.5 s)
            for value in values:
                if isinstance(value, str):
                    value.encode("utf-8")
        except UnicodeEncodeError:
            values = [_storable(value) for value in values]
    flags = [issubclass(kind, (bool, np.bool_)) for kind in kinds]
    if kinds and all(flags):
        if not missing:
            return np.array(values, dtype=bool)
    elif kinds and not any(flags) and all(issubclass(kind, (int, float, np.number)) for kind in kinds):
        try:
            if not missing and all(issubclass(kind, (int, np.integer)) for kind in kinds):
                return np.array(values, dtype=np.int64)
            return np.array(values, dtype=np.float64)  # None -> NaN
        except OverflowError:  # an int beyond int64: DuckDB converts it from the object
            pass
    return np.fromiter(values, dtype=object, count=len(values))


def _storable_columns(records: list[dict]) -> dict[str, np.ndarray]:
    """`records` as columns (every key of any record; None where one lacks it), each a `_column`. No pandas: its
    import alone (0.3-0.9 s) cost the trainer's process more than a default run's database writes."""
    if set(map(len, records)) == {len(set().union(*records))}:  # every record has every key (the trainer's rows)
        return {name: _column(list(map(operator.itemgetter(name), records))) for name in records[0]}
    names = dict.fromkeys(name for record in records for name in record)  # (in order of appearance)
    return {name: _column([record.get(name) for record in records]) for name in names}


def _rollback(con: duckdb.DuckDBPyConnection, err: BaseException) -> None:
    """Roll back after `err`, which stays the error to report: DuckDB has often ended the transaction itself (an I/O
    error such as a full disk aborts it), and "cannot rollback - no transaction is active" must not replace the
    real cause."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error as rollback_err:
        err.add_note(f"(the rollback after it failed too: {rollback_err})")


class RunWriter:
    """The single writer of one run's database file.

    Writes are queued and go out in order when `flush()` finds the file free: consecutive steps (with their late
    timings) in one transaction, so readers see whole steps only. The trainer calls `flush_when_due()`, which writes
    only when the last write is long enough ago (WRITE_SHARE) and otherwise saves the queued writes to
    `<run>/pending/` (one file each, written atomically). A reader holding the file (even for hours) never fails or
    stalls training either: a flush tries only briefly, and if the file is busy the queued writes are saved the same
    way. So a kill -9 loses nothing but the step in flight; the next flush that finds the file free writes them and
    deletes their files, and a resumed trainer picks up any that an earlier one left.
    """

    # whether each saved write is synced before its rename (False: `sync_pending` syncs them before a checkpoint, the
    # only point a resume needs them durable; bench/bench_handoff.py times what True would cost a step)
    sync_each_spill = False

    def __init__(
        self,
        path: Path,
        run_id: str,
        lock_timeout_s: float = 0.2,
        open_timeout_s: float = 60.0,
        clock=time.monotonic,
        on_wait=None,
        resume_from: int | None = None,
    ):
        """`on_wait(holder)`: called once if opening the file waits on another process for over
        run_file.WAIT_NOTICE_S. `resume_from`: the checkpoint step of a resume, the only writer that takes up a
        saved truncation (`_load_spilled`); None for any other writer (`qae eval`, a new run)."""
        self.path = Path(path)
        self.clock = clock  # when writes are due (tests move it by hand)
        self.next_flush_at = -math.inf  # the first write is due at once
        self._instance: duckdb.DuckDBPyConnection | None = None  # see _open
        self.run_id = run_id
        self.lock_timeout_s = lock_timeout_s  # how long a flush waits for the file before spilling
        self.pending_dir = self.path.parent / PENDING_DIR
        check_own_folder(self.pending_dir)  # (writes saved through a planted link would land outside the folder)
        self.busy_since: float | None = None  # when flushes started finding the file busy (None: it is free)
        self.flush_retries = 0  # flushes that found the file busy
        self.holder = ""  # who held the file at the last busy flush, as DuckDB says it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists() and self.path.stat().st_size > 0
        try:
            with self._open(timeout_s=open_timeout_s, on_wait=on_wait) as con:
                self._check_and_prepare(con, existed)
        except duckdb.Error as err:
            if is_lock_error(err):
                raise QAEUserError(
                    f"store: {self.path} is held by another process for more than "
                    f"{open_timeout_s:.0f} s ({holder(err)}). Close that connection and retry; "
                    "read live runs with `qae show` or the dashboard, which let go at once."
                ) from err
            if is_damage_error(err):
                raise unreadable_run_error(self.path, damage_reason(err)) from err
            raise
        # left by a trainer that never found the file free
        self.pending: list[PendingWrite] = self._load_spilled(resume_from)

    @contextmanager
    def _open(self, timeout_s: float | None = None, on_wait=None) -> Iterator[duckdb.DuckDBPyConnection]:
        """The run file, attached for writing to this writer's own in-memory database (made once: making a DuckDB
        database costs ~30 ms, attaching a file ~2 ms) and detached on exit, which lets go of its lock."""
        if self._instance is None:
            self._instance = run_file_database()
            # this database reaches the run file and nothing else: no COPY ... TO, no ATTACH or read of another path,
            # whatever SQL a crafted name might slip in (its names are checked too: schema.pending_write_from_json)
            self._instance.execute(
                "SET allowed_paths = ?",
                [[str(self.path), *(f"{self.path}{suffix}" for suffix in (".wal", ".wal.checkpoint"))]],
            )
            self._instance.execute("SET enable_external_access = false")
        con = self._instance
        try:
            attach(
                con,
                self.path,
                "run",
                self.lock_timeout_s if timeout_s is None else timeout_s,
                read_only=False,
                on_wait=on_wait,
            )
        except duckdb.Error as err:
            if is_damage_error(err) and self.path.exists() and self.path.stat().st_size > 0:
                raise unreadable_run_error(self.path, err) from err
            raise
        try:
            refuse_crafted_objects(con, "run", self.path)
            con.execute("USE run")
            yield con
        except BaseException:
            # a statement that failed inside a transaction leaves it aborted: every later statement, the USE and
            # DETACH below included, would fail with "Current transaction is aborted" and hide the real error
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass  # no transaction was open
            raise
        finally:
            con.execute("USE memory")
            con.execute("DETACH run")

    def _check_and_prepare(self, con: duckdb.DuckDBPyConnection, existed: bool) -> None:
        """Refuse a damaged file, or a DuckDB file that `existed` before this writer without being a run's, before
        writing to it; then qae's tables, and the folder's run id on every row."""
        # a truncated file opens and takes writes; it fails only when a reader reaches the missing blocks. DuckDB
        # itself drops free blocks from the end of the file, so only the blocks in use must all be there
        block_size, blocks = con.execute(
            "SELECT block_size, used_blocks FROM pragma_database_size() WHERE database_name = current_database()"
        ).fetchone()
        if self.path.stat().st_size < block_size * blocks:
            raise unreadable_run_error(
                self.path,
                f"it is {self.path.stat().st_size:,} bytes, shorter than the "
                f"{block_size * blocks:,} bytes of the blocks its header says "
                "are in use",
            )
        tables = {
            row[0]
            for row in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
            ).fetchall()
        }
        if not tables & set(TABLES) and (tables or existed):  # another program's file, or one emptied: left alone
            raise unreadable_run_error(
                self.path,
                "it is not a qae run database (it has none of qae's tables"
                + (
                    f"; its own: {', '.join(sorted(tables)[:5])})"
                    if tables
                    else "): another program's DuckDB file, or one emptied"
                ),
            )
        for statement in schema_statements():
            con.execute(statement)
        # a copied or renamed run folder is the run named by the folder: its rows take that id
        stored = con.execute("SELECT run_id FROM runs").fetchall()
        if stored and stored[0][0] != self.run_id:
            con.execute("BEGIN TRANSACTION")
            for table in TABLES:
                con.execute(f"UPDATE {table} SET run_id = ?", [self.run_id])
            con.execute("COMMIT")

    def moved_to(self, path: Path) -> None:
        """The file was moved (a new run's staging folder renamed into place): write there from now on, without
        opening it again (a reader may already hold it)."""
        self.path = Path(path)
        self.pending_dir = self.path.parent / PENDING_DIR
        if self._instance is not None:  # its database may reach the old path only: made anew for the new one
            self._instance.close()
            self._instance = None

    # run-level rows ------------------------------------------------------------------------------------------
    def create_run(
        self, name: str, config: dict, estimator: str, k: float | None, model: str, task: str, seed: int
    ) -> None:
        """The run's row, written at once (a new run's database is in a folder no reader can see yet)."""
        with self._open(timeout_s=30) as con:
            con.execute(
                "INSERT INTO runs (run_id, name, created_at, updated_at, status, config, estimator, k, model, task, "
                "seed) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                [
                    self.run_id,
                    _storable(name),
                    _now(),
                    _now(),
                    json.dumps(config),
                    estimator,
                    k,
                    _storable(model),
                    _storable(task),
                    seed,
                ],
            )

    def update_run(self, first: bool = False, **fields) -> bool:
        """Queue a change of run-level fields (status, error, k, config, wall_s, setup_s) and flush; False if it had to
        wait."""
        unknown = set(fields) - (set(RUN_UPDATE_FIELDS) - {"updated_at"})  # updated_at is the writer's own
        if unknown:
            raise ValueError(f"cannot update runs columns {unknown}")
        if "status" in fields and fields["status"] not in STORED_STATUSES:
            raise ValueError(f"status must be one of {STORED_STATUSES}")
        if "config" in fields:
            fields["config"] = json.dumps(fields["config"])
        fields = {name: _storable(value) for name, value in fields.items()}  # an error message may quote bad text
        write = PendingWrite("run", fields=dict(fields, updated_at=_now()))
        if first:  # ahead of every queued write (a failed run's status, when the queued rows are what fails)
            self.pending.insert(0, write)
        else:
            self.pending.append(write)
        return self.flush()

    # step rows -----------------------------------------------------------------------------------------------
    def add_step(self, step: int, **tables: list[dict]) -> None:
        """Queue one step's rows (steps=[...], groups=[...], rollouts=[...], ...); `flush()` writes them."""
        unknown = set(tables) - set(STEP_TABLES)
        if unknown:
            raise ValueError(f"unknown step tables {unknown}")
        for table, records in tables.items():  # a column the table lacks is a bug (a missing one is NULL)
            if records and not set(records[0]) <= set(row_columns(table)):
                raise ValueError(
                    f"{table} rows have columns {sorted(set(records[0]) - set(row_columns(table)))} "
                    f"that the table lacks (it has {', '.join(row_columns(table))})"
                )
        self.pending.append(PendingWrite("step", step=step, tables=tables, logged_at=_now()))

    def update_step(self, step: int, **metrics: float) -> None:
        """Queue values for a step's row that became known after it was queued (its write and checkpoint times)."""
        unknown = set(metrics) - set(STEP_METRICS)
        if unknown:
            raise ValueError(f"unknown step metrics {unknown}")
        self.pending.append(PendingWrite("step_update", step=step, fields=metrics))

    def truncate_after(self, step: int) -> bool:
        """Drop rows of steps after `step` (written after the checkpoint a resume starts from), queued ones too."""
        for write in [w for w in self.pending if w.kind in ("step", "step_update") and w.step > step]:
            self.pending.remove(write)
            if write.spilled is not None:
                write.spilled.unlink(missing_ok=True)
        self.pending.append(PendingWrite("truncate", step=step))
        return self.flush()

    def flush_when_due(self) -> bool:
        """`flush()` if the last write is long enough ago (WRITE_SHARE, MAX_ROW_DELAY_S), else save the queued writes
        under pending/ and return True. False only when a write was due and found the file busy."""
        if self.clock() < self.next_flush_at and queued_text_chars(self.pending) < WRITE_NOW_CHARS:
            self._spill()
            return True
        return self.flush()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Write every queued write in order: run-row changes and truncations one transaction each, consecutive
        steps and step updates together in one. False if the file stayed busy for `timeout_s` (default:
        lock_timeout_s): then every queued write is safe on disk under pending/ until a later flush."""
        if not self.pending:
            return True
        start = time.perf_counter()
        try:
            con_cm = self._open(timeout_s)
            con = con_cm.__enter__()
        except Exception as err:  # noqa: BLE001
            if is_lock_error(err):
                self.flush_retries += 1
                self.busy_since = self.busy_since or time.monotonic()
                self.holder = holder(err)
                self._spill()
                return False
            raise
        try:
            while self.pending:
                write = self.pending[0]
                if write.kind in ("step", "step_update"):
                    count = next(
                        (i for i, w in enumerate(self.pending) if w.kind not in ("step", "step_update")),
                        len(self.pending),
                    )
                    done = self.pending[:count]
                    self._write_steps(con, done)
                elif write.kind == "run":
                    assignments = ", ".join(f"{name} = ?" for name in write.fields)  # allow-listed names
                    con.execute(
                        f"UPDATE runs SET {assignments} WHERE run_id = ?", [*write.fields.values(), self.run_id]
                    )
                    done = [write]
                else:
                    self._in_transaction(
                        con,
                        lambda after=write.step: [
                            con.execute(f"DELETE FROM {table} WHERE run_id = ? AND step > ?", [self.run_id, after])
                            for table in STEP_TABLES
                        ],
                    )
                    done = [write]
                del self.pending[: len(done)]
                for written in done:
                    if written.spilled is not None:
                        written.spilled.unlink(missing_ok=True)
        finally:
            con_cm.__exit__(None, None, None)
        self.busy_since = None
        cost = time.perf_counter() - start
        self.next_flush_at = self.clock() + min(cost / WRITE_SHARE, MAX_ROW_DELAY_S)
        return True

    def wait_until_written(self, timeout_s: float | None = None, on_wait=None, every_s: float = 30.0) -> bool:
        """Flush until every queued write is in the database (or `timeout_s` passes: False). `on_wait(seconds)` is
        called every `every_s` seconds of waiting, so the caller can say what it waits for."""
        start = last_said = time.monotonic()
        while not self.flush(timeout_s=1.0):
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                return False
            if on_wait is not None and now - last_said >= every_s:
                on_wait(now - start)
                last_said = now
        return True

    def _spill(self) -> None:
        """Save every queued write that is not on disk yet: one JSON file each, written to a temporary name, then
        renamed, so a file under pending/ is always whole. Not synced unless `sync_each_spill` (a kill cannot lose it;
        `sync_pending`)."""
        self.pending_dir.mkdir(exist_ok=True)
        for write in self.pending:
            if write.spilled is not None:
                continue
            self._spilled_count += 1
            final = self.pending_dir / f"{self._spilled_count:08d}-{write.kind}{PENDING_SUFFIX}"
            _write_atomically(final, pending_write_json(write), sync=self.sync_each_spill)
            write.spilled = final

    def sync_pending(self) -> None:
        """Sync every queued write saved under pending/ (its file, then the folder, which holds its name) to the
        disk, so an OS crash cannot lose it either; what the database holds DuckDB has synced. The trainer calls this
        before it saves a checkpoint: a resume trains again every step after its checkpoint, but not those before."""
        spilled = [write.spilled for write in self.pending if write.spilled is not None]
        for path in spilled + ([self.pending_dir] if spilled else []):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _load_spilled(self, resume_from: int | None) -> list[PendingWrite]:
        """The writes saved under pending/, in order. A truncation drops rows, and only a resume drops rows: anyone
        else (`qae eval`) takes up the writes before the first one and leaves it and the rest where they are, for the
        run's next resume. A resume never drops a step its checkpoint keeps (a saved truncation below `resume_from`
        is raised to it): a real one is followed by every step it drops, saved too, while one planted alone would
        empty the run."""
        pickled = pickled_pending_files(self.path.parent)
        if pickled:  # (a pre-release's: `qae migrate` converts them)
            raise pickled_pending_error(self.path.parent, pickled)
        writes = []
        found = sorted(self.pending_dir.glob(f"*{PENDING_SUFFIX}"))
        self._spilled_count = int(found[-1].name.split("-")[0]) if found else 0  # new files are named after these
        for path in found:
            write = read_pending_write(path)
            if write.kind == "truncate":
                if resume_from is None:
                    break
                write.step = max(write.step, resume_from)
            write.spilled = path
            writes.append(write)
        for tmp in self.pending_dir.glob("*.tmp"):  # a spill killed before its rename: the write was not queued yet
            tmp.unlink()
        return writes

    @staticmethod
    def _in_transaction(con: duckdb.DuckDBPyConnection, body) -> None:
        con.execute("BEGIN TRANSACTION")
        try:
            body()
            con.execute("COMMIT")
        except BaseException as err:
            _rollback(con, err)
            raise

    def _write_steps(self, con: duckdb.DuckDBPyConnection, writes: list[PendingWrite]) -> None:
        """Consecutive step rows and step updates, in one transaction with one DELETE and one INSERT per table.

        A step written again (replayed after a resume, or queued twice) replaces its earlier rows; evaluations
        replace only their own benchmark's rows from the same source (`qae eval` of a checkpoint must not erase the
        evaluation the trainer logged at that step). A step update joins its step's row when that is written here."""
        rows: dict[str, dict[tuple, list[dict]]] = {table: {} for table in STEP_TABLES}  # table -> key -> rows
        logged_at: dict[int, datetime] = {}  # step -> when its rows were queued
        late_updates = []  # updates of steps written earlier
        for write in writes:
            if write.kind == "step_update":
                steps_rows = rows["steps"].get((write.step,))
                if steps_rows:
                    steps_rows[0] = {**steps_rows[0], **write.fields}
                else:
                    late_updates.append(write)
                continue
            logged_at[write.step] = write.logged_at or _now()
            for table, records in write.tables.items():
                if table in EVAL_TABLES:
                    for benchmark, source in sorted({(r["benchmark"], r["source"]) for r in records}):
                        rows[table][(write.step, benchmark, source)] = [
                            r for r in records if (r["benchmark"], r["source"]) == (benchmark, source)
                        ]
                else:
                    rows[table][(write.step,)] = records

        def body() -> None:
            for table, by_key in rows.items():
                if not by_key:
                    continue
                if table in EVAL_TABLES:
                    for step, benchmark, source in by_key:
                        con.execute(
                            f"DELETE FROM {table} WHERE run_id = ? AND step = ? AND benchmark = ? AND source = ?",
                            [self.run_id, step, benchmark, source],
                        )
                else:
                    con.execute(
                        f"DELETE FROM {table} WHERE run_id = ? AND list_contains(?, step)",
                        [self.run_id, [key[0] for key in by_key]],
                    )
                records = [record for group in by_key.values() for record in group]
                if not records:
                    continue
                columns = _storable_columns(records)
                steps = [key[0] for key, group in by_key.items() for _ in group]
                columns["run_id"] = _column([self.run_id] * len(records))
                columns["step"] = _column(steps)
                if "logged_at" in TABLES[table]:
                    columns["logged_at"] = _column([logged_at[step] for step in steps])
                con.register("_batch", columns)
                con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _batch")
                con.unregister("_batch")
            for update in late_updates:
                assignments = ", ".join(f"{name} = ?" for name in update.fields)  # STEP_METRICS names
                con.execute(
                    f"UPDATE steps SET {assignments} WHERE run_id = ? AND step = ?",
                    [*update.fields.values(), self.run_id, update.step],
                )
            for write in writes:  # crash tests: a kill here loses nothing (these steps are in pending/ or in flight)
                if write.kind == "step":
                    fault_point("db_commit", write.step)

        self._in_transaction(con, body)


def queued_text_chars(writes: list[PendingWrite]) -> int:
    """Characters of text in the step rows of `writes` not saved under pending/ yet (what a spill would write; a
    per-token list counts its texts and about 10 characters a number, as JSON writes it)."""
    return sum(
        len(value) if isinstance(value, str) else sum(len(item) if isinstance(item, str) else 10 for item in value)
        for write in writes
        if write.spilled is None and write.kind == "step"
        for records in write.tables.values()
        for record in records
        for value in record.values()
        if isinstance(value, (str, list))
    )


# ---------------------------------------------------------------------------------------------------------------
# pending/ as data


def _write_atomically(final: Path, text: str, sync: bool = True) -> None:
    """`text` as the file `final`, which is whole whenever it exists (written under a temporary name, renamed);
    synced to the disk before the rename unless `sync` is False."""
    tmp = final.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, final)
