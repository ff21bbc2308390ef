"""The run store: one DuckDB file per run, `runs/<run_id>/qae.duckdb`.

Only this module touches the database. The trainer is the only writer: `RunWriter` saves each step's rows under
`pending/` and every few seconds opens the file, writes the steps since the last write in one transaction (so readers
see whole steps only, and a kill mid-write loses nothing saved) and closes it again, so readers can get in between. A
reader holding the file makes the writer retry; if the file stays busy the rows stay saved and go out with a later
write, never dropped. Readers (`read_*`, qae_app/store_read.py) open the file read-only, query with bound parameters,
and close at once.

`STEP_METRICS` is the single definition of every per-step metric: the `steps` table columns, the README table and the
dashboard labels all come from it.
"""

from __future__ import annotations

import json
import math
import operator
import os
import pickle
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import duckdb

if TYPE_CHECKING:  # numpy is imported where rows are written: `qae runs` never writes
    import numpy as np

from qae_app.errors import QAEUserError
from qae_app.faults import fault_point
from qae_app.names import DEFAULT_K
from qae_app.rundir import CONFIG_FILE, PENDING_DIR, STORED_STATUSES, list_checkpoints, lost_its_database

# name -> definition. Every name is a column of `steps`; NaN is stored as NULL (e.g. no response had a negative
# advantage, so entropy_neg is undefined). With --dynamic-sampling a step samples more groups than it trains: metrics
# of what was sampled count every group of the step, filtered ones included; metrics of the update count the trained
# groups only (each definition says which). Without dynamic sampling every sampled group is trained.
STEP_METRICS: dict[str, str] = {
    "reward_mean": "mean reward of the responses sampled this step, filtered groups included (after the overlong "
                   "penalty; unverifiable responses count as wrong)",
    "accuracy": "fraction of the responses sampled this step that the verifier found correct, filtered groups "
                "included",
    "heldout_accuracy": "sampled (temperature as training) accuracy on the held-out split; NULL on steps without eval",
    "entropy": "mean per-token entropy (nats) of the policy over the response tokens of the trained groups, before "
               "the update",
    "entropy_pos": "mean token entropy of trained responses with advantage > 0",
    "entropy_neg": "mean token entropy of trained responses with advantage < 0",
    "frac_zero_adv": "fraction of trained responses whose advantage is exactly 0 (gated out: no policy gradient)",
    "frac_zero_adv_informative": "frac_zero_adv over the trained responses of informative groups only (neither all "
                                 "correct nor all wrong): the paper's ~80% (Fig. 5c); NULL when no group is "
                                 "informative",
    "frac_hard": "fraction of the groups sampled this step (filtered included) in the hard regime (baseline = the "
                 "group's lowest reward: only responses above it are pushed up)",
    "frac_easy": "fraction of the groups sampled this step (filtered included) in the easy regime (baseline = the "
                 "group's highest reward: only responses below it are pushed down)",
    "frac_all_correct": "fraction of the groups sampled this step where every response is correct with equal "
                        "rewards (no signal)",
    "frac_all_wrong": "fraction of the groups sampled this step where every response is wrong with equal rewards "
                      "(no signal)",
    "frac_mixed": "fraction of the groups sampled this step whose baseline lies strictly between their lowest and "
                  "highest reward (mean-baseline estimators, linear quantile, QAE on shaped rewards)",
    "frac_unverified": "fraction of the responses sampled this step that the verifier could not score in time "
                       "(counted wrong)",
    "gen_batches": "generation batches of prompts_per_step prompts sampled this step (always 1 without "
                   "--dynamic-sampling)",
    "frac_filtered": "fraction of the groups sampled this step that dynamic sampling left out of the update (no "
                     "signal, or informative beyond the first prompts_per_step); 0 without it",
    "dH": "with --log-entropy-delta: how the step's update changed the mean token entropy of the step's own "
          "trained responses (after minus before, nats); NULL without it",
    "dH_hard": f"dH over the responses of hard groups (success rate <= 1 - K; K = {DEFAULT_K} for mean-baseline "
               "runs): the paper's Prop. 4.2 predicts < 0 under QAE",
    "dH_easy": "dH over the responses of easy groups (success rate > 1 - K, not all correct): Prop. 4.2 predicts > 0 "
               "under QAE",
    "cov_logp_adv": "covariance over trained response tokens of token log-prob and advantage; entropy falls when it "
                    "is > 0",
    "adv_abs_mean": "mean |advantage| over trained responses",
    "k": "the QAE quantile level K used this step (NULL for mean-baseline estimators)",
    "loss": "policy loss (plus KL term) averaged over the step's optimizer updates",
    "pg_loss": "policy-gradient part of the loss",
    "kl": "mean k3 estimate of KL(policy || reference) over response tokens; 0 when kl_beta = 0",
    "grad_norm": "gradient norm before clipping, averaged over the step's optimizer updates",
    "clip_frac": "fraction of tokens whose ratio was clipped (low + high)",
    "clip_frac_low": "fraction of tokens with negative advantage and ratio < 1 - clip_low (clipped)",
    "clip_frac_high": "fraction of tokens with positive advantage and ratio > 1 + clip_high (clipped)",
    "lr": "learning rate used for this step's updates",
    "response_len": "mean length in tokens of the responses sampled this step, filtered groups included",
    "truncated_frac": "fraction of the responses sampled this step that hit max_new_tokens before eos",
    "n_updates": "optimizer updates this step (num_mini_batches x ppo_epochs, including mini-batches whose "
                 "advantages are all 0: AdamW still moves the weights on them, as a dense update would; fewer when "
                 "dynamic sampling's cap left fewer trained responses than mini-batches, 0 when it left none)",
    "rollout_s": "seconds sampling responses (every generation batch)",
    "reward_s": "seconds scoring responses",
    "update_s": "seconds in forward/backward/optimizer (including the log-prob pass)",
    "eval_s": "seconds of the held-out evaluation after this step (0 without one)",
    "write_s": "seconds the loop spent handing this step's rows to the store (the store writes on its own thread "
               "while the next step trains) and waiting for it",
    "checkpoint_s": "seconds saving the checkpoint after this step (0 without one)",
    "store_s": "CPU seconds the store's thread spent on this step's rows while the next step trained: saving them "
               "under pending/, plus the database write (of the steps since the last one) when one was due; not part "
               "of step_s",
    "step_s": "wall seconds of the whole step: the above plus advantages and row building",
}
TIMING_METRICS = tuple(name for name in STEP_METRICS if name.endswith("_s"))  # seconds: differ run to run

# The tables: name -> {column: SQL type}, `run_id` first in every table. The DDL, the migration of older files and the
# check of the rows the trainer produces (`RunWriter.add_step`) all come from here.
TABLES: dict[str, dict[str, str]] = {
    "runs": {
        "run_id": "VARCHAR PRIMARY KEY", "name": "VARCHAR", "created_at": "TIMESTAMP", "updated_at": "TIMESTAMP",
        "status": "VARCHAR", "config": "VARCHAR", "estimator": "VARCHAR", "k": "DOUBLE", "model": "VARCHAR",
        "task": "VARCHAR", "seed": "BIGINT", "error": "VARCHAR",
        "setup_s": "DOUBLE",  # seconds from the trainer's start to its first step (loading, step-0 evaluation)
        "wall_s": "DOUBLE",  # seconds the run has trained, summed over its sessions (resumes)
    },
    # logged_at: when the step's rows were handed to RunWriter (UTC), stamped by it: the dashboard's wall-time axis,
    # heartbeat, rate and ETA
    "steps": {"run_id": "VARCHAR", "step": "INTEGER", "logged_at": "TIMESTAMP",
              **{name: "DOUBLE" for name in STEP_METRICS}},
    "groups": {
        "run_id": "VARCHAR", "step": "INTEGER", "group_idx": "INTEGER", "prompt_id": "VARCHAR", "prompt": "VARCHAR",
        "answer": "VARCHAR", "n_correct": "INTEGER", "group_size": "INTEGER", "baseline": "DOUBLE",
        "regime": "VARCHAR",
        "filtered": "BOOLEAN",  # left out of the update by dynamic sampling
    },
    "rollouts": {
        "run_id": "VARCHAR", "step": "INTEGER", "group_idx": "INTEGER", "sample_idx": "INTEGER",
        "prompt_id": "VARCHAR", "response": "VARCHAR", "reward": "DOUBLE", "verified": "BOOLEAN",
        "advantage": "DOUBLE", "gated": "BOOLEAN", "regime": "VARCHAR", "n_tokens": "INTEGER",
        "truncated": "BOOLEAN", "entropy": "DOUBLE", "logprob": "DOUBLE",
        "correct": "BOOLEAN",  # the verifier's verdict (reward is shaped); NULL in rows from before the column
        # its group was left out of the update by dynamic sampling (entropy, logprob: NULL unless the engine measured
        # them while sampling, as the hf engine does; the trainer's own pass covers the trained responses only)
        "filtered": "BOOLEAN",
    },
    "evals": {
        "run_id": "VARCHAR", "step": "INTEGER", "benchmark": "VARCHAR", "subset": "VARCHAR", "metric": "VARCHAR",
        "k": "INTEGER", "value": "DOUBLE", "n_problems": "INTEGER", "source": "VARCHAR",
    },
    "eval_samples": {
        "run_id": "VARCHAR", "step": "INTEGER", "benchmark": "VARCHAR", "problem_id": "VARCHAR",
        "sample_idx": "INTEGER", "response": "VARCHAR", "extracted": "VARCHAR", "correct": "BOOLEAN",
        "verified": "BOOLEAN", "n_tokens": "INTEGER", "source": "VARCHAR",
    },
    "warnings": {"run_id": "VARCHAR", "step": "INTEGER", "kind": "VARCHAR", "message": "VARCHAR"},
}
# What a column added after its table's first version holds in rows written before it existed.
LEGACY_DEFAULTS = {("evals", "source"): "'train'", ("eval_samples", "source"): "'train'",
                   ("groups", "filtered"): "FALSE", ("rollouts", "filtered"): "FALSE"}
STEP_TABLES = ("steps", "groups", "rollouts", "evals", "eval_samples", "warnings")  # rows keyed by step
EVAL_TABLES = ("evals", "eval_samples")  # rows keyed by step, benchmark and source


# When queued steps go to the database. Attaching the file and detaching it (a checkpoint of DuckDB's log) and each
# INSERT cost about as much for one step as for twenty, so steps are written together: after a write that took c
# seconds of CPU, the next is due c / WRITE_SHARE later (at most MAX_ROW_DELAY_S, so live views stay live). At the
# defaults a write of ~20 steps takes ~50 ms, so one is due every ~5 s. Until then each step's rows are saved under
# pending/ (about a millisecond), where a kill -9 cannot lose them. The file is attached only while a write runs,
# so readers get in between.
WRITE_SHARE = 0.01
MAX_ROW_DELAY_S = 5.0

WRITER_COLUMNS = ("run_id", "step", "logged_at")  # filled in by RunWriter, not by the rows it is handed


def row_columns(table: str) -> tuple[str, ...]:
    """The columns a row of a step table carries when handed to the writer (the writer adds run_id, step and
    logged_at)."""
    return tuple(name for name in TABLES[table] if name not in WRITER_COLUMNS)


def _schema_statements() -> list[str]:
    statements = []
    for table, columns in TABLES.items():
        statements.append(f"CREATE TABLE IF NOT EXISTS {table} ("
                          + ", ".join(f"{name} {sql_type}" for name, sql_type in columns.items()) + ")")
        # files written by an older version lack the newer columns: add them (a no-op on current files)
        for name, sql_type in columns.items():
            if "PRIMARY KEY" in sql_type:
                continue
            default = LEGACY_DEFAULTS.get((table, name))
            statements.append(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {sql_type}"
                              + (f" DEFAULT {default}" if default else ""))
    return statements


_LOCK_ERROR = re.compile(r"lock|being used by another process|Conflicting lock", re.IGNORECASE)


WAIT_NOTICE_S = 1.0  # a wait for the run file longer than this is said (RunWriter's on_wait)


def holder(err: Exception) -> str:
    """'held by PID 123' from DuckDB's lock error, when it says."""
    match = re.search(r"PID (\d+)", str(err))
    return f"held by process {match.group(1)}" if match else "held by another process"


def is_lock_error(err: Exception) -> bool:
    return isinstance(err, (duckdb.IOException, duckdb.ConnectionException)) and bool(_LOCK_ERROR.search(str(err)))


def attach(cursor: duckdb.DuckDBPyConnection, path: Path, alias: str, timeout_s: float,
            read_only: bool = True, on_wait=None) -> None:
    """ATTACH the file (read-only unless told), retrying while another process holds its lock; `on_wait(holder)` is
    called once if that lasts more than WAIT_NOTICE_S (a long wait says why)."""
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


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


_LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _storable(value):
    """Strings with lone surrogates (a JSON "\\ud800" escape in a data file, a tokenizer's broken decode) cannot be
    encoded as UTF-8, so DuckDB refuses them: each becomes U+FFFD. Anything else is returned as is."""
    if isinstance(value, str) and _LONE_SURROGATE_RE.search(value):
        return _LONE_SURROGATE_RE.sub("\ufffd", value)
    return value


def _column(values: list) -> "np.ndarray":
    """One column of rows as DuckDB's NumPy scan takes it, typed as pandas' `from_records` would type it (so the file
    holds what it held when the rows went in as a frame): numbers as float64 (None and NaN become NULL, ints only when
    none is missing), bools as bool when none is missing, anything else (text with `_storable` text, timestamps) as
    Python objects. The values are looked at by type, not one by one: a write holds thousands of rows."""
    import numpy as np  # (here: `qae runs` never writes, and starts faster without it)

    kinds = set(map(type, values))
    missing = type(None) in kinds
    kinds.discard(type(None))
    if str in kinds:
        text = "".join(filter(None, values)) if kinds == {str} else "".join(v for v in values if isinstance(v, str))
        if _LONE_SURROGATE_RE.search(text):
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


def _storable_columns(records: list[dict]) -> dict[str, "np.ndarray"]:
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


class RunFileError(QAEUserError):
    """A run's database file cannot be opened or read: damaged, truncated or not a DuckDB file."""


def unreadable_run_error(path: Path, err: Exception | str) -> RunFileError:
    """The error for a run file DuckDB cannot open or read (damaged, truncated, not DuckDB, missing): names the file,
    the reason, and what in the run folder is still usable."""
    path = Path(path)
    if not path.exists():
        err = "the file is missing (deleted or moved aside)"
    reason = str(err).strip().splitlines()[0].rstrip(".!") if str(err).strip() else type(err).__name__
    checkpoints = list_checkpoints(path.parent)
    if checkpoints:
        kept = (f"The model is safe in its checkpoints ({', '.join(p.name for p in checkpoints)}): evaluate the newest "
                f"with `qae eval --model {checkpoints[-1] / 'model'}`.")
    else:
        kept = "The run has no checkpoint to recover a model from."
    config = f" Its settings are in {CONFIG_FILE}." if (path.parent / CONFIG_FILE).exists() else ""
    silence = ("Move the file aside to silence this." if path.exists() else
               "Move the run's folder aside to silence this.")
    return RunFileError(f"run: cannot read {path}: {reason}. The steps logged in this file are lost unless you restore "
                        f"it from a backup. {kept}{config} {silence}")


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
    return (type(err) is duckdb.Error or _missing_table(err) is not None
            or isinstance(err, (duckdb.IOException, duckdb.SerializationException, duckdb.InternalException,
                                duckdb.FatalException)))


def _missing_table(err: BaseException) -> str | None:
    """The qae table a query found missing from the file, if that is what `err` says."""
    match = re.search(r"Table with name (\w+) does not exist", str(err))
    return match.group(1) if isinstance(err, duckdb.CatalogException) and match and match.group(1) in TABLES \
        else None


def damage_reason(err: BaseException) -> Exception | str:
    """What unreadable_run_error says of `err`."""
    table = _missing_table(err)
    return (f"it is not a qae run database (it has no {table} table): another program's DuckDB file, or one emptied"
            if table else err)


# ---------------------------------------------------------------------------------------------------------------
# writer


@dataclass
class PendingWrite:
    """One write waiting for the file: a step's rows, a change to the run's row, or a truncation (on resume)."""

    kind: str  # "step", "step_update", "run" or "truncate"
    step: int | None = None
    tables: dict[str, list[dict]] | None = None  # kind "step": table name -> rows (without run_id and step)
    fields: dict | None = None  # kinds "run", "step_update": columns -> values
    spilled: Path | None = None  # its file under pending/ once the database was found busy
    logged_at: datetime | None = None  # kind "step": when it was queued (the steps row's logged_at)


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

    def __init__(self, path: Path, run_id: str, lock_timeout_s: float = 0.2, open_timeout_s: float = 60.0,
                 clock=time.monotonic, on_wait=None):
        """`on_wait(holder)`: called once if opening the file waits on another process for over WAIT_NOTICE_S."""
        self.path = Path(path)
        self.clock = clock  # when writes are due (tests move it by hand)
        self.next_flush_at = -math.inf  # the first write is due at once
        self._instance: duckdb.DuckDBPyConnection | None = None  # see _open
        self.run_id = run_id
        self.lock_timeout_s = lock_timeout_s  # how long a flush waits for the file before spilling
        self.pending_dir = self.path.parent / PENDING_DIR
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
                raise QAEUserError(f"store: {self.path} is held by another process for more than "
                                   f"{open_timeout_s:.0f} s ({holder(err)}). Close that connection and retry; "
                                   "read live runs with `qae show` or the dashboard, which let go at once.") from err
            if is_damage_error(err):
                raise unreadable_run_error(self.path, damage_reason(err)) from err
            raise
        self.pending: list[PendingWrite] = self._load_spilled()  # left by a trainer that never found the file free

    @contextmanager
    def _open(self, timeout_s: float | None = None, on_wait=None) -> Iterator[duckdb.DuckDBPyConnection]:
        """The run file, attached for writing to this writer's own in-memory database (made once: making a DuckDB
        database costs ~30 ms, attaching a file ~2 ms) and detached on exit, which lets go of its lock."""
        if self._instance is None:
            self._instance = duckdb.connect(":memory:")
        con = self._instance
        try:
            attach(con, self.path, "run", self.lock_timeout_s if timeout_s is None else timeout_s, read_only=False,
                    on_wait=on_wait)
        except duckdb.Error as err:
            if is_damage_error(err) and self.path.exists() and self.path.stat().st_size > 0:
                raise unreadable_run_error(self.path, err) from err
            raise
        try:
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
        block_size, blocks = con.execute("SELECT block_size, used_blocks FROM pragma_database_size() "
                                         "WHERE database_name = current_database()").fetchone()
        if self.path.stat().st_size < block_size * blocks:
            raise unreadable_run_error(self.path, f"it is {self.path.stat().st_size:,} bytes, shorter than the "
                                                  f"{block_size * blocks:,} bytes of the blocks its header says "
                                                  "are in use")
        tables = {row[0] for row in con.execute("SELECT table_name FROM duckdb_tables() "
                                                "WHERE database_name = current_database()").fetchall()}
        if not tables & set(TABLES) and (tables or existed):  # another program's file, or one emptied: left alone
            raise unreadable_run_error(self.path, "it is not a qae run database (it has none of qae's tables"
                                                  + (f"; its own: {', '.join(sorted(tables)[:5])})" if tables
                                                     else "): another program's DuckDB file, or one emptied"))
        for statement in _schema_statements():
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

    # run-level rows ------------------------------------------------------------------------------------------
    def create_run(self, name: str, config: dict, estimator: str, k: float | None, model: str, task: str,
                   seed: int) -> None:
        """The run's row, written at once (a new run's database is in a folder no reader can see yet)."""
        with self._open(timeout_s=30) as con:
            con.execute(
                "INSERT INTO runs (run_id, name, created_at, updated_at, status, config, estimator, k, model, task, "
                "seed) VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                [self.run_id, _storable(name), _now(), _now(), json.dumps(config), estimator, k, _storable(model),
                 _storable(task), seed],
            )

    def update_run(self, first: bool = False, **fields) -> bool:
        """Queue a change of run-level fields (status, error, k, config, wall_s, setup_s) and flush; False if it had to
        wait."""
        allowed = {"status", "error", "k", "config", "wall_s", "setup_s"}
        unknown = set(fields) - allowed
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
                raise ValueError(f"{table} rows have columns {sorted(set(records[0]) - set(row_columns(table)))} "
                                 f"that the table lacks (it has {', '.join(row_columns(table))})")
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
        if self.clock() < self.next_flush_at:
            self._spill()
            return True
        return self.flush()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Write every queued write in order: run-row changes and truncations one transaction each, consecutive
        steps and step updates together in one. False if the file stayed busy for `timeout_s` (default:
        lock_timeout_s): then every queued write is safe on disk under pending/ until a later flush."""
        if not self.pending:
            return True
        cpu_start = time.thread_time()
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
                    count = next((i for i, w in enumerate(self.pending) if w.kind not in ("step", "step_update")),
                                 len(self.pending))
                    done = self.pending[:count]
                    self._write_steps(con, done)
                elif write.kind == "run":
                    assignments = ", ".join(f"{name} = ?" for name in write.fields)  # allow-listed names
                    con.execute(f"UPDATE runs SET {assignments} WHERE run_id = ?",
                                [*write.fields.values(), self.run_id])
                    done = [write]
                else:
                    self._in_transaction(con, lambda: [con.execute(f"DELETE FROM {table} WHERE run_id = ? AND "
                                                                   "step > ?", [self.run_id, write.step])
                                                       for table in STEP_TABLES])
                    done = [write]
                del self.pending[: len(done)]
                for written in done:
                    if written.spilled is not None:
                        written.spilled.unlink(missing_ok=True)
        finally:
            con_cm.__exit__(None, None, None)
        self.busy_since = None
        cost = time.thread_time() - cpu_start
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
        """Save every queued write that is not on disk yet: one pickle each, written to a temporary name, synced,
        then renamed, so a file under pending/ is always whole."""
        self.pending_dir.mkdir(exist_ok=True)
        for write in self.pending:
            if write.spilled is not None:
                continue
            self._spilled_count += 1
            final = self.pending_dir / f"{self._spilled_count:08d}-{write.kind}.pkl"
            tmp = final.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                pickle.dump(write, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            write.spilled = final

    def _load_spilled(self) -> list[PendingWrite]:
        writes = []
        found = sorted(self.pending_dir.glob("*.pkl"))
        self._spilled_count = int(found[-1].name.split("-")[0]) if found else 0  # new files are named after these
        for path in found:
            with open(path, "rb") as f:
                write = pickle.load(f)
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
            logged_at[write.step] = getattr(write, "logged_at", None) or _now()  # (None: spilled by an older version)
            for table, records in write.tables.items():
                if table in EVAL_TABLES:
                    for benchmark, source in sorted({(r["benchmark"], r["source"]) for r in records}):
                        rows[table][(write.step, benchmark, source)] = [
                            r for r in records if (r["benchmark"], r["source"]) == (benchmark, source)]
                else:
                    rows[table][(write.step,)] = records

        def body() -> None:
            for table, by_key in rows.items():
                if not by_key:
                    continue
                if table in EVAL_TABLES:
                    for step, benchmark, source in by_key:
                        con.execute(f"DELETE FROM {table} WHERE run_id = ? AND step = ? AND benchmark = ? "
                                    "AND source = ?", [self.run_id, step, benchmark, source])
                else:
                    con.execute(f"DELETE FROM {table} WHERE run_id = ? AND list_contains(?, step)",
                                [self.run_id, [key[0] for key in by_key]])
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
                con.execute(f"UPDATE steps SET {assignments} WHERE run_id = ? AND step = ?",
                            [*update.fields.values(), self.run_id, update.step])
            for write in writes:  # crash tests: a kill here loses nothing (these steps are in pending/ or in flight)
                if write.kind == "step":
                    fault_point("db_commit", write.step)

        self._in_transaction(con, body)
