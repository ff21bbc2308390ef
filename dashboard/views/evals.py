"""Evaluations: avg@k / pass@k / maj@k over training steps, per benchmark and subset, for the picked runs."""

import board
import charts
import pandas as pd
import streamlit as st

EMPTY = (
    "No evaluations recorded for the picked runs. Train with `--eval-every N` to evaluate on the held-out split "
    "(or `--eval-bench NAME`) every N steps; the results appear here."
)


def body(run_ids: list[str]) -> None:
    views = {run_id: view for run_id in run_ids if (view := board.run_view(run_id)) is not None}
    evals = {run_id: view.evals for run_id, view in views.items() if not view.evals.empty}
    if not evals:
        if views:  # (an unreadable run's note says why it shows nothing)
            st.info(EMPTY)
        return
    everything = pd.concat([frame.assign(run=run_id) for run_id, frame in evals.items()], ignore_index=True)
    # `qae eval` of a checkpoint is listed apart from the trainer's own --eval-every results (other k, limit)
    everything["benchmark"] = [
        board.eval_label(b, s) for b, s in zip(everything["benchmark"], everything["source"], strict=True)
    ]
    colors = board.run_colors(run_ids)  # the picked order, readable or not: a run keeps its color on every page
    benchmarks = list(board.eval_choices(pd.concat(evals.values())))
    first = next(iter(board.eval_choices(evals[run_ids[0]]))) if run_ids[0] in evals else benchmarks[0]
    cols = st.columns(2)
    # opens where Eval samples opens for the first picked run (the one it shows)
    benchmark = cols[0].selectbox(
        "Benchmark", benchmarks, index=benchmarks.index(first), key="benchmark", bind="query-params"
    )
    subsets = sorted(
        everything.loc[everything["benchmark"] == benchmark, "subset"].unique(), key=lambda s: (s != "all", s)
    )
    subset = cols[1].selectbox(
        "Subset", subsets, key="subset", bind="query-params", help="'all', or one subject / level of the benchmark"
    )
    part = everything[(everything["benchmark"] == benchmark) & (everything["subset"] == subset)]
    frames = {run_id: part[part["run"] == run_id] for run_id in evals}
    board.plot(charts.evals(frames, colors, f"{benchmark} · {subset}"), "evals_chart")
    # the newest row of each (run, metric, k) whole: .last() would take each column's last non-missing value
    latest = part.sort_values("step").groupby(["run", "metric", "k"]).tail(1).sort_values(["run", "metric", "k"])
    st.caption("latest value of each metric")
    st.dataframe(
        latest[["run", "step", "metric", "k", "value", "n_problems"]],
        hide_index=True,
        key="evals_latest",
        column_config={"value": st.column_config.NumberColumn(format="%.3f")},
        placeholder="",
    )
    with st.expander("every evaluation row"):
        st.dataframe(
            everything[["run", "step", "benchmark", "subset", "metric", "k", "value", "n_problems"]],
            hide_index=True,
            key="evals_all",
            placeholder="",
        )


run_ids = board.start_page(
    "Evaluations",
    "avg@k: mean accuracy of k samples · pass@k: some sample correct · maj@k: the most common answer correct",
)
body(run_ids)
