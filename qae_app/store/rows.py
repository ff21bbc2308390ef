"""What one RL step stores, built from plain Python values: the `groups` and `rollouts` rows (columns: schema.TABLES)
and the step metrics computed from those rows (names: schema.STEP_METRICS).

Pure and torch-free, so the metrics the dashboard or a test recomputes from stored rows are, by construction, the ones
that were logged.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from qae_app.core.names import NO_SIGNAL_REGIMES, REGIMES


@dataclass
class GroupResult:
    """One prompt of a step and what happened to its G responses (everything a row needs, as plain values)."""

    group_idx: int  # position of the prompt in the step (global over processes)
    prompt_id: str
    prompt: str
    answer: str
    baseline: float
    regime: str  # a names.REGIMES key
    responses: list[str]  # [G]
    rewards: list[float]  # [G], shaped (reward values, overlong penalty); unverifiable responses count as wrong
    correct: list[bool]  # [G], the verifier's verdicts
    verified: list[bool]  # [G]
    advantages: list[float]  # [G], what the estimator gives (also for a filtered group, which is not trained)
    n_tokens: list[int]  # [G]
    truncated: list[bool]  # [G]
    entropies: list[float | None]  # [G], mean token entropy of each response; None if filtered and not measured
    logprobs: list[float | None]  # [G], sum of token log-probs of each response; None if filtered and not measured
    filtered: bool = False  # left out of the update by dynamic sampling
    model_prompt: str | None = None  # the prompt with the chat template applied, as the model saw it; None without one
    # reward component -> [G] each response's value (None: could not verify); empty unless the run stores them
    components: dict[str, list[float | None]] = field(default_factory=dict)
    # reward component -> [G] its weighted part of each response's reward (what the total sums; store/signal.py)
    parts: dict[str, list[float]] = field(default_factory=dict)
    # [G] mean |logp_old - logp_sampler| over each response's tokens; None where either is missing
    mismatch: list[float | None] | None = None
    # [G] each response's per-token values (store/tokens.py: tokens, logprob, entropy, old_logprob) where the store
    # keeps them (--store-tokens), else None
    token_values: list[dict | None] | None = None


def group_rows(groups: Sequence[GroupResult]) -> list[dict]:
    return [
        {
            "group_idx": g.group_idx,
            "prompt_id": g.prompt_id,
            "prompt": g.prompt,
            "answer": g.answer,
            "n_correct": sum(g.correct),
            "group_size": len(g.rewards),
            "baseline": g.baseline,
            "regime": g.regime,
            "filtered": g.filtered,
            "model_prompt": g.model_prompt,
        }
        for g in groups
    ]


def rollout_rows(groups: Sequence[GroupResult]) -> list[dict]:
    return [
        {
            "group_idx": g.group_idx,
            "sample_idx": i,
            "prompt_id": g.prompt_id,
            "response": g.responses[i],
            "reward": g.rewards[i],
            "correct": g.correct[i],
            "verified": g.verified[i],
            "advantage": g.advantages[i],
            "gated": g.advantages[i] == 0.0,
            "regime": g.regime,
            "n_tokens": g.n_tokens[i],
            "truncated": g.truncated[i],
            "entropy": g.entropies[i],
            "logprob": g.logprobs[i],
            "filtered": g.filtered,
            "mismatch": g.mismatch[i] if g.mismatch is not None else None,
        }
        for g in groups
        for i in range(len(g.rewards))
    ]


def component_rows(groups: Sequence[GroupResult]) -> list[dict]:
    """The `reward_components` rows: one per response and component."""
    return [
        {"group_idx": g.group_idx, "sample_idx": i, "name": name, "value": values[i]}
        for g in groups
        for name, values in g.components.items()
        for i in range(len(values))
    ]


STORE_RESPONSES_HELP = (
    "What the store keeps of the responses' text: all, N per group (chosen by a seeded draw, "
    "the same on a rerun), or none. Every response's row (reward, advantage, gated, tokens) is "
    "kept either way, so counts stay exact; a text not kept is NULL."
)


def check_store_responses(value: str) -> str:
    """`value` if --store-responses can take it (all, none, or a whole number >= 1); else an error's text."""
    if value in ("all", "none") or (value.isdigit() and int(value) >= 1):
        return value
    raise ValueError(
        f"store-responses: '{value}' is not all, none or a whole number of responses per group (>= 1). "
        "Use all (the default), e.g. 4 to keep 4 texts a group, or none."
    )


def stored_responses(rollouts: list[dict], keep: str, seed: int, step: int) -> list[dict]:
    """The rollout rows with the response text the store keeps (`keep`: all, none or N per group). N per group are
    drawn with a generator seeded by (seed, step, group), so a rerun keeps the same ones whatever the order of rows;
    the others' `response` is None. Every row stays: counts of gated, kept and correct responses are exact."""
    if keep == "all":
        return rollouts
    per_group = 0 if keep == "none" else int(keep)
    samples: dict[int, list[int]] = {}
    for row in rollouts:
        samples.setdefault(row["group_idx"], []).append(row["sample_idx"])
    kept = {
        (group, i)
        for group, indexes in samples.items()
        for i in random.Random(f"{seed}:{step}:{group}").sample(sorted(indexes), min(per_group, len(indexes)))
    }
    return [row if (row["group_idx"], row["sample_idx"]) in kept else {**row, "response": None} for row in rollouts]


def step_metrics(group_rows: list[dict], rollout_rows: list[dict]) -> dict:
    """The metrics of one step that follow from its rows (the rest come from the update and the clock).

    What was sampled (reward, accuracy, lengths, regimes, filtered) counts every row; what the update saw (entropy,
    advantages, covariance) counts the rows that were not filtered out by dynamic sampling (schema.STEP_METRICS)."""
    n = len(rollout_rows)
    trained = [r for r in rollout_rows if not r["filtered"]]
    n_trained = len(trained)
    tokens = sum(r["n_tokens"] for r in trained)
    adv = [r["advantage"] for r in trained]

    def token_mean(rows):
        count = sum(r["n_tokens"] for r in rows)
        return sum(r["entropy"] * r["n_tokens"] for r in rows) / count if count else math.nan

    def share(count: int, total: int) -> float:
        return count / total if total else math.nan

    # covariance over tokens of token log-prob and its sequence's advantage (logprob is the sequence's sum)
    if tokens:
        mean_logp = sum(r["logprob"] for r in trained) / tokens
        mean_adv = sum(r["advantage"] * r["n_tokens"] for r in trained) / tokens
        cov = sum(r["advantage"] * r["logprob"] for r in trained) / tokens - mean_logp * mean_adv
    else:
        cov = math.nan
    regimes = [g["regime"] for g in group_rows]
    informative = [r for r in trained if r["regime"] not in NO_SIGNAL_REGIMES]
    return {
        "reward_mean": sum(r["reward"] for r in rollout_rows) / n,
        "accuracy": sum(bool(r["correct"]) for r in rollout_rows) / n,
        "entropy": token_mean(trained),
        "entropy_pos": token_mean([r for r in trained if r["advantage"] > 0]),
        "entropy_neg": token_mean([r for r in trained if r["advantage"] < 0]),
        "frac_zero_adv": share(sum(a == 0.0 for a in adv), n_trained),
        "frac_zero_adv_informative": share(sum(r["advantage"] == 0.0 for r in informative), len(informative)),
        **{f"frac_{name}": regimes.count(name) / len(regimes) for name in REGIMES},
        "frac_unverified": sum(not r["verified"] for r in rollout_rows) / n,
        "frac_filtered": sum(bool(g["filtered"]) for g in group_rows) / len(group_rows),
        "cov_logp_adv": cov,
        "adv_abs_mean": share(sum(abs(a) for a in adv), n_trained),
        "response_len": sum(r["n_tokens"] for r in rollout_rows) / n,
        "truncated_frac": sum(r["truncated"] for r in rollout_rows) / n,
    }
