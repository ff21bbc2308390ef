"""What every dashboard page shares: where the runs are, which runs are shown (kept in the URL), cached readers, the
watcher that redraws a page when its runs change, and the facts of a run (progress, pace, config).

A run is its folder: every reader is given `<runs dir>/<folder>/qae.duckdb`, so a copied or renamed run folder is a
run of its own on every page (the id stored inside the file is only shown, as `stored_run_id`).

No I/O at import. Every read goes through a `qae_app.store.reader` reader (read-only, opened and closed at once) wrapped
in `st.cache_data` keyed by the run's file version (`reader.file_version`: mtime and size, two stat calls): a page
redrawn without a new commit reads nothing from the database, and a new commit is always read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import FunctionType

import charts
import duckdb
import pandas as pd
import plotly
import plotly.colors
import plotly.graph_objects as go
import streamlit as st
import streamlit.components.v1 as components_v1

from qae_app.analysis import differences, run_comparison
from qae_app.analysis.settings import settings_problem
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.formatting import MISSING, missing, pace_line, run_pace
from qae_app.store import run_file
from qae_app.store.labels import LABELS_FILE
from qae_app.store.reader import (
    READ_STATUSES,
    RunView,
    file_version,
    read_rollout_steps,
    read_rollouts,
    read_run_view,
    read_runs,
    stored_config,
)
from qae_app.store.run_folder import (
    RESULTS_ONLY_KINDS,
    db_path,
    folders_not_runs,
    list_run_dirs,
    lock_holder_pid,
    runs_without_database,
    trainer_alive,
)
from qae_app.store.stop import request_stop, trainer_of

RUNS_DIR_ENV = "QAE_RUNS_DIR"  # set by `qae dashboard --runs-dir`
REFRESH_CHOICES = {
    ("off" if seconds is None else f"{seconds} s"): seconds  # sidebar label -> seconds
    for seconds in names.DASHBOARD_REFRESH_S.values()
}
RUN_COLORS = plotly.colors.qualitative.Plotly
# one color per method (the estimator), the same on every page: QAE is blue wherever it is told apart by method, on
# Training curves, Evals, Distributions and Compare alike (method_colors)
METHOD_COLORS = {name: RUN_COLORS[i % len(RUN_COLORS)] for i, name in enumerate(ESTIMATORS)}
CACHE_ENTRIES = 64  # per reader: a few versions of each shown run
RECORD_CACHE_ENTRIES = 256  # the Compare page reads every run of a sweep: a few versions of each of many runs


def starting_refresh() -> tuple[str, str | None]:
    """The refresh the sidebar starts at (`qae dashboard --refresh`), and what was wrong with the setting, if anything
    (a hand-set environment variable: `qae dashboard` refuses a bad value before starting)."""
    asked, problem = os.environ.get(names.DASHBOARD_REFRESH_ENV, names.DASHBOARD_REFRESH_DEFAULT), None
    if asked not in names.DASHBOARD_REFRESH_S:
        problem = (
            f"{names.DASHBOARD_REFRESH_ENV}={asked} is not offered ({', '.join(names.DASHBOARD_REFRESH_S)}): "
            f"refreshing every {names.DASHBOARD_REFRESH_DEFAULT} s."
        )
        asked = names.DASHBOARD_REFRESH_DEFAULT
    label = {seconds: label for label, seconds in REFRESH_CHOICES.items()}[names.DASHBOARD_REFRESH_S[asked]]
    return label, problem


def runs_dir() -> Path:
    return Path(os.environ.get(RUNS_DIR_ENV, "runs")).resolve()


def run_path(run_id: str) -> Path:
    return db_path(runs_dir(), run_id)


# ---------------------------------------------------------------------------------------------------------------
# versions: what changes when a run changes, without opening a database


def run_folders() -> tuple:
    """(folder, trainer alive) of every run: changes when a run appears, disappears, starts or stops (kill -9
    included: the trainer's lock goes with its process)."""
    return tuple((folder.name, trainer_alive(folder)) for folder in list_run_dirs(runs_dir()))


def runs_signature() -> tuple:
    """The run folders (`run_folders`) and every other folder a listing shows (not a run; a run that lost its
    database): changes when any of them appears or disappears. (A folder caught halfway through `rm -r`, its database
    gone, is listed; it must leave the listing when the rest of it goes.)"""
    root = runs_dir()
    return (
        run_folders(),
        tuple(folder.name for folder, _ in folders_not_runs(root)),
        tuple(folder.name for folder in runs_without_database(root)),
    )


def labels_version(run_id: str) -> tuple:
    """Changes when the run's tags or note change (`qae tag`, `qae note`, the Runs table: labels.json, beside the
    database, replaced by a rename)."""
    try:
        stat = (run_path(run_id).parent / LABELS_FILE).stat()
    except OSError:
        return (None, None, None)
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def run_version(run_id: str) -> tuple:
    """Changes with every commit to the run's database, when its trainer starts or stops, and with its labels."""
    path = run_path(run_id)
    return (*file_version(path), trainer_alive(path.parent), *labels_version(run_id))


def runs_version() -> tuple:
    """What the listing of every run is cached by: every folder it shows, and each run's file and labels."""
    return (runs_signature(), tuple((file_version(run_path(name)), labels_version(name)) for name, _ in run_folders()))


# ---------------------------------------------------------------------------------------------------------------
# cached readers: the version argument is part of the cache key, so a new commit is a cache miss


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner=False)
def _runs(runs_dir_: str, version: tuple) -> pd.DataFrame:
    return read_runs(Path(runs_dir_))


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner=False)
def _run_view(path: str, version: tuple) -> RunView:
    return read_run_view(Path(path))


@st.cache_data(max_entries=RECORD_CACHE_ENTRIES, show_spinner=False)
def _run_record(runs_dir_: str, run_id: str, version: tuple) -> run_comparison.RunRecord:
    return run_comparison.load_run(Path(runs_dir_), run_id)


def _reader_key(reader: Callable) -> str:
    """What a reader adds to a cache key: its qualified name (Streamlit cannot hash a function itself)."""
    return f"{reader.__module__}.{reader.__qualname__}"


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner=False, hash_funcs={FunctionType: _reader_key})
def _read(reader: Callable, path: str, version: tuple, *args) -> pd.DataFrame | list:
    """Any other store reader: reader(path, *args)."""
    return reader(Path(path), *args)


def _guarded(read: Callable, *args, what: str):
    """`read(*args)`, or None with a note when the file stayed busy or cannot be read (the next redraw retries)."""
    try:
        return read(*args)
    except duckdb.Error as err:
        if run_file.is_lock_error(err):
            st.caption(f":material/hourglass_empty: {what}: the database is busy; retrying at the next refresh.")
        else:
            st.error(f"{what}: the database cannot be read: {err}")
    except QAEUserError as err:
        st.warning(str(err))
    return None


def runs() -> pd.DataFrame:
    """Every run in the runs dir, newest first, with its effective status (see `read_runs`)."""
    frame = _guarded(_runs, str(runs_dir()), runs_version(), what="runs")
    return frame if frame is not None else pd.DataFrame(columns=["run_id", "status", "steps"])


def run_view(run_id: str) -> RunView | None:
    return _guarded(_run_view, str(run_path(run_id)), run_version(run_id), what=run_id)


def run_record(run_id: str) -> run_comparison.RunRecord | None:
    """The run as `qae compare` reads it (config, seed, steps with the step-0 held-out point); None if unreadable."""
    return _guarded(_run_record, str(runs_dir()), run_id, run_version(run_id), what=run_id)


def read(reader: Callable, run_id: str, *args):
    """`reader(the run's database, *args)` for a `store_read` reader, cached by the run's version; None (with a note)
    if unreadable."""
    return _guarded(_read, reader, str(run_path(run_id)), run_version(run_id), *args, what=run_id)


def rollout_steps(run_id: str) -> list[int] | None:
    """The steps with rollouts; None (with a note) if the run cannot be read."""
    return read(read_rollout_steps, run_id)


def rollouts(
    run_id: str,
    step: int,
    gated: bool | None = None,
    regime: str | None = None,
    reward: float | None = None,
    search: str | None = None,
    filtered: bool | None = None,
    with_text: bool = True,
    group_ids: tuple[int, ...] | None = None,
) -> pd.DataFrame | None:
    return read(
        read_rollouts,
        run_id,
        step,
        gated,
        regime,
        reward,
        search or None,
        filtered,
        with_text,
        None if group_ids is None else tuple(group_ids),
    )


# ---------------------------------------------------------------------------------------------------------------
# which runs are shown: the sidebar picker, bound to `?run=...` so a view can be shared


def default_runs(all_runs: pd.DataFrame) -> list[str]:
    """The run shown on a first visit: the newest run being trained, else the newest run."""
    readable = all_runs[~all_runs["status"].isin(READ_STATUSES)]
    live = readable[readable["status"] == "running"]
    pool = live if not live.empty else readable
    return [str(pool["run_id"].iloc[0])] if not pool.empty else []


def _picked_by_user() -> None:
    st.session_state["_run_chosen"] = True


def pick_runs(all_runs: pd.DataFrame) -> list[str]:
    """The sidebar multiselect of runs, bound to `?run=`. A link's runs are kept as the link says them, in the picker
    and in the URL, whether or not this folder has them: the page says which it does not have (`unknown_notice`) and
    shows them as soon as they appear (a link to a run about to start). Without a link, and until the user picks, the
    page shows the default (see `default_runs`), so a new run shows up on a page opened on an empty runs dir."""
    ids = [str(run_id) for run_id in all_runs["run_id"]]
    st.session_state["_run_ids"] = ids
    if "_link_runs" not in st.session_state:
        st.session_state["_link_runs"] = link_runs()  # what the link asked for, read once
    if not st.session_state.get("_run_chosen") and not st.session_state["_link_runs"]:
        wanted = default_runs(all_runs)
        if wanted and st.session_state.get("run") != wanted:
            seed("run", wanted)
    # no format_func: a bound widget reads the URL as formatted options, and run ids make plain URLs; new options:
    # a link's run that is not here yet stays in the URL (Streamlit drops a value that is not an option)
    st.sidebar.multiselect(
        "Runs",
        ids,
        key="run",
        bind="query-params",
        placeholder="pick runs",
        on_change=_picked_by_user,
        accept_new_options=True,
        help="Curves and evaluations overlay every picked run; rollouts and prompt history show "
        "one of them. The choice is in the URL: share it to share the view.",
    )
    return shown_runs()


def link_runs() -> list[str]:
    """The runs a link names, `?run=a&run=b` (or `?run=a,b`), on every page. A link written when the Compare page had
    a parameter of its own (`?runs=a&runs=b`, `?runs=a,b`) names them the same way, and the address then says
    `?run=`."""
    named = [run_id for value in st.query_params.get_all("run") for run_id in value.split(",") if run_id]
    if not named and "runs" in st.query_params:
        named = [run_id for value in st.query_params.get_all("runs") for run_id in value.split(",") if run_id]
        del st.query_params["runs"]
        seed("run", named)  # (the picker and the address: ?run=)
    return named


def picked_runs() -> list[str]:
    """Every run in the picker, as the link or the user named it, in this folder or not."""
    return [str(run_id) for run_id in st.session_state.get("run") or []]


def shown_runs() -> list[str]:
    """The picked runs this folder has: the ones the pages show."""
    known = set(st.session_state.get("_run_ids") or [])
    return [run_id for run_id in picked_runs() if run_id in known]


def unknown_notice() -> bool:
    """Say on the page which picked runs this folder does not have; True when none of the picked runs is here (the
    page then draws nothing else: it never shows another run in their place)."""
    unknown = [run_id for run_id in picked_runs() if run_id not in set(shown_runs())]
    if unknown:
        st.warning(
            f"Not in `{literal(runs_dir())}`: "
            + ", ".join(f"**{literal(r)}**" for r in unknown)
            + ". The link names runs this folder does not have (not started yet, renamed, moved or deleted): "
            "they are shown as soon as they appear; or pick runs in the sidebar.",
            icon=":material/link_off:",
        )
    return bool(unknown) and not shown_runs()


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


def start_page(title: str, caption: str | None = None, one_run: bool = False) -> list[str]:
    """How a page about the picked runs starts: its header (and caption), then the runs it shows: every picked run,
    or with `one_run` the one chosen among them (a list of one). With no run picked it says so and stops the page."""
    st.header(title)
    if caption:
        st.caption(caption)
    if one_run:
        run = pick_one_run()
        chosen = [] if run is None else [run]
    else:
        chosen = shown_runs()
        if not chosen:
            st.info("Pick one or more runs in the sidebar.")
    if not chosen:
        st.stop()
    return chosen


def run_colors(run_ids: list[str]) -> dict[str, str]:
    """One fixed color per run on every chart: its method's where the picked runs are one per method
    (`method_colors`), else by the order they were picked."""
    return method_colors({run_id: [run_id] for run_id in run_ids})


def method_colors(members: dict[str, list[str]]) -> dict[str, str]:
    """A color per line (label -> the runs it draws, a run or a group): where each line's runs share one estimator
    and no two lines share it, that estimator's METHOD_COLORS color, so a method has one color on every page; else
    (two seeds of one method, a group mixing methods) one color per line in order."""
    known = runs()
    estimator_of = (
        dict(zip(known["run_id"].astype(str), known["estimator"].astype(str), strict=True))
        if "estimator" in known
        else {}
    )
    methods = {label: {estimator_of.get(run_id) for run_id in run_ids} for label, run_ids in members.items()}
    single = [next(iter(found)) for found in methods.values() if len(found) == 1]
    if len(single) == len(members) and len(set(single)) == len(single) and set(single) <= set(METHOD_COLORS):
        return {label: METHOD_COLORS[next(iter(found))] for label, found in methods.items()}
    return {label: RUN_COLORS[i % len(RUN_COLORS)] for i, label in enumerate(members)}


# ---------------------------------------------------------------------------------------------------------------
# live: the page is redrawn when what it shows changed, and only then


def refresh_interval() -> float | None:
    """Seconds between checks for changes (sidebar choice), None when off."""
    return REFRESH_CHOICES.get(st.session_state.get("refresh") or starting_refresh()[0])


def _snapshot(watched: list[str]) -> tuple:
    return runs_signature(), tuple((file_version(run_path(run_id)), labels_version(run_id)) for run_id in watched)


def watch(watched: list[str], all_runs: pd.DataFrame) -> None:
    """Check every refresh interval (two stat calls per run, no database opened) whether a run appeared, started or
    stopped, or a watched run committed something; if so, redraw the page. Nothing else redraws it, so a page whose
    runs are idle or finished stays still (plotly keeps zoom and hidden traces), and a new run appears on an open
    page."""
    interval = refresh_interval()
    watched = [run_id for run_id in watched if run_id in set(all_runs["run_id"])]
    drawn = _snapshot(watched)
    live = sorted(set(all_runs.loc[all_runs["status"] == "running", "run_id"]) & set(watched))
    if interval is None:
        st.caption(":material/pause_circle: live updates off")
    elif live:
        st.caption(
            f":material/radio_button_checked: live: {', '.join(live)} training; the page redraws when new "
            f"steps are stored (the trainer writes every few seconds; checked every {interval:g} s)"
        )
    else:
        st.caption(
            f":material/radio_button_unchecked: no shown run is training: the page is not redrawn (new runs "
            f"are picked up within {interval:g} s)"
        )

    def check() -> None:
        if _snapshot(watched) != drawn:
            st.rerun(scope="app")

    st.fragment(check, run_every=interval)()


# ---------------------------------------------------------------------------------------------------------------
# facts of a run


def run_config(run: dict) -> dict:
    """The run's training config (the `config` JSON of its `runs` row); {} if it is not a JSON object, or holds
    settings qae did not write (analysis.settings: a view would compare or format them)."""
    config = stored_config(run)
    return config if settings_problem(config) is None else {}


def grouping_config(run: dict) -> dict:
    """The run's config and its tags as one more key (`tags`: its `qae tag` tags, as `qae compare --group-by tags`
    has them): what Training curves can group by."""
    tags = [tag for tag in str(run.get("tags") or "").split(", ") if tag]
    return {**run_config(run), run_comparison.TAGS_KEY: run_comparison.tags_value(tags)}


EVAL_SOURCES = {"train": "during training", "eval": "qae eval"}  # evals.source -> how the pages say it


def eval_label(benchmark: str, source: str) -> str:
    """How the Evaluations and Eval samples pages name one benchmark's evaluations: 'math500 (during training)'
    (--eval-every, --eval-bench) or 'math500 (qae eval)' (a checkpoint evaluated on its own, other k and limit)."""
    return f"{benchmark} ({EVAL_SOURCES.get(source, source)})"


def eval_choices(evaluations: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """label -> (benchmark, source) of a frame's evaluations (evals or eval_samples rows), as both pages list them;
    the first is where both open: the training's own evaluations before `qae eval`'s, each by benchmark name."""
    pairs = evaluations[["benchmark", "source"]].drop_duplicates().itertuples(index=False)
    ordered = sorted(pairs, key=lambda pair: (pair.source != "train", str(pair.benchmark), str(pair.source)))
    return {eval_label(benchmark, source): (benchmark, source) for benchmark, source in ordered}


def training_config(run: dict) -> dict | None:
    """The run's training config; None for a run without one (unreadable; made by `qae eval` or `qae preview`)."""
    if run.get("status") in READ_STATUSES or run.get("estimator") in RESULTS_ONLY_KINDS:
        return None
    return run_config(run)


def runs_apart(runs: pd.DataFrame, leave_out: tuple[str, ...] = ()) -> differences.Differences:
    """What the runs of a view (rows of `runs()`) share and what tells each apart, as `qae runs` says it."""
    return differences.what_differs([training_config(run) for run in runs.to_dict("records")], leave_out)


def picked_apart(all_runs: pd.DataFrame, shown: list[str]) -> None:
    """Under the sidebar's picker: each picked run's whole id and what tells it apart from the other picked runs (or,
    picked alone, its options not at their default); what they all share and is not the default, once."""
    picked = all_runs.set_index("run_id").loc[shown].reset_index()  # (in the picker's order)
    apart = runs_apart(picked)
    lines = [
        f"**{literal(run_id)}**: {literal(differences.options_text(options))}"
        for run_id, options in zip(picked["run_id"], apart.per_run, strict=True)
        if options
    ]
    if apart.shared:
        lines.append(f"all: {literal(differences.options_text(apart.shared))} (not the defaults)")
    if lines:
        st.caption(
            "  \n".join(lines),
            help="What tells the picked runs apart: the options whose value varies "
            "among them (a run picked alone: its options not at their default), as `qae runs` says it.",
        )


def progress_line(view: RunView) -> str:
    """'qae1 · running · step 37 / 400' from the run's row and config."""
    run = view.run
    total = run_config(run).get("steps")
    last = MISSING if missing(run.get("last_step")) else int(run["last_step"])
    return f"{run['run_id']} · {run['status']} · step {last}" + (f" / {total}" if total else "")


def controls_on() -> bool:
    """Whether this dashboard shows the controls that change runs (stop, tags and notes): `qae dashboard` on a
    loopback address or with --controls; not with --read-only, another --host, or the app started by hand."""
    return os.environ.get(names.DASHBOARD_CONTROLS_ENV) == "1"


def stop_controls(views: dict[str, RunView]) -> None:
    """For each shown run that a trainer of this machine is training: a stop button behind a confirmation, which
    stops it as `qae stop` does (store/stop.py: SIGTERM to the process the kernel says holds the run's lock; the run
    stops after its current step, with a checkpoint). Nothing for a run trained elsewhere, or without controls."""
    if not controls_on():
        return
    for run_id, view in views.items():
        if view.run["status"] != "running":
            continue
        folder = run_path(run_id).parent
        if st.session_state.get(f"_stop_sent_{run_id}") == lock_holder_pid(folder):
            st.caption(
                f":material/hourglass_top: **{literal(run_id)}**: stop sent; it stops after its current "
                "step and writes a checkpoint on the way out."
            )
            continue
        try:
            trainer_of(folder)
        except QAEUserError:  # not training here (another machine's trainer on a shared folder, or just ended)
            continue
        with st.popover(f"Stop {run_id}", icon=":material/stop_circle:", key=f"stop_menu_{run_id}"):
            st.markdown(
                f"Stop **{literal(run_id)}** after its current step? It writes a checkpoint on the way out "
                f"and ends `interrupted`; `qae train --resume {literal(run_id)}` continues it."
            )
            if st.button(f"Stop {run_id} now", key=f"stop_{run_id}", type="primary"):
                try:
                    st.session_state[f"_stop_sent_{run_id}"] = request_stop(folder)
                except QAEUserError as err:
                    st.error(literal(str(err)))
                    continue
                st.rerun()


def heartbeat(views: dict[str, RunView]) -> None:
    """For each run being trained: its last step's age, steps per minute and ETA, redrawn every few seconds on its
    own (only this line; the data is what the page was drawn with), so a trainer that hangs shows as an age that
    keeps growing."""
    live = {run_id: view for run_id, view in views.items() if view.run["status"] == "running"}
    if not live:
        return

    def line() -> None:
        parts = []
        for run_id, view in live.items():
            parts.append(f"**{run_id}**: " + pace_line(run_pace(view.steps, run_config(view.run).get("steps"))))
        st.markdown(":material/favorite: " + "   ·   ".join(parts))

    st.fragment(line, run_every=refresh_interval())()


def step_slider(steps: list[int], label: str, what: str) -> int:
    """Step picker bound to `?step=`; it follows the newest step while the user is on the newest step (a live run's
    new steps are shown as they come). A step in the link that has no `what` (rollouts) opens the nearest one that
    has, and says so."""
    latest, seen = steps[-1], st.session_state.get("_latest_step")
    requested = st.query_params.get("step")
    if requested is not None and requested not in {str(s) for s in steps}:
        try:
            target = min(steps, key=lambda s: (abs(s - int(requested)), -s))
        except ValueError:
            target = latest
        st.session_state["_step_note"] = (
            f"Step {literal(requested)} from the link has no {what}; showing step "
            f"{target}, the nearest (steps {steps[0]}..{latest})."
        )
        seed("step", target)
    elif "step" not in st.session_state and requested is None:
        seed("step", latest)
    elif "step" in st.session_state and (st.session_state["step"] not in steps or st.session_state["step"] == seen):
        st.session_state["step"] = latest
    st.session_state["_latest_step"] = latest
    if st.session_state.get("_step_note"):
        st.caption(st.session_state["_step_note"])
    if len(steps) == 1:
        st.caption(f"step {latest} (the only step with {what} so far)")
        return latest
    return st.select_slider(
        label,
        steps,
        key="step",
        bind="query-params",
        on_change=_clear_step_note,
        help="Stays on the newest step while you are on it; pick an older one to stay there.",
    )


def _clear_step_note() -> None:
    st.session_state.pop("_step_note", None)


MARKDOWN_SPECIAL = "\\`*_{}[]()#+-.!|<>~$:"


def literal(text: str) -> str:
    """`text` escaped for st.markdown / st.error, so file paths and messages show as they are."""
    return "".join("\\" + c if c in MARKDOWN_SPECIAL else c for c in str(text))


def seed(key: str, value) -> None:
    """Set a URL-bound widget's value from the code (a default, or a correction of a bad link) before the widget is
    drawn: in the session for this run and in the URL, so the address bar always shows what the page shows."""
    bound = key in st.session_state  # the widget was drawn before: Streamlit writes its new value into the URL
    st.session_state[key] = value
    if not bound:
        st.query_params[key] = [str(v) for v in value] if isinstance(value, list) else str(value)


# ---------------------------------------------------------------------------------------------------------------
# charts that keep their state
#
# st.plotly_chart gives a figure with new data a new element, so the browser draws a fresh plot and the user's zoom
# and hidden legend entries are lost at every new step. `plot` draws through a small component keyed by the chart's
# name instead: the same plot is updated in place with Plotly.react, which keeps UI state under a constant
# `uirevision` (set by charts.LAYOUT). plotly.js is the copy that ships with the plotly Python package, served by
# Streamlit from that package's folder; nothing is fetched from the network. The browser keeps a plot only while the
# chart's place among the page's blocks stays: st.columns are told apart by position, so an element that comes and
# goes above a chart (a live run's stop button) goes into a container drawn either way, or the chart below is drawn
# afresh and unzoomed.

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["select2d", "lasso2d"]}
PLOTLY_JS = r"""
export default function (component) {
  const { data, parentElement } = component;
  let plot = parentElement.querySelector("div.qae-plot");
  if (!plot) {
    plot = document.createElement("div");
    plot.className = "qae-plot";
    plot.style.width = "100%";
    parentElement.appendChild(plot);
  }
  // the figure is drawn in the light theme's ink (charts.THEMED) on a transparent background: swap the ink for the
  // page's text color, so a dark theme gets light text, grid and outlines
  const probe = document.createElement("span");
  probe.style.color = getComputedStyle(parentElement).getPropertyValue("--st-text-color").trim() || "#31333f";
  parentElement.appendChild(probe);
  const ink = getComputedStyle(probe).color.match(/[\d.]+/g).slice(0, 3).join(",");  // "r,g,b"
  probe.remove();
  const themed = JSON.parse(data.themed);
  const figure = JSON.parse(data.figure.replaceAll(themed.ink, `rgb(${ink})`)
    .replaceAll(themed.grid, `rgba(${ink},0.12)`).replaceAll(themed.axis_line, `rgba(${ink},0.3)`));
  window.qaePlotly = window.qaePlotly || new Promise((resolve, reject) => {
    if (window.Plotly) { resolve(window.Plotly); return; }
    const script = document.createElement("script");
    script.src = data.library;
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => reject(new Error("qae: could not load " + data.library));
    document.head.appendChild(script);
  });
  window.qaePlotly.then((Plotly) => Plotly.react(plot, figure.data, figure.layout, JSON.parse(data.config)));
  return () => { if (window.Plotly) { window.Plotly.purge(plot); } };
}
"""


@st.cache_resource(show_spinner=False)
def _plot_component():
    return st.components.v2.component("qae_plot", js=PLOTLY_JS, isolate_styles=False)


def _plotly_library_url() -> str:
    """Where the browser loads plotly.js from: the plotly package's own copy, served as a (never drawn) component."""
    library = components_v1.declare_component("plotly_js", path=str(Path(plotly.__file__).parent / "package_data"))
    base = str(st.get_option("server.baseUrlPath") or "").strip("/")
    return "/" + "/".join(part for part in (base, "component", library.name, "plotly.min.js") if part)


def plot(fig: go.Figure, key: str) -> None:
    """Draw `fig` as the chart named `key`; redrawn with new data, it keeps the user's zoom and hidden traces."""
    _plot_component()(
        key=key,
        data={
            "figure": fig.to_json(remove_uids=False),
            "library": _plotly_library_url(),
            "config": json.dumps(PLOTLY_CONFIG),
            "themed": json.dumps(charts.THEMED),
            # a new theme reruns the page: new data, so the chart is drawn in its ink
            "theme": st.context.theme.type,
        },
    )


FILTERED_REASON = "filtered by dynamic sampling"  # what a response of a group left out of the update shows


def filtered_rows(responses: pd.DataFrame) -> pd.Series:
    """Whether each response's group was left out of the update by dynamic sampling (NULL, never written: trained):
    such a response is neither gated nor kept, whatever its advantage."""
    return responses["filtered"].fillna(False).astype(bool)


def show_prompt_and_answer(prompt: str, answer: str, model_prompt: str | None = None) -> None:
    """Prompt and gold answer side by side, as literal text (model-facing text never goes through markdown); with
    `model_prompt`, the prompt as the model saw it (chat template applied) instead of the task's text."""
    left, right = st.columns([3, 1])
    with left:
        st.caption("prompt as the model saw it (chat template applied)" if model_prompt is not None else "prompt")
        st.code(model_prompt if model_prompt is not None else prompt, language=None, wrap_lines=True)
    with right:
        st.caption("answer")
        st.code(answer, language=None, wrap_lines=True)
