"""The run store: one DuckDB file per run, `runs/<run_id>/qae.duckdb`, and what it holds.

`STEP_METRICS` is the single definition of every per-step metric: the `steps` table columns, the README table and the
dashboard labels all come from it. `TABLES` is the single definition of every table: the writer's DDL, the check that a
file is of the current format (run_file.format_problem) and the check of the rows the trainer hands over all come from
it. `PendingWrite` is a write the writer
keeps under `pending/` until the file is free.

Who touches the file: qae_app/store/writer.py (`RunWriter`, the only writer) and qae_app/store/reader.py (the readers:
read-only, one query, let go at once), both through qae_app/store/run_file.py, which waits out another process's lock
and tells a busy file from a damaged one. This module is data only: it imports no database library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.names import DEFAULT_K
from qae_app.store.run_folder import STORED_STATUSES, read_run_file

# name -> definition. Every name is a column of `steps`; NaN is stored as NULL (e.g. no response had a negative
# advantage, so entropy_neg is undefined). With --dynamic-sampling a step samples more groups than it trains: metrics
# of what was sampled count every group of the step, filtered ones included; metrics of the update count the trained
# groups only (each definition says which). Without dynamic sampling every sampled group is trained.
STEP_METRICS: dict[str, str] = {
    "reward_mean": "mean reward of the responses sampled this step, filtered groups included (after the overlong "
    "penalty; unverifiable responses count as wrong)",
    "accuracy": "fraction of the responses sampled this step that the verifier found correct, filtered groups included",
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
    "runs), under the whole update (every group's gradient): not which regime's update moved it (that is "
    "dH_hard_from_hard / dH_hard_from_easy)",
    "dH_easy": "dH over the responses of easy groups (success rate > 1 - K, not all correct), under the whole update, "
    "as dH_hard",
    "dH_from_hard": "with --log-entropy-attribution: how the update made from the hard groups' loss alone (every "
    "other advantage 0, the real step's normalizer, from the policy and optimizer state before the "
    "update, then undone) changes the mean token entropy of all the step's trained responses; "
    "regimes as dH_hard's; NULL without it or when the step has no hard group",
    "dH_hard_from_hard": "dH_from_hard over the hard groups' responses only",
    "dH_easy_from_hard": "dH_from_hard over the easy groups' responses only",
    "dH_from_easy": "as dH_from_hard, for the update made from the easy groups' loss alone",
    "dH_hard_from_easy": "dH_from_easy over the hard groups' responses only",
    "dH_easy_from_easy": "dH_from_easy over the easy groups' responses only",
    "dH_from_none": "as dH_from_hard, for the update with every advantage 0: AdamW's drift (its first moment from "
    "earlier steps, weight decay), part of both regimes' updates; dH_from_hard - dH_from_none is "
    "the hard gradient's own part",
    "dH_hard_from_none": "dH_from_none over the hard groups' responses only",
    "dH_easy_from_none": "dH_from_none over the easy groups' responses only",
    "cov_logp_adv": "covariance over trained response tokens of token log-prob and advantage; entropy falls when it "
    "is > 0",
    "adv_abs_mean": "mean |advantage| over trained responses",
    "k": "the QAE quantile level K used this step (NULL for mean-baseline estimators)",
    "loss": "policy loss (plus KL term) averaged over the step's optimizer updates",
    "pg_loss": "policy-gradient part of the loss",
    "kl": "mean k3 estimate of KL(policy || reference) over response tokens; 0 when kl_beta = 0",
    "grad_norm": "gradient norm before clipping, averaged over the step's optimizer updates",
    "clip_frac": "fraction of tokens whose ratio was clipped (low + high)",
    "clip_frac_low": "fraction of tokens with negative advantage and ratio < 1 - clip_low (clipped); gspo: the "
    "sequence ratio against 1 - gspo_clip_low, counted at each of its tokens; 0 for kl_cov and "
    "cispo, which clip nothing below",
    "clip_frac_high": "fraction of tokens with positive advantage and ratio > 1 + clip_high (clipped); gspo: the "
    "sequence ratio against 1 + gspo_clip_high; cispo: the weight capped at cispo_weight_cap (its "
    "gradient flows on); 0 for kl_cov",
    "cov_selected_frac": "fraction of the step's response tokens (summed over its optimizer updates) that the policy "
    "loss's covariance rule selected: --policy-loss clip_cov cut their gradient, kl_cov "
    "penalised them; 0 for the other losses",
    "entropy_coef": "the entropy bonus's coefficient after the step's updates: --entropy-coef, or where "
    "--entropy-target moved it (0: no bonus)",
    "mismatch_logp_abs": "mean absolute difference logp_old - logp_sampler over the response tokens the loss weighs "
    "(responses with advantage != 0; every response under a KL term): logp_old the trainer's "
    "log-prob under the sampling weights (the ratio's denominator), logp_sampler the engine's "
    "while it sampled; "
    "~1e-7 for the hf engine in the trainer's dtype (float32 rounding: its decode loop sums in "
    "another order), ~1e-2 for a bfloat16 sampler; NULL where the engine returns none",
    "mismatch_k3_kl": "k3 estimate of KL(pi_sampler, pi_old) over the same tokens, the sampler's distribution first: "
    "mean of exp(d) - d - 1 with d = logp_old - logp_sampler (verl's mismatch_k3_kl; >= 0)",
    "mismatch_ratio_max": "largest pi_old / pi_sampler = exp(d) over the same tokens (--rollout-correction tis caps "
    "each token's weight at --rollout-correction-cap)",
    "mismatch_capped": "tokens among the same ones whose pi_old / pi_sampler is above --rollout-correction-cap (the "
    "tokens --rollout-correction tis caps, whether or not it is on); NULL where the engine returns "
    "no log-probs",
    "mismatch_capped_frac": "mismatch_capped as a share of the same tokens",
    "lr": "learning rate used for this step's updates",
    "response_len": "mean length in tokens of the responses sampled this step, filtered groups included",
    "truncated_frac": "fraction of the responses sampled this step that hit max_new_tokens before eos",
    "n_updates": "optimizer updates this step (num_mini_batches x ppo_epochs, including mini-batches whose "
    "advantages are all 0: AdamW still moves the weights on them, as a dense update would; fewer when "
    "dynamic sampling's cap left fewer trained responses than mini-batches, 0 when it left none)",
    "rollout_s": "seconds sampling responses (every generation batch)",
    "reward_s": "seconds scoring responses",
    "update_s": "seconds in forward/backward/optimizer (including the log-prob pass)",
    "sync_s": "seconds copying the updated weights into the rollout engine after the update: vLLM's copy (--engine "
    "vllm), or the hf engine's bfloat16 sampling copy (--rollout-dtype bfloat16); ~0 where the engine "
    "samples from the trained model itself; 0 when the step trained nothing; not part of update_s",
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

# The tables: name -> {column: SQL type}, `run_id` first in every table. The DDL, the current format a file must have
# (older ones: store/format_migration.py) and the check of the rows the trainer produces (`RunWriter.add_step`) all come
# from here.
TABLES: dict[str, dict[str, str]] = {
    "runs": {
        "run_id": "VARCHAR PRIMARY KEY",
        "name": "VARCHAR",
        "created_at": "TIMESTAMP",
        "updated_at": "TIMESTAMP",
        "status": "VARCHAR",
        "config": "VARCHAR",
        "estimator": "VARCHAR",
        "k": "DOUBLE",
        "model": "VARCHAR",
        "task": "VARCHAR",
        "seed": "BIGINT",
        "error": "VARCHAR",
        "setup_s": "DOUBLE",  # seconds from the trainer's start to its first step (loading, step-0 evaluation)
        "wall_s": "DOUBLE",  # seconds the run has trained, summed over its sessions (resumes)
    },
    # logged_at: when the step's rows were handed to RunWriter (UTC), stamped by it: the dashboard's wall-time axis,
    # heartbeat, rate and ETA
    "steps": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "logged_at": "TIMESTAMP",
        **{name: "DOUBLE" for name in STEP_METRICS},
    },
    "groups": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "group_idx": "INTEGER",
        "prompt_id": "VARCHAR",
        "prompt": "VARCHAR",
        "answer": "VARCHAR",
        "n_correct": "INTEGER",
        "group_size": "INTEGER",
        "baseline": "DOUBLE",
        "regime": "VARCHAR",
        "filtered": "BOOLEAN",  # left out of the update by dynamic sampling
        # the prompt as a chat model saw it: chat template applied, special tokens written out (system message, role
        # markers); NULL for a model without a chat template (the prompt is `prompt` itself)
        "model_prompt": "VARCHAR",
    },
    "rollouts": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "group_idx": "INTEGER",
        "sample_idx": "INTEGER",
        # zstd: the file holds response text at about a third of its size (FSST, DuckDB's default, about half)
        "prompt_id": "VARCHAR",
        "response": "VARCHAR USING COMPRESSION zstd",
        "reward": "DOUBLE",
        "verified": "BOOLEAN",
        "advantage": "DOUBLE",
        "gated": "BOOLEAN",
        "regime": "VARCHAR",
        "n_tokens": "INTEGER",
        "truncated": "BOOLEAN",
        "entropy": "DOUBLE",
        "logprob": "DOUBLE",
        "correct": "BOOLEAN",  # the verifier's verdict (reward is shaped); NULL in rows from before the column
        # its group was left out of the update by dynamic sampling (entropy, logprob: NULL unless the engine measured
        # them while sampling, as the hf engine does; the trainer's own pass covers the trained responses only)
        "filtered": "BOOLEAN",
        # mean |logp_old - logp_sampler| over the response's tokens: how far the sampler's numbers were from the
        # trainer's; NULL where the update did not forward it or the engine returns no log-probs
        "mismatch": "DOUBLE",
    },
    # per-token values of the responses --store-tokens keeps (store/tokens.py), one list element per response token
    "token_values": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "group_idx": "INTEGER",
        "sample_idx": "INTEGER",
        "tokens": "VARCHAR[]",
        "logprob": "FLOAT[]",
        "entropy": "FLOAT[]",
        "old_logprob": "FLOAT[]",
    },
    # with --reward: each response's value of each reward component (a built-in's verdict, a user function's score
    # or one of its named parts; NULL: could not verify); the response's `reward` is their weighted sum
    "reward_components": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "group_idx": "INTEGER",
        "sample_idx": "INTEGER",
        "name": "VARCHAR",
        "value": "DOUBLE",
    },
    # with several reward components (--reward): which carries the step's signal (store/signal.py): their mean value,
    # the share of groups where each differs, where the signal exists because of it, and its share of the advantage
    "component_signal": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "name": "VARCHAR",
        "weight": "DOUBLE",
        "value_mean": "DOUBLE",
        "frac_differs": "DOUBLE",
        "frac_signal": "DOUBLE",
        "adv_share": "DOUBLE",
    },
    "evals": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "benchmark": "VARCHAR",
        "subset": "VARCHAR",
        "metric": "VARCHAR",
        "k": "INTEGER",
        "value": "DOUBLE",
        "n_problems": "INTEGER",
        "source": "VARCHAR",
        # how the evaluation sampled: temperature, top-p, samples per problem and --limit (--eval-limit; NULL: every
        # problem); NULL in rows from before these columns
        "temperature": "DOUBLE",
        "top_p": "DOUBLE",
        "samples": "INTEGER",
        "problem_limit": "INTEGER",
    },
    "eval_samples": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "benchmark": "VARCHAR",
        "problem_id": "VARCHAR",
        "sample_idx": "INTEGER",
        "response": "VARCHAR",
        "extracted": "VARCHAR",
        "correct": "BOOLEAN",
        "verified": "BOOLEAN",
        "n_tokens": "INTEGER",
        "source": "VARCHAR",
        "model_prompt": "VARCHAR",  # as in `groups`: the prompt after the chat template; NULL without one
        "answer": "VARCHAR",  # the problem's gold answer, what `extracted` was checked against; NULL if unknown
    },
    "warnings": {"run_id": "VARCHAR", "step": "INTEGER", "kind": "VARCHAR", "message": "VARCHAR"},
    # `qae preview` (a run folder of its own, its runs row's estimator 'preview'; its responses are the `groups` and
    # `rollouts` rows of step 0, under the run's own estimator): what it found, one row
    "previews": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "n_prompts": "INTEGER",
        "group_size": "INTEGER",
        "max_new_tokens": "INTEGER",
        "accuracy": "DOUBLE",
        "reward_mean": "DOUBLE",
        "frac_no_signal": "DOUBLE",
        "frac_unverified": "DOUBLE",
        "truncated_frac": "DOUBLE",
        "response_len": "DOUBLE",
        "suggested_k": "DOUBLE",  # NULL when no group has signal: no K helps
        "verdict": "VARCHAR",
        "suggested_why": "VARCHAR",
    },
    # ... and what each estimator would make of its rewards: QAE at each K of --ks, and GRPO (k NULL)
    "preview_k": {
        "run_id": "VARCHAR",
        "step": "INTEGER",
        "estimator": "VARCHAR",
        "k": "DOUBLE",
        "frac_zero_adv": "DOUBLE",
        "frac_zero_adv_informative": "DOUBLE",
        "n_hard": "INTEGER",
        "n_easy": "INTEGER",
        "n_all_correct": "INTEGER",
        "n_all_wrong": "INTEGER",
        "n_mixed": "INTEGER",
        "suggested": "BOOLEAN",
    },
}
STEP_TABLES = (
    "steps",
    "groups",
    "rollouts",
    "reward_components",
    "component_signal",
    "token_values",
    "evals",
    "eval_samples",
    "warnings",
    "previews",
    "preview_k",
)  # rows keyed by step
EVAL_TABLES = ("evals", "eval_samples")  # rows keyed by step, benchmark and source


WRITER_COLUMNS = ("run_id", "step", "logged_at")  # filled in by RunWriter, not by the rows it is handed

# The columns of qae's tables in its first run files (2026-11-30): a file without one of them is no run file of qae's
# (damaged, or edited), where one without a column added since is of an older format (`qae migrate` adds it).
FIRST_COLUMNS = {
    "runs": (
        "run_id",
        "name",
        "created_at",
        "updated_at",
        "status",
        "config",
        "estimator",
        "k",
        "model",
        "task",
        "seed",
        "error",
    ),
    "steps": ("run_id", "step"),
    "groups": (
        "run_id",
        "step",
        "group_idx",
        "prompt_id",
        "prompt",
        "answer",
        "n_correct",
        "group_size",
        "baseline",
        "regime",
    ),
    "rollouts": (
        "run_id",
        "step",
        "group_idx",
        "sample_idx",
        "prompt_id",
        "response",
        "reward",
        "verified",
        "advantage",
        "gated",
        "regime",
        "n_tokens",
        "truncated",
        "entropy",
        "logprob",
    ),
    "evals": ("run_id", "step", "benchmark", "subset", "metric", "k", "value", "n_problems"),
    "eval_samples": (
        "run_id",
        "step",
        "benchmark",
        "problem_id",
        "sample_idx",
        "response",
        "extracted",
        "correct",
        "verified",
        "n_tokens",
    ),
    "warnings": ("run_id", "step", "kind", "message"),
}


def column_problem(columns: list[tuple[str, str, str]]) -> str | None:
    """Why the columns of a run file's tables, as (table, column, DuckDB type) rows, are not what qae writes (a
    column of qae's of another type, or one its first files had missing), or None. Tables and columns that are not
    qae's are left to the other checks."""
    found: dict[str, dict[str, str]] = {}
    for table, column, data_type in columns:
        found.setdefault(table, {})[column] = data_type
    for table, have in found.items():
        if table not in TABLES:
            continue
        for column, data_type in have.items():
            want = TABLES[table].get(column, "").split(" ")[0]
            if want and data_type != want:
                return f"has {table}.{column} as {data_type}, where qae writes {want}"
        missing = [column for column in FIRST_COLUMNS.get(table, ()) if column not in have]
        if missing:
            return f"has no {table}.{missing[0]} column, which every run file of qae's has"
    return None


def row_columns(table: str) -> tuple[str, ...]:
    """The columns a row of a step table carries when handed to the writer (the writer adds run_id, step and
    logged_at)."""
    return tuple(name for name in TABLES[table] if name not in WRITER_COLUMNS)


def schema_statements() -> list[str]:
    """The DDL of a new run file (a no-op on a file of the current format)."""
    return [
        f"CREATE TABLE IF NOT EXISTS {table} ("
        + ", ".join(f"{name} {sql_type}" for name, sql_type in columns.items())
        + ")"
        for table, columns in TABLES.items()
    ]


# ---------------------------------------------------------------------------------------------------------------
# a write waiting under pending/


@dataclass
class PendingWrite:
    """One write waiting for the file: a step's rows, a change to the run's row, or a truncation (on resume).

    Saved under pending/ as JSON (`pending_write_json`): data only, read without running anything (pre-releases
    pickled it: store/format_migration.py converts such files)."""

    kind: str  # "step", "step_update", "run" or "truncate"
    step: int | None = None
    tables: dict[str, list[dict]] | None = None  # kind "step": table name -> rows (without run_id and step)
    fields: dict | None = None  # kinds "run", "step_update": columns -> values
    spilled: Path | None = None  # its file under pending/ once the database was found busy
    logged_at: datetime | None = None  # kind "step": when it was queued (the steps row's logged_at)


PENDING_SUFFIX = ".json"  # a write saved under pending/: data only, nothing in it runs when read
_DATETIME_KEY = "$datetime"  # JSON has no timestamps: {"$datetime": ISO 8601}


def pending_write_json(write: PendingWrite) -> str:
    """A pending write as JSON text (without `spilled`, which is where it was read from). Row values are what the
    store's columns hold: text, numbers (NaN and infinities as Python's json writes them), booleans, null, nested
    lists/objects, and timestamps."""
    record = {
        "kind": write.kind,
        "step": write.step,
        "tables": write.tables,
        "fields": write.fields,
        "logged_at": write.logged_at,
    }
    return json.dumps(record, default=_json_value, ensure_ascii=False)


def pending_write_from_json(text: str) -> PendingWrite:
    """The inverse of pending_write_json; ValueError, naming what is wrong, when the text is not such a record. A file
    under pending/ may have been planted: its table and column names become SQL identifiers, so every name is checked
    against the schema here, before anything is applied, and every value must be one a column holds."""
    try:
        record = json.loads(text, object_hook=_from_json_object)
    except RecursionError:
        raise ValueError("nested deeper than any row") from None
    if not isinstance(record, dict) or record.get("kind") not in PENDING_KINDS:
        raise ValueError("not a pending write: no known 'kind'")
    unknown = set(record) - {"kind", "step", "tables", "fields", "logged_at"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}")
    write = PendingWrite(
        kind=record["kind"],
        step=record.get("step"),
        tables=record.get("tables"),
        fields=record.get("fields"),
        logged_at=record.get("logged_at"),
    )
    _check_pending(write)
    return write


def read_pending_write(path: Path) -> PendingWrite:
    """One saved write; a file that is not one (edited, planted, cut short by a full disk) is named."""
    try:
        return pending_write_from_json(read_run_file(path).decode("utf-8"))
    except (OSError, ValueError) as err:
        raise QAEUserError(
            f"store: {path} is not a write qae saved ({err}). Move it out of {path.parent} to go on "
            "without it (the step it held is trained again on resume if its checkpoint is older, "
            "else it is missing from the database)."
        ) from err


PENDING_KINDS = ("step", "step_update", "run", "truncate")
RUN_UPDATE_FIELDS = ("status", "error", "k", "config", "wall_s", "setup_s", "updated_at")  # what a "run" write sets


def _check_pending(write: PendingWrite) -> None:
    """ValueError unless every name in `write` is the schema's and every value a column's (see
    pending_write_from_json)."""
    if write.kind == "run":
        step_ok = write.step is None
    else:
        step_ok = (
            isinstance(write.step, int)
            and not isinstance(write.step, bool)
            and 0 <= write.step < _INTEGER_BOUNDS["INTEGER"]
        )
    if not step_ok:
        raise ValueError(f"step {str(write.step)[:40]!r} is not a step number (a whole number, 0 or more)")
    if write.logged_at is not None and not isinstance(write.logged_at, datetime):
        raise ValueError("logged_at is not a timestamp")
    if write.kind == "step":
        if not isinstance(write.tables, dict) or write.fields is not None:
            raise ValueError("a step write holds tables of rows and no fields")
        for table, rows in write.tables.items():
            if table not in STEP_TABLES:
                raise ValueError(f"unknown table {table!r}; a step's tables are {', '.join(STEP_TABLES)}")
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                raise ValueError(f"{table}: rows are not a list of objects")
            for row in rows:
                _check_fields(row, {name: TABLES[table][name] for name in row_columns(table)}, table)
        return
    if write.tables is not None:
        raise ValueError(f"a {write.kind} write holds no tables")
    if write.kind == "truncate":
        if write.fields is not None:
            raise ValueError("a truncate write holds no fields")
        return
    if not isinstance(write.fields, dict):
        raise ValueError(f"a {write.kind} write's fields are not an object")
    columns = RUN_UPDATE_FIELDS if write.kind == "run" else tuple(STEP_METRICS)
    table = TABLES["runs" if write.kind == "run" else "steps"]
    _check_fields(write.fields, {name: table[name] for name in columns}, write.kind)
    if write.kind == "run" and "status" in write.fields and write.fields["status"] not in STORED_STATUSES:
        raise ValueError(f"status {write.fields['status']!r} is not one of {', '.join(STORED_STATUSES)}")


def _check_fields(fields: dict, columns: dict[str, str], where: str) -> None:
    """ValueError unless every name of `fields` is one of `columns` (name -> SQL type) and its value one its column
    holds."""
    unknown = set(fields) - set(columns)
    if unknown:
        raise ValueError(f"{where}: unknown columns {sorted(unknown)[:5]}")
    for name, value in fields.items():
        problem = _value_problem(value, columns[name].split()[0])
        if problem:
            raise ValueError(f"{where}.{name}: {problem}")


_INTEGER_BOUNDS = {"INTEGER": 2**31, "BIGINT": 2**63}


def _value_problem(value, sql_type: str) -> str | None:
    """Why `value` is not one a column of `sql_type` (TABLES: VARCHAR, INTEGER, BIGINT, DOUBLE, BOOLEAN, TIMESTAMP,
    lists of text or numbers) takes, or None (null always is): a number for a number or a flag (NaN: null), text or a
    number for text, a timestamp for a timestamp, a list of them for a list, and no integer DuckDB cannot hold."""
    if value is None:
        return None
    if sql_type.endswith("[]"):  # (token_values: lists of text or numbers)
        if isinstance(value, list) and all(item is None or isinstance(item, (str, int, float)) for item in value):
            return None
        return f"a {type(value).__name__} is not a list this column ({sql_type}) holds"
    if not isinstance(value, (str, int, float, datetime)):
        return f"a {type(value).__name__} is not a value this column holds"
    if isinstance(value, int) and not -_INTEGER_BOUNDS["BIGINT"] <= value < _INTEGER_BOUNDS["BIGINT"]:
        return f"an integer of {len(str(abs(value))):,} digits is past what a column holds"
    takes = {"TIMESTAMP": datetime, "VARCHAR": (str, int, float)}.get(sql_type, (int, float))
    if not isinstance(value, takes):
        return f"a {type(value).__name__} is not a value this column ({sql_type}) holds"
    bound = _INTEGER_BOUNDS.get(sql_type)
    if bound and isinstance(value, (int, float)) and value == value and not -bound <= value < bound:  # (NaN: null)
        return f"{value!r} is past what this column ({sql_type}) holds"
    return None


def _json_value(value):
    if isinstance(value, datetime):
        return {_DATETIME_KEY: value.isoformat()}
    if hasattr(value, "item") and hasattr(value, "dtype"):  # a NumPy scalar a row was built with
        return value.item()
    raise TypeError(f"a pending write holds a {type(value).__name__}, which the store's columns do not take")


def _from_json_object(obj: dict):
    if len(obj) == 1 and _DATETIME_KEY in obj:
        value = obj[_DATETIME_KEY]
        try:
            return datetime.fromisoformat(value)
        except (TypeError, ValueError):  # (a number, an object, text that is no timestamp)
            raise ValueError(f"{{{_DATETIME_KEY!r}: {str(value)[:40]!r}}} is not a timestamp") from None
    return obj
