"""Evaluation metrics over the k samples drawn for one problem.

| metric   | meaning                                                                                              |
|----------|------------------------------------------------------------------------------------------------------|
| pass@k   | chance that at least one of k samples is correct; unbiased from n >= k samples, c correct (Chen 2021) |
| avg@k    | fraction of the k samples that are correct (mean accuracy)                                            |
| maj@k    | whether the most frequent extracted answer among the k samples is correct (majority vote)            |

Averaging each over problems gives the benchmark number.
"""

from __future__ import annotations

from collections import Counter


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which stays exact-ish for large n where the binomials overflow.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} correct out of n={n} samples; need 0 <= c <= n")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} with n={n} samples; need 1 <= k <= n (draw at least k samples)")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def avg_at_k(correct: list[bool]) -> float:
    """Mean accuracy over the samples."""
    if not correct:
        raise ValueError("avg_at_k: no samples; need at least one")
    return sum(bool(x) for x in correct) / len(correct)


def maj_at_k(answers: list[str | None], correct: list[bool]) -> bool:
    """Whether the majority-vote answer is correct.

    `answers[i]` is the answer extracted from sample i (None if none was found), `correct[i]` its verdict. Answers
    are compared after stripping whitespace; None and empty answers never win. A tie goes to the tied answer that
    appears first in sample order (deterministic). The verdict is that of the first sample carrying the winning
    answer. False when no sample has an answer.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} answers but {len(correct)} verdicts; pass one per sample")
    normalized = [a.strip() if a is not None else "" for a in answers]
    counts = Counter(a for a in normalized if a)
    if not counts:
        return False
    best = max(counts.values())
    first = next(i for i, a in enumerate(normalized) if a and counts[a] == best)  # earliest of the most frequent
    return bool(correct[first])


def pass_k_values(k: int) -> list[int]:
    """The k's to report up to k: powers of two <= k, plus k itself. pass_k_values(6) == [1, 2, 4, 6]."""
    if k < 1:
        raise ValueError(f"pass_k_values: k={k}; need k >= 1")
    values = []
    power = 1
    while power <= k:
        values.append(power)
        power *= 2
    if values[-1] != k:
        values.append(k)
    return values
