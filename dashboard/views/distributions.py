"""Distributions: advantage, reward, response length and entropy over each step's responses, as quantile bands over
the steps and as a histogram of one step, for the picked runs overlaid."""

import board
import charts
import streamlit as st

from qae_app.store.reader import DISTRIBUTION_COLUMNS, QUANTILES, read_quantiles


def body(run_ids: list[str], column: str, log_y: bool) -> None:
    label = DISTRIBUTION_COLUMNS[column]
    readable = {run_id: q for run_id in run_ids if (q := board.read(read_quantiles, run_id, column)) is not None}
    quantiles = {run_id: q for run_id, q in readable.items() if not q.empty}
    if not quantiles:
        if readable:  # (an unreadable run's note says why it shows nothing)
            st.info("No rollouts written yet: distributions appear here when the trainer finishes its first step.")
        return
    colors = board.run_colors(run_ids)
    steps = sorted({int(s) for q in quantiles.values() for s in q["step"]})
    step = board.step_slider(steps, "Step of the histogram", what="rollouts")
    left, right = st.columns([3, 2])
    with left:
        bands = "-".join(f"{q:.0%}" for q in (QUANTILES[0], QUANTILES[-1]))
        board.plot(
            charts.quantile_bands(quantiles, colors, f"{label} over each step's responses", label, step, log_y),
            "quantile_bands",
        )
        st.caption(
            f"Line: median over the step's responses; dark band: 25-75%; light band: {bands}. Hover for the "
            "values and the mean."
        )
    with right:
        values = {}
        for run_id in quantiles:
            frame = board.rollouts(run_id, step, with_text=False)
            if frame is not None and not frame.empty:
                values[run_id] = frame[column]
        if values:
            board.plot(charts.histogram(values, colors, f"{label} at step {step}", label), "histogram")
            st.caption(
                " · ".join(
                    f"{run_id}: {len(v)} responses, mean {v.mean():.4g}, median {v.median():.4g}"
                    for run_id, v in values.items()
                )
            )
        else:
            st.caption(f"No picked run has responses at step {step}.")


run_ids = board.start_page("Distributions")
controls = st.columns([4, 1])
quantity = controls[0].segmented_control(
    "Quantity",
    list(DISTRIBUTION_COLUMNS),
    key="quantity",
    default="advantage",
    bind="query-params",
    required=True,
    help="; ".join(f"{k}: {v}" for k, v in DISTRIBUTION_COLUMNS.items()),
)
log_y = controls[1].toggle("log y", key="log", bind="query-params")
body(run_ids, quantity, log_y)
