"""Benchmark: what bounds the math verifier's cost on hostile batches.

    python bench/bench_verifier.py

Prints, measured in this run (no thresholds):
- answer extraction on a 2.5 MB response: reading only the tail (`FINAL_ANSWER_WINDOW`) against the whole text;
- answer extraction on the hostile texts of tests/rewards/test_rewards.py (the slowest), and on 10x more nested boxes
  within the window (linear grows ~10x, a rescan per box ~100x);
- replacing a killed worker: forked from the warm fork server against a fresh "spawn" (a sympy import);
- 16 distinct power towers + 16 honest answers on 2 workers with a 3 s timeout: the default batch bound against none.

The tail extraction, the slowest hostile text, the fork server's replacement and the bounded batch go to the results
log (bench/harness.py), without goals.
"""

from __future__ import annotations

import multiprocessing
import time

from harness import report

from qae_app.rewards import answers
from qae_app.rewards.answers import extract_answer
from qae_app.rewards.verifier_pool import MathVerifierPool

# the hostile texts of tests/rewards/test_rewards.py::test_extract_answer_on_hostile_text
HOSTILE_TEXTS = [
    "x" * 100_000 + "\\boxed{1}",
    "{" * 5000 + "\\boxed{" + "{" * 5000 + "1" + "}" * 4000,
    "\\boxed{" * 20_000,
    "answer is " * 20_000,
    "\\boxed{" + "9" * 10_000 + "}",
    "}" * 50_000 + "{" * 50_000,
]


def extraction_seconds(text: str, window: int) -> float:
    saved, answers.FINAL_ANSWER_WINDOW = answers.FINAL_ANSWER_WINDOW, window
    try:
        start = time.perf_counter()
        extract_answer(text)
        return time.perf_counter() - start
    finally:
        answers.FINAL_ANSWER_WINDOW = saved


def replacement_seconds(context_name: str | None, rounds: int = 3) -> float:
    """Median time from killing a ready worker to its replacement reporting ready."""
    pool = MathVerifierPool(num_workers=1, shortcuts=False)
    if context_name is not None:
        pool._context = multiprocessing.get_context(context_name)
    times = []
    with pool:
        pool.score(["\\boxed{1}"], ["1"])
        for _ in range(rounds):
            [worker] = pool._workers
            start = time.perf_counter()
            new = pool._replace(worker)
            assert new.conn.recv()[0] == "ready"
            new.ready = True
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def hostile_batch(batch_timeout_s: float | None) -> tuple[float, list, MathVerifierPool]:
    towers = [f"\\boxed{{{base}^{{9^{{9^{{9}}}}}}}}" for base in range(2, 18)]
    honest = [f"\\boxed{{\\frac{{{k}}}{{2}}}}" for k in range(1, 17)]
    responses = [r for pair in zip(towers, honest, strict=True) for r in pair]  # mixed, as a step's groups would be
    golds = [g for k in range(1, 17) for g in ("1", str(k / 2))]
    pool = MathVerifierPool(timeout_s=3.0, num_workers=2, shortcuts=False, batch_timeout_s=batch_timeout_s)
    with pool:
        pool.score(["\\boxed{1}"], ["1"])
        start = time.perf_counter()
        scores = pool.score(responses, golds)
        return time.perf_counter() - start, scores, pool


def main() -> None:
    text = "\\boxed{7}{" * 250_000 + "so the answer is \\boxed{\\frac{1}{2}}."
    tail, whole = extraction_seconds(text, answers.FINAL_ANSWER_WINDOW), extraction_seconds(text, len(text))
    print(
        f"extract_answer on {len(text) / 1e6:.1f} MB: tail {tail * 1000:.1f} ms, whole text {whole * 1000:.0f} ms "
        f"({whole / tail:.0f}x)"
    )
    slowest = max(min(extraction_seconds(t, answers.FINAL_ANSWER_WINDOW) for _ in range(3)) for t in HOSTILE_TEXTS)
    nested = [min(extraction_seconds("\\boxed{" * n + "{" * n, 10**9) for _ in range(3)) for n in (500, 5_000)]
    print(
        f"extract_answer on {len(HOSTILE_TEXTS)} hostile texts: slowest {slowest * 1000:.1f} ms; nested boxes 500 -> "
        f"5,000: {nested[0] * 1000:.2f} -> {nested[1] * 1000:.1f} ms ({nested[1] / nested[0]:.0f}x for 10x the text)"
    )
    forked, spawned = replacement_seconds(None), replacement_seconds("spawn")
    print(
        f"worker replacement: fork server {forked * 1000:.0f} ms, spawn {spawned * 1000:.0f} ms "
        f"({spawned / forked:.0f}x)"
    )
    batch = {}
    for label, bound in (("default bound", None), ("no bound", 1e9)):
        seconds, scores, pool = hostile_batch(bound)
        honest_scored = sum(score == 1.0 for score in scores[1::2])
        batch[label] = (
            f"{seconds:.1f} s, honest scored {honest_scored}/16, towers timed out {pool.timeouts}, cut off "
            f"{pool.batch_cutoffs}, workers started {pool.workers_started}"
        )
        print(f"16 towers + 16 honest, {label}: {batch[label]}")
        if bound is None:
            bounded_s = seconds
    report(
        f"bench_verifier: extract_answer on {len(text) / 1e6:.1f} MB, tail only",
        round(tail * 1e3, 3),
        None,
        unit="ms",
        note=f"whole text {whole * 1e3:.0f} ms",
    )
    report(
        f"bench_verifier: extract_answer, slowest of {len(HOSTILE_TEXTS)} hostile texts",
        round(slowest * 1e3, 3),
        None,
        unit="ms",
        note=f"nested boxes 500 -> 5,000: {nested[0] * 1e3:.2f} -> {nested[1] * 1e3:.1f} ms",
    )
    report(
        "bench_verifier: worker replacement from the fork server",
        round(forked * 1e3, 1),
        None,
        unit="ms",
        note=f"spawn {spawned * 1e3:.0f} ms",
    )
    report(
        "bench_verifier: 16 power towers + 16 honest answers, 2 workers, default batch bound",
        round(bounded_s, 2),
        None,
        unit="s",
        note="; ".join(f"{label}: {line}" for label, line in batch.items()),
    )


if __name__ == "__main__":
    main()
