"""Runs: every run in the runs dir with its status, setup, latest metrics, pace, tags and note (editable in the table
when the dashboard shows controls); a run's config and the difference between two runs' configs."""

import json

import board
import pandas as pd
import streamlit as st

from qae_app.analysis.differences import options_text
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import ago, duration, estimator_label, run_pace, setup_label
from qae_app.store.labels import MAX_NOTE_CHARS, check_note, labels_to_change, tags_from_text, write_labels
from qae_app.store.reader import NOT_A_RUN, READ_STATUSES, resolve_run
from qae_app.store.schema import STEP_METRICS

# In reading order: what the run is (its labels, then what tells it apart), how it is doing (its latest metrics
# before the pace of a live run), then bookkeeping. The columns shown fit 1400 px (a 940 px table beside the sidebar),
# also with a run training (its ETA shown); those HIDDEN are one click away in the table's column menu (the eye icon):
# a live run's last step age and pace (its status says when its trainer is gone), the estimator, K,
# seed, model and task are in `differs` wherever they tell runs apart (and above the table when every run shares
# them), an error is said above the table.
HIDDEN = {"hidden": True}
COLUMNS = {
    "shown": {
        **st.column_config.CheckboxColumn("shown", width=56, help="Picked in the sidebar: shown on the other pages."),
        **HIDDEN,
    },
    "run_id": st.column_config.TextColumn(
        "run", help="The run's folder: a copied or renamed folder is a run of its own."
    ),
    "tags": st.column_config.TextColumn(
        "tags",
        width=90,
        help="`qae tag RUN TAG...`; where the dashboard shows "
        "controls, edit them here (comma or space "
        "separated), even while the run trains",
    ),
    "note": st.column_config.TextColumn(
        "note",
        width=80,
        max_chars=MAX_NOTE_CHARS,
        help="`qae note RUN TEXT`; editable here where the dashboard shows controls",
    ),
    "differs": st.column_config.TextColumn(
        "differs",
        width=190,
        help="What tells the run apart: the options whose value varies among the runs listed "
        "(a switch that is off is not named), as `qae runs` says it; the options every "
        "run shares that are not the defaults are said above the table. A long one is "
        "cut: widen the column by its edge, or pick the run (the sidebar says it whole).",
    ),
    "status": st.column_config.TextColumn(
        "status",
        width=85,
        help="running, finished, failed, interrupted; stopped: stored as running but no trainer holds the "
        "run (killed without a chance to say so: resume it); unreadable: the database cannot be "
        "opened (see error)",
    ),
    "progress": st.column_config.TextColumn("steps", width=70, help="last step written / steps configured"),
    "reward_mean": st.column_config.NumberColumn(
        "reward",
        format="%.3f",
        width=60,
        help=STEP_METRICS["reward_mean"] + " (with 0/1 rewards, the "
        "accuracy; the accuracy column is in the column menu)",
    ),
    "accuracy": {
        **st.column_config.NumberColumn("accuracy", format="%.3f", width=70, help=STEP_METRICS["accuracy"]),
        **HIDDEN,
    },
    "entropy": st.column_config.NumberColumn("entropy", format="%.3f", width=60, help=STEP_METRICS["entropy"]),
    "heldout_accuracy": st.column_config.NumberColumn(
        "held-out", format="%.3f", width=70, help=STEP_METRICS["heldout_accuracy"]
    ),
    "last_step_age": {
        **st.column_config.TextColumn(
            "last step", width=80, help="how long ago the last step was committed (running runs)"
        ),
        **HIDDEN,
    },
    "steps_per_min": {
        **st.column_config.NumberColumn(
            "steps/min", format="%.3g", width=75, help="median pace of the last 50 steps (running runs)"
        ),
        **HIDDEN,
    },
    "eta": st.column_config.TextColumn(
        "ETA",
        width=60,
        help="time left to the configured steps at the pace of the last 50 steps (steps/min, in the column menu)",
    ),
    "estimator": {**st.column_config.TextColumn("estimator", width=80), **HIDDEN},
    "k": {
        **st.column_config.NumberColumn(
            "K", format="%.2f", width=50, help="QAE quantile level (empty for mean baselines)"
        ),
        **HIDDEN,
    },
    "group_size": {**st.column_config.NumberColumn("G", width=40, help="responses per prompt"), **HIDDEN},
    "seed": {
        **st.column_config.NumberColumn(
            "seed",
            width=50,
            help="the run's seed: runs of one setup that differ only in it are grouped on Compare and Training curves",
        ),
        **HIDDEN,
    },
    "sweep": {**st.column_config.TextColumn("sweep", help="the `qae sweep` the run belongs to (its name)"), **HIDDEN},
    "model": {**st.column_config.TextColumn("model"), **HIDDEN},
    "task": {**st.column_config.TextColumn("task"), **HIDDEN},
    "pending_writes": st.column_config.NumberColumn(
        "pending writes",
        help="Writes the trainer saved under pending/ that are not in the database yet: the "
        "steps since its last database write (it writes every few seconds), or everything while "
        "a reader holds the file. A stopped run's are written by `qae train --resume`.",
    ),
    "stored_run_id": st.column_config.TextColumn(
        "copied from", help="The id stored in the database, when it differs from the folder (a copied or renamed run)."
    ),
    "created_at": {**st.column_config.DatetimeColumn("created (UTC)", format="YYYY-MM-DD HH:mm"), **HIDDEN},
    "updated_at": {**st.column_config.DatetimeColumn("updated (UTC)", format="YYYY-MM-DD HH:mm:ss"), **HIDDEN},
    "error": {**st.column_config.TextColumn("error", width="large"), **HIDDEN},
}
ROW_PX = 35  # a row of st.dataframe
MAX_ROWS_SHOWN = 60  # the table grows to show every run up to this many; beyond, it scrolls (and says so)


def table(all_runs: pd.DataFrame) -> pd.DataFrame:
    frame = all_runs.copy()
    # (a list of unreadable runs only has none of the columns a readable run's row brings)
    for column in (*COLUMNS, "last_step", "stored_run_id"):
        if column not in frame:
            frame[column] = None
    configs = [board.run_config(row) for row in frame.to_dict("records")]
    total = [config.get("steps") for config in configs]
    last = frame["last_step"].astype("Int64").astype("string").fillna("0")
    frame["progress"] = [f"{step} / {steps}" if steps else step for step, steps in zip(last, total, strict=True)]
    frame.loc[frame["status"].isin(READ_STATUSES), "progress"] = None
    frame["group_size"] = [config.get("group_size") for config in configs]
    frame["seed"] = [config.get("seed") for config in configs]
    frame["sweep"] = [config.get("sweep_name") or config.get("sweep_id") for config in configs]
    frame["shown"] = frame["run_id"].isin(board.shown_runs())
    frame["stored_run_id"] = frame["stored_run_id"].where(frame["stored_run_id"] != frame["run_id"])
    for i, row in frame[frame["status"] == "running"].iterrows():
        view = board.run_view(row["run_id"])
        if view is None:
            continue
        pace = run_pace(view.steps, board.run_config(view.run).get("steps"))
        frame.at[i, "last_step_age"] = ago(pace["age_s"]) if pace["age_s"] is not None else None
        frame.at[i, "steps_per_min"] = pace["steps_per_min"]
        frame.at[i, "eta"] = duration(pace["eta_s"]) if pace["eta_s"] is not None else None
    frame["pending_writes"] = frame["pending_writes"].where(frame["pending_writes"].fillna(0) > 0)
    frame["differs"] = differs(frame)
    # shown when some run has one (tags and note always, where they can be edited)
    optional = (
        "last_step_age",
        "steps_per_min",
        "eta",
        "stored_run_id",
        "pending_writes",
        "sweep",
        *(() if board.controls_on() else ("tags", "note")),
    )
    frame[["tags", "note"]] = frame[["tags", "note"]].fillna("").astype(str)
    frame[["tags", "note"]] = frame[["tags", "note"]].where(frame[["tags", "note"]] != "")
    shown = [column for column in COLUMNS if column not in optional or frame[column].notna().any()]
    return frame[shown]


SETUP = ("estimator", "k")  # (said above the table when every run shares them, else in `differs`)


def differs(runs: pd.DataFrame) -> list[str | None]:
    """The `differs` column: what tells each run apart from the others listed (analysis.differences; the steps are
    in their own column), the seed first: the column is cut at its width, and the seed is what tells a sweep's runs of
    one setup apart."""
    return [
        options_text(sorted(options, key=lambda option: option[0] != "seed")) or None
        for options in board.runs_apart(runs, leave_out=("steps",)).per_run
    ]


def shared_note(runs: pd.DataFrame) -> None:
    """Above the table, once: the estimator and K every run listed trains with, and the options they all share that
    are not the defaults."""
    setups = {
        estimator_label(run["estimator"], run.get("k"))
        for run in runs.to_dict("records")
        if board.training_config(run) is not None
    }
    shared = [
        (key, value)
        for key, value in board.runs_apart(runs, leave_out=("steps",)).shared
        if key not in SETUP or len(setups) != 1
    ]
    said = [*setups] if len(setups) == 1 else []
    if shared:
        said.append(f"{options_text(shared)} (not the defaults)")
    if said:
        st.caption(f"Every run listed: {board.literal('; '.join(said))}")


EDITABLE = ("tags", "note")
TABLE_VERSION = "_runs_table_version"  # part of the editable table's key: a new table (no stale edits) after a save


def save_labels(run_ids: list[str], key: str) -> None:
    """The editable table's on_change: write each edited row's tags and note to its run's labels.json (store/labels.py,
    beside the database: no lock of the trainer's is touched), then start a fresh table. `run_ids`: the runs as the
    table showed them, row by row."""
    problems = []
    for row, changed in st.session_state[key]["edited_rows"].items():
        run_id = run_ids[int(row)]
        try:
            folder = resolve_run(board.runs_dir(), run_id).parent
            labels = labels_to_change(folder)
            if "tags" in changed:
                labels.tags = tags_from_text(changed["tags"] or "")
            if "note" in changed:
                labels.note = check_note(changed["note"] or "")
            write_labels(folder, labels)
        except (QAEUserError, OSError) as err:
            problems.append(f"{run_id}: {err}")
    st.session_state["_label_problems"] = problems
    st.session_state[TABLE_VERSION] = st.session_state.get(TABLE_VERSION, 0) + 1


def runs_table(runs_now: pd.DataFrame) -> None:
    """Every run in view (the table grows with the runs: a fixed box hid the 11th run below its fold); with controls,
    the tags and note cells are editable."""
    frame = table(runs_now)
    height = ROW_PX * (min(len(runs_now), MAX_ROWS_SHOWN) + 1) + 3
    if not board.controls_on():
        st.dataframe(frame, hide_index=True, column_config=COLUMNS, key="runs_table", placeholder="", height=height)
        return
    for problem in st.session_state.pop("_label_problems", []):
        st.error(board.literal(problem), icon=":material/label_off:")
    key = f"runs_table_{st.session_state.get(TABLE_VERSION, 0)}"
    st.data_editor(
        frame,
        hide_index=True,
        column_config=COLUMNS,
        key=key,
        placeholder="",
        height=height,
        disabled=[column for column in frame.columns if column not in EDITABLE],
        on_change=save_labels,
        args=([str(run_id) for run_id in frame["run_id"]], key),
    )
    st.caption(
        "Edit a run's **tags** (comma or space separated) or **note** in the table: saved beside its "
        "database at once, also while it trains (as `qae tag` and `qae note`)."
    )


def config_section(all_runs: pd.DataFrame) -> None:
    """One run's config, or (two runs picked) the options where they differ."""
    readable = all_runs[~all_runs["status"].isin(READ_STATUSES)]
    ids = [str(r) for r in readable["run_id"]]
    if not ids:
        return
    st.subheader("Config")
    shown = [r for r in board.shown_runs() if r in ids]
    default = shown[:2] if shown else ids[:1]
    picked = st.multiselect(
        "Runs to compare (one: its config; two or more: the options that differ)",
        ids,
        default=default,
        key="config_runs",
        max_selections=4,
    )
    if not picked:
        return
    configs = {run_id: board.run_config(readable.set_index("run_id").loc[run_id].to_dict()) for run_id in picked}
    keys = list(dict.fromkeys(key for config in configs.values() for key in config))

    def cell(config: dict, key: str) -> str:
        if key == "distributed" and key in config:  # how the run was launched: "fsdp2 x 2 processes"
            return setup_label(config[key]) or "(not set)"
        return json.dumps(config[key]) if key in config else "(not set)"

    grid = pd.DataFrame(
        {"option": keys, **{run_id: [cell(config, key) for key in keys] for run_id, config in configs.items()}}
    )
    if len(picked) > 1:
        differ = grid[picked].nunique(axis=1) > 1
        only = st.toggle("only the options that differ", value=True, key="config_diff_only")
        st.caption(f"{int(differ.sum())} of {len(keys)} options differ")
        if only:
            if not differ.any():
                st.info("These runs have the same config.")
                return
            grid = grid[differ]
    st.dataframe(grid, hide_index=True, key="config_table", placeholder="")


def unreadable_notice(all_runs: pd.DataFrame) -> None:
    for row in all_runs[all_runs["status"].isin(READ_STATUSES)].to_dict("records"):
        if row["status"] == NOT_A_RUN:
            st.info(f"**{board.literal(row['run_id'])}**: {board.literal(row['error'])}", icon=":material/folder_off:")
            continue
        st.error(
            f"**{row['run_id']}** is unreadable: {board.literal(row['error'])}. Other runs are unaffected; the "
            "run's checkpoints, if any, are still in its folder.",
            icon=":material/broken_image:",
        )


st.header("Runs")
st.caption("Pick the runs to show (and compare) in the sidebar; the choice is kept in the URL, so you can share it.")
runs_now = board.runs()
if runs_now.empty:
    st.info(
        f"No runs in `{board.runs_dir()}` yet. Start one with `qae train --runs-dir {board.runs_dir()}`; "
        "it appears here within seconds."
    )
    st.stop()
unreadable_notice(runs_now)
shared_note(runs_now)
runs_table(runs_now)
counts = runs_now["status"].value_counts()
st.caption(
    f"{len(runs_now)} runs: "
    + " · ".join(f"{n} {status}" for status, n in counts.items())
    + (
        f" (the table shows {MAX_ROWS_SHOWN} at a time: scroll it for the rest)"
        if len(runs_now) > MAX_ROWS_SHOWN
        else ""
    )
)
config_section(runs_now)
