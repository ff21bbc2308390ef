"""What every dashboard page shares: where the runs are, which runs are shown (kept in the URL), cached readers and
the live-refresh fragment.

No I/O at import. Every read goes through a `qae_app.store` reader (read-only, opened and closed at once) wrapped in
`st.cache_data` with a TTL shorter than the refresh interval, so a refresh costs the trainer one short wait per run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import duckdb
import pandas as pd
import plotly.colors
import streamlit as st

from qae_app import store
from qae_app.errors import QAEUserError

RUNS_DIR_ENV = "QAE_RUNS_DIR"  # set by `qae dashboard --runs-dir`
CACHE_TTL_S = 2.0  # below the shortest refresh interval, so every refresh sees new steps
REFRESH_CHOICES = {"off": None, "2 s": 2, "5 s": 5, "10 s": 10, "30 s": 30}
DEFAULT_REFRESH = "5 s"
RUN_COLORS = plotly.colors.qualitative.Plotly


def runs_dir() -> Path:
    return Path(os.environ.get(RUNS_DIR_ENV, "runs")).resolve()


def run_path(run_id: str) -> Path:
    return store.db_path(runs_dir(), run_id)


# ---------------------------------------------------------------------------------------------------------------
# cached readers (arguments are the cache key; the runs dir is part of it so tests with several dirs don't mix)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _runs(runs_dir_: str) -> pd.DataFrame:
    return store.read_runs(Path(runs_dir_))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _run_view(path: str) -> store.RunView:
    return store.read_run_view(Path(path))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _rollout_steps(path: str) -> list[int]:
    return store.read_rollout_steps(Path(path))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _rollouts(path: str, step: int, gated: bool | None, regime: str | None, reward: float | None,
              search: str | None) -> pd.DataFrame:
    return store.read_rollouts(Path(path), step, gated=gated, regime=regime, reward=reward, search=search)


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _prompts(path: str) -> pd.DataFrame:
    return store.read_prompts(Path(path))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _prompt_histories(path: str, prompt_ids: tuple[str, ...]) -> pd.DataFrame:
    return store.read_prompt_histories(Path(path), list(prompt_ids))


@st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)
def _regime_counts(path: str) -> pd.DataFrame:
    return store.read_regime_counts(Path(path))


def _guarded(read: Callable, *args, what: str):
    """`read(*args)`, or None with a note when the file stayed busy or went away (the next refresh retries)."""
    try:
        return read(*args)
    except duckdb.Error as err:
        st.caption(f":material/hourglass_empty: {what}: the database is busy ({type(err).__name__}); retrying at the "
                   "next refresh.")
    except QAEUserError as err:
        st.warning(str(err))
    return None


def runs() -> pd.DataFrame:
    """Every run in the runs dir, newest first (see `store.read_runs`)."""
    frame = _guarded(_runs, str(runs_dir()), what="runs")
    return frame if frame is not None else pd.DataFrame(columns=["run_id", "status", "steps"])


def run_view(run_id: str) -> store.RunView | None:
    return _guarded(_run_view, str(run_path(run_id)), what=run_id)


def rollout_steps(run_id: str) -> list[int]:
    return _guarded(_rollout_steps, str(run_path(run_id)), what=run_id) or []


def rollouts(run_id: str, step: int, gated: bool | None = None, regime: str | None = None,
             reward: float | None = None, search: str | None = None) -> pd.DataFrame | None:
    return _guarded(_rollouts, str(run_path(run_id)), step, gated, regime, reward, search or None, what=run_id)


def prompts(run_id: str) -> pd.DataFrame | None:
    return _guarded(_prompts, str(run_path(run_id)), what=run_id)


def prompt_histories(run_id: str, prompt_ids: list[str]) -> pd.DataFrame | None:
    return _guarded(_prompt_histories, str(run_path(run_id)), tuple(prompt_ids), what=run_id)


def regime_counts(run_id: str) -> pd.DataFrame | None:
    return _guarded(_regime_counts, str(run_path(run_id)), what=run_id)


# ---------------------------------------------------------------------------------------------------------------
# which runs are shown: the sidebar picker, bound to `?run=...` so a view can be shared


def pick_runs(all_runs: pd.DataFrame) -> list[str]:
    """The sidebar multiselect of runs. First visit without `?run=`: the newest run."""
    ids = [str(run_id) for run_id in all_runs["run_id"]]
    if "run" not in st.session_state and "run" not in st.query_params and ids:
        st.session_state["run"] = ids[:1]
    # no format_func: a bound widget reads the URL as formatted options, and run ids make plain URLs
    st.sidebar.multiselect("Runs", ids, key="run", bind="query-params", placeholder="pick runs",
                           help="Curves and evaluations overlay every picked run; rollouts and prompt history show "
                                "one of them. The choice is in the URL: share it to share the view.")
    return shown_runs()


def shown_runs() -> list[str]:
    return list(st.session_state.get("run") or [])


def pick_one_run(label: str = "Run") -> str | None:
    """For pages about a single run: the first picked run, or a choice among the picked ones."""
    chosen = shown_runs()
    if not chosen:
        st.info("Pick a run in the sidebar.")
        return None
    if len(chosen) == 1:
        return chosen[0]
    if st.session_state.get("one_run") not in chosen:
        st.session_state["one_run"] = chosen[0]
    return st.segmented_control(label, chosen, key="one_run", bind="query-params", persist_state="session")


def run_colors(run_ids: list[str]) -> dict[str, str]:
    """One fixed color per run, in the order they were picked, on every chart."""
    return {run_id: RUN_COLORS[i % len(RUN_COLORS)] for i, run_id in enumerate(run_ids)}


# ---------------------------------------------------------------------------------------------------------------
# live refresh


def refresh_interval() -> float | None:
    """Seconds between refreshes of the live parts of a page (sidebar choice), None when off."""
    return REFRESH_CHOICES.get(st.session_state.get("refresh", DEFAULT_REFRESH))


def live(body: Callable[[], None], run_ids: list[str], all_runs: pd.DataFrame) -> None:
    """Draw `body()`, and while one of `run_ids` is running redraw it (only it) every few seconds.

    `body` runs in an `st.fragment(run_every=...)`; when the last live run stops, the whole page reruns once so the
    timer goes away.
    """
    running = set(all_runs.loc[all_runs["status"] == "running", "run_id"]) & set(run_ids)
    interval = refresh_interval() if running else None

    def fragment() -> None:
        if running:
            now = runs()
            still = set(now.loc[now["status"] == "running", "run_id"]) & running
            if still != running:
                st.rerun(scope="app")
        body()

    st.fragment(fragment, run_every=interval)()


def progress_line(view: store.RunView) -> str:
    """'qae1 · running · step 37 / 400' from the run's row and config."""
    run = view.run
    total = run_config(run).get("steps")
    last = "—" if pd.isna(run.get("last_step")) else int(run["last_step"])
    return f"{run['run_id']} · {run['status']} · step {last}" + (f" / {total}" if total else "")


def run_config(run: dict) -> dict:
    """The run's training config (the `config` JSON of its `runs` row); {} if unreadable."""
    try:
        return json.loads(run.get("config") or "{}")
    except (TypeError, ValueError):
        return {}


def show_prompt_and_answer(prompt: str, answer: str) -> None:
    """Prompt and gold answer side by side, as literal text (model-facing text never goes through markdown)."""
    left, right = st.columns([3, 1])
    with left:
        st.caption("prompt")
        st.code(prompt, language=None, wrap_lines=True)
    with right:
        st.caption("answer")
        st.code(answer, language=None, wrap_lines=True)
