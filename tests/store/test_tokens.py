"""Every token's numbers in the store: which responses --store-tokens keeps, list columns through pending/ and the
database, and how a kept response's numbers read."""

import math

import pytest

from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.store.schema import PendingWrite, pending_write_from_json, pending_write_json
from qae_app.store.signal_reader import read_token_values
from qae_app.store.tokens import (
    AUTO_ALL_TOKENS,
    AUTO_SAMPLE,
    check_store_tokens,
    kept_responses,
    responses_kept,
    strength,
    token_numbers,
)
from qae_app.store.writer import RunWriter


def test_auto_keeps_every_response_of_a_cpu_sized_step_and_a_sample_at_scale():
    assert responses_kept("auto", 8 * 16 * 8) is None  # the default run: every response
    assert responses_kept("auto", AUTO_ALL_TOKENS) is None
    assert responses_kept("auto", 512 * 16 * 20_000) == AUTO_SAMPLE  # the paper's step
    assert responses_kept("all", 512 * 16 * 20_000) is None
    assert responses_kept("none", 10) == 0 and responses_kept("7", 10**9) == 7


def test_the_sample_is_a_seeded_draw_the_same_on_every_process_and_rerun():
    drawn = kept_responses(64, 8192, seed=3, step=5)
    assert len(drawn) == 64 and drawn == kept_responses(64, 8192, seed=3, step=5)
    assert drawn != kept_responses(64, 8192, seed=3, step=6)
    assert kept_responses(None, 100, 0, 1) is None and kept_responses(200, 100, 0, 1) is None
    assert kept_responses(0, 100, 0, 1) == set()


@pytest.mark.parametrize("value", ["some", "0", "-3", "1.5"])
def test_a_bad_store_tokens_is_one_clear_error(value):
    with pytest.raises(ValueError, match="store-tokens: .* is not auto, all, none or a whole number"):
        check_store_tokens(value)
    with pytest.raises(QAEUserError, match="store-tokens"):
        build_config(store_tokens=value)


def test_list_columns_go_through_pending_and_the_database_as_they_were(tmp_path):
    row = {
        "group_idx": 0,
        "sample_idx": 1,
        "tokens": ["4", "<eos>", "\x1b[2J"],
        "logprob": [-0.5, -0.01, -3.25],
        "entropy": [0.5, 0.25, 1.0],
        "old_logprob": None,
    }
    write = PendingWrite("step", step=2, tables={"token_values": [row]})
    assert pending_write_from_json(pending_write_json(write)).tables == write.tables
    writer = RunWriter(tmp_path / "r" / "qae.duckdb", "r")
    writer.create_run("r", {}, "qae", 0.4, "m", "t", 0)
    writer.add_step(2, token_values=[row])
    assert writer.wait_until_written(timeout_s=60)
    stored = read_token_values(tmp_path / "r" / "qae.duckdb", 2).iloc[0].to_dict()
    assert list(stored["tokens"]) == row["tokens"]
    assert list(stored["logprob"]) == row["logprob"] and list(stored["entropy"]) == row["entropy"]  # (exact in float32)
    numbers = token_numbers(stored)
    assert [n["old_logprob"] for n in numbers] == [None] * 3 and numbers[2]["gap"] is None


def test_a_planted_pending_list_of_objects_is_refused():
    text = pending_write_json(
        PendingWrite(
            "step",
            step=1,
            tables={
                "token_values": [
                    {
                        "group_idx": 0,
                        "sample_idx": 0,
                        "tokens": ["a"],
                        "logprob": [-1.0],
                        "entropy": None,
                        "old_logprob": None,
                    }
                ]
            },
        )
    )
    with pytest.raises(ValueError, match="token_values.tokens"):
        pending_write_from_json(text.replace('["a"]', '[{"x": 1}]'))


def test_a_token_is_coloured_by_how_far_its_number_is_from_nothing():
    assert strength(0.0, "logprob") == 0 and strength(-5.0, "logprob") == 1 and strength(-50, "logprob") == 1
    assert strength(-1.0, "logprob") == pytest.approx(0.2)
    assert strength(1.5, "entropy") == pytest.approx(0.5) and strength(-0.25, "gap") == pytest.approx(0.5)
    assert strength(None, "gap") == 0
    numbers = token_numbers(
        {"tokens": ["a", "b"], "logprob": [-1.0, math.nan], "entropy": [0.1, 0.2], "old_logprob": [-0.75, -2.0]}
    )
    assert numbers[0]["gap"] == pytest.approx(0.25) and numbers[1]["logprob"] is None and numbers[1]["gap"] is None
