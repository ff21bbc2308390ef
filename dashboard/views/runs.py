"""Runs: every run in the runs dir with its status, setup and latest metrics."""

import pandas as pd
import streamlit as st

import board
from qae_app.store import STEP_METRICS

COLUMNS = {
    "shown": st.column_config.CheckboxColumn("shown", help="Picked in the sidebar: shown on the other pages."),
    "run_id": st.column_config.TextColumn("run"),
    "status": st.column_config.TextColumn("status", help="running, finished, failed or interrupted"),
    "estimator": st.column_config.TextColumn("estimator"),
    "k": st.column_config.NumberColumn("K", format="%.2f", help="QAE quantile level (empty for mean baselines)"),
    "group_size": st.column_config.NumberColumn("G", help="responses per prompt"),
    "model": st.column_config.TextColumn("model"),
    "task": st.column_config.TextColumn("task"),
    "progress": st.column_config.TextColumn("steps", help="last step written / steps configured"),
    "reward_mean": st.column_config.NumberColumn("reward", format="%.3f", help=STEP_METRICS["reward_mean"]),
    "accuracy": st.column_config.NumberColumn("accuracy", format="%.3f", help=STEP_METRICS["accuracy"]),
    "entropy": st.column_config.NumberColumn("entropy", format="%.3f", help=STEP_METRICS["entropy"]),
    "heldout_accuracy": st.column_config.NumberColumn("heldout acc.", format="%.3f",
                                                      help=STEP_METRICS["heldout_accuracy"]),
    "created_at": st.column_config.DatetimeColumn("created (UTC)", format="YYYY-MM-DD HH:mm"),
    "updated_at": st.column_config.DatetimeColumn("updated (UTC)", format="YYYY-MM-DD HH:mm:ss"),
    "error": st.column_config.TextColumn("error"),
}


def table(all_runs: pd.DataFrame) -> pd.DataFrame:
    frame = all_runs.copy()
    configs = [board.run_config(row) for row in frame.to_dict("records")]
    total = [config.get("steps") for config in configs]
    last = frame["last_step"].astype("Int64").astype("string").fillna("0")
    frame["progress"] = [f"{step} / {steps}" if steps else step for step, steps in zip(last, total)]
    frame["group_size"] = [config.get("group_size") for config in configs]
    frame["shown"] = frame["run_id"].isin(board.shown_runs())
    return frame[[column for column in COLUMNS if column in frame]]


def body() -> None:
    all_runs = board.runs()
    if all_runs.empty:
        st.info(f"No runs in `{board.runs_dir()}` yet. Start one with `qae train --runs-dir {board.runs_dir()}`; "
                "it appears here within seconds.")
        return
    st.dataframe(table(all_runs), hide_index=True, column_config=COLUMNS, key="runs_table")
    counts = all_runs["status"].value_counts()
    st.caption(" · ".join(f"{n} {status}" for status, n in counts.items()) + f" · refreshed every "
               f"{board.refresh_interval() or '—'} s while a run is running")


st.header("Runs")
st.caption("Pick the runs to show (and compare) in the sidebar; the choice is kept in the URL, so you can share it.")
runs_now = board.runs()
board.live(body, list(runs_now["run_id"]), runs_now)
