"""Prompt history: how one prompt's success rate and regime move over the steps it was sampled, its responses at each
of those steps side by side for every picked run, the most-sampled prompts as a heatmap and the regime mix of every
step.

Model text is data, never markup: prompts and responses are shown with st.code and in dataframe cells.
"""

import board
import charts
import pandas as pd
import streamlit as st

from qae_app.store.reader import read_prompt_histories, read_prompt_rollouts, read_prompts, read_regime_counts

HEATMAP_PROMPTS = 30
PROMPT_COLUMNS = {
    "prompt_id": st.column_config.TextColumn("prompt id"),
    "prompt": st.column_config.TextColumn("prompt", width="large"),
    "answer": st.column_config.TextColumn("answer"),
    "times_sampled": st.column_config.NumberColumn("sampled", help="steps at which the prompt was in the batch"),
    "first_step": st.column_config.NumberColumn("first step"),
    "last_step": st.column_config.NumberColumn("last step"),
    "first_success": st.column_config.ProgressColumn("first success", min_value=0.0, max_value=1.0, format="%.2f"),
    "last_success": st.column_config.ProgressColumn("last success", min_value=0.0, max_value=1.0, format="%.2f"),
    "first_regime": st.column_config.TextColumn("first regime"),
    "last_regime": st.column_config.TextColumn("last regime"),
}


def pick_prompt(prompts: pd.DataFrame) -> str:
    """Prompt picker bound to `?prompt=`; default: the most-sampled prompt (ties: the most recent)."""
    ids = [str(p) for p in prompts["prompt_id"]]
    if st.session_state.get("prompt") not in ids and ("prompt" in st.session_state or "prompt" not in st.query_params):
        st.session_state["prompt"] = ids[0]
    return st.selectbox(
        "Prompt",
        ids,
        key="prompt",
        bind="query-params",
        help="Sorted by how often the prompt was sampled. Type to search prompt ids.",
    )


SIDE_BY_SIDE_STEPS = 8  # samplings of the prompt shown per run (the most recent)
SAMPLE_COLUMNS = {
    "sample_idx": st.column_config.NumberColumn("sample", width="small"),
    "reward": st.column_config.NumberColumn("reward", format="%.2f", width="small"),
    "advantage": st.column_config.NumberColumn("advantage", format="%+.3f", width="small"),
    "gate_reason": st.column_config.TextColumn("why gated", width="medium"),
    "response": st.column_config.TextColumn("response", width="large"),
}


def side_by_side(prompt_id: str, run_ids: list[str]) -> None:
    """The prompt's responses at each step it was sampled, one column per picked run."""
    readable = {
        run_id: frame
        for run_id in run_ids
        if (frame := board.read(read_prompt_rollouts, run_id, prompt_id)) is not None
    }
    found = {run_id: frame for run_id, frame in readable.items() if not frame.empty}
    st.subheader("Its responses, step by step" + (" and run by run" if len(run_ids) > 1 else ""))
    absent = [run_id for run_id in readable if run_id not in found]  # (an unreadable run's note says why)
    if absent:
        st.caption(f"Never sampled in {', '.join(absent)}.")
    if not found:
        return
    columns = st.columns(len(found))
    for column, (run_id, frame) in zip(columns, found.items(), strict=True):
        with column:
            steps = list(dict.fromkeys(frame["step"]))
            st.markdown(
                f"**{run_id}** · sampled at {len(steps)} step(s)"
                + (f", the last {SIDE_BY_SIDE_STEPS} shown" if len(steps) > SIDE_BY_SIDE_STEPS else "")
            )
            for step in steps[-SIDE_BY_SIDE_STEPS:][::-1]:
                rows = frame[frame["step"] == step]
                first = rows.iloc[0]
                filtered = bool(board.filtered_rows(rows).iloc[0])  # as the Rollouts page: not trained, not gated
                outcome = f"{board.FILTERED_REASON} · not trained" if filtered else f"{int(rows['gated'].sum())} gated"
                st.caption(
                    f"step {step} · {int(first['n_correct'])}/{int(first['group_size'])} correct · "
                    f"{first['regime']} · baseline {first['baseline']:.3g} · {outcome}"
                )
                if filtered:
                    rows = rows.assign(gate_reason=board.FILTERED_REASON)
                st.dataframe(
                    rows[list(SAMPLE_COLUMNS)],
                    hide_index=True,
                    column_config=SAMPLE_COLUMNS,
                    key=f"side_{run_id}_{step}_{int(first['group_idx'])}",
                    placeholder="",
                )


def body(run_id: str) -> None:
    prompts = board.read(read_prompts, run_id)
    if prompts is None:
        return
    if prompts.empty:
        st.info("No groups written yet: prompts appear here when the trainer finishes its first step.")
        return
    view = board.run_view(run_id)
    k = view.run.get("k") if view is not None else None
    moved = prompts[(prompts["times_sampled"] > 1) & (prompts["first_regime"] != prompts["last_regime"])]
    st.caption(
        f"{len(prompts)} prompts sampled · {int((prompts['times_sampled'] > 1).sum())} more than once · "
        f"{len(moved)} changed regime between their first and last sampling"
    )
    prompt_id = pick_prompt(prompts)
    row = prompts.set_index("prompt_id").loc[prompt_id]
    board.show_prompt_and_answer(row["prompt"], row["answer"])
    history = board.read(read_prompt_histories, run_id, [prompt_id])
    if history is not None:
        cols = st.columns([2, 1])
        with cols[0]:
            board.plot(charts.prompt_history(history, k), "prompt_history")
        with cols[1]:
            st.dataframe(
                history[["step", "n_correct", "group_size", "baseline", "regime"]],
                hide_index=True,
                key="prompt_history_table",
                placeholder="",
            )
    side_by_side(prompt_id, board.shown_runs())
    with st.expander("All prompts", expanded=False):
        st.dataframe(
            prompts[list(PROMPT_COLUMNS)], hide_index=True, column_config=PROMPT_COLUMNS, key="prompts", placeholder=""
        )
    repeated = prompts[prompts["times_sampled"] > 1]
    if repeated.empty:
        st.caption(
            "No prompt has been sampled twice yet, so there is no history to compare across steps: prompts "
            "come back once the run has gone through the training set."
        )
    else:
        top = [str(p) for p in repeated["prompt_id"].head(HEATMAP_PROMPTS)]
        histories = board.read(read_prompt_histories, run_id, top)
        if histories is not None:
            board.plot(charts.prompt_heatmap(histories, top), "prompt_heatmap")
    counts = board.read(read_regime_counts, run_id)
    if counts is not None:
        board.plot(charts.regime_mix(counts), "regime_mix")


[run] = board.start_page("Prompt history", one_run=True)
body(run)
