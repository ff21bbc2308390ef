"""bench/harness.py's paired timing, what every paired benchmark reports with: which side runs first, the per-pair
ratios and their spread, on hand-computed cases (the benchmarks themselves are not tests: no wall-clock bound
anywhere)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import harness  # noqa: E402


def test_sides_alternate_which_runs_first():
    calls = []
    a, b = harness.alternate(
        lambda i: calls.append(("a", i)) or 2.0 * (i + 1), lambda i: calls.append(("b", i)) or 4.0 * (i + 1), 3
    )
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert (a, b) == ([2.0, 4.0, 6.0], [4.0, 8.0, 12.0])
    assert harness.pair_ratios(a, b) == [0.5, 0.5, 0.5]


def test_spread_is_median_quartiles_and_extremes_of_the_pairs():
    # sorted 0.2 0.3 0.4 0.5 0.9: inclusive quartiles at positions 1 and 3 (of 0..4)
    s = harness.spread([0.5, 0.2, 0.9, 0.4, 0.3])
    assert (s.median, s.low_quartile, s.high_quartile, s.low, s.high, s.pairs) == (0.4, 0.3, 0.5, 0.2, 0.9, 5)
    assert harness.describe([0.5, 0.2, 0.9, 0.4, 0.3]) == "0.40x (middle half 0.30-0.50, min-max 0.20-0.90, 5 pairs)"
    assert harness.describe([0.30, 0.40]) == "0.35x (per pair 0.30, 0.40)"


def test_unpaired_timings_are_refused():
    with pytest.raises(ValueError, match="same, non-zero count"):
        harness.pair_ratios([1.0, 2.0], [1.0])
