"""Paired timing for the benchmarks that compare two sides (A against B): run them alternately, one pair at a time,
and report the median of the per-pair ratios A/B with its spread.

Why pairs: on a shared machine the load drifts over minutes. Running every A and then every B puts that drift on one
side only; a pair's two timings are seconds apart, so their ratio is what the load leaves alone, and the spread of
the ratios over pairs says how much to believe the median. Within a pair the order alternates (A then B, then B then
A), so neither side always runs second (a warm cache, a finished background job).

    ratios = pair_ratios(a_times, b_times)          # a_times[i] and b_times[i] measured next to each other
    print(f"gated / dense {describe(ratios)}")       # "0.33x (middle half 0.28-0.38, min-max 0.21-0.45, 20 pairs)"
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def pair_order(index: int) -> tuple[int, int]:
    """Which side runs first in pair `index`: (0, 1) for even pairs, (1, 0) for odd ones."""
    return (0, 1) if index % 2 == 0 else (1, 0)


def alternate(side_a: Callable[[int], float], side_b: Callable[[int], float], pairs: int
              ) -> tuple[list[float], list[float]]:
    """Run `side_a(i)` and `side_b(i)` for i in range(pairs), in the order pair_order(i) gives; each returns the
    seconds it measured. Returns (a_times, b_times), pair by pair."""
    sides = (side_a, side_b)
    times: tuple[list[float], list[float]] = ([], [])
    for index in range(pairs):
        for which in pair_order(index):
            times[which].append(sides[which](index))
    return times


def pair_ratios(a_times: Sequence[float], b_times: Sequence[float]) -> list[float]:
    """a_times[i] / b_times[i] for each pair."""
    if len(a_times) != len(b_times) or not a_times:
        raise ValueError(f"paired timings need the same, non-zero count on both sides: {len(a_times)} and "
                         f"{len(b_times)}")
    return [a / b for a, b in zip(a_times, b_times)]


@dataclass(frozen=True)
class RatioSpread:
    median: float
    low_quartile: float  # the middle half of the per-pair ratios lies between the quartiles
    high_quartile: float
    low: float
    high: float
    pairs: int


def spread(ratios: Sequence[float]) -> RatioSpread:
    """Median, quartiles (statistics.quantiles, inclusive method) and extremes of per-pair ratios."""
    if len(ratios) == 1:
        (only,) = ratios
        return RatioSpread(only, only, only, only, only, 1)
    low_quartile, _, high_quartile = statistics.quantiles(ratios, n=4, method="inclusive")
    return RatioSpread(statistics.median(ratios), low_quartile, high_quartile, min(ratios), max(ratios), len(ratios))


def describe(ratios: Sequence[float]) -> str:
    """'0.33x (middle half 0.28-0.38, min-max 0.21-0.45, 20 pairs)'; with fewer than 4 pairs the ratios themselves."""
    s = spread(ratios)
    if s.pairs < 4:
        return f"{s.median:.2f}x (per pair {', '.join(f'{r:.2f}' for r in ratios)})"
    return (f"{s.median:.2f}x (middle half {s.low_quartile:.2f}-{s.high_quartile:.2f}, min-max {s.low:.2f}-"
            f"{s.high:.2f}, {s.pairs} pairs)")
