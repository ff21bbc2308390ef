"""Compare: the runs of a sweep, or any runs picked, grouped by their config without the seed (as `qae compare`): per
group the run metrics' means with 95% intervals, the paired differences from a baseline group, and the mean curves of
held-out accuracy, entropy and the zero-advantage fraction with a band across seeds.

Every number of the table comes from `qae_app.analysis.run_comparison`; this page only picks the runs and lays the
numbers out."""

import board
import charts
import loss_multiples
import pandas as pd
import streamlit as st

from qae_app.analysis import run_comparison
from qae_app.analysis.loss_table import TABLE_METRICS, loss_table
from qae_app.core.errors import QAEUserError
from qae_app.store.reader import READ_STATUSES
from qae_app.store.schema import STEP_METRICS

# the curves drawn per group: steps column -> (chart title, y axis title)
CURVES = {
    "heldout_accuracy": ("held-out accuracy", "avg@k over the held-out set"),
    "entropy": ("entropy", "nats / token"),
    "frac_zero_adv": ("zero-advantage (gated) fraction", "fraction of responses"),
}
# the values each curve can take: its band is cut there
CURVE_BOUNDS = {"heldout_accuracy": (0.0, 1.0), "entropy": (0.0, None), "frac_zero_adv": (0.0, 1.0)}
NO_HELDOUT = (
    "No held-out evaluation in these runs, so the held-out metrics are empty. Train with `--eval-every N` "
    "(`qae sweep` passes it on to every run) to evaluate on the held-out split every N steps and at step 0."
)


# ---------------------------------------------------------------------------------------------------------------
# which runs: a sweep (`?sweep=`) or the runs picked in the sidebar (`?run=`, the name every page uses)
#
# The pickers take a value typed in or given in a link that is not one of their options (a sweep's id where the list
# shows names, `grpo` for the group `estimator=grpo`, `a,b` for two runs in the sidebar's picker), and resolve it as
# `qae compare` does: the URL keeps what the link said, and a value that names nothing is reported, not dropped.


def run_configs(readable: pd.DataFrame) -> dict[str, dict]:
    return {str(row["run_id"]): board.run_config(row) for row in readable.to_dict("records")}


def sweeps(configs: dict[str, dict]) -> list[str]:
    """The sweeps among these runs (run id -> config, newest first), each by the name a user types (its id when two
    sweeps share a name)."""
    names: dict[str, str] = {}  # sweep id -> name, in the order first seen (newest run first)
    for config in configs.values():
        if config.get("sweep_id"):
            names.setdefault(str(config["sweep_id"]), str(config.get("sweep_name") or config["sweep_id"]))
    shared = {name for name in names.values() if list(names.values()).count(name) > 1}
    return [sweep_id if name in shared else name for sweep_id, name in names.items()]


def _chosen_by_user() -> None:
    st.session_state["_compare_chosen"] = True


def not_found(what: str) -> None:
    st.warning(
        f"Not in `{board.runs_dir()}`: {what}. The link names what this folder does not have (renamed, moved "
        "or deleted); pick above.",
        icon=":material/link_off:",
    )


def pick_compared(readable: pd.DataFrame) -> list[str]:
    """The sweep picker (`?sweep=NAME` or its id) and, without a sweep, the runs picked in the sidebar (`?run=a&run=b`
    or `?run=a,b`, as on every page; a link's `?runs=` is read as `?run=`). A first visit without a link shows the
    newest sweep, else the sidebar's runs."""
    configs = run_configs(readable)
    found = sweeps(configs)
    if not (
        st.session_state.get("_compare_chosen") or "sweep" in st.query_params or st.session_state.get("_link_runs")
    ):
        if found and st.session_state.get("sweep") is None:
            board.seed("sweep", found[0])
    left, right = st.columns(2)
    sweep = left.selectbox(
        "Sweep",
        found,
        index=None,
        key="sweep",
        bind="query-params",
        accept_new_options=True,
        placeholder="none: compare the runs picked in the sidebar" if found else "no sweep in this runs dir",
        on_change=_chosen_by_user,
        help="Runs started by `qae sweep` carry its id and name in their config: pick its name "
        "or type its id. Clear it to compare the runs picked in the sidebar.",
    )
    if sweep is not None:
        members = [run_id for run_id, config in sorted(configs.items()) if run_comparison.in_sweep(config, sweep)]
        if not members:
            not_found(f"no run belongs to sweep {board.literal(sweep)}")  # (the link's text, shown as text)
        else:
            ids = sorted({str(configs[run_id]["sweep_id"]) for run_id in members})
            right.caption(f"sweep id {', '.join(ids)}: {len(members)} run(s): " + ", ".join(members))
        return members
    run_ids = list(dict.fromkeys(run_id for value in board.picked_runs() for run_id in value.split(",") if run_id))
    right.caption(
        "the runs picked in the sidebar: runs with the same config but the seed form a group; pick two or "
        "more seeds of a setup for an interval"
    )
    if missing := [run_id for run_id in run_ids if run_id not in configs]:
        not_found(", ".join(f"run {board.literal(run_id)}" for run_id in missing))
    return [run_id for run_id in run_ids if run_id in configs]


# ---------------------------------------------------------------------------------------------------------------
# the table


def estimate_text(estimate: run_comparison.Estimate | None, sign: bool = False) -> str:
    """'0.700 [0.452, 0.948]': the mean over seeds and its 95% interval, '0.700 (n=2: no interval)' below
    `run_comparison.MIN_SEEDS` seeds, the mean alone with one; for a paired difference '+0.133 [-0.010, 0.277]
    p=0.0572'. `run_comparison.shown` rules what is printed, as in `qae compare`."""
    return loss_multiples.cell_text(estimate, sign)


def difference_text(difference: run_comparison.PairedDifference | None) -> str:
    """'+0.133 [-0.010, 0.277] p=0.0572': the mean paired difference, its 95% interval and the paired t-test p."""
    return estimate_text(difference, sign=True)


def group_notes(group: run_comparison.RunGroup) -> str:
    unfinished = [f"{run.run_id} ({run.status})" for run in group.runs if run.status != "finished"]
    notes = [group.note()] + ([f"not finished, numbers so far: {', '.join(unfinished)}"] if unfinished else [])
    return "; ".join(note for note in notes if note)


def groups_table(comparison: run_comparison.Comparison) -> pd.DataFrame:
    rows = []
    for group in comparison.groups:
        rows.append(
            {
                "group": group.label,
                "n": len(group.runs),
                "seeds": ", ".join(map(str, group.seeds)),
                **{name: estimate_text(group.metrics.get(name)) for name in run_comparison.RUN_METRICS},
                "note": group_notes(group),
                "runs": ", ".join(run.run_id for run in group.runs),
            }
        )
    return pd.DataFrame(rows)


def differences_table(comparison: run_comparison.Comparison) -> pd.DataFrame:
    rows = []
    for label, differences in comparison.differences.items():
        pairs = differences[next(iter(run_comparison.RUN_METRICS))].pairs
        rows.append(
            {
                "group": label,
                "paired seeds": ", ".join(str(seed) for seed, _, _ in pairs) or "none",
                "paired runs": "; ".join(f"{run} - {base_run}" for _, run, base_run in pairs) or "none",
                **{name: difference_text(differences.get(name)) for name in run_comparison.RUN_METRICS},
            }
        )
    return pd.DataFrame(rows)


def by_metric(table: pd.DataFrame) -> pd.DataFrame:
    """A table with a row per group (first column `group`) turned to a row per metric and a column per group: ten
    metrics of 'mean [low, high]' side by side ran off a 1400 px page (zero_adv, dH_*, step_s out of view), while a
    sweep has a few groups."""
    return table.set_index("group").T.astype(str).rename_axis("metric").reset_index()


def full_height(table: pd.DataFrame) -> int:
    """Pixels that show every row of `table` (st.dataframe's default box showed ten, hiding dH_hard and step_s)."""
    return 35 * (len(table) + 1) + 3


def by_metric_columns(table: pd.DataFrame, what: str) -> dict:
    return {
        "metric": st.column_config.TextColumn(
            "metric", pinned=True, width=120, help="each metric is defined under 'metric definitions' below"
        ),
        **{label: st.column_config.TextColumn(label, help=what) for label in table["group"]},
    }


def pick_baseline(groups: list[run_comparison.RunGroup]) -> run_comparison.RunGroup | None:
    """The baseline selector (`?baseline=LABEL`, or a value only one group has, such as `grpo`, resolved as
    `qae compare --baseline grpo` resolves it)."""
    if len(groups) < 2:
        return None
    name = st.selectbox(
        "Baseline",
        [group.label for group in groups],
        index=None,
        key="baseline",
        bind="query-params",
        accept_new_options=True,
        placeholder="none: no differences",
        help="Adds each group's difference from this one, paired by seed (the same seed gives both "
        "runs the same prompt order), with its 95% interval and the paired t-test p-value. "
        "Pick a group, or type a value only it has (grpo).",
    )
    if name is None:
        return None
    try:
        return run_comparison.find_group(groups, name)
    except QAEUserError as err:
        st.warning(str(err), icon=":material/link_off:")
        return None


# ---------------------------------------------------------------------------------------------------------------
# the page


def curves_section(comparison: run_comparison.Comparison, band: str) -> None:
    colors = board.method_colors({group.label: [run.run_id for run in group.runs] for group in comparison.groups})
    band, why = charts.resolve_band(band, max(len(group.runs) for group in comparison.groups))
    caption = (
        f"One color per group; the line is the mean over the group's seeds at each step, the band the "
        f"{charts.SEED_BANDS[band]}, cut at the values the metric can take (none where only one seed has the "
        "step; hover for how many do)"
    )
    if why:  # once for the three charts
        st.caption(f":material/info: {why[0].upper()}{why[1:]}.")
    left, right = st.columns(2)
    for i, (metric, (title, y_title)) in enumerate(CURVES.items()):
        curves = {
            group.label: charts.across_seeds(
                [run.steps.rename(columns={metric: "value"}) for run in group.runs if metric in run.steps],
                band,
                CURVE_BOUNDS[metric],
            )
            for group in comparison.groups
        }
        with (left, right)[i % 2]:
            if metric == "heldout_accuracy" and all(curve.empty for curve in curves.values()):
                st.subheader(title)
                st.info(NO_HELDOUT)
                continue
            fig = charts.seed_bands(curves, colors, title, y_title, band)
            if metric == "heldout_accuracy":
                fig.update_yaxes(range=[0, 1.05])
            board.plot(fig, f"compare_{metric}")
            without = [label for label, curve in curves.items() if curve.empty]
            st.caption(
                f"**{metric}**: {STEP_METRICS[metric]}. {caption}."
                + (f" No values in: {'; '.join(without)}." if without else "")
            )


def _groups_table(comparison) -> None:
    """Each group's metrics (mean over seeds and interval), the notes on groups, and a line when nothing was
    evaluated on held-out problems."""
    table = groups_table(comparison)
    shown = by_metric(table)
    st.dataframe(
        shown,
        hide_index=True,
        key="compare_table",
        placeholder="",
        height=full_height(shown),
        column_config=by_metric_columns(table, "mean over the group's seeds [95% Student-t interval]"),
    )
    for group in comparison.groups:
        if note := group_notes(group):
            st.caption(f":material/info: **{board.literal(group.label)}**: {board.literal(note)}")
    if all(group.metrics["final_heldout"].mean is None for group in comparison.groups):
        st.info(NO_HELDOUT)


def _differences_table(comparison) -> None:
    """Each group minus the baseline, paired by seed, and a note where seeds could not be paired."""
    st.markdown(
        f"**Minus the baseline {board.literal(comparison.baseline.label)}**, paired by seed: mean "
        "difference [95% interval] and the two-sided paired t-test p"
    )
    differences = differences_table(comparison)
    shown = by_metric(differences)
    st.dataframe(
        shown,
        hide_index=True,
        key="compare_differences",
        placeholder="",
        height=full_height(shown),
        column_config=by_metric_columns(
            differences, "group minus baseline, mean over paired seeds [95% interval] and the paired t-test p"
        ),
    )
    for label, differences in comparison.differences.items():
        paired = differences[next(iter(run_comparison.RUN_METRICS))]
        if paired.note:
            st.caption(f":material/info: **{board.literal(label)}** minus the baseline: {board.literal(paired.note)}")


def loss_section(comparison: run_comparison.Comparison, band: str) -> None:
    """The bake-off in the paper's layout, where the groups are a grid of policy losses x (a base estimator, qae):
    a table per metric (a row per loss) and the small multiples of entropy and held-out accuracy per loss."""
    table = loss_table(comparison.groups)
    if table is None:
        return
    st.subheader("By policy loss, as the paper's Table 2")
    st.caption(
        f"A row per policy loss: {table.base_estimator}, the same loss with qae, and qae minus "
        f"{table.base_estimator} paired by seed (mean [95% interval] p; no interval below "
        f"{run_comparison.MIN_SEEDS} seeds), as `qae compare` prints it"
    )
    left, right = st.columns(2)
    for i, metric in enumerate(TABLE_METRICS):
        with (left, right)[i % 2]:
            st.markdown(f"**{metric}**: {run_comparison.RUN_METRICS[metric]}")
            st.dataframe(
                loss_multiples.metric_frame(table, metric), hide_index=True, key=f"loss_table_{metric}", placeholder=""
            )
    colors = {estimator: board.METHOD_COLORS[estimator] for estimator in (table.base_estimator, "qae")}
    board.plot(loss_multiples.small_multiples(table, colors, band), "compare_loss_multiples")
    st.caption(
        "Each estimator in its color on every page; the line is the mean over the loss's seeds, the band the "
        f"{charts.SEED_BANDS[band]}."
    )


def body(run_ids: list[str]) -> None:
    records = [record for run_id in run_ids if (record := board.run_record(run_id)) is not None]
    if not records:
        return
    first = run_comparison.compare_runs(records)
    if first.left_out:
        st.caption(
            ":material/info: left out: "
            + board.literal(", ".join(f"{run_id} ({why})" for run_id, why in first.left_out.items()))
        )
    groups = first.groups
    if not groups:
        st.info("No picked run has a training step yet: the comparison appears when they write their first steps.")
        return
    baseline = pick_baseline(groups)
    comparison = run_comparison.compare_runs(records, baseline.label if baseline else None)
    n_runs = sum(len(group.runs) for group in groups)
    st.caption(
        f"{n_runs} run(s) in {len(groups)} group(s) (same config but the seed); each metric is the "
        "mean over the group's seeds with its 95% Student-t interval in brackets, as `qae compare` prints it"
    )
    _groups_table(comparison)
    if comparison.baseline is not None:
        _differences_table(comparison)
    with st.expander("metric definitions"):
        st.markdown("\n".join(f"- **{name}**: {text}" for name, text in run_comparison.RUN_METRICS.items()))
    if all(record.steps.empty for record in records):
        st.info("No step written yet: the curves appear when the runs write their first steps.")
        return
    band = st.segmented_control(
        "Band",
        list(charts.SEED_BANDS),
        key="band",
        default="auto",
        required=True,
        bind="query-params",
        help="t-interval: the 95% Student-t interval of the mean over seeds (the table's "
        "interval, step by step; wide with few seeds); min-max: the lowest to highest "
        "seed; auto: min-max up to 3 seeds, where t (12.71 at 2 seeds, 4.30 at 3) "
        "makes the interval unreadably wide, the t-interval from 4 seeds on.",
    )
    curves_section(comparison, band)
    loss_section(comparison, charts.resolve_band(band, max(len(group.runs) for group in comparison.groups))[0])


st.header("Compare")
st.caption(
    "Runs that differ only in seed form a group; each group's metrics are means over its seeds with 95% "
    "intervals. Pick a sweep or any runs; the choice is in the URL."
)
runs_now = board.runs()
readable_runs = runs_now[~runs_now["status"].isin(READ_STATUSES)]
if readable_runs.empty:
    st.info(
        f"No runs in `{board.runs_dir()}` yet. Start a sweep with `qae sweep --estimator qae,grpo --seeds 3 "
        f"--runs-dir {board.runs_dir()}`; its runs appear here."
    )
    st.stop()
compared = pick_compared(readable_runs)
if not compared:
    st.info("Pick a sweep, or runs to compare.")
    st.stop()
body(compared)
