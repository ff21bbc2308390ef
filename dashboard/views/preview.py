"""Preview: what `qae preview` found for a task before training (qae_app/evaluation/task_preview.py): its verdict, the
groups by success rate, what QAE at each K would gate against GRPO, the response lengths and some responses."""

import board
import charts
import pandas as pd
import streamlit as st

from qae_app.store.reader import PreviewView, read_preview
from qae_app.store.signal import groups_with_signal

EMPTY = (
    "None of the picked runs is a preview. Run `qae preview` with the options of `qae train` (e.g. `qae preview "
    "--data builtin:chain --group-size 8`) and pick it in the sidebar: it is listed with the runs."
)
SHOWN_RESPONSES = 50


def body(view: PreviewView, run_id: str) -> None:
    _verdict(view.summary)
    _charts(view, run_id, int(view.summary["group_size"]))
    _tables(view, run_id)


def _verdict(s: dict) -> None:
    """Whether the task is learnable at this group size, the numbers that say so and the suggested K."""
    learnable = str(s["verdict"]).startswith("learnable")
    (st.success if learnable else st.error)(
        s["verdict"], icon=":material/check_circle:" if learnable else ":material/block:"
    )
    cols = st.columns(5)
    cols[0].metric("success rate", f"{s['accuracy']:.1%}")
    cols[1].metric("groups without signal", f"{s['frac_no_signal']:.1%}")
    cols[2].metric("cut at max-new-tokens", f"{s['truncated_frac']:.1%}", help=f"max-new-tokens {s['max_new_tokens']}")
    cols[3].metric("mean length", f"{s['response_len']:.1f} tokens")
    cols[4].metric("suggested K", "-" if pd.isna(s["suggested_k"]) else f"{s['suggested_k']:g}")
    if not pd.isna(s["suggested_why"]):
        st.caption(s["suggested_why"])


def _charts(view: PreviewView, run_id: str, group_size: int) -> None:
    """Success per group, the gated fraction and the regimes at each K, the response lengths."""
    left, right = st.columns(2)
    with left:
        signal = groups_with_signal(view.rollouts["group_idx"], view.rollouts["reward"])
        board.plot(charts.preview_success(view.groups, group_size, signal), "preview_success")
    with right:
        board.plot(charts.preview_gating(view.by_k), "preview_gating")
    left, right = st.columns(2)
    with left:
        board.plot(charts.preview_regimes(view.by_k), "preview_regimes")
    with right:
        board.plot(
            charts.histogram(
                {run_id: view.rollouts["n_tokens"]}, board.run_colors([run_id]), "response lengths", "tokens"
            ),
            "preview_lengths",
        )


def _tables(view: PreviewView, run_id: str) -> None:
    """Which reward carries the signal (several components), the gating at each K, the first responses."""
    if view.signal is not None and not view.signal.empty:  # several reward components: which carries the signal
        st.markdown("**Which reward carries the signal**")
        st.dataframe(
            view.signal[["name", "weight", "value_mean", "frac_differs", "frac_signal", "adv_share"]],
            hide_index=True,
            key="preview_signal",
            column_config={
                "name": "component",
                "value_mean": "mean",
                **{
                    c: st.column_config.NumberColumn(label, format="percent")
                    for c, label in (
                        ("frac_differs", "differs in (groups)"),
                        ("frac_signal", "signal because of it (groups)"),
                        ("adv_share", "share of the advantage"),
                    )
                },
            },
        )
    table = view.by_k.assign(k=view.by_k["k"].where(view.by_k["estimator"] == "qae"))
    st.dataframe(
        table[
            [
                "estimator",
                "k",
                "suggested",
                "frac_zero_adv",
                "frac_zero_adv_informative",
                "n_hard",
                "n_easy",
                "n_all_correct",
                "n_all_wrong",
                "n_mixed",
            ]
        ],
        hide_index=True,
        key="preview_by_k",
        column_config={
            "frac_zero_adv": st.column_config.NumberColumn("gated", format="percent"),
            "frac_zero_adv_informative": st.column_config.NumberColumn("gated with signal", format="percent"),
        },
    )
    responses = view.rollouts.merge(view.groups[["group_idx", "prompt", "answer"]], on="group_idx")
    st.caption(
        f"the first {min(SHOWN_RESPONSES, len(responses))} of {len(responses)} responses (every one: the "
        f"Rollouts page, or `qae rollouts {run_id}`)"
    )
    st.dataframe(
        responses[["group_idx", "prompt", "answer", "response", "reward", "correct", "n_tokens", "truncated"]].head(
            SHOWN_RESPONSES
        ),
        hide_index=True,
        key="preview_responses",
    )


run_ids = board.start_page(
    "Preview", "what `qae preview` sampled before training: is the task learnable at this group size, and which K?"
)
estimators = board.runs().set_index("run_id")["estimator"] if "estimator" in board.runs() else pd.Series(dtype=str)
previews = [run_id for run_id in run_ids if estimators.get(run_id) == "preview"]
if not previews:
    st.info(EMPTY)
    st.stop()
chosen = (
    previews[0]
    if len(previews) == 1
    else st.segmented_control("Preview", previews, key="preview", bind="query-params", default=previews[0])
)
view = board.read(read_preview, chosen)
if view is not None:
    body(view, chosen)
