"""Eval samples: what the model answered in each evaluation (response, extracted answer, correct or not), and each
problem's result across the evaluated checkpoints.

Model text is data, never markup: responses and answers are shown in dataframe cells and with st.code.
"""

from functools import partial

import board
import charts
import pandas as pd
import streamlit as st

from qae_app.store.reader import read_eval_checkpoints, read_eval_problem_grid, read_eval_samples

CORRECT_CHOICES = {"all": None, "correct": True, "wrong": False}
SAMPLE_COLUMNS = {
    "problem_id": st.column_config.TextColumn("problem"),
    "sample_idx": st.column_config.NumberColumn("sample", width="small"),
    "correct": st.column_config.CheckboxColumn("correct", width="small"),
    "verified": st.column_config.CheckboxColumn(
        "verified", width="small", help="False: the verifier timed out (scored as wrong)"
    ),
    "extracted": st.column_config.TextColumn("extracted answer", width="medium"),
    "answer": st.column_config.TextColumn(
        "gold answer",
        width="medium",
        help="The problem's answer the extracted one was checked against (empty "
        "for an evaluation stored before qae kept it)",
    ),
    "response": st.column_config.TextColumn("response (click a row to open it)", width="large"),
    "n_tokens": st.column_config.NumberColumn("tokens", width="small"),
}


def open_sample(samples: pd.DataFrame, where: tuple) -> None:
    """Clicking a cell (or a row's checkbox) opens that sample below the table (for this benchmark and step)."""
    selection = st.session_state["eval_samples_table"]["selection"]
    rows = list(selection.get("rows", [])) + [cell[0] for cell in selection.get("cells", [])]
    st.session_state["_open_sample"] = (where, samples.iloc[rows[0]].to_dict()) if rows else None


def body(run_id: str) -> None:
    checkpoints = board.read(read_eval_checkpoints, run_id)
    if checkpoints is None:
        return
    if checkpoints.empty:
        st.info(
            "No evaluation samples stored for this run. Train with `--eval-every N`, or run `qae eval --model "
            f"{run_id}`; every sampled answer is stored and shown here."
        )
        return
    names = board.eval_choices(checkpoints)  # as Evaluations lists them, opening on the same one
    cols = st.columns([2, 3])
    name = cols[0].selectbox("Benchmark", list(names), key="benchmark", bind="query-params")
    benchmark, source = names[name]
    part = checkpoints[(checkpoints["benchmark"] == benchmark) & (checkpoints["source"] == source)]
    steps = [int(s) for s in part["step"]]
    requested = st.query_params.get("step")
    if requested not in {str(s) for s in steps} and (requested is not None or "step" not in st.session_state):
        board.seed("step", steps[-1])  # first visit, or a step not evaluated: the newest evaluation
    with cols[1]:
        step = (
            steps[0]
            if len(steps) == 1
            else st.select_slider("Evaluated at step", steps, key="step", bind="query-params")
        )
    _step_summary(part[part["step"] == step].iloc[0])
    grid = _problem_grid(run_id, benchmark, source, step, len(steps))
    if _samples_table(run_id, name, benchmark, source, step, grid):
        _opened_sample(run_id, name, step)


def _step_summary(row: pd.Series) -> None:
    """The evaluation's accuracy over all samples, and how many problems and samples it had."""
    summary = st.columns(3)
    summary[0].metric("accuracy (all samples)", f"{row['accuracy']:.3f}")
    summary[1].metric("problems", int(row["n_problems"]))
    summary[2].metric("samples", int(row["n_samples"]))


def _problem_grid(run_id: str, benchmark: str, source: str, step: int, n_steps: int) -> pd.DataFrame | None:
    """How many problems were solved at `step` by one sample and by every sample, and each problem across the
    evaluated checkpoints (open by default when there are several); the grid, or None where it cannot be read."""
    grid = board.read(read_eval_problem_grid, run_id, benchmark, source)
    if grid is not None and not grid.empty:
        at_step = grid[grid["step"] == step]
        solved = int((at_step["n_correct"] > 0).sum())
        st.caption(
            f"At step {step}: {solved} of {len(at_step)} problems solved by at least one sample, "
            f"{int((at_step['n_correct'] == at_step['n_samples']).sum())} by every sample."
        )
        with st.expander("Each problem across the evaluated checkpoints", expanded=n_steps > 1):
            board.plot(charts.eval_problem_grid(grid, f"{benchmark}: fraction of samples correct"), "eval_grid")
    return grid


def _samples_table(run_id: str, name: str, benchmark: str, source: str, step: int, grid: pd.DataFrame | None) -> bool:
    """The samples at `step` that match the filters (correct or wrong, a problem, a search), one a row; a row
    picked opens the sample below. False where they cannot be read (board.read said why)."""
    filters = st.columns([1.4, 2, 2])
    correct = filters[0].segmented_control(
        "Samples", list(CORRECT_CHOICES), key="correct", default="all", bind="query-params", required=True
    )
    problems = sorted(grid.loc[grid["step"] == step, "problem_id"].unique()) if grid is not None else []
    problem = filters[1].selectbox("Problem", ["any", *problems], key="problem", bind="query-params")
    search = filters[2].text_input(
        "Search responses and answers",
        key="eval_search",
        bind="query-params",
        placeholder="plain text, case-insensitive",
    )
    samples = board.read(
        read_eval_samples,
        run_id,
        benchmark,
        source,
        step,
        CORRECT_CHOICES[correct],
        None if problem == "any" else problem,
        search or None,
    )
    if samples is None:
        return False
    st.caption(f"{len(samples)} samples match")
    st.dataframe(
        samples[list(SAMPLE_COLUMNS)],
        hide_index=True,
        column_config=SAMPLE_COLUMNS,
        key="eval_samples_table",
        on_select=partial(open_sample, samples, (run_id, name, step)),
        selection_mode=["single-row", "single-cell"],
        placeholder="",
    )
    return True


def _opened_sample(run_id: str, name: str, step: int) -> None:
    """The sample picked in the table (of this run, benchmark and step): its extracted and gold answers and its
    response, whole."""
    where, opened = st.session_state.get("_open_sample") or (None, None)
    if opened is not None and where == (run_id, name, step):
        st.caption(
            f"problem {board.literal(opened['problem_id'])} · sample {opened['sample_idx']} · "
            + ("correct" if opened["correct"] else "wrong")
            + " · extracted answer, then the gold answer:"
        )
        st.code(str(opened["extracted"]), language=None, wrap_lines=True)
        st.code(
            "not stored (an evaluation from before qae kept it)"
            if pd.isna(opened.get("answer"))
            else str(opened["answer"]),
            language=None,
            wrap_lines=True,
        )
        st.code(str(opened["response"]), language=None, wrap_lines=True)


[run] = board.start_page("Eval samples", one_run=True)
body(run)
