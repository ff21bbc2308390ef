"""How a number, a missing value, a duration, a run's pace and its launch read, wherever qae shows them: the terminal
(`qae runs`, `qae show`, `qae train`, `qae compare`) and the dashboard. One definition of each, so the two never
disagree.

Torch-free, and pandas-free at import (`qae runs` draws from dicts): `run_pace` imports pandas when it is called.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

MISSING = "-"  # what a value that was never recorded reads as


def missing(value: Any) -> bool:
    """None, NaN, pandas' NA or NaT: a value that was never recorded."""
    # (NA before the NaN test: `NA != NA` is NA, whose truth value raises)
    return value is None or type(value).__name__ in ("NAType", "NaTType") or value != value


def as_float(value: Any) -> float | None:
    """A stored number as a float; None when it is missing or not a number at all."""
    if missing(value):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def number(value: Any) -> str:
    """A number in at most ~8 characters, never cut: '-' for missing, integers as they are, 3 decimals in [0.001, 1),
    4 significant digits from 1 on (5.123, 50.86, 135.7, 1358: one precision, where 50.859 sat beside 135.7), 2
    significant digits in scientific notation below 0.001 and from a million on."""
    if missing(value):
        return MISSING
    if isinstance(value, (bool,)):
        return str(value)
    if isinstance(value, (int,)) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e6):
        return str(int(value))
    value = float(value)
    if abs(value) >= 1e6:
        return f"{value:.3g}"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    if abs(value) >= 1:
        value = float(f"{value:.4g}")  # rounded first, so 9.9996 reads 10.00, not 10.000
        return f"{value:.{max(0, 3 - math.floor(math.log10(abs(value))))}f}"
    if abs(value) >= 0.001:
        return f"{value:.3f}"
    return f"{value:.1e}"


def duration(seconds: float | None) -> str:
    """'45 s', '12 min', '3.4 h', '2.1 d' (or '-' when unknown)."""
    if missing(seconds):
        return MISSING
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def ago(seconds: float | None) -> str:
    """'45 s ago' ('- ago' when unknown)."""
    return f"{duration(seconds)} ago"


# ---------------------------------------------------------------------------------------------------------------
# a run's pace

PACE_STEPS = 50  # a run's pace is the median spacing of its last this-many steps


def run_pace(steps: pd.DataFrame, total_steps: int | None, now: datetime | None = None) -> dict:
    """How a run is moving, from the times its steps were committed (`logged_at`, UTC): `age_s` of the last step,
    `steps_per_min` (median spacing of the last PACE_STEPS steps, so a pause for an evaluation, a checkpoint or a
    resume does not skew it) and `eta_s` to `total_steps` at that pace. Facts that cannot be known are None."""
    import pandas as pd  # (here: `qae runs` never needs it)

    now = now or datetime.now(timezone.utc).replace(tzinfo=None)  # naive UTC, as the store's logged_at
    times = steps["logged_at"].dropna() if "logged_at" in steps else pd.Series(dtype="datetime64[ns]")
    if times.empty:
        return dict(age_s=None, steps_per_min=None, eta_s=None)
    age_s = max(0.0, (now - pd.Timestamp(times.iloc[-1]).to_pydatetime()).total_seconds())
    gaps = pd.to_datetime(times.tail(PACE_STEPS)).diff().dt.total_seconds().dropna()
    gaps = gaps[gaps > 0]
    per_min = 60 / float(gaps.median()) if not gaps.empty else None
    last = int(steps["step"].iloc[-1])
    eta_s = (total_steps - last) * 60 / per_min if per_min and total_steps and total_steps > last else None
    return dict(age_s=age_s, steps_per_min=per_min, eta_s=eta_s)


def pace_line(pace: dict) -> str:
    """'last step 12 s ago · 3.1 steps/min · ETA 5 min' from a `run_pace` ('-' for what is unknown)."""
    rate = pace["steps_per_min"]
    return (
        f"last step {ago(pace['age_s'])} · "
        + (f"{rate:.3g} steps/min" if rate else f"{MISSING} steps/min")
        + f" · ETA {duration(pace['eta_s'])}"
    )


ECHO_CHARS = 80  # a value a message repeats is cut to this many characters


def clipped(value: Any, limit: int = ECHO_CHARS) -> str:
    """`value` as text for a message, cut after `limit` characters with its length said: a 10 MB string in a config
    file is named by its start, not echoed whole. An integer too long for Python to print (over 4,300 digits) is
    named by its size."""
    try:
        text = str(value)
    except ValueError:  # int's str limit (sys.set_int_max_str_digits): the number itself is the harm
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def estimator_label(estimator: Any, k: Any) -> str:
    """'qae K=0.4', or 'grpo' for an estimator without K (`qae runs`, the Runs table)."""
    k = as_float(k)
    return f"{estimator}" + ("" if k is None else f" K={k:g}")


def setup_label(setup: dict | None) -> str | None:
    """How a run was launched (its config's `distributed`, sharding.DistributedSetup): 'fsdp2 x 2 processes',
    'ddp x 4 processes on 2 machines', '1 process'; None for a run whose config holds none."""
    if not setup:
        return None
    n = setup.get("processes", 1)
    if n == 1:
        return "1 process"
    label = f"{setup.get('sharding')} x {n} processes"
    if (setup.get("machines") or 1) > 1:
        label += f" on {setup['machines']} machines"
    if setup.get("mixed_precision") not in (None, "no"):
        label += f", {setup['mixed_precision']} mixed precision"
    return label
