"""Reading a run's database (qae_app/store/schema.py says what it holds): `qae runs`, `qae show`, `qae rollouts`,
`qae compare`, the dashboard and the trainer's resume all read through here.

A reader opens the file read-only (attached to one in-memory DuckDB database per process, which costs a fraction of a
connection of its own), queries it with bound parameters, and lets go at once, so the trainer's writer
(qae_app/store/writer.py) gets in between. A run is seen from its folder: a copied or renamed folder is that run, and a
run stored as running that no trainer holds reads as `stopped`.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

if TYPE_CHECKING:  # pandas is imported where a frame is made: `qae runs` (run_summaries) never needs it
    import pandas as pd

from qae_app.core.errors import QAEUserError
from qae_app.core.names import GATE_REASONS
from qae_app.store.labels import read_labels
from qae_app.store.run_file import (
    attach,
    damage_reason,
    is_damage_error,
    is_lock_error,
    refuse_crafted_objects,
    refuse_missing_file_of_training_run,
    run_file_database,
    unreadable_run_error,
)
from qae_app.store.run_folder import (
    CONFIG_FILE,
    DB_FILE,
    PENDING_DIR,
    RESULTS_ONLY_KINDS,
    effective_status,
    folders_not_runs,
    list_run_dirs,
    pending_writes,
    recent_runs_text,
    runs_without_database,
    validated_run_dir,
)
from qae_app.store.schema import PENDING_SUFFIX, read_pending_write

UNREADABLE, BUSY = "unreadable", "busy"  # what `read_runs` says of a run whose file it cannot read (never stored):
NOT_A_RUN = "not a run"  # ... and of a folder in the runs dir that holds no run
READ_STATUSES = (UNREADABLE, BUSY, NOT_A_RUN)  # damaged, held by another process for too long, no run; `error` says why


def pandas():
    """The pandas module, imported on first use (it takes longer to import than `qae runs` takes to run)."""
    import pandas

    return pandas


_readers: duckdb.DuckDBPyConnection | None = None  # one in-memory database per process that readers attach files to
_readers_lock = threading.Lock()


def _reader_cursor() -> duckdb.DuckDBPyConnection:
    """A cursor on this process's reader database. Attaching a run file to it costs a fraction of opening a
    connection to the file (7 against 40 ms), which is most of what listing 20 runs costs."""
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = run_file_database()
        return _readers.cursor()


@contextmanager
def open_reader(path: Path, timeout_s: float = 3.0) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only view of one run's file, retried briefly while the trainer writes, let go of on exit: a cursor
    whose default database is the file (queries name its tables plainly)."""
    path = Path(path)
    refuse_missing_file_of_training_run(path)
    if not path.exists():
        raise QAEUserError(f"run: no database at {path}. List runs with `qae runs`.")
    cursor = _reader_cursor()
    alias = f"run_{uuid.uuid4().hex}"
    try:
        attach(cursor, path, alias, timeout_s)
    except duckdb.Error as err:
        cursor.close()
        if is_damage_error(err):
            raise unreadable_run_error(path, err) from err
        raise
    try:
        refuse_crafted_objects(cursor, alias, path)
        cursor.execute(f"USE {alias}")
        yield cursor
    except duckdb.Error as err:  # a damaged block (or a missing table) is found only when a query reads it
        if is_damage_error(err):
            raise unreadable_run_error(path, damage_reason(err)) from err
        raise
    finally:
        cursor.execute("USE memory")
        cursor.execute(f"DETACH {alias}")
        cursor.close()


def query(path: Path, sql: str, params: list | None = None, timeout_s: float = 3.0) -> pd.DataFrame:
    with open_reader(path, timeout_s) as con:
        return con.execute(sql, params or []).df()


def resolve_run(runs_dir: Path, run: str) -> Path:
    """Database path of a run given by id; a clear error listing existing runs otherwise."""
    path = validated_run_dir(runs_dir, run) / DB_FILE
    refuse_missing_file_of_training_run(path)
    if not path.exists():
        raise QAEUserError(
            f"run: no run '{run}' in {runs_dir} (runs there, last written first: "
            f"{recent_runs_text(runs_dir)}). See `qae runs`."
        )
    return path


SQL_RUN_SUMMARY = """
    WITH last AS (SELECT step, reward_mean, accuracy, entropy FROM steps ORDER BY step DESC LIMIT 1)
    SELECT r.*,
           (SELECT count(*) FROM steps) AS steps, last.step AS last_step, last.reward_mean, last.accuracy,
           last.entropy,
           (SELECT heldout_accuracy FROM steps WHERE heldout_accuracy IS NOT NULL ORDER BY step DESC LIMIT 1)
             AS heldout_accuracy
    FROM runs r LEFT JOIN last ON true
"""


def _seen_from_folder(row: dict, path: Path) -> dict:
    """A run is named by its folder (a copied or renamed folder is that run) and shown with its effective status
    (`stopped` when stored as running but no trainer holds it); what the file says stays in stored_*."""
    folder = Path(path).parent
    labels = read_labels(folder)  # (beside the database: `qae tag` and `qae note` write them while the run trains)
    return {
        **row,
        "run_id": folder.name,
        "stored_run_id": row["run_id"],
        "stored_status": row["status"],
        "status": effective_status(row["status"], folder),
        "pending_writes": pending_writes(folder),
        "tags": ", ".join(labels.tags),
        "note": labels.note,
    }


def _as_seen_from_folder(frame: pd.DataFrame, path: Path) -> pd.DataFrame:
    return pandas().DataFrame([_seen_from_folder(row, path) for row in frame.to_dict("records")])


def _run_summary(path: Path) -> list[dict]:
    with open_reader(path) as cursor:
        result = cursor.execute(SQL_RUN_SUMMARY)
        names = [column[0] for column in result.description]
        return [_seen_from_folder(dict(zip(names, values, strict=True)), path) for values in result.fetchall()]


def read_runs(runs_dir: Path) -> pd.DataFrame:
    """`run_summaries` as a frame."""
    rows = run_summaries(runs_dir)
    if not rows:
        return pandas().DataFrame(columns=["run_id", "name", "status", "estimator", "k", "model", "task", "steps"])
    return pandas().DataFrame(rows)


def run_summaries(runs_dir: Path) -> list[dict]:
    """One dict per run in `runs_dir`, newest first: the run's row, its step count and latest metrics. A run whose
    file cannot be read is listed too, with status `unreadable` (damaged file) or `busy` (held by another process for
    too long) and the reason in `error`."""
    rows = []
    for folder in runs_without_database(runs_dir):  # a training run whose file was deleted or moved aside
        modified = datetime.fromtimestamp((folder / CONFIG_FILE).stat().st_mtime, timezone.utc).replace(tzinfo=None)
        rows.append(
            {
                "run_id": folder.name,
                "name": folder.name,
                "status": UNREADABLE,
                "created_at": modified,
                "error": str(unreadable_run_error(folder / DB_FILE, "")),
                "steps": None,
            }
        )
    for folder, reason in folders_not_runs(runs_dir):
        modified = datetime.fromtimestamp(folder.stat().st_mtime, timezone.utc).replace(tzinfo=None)
        rows.append(
            {
                "run_id": folder.name,
                "name": folder.name,
                "status": NOT_A_RUN,
                "created_at": modified,
                "error": reason,
                "steps": None,
            }
        )
    for run_dir in list_run_dirs(runs_dir):
        try:
            rows += _run_summary(run_dir / DB_FILE)
        except (QAEUserError, duckdb.Error) as err:  # (a damaged file; a link or a FIFO in its place: NotARegularFile)
            status = BUSY if is_lock_error(err) else UNREADABLE
            reason = (
                str(err)
                if status == UNREADABLE
                else (
                    f"run: {run_dir / DB_FILE} is held by another process "
                    f"({str(err).splitlines()[0]}); try again later."
                )
            )
            # (lstat: the planted link itself, never what it points at, which may be gone)
            modified = datetime.fromtimestamp(os.lstat(run_dir / DB_FILE).st_mtime, timezone.utc).replace(tzinfo=None)
            rows.append(
                {
                    "run_id": run_dir.name,
                    "name": run_dir.name,
                    "status": status,
                    "error": reason,
                    "created_at": modified,
                    "steps": None,
                }
            )
    return sorted(rows, key=lambda row: row["created_at"] or datetime.min, reverse=True)


def results_only_kind(folder: Path) -> str | None:
    """'eval' or 'preview' for a run folder that `qae eval` or `qae preview` made (its row's estimator says which:
    run_folder.RESULTS_ONLY_KINDS): results only, no model, no training run's settings; None for any other folder."""
    folder = Path(folder)
    if not (folder / DB_FILE).exists() or (folder / CONFIG_FILE).exists():  # a training run writes its config.json
        return None
    try:
        estimator = read_run(folder / DB_FILE).get("estimator")
    except (QAEUserError, duckdb.Error):  # unreadable: the command's own reading says why
        return None
    return estimator if estimator in RESULTS_ONLY_KINDS else None


def is_eval_run(folder: Path) -> bool:
    """A run folder `qae eval` made (its row's estimator is 'eval')."""
    return results_only_kind(folder) == "eval"


def check_run_file(path: Path) -> None:
    """QAEUserError naming `path` unless it opens, read-only, as a qae run's database (damaged, another program's
    DuckDB file, crafted); a file whose trainer holds it this instant passes (the run's lock says who trains it)."""
    try:
        query(path, "SELECT count(*) FROM runs")
    except duckdb.Error as err:
        if not is_lock_error(err):
            raise


def read_run(path: Path) -> dict:
    frame = query(path, SQL_RUN_SUMMARY)
    if frame.empty:
        raise QAEUserError(f"run: {path} has no run row; the run never started writing.")
    return _as_seen_from_folder(frame, path).iloc[0].to_dict()


def stored_config(row: dict) -> dict:
    """The run's settings from its row's `config` column as a dict; {} when the column is not a JSON object (a file
    edited by hand or crafted: a list, text, nesting deeper than any config), so one such run never breaks a listing
    or a view of the others. Its values are shown as stored; a resume reads config.json, checked (session)."""
    import json

    try:
        config = json.loads(row.get("config") or "{}")
    except (TypeError, ValueError, RecursionError):
        return {}
    return config if isinstance(config, dict) else {}


def read_steps(path: Path) -> pd.DataFrame:
    return query(path, "SELECT * FROM steps ORDER BY step")


def read_groups(path: Path, step: int) -> pd.DataFrame:
    return query(path, "SELECT * FROM groups WHERE step = ? ORDER BY group_idx", [step])


# Why a gated rollout `r` got advantage 0: reason (names.GATE_REASONS) -> condition on the row, first match wins.
GATE_REASON_RULES: dict[str, str] = {
    "all_correct_group": "r.regime = 'all_correct'",
    "all_wrong_group": "r.regime = 'all_wrong'",
    # by the verifier's verdict, not the reward (-1/1 and shaped rewards)
    "success_in_easy_group": "r.regime = 'easy' AND r.correct",
    "failure_in_hard_group": "r.regime = 'hard' AND NOT r.correct",
    "reward_at_baseline": "TRUE",
}
assert list(GATE_REASON_RULES) == list(GATE_REASONS)
SQL_GATE_REASON = (
    "CASE WHEN NOT r.gated THEN NULL "
    + " ".join(f"WHEN {condition} THEN '{reason}'" for reason, condition in GATE_REASON_RULES.items())
    + " END"
)

ROLLOUT_TEXT_COLUMNS = "g.prompt, r.response"  # the bulk of a step's bytes: read for the groups a page shows
SQL_ROLLOUTS = f"""
    SELECT r.step, r.group_idx, r.sample_idx, r.prompt_id, {{text}} g.answer, g.n_correct, g.group_size,
           g.baseline, r.regime, r.reward, r.correct, r.verified, r.advantage, r.gated, r.filtered,
           {SQL_GATE_REASON} AS gate_reason, r.n_tokens, r.truncated, r.entropy, r.logprob
    FROM rollouts r JOIN groups g USING (run_id, step, group_idx)
    WHERE r.step = ?
      AND (? IS NULL OR r.gated = ?)
      AND (? IS NULL OR r.filtered = ?)
      AND (? IS NULL OR r.regime = ?)
      AND (? IS NULL OR r.reward = ?)
      AND (? IS NULL OR contains(lower(r.response), lower(?)) OR contains(lower(g.prompt), lower(?)))
      AND (? IS NULL OR list_contains(?, r.group_idx))
    ORDER BY r.group_idx, r.sample_idx
"""


def read_rollouts(
    path: Path,
    step: int,
    gated: bool | None = None,
    regime: str | None = None,
    reward: float | None = None,
    search: str | None = None,
    filtered: bool | None = None,
    with_text: bool = True,
    group_ids: list[int] | None = None,
) -> pd.DataFrame:
    """Rollouts of one step joined with their group, filtered; `search` is a plain substring (bound, no SQL);
    `filtered`: only the groups dynamic sampling left out of the update (True) or only the trained ones (False).
    `with_text=False` leaves out the prompt and response texts (at the paper's step size, 512 x 16 responses of
    2-12k characters, they are ~60 MB; the counts and filters need none of it); `group_ids` reads only those groups."""
    search = search or None
    groups = None if group_ids is None else [int(g) for g in group_ids]
    sql = SQL_ROLLOUTS.format(text=f"{ROLLOUT_TEXT_COLUMNS}," if with_text else "")
    return query(
        path,
        sql,
        [
            step,
            gated,
            gated,
            filtered,
            filtered,
            regime,
            regime,
            reward,
            reward,
            search,
            search,
            search,
            groups,
            groups,
        ],
    )


SQL_MODEL_PROMPTS = "SELECT group_idx, model_prompt FROM groups WHERE step = ? AND model_prompt IS NOT NULL"


def read_model_prompts(path: Path, step: int) -> dict[int, str]:
    """group_idx -> the prompt as the model saw it (chat template applied) for the groups of one step; empty for a
    model without a chat template."""
    with open_reader(path) as con:
        return {int(g): str(text) for g, text in con.execute(SQL_MODEL_PROMPTS, [step]).fetchall()}


SQL_HAS_TABLE = """
    SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() AND table_name = ?
"""
# the mean of each reward component per step, over the responses it scored (None: not counted), and how many it scored
SQL_COMPONENT_MEANS = """
    SELECT step, name, avg(value) AS mean, count(value) AS scored, count(*) AS responses
    FROM reward_components GROUP BY step, name ORDER BY step, name
"""
SQL_COMPONENTS = """
    SELECT group_idx, sample_idx, name, value FROM reward_components WHERE step = ?
    ORDER BY group_idx, sample_idx, name
"""


def _read_components(path: Path, sql: str, params: list, columns: list[str]) -> pd.DataFrame:
    """A query of `reward_components`; an empty frame of `columns` for a file from before the table (a reader never
    migrates)."""
    with open_reader(path) as con:
        if not con.execute(SQL_HAS_TABLE, ["reward_components"]).fetchone()[0]:
            return pandas().DataFrame(columns=columns)
        return con.execute(sql, params).df()


def read_component_means(path: Path) -> pd.DataFrame:
    """step, name, mean, scored, responses: each reward component's mean per step (a run given --reward; else
    empty)."""
    return _read_components(path, SQL_COMPONENT_MEANS, [], ["step", "name", "mean", "scored", "responses"])


def read_components(path: Path, step: int) -> pd.DataFrame:
    """group_idx, sample_idx, name, value of every response of one step and every reward component."""
    return _read_components(path, SQL_COMPONENTS, [step], ["group_idx", "sample_idx", "name", "value"])


def component_table(means: pd.DataFrame) -> pd.DataFrame:
    """Component means as one column per component, one row per step (columns named `reward:<name>`)."""
    if means.empty:
        return pandas().DataFrame({"step": []})
    wide = means.pivot(index="step", columns="name", values="mean")
    wide.columns = [f"reward:{name}" for name in wide.columns]
    return wide.reset_index()


def read_evals(path: Path) -> pd.DataFrame:
    return query(path, "SELECT * FROM evals ORDER BY benchmark, subset, metric, k, step")


def read_warnings(path: Path) -> pd.DataFrame:
    return query(path, "SELECT * FROM warnings ORDER BY step")


def read_last_step(path: Path) -> int | None:
    frame = query(path, "SELECT max(step) AS last FROM steps")
    return None if frame["last"].isna().iloc[0] else int(frame["last"].iloc[0])  # NULL (NA, None or NaN): no step


def read_last_heldout_accuracy(path: Path) -> float | None:
    """The run's newest held-out accuracy, or None when it has never evaluated."""
    frame = query(
        path, "SELECT heldout_accuracy FROM steps WHERE heldout_accuracy IS NOT NULL ORDER BY step DESC LIMIT 1"
    )
    return float(frame["heldout_accuracy"].iloc[0]) if len(frame) else None


def _saved_step_writes(run_dir: Path) -> list:
    """The step writes saved under pending/ for the run's next writer, in the order they were saved."""
    writes = (read_pending_write(path) for path in sorted((Path(run_dir) / PENDING_DIR).glob(f"*{PENDING_SUFFIX}")))
    return [write for write in writes if write.kind == "step"]


def logged_steps(run_dir: Path) -> set[int]:
    """The steps whose `steps` row a run kept: in its database, or saved under pending/ for it (written by the run's
    next writer). A reader: it writes nothing."""
    path = Path(run_dir) / DB_FILE
    in_file = set(query(path, "SELECT DISTINCT step FROM steps")["step"].astype(int)) if path.exists() else set()
    return in_file | {write.step for write in _saved_step_writes(run_dir) if (write.tables or {}).get("steps")}


def last_logged_step(run_dir: Path) -> int:
    """The newest step any of whose rows a run kept, in its database or under pending/; 0 when none."""
    path = Path(run_dir) / DB_FILE
    in_file = read_last_step(path) if path.exists() else None
    return max([in_file or 0, *(write.step for write in _saved_step_writes(run_dir))])


# ---------------------------------------------------------------------------------------------------------------
# dashboard readers
#
# Each opens the run's file once, read-only, and closes it before returning, so a dashboard that refreshes every few
# seconds costs the trainer at most one short wait per refresh.


@dataclass
class RunView:
    """What the curves and evals pages show for one run, read in one connection."""

    run: dict  # one row of SQL_RUN_SUMMARY
    steps: pd.DataFrame  # the steps table, by step
    warnings: pd.DataFrame  # step, kind, message
    evals: pd.DataFrame  # step, benchmark, subset, metric, k, value, n_problems


def read_run_view(path: Path) -> RunView:
    with open_reader(path) as con:
        run = con.execute(SQL_RUN_SUMMARY).df()
        if run.empty:
            raise QAEUserError(f"run: {path} has no run row; the run never started writing.")
        return RunView(
            run=_as_seen_from_folder(run, path).iloc[0].to_dict(),
            steps=con.execute("SELECT * FROM steps ORDER BY step").df(),
            warnings=con.execute("SELECT step, kind, message FROM warnings ORDER BY step").df(),
            evals=con.execute(
                "SELECT step, benchmark, subset, metric, k, value, n_problems, source FROM evals "
                "ORDER BY benchmark, subset, metric, k, step"
            ).df(),
        )


@dataclass
class PreviewView:
    """What `qae preview` found (qae_app/evaluation/task_preview.py), read in one connection: what it prints and the
    dashboard's Preview page draws."""

    run: dict  # one row of SQL_RUN_SUMMARY
    summary: dict  # the `previews` row
    by_k: pd.DataFrame  # the `preview_k` rows: QAE by K, then GRPO (k NULL)
    groups: pd.DataFrame  # group_idx, prompt, answer, n_correct, group_size, baseline, regime
    rollouts: pd.DataFrame  # group_idx, sample_idx, response, reward, correct, verified, advantage, gated, n_tokens,
    # truncated
    signal: pd.DataFrame | None = None  # its `component_signal` rows (several reward components), else None


SQL_PREVIEW_GROUPS = (
    "SELECT group_idx, prompt, answer, n_correct, group_size, baseline, regime FROM groups "
    "WHERE step = ? ORDER BY group_idx"
)
SQL_PREVIEW_ROLLOUTS = (
    "SELECT group_idx, sample_idx, response, reward, correct, verified, advantage, gated, "
    "n_tokens, truncated FROM rollouts WHERE step = ? ORDER BY group_idx, sample_idx"
)


def read_preview(path: Path) -> PreviewView:
    """A preview's findings; QAEUserError when the run is not a preview."""
    with open_reader(path) as con:
        run = con.execute(SQL_RUN_SUMMARY).df()
        if run.empty or run["estimator"].iloc[0] != "preview":
            raise QAEUserError(
                f"run: '{Path(path).parent.name}' is not a preview. Make one with `qae preview` (the "
                "options of `qae train`), or look at a training run with `qae show`."
            )
        summary = con.execute("SELECT * FROM previews ORDER BY step DESC LIMIT 1").df()
        if summary.empty:
            raise QAEUserError(
                f"run: the preview '{Path(path).parent.name}' holds no findings: it stopped before "
                "they were written. Run `qae preview` again."
            )
        step = int(summary["step"].iloc[0])
        return PreviewView(
            run=_as_seen_from_folder(run, path).iloc[0].to_dict(),
            summary=summary.iloc[0].to_dict(),
            by_k=con.execute("SELECT * FROM preview_k WHERE step = ? ORDER BY estimator DESC, k", [step]).df(),
            groups=con.execute(SQL_PREVIEW_GROUPS, [step]).df(),
            rollouts=con.execute(SQL_PREVIEW_ROLLOUTS, [step]).df(),
            signal=(
                con.execute("SELECT * FROM component_signal WHERE step = ? ORDER BY rowid", [step]).df()
                if con.execute(SQL_HAS_TABLE, ["component_signal"]).fetchone()[0]
                else None
            ),
        )


def read_rollout_steps(path: Path) -> list[int]:
    """Steps that have groups (and so rollouts), ascending."""
    frame = query(path, "SELECT DISTINCT step FROM groups ORDER BY step")
    return [int(step) for step in frame["step"]]


SQL_PROMPTS = """
    SELECT prompt_id, any_value(prompt) AS prompt, any_value(answer) AS answer, count(*) AS times_sampled,
           min(step) AS first_step, max(step) AS last_step,
           arg_min(n_correct / group_size, step) AS first_success,
           arg_max(n_correct / group_size, step) AS last_success,
           arg_min(regime, step) AS first_regime, arg_max(regime, step) AS last_regime,
           avg(n_correct / group_size) AS mean_success
    FROM groups
    GROUP BY prompt_id
    ORDER BY times_sampled DESC, last_step DESC, prompt_id
"""


def read_prompts(path: Path) -> pd.DataFrame:
    """One row per prompt sampled in the run: how often, when, and its success rate and regime first and last."""
    return query(path, SQL_PROMPTS)


def read_prompt_histories(path: Path, prompt_ids: list[str]) -> pd.DataFrame:
    """step, prompt_id, success_rate, regime for each sampling of the given prompts."""
    return query(
        path,
        "SELECT step, prompt_id, n_correct, group_size, n_correct / group_size AS success_rate, baseline, regime "
        "FROM groups WHERE list_contains(?, prompt_id) ORDER BY prompt_id, step",
        [list(prompt_ids)],
    )


def read_regime_counts(path: Path) -> pd.DataFrame:
    """step, regime, n_groups: the regime mix of every step."""
    return query(
        path, "SELECT step, regime, count(*) AS n_groups FROM groups GROUP BY step, regime ORDER BY step, regime"
    )


# ---------------------------------------------------------------------------------------------------------------
# readers for the dashboard's live refresh, distributions, gating, evaluation samples and prompts across runs


def file_version(path: Path) -> tuple:
    """A fingerprint of a run's database (mtime and size of the file and its WAL) that changes with every commit.
    Costs two stat calls and never opens the file, so a dashboard can poll it to learn whether anything changed."""
    path = Path(path)
    version = []
    for file in (path, path.with_name(path.name + ".wal")):
        try:
            stat = file.stat()
            version += [stat.st_mtime_ns, stat.st_size]
        except OSError:
            version += [None, None]
    return tuple(version)


def read_step_tokens(path: Path) -> pd.DataFrame:
    """step, n_responses, n_trained (not filtered out by dynamic sampling), n_tokens (generated tokens of the step's
    responses), by step."""
    return query(
        path,
        "SELECT step, count(*) AS n_responses, count(*) FILTER (WHERE NOT filtered) "
        "AS n_trained, sum(n_tokens)::BIGINT AS n_tokens FROM rollouts GROUP BY step ORDER BY step",
    )


def read_gate_breakdown(path: Path) -> pd.DataFrame:
    """step, gate_reason, n: how many trained responses of each step were gated, and why (names.GATE_REASONS); a
    group dynamic sampling left out of the update is not counted (it is filtered, whatever its advantages), so the
    counts add up to frac_zero_adv."""
    return query(
        path,
        f"SELECT step, {SQL_GATE_REASON} AS gate_reason, count(*) AS n FROM rollouts r "
        "WHERE r.gated AND NOT r.filtered GROUP BY ALL ORDER BY step, gate_reason",
    )


# rollouts columns whose distribution over a step's responses the dashboard shows: column -> label
DISTRIBUTION_COLUMNS: dict[str, str] = {
    "advantage": "advantage",
    "reward": "reward",
    "n_tokens": "response length (tokens)",
    "entropy": "mean token entropy (nats)",
}
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def read_quantiles(path: Path, column: str, quantiles: tuple[float, ...] = QUANTILES) -> pd.DataFrame:
    """step, mean, q0.05, ..., q0.95 of one rollouts column over each step's responses (linear quantiles)."""
    if column not in DISTRIBUTION_COLUMNS:
        raise ValueError(f"column: {column!r} is not one of {list(DISTRIBUTION_COLUMNS)}")
    frame = query(
        path,
        f"SELECT step, avg({column}) AS mean, quantile_cont({column}, ?) AS q FROM rollouts "
        f"WHERE {column} IS NOT NULL GROUP BY step ORDER BY step",
        [list(quantiles)],
    )
    pd = pandas()
    values = pd.DataFrame(frame.pop("q").tolist(), columns=[f"q{q:g}" for q in quantiles], index=frame.index)
    return pd.concat([frame, values], axis=1)


def read_prompt_rollouts(path: Path, prompt_id: str) -> pd.DataFrame:
    """Every response to one prompt, at every step it was sampled, with its group's outcome and why it was gated."""
    return query(
        path,
        f"""
        SELECT r.step, r.group_idx, r.sample_idx, g.n_correct, g.group_size, g.baseline, r.regime, r.response,
               r.reward, r.advantage, r.gated, {SQL_GATE_REASON} AS gate_reason, r.n_tokens, r.truncated, r.filtered
        FROM rollouts r JOIN groups g USING (run_id, step, group_idx)
        WHERE r.prompt_id = ?
        ORDER BY r.step, r.group_idx, r.sample_idx""",
        [prompt_id],
    )


def read_eval_checkpoints(path: Path) -> pd.DataFrame:
    """benchmark, source, step, n_problems, n_samples, accuracy: every evaluation that stored its samples."""
    return query(
        path,
        "SELECT benchmark, source, step, count(DISTINCT problem_id) AS n_problems, "
        "count(*) AS n_samples, avg(correct::INT) AS accuracy FROM eval_samples "
        "GROUP BY ALL ORDER BY benchmark, source, step",
    )


def read_eval_problem_grid(path: Path, benchmark: str, source: str) -> pd.DataFrame:
    """problem_id, step, n_correct, n_samples: each problem's result at each evaluated step of one benchmark."""
    return query(
        path,
        "SELECT problem_id, step, sum(correct::INT)::INTEGER AS n_correct, count(*) AS n_samples "
        "FROM eval_samples WHERE benchmark = ? AND source = ? GROUP BY ALL ORDER BY problem_id, step",
        [benchmark, source],
    )


def read_eval_samples(
    path: Path,
    benchmark: str,
    source: str,
    step: int,
    correct: bool | None = None,
    problem_id: str | None = None,
    search: str | None = None,
) -> pd.DataFrame:
    """The evaluated responses of one benchmark at one step, filtered; `search` is a plain substring (bound)."""
    search = search or None
    return query(
        path,
        """
        SELECT problem_id, sample_idx, response, extracted, answer, correct, verified, n_tokens
        FROM eval_samples
        WHERE benchmark = ? AND source = ? AND step = ?
          AND (? IS NULL OR correct = ?)
          AND (? IS NULL OR problem_id = ?)
          AND (? IS NULL OR contains(lower(response), lower(?)) OR contains(lower(extracted), lower(?)))
        ORDER BY problem_id, sample_idx""",
        [benchmark, source, step, correct, correct, problem_id, problem_id, search, search, search],
    )
