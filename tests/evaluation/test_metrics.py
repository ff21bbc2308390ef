"""pass@k against brute force over all k-subsets; avg@k and maj@k by hand."""

from itertools import combinations
from math import comb

import pytest

from qae_app.evaluation.metrics import avg_at_k, maj_at_k, pass_at_k, pass_k_values


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_large_n():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs contain the correct sample
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0
    # n large enough that the binomials overflow a float: the product form still agrees with exact integers
    n, c, k = 2000, 3, 100
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-9)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_invalid_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_k():
    assert avg_at_k([True, False, True, True]) == 0.75
    assert avg_at_k([False]) == 0.0
    with pytest.raises(ValueError):
        avg_at_k([])


def test_maj_at_k_majority_and_first_seen_tie_break():
    # "3" appears twice, "4" once: the majority answer "3" is correct
    assert maj_at_k(["3", "4", " 3 "], [True, False, True]) is True
    # tie between "4" (first seen) and "3": "4" wins, so the vote is wrong
    assert maj_at_k(["4", "3", "3", "4"], [False, True, True, False]) is False
    assert maj_at_k(["3", "4", "4", "3"], [True, False, False, True]) is True
    # None never wins, even when it is the most common "answer"
    assert maj_at_k([None, None, None, "7"], [False, False, False, True]) is True
    assert maj_at_k([None, "  "], [False, False]) is False
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True, False])


def test_pass_k_values():
    assert pass_k_values(1) == [1]
    assert pass_k_values(8) == [1, 2, 4, 8]
    assert pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(17) == [1, 2, 4, 8, 16, 17]
    with pytest.raises(ValueError):
        pass_k_values(0)
