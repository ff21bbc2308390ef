"""What a number, a missing value, a duration and a run's pace read as: one definition (qae_app/core/formatting.py) for
the terminal and the dashboard, checked on hand-written values."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np
import pandas as pd
import pytest

from qae_app.config import check_range
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import ago, as_float, clipped, duration, missing, number, pace_line, run_pace


def test_missing_is_every_kind_of_never_recorded_and_nothing_else():
    assert [missing(v) for v in (None, float("nan"), np.float32("nan"), pd.NA, pd.NaT)] == [True] * 5
    assert [missing(v) for v in (0, 0.0, "", False, "-", datetime(2026, 1, 1))] == [False] * 6


def test_numbers_keep_their_digits():
    assert [number(v) for v in (None, float("nan"), 3, 3.0, 0.12345, -0.0456, 123.456, 1.5e-05, 2.5e7)] == [
        "-",
        "-",
        "3",
        "3",
        "0.123",
        "-0.046",
        "123.5",
        "1.5e-05",
        "2.5e+07",
    ]
    assert [number(v) for v in (pd.NA, True, 1.0, 0.875)] == ["-", "True", "1", "0.875"]
    # one precision from 1 on: 4 significant digits (50.859 beside 135.7 read as two precisions)
    assert [number(v) for v in (5.1234, 50.859, 135.74, 1357.6, 99.99, -12.345, 9.9996)] == [
        "5.123",
        "50.86",
        "135.7",
        "1358",
        "99.99",
        "-12.35",
        "10.00",
    ]


def test_as_float_gives_none_for_what_is_not_a_number():
    assert [as_float(v) for v in (None, float("nan"), pd.NA, "auto", "0.5", 2)] == [None, None, None, None, 0.5, 2.0]


def test_durations():
    assert [duration(s) for s in (None, float("nan"), 45, 600, 3 * 3600, 3 * 86400)] == [
        "-",
        "-",
        "45 s",
        "10 min",
        "3.0 h",
        "3.0 d",
    ]
    assert ago(45) == "45 s ago" and ago(None) == "- ago"


def test_run_pace_from_step_times():
    start = datetime(2026, 1, 1, 12, 0, 0)
    # 10 steps 6 s apart, with a 600 s pause (an evaluation) before step 6: the median spacing ignores the pause
    times = [start + timedelta(seconds=6 * i + (600 if i >= 5 else 0)) for i in range(10)]
    steps = pd.DataFrame({"step": range(1, 11), "logged_at": times})
    pace = run_pace(steps, 110, now=times[-1] + timedelta(seconds=30))
    assert pace["age_s"] == 30 and pace["steps_per_min"] == pytest.approx(10)
    assert pace["eta_s"] == pytest.approx(100 * 6)
    assert pace_line(pace) == "last step 30 s ago · 10 steps/min · ETA 10 min"
    unknown = run_pace(steps.assign(logged_at=pd.NaT), 110)
    assert unknown == dict(age_s=None, steps_per_min=None, eta_s=None)
    assert pace_line(unknown) == "last step - ago · - steps/min · ETA -"


def test_setup_labels():
    from qae_app.core.formatting import setup_label

    assert setup_label(None) is None
    assert setup_label({"sharding": "none", "processes": 1, "machines": 1, "mixed_precision": "no"}) == "1 process"
    assert (
        setup_label({"sharding": "fsdp2", "processes": 2, "machines": 1, "mixed_precision": "no"})
        == "fsdp2 x 2 processes"
    )
    assert (
        setup_label({"sharding": "ddp", "processes": 4, "machines": 2, "mixed_precision": "bf16"})
        == "ddp x 4 processes on 2 machines, bf16 mixed precision"
    )


def test_a_huge_value_is_named_by_its_start_or_its_size_never_echoed_whole():
    """A run folder's 4,000-digit seed was echoed whole in `qae runs`' unreadable note, pushing the table off the
    screen; past 4,300 digits Python refuses to print the integer at all (ValueError, a traceback)."""
    assert clipped("short") == "short"
    assert clipped("x" * 200) == "x" * 80 + "… (200 characters)"
    assert clipped(10**4000) == "1" + "0" * 79 + "… (4,001 characters)"
    assert clipped(10**5000) == f"an integer of {(10**5000).bit_length():,} bits"
    with pytest.raises(QAEUserError) as err:
        check_range("seed", 10**5000)
    assert str(err.value).startswith("seed: an integer of 16,610 bits is more than 2,147,483,647")
