"""Reward functions: score a policy's responses against gold answers.

Contract (open-r1 style): a reward function maps `(responses: list[str], answers: list[str]) -> list[float | None]`,
one score per response. `None` means "could not verify" (the verifier timed out or crashed); the caller counts
those and never treats them as a silent 0.

| name          | scores                                                                                         |
|---------------|------------------------------------------------------------------------------------------------|
| `exact_int`   | built-in arithmetic task: 1.0 when the stripped response is exactly the gold integer, else 0.0 |
| `chain_final` | built-in chain task: 1.0 when the integer after the last " so " is exactly the gold integer,   |
|               | else 0.0; the scratchpad before it is not checked                                              |
| `math`        | math files: the last `\\boxed{...}` (or a final "answer is X" line) checked with math-verify   |
| `final_number`| built-in `add` task (instruct models answering in words): the number on the last `Answer: N`    |
|               | line, else the last number of the response, checked with math-verify                          |

`math` and `final_number` are scored by worker processes (`MathVerifierPool`, qae_app/rewards/verifier_pool.py:
math-verify can hang, so each item has a hard deadline) that every `BuiltinVerifier` starts and closes itself; the
answers each reward reads are extracted in qae_app/rewards/answers.py."""

from __future__ import annotations

from collections.abc import Callable

from qae_app.core.errors import QAEUserError
from qae_app.rewards.answers import INTEGER_RE, chain_final_answer, check_lengths, extract_answer, final_number_answer
from qae_app.rewards.verifier_pool import MathVerifierPool

RewardFunction = Callable[[list[str], list[str]], list[float | None]]


# ---------------------------------------------------------------------------------------------------------------
# exact_int: the built-in arithmetic task


def exact_int_reward(responses: list[str], answers: list[str]) -> list[float | None]:
    """1.0 when the response, stripped of whitespace, is exactly the gold integer string; else 0.0. Never None."""
    check_lengths(responses, answers)
    return [
        1.0 if INTEGER_RE.fullmatch(r.strip()) and r.strip() == a.strip() else 0.0
        for r, a in zip(responses, answers, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------------------
# chain_final: the built-in chain task


def chain_final_reward(responses: list[str], answers: list[str]) -> list[float | None]:
    """Final answer only: 1.0 when `chain_final_answer` is exactly the gold integer string; else 0.0 (no marker, or
    not an integer after it). Never None.

    The scratchpad before the marker is not read: `1+1=3 so 2` scores 1 for gold 2, as outcome rewards do."""
    check_lengths(responses, answers)
    scores: list[float | None] = []
    for response, answer in zip(responses, answers, strict=True):
        final = chain_final_answer(response)
        scores.append(1.0 if final is not None and INTEGER_RE.fullmatch(final) and final == answer.strip() else 0.0)
    return scores


# ---------------------------------------------------------------------------------------------------------------
# Registry

# name -> reward function. `math` and `final_number` have none: worker processes score them (MathVerifierPool), which
# each BuiltinVerifier starts and closes itself, so that no pool outlives the run that uses it.
REWARD_FUNCTIONS: dict[str, RewardFunction | None] = {
    "exact_int": exact_int_reward,
    "chain_final": chain_final_reward,
    "math": None,
    "final_number": None,
}


# the part of a response each reward reads as its answer: what maj@k votes on (qae eval's `extracted` column)
ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "exact_int": lambda response: response.strip(),  # the whole response is the answer
    "chain_final": chain_final_answer,
    "math": extract_answer,
    "final_number": final_number_answer,
}


def get_reward_function(name: str) -> RewardFunction | None:
    """The reward function of `name` (None for `math` and `final_number`: only a BuiltinVerifier, with its own pool,
    scores them)."""
    if name not in REWARD_FUNCTIONS:
        raise QAEUserError(f"reward: unknown reward function '{name}'. Choose one of: {', '.join(REWARD_FUNCTIONS)}.")
    return REWARD_FUNCTIONS[name]


class BuiltinVerifier:
    """A built-in reward function, with its own verifier pool when it needs one; use as a context manager.

    `BuiltinVerifier("math", timeout_s=3)` owns a `MathVerifierPool` with that per-item deadline, checking the answer
    that `ANSWER_EXTRACTORS[name]` reads (so does `final_number`); other rewards run inline.
    """

    def __init__(self, name: str, timeout_s: float = 3.0):
        self.name = name
        self.pool = (
            MathVerifierPool(timeout_s=timeout_s, extract=ANSWER_EXTRACTORS[name])
            if name in REWARD_FUNCTIONS and REWARD_FUNCTIONS[name] is None
            else None
        )
        self.fn = self.pool.score if self.pool is not None else get_reward_function(name)

    def __call__(self, responses: list[str], answers: list[str]) -> list[float | None]:
        """Scores, or `ScoringInterrupted` when `interrupt()` cut the call short (never a partial list)."""
        return self.fn(responses, answers)

    def interrupt(self) -> None:
        """Shutting down: the scoring call in progress (or the next) raises `ScoringInterrupted` within ~0.1 s.
        Safe from a signal handler. Inline rewards (exact_int) finish at once and have nothing to interrupt."""
        if self.pool is not None:
            self.pool.interrupt()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> BuiltinVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------------------
# From verdicts to rewards: the reward values (names.REWARD_VALUES) and DAPO's overlong penalty


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens: 0 up to max_new_tokens - buffer tokens, then
    falling linearly to -factor at max_new_tokens, `min(0, -(length - (max_new_tokens - buffer)) / buffer * factor)`.
    buffer 0: no penalty."""
    if buffer <= 0:
        return 0.0
    return min(0.0, -(length - (max_new_tokens - buffer)) / buffer * factor)


def shape_rewards(
    scores: list[float | None],
    lengths: list[int],
    values: tuple[float, float],
    max_new_tokens: int,
    buffer: int = 0,
    factor: float = 1.0,
) -> tuple[list[float], list[bool]]:
    """(rewards, correct) of responses from the verifier's scores (1.0, 0.0, or None: unverifiable, counted wrong)
    and their lengths in tokens: `values` = (wrong, correct) reward, plus the overlong penalty."""
    if len(scores) != len(lengths):
        raise ValueError(f"{len(scores)} scores for {len(lengths)} lengths")
    correct = [score == 1.0 for score in scores]
    wrong_value, correct_value = values
    rewards = [
        (correct_value if ok else wrong_value) + overlong_penalty(length, max_new_tokens, buffer, factor)
        for ok, length in zip(correct, lengths, strict=True)
    ]
    return rewards, correct
