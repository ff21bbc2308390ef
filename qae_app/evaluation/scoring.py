"""Scoring a run's responses as the run does: which rewards (--reward, else the task's own) and one generation
batch scored into the shaped rewards, verdicts and components a step stores. `qae train` and `qae preview` both score
through here, so a preview sees the rewards its run would."""

from __future__ import annotations

from dataclasses import dataclass

from qae_app.config import TrainConfig
from qae_app.core import names
from qae_app.rewards.registry import RewardSet
from qae_app.rewards.scorer import overlong_penalty


def run_rewards(cfg: TrainConfig, reward: str) -> RewardSet:
    """The rewards a run (or its --eval-every evaluation, whose task may name another `reward`) scores with."""
    return RewardSet.of(cfg.reward, cfg.reward_weights, reward, cfg.verify_timeout_s,
                        names.reward_values(cfg.reward_values))


@dataclass
class ScoredBatch:
    """One generation batch's responses, scored: [B * G] each, sample j of prompt i at i * G + j."""

    rewards: list[float]  # the total plus the overlong penalty: what the estimator sees
    correct: list[bool]  # full marks (registry.RewardSet.correct)
    verified: list[bool]  # no component None
    components: dict[str, list[float | None]]  # what the store keeps per response (empty: not stored)
    warning: dict | None  # a `warnings` row: responses a user function did not score in time


def score_batch(rewards: RewardSet, cfg: TrainConfig, samples: list, problems: list, prompts: list[str],
                step: int) -> ScoredBatch:
    """Score a batch's `samples` (each with prompt_index into `problems` and `prompts`, its text and token ids)."""
    asked = [s.prompt_index for s in samples]
    totals, components = rewards.score([s.text for s in samples], [prompts[i] for i in asked],
                                       [problems[i] for i in asked], step)
    shaped = [total + overlong_penalty(len(s.response_ids), cfg.max_new_tokens, cfg.overlong_buffer,
                                       cfg.overlong_penalty) for total, s in zip(totals, samples)]
    return ScoredBatch(shaped, rewards.correct(components), rewards.verified(components),
                       components if cfg.reward is not None else {}, rewards.timeout_warning(step, len(samples)))
