"""Rollouts: the groups of one step (prompt, answer, success count, baseline, regime), their responses, and why each
gated response was gated, with the step's breakdown by reason. A group that dynamic sampling left out of the update
is "filtered": none of its responses is trained, whatever its advantages, so it is neither gated nor kept, and the
step's gated count is over the trained responses (as frac_zero_adv). To find a hacked reward: filter by reward
component values (one_word = 1 and antonym = 0), order by entropy or by the sampler/trainer mismatch, and open a
response to see its tokens coloured by their numbers (tokens.py).

Model text is data, never markup: prompts and responses are shown with st.code / st.text and in dataframe cells, and
the token view escapes every token before it is markup.
"""

import math
from functools import partial

import board
import charts
import pandas as pd
import streamlit as st
import token_markup

from qae_app.core.names import GATE_REASONS, REGIMES
from qae_app.store.reader import read_components, read_gate_breakdown, read_model_prompts, read_step_tokens
from qae_app.store.signal_reader import read_response_mismatch, read_token_values
from qae_app.store.tokens import COLOR_SCALES, token_numbers

GROUPS_PER_PAGE = 10
ROW_PX, MAX_TABLE_PX = 35, 610  # a group's table shows up to ~16 responses without scrolling
# the Responses control -> (gated, filtered) for read_rollouts: gated and kept are of the trained groups
GATED_CHOICES = {"all": (None, None), "gated": (True, False), "kept": (False, False), "filtered": (None, True)}
STATUS = {"kept": "✓ kept", "gated": "⊘ gated", "filtered": "⊘ filtered"}
# rows without a gradient: grey text on the page's own background, so they read dimmer than the kept rows in the light
# and the dark theme alike (a light background made them the brightest rows in dark mode)
DIMMED = "color: #8a8a8a"
REGIME_BADGE = {"hard": "red", "easy": "green", "all_correct": "blue", "all_wrong": "gray", "mixed": "violet"}
RESPONSE_COLUMNS = {
    "sample_idx": st.column_config.NumberColumn("sample", width="small"),
    "status": st.column_config.TextColumn(
        "gated",
        width="small",
        help="gated: advantage exactly 0, no policy gradient from this response; "
        "filtered: its group was left out of the update by dynamic sampling",
    ),
    "gate_reason": st.column_config.TextColumn(
        "why gated", width="medium", help="; ".join(f"{k}: {v}" for k, v in GATE_REASONS.items())
    ),
    "reward": st.column_config.NumberColumn("reward", format="%.2f", width="small"),
    "advantage": st.column_config.NumberColumn("advantage", format="%+.3f", width="small"),
    "response": st.column_config.TextColumn("response (click a row to open it)", width="large"),
    "n_tokens": st.column_config.NumberColumn("tokens", width="small"),
    "truncated": st.column_config.CheckboxColumn("truncated", width="small"),
    "entropy": st.column_config.NumberColumn("entropy", format="%.3f", width="small"),
}


def accuracy(responses: pd.DataFrame) -> float:
    """The verifier's: a correct answer whose reward is shaped (overlong penalty, -1/1 rewards) is correct. Rows from
    before the `correct` column: reward 1 was correct (as GATE_REASON_RULES)."""
    correct = responses["correct"].astype("boolean").fillna(responses["reward"].eq(1))
    return float(correct.mean()) if len(correct) else math.nan


def response_columns(components: list[str]) -> dict:
    """The table's columns: RESPONSE_COLUMNS with each reward component's after the reward."""
    columns = {}
    for name, column in RESPONSE_COLUMNS.items():
        columns[name] = column
        if name == "reward":
            columns.update(
                {
                    c: st.column_config.NumberColumn(
                        c,
                        format="%.3g",
                        width="small",
                        help="this reward component's value (None: could not verify); the reward is their weighted sum",
                    )
                    for c in components
                }
            )
    return columns


def with_components(rows: pd.DataFrame, components: pd.DataFrame | None) -> tuple[pd.DataFrame, list[str]]:
    """The rows with a column per reward component (a run given --reward), and the components' names."""
    if components is None or components.empty:
        return rows, []
    wide = components.pivot(index=["group_idx", "sample_idx"], columns="name", values="value").reset_index()
    names = [str(c) for c in wide.columns if c not in ("group_idx", "sample_idx")]
    return rows.merge(wide, on=["group_idx", "sample_idx"], how="left"), names


def styled(responses: pd.DataFrame, components: list[str] = ()):
    """Responses of one group, the ones without a gradient (gated, filtered) greyed out."""
    filtered = board.filtered_rows(responses)
    status = responses["gated"].map({True: STATUS["gated"], False: STATUS["kept"]}).where(~filtered, STATUS["filtered"])
    frame = responses.assign(
        status=status, gate_reason=responses["gate_reason"].fillna("").where(~filtered, board.FILTERED_REASON)
    )
    frame = frame[list(response_columns(list(components)))].reset_index(drop=True)
    return frame.style.apply(lambda row: [DIMMED if row["status"] != STATUS["kept"] else ""] * len(row), axis=1)


def open_row(table_key: str, select_key: str, samples: list[int]) -> None:
    """Clicking a cell (or a row's checkbox) of a group's table opens that response (sets the group's 'open' box)."""
    selection = st.session_state[table_key]["selection"]
    rows = list(selection.get("rows", [])) + [cell[0] for cell in selection.get("cells", [])]
    st.session_state[select_key] = samples[rows[0]] if rows else None


def group(
    step: int,
    rows: pd.DataFrame,
    model_prompts: dict[int, str],
    components: list[str] = (),
    run_id: str | None = None,
    color_by: str = "logprob",
) -> None:
    first = rows.iloc[0]
    g, regime = int(first["group_idx"]), str(first["regime"])
    with st.container(border=True):
        badge = f":{REGIME_BADGE[regime]}-badge[{regime}]" if regime in REGIME_BADGE else ""
        filtered = bool(board.filtered_rows(rows).iloc[0])
        status = (
            ":orange-badge[filtered by dynamic sampling] · not trained"
            if filtered
            else f"{int(rows['gated'].sum())} of {len(rows)} shown gated"
        )
        st.markdown(
            f"**Group {g}** {badge} · **{int(first['n_correct'])}/{int(first['group_size'])}** correct · "
            f"baseline **{first['baseline']:.3g}** · {status}"
        )
        board.show_prompt_and_answer(first["prompt"], first["answer"], model_prompts.get(g))
        samples = [int(s) for s in rows["sample_idx"]]
        table_key, select_key = f"table_{step}_{g}", f"open_{step}_{g}"
        st.dataframe(
            styled(rows, components),
            hide_index=True,
            column_config=response_columns(list(components)),
            key=table_key,
            height=min(ROW_PX * (len(rows) + 1) + 8, MAX_TABLE_PX),
            on_select=partial(open_row, table_key, select_key, samples),
            selection_mode=["single-row", "single-cell"],
            placeholder="",
        )
        by_sample = rows.set_index("sample_idx")
        chosen = st.selectbox(
            "Open a response in full",
            [None, *samples],
            key=select_key,
            format_func=lambda s: (
                "—"
                if s is None
                else (
                    f"sample {s} · reward {by_sample.at[s, 'reward']:.2f} · "
                    f"advantage {by_sample.at[s, 'advantage']:+.3f}"
                    + (" · filtered" if filtered else " · gated" if by_sample.at[s, "gated"] else "")
                )
            ),
        )
        if chosen is not None:
            row = by_sample.loc[chosen]
            st.code(row["response"], language=None, wrap_lines=True)
            st.caption(
                f"{int(row['n_tokens'])} tokens"
                + (" · truncated at max_new_tokens" if row["truncated"] else "")
                + f" · entropy {row['entropy']:.3f}"
                + (
                    " · its group was left out of the update by dynamic sampling"
                    if filtered
                    else f" · gated: {GATE_REASONS[row['gate_reason']]}"
                    if row["gated"]
                    else ""
                )
            )
            if run_id is not None:
                token_view(run_id, step, g, int(chosen), color_by)


def token_view(run_id: str, step: int, g: int, sample: int, color_by: str) -> None:
    """One response's tokens, each coloured by `color_by`, every number on hover; a note where the run kept none."""
    stored = board.read(read_token_values, run_id, step, ((g, sample),))
    if stored is None:
        return
    if stored.empty:
        st.caption(
            "Its per-token numbers were not stored (--store-tokens keeps a sample of a step's responses at "
            "scale, none with `none`, and runs from before the table have none)."
        )
        return
    st.html(token_markup.token_html(token_numbers(stored.iloc[0].to_dict()), color_by))
    st.caption(token_markup.legend(color_by))


def gate_summary(run_id: str, step: int, everything: pd.DataFrame) -> None:
    """Why this step's gated (trained) responses were gated (a table), and the same over every step (a chart)."""
    trained = everything[~board.filtered_rows(everything)]
    counts = trained.loc[trained["gated"], "gate_reason"].value_counts()
    table = pd.DataFrame(
        {
            "why gated": list(GATE_REASONS),
            "responses": [int(counts.get(r, 0)) for r in GATE_REASONS],
            "meaning": list(GATE_REASONS.values()),
        }
    )
    table["share of the trained"] = table["responses"] / max(len(trained), 1)
    n_filtered = len(everything) - len(trained)
    st.markdown(
        f"**Why gated** at step {step}: "
        + (
            " · ".join(
                f"{n} {reason.replace('_', ' ')}"
                for reason, n in zip(table["why gated"], table["responses"], strict=True)
                if n
            )
            or "none gated"
        )
        + (f" · and {n_filtered} responses in groups filtered by dynamic sampling (not trained)" if n_filtered else "")
    )
    with st.expander("The breakdown, with what each reason means, and over every step", expanded=False):
        st.dataframe(
            table[table["responses"] > 0],
            hide_index=True,
            key="gate_table",
            column_config={"share of the trained": st.column_config.NumberColumn(format="percent")},
            placeholder="",
        )
        breakdown = board.read(read_gate_breakdown, run_id)
        totals = board.read(read_step_tokens, run_id)
        if breakdown is not None and totals is not None:
            board.plot(charts.gate_breakdown(breakdown, totals, step), "gate_breakdown")


def filter_controls(everything: pd.DataFrame) -> tuple[dict, str]:
    """The page's filters, bound to the URL: the board.rollouts arguments they make, and the gate reason (applied by
    `matching`). `everything`: the step's rollouts, whose rewards the Reward control offers."""
    filters = st.columns([1.1, 1.6, 0.8, 1.5])
    regime = filters[0].selectbox("Regime", ["any", *REGIMES], key="regime", bind="query-params")
    gated = filters[1].segmented_control(
        "Responses",
        list(GATED_CHOICES),
        key="gated",
        default="all",
        bind="query-params",
        required=True,
        help="gated and kept: of the trained groups; filtered: the groups dynamic sampling left out of the update",
    )
    rewards = [f"{r:g}" for r in sorted(everything["reward"].dropna().unique().tolist())]
    reward = filters[2].selectbox("Reward", ["any", *rewards], key="reward", bind="query-params")
    reason = filters[3].selectbox(
        "Why gated",
        ["any", *GATE_REASONS],
        key="why",
        bind="query-params",
        help="; ".join(f"{k}: {v}" for k, v in GATE_REASONS.items()),
    )
    search = st.text_input(
        "Search prompts and responses", key="search", bind="query-params", placeholder="plain text, case-insensitive"
    )
    gated_only, filtered_only = GATED_CHOICES[gated]
    query = dict(
        gated=gated_only,
        regime=None if regime == "any" else regime,
        reward=None if reward == "any" else float(reward),
        search=search,
        filtered=False if reason != "any" and filtered_only is None else filtered_only,
    )
    return query, reason


ORDERS = {
    "group": "groups in order, responses by sample",
    "entropy": "highest mean token entropy first",
    "mismatch": "largest sampler/trainer gap first (mean |old - sampler| log-prob per token)",
}


def component_controls(components: pd.DataFrame | None) -> dict[str, float]:
    """A filter per reward component (a run given --reward): the value its responses must have, bound to the URL
    (`comp0`, `comp1`, ... in the components' order); {} for 'any' everywhere."""
    if components is None or components.empty:
        return {}
    names = list(dict.fromkeys(components["name"]))
    columns = st.columns(min(len(names), 4))
    wanted = {}
    for i, name in enumerate(names):
        values = sorted(components.loc[components["name"] == name, "value"].dropna().unique().tolist())
        picked = columns[i % len(columns)].selectbox(
            board.literal(name),
            ["any", *(f"{v:g}" for v in values)],
            key=f"comp{i}",
            bind="query-params",
            help=f"Only responses whose {board.literal(name)} component has this value",
        )
        if picked != "any":
            wanted[name] = float(picked)
    return wanted


def with_component_values(rows: pd.DataFrame, components: pd.DataFrame | None, wanted: dict[str, float]):
    """The rows whose components have the `wanted` values."""
    if not wanted or rows is None:
        return rows
    keep = None
    for name, value in wanted.items():
        part = components[(components["name"] == name) & (components["value"] == value)]
        pairs = set(zip(part["group_idx"].astype(int), part["sample_idx"].astype(int), strict=True))
        keep = pairs if keep is None else keep & pairs
    return rows[[(int(g), int(i)) in keep for g, i in zip(rows["group_idx"], rows["sample_idx"], strict=True)]]


def ordered(rows: pd.DataFrame, order: str, mismatch: pd.DataFrame | None) -> pd.DataFrame:
    """`rows` in the chosen ORDERS (groups follow their first response; missing values last)."""
    if order == "group" or rows.empty:
        return rows
    if order == "mismatch":
        gaps = mismatch.set_index(["group_idx", "sample_idx"])["mismatch"] if mismatch is not None else None
        rows = rows.assign(
            mismatch=[
                gaps.get((g, i)) if gaps is not None else None
                for g, i in zip(rows["group_idx"], rows["sample_idx"], strict=True)
            ]
        )
    rows = rows.sort_values(order, ascending=False, na_position="last", kind="stable")
    first = {g: rank for rank, g in reversed(list(enumerate(rows["group_idx"])))}
    return rows.assign(_rank=rows["group_idx"].map(first)).sort_values("_rank", kind="stable").drop(columns="_rank")


def matching(
    run_id: str,
    step: int,
    query: dict,
    reason: str,
    components: pd.DataFrame | None = None,
    wanted: dict[str, float] | None = None,
    **read,
) -> pd.DataFrame | None:
    """The step's rollouts that pass the filters (filter_controls' `query` and `reason`, and component values
    `wanted` of `components`); `read`: with_text or group_ids, as board.rollouts takes them. None when the file cannot
    be read (a note says why)."""
    rows = board.rollouts(run_id, step, **query, **read)
    if rows is not None and reason != "any":
        rows = rows[rows["gate_reason"] == reason]
    return with_component_values(rows, components, wanted or {})


def step_summary(everything: pd.DataFrame, shown: pd.DataFrame) -> None:
    """The step's counts (responses and groups shown, gated, accuracy, filtered out), before filters unless said."""
    n_groups = everything["group_idx"].nunique()
    filtered = board.filtered_rows(everything)
    trained = everything[~filtered]
    summary = st.columns(5 if filtered.any() else 4)
    summary[0].metric("responses shown", f"{len(shown)} / {len(everything)}")
    summary[1].metric(
        "gated (advantage 0)",
        f"{int(trained['gated'].sum())} / {len(trained)}",
        help="of the step's trained responses (frac_zero_adv), before filters",
    )
    summary[2].metric("groups shown", f"{shown['group_idx'].nunique()} / {n_groups}")
    summary[3].metric(
        "accuracy",
        f"{accuracy(everything):.3f}",
        help="the verifier's verdicts over every response of the step (filtered groups included), as "
        "the step's accuracy metric",
    )
    if filtered.any():
        summary[4].metric(
            "filtered out",
            f"{int(filtered.sum())} / {len(everything)}",
            help=f"responses of the {everything.loc[filtered, 'group_idx'].nunique()} groups that "
            "dynamic sampling left out of the update: no signal, or informative beyond the first "
            "prompts_per_step",
        )


def page_of_groups(group_ids: list[int]) -> list[int]:
    """The groups of the page the pagination control (bound to the URL) picks, GROUPS_PER_PAGE a page."""
    pages = math.ceil(len(group_ids) / GROUPS_PER_PAGE)
    page = 1
    if pages > 1:
        st.caption(f"{len(group_ids)} groups, {GROUPS_PER_PAGE} a page")
        if st.session_state.get("page", 1) > pages:
            st.session_state["page"] = pages
        page = st.pagination(pages, key="page", bind="query-params")
    return group_ids[(page - 1) * GROUPS_PER_PAGE : page * GROUPS_PER_PAGE]


def templated_prompts(run_id: str, step: int) -> dict[int, str]:
    """With its toggle on, a chat model's prompts as it saw them (chat template applied), by group: empty for a model
    without a chat template, as a caption says."""
    if not st.toggle("Show prompts as the model saw them (chat template)", key="model_prompt", bind="query-params"):
        return {}
    model_prompts = board.read(read_model_prompts, run_id, step) or {}
    if not model_prompts:
        st.caption("This run stored no templated prompts: its model has no chat template (it saw the prompt itself).")
    return model_prompts


def body(run_id: str) -> None:
    steps = board.rollout_steps(run_id)
    if steps is None:  # unreadable: the note says why
        return
    if not steps:
        st.info("No rollouts written yet: the first step's groups appear here when the trainer finishes it.")
        return
    step = board.step_slider(steps, "Step", what="rollouts")
    # counts and filters read no text; the prompt and response texts are read for the page's groups only (a step
    # at the paper's size holds ~60 MB of them)
    everything = board.rollouts(run_id, step, with_text=False)
    if everything is None:
        return
    query, reason = filter_controls(everything)
    step_components = board.read(read_components, run_id, step)
    wanted = component_controls(step_components)
    controls = st.columns(2)
    order = controls[0].segmented_control(
        "Order",
        list(ORDERS),
        key="order",
        default="group",
        bind="query-params",
        required=True,
        help="; ".join(f"{k}: {v}" for k, v in ORDERS.items()),
    )
    color_by = controls[1].segmented_control(
        "Colour tokens by",
        list(COLOR_SCALES),
        key="color",
        default="logprob",
        bind="query-params",
        required=True,
        help="; ".join(f"{k}: {v[0]}" for k, v in COLOR_SCALES.items()),
    )
    mismatch = board.read(read_response_mismatch, run_id, step) if order == "mismatch" else None
    shown = matching(run_id, step, query, reason, step_components, wanted, with_text=False)
    if shown is None:
        return
    shown = ordered(shown, order, mismatch)
    step_summary(everything, shown)
    gate_summary(run_id, step, everything)
    if shown.empty:
        st.info("No response of this step matches the filters.")
        return
    page_groups = page_of_groups(list(dict.fromkeys(shown["group_idx"])))
    model_prompts = templated_prompts(run_id, step)
    page_rows = matching(run_id, step, query, reason, step_components, wanted, group_ids=tuple(page_groups))
    if page_rows is None:
        return
    page_rows, components = with_components(ordered(page_rows, order, mismatch), step_components)
    for g in page_groups:
        group(step, page_rows[page_rows["group_idx"] == g], model_prompts, components, run_id, color_by)


[run] = board.start_page("Rollouts", one_run=True)
body(run)
