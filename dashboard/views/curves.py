"""Training curves of the picked runs, overlaid, growing live while a run trains."""

import pandas as pd
import streamlit as st

import board
import charts
from qae_app import names
from qae_app.store import STEP_METRICS

OTHER_DEFAULT = ["loss", "grad_norm", "adv_abs_mean"]


def chart(fig, key: str, metrics: list[str]) -> None:
    st.plotly_chart(fig, key=key, config={"displaylogo": False})
    st.caption(" · ".join(f"**{metric}**: {STEP_METRICS[metric]}" for metric in metrics if metric in STEP_METRICS))


def body(run_ids: list[str], smoothing: tuple[str, float], other: list[str]) -> None:
    views = {run_id: view for run_id in run_ids if (view := board.run_view(run_id)) is not None}
    if not views:
        return
    st.text("   ".join(board.progress_line(view) for view in views.values()))
    frames = {run_id: view.steps for run_id, view in views.items()}
    if all(frame.empty for frame in frames.values()):
        st.info("No step written yet: the first step appears here when the trainer finishes it.")
        return
    colors = board.run_colors(list(views))
    bands = {}  # the band each run's trainer watched: its options, or relative to its first step's entropy
    for run_id, view in views.items():
        cfg = board.run_config(view.run)
        start = view.steps["entropy"].dropna().iloc[0] if view.steps["entropy"].notna().any() else None
        band = names.entropy_band(cfg.get("entropy_low"), cfg.get("entropy_high"), start)
        if band is not None:
            bands[run_id] = band
    warnings = {run_id: view.warnings for run_id, view in views.items()}

    left, right = st.columns(2)
    with left:
        chart(charts.entropy(frames, colors, bands, warnings, smoothing), "entropy", ["entropy"])
        recorded = pd.concat([w.assign(run=run_id) for run_id, w in warnings.items()], ignore_index=True)
        if not recorded.empty:
            with st.expander(f"{len(recorded)} recorded warning(s)"):
                st.dataframe(recorded[["run", "step", "kind", "message"]], hide_index=True)
    with right:
        chart(charts.accuracy(frames, colors, smoothing), "accuracy", ["accuracy", "reward_mean", "heldout_accuracy"])
    left, right = st.columns(2)
    with left:
        chart(charts.lines(frames, ["frac_zero_adv"], colors, "zero-advantage (gated) fraction", smoothing),
              "frac_zero_adv", ["frac_zero_adv"])
    with right:
        chart(charts.regimes(frames, smoothing), "regimes", list(charts.REGIME_METRICS))
    left, right = st.columns(2)
    with left:
        chart(charts.lines(frames, ["cov_logp_adv"], colors, "covariance of log-prob and advantage", smoothing),
              "cov_logp_adv", ["cov_logp_adv"])
    with right:
        chart(charts.lines(frames, ["entropy_pos", "entropy_neg"], colors, "entropy of positive vs negative "
                           "responses", smoothing, "nats / token"), "entropy_split", ["entropy_pos", "entropy_neg"])
    left, right = st.columns(2)
    with left:
        chart(charts.lines(frames, ["response_len"], colors, "response length", smoothing, "tokens"),
              "response_len", ["response_len"])
    with right:
        chart(charts.lines(frames, ["clip_frac_low", "clip_frac_high"], colors, "clip fractions", smoothing),
              "clip_frac", ["clip_frac_low", "clip_frac_high"])
    chart(charts.step_time(frames, smoothing), "step_time", list(charts.TIME_METRICS))
    columns = st.columns(2)
    for i, metric in enumerate(other):
        with columns[i % 2]:
            chart(charts.lines(frames, [metric], colors, metric, smoothing), f"other_{metric}", [metric])


st.header("Training curves")
run_ids = board.shown_runs()
if not run_ids:
    st.info("Pick one or more runs in the sidebar.")
    st.stop()
controls = st.columns([1.4, 2, 3])
method = controls[0].segmented_control("Smoothing", charts.SMOOTHING_METHODS, key="smooth", default="ema",
                                       bind="query-params", required=True,
                                       help="ema: exponential moving average (the raw curve stays faint below); "
                                            "rolling: mean over a window of steps.")
if method == "ema":
    amount = controls[1].slider("EMA weight on the past", 0.0, 0.99, 0.6, 0.01, key="ema", persist_state="session")
elif method == "rolling":
    amount = controls[1].slider("Window (steps)", 1, 100, 10, key="window", persist_state="session")
else:
    amount = 0.0
other = controls[2].multiselect("More metrics", [m for m in STEP_METRICS if m not in charts.TIME_METRICS],
                                default=OTHER_DEFAULT, key="other", persist_state="session",
                                format_func=lambda m: m, help="Any other column of the steps table.")
board.live(lambda: body(run_ids, (method, amount), other), run_ids, board.runs())
