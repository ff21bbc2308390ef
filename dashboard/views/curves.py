"""Training curves of the picked runs, overlaid, redrawn at each new step of a live run (zoom and hidden legend entries
survive the redraw)."""

import attribution
import board
import charts
import grouping
import pandas as pd
import streamlit as st

from qae_app.core.names import entropy_band
from qae_app.store.reader import component_table, read_component_means, read_step_tokens
from qae_app.store.schema import STEP_METRICS
from qae_app.store.signal_reader import read_component_signal, signal_table

OTHER_DEFAULT = ["loss", "grad_norm", "adv_abs_mean"]
# --log-entropy-attribution's columns: the change of all responses per source, and the 2 x 2 regime matrix
ATTRIBUTION_SOURCES = ("dH_from_hard", "dH_from_easy", "dH_from_none")
ATTRIBUTION_MATRIX = ("dH_hard_from_hard", "dH_easy_from_hard", "dH_hard_from_easy", "dH_easy_from_easy")


def chart(fig, key: str, metrics: list[str]) -> None:
    board.plot(fig, key)
    st.caption(" · ".join(f"**{metric}**: {STEP_METRICS[metric]}" for metric in metrics if metric in STEP_METRICS))


def heldout_points(view) -> pd.DataFrame:
    """step, value of the run's own held-out evaluations (avg@k over the whole set), step 0 included."""
    evals = view.evals
    part = evals[(evals["source"] == "train") & (evals["metric"] == "avg@k") & (evals["subset"] == "all")]
    if part.empty:  # a run from before the evals table: the steps column
        steps = view.steps.dropna(subset=["heldout_accuracy"])
        return pd.DataFrame({"step": steps["step"], "value": steps["heldout_accuracy"]})
    return part.groupby("step", as_index=False)["value"].mean()


def grouped(
    views: dict, frames: dict[str, pd.DataFrame], heldout: dict[str, pd.DataFrame], by: list[str], band: str
) -> tuple[dict, dict, dict[str, list[str]]]:
    """The runs' frames and held-out points as one per group (mean and band over its runs), and the groups."""
    configs = {
        run_id: board.grouping_config(view.run) if by else board.run_config(view.run) for run_id, view in views.items()
    }  # (the default groups are Compare's: tags not among the keys)
    groups = grouping.group_runs(configs, by or None)
    drawn, why = charts.resolve_band(band, max(len(run_ids) for run_ids in groups.values()))
    metrics = (
        [m for m in STEP_METRICS if any(m in frame for frame in frames.values())]
        + component_columns(frames)
        + component_columns(frames, "signal:")
    )
    held = {run_id: points.rename(columns={"value": "heldout"}) for run_id, points in heldout.items()}
    grouped_held = grouping.group_frames(held, groups, ["heldout"], drawn)
    lines = [
        f"**{board.literal(label)}**: {len(run_ids)} run(s) ({board.literal(', '.join(run_ids))})"
        for label, run_ids in groups.items()
    ]
    st.caption(
        f"Grouped by {', '.join(by) if by else 'everything but the seed'}: the line is the mean over the "
        f"group's runs at each step, the band the {charts.SEED_BANDS[drawn]} (none where one run has the "
        "step; hover for how many do). " + " · ".join(lines) + (f". {why}." if why else "")
    )
    return (
        grouping.group_frames(frames, groups, metrics, drawn),
        {
            label: frame.rename(columns={"heldout": "value"})[["step", "value"]].dropna()
            for label, frame in grouped_held.items()
        },
        groups,
    )


def step_frames(views: dict, x: str) -> dict[str, pd.DataFrame]:
    """Each run's steps with the x axes (charts.X_AXES); a run that recorded no `x` is plotted by step, as the page
    says."""
    frames = {
        run_id: charts.with_x_axes(
            with_components(run_id, view.steps),
            view.run.get("created_at"),
            board.read(read_step_tokens, run_id) if x == "tokens" else None,
        )
        for run_id, view in views.items()
    }
    missing = [run_id for run_id, frame in frames.items() if not frame.empty and frame[x].isna().all()]
    if missing:
        st.caption(
            f"{', '.join(missing)}: no {x.replace('_', ' ')} recorded (a run written before step times "
            "were kept); plotted by step instead."
        )
        for run_id in missing:
            frames[run_id] = frames[run_id].assign(**{x: frames[run_id]["step"]})
    return frames


def with_components(run_id: str, steps: pd.DataFrame) -> pd.DataFrame:
    """The run's steps with each reward component's mean per step as a column `reward:<name>` and its share of the
    advantage as `signal:<name>` (a run given --reward; the others' steps as they are)."""
    means = board.read(read_component_means, run_id)
    signal = board.read(read_component_signal, run_id)
    for wide in (
        component_table(means) if means is not None else None,
        signal_table(signal) if signal is not None else None,
    ):
        if wide is not None and len(wide.columns) > 1:
            steps = steps.merge(wide, on="step", how="left")
    return steps


def component_columns(frames: dict[str, pd.DataFrame], prefix: str = "reward:") -> list[str]:
    return sorted({str(c) for frame in frames.values() for c in frame.columns if str(c).startswith(prefix)})


def entropy_bands(views: dict) -> dict[str, tuple[float, float]]:
    """The entropy band each run's trainer watched: its options, or relative to its first step's entropy."""
    bands = {}
    for run_id, view in views.items():
        cfg = board.run_config(view.run)
        start = view.steps["entropy"].dropna().iloc[0] if view.steps["entropy"].notna().any() else None
        band = entropy_band(cfg.get("entropy_low"), cfg.get("entropy_high"), start)
        if band is not None:
            bands[run_id] = band
    return bands


def body(
    run_ids: list[str],
    smoothing: tuple[str, float],
    x: str,
    log_y: bool,
    other: list[str],
    group_by: list[str] | None = None,
    seed_band: str = "auto",
) -> None:
    """The charts of the picked runs; `group_by` (a list, [] for everything but the seed): one mean curve and band
    per group of runs instead of a line per run."""
    views = {run_id: view for run_id in run_ids if (view := board.run_view(run_id)) is not None}
    if not views:
        return
    st.text("   ".join(board.progress_line(view) for view in views.values()))
    # what only a live run has, in one slot drawn live or not: Streamlit's browser side keeps a chart (and its zoom)
    # by its place among the page's blocks, so a stop button and pace line that vanished when the run finished moved
    # every chart in columns below them, and those were drawn afresh, unzoomed
    with st.container():
        board.stop_controls(views)
        board.heartbeat(views)
    if all(view.steps.empty for view in views.values()):
        st.info("No step written yet: the first step appears here when the trainer finishes it.")
        return
    frames = step_frames(views, x)
    colors = board.run_colors(run_ids)  # the picked order, readable or not: a run keeps its color on every page
    bands = entropy_bands(views)
    warnings = {run_id: view.warnings for run_id, view in views.items()}
    heldout = {run_id: heldout_points(view) for run_id, view in views.items()}
    if group_by is not None:
        if x != "step":
            st.caption(f"Grouped curves are drawn over steps: the runs of a group differ in {x.replace('_', ' ')}.")
            x = "step"
        frames, heldout, groups = grouped(views, frames, heldout, group_by, seed_band)
        colors = board.method_colors(groups)
        bands = {label: bands[run_ids[0]] for label, run_ids in groups.items() if run_ids[0] in bands}
        warnings = {}  # markers of one run's warnings: ungroup to see them
    axes = dict(x=x, log_y=log_y)
    policy_charts(frames, colors, bands, warnings, heldout, smoothing, axes)
    if components := component_columns(frames):  # runs given --reward: each component's mean per step
        component_charts(frames, colors, warnings, components, smoothing, axes)
    update_charts(frames, colors, warnings, smoothing, axes)
    chart(charts.step_time(frames, smoothing, x), "step_time", list(charts.TIME_METRICS))
    columns = st.columns(2)
    for i, metric in enumerate(other):
        with columns[i % 2]:
            chart(
                charts.lines(frames, [metric], colors, metric, smoothing, charts.metric_unit(metric), **axes),
                f"other_{metric}",
                [metric],
            )


def policy_charts(
    frames: dict, colors: dict, bands: dict, warnings: dict, heldout: dict, smoothing: tuple[str, float], axes: dict
) -> None:
    """What the policy did: entropy (with its band and the recorded warnings), accuracy, the gated fraction, the
    covariance of log-prob and advantage, the regimes, the entropy of positive and negative responses, response
    length."""
    _entropy_and_accuracy_row(frames, colors, bands, warnings, heldout, smoothing, axes)
    left, right = st.columns(2)
    with left:
        chart(
            marked(
                charts.lines(
                    frames,
                    ["frac_zero_adv"],
                    colors,
                    "zero-advantage (gated) fraction",
                    smoothing,
                    "fraction of responses",
                    **axes,
                ),
                frames,
                colors,
                warnings,
                ["frac_zero_adv"],
                axes["x"],
            ),
            "frac_zero_adv",
            ["frac_zero_adv"],
        )
    with right:
        chart(
            charts.lines(
                frames,
                ["cov_logp_adv"],
                colors,
                "covariance of log-prob and advantage",
                smoothing,
                "nats x advantage",
                **axes,
            ),
            "cov_logp_adv",
            ["cov_logp_adv"],
        )
    # a panel per run: full width
    chart(charts.regimes(frames, smoothing, axes["x"]), "regimes", list(charts.REGIME_METRICS))
    _entropy_split_and_length_row(frames, colors, warnings, smoothing, axes)


def _entropy_split_and_length_row(
    frames: dict, colors: dict, warnings: dict, smoothing: tuple[str, float], axes: dict
) -> None:
    """The entropy of positive and negative responses; response length beside it, with its alerts marked."""
    left, right = st.columns(2)
    with left:
        chart(
            charts.lines(
                frames,
                ["entropy_pos", "entropy_neg"],
                colors,
                "entropy of positive vs negative responses",
                smoothing,
                "nats / token",
                **axes,
            ),
            "entropy_split",
            ["entropy_pos", "entropy_neg"],
        )
    with right:
        chart(
            marked(
                charts.lines(frames, ["response_len"], colors, "response length", smoothing, "tokens", **axes),
                frames,
                colors,
                warnings,
                ["response_len"],
                axes["x"],
            ),
            "response_len",
            ["response_len"],
        )


def _entropy_and_accuracy_row(
    frames: dict, colors: dict, bands: dict, warnings: dict, heldout: dict, smoothing: tuple[str, float], axes: dict
) -> None:
    """Entropy with its band, its recorded warnings in an expander under it; accuracy beside it."""
    left, right = st.columns(2)
    with left:
        chart(charts.entropy(frames, colors, bands, warnings, smoothing, **axes), "entropy", ["entropy"])
        recorded = pd.concat(
            [pd.DataFrame(columns=["step", "kind", "message"])]
            + [w.assign(run=run_id) for run_id, w in warnings.items()],
            ignore_index=True,
        )
        if not recorded.empty:
            with st.expander(f"{len(recorded)} recorded warning(s)"):
                st.dataframe(recorded[["run", "step", "kind", "message"]], hide_index=True, placeholder="")
    with right:
        chart(
            marked(
                charts.accuracy(frames, colors, heldout, smoothing, **axes),
                frames,
                colors,
                warnings,
                ["accuracy"],
                axes["x"],
            ),
            "accuracy",
            ["accuracy", "reward_mean", "heldout_accuracy"],
        )


def component_charts(
    frames: dict, colors: dict, warnings: dict, components: list[str], smoothing: tuple[str, float], axes: dict
) -> None:
    """Each reward component's mean per step and its share of the advantage (which reward carries the signal),
    with the reward_signal alerts marked."""
    left, right = st.columns(2)
    with left:
        board.plot(
            charts.lines(frames, components, colors, "reward components", smoothing, "mean per response", **axes),
            "reward_components",
        )
        st.caption(
            "**reward:NAME**: the mean, over the step's responses it scored, of one reward component (a "
            "built-in's verdict, a user function's score or one of its named parts); the reward is their "
            "weighted sum (docs/rewards.md)"
        )
    signal = component_columns(frames, "signal:")
    if signal:
        with right:
            fig = charts.lines(
                frames, signal, colors, "which reward carries the signal", smoothing, "share of the advantage", **axes
            )
            board.plot(
                charts.mark_warnings(fig, frames, colors, warnings, signal, axes["x"], chart="signal"), "reward_signal"
            )
            st.caption(
                "**signal:NAME**: the reward component's share of the step's advantage mass (each group's "
                "sum of |advantage| split by the components' share of its reward spread); a component near 1 "
                "while the task's reward sits at 0 is a reward being hacked (docs/metrics.md)"
            )


def marked(fig, frames: dict, colors: dict, warnings: dict, metrics: list[str], x: str):
    """`fig` with the alerts that belong on the chart of `metrics[0]` marked (core.alert_levels.ALERT_CHARTS)."""
    return charts.mark_warnings(fig, frames, colors, warnings, metrics, x, chart=metrics[0])


def update_charts(frames: dict, colors: dict, warnings: dict, smoothing: tuple[str, float], axes: dict) -> None:
    """What the updates did: clip fractions, the entropy change of each regime's responses (--log-entropy-delta)
    and the change each regime's update caused (--log-entropy-attribution), or a line that says how to measure
    them; and, where the engine returned its log-probs, how far the sampler's numbers were from the trainer's."""
    _clip_and_entropy_change_row(frames, colors, smoothing, axes)
    _attribution_row(frames, smoothing, axes)
    _mismatch_row(frames, colors, warnings, smoothing, axes)


def _clip_and_entropy_change_row(frames: dict, colors: dict, smoothing: tuple[str, float], axes: dict) -> None:
    """Clip fractions; beside them the entropy change of each regime's responses (--log-entropy-delta)."""
    left, right = st.columns(2)
    with left:
        chart(
            charts.lines(
                frames,
                ["clip_frac_low", "clip_frac_high"],
                colors,
                "clip fractions",
                smoothing,
                "fraction of tokens",
                **axes,
            ),
            "clip_frac",
            ["clip_frac_low", "clip_frac_high"],
        )
    with right:
        if any("dH" in frame and frame["dH"].notna().any() for frame in frames.values()):
            # what each regime's responses did under the whole step's update; which regime caused it: the
            # attribution chart (--log-entropy-attribution)
            chart(
                attribution.chart(
                    frames,
                    ["dH_easy", "dH_hard", "dH"],
                    "entropy change of each regime's responses, whole update",
                    smoothing,
                    axes["x"],
                ),
                "entropy_delta",
                ["dH_easy", "dH_hard", "dH"],
            )
        else:
            st.caption(
                "Entropy change per regime (dH_easy, dH_hard): not measured in these runs. Train with "
                "--log-entropy-delta (on in `qae sweep`)."
            )


def _attribution_row(frames: dict, smoothing: tuple[str, float], axes: dict) -> None:
    """The entropy change each regime's update caused (--log-entropy-attribution), or how to measure it."""
    if any("dH_from_none" in frame and frame["dH_from_none"].notna().any() for frame in frames.values()):
        left, right = st.columns(2)
        with left:
            # QAE, Prop. 4.2 predicts from_easy > from_none > from_hard (in the metrics' definitions below)
            chart(
                attribution.chart(
                    frames,
                    list(ATTRIBUTION_SOURCES),
                    "entropy change caused by one regime's update alone",
                    smoothing,
                    axes["x"],
                ),
                "entropy_attribution",
                list(ATTRIBUTION_SOURCES),
            )
        with right:
            chart(
                attribution.chart(
                    frames,
                    list(ATTRIBUTION_MATRIX),
                    "which regime's update moved which regime's responses",
                    smoothing,
                    axes["x"],
                ),
                "entropy_attribution_matrix",
                list(ATTRIBUTION_MATRIX),
            )
    else:
        st.caption(
            "Entropy change caused by each regime's update (dH_from_hard, dH_from_easy): not measured in "
            "these runs. Train with --log-entropy-attribution."
        )


def _mismatch_row(frames: dict, colors: dict, warnings: dict, smoothing: tuple[str, float], axes: dict) -> None:
    """Where the engine returned its log-probs: how far the sampler's numbers were from the trainer's, with the
    mismatch alerts marked."""
    if any("mismatch_k3_kl" in frame and frame["mismatch_k3_kl"].notna().any() for frame in frames.values()):
        # the sampler's numbers against the trainer's (--rollout-dtype, vLLM; --rollout-correction tis corrects)
        left, right = st.columns(2)
        with left:
            chart(
                marked(
                    charts.lines(
                        frames,
                        ["mismatch_logp_abs", "mismatch_k3_kl"],
                        colors,
                        "sampler-trainer mismatch",
                        smoothing,
                        "nats / token",
                        **axes,
                    ),
                    frames,
                    colors,
                    warnings,
                    ["mismatch_k3_kl"],
                    axes["x"],
                ),
                "mismatch",
                ["mismatch_logp_abs", "mismatch_k3_kl"],
            )
        with right:
            chart(
                charts.lines(
                    frames, ["mismatch_ratio_max"], colors, "largest pi_old / pi_sampler", smoothing, "ratio", **axes
                ),
                "mismatch_ratio_max",
                ["mismatch_ratio_max"],
            )


run_ids = board.start_page("Training curves")
# controls in rows of two, so none is clipped on a 1024 px screen with the sidebar open
top = st.columns(2)
method = top[0].segmented_control(
    "Smoothing",
    charts.SMOOTHING_METHODS,
    key="smooth",
    default="ema",
    bind="query-params",
    required=True,
    help="ema: exponential moving average (the raw curve stays faint below); rolling: mean over a window of steps.",
)
if method == "ema":
    amount = top[1].slider("EMA weight on the past", 0.0, 0.99, 0.6, 0.01, key="ema", bind="query-params")
elif method == "rolling":
    amount = top[1].slider("Window (steps)", 1, 100, 10, key="window", bind="query-params")
else:
    amount = 0.0
bottom = st.columns(2)
x_axis = bottom[0].segmented_control(
    "x axis",
    list(charts.X_AXES),
    key="x",
    default="step",
    bind="query-params",
    required=True,
    help="step; wall time: hours from the run's start to each step's commit "
    "(pauses and resumes included); tokens: response tokens generated so far",
)
log_y = bottom[1].toggle("log y", key="log", bind="query-params", help="Logarithmic y axes (zeros are not drawn).")
other = st.multiselect(
    "More metrics",
    [m for m in STEP_METRICS if m not in charts.TIME_METRICS],
    default=OTHER_DEFAULT,
    key="other",
    bind="query-params",
    help="Any other column of the steps table.",
)
grouping_row = st.columns([1, 2, 1.3])
group_on = grouping_row[0].toggle(
    "Group runs",
    key="group",
    bind="query-params",
    help="One mean curve and band per group of runs (same config but the seed, or the keys picked), as W&B's grouping.",
)
group_by = None
if group_on:
    picked_configs = {
        run_id: board.grouping_config(view.run) for run_id in run_ids if (view := board.run_view(run_id)) is not None
    }
    group_by = grouping_row[1].multiselect(
        "Group by",
        grouping.config_keys(picked_configs),
        key="group_by",
        bind="query-params",
        accept_new_options=True,
        placeholder="everything but the seed",
        help="Config keys whose values make a group (the keys that differ "
        "between the picked runs are listed first), or tags: the runs' "
        "`qae tag` tags (runs with the same tags form a group). None: runs "
        "that differ only in seed (and bookkeeping) form a group, as on "
        "Compare.",
    )
    band_choice = grouping_row[2].segmented_control(
        "Band",
        list(charts.SEED_BANDS),
        key="band",
        default="auto",
        bind="query-params",
        required=True,
        help="; ".join(f"{k}: {v}" for k, v in charts.SEED_BANDS.items()),
    )
body(run_ids, (method, amount), x_axis, log_y, other, group_by, band_choice if group_on else "auto")
