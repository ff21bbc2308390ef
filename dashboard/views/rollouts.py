"""Rollouts: the groups of one step (prompt, answer, success count, baseline, regime), their responses, and why each
gated response was gated, with the step's breakdown by reason.

Model text is data, never markup: prompts and responses are shown with st.code / st.text and in dataframe cells.
"""

import math
from functools import partial

import pandas as pd
import streamlit as st

import board
import charts
from qae_app.names import GATE_REASONS, REGIMES

GROUPS_PER_PAGE = 10
ROW_PX, MAX_TABLE_PX = 35, 610  # a group's table shows up to ~16 responses without scrolling
GATED_CHOICES = {"all": None, "gated": True, "kept": False}
REGIME_BADGE = {"hard": "red", "easy": "green", "all_correct": "blue", "all_wrong": "gray", "mixed": "violet"}
RESPONSE_COLUMNS = {
    "sample_idx": st.column_config.NumberColumn("sample", width="small"),
    "status": st.column_config.TextColumn("gated", width="small",
                                          help="gated: advantage exactly 0, no policy gradient from this response"),
    "gate_reason": st.column_config.TextColumn("why gated", width="medium",
                                               help="; ".join(f"{k}: {v}" for k, v in GATE_REASONS.items())),
    "reward": st.column_config.NumberColumn("reward", format="%.2f", width="small"),
    "advantage": st.column_config.NumberColumn("advantage", format="%+.3f", width="small"),
    "response": st.column_config.TextColumn("response (click a row to open it)", width="large"),
    "n_tokens": st.column_config.NumberColumn("tokens", width="small"),
    "truncated": st.column_config.CheckboxColumn("truncated", width="small"),
    "entropy": st.column_config.NumberColumn("entropy", format="%.3f", width="small"),
}


def step_slider(steps: list[int]) -> int:
    """Step picker bound to `?step=`; it follows the newest step while the user is on the newest step. A step in the
    link that has no rollouts opens the nearest one that has, and says so."""
    latest, seen = steps[-1], st.session_state.get("_latest_step")
    requested = st.query_params.get("step")
    if requested is not None and requested not in {str(s) for s in steps}:
        try:
            target = min(steps, key=lambda s: (abs(s - int(requested)), -s))
        except ValueError:
            target = latest
        st.session_state["_step_note"] = (f"Step {requested} from the link has no rollouts; showing step {target}, "
                                          f"the nearest (steps {steps[0]}..{latest}).")
        board.seed("step", target)
    elif "step" not in st.session_state and requested is None:
        board.seed("step", latest)
    elif "step" in st.session_state and (st.session_state["step"] not in steps or st.session_state["step"] == seen):
        st.session_state["step"] = latest
    st.session_state["_latest_step"] = latest
    if st.session_state.get("_step_note"):
        st.caption(st.session_state["_step_note"])
    if len(steps) == 1:
        st.caption(f"step {latest} (the only step with rollouts so far)")
        return latest
    return st.select_slider("Step", steps, key="step", bind="query-params", on_change=_clear_step_note,
                            help="Stays on the newest step while you are on it; pick an older one to stay there.")


def _clear_step_note() -> None:
    st.session_state.pop("_step_note", None)


def styled(responses: pd.DataFrame):
    """Responses of one group with the gated ones greyed out."""
    frame = responses.assign(status=responses["gated"].map({True: "⊘ gated", False: "✓ kept"}),
                             gate_reason=responses["gate_reason"].fillna(""))
    frame = frame[list(RESPONSE_COLUMNS)].reset_index(drop=True)
    grey = "color: #8a8a8a; background-color: #f2f2f2"
    return frame.style.apply(lambda row: [grey if row["status"] == "⊘ gated" else ""] * len(row), axis=1)


def open_row(table_key: str, select_key: str, samples: list[int]) -> None:
    """Clicking a cell (or a row's checkbox) of a group's table opens that response (sets the group's 'open' box)."""
    selection = st.session_state[table_key]["selection"]
    rows = list(selection.get("rows", [])) + [cell[0] for cell in selection.get("cells", [])]
    st.session_state[select_key] = samples[rows[0]] if rows else None


def group(step: int, rows: pd.DataFrame) -> None:
    first = rows.iloc[0]
    g, regime = int(first["group_idx"]), str(first["regime"])
    with st.container(border=True):
        badge = f":{REGIME_BADGE[regime]}-badge[{regime}]" if regime in REGIME_BADGE else ""
        n_gated = int(rows["gated"].sum())
        st.markdown(f"**Group {g}** {badge} · **{int(first['n_correct'])}/{int(first['group_size'])}** correct · "
                    f"baseline **{first['baseline']:.3g}** · {n_gated} of {len(rows)} shown gated")
        board.show_prompt_and_answer(first["prompt"], first["answer"])
        samples = [int(s) for s in rows["sample_idx"]]
        table_key, select_key = f"table_{step}_{g}", f"open_{step}_{g}"
        st.dataframe(styled(rows), hide_index=True, column_config=RESPONSE_COLUMNS, key=table_key,
                     height=min(ROW_PX * (len(rows) + 1) + 8, MAX_TABLE_PX),
                     on_select=partial(open_row, table_key, select_key, samples),
                     selection_mode=["single-row", "single-cell"], placeholder="")
        by_sample = rows.set_index("sample_idx")
        chosen = st.selectbox("Open a response in full", [None, *samples], key=select_key,
                              format_func=lambda s: "—" if s is None else (
                                  f"sample {s} · reward {by_sample.at[s, 'reward']:.2f} · "
                                  f"advantage {by_sample.at[s, 'advantage']:+.3f}"
                                  + (" · gated" if by_sample.at[s, 'gated'] else "")))
        if chosen is not None:
            row = by_sample.loc[chosen]
            st.code(row["response"], language=None, wrap_lines=True)
            st.caption(f"{int(row['n_tokens'])} tokens" + (" · truncated at max_new_tokens" if row["truncated"]
                                                             else "") + f" · entropy {row['entropy']:.3f}"
                       + (f" · gated: {GATE_REASONS[row['gate_reason']]}" if row["gated"] else ""))


def gate_summary(run_id: str, step: int, everything: pd.DataFrame) -> None:
    """Why this step's gated responses were gated (a table), and the same over every step (a chart)."""
    gated = everything[everything["gated"]]
    counts = gated["gate_reason"].value_counts()
    table = pd.DataFrame({"why gated": list(GATE_REASONS), "responses": [int(counts.get(r, 0)) for r in GATE_REASONS],
                          "meaning": list(GATE_REASONS.values())})
    table["share of the step"] = table["responses"] / max(len(everything), 1)
    st.markdown(f"**Why gated** at step {step}: " + (" · ".join(
        f"{n} {reason.replace('_', ' ')}" for reason, n in zip(table["why gated"], table["responses"]) if n)
        or "none gated"))
    with st.expander("The breakdown, with what each reason means, and over every step", expanded=False):
        st.dataframe(table[table["responses"] > 0], hide_index=True, key="gate_table",
                     column_config={"share of the step": st.column_config.NumberColumn(format="percent")},
                     placeholder="")
        breakdown = board.read("read_gate_breakdown", run_id)
        totals = board.read("read_step_tokens", run_id)
        if breakdown is not None and totals is not None:
            board.plot(charts.gate_breakdown(breakdown, totals, step), "gate_breakdown")


def reward_label(reward: str) -> str:
    return reward if reward == "any" else f"reward {reward}"


def body(run_id: str) -> None:
    steps = board.rollout_steps(run_id)
    if not steps:
        st.info("No rollouts written yet: the first step's groups appear here when the trainer finishes it.")
        return
    step = step_slider(steps)
    everything = board.rollouts(run_id, step)
    if everything is None:
        return
    filters = st.columns([1.1, 1.6, 0.8, 1.5])
    regime = filters[0].selectbox("Regime", ["any", *REGIMES], key="regime", bind="query-params")
    gated = filters[1].segmented_control("Responses", list(GATED_CHOICES), key="gated", default="all",
                                         bind="query-params", required=True)
    rewards = [f"{r:g}" for r in sorted(everything["reward"].dropna().unique().tolist())]
    reward = filters[2].selectbox("Reward", ["any", *rewards], key="reward", bind="query-params")
    reason = filters[3].selectbox("Why gated", ["any", *GATE_REASONS], key="why", bind="query-params",
                                  help="; ".join(f"{k}: {v}" for k, v in GATE_REASONS.items()))
    search = st.text_input("Search prompts and responses", key="search", bind="query-params",
                           placeholder="plain text, case-insensitive")
    shown = board.rollouts(run_id, step, gated=GATED_CHOICES[gated], regime=None if regime == "any" else regime,
                           reward=None if reward == "any" else float(reward), search=search)
    if shown is None:
        return
    if reason != "any":
        shown = shown[shown["gate_reason"] == reason]
    n_groups = everything["group_idx"].nunique()
    summary = st.columns(4)
    summary[0].metric("responses shown", f"{len(shown)} / {len(everything)}")
    summary[1].metric("gated (advantage 0)", f"{int(everything['gated'].sum())} / {len(everything)}",
                      help="over the whole step, before filters")
    summary[2].metric("groups shown", f"{shown['group_idx'].nunique()} / {n_groups}")
    summary[3].metric("accuracy", f"{everything['reward'].eq(1).mean():.3f}")
    gate_summary(run_id, step, everything)
    if shown.empty:
        st.info("No response of this step matches the filters.")
        return
    group_ids = list(dict.fromkeys(shown["group_idx"]))
    pages = math.ceil(len(group_ids) / GROUPS_PER_PAGE)
    page = 1
    if pages > 1:
        st.caption(f"{len(group_ids)} groups, {GROUPS_PER_PAGE} a page")
        if st.session_state.get("page", 1) > pages:
            st.session_state["page"] = pages
        page = st.pagination(pages, key="page", bind="query-params")
    for g in group_ids[(page - 1) * GROUPS_PER_PAGE: page * GROUPS_PER_PAGE]:
        group(step, shown[shown["group_idx"] == g])


st.header("Rollouts")
run = board.pick_one_run()
if run is None:
    st.stop()
body(run)
