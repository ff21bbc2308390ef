"""A training session's hold on its run folder (runs/<run_id>/), from claiming it to letting it go:

    cfg = resume_config(runs_dir, run_id, **given)   # a resume: the run's stored config, with what may change
    with RunSession(runs_dir, run_id, cfg, accelerator, resume) as session:  # takes the run's lock
        state = session.checkpoints.restore(data_fingerprint, ...)  # a resume: the newest valid checkpoint
                                                                    # (checkpoints.py), checked against the run
        session.open_store(state)                     # the database and config.json; a new run's folder appears
        session.catch_stop_signals()                  # Ctrl-C / SIGTERM: stop at the next step boundary
        ... session.write_step(...), session.record_step_times(...), session.save_checkpoint(...),
            session.should_stop() ...
        session.finish(status, ...)                   # the last rows and the run's final status
    # close(): the lock, a new run's staging folder if the run never appeared, the writer's thread, the signals

The main process does every file operation; the others take part in the collectives only (checkpoints, the resume
decision, the stop vote). Rows are written on one thread of the main process's own, so the next step trains while a
step's rows are stored; only the store's writer (`qae_app.store.writer.RunWriter`) writes the database.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from qae_app.analysis.settings import STORED_BESIDE_OPTIONS, settings_problem
from qae_app.config import FIELDS, RESUMABLE, TrainConfig, coerce_option, given_options, option_flag
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.faults import fault_point
from qae_app.core.formatting import clipped
from qae_app.core.host_faults import leave_the_terminal
from qae_app.rewards.specs import check_named_again
from qae_app.store.reader import check_run_file, logged_steps, read_run, results_only_kind
from qae_app.store.run_file import migrate_hint
from qae_app.store.run_folder import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    DB_FILE,
    NotARegularFile,
    RunLock,
    check_checkpoint_entries,
    check_own_folder,
    check_regular_file,
    config_restore_hint,
    eval_run_error,
    latest_checkpoint,
    read_run_config,
    recent_runs_text,
    replace_run_file,
    run_dir,
    trainer_alive,
)
from qae_app.store.writer import RunWriter
from qae_app.train.checkpoints import RunCheckpoints
from qae_app.train.trackers import TENSORBOARD_DIR, Trackers, start_trackers
from qae_app.train.trainer_state import TrainerState

CREATING_PREFIX = ".creating-"  # a run folder being created: hidden from readers until it is renamed into place
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops a run after its step, with a checkpoint


# ---------------------------------------------------------------------------------------------------------------
# the config of a run being resumed


def stored_config(folder: Path) -> TrainConfig:
    """The config a run was started with (its config.json), checked as a TOML file is: a file edited by hand or
    damaged is named with the bad value and what to do, not met by a traceback; a setting this version has no option
    for (a pre-release's) names `qae migrate`."""
    path = Path(folder) / CONFIG_FILE
    source = f"config.json {path}"
    values = {}
    stored = read_run_config(folder)  # (its errors say what to do already)
    unknown = sorted(set(stored) - set(FIELDS) - STORED_BESIDE_OPTIONS)
    if unknown:
        raise QAEUserError(
            f"{source} holds {', '.join(repr(clipped(key)) for key in unknown[:5])}, no setting of a "
            "qae run of this version. Nothing was written. If an older qae wrote the run: "
            f"{migrate_hint(Path(folder))} Otherwise the file is not a qae run's settings: "
            f"{config_restore_hint(folder)}"
        )
    problem = settings_problem({key: stored[key] for key in STORED_BESIDE_OPTIONS & set(stored)})
    if problem:  # (the options are checked below, as a TOML file's are)
        raise QAEUserError(f"{source}: {problem}. {config_restore_hint(folder)}")
    try:
        for key, value in stored.items():
            if key in STORED_BESIDE_OPTIONS:  # (checked above)
                continue
            if value is None and "None" not in str(FIELDS[key].type):
                raise QAEUserError(
                    f"{source}: '{key}' = null, expected {str(FIELDS[key].type)}. {FIELDS[key].metadata['help']}"
                )
            values[key] = coerce_option(key, value, source)
    except QAEUserError as err:
        raise QAEUserError(f"{err} {config_restore_hint(folder)}") from None
    try:
        return TrainConfig(**values).validate()
    except QAEUserError as err:
        raise QAEUserError(f"{source} holds a bad value: {err} {config_restore_hint(folder)}") from None


def resume_config(runs_dir: Path, run: str, toml_path: Path | None = None, **cli_options: Any) -> TrainConfig:
    """The stored config of `run`, with the resumable options the user gave now; any other option the user gave
    must equal the stored value (a resumed run keeps its config)."""
    folder = run_dir(runs_dir, run)
    given = given_options(toml_path, **cli_options)  # the TOML file's, then the command line's
    given_name = given.get("run_name")
    if given_name is not None and given_name != run:
        raise QAEUserError(
            f"run-name: '{given_name}' is not the run --resume continues ('{run}'). Drop --run-name "
            "(and run_name from the --config file) to resume it, or drop --resume to start a new run "
            "of that name."
        )
    if kind := results_only_kind(folder):
        raise eval_run_error(
            "resume", folder, "There is nothing to resume; start a training run with another --run-name.", kind
        )
    check_run_to_resume(runs_dir, run, folder)
    stored = stored_config(folder)
    check_named_again(stored.reward, given.get("reward"), run, stored.reward_weights)
    changes = {}
    for name, value in given.items():
        if name == "run_name" or value == getattr(stored, name):  # (a copied run's stored name is not its own)
            continue
        if name not in RESUMABLE:
            raise QAEUserError(
                f"resume: --{option_flag(name)} {value} conflicts with run '{run}', which was started with "
                f"{getattr(stored, name)}. A resumed run keeps its config; start a new run to change it (resume "
                f"may change: {', '.join(option_flag(n) for n in RESUMABLE)})."
            )
        changes[name] = value
    return dataclasses.replace(stored, run_name=run, **changes).validate()


def check_run_to_resume(runs_dir: Path, run: str, folder: Path) -> None:
    """A resume continues a run, so the folder must hold a run's database (a qae run file, read here, read-only) and
    its config.json (check_holds_a_database)."""
    check_holds_a_database(runs_dir, run, folder, "resume")
    check_run_file(folder / DB_FILE)  # (a file that is not a run's, damaged or another program's, is named there)
    if not (folder / CONFIG_FILE).exists():
        raise QAEUserError(
            f"resume: run '{run}' in {runs_dir} has no {CONFIG_FILE}, the settings it was started "
            f"with. Nothing was written. {config_restore_hint(folder)}"
        )


def check_holds_a_database(runs_dir: Path, run: str, folder: Path, option: str) -> None:
    """A command that writes into a run (`option`: a resume, `qae migrate`) needs one: a folder without a run's
    database as a file of its own, a folder of someone's own with a config.json of its own too, is refused by name
    before anything is written into it (a linked run folder leads outside the runs dir)."""
    try:
        has_database = folder.is_dir() and check_regular_file(folder / DB_FILE, writing=True)
    except NotARegularFile as err:
        raise QAEUserError(f"{option}: {err}") from None
    if not folder.is_dir():
        raise QAEUserError(
            f"{option}: no run '{run}' in {runs_dir} (runs there, last written first: "
            f"{recent_runs_text(runs_dir)}). See `qae runs`."
        )
    if not has_database:
        raise QAEUserError(_no_database(runs_dir, run, folder, option))


def _no_database(runs_dir: Path, run: str, folder: Path, option: str) -> str:
    """Why a folder without a database is not written into: a run's (its config.json a run's settings) lost it; any
    other folder is no run, and what its config.json holds that no run's does is named."""
    try:
        unknown = sorted(set(read_run_config(folder)) - set(FIELDS) - STORED_BESIDE_OPTIONS)
    except QAEUserError:  # (missing, damaged, planted: no run's settings either way)
        unknown = None
    if unknown == []:
        newest = latest_checkpoint(folder)
        lost = f", and with it the rows of the steps up to its checkpoint {newest.name}" if newest else ""
        return (
            f"{option}: run '{run}' in {runs_dir} has no {DB_FILE}: it was deleted or moved aside{lost}. Nothing "
            f"was written. Put the file back (from a backup), or start a new run with another --run-name."
        )
    held = ", ".join(sorted(path.name for path in folder.iterdir())[:6]) or "nothing"
    linked = f" (a link to {os.path.realpath(folder)})" if folder.is_symlink() else ""
    keys = (
        (f"; its {CONFIG_FILE} holds {', '.join(repr(clipped(key)) for key in unknown[:5])}, no setting of a qae run")
        if unknown
        else ""
    )
    return (
        f"{option}: '{run}' in {runs_dir}{linked} is not a run: it holds no {DB_FILE} (it holds {held}{keys}). "
        "Nothing was written." + (" Start a new run with another --run-name." if option == "resume" else "")
    )


# ---------------------------------------------------------------------------------------------------------------


class RunSession:
    """One session of a run on disk: `RunSession(...)` takes the run's lock before anything slow, so nothing runs for
    a run that another process is training; a new run is built in a hidden staging folder that becomes runs/<id> by
    one rename once its database holds the run's row (open_store), so every command sees either no run or one with
    its row. `close()` (or leaving `with`) lets go of everything; it may be called more than once."""

    def __init__(
        self,
        runs_dir: Path,
        run_id: str,
        cfg: TrainConfig,
        accelerator,
        resume: bool = False,
        say=None,
        started: float | None = None,
        distributed=None,
    ):
        self.runs_dir = Path(runs_dir)
        self.run_id = run_id
        self.run_dir = run_dir(self.runs_dir, run_id)
        self.cfg = cfg
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.resuming = resume
        self.distributed = distributed  # sharding.DistributedSetup of this launch, stored in the run's config
        self.reward_files: dict = {}  # the user reward functions' files and sha256s (reward_record.py), stored too
        self.started = time.perf_counter() if started is None else started  # the session's wall_s counts from here
        self._say = say or (lambda message: None)
        self.writer: RunWriter | None = None  # main process only, from open_store on
        self.trackers: Trackers | None = None  # --report-to: main process only, from open_store on
        self._lock: RunLock | None = None  # main process only
        self._staging: Path | None = None  # a new run's folder until open_store renames it into place
        self._write_thread: ThreadPoolExecutor | None = None  # main process: writes the store while steps train
        self._write_job: Future | None = None
        self._store_s: dict[int, float] = {}  # step -> CPU seconds of its write job, once done (see drain_writes)
        # (step, seconds): the newest step's times known only after its rows were queued (record_step_times)
        self._late_times: tuple[int, dict[str, float]] | None = None
        self._previous_handlers: dict = {}
        self.finishing = False  # set by the caller once it writes the final status: late signals are ignored
        self._stop_requested = self._waiting_for_store = False
        self.checkpoints = RunCheckpoints(self.run_dir, run_id, cfg, accelerator, say)
        try:
            self._claim_run_folder()
        except BaseException:  # refused after taking the lock (a linked folder): let go of it
            self.close()
            raise

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the run folder: the writer's thread (after its job), the lock, a new run's staging folder if the
        run never appeared (nothing is left behind), and the signal handlers catch_stop_signals replaced."""
        try:
            if self._write_thread is not None:
                self._write_thread.shutdown(wait=True)
            if self.trackers is not None:
                self.trackers.finish()
        finally:
            if self._lock is not None:
                self._lock.release()
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers = {}

    # -------------------------------------------------------------------------------------------------------------
    # claiming the folder, resume checks, the database

    def _claim_run_folder(self) -> None:
        """Take the run's lock; a new run's is on its staging folder, created here."""
        if not self.is_main:
            return
        if self.resuming:
            self._lock = RunLock(self.run_dir).acquire("resume")
            for folder in (CHECKPOINTS_DIR, TENSORBOARD_DIR):  # (saved through a link, they would land outside)
                check_own_folder(self.run_dir / folder)
            check_checkpoint_entries(self.run_dir)  # (nor a save replace a linked step-N: it removes the old first)
            return
        if kind := results_only_kind(self.run_dir):
            raise eval_run_error("run-name", self.run_dir, "Pick another --run-name for the training run.", kind)
        if (self.run_dir / DB_FILE).exists() or (self.run_dir / CONFIG_FILE).exists():
            raise QAEUserError(
                f"run-name: a run '{self.run_id}' already exists in {self.runs_dir}. Continue it "
                f"with --resume {self.run_id}, or pick another --run-name."
            )
        try:
            self.runs_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.runs_dir.glob(f"{CREATING_PREFIX}{self.run_id}-*"):  # left by a kill mid-creation
                if not trainer_alive(stale):
                    shutil.rmtree(stale, ignore_errors=True)
            self._staging = self.runs_dir / f"{CREATING_PREFIX}{self.run_id}-{os.getpid()}"
            self._staging.mkdir()
        except OSError as err:
            raise QAEUserError(
                f"runs-dir: cannot create a run in {self.runs_dir} ({err.strerror}). Pass a writable --runs-dir."
            ) from err
        self._lock = RunLock(self._staging).acquire("run-name")

    def _say_missing_steps(self, checkpoint_step: int) -> None:
        """A resume replays the steps after its checkpoint; those up to it must be stored already. Say which are not
        (a pending write moved aside or lost before it reached the file): their rows are not coming back."""
        queued = {write.step for write in self.writer.pending if write.kind == "step"}
        missing = sorted(set(range(1, checkpoint_step + 1)) - logged_steps(self.run_dir) - queued)
        if missing:
            spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _spans(missing))
            self._say(
                f"[yellow]warning:[/] run '{self.run_id}' resumes after its checkpoint at step "
                f"{checkpoint_step}, but the rows of step(s) {spans} are in neither {DB_FILE} nor pending/ (a "
                "saved write moved aside or lost before it was written). The checkpoint's weights include "
                "those steps; their rows stay missing from `qae show` and the dashboard."
            )

    def open_store(self, state: TrainerState) -> dict:
        """The run's database and config.json (main process), and the writer's thread. A new run's staging folder is
        renamed into place last. Returns the stored row of a resumed run that has one (its earlier sessions'
        wall_s and setup_s), else {}."""
        if not self.is_main:
            return {}
        cfg = self.cfg
        config = cfg.to_dict()
        if self.distributed is not None:  # how this session ran (a resume records its own launch)
            config["distributed"] = self.distributed.to_dict()
        if self.reward_files:
            config["reward_files"] = self.reward_files
        k = ESTIMATORS[cfg.estimator].k_in_use(state.k)  # (None before --k auto chooses one, and for a mean baseline)
        if self.resuming:
            return self._reopen_store(state, config, k)
        staging = self._staging
        writer = RunWriter(staging / DB_FILE, self.run_id)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        writer.create_run(self.run_id, config, cfg.estimator, k, cfg.model, cfg.data, cfg.seed)
        try:
            os.rename(staging, self.run_dir)
        except OSError as err:  # another `qae train --run-name` of the same name got there first
            raise QAEUserError(
                f"run-name: a run '{self.run_id}' already exists in {self.runs_dir} ({err.strerror})."
                f" Continue it with --resume {self.run_id}, or pick another --run-name."
            ) from err
        self._staging = None
        # the same writer, not a new one: a new writer opens the file, which a reader may hold from the rename on
        writer.moved_to(self.run_dir / DB_FILE)
        self.writer = writer
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qae-store")
        self.trackers = start_trackers(cfg.report_to, self.run_id, self.run_dir, config)
        return {}

    def _reopen_store(self, state: TrainerState, config: dict, k: float | None) -> dict:
        """A resumed run's database, its rows after the checkpoint dropped (this run replays them), and its
        config.json; a run row lost before the first checkpoint is created again. Returns the stored row, or {}."""
        cfg = self.cfg
        db = self.run_dir / DB_FILE
        if not db.exists() and state.step > 0:
            raise QAEUserError(
                f"resume: run '{self.run_id}' has a checkpoint at step {state.step} but no database: the "
                f"rows of steps 1-{state.step} are lost. Restore {DB_FILE} from a backup, or start a new "
                "run."
            )
        # (opening refuses a file of an older format, naming `qae migrate`; it waits up to 60 s for a reader)
        self.writer = RunWriter(
            db,
            self.run_id,
            resume_from=state.step,
            on_wait=lambda holder: self._say(
                f"[yellow]waiting for {db}: {holder} (a reader left open?). Close it to go on.[/]"
            ),
        )
        earlier = _stored_run(db)
        if earlier is None and state.step > 0:
            raise QAEUserError(
                f"resume: run '{self.run_id}' has a checkpoint at step {state.step} but no run row in {db}: "
                f"the rows of steps 1-{state.step} are lost. Restore {DB_FILE} from a backup, or start a "
                "new run."
            )
        if earlier is None:  # killed while the run was being created (before any checkpoint): create it again
            self.writer.create_run(self.run_id, config, cfg.estimator, k, cfg.model, cfg.data, cfg.seed)
        # rows written after the checkpoint are replayed by this run: drop them so each step is stored once
        self.writer.truncate_after(state.step)
        self._say_missing_steps(state.step)
        replace_run_file(self.run_dir / CONFIG_FILE, json.dumps(config, indent=2))  # (never through a link)
        self.writer.update_run(status="running", error=None, config=config)
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qae-store")
        self.trackers = start_trackers(cfg.report_to, self.run_id, self.run_dir, config)
        return earlier or {}

    # -------------------------------------------------------------------------------------------------------------
    # writing: only here, only on the main process, on one writer thread so the next step trains meanwhile

    def record_step_times(self, step: int, **seconds: float) -> None:
        """The times of `step` that are known only after its rows were queued (write_s, checkpoint_s, step_s): they
        complete its row with the next step's write, with store_s (the writer thread's CPU time for the step, known
        once that job is done), or at finish. Kept until the next step's are recorded."""
        self._late_times = (step, seconds)

    def write_step(self, step: int, tables: dict[str, list[dict]], chosen_k: float | None = None) -> float:
        """Hand one step's rows (table name -> rows) to the writer thread, after the previous step's write is done,
        so at most one step is in flight; `chosen_k` goes into the run's row, and the times recorded for an earlier
        step (record_step_times) complete its row. Returns the seconds this thread spent."""
        if self.writer is None:
            return 0.0
        t0 = time.perf_counter()
        late = self._late_times  # (step, seconds) of an earlier step, or None

        def write(writer: RunWriter) -> tuple[int, float]:
            cpu_start = time.thread_time()
            if late is not None:
                writer.update_step(late[0], **late[1])
            if chosen_k is not None:
                writer.update_run(k=chosen_k)
            writer.add_step(step, **tables)
            fault_point("after_step_rows", step)  # crash tests: rows queued, not yet written
            self._flush()
            return step, time.thread_time() - cpu_start

        self.drain_writes()
        if late is not None:  # the earlier step's job is done: its store_s is known
            late[1]["store_s"] = self._store_s.pop(late[0], None)
        if self.trackers is not None:  # --report-to: what the rows hold, in step order
            if late is not None:
                self.trackers.log_times(*late)
            self.trackers.log_step(step, tables)
        self._write_job = self._write_thread.submit(write, self.writer)
        return time.perf_counter() - t0

    def drain_writes(self) -> float:
        """Wait for the writer thread's job (re-raising its error) and keep its CPU time for the step's store_s;
        returns the seconds waited."""
        t0 = time.perf_counter()
        job, self._write_job = self._write_job, None
        if job is not None:
            step, store_s = job.result()
            self._store_s[step] = store_s
        return time.perf_counter() - t0

    def finish(self, status: str, error: str | None, *, setup_s: float, wall_s_before: float = 0.0) -> None:
        """The last writes: the times recorded for the last step (record_step_times), the final status and the run's
        time (setup_s; wall_s: the earlier sessions' and this one's); waits for a reader that still holds the file
        (Ctrl-C leaves the rows safe under pending/)."""
        if self.writer is None:
            return
        try:
            self.drain_writes()
        finally:
            self._write_thread.shutdown(wait=True)
            if self._late_times is not None:
                step, values = self._late_times  # (its store_s is known if the job was drained, by now or earlier)
                values = {**values, "store_s": self._store_s.pop(step, values.get("store_s"))}
                self.writer.update_step(step, **values)
                if self.trackers is not None:
                    self.trackers.log_times(step, values)
            wall_s = wall_s_before + time.perf_counter() - self.started
            # a failed run's status goes ahead of rows still queued: if the failure was writing them (a full disk),
            # the small update of the run's row may still fit, and `qae runs` says why it failed
            self.writer.update_run(status=status, error=error, wall_s=wall_s, setup_s=setup_s, first=status == "failed")
            self._wait_for_store()

    def _flush(self) -> None:
        """Write what is queued when a database write is due (writer.WRITE_SHARE; until then the rows wait under
        pending/); if a reader holds the file, training goes on and the rows wait there too, and the log says so once
        per busy spell."""
        was_busy = self.writer.busy_since is not None
        if self.writer.flush_when_due():
            if was_busy:
                self._say("the database is free again: the waiting rows are written")
        elif not was_busy:
            self._say(
                f"[yellow]note:[/] {self.writer.path} is {self.writer.holder}; training goes on and the rows "
                f"wait, safe on disk, in {self.writer.pending_dir} until it is free. Read live runs with "
                "`qae show`, `qae rollouts` or the dashboard, which let go of the file at once."
            )

    def _wait_for_store(self) -> None:
        """At the end of the run every row must reach the database: wait for a reader that still holds it."""
        if self.writer is None or self.writer.flush():
            return

        def say(waited: float) -> None:
            self._say(
                f"waiting {waited:.0f} s for {self.writer.path} ({self.writer.holder}) to write the last rows;"
                f" they are safe in {self.writer.pending_dir}. Ctrl-C leaves them there: `qae train --resume "
                f"{self.run_id}` writes them later."
            )

        say(0)
        self._waiting_for_store = True
        try:
            self.writer.wait_until_written(on_wait=say)
        except KeyboardInterrupt:
            self.writer.sync_pending()  # (the run is over: they stay there, maybe across a reboot)
            self._say(
                f"[yellow]stopped waiting:[/] the last rows stay in {self.writer.pending_dir}; "
                f"`qae train --resume {self.run_id}` writes them."
            )
        finally:
            self._waiting_for_store = False

    # -------------------------------------------------------------------------------------------------------------
    # checkpoints: saved and restored by self.checkpoints (checkpoints.py); the session makes the rows durable first

    def save_checkpoint(self, model, optimizer, scheduler, codec, state: TrainerState) -> Path:
        """The steps up to a checkpoint are not trained again on resume: their rows must survive the OS going down
        too, so they are written out (or synced under pending/) before `self.checkpoints.save` writes it."""
        if self.writer is not None:
            self.drain_writes()  # (the writer's thread is idle after this)
            self.writer.sync_pending()
        return self.checkpoints.save(model, optimizer, scheduler, codec, state)

    # -------------------------------------------------------------------------------------------------------------
    # stopping

    def catch_stop_signals(self) -> None:
        """Ctrl-C, SIGTERM or SIGHUP (a closed terminal, a dropped ssh session) asks to stop at the next step boundary
        (should_stop); a second Ctrl-C stops at once (KeyboardInterrupt). close() puts the previous handlers back.
        Only from the main thread (signals reach it)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            if signum == signal.SIGHUP:
                leave_the_terminal()  # (writing to a terminal that hung up fails: the run must still stop well)
            if self._waiting_for_store:
                raise KeyboardInterrupt  # give up waiting for a reader: the rows stay safe under pending/
            if self.finishing:
                return  # the run is writing its final status: nothing may interrupt that
            if self._stop_requested:
                # only a person's second Ctrl-C stops at once; a repeated SIGTERM is the same request again (a
                # supervisor may send it more than once, the kernel's parent-death signal once per dying thread),
                # and aborting would lose the steps since the last checkpoint
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                return
            self._stop_requested = True
            if signum == signal.SIGINT:
                self._say("[yellow]stopping after this step (checkpoint, then exit); Ctrl-C again to stop at once[/]")
            else:  # a repeated SIGTERM is the same request (above): only SIGKILL stops at once, losing the step
                self._say(
                    f"[yellow]{signal.Signals(signum).name}: stopping after this step (checkpoint, then exit); "
                    "sending it again changes nothing, kill -9 stops at once and loses the steps since the "
                    "last checkpoint[/]"
                )

        self._previous_handlers = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}

    def should_stop(self) -> bool:
        """All processes agree to stop at the same step boundary (a signal may reach them at different times)."""
        flag = torch.tensor(float(self._stop_requested), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        return flag.item() > 0


def _stored_run(db: Path) -> dict | None:
    """The run's row in its database, None if it has none."""
    try:
        return read_run(db)
    except QAEUserError:
        return None


def _spans(steps: list[int]) -> list[tuple[int, int]]:
    """[1, 2, 3, 7, 9, 10] -> [(1, 3), (7, 7), (9, 10)]."""
    spans: list[tuple[int, int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], step)
        else:
            spans.append((step, step))
    return spans
