"""Which reward carries the signal (store/signal.py), on groups whose shares are worked out by hand, and what the
preview's verdict says of them."""

import pytest

from qae_app.store.rows import GroupResult
from qae_app.store.signal import component_signal_rows, signal_sentence

WEIGHTS = {"correct": 1.0, "format": 0.2}


def group(g: int, correct: list[float], fmt: list[float], advantages: list[float], penalty=None, filtered=False):
    """A group of G=4 with two components' values; parts = weight x value; reward = their sum (+ a penalty)."""
    parts = {"correct": [1.0 * v for v in correct], "format": [0.2 * v for v in fmt]}
    penalty = penalty or [0.0] * 4
    rewards = [c + f + p for c, f, p in zip(parts["correct"], parts["format"], penalty, strict=True)]
    return GroupResult(
        group_idx=g,
        prompt_id=f"p{g}",
        prompt="q",
        answer="a",
        baseline=0.0,
        regime="hard",
        responses=["r"] * 4,
        rewards=rewards,
        correct=[c == 1 for c in correct],
        verified=[True] * 4,
        advantages=advantages,
        n_tokens=[1] * 4,
        truncated=[False] * 4,
        entropies=[0.1] * 4,
        logprobs=[-1.0] * 4,
        filtered=filtered,
        components={"correct": correct, "format": fmt},
        parts=parts,
    )


def by_name(rows):
    return {row["name"]: row for row in rows}


def test_each_component_gets_the_groups_and_the_advantage_it_decides():
    # A: only format differs (its spread 0.4: parts 0.2,0,0,0.2 around 0.1), |advantage| mass 2
    # B: only correct differs (spread 1.5: 1,0,0,0 around 0.25), mass 1.5; format equal everywhere
    # C: nothing differs: no signal, no mass
    rows = by_name(
        component_signal_rows(
            [
                group(0, [0, 0, 0, 0], [1, 0, 0, 1], [1.0, 0, 0, 1.0]),
                group(1, [1, 0, 0, 0], [1, 1, 1, 1], [1.5, 0, 0, 0]),
                group(2, [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]),
            ],
            WEIGHTS,
        )
    )
    assert list(rows) == ["correct", "format"]
    assert rows["correct"]["frac_differs"] == rows["format"]["frac_differs"] == pytest.approx(1 / 3)
    assert rows["correct"]["frac_signal"] == rows["format"]["frac_signal"] == pytest.approx(1 / 3)
    assert rows["format"]["adv_share"] == pytest.approx(2 / 3.5)
    assert rows["correct"]["adv_share"] == pytest.approx(1.5 / 3.5)
    assert rows["format"]["value_mean"] == pytest.approx(6 / 12)
    assert rows["correct"]["value_mean"] == pytest.approx(1 / 12)
    assert rows["format"]["weight"] == 0.2


def test_a_group_both_components_move_is_decided_by_neither_and_split_by_spread():
    rows = by_name(component_signal_rows([group(0, [1, 0, 0, 0], [1, 1, 0, 0], [2.0, 0.5, -0.5, -0.5])], WEIGHTS))
    assert rows["correct"]["frac_signal"] == rows["format"]["frac_signal"] == 0  # the other alone still differs
    assert rows["correct"]["adv_share"] == pytest.approx(1.5 / 1.9)  # spreads 1.5 and 0.4
    assert rows["format"]["adv_share"] == pytest.approx(0.4 / 1.9)


def test_the_overlong_penalty_takes_its_share_and_decides_no_component():
    rows = by_name(
        component_signal_rows(
            [group(0, [0, 0, 0, 0], [1, 1, 1, 1], [0.5, 0.5, -0.5, -0.5], penalty=[0, 0, -0.5, -0.5])], WEIGHTS
        )
    )
    assert rows["format"]["frac_signal"] == 0 and rows["correct"]["frac_signal"] == 0  # the penalty differs alone
    assert rows["format"]["adv_share"] == 0 and rows["correct"]["adv_share"] == 0


def test_a_filtered_group_counts_in_the_groups_but_carries_no_advantage():
    rows = by_name(
        component_signal_rows(
            [
                group(0, [0, 0, 0, 0], [1, 0, 0, 0], [1.0, 0, 0, 0]),
                group(1, [1, 0, 0, 0], [0, 0, 0, 0], [1.0, 0, 0, 0], filtered=True),
            ],
            WEIGHTS,
        )
    )
    assert rows["correct"]["frac_signal"] == 0.5 and rows["correct"]["adv_share"] == 0
    assert rows["format"]["adv_share"] == 1.0


def test_no_signal_anywhere_leaves_the_share_undefined_and_no_components_no_rows():
    rows = by_name(component_signal_rows([group(0, [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0])], WEIGHTS))
    assert rows["format"]["adv_share"] is None and rows["format"]["frac_signal"] == 0
    plain = group(0, [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0])
    plain.parts = {}
    assert component_signal_rows([plain], WEIGHTS) == []


def test_the_verdict_names_the_component_that_carries_the_signal():
    rows = component_signal_rows([group(0, [0, 0, 0, 0], [1, 0, 0, 1], [1.0, 0, 0, 1.0])], WEIGHTS)
    assert signal_sentence(rows) == "all signal comes from format (weight 0.2); correct never differs within a group"
    both = component_signal_rows(
        [group(0, [0, 0, 0, 0], [1, 0, 0, 1], [1.0, 0, 0, 1.0]), group(1, [1, 0, 0, 0], [1, 1, 1, 1], [3.0, 0, 0, 0])],
        WEIGHTS,
    )
    assert signal_sentence(both) == "signal by component (share of the advantage): correct 60%, format 40%"
    assert signal_sentence(component_signal_rows([group(0, [0] * 4, [1] * 4, [0] * 4)], WEIGHTS)) is None
