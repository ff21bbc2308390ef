"""A run's task and rewards as the run has them: its data loaded with its prompt template and only the columns its
rewards need (a user's reward may need no gold answer), which rewards (--reward, else the task's own), and one
generation batch scored into the shaped rewards, verdicts and components a step stores. `qae train`, `qae preview` and
`qae sweep` load and score through here, so a preview sees the prompts and rewards its run would."""

from __future__ import annotations

from dataclasses import dataclass, field

from qae_app.config import TrainConfig
from qae_app.core import names
from qae_app.data.datasets import Problem
from qae_app.data.prompt_format import Prompt, prompt_text, sends_row_messages
from qae_app.data.tasks import Task, load_benchmark, load_task
from qae_app.rewards.builtin_verifiers import overlong_penalty
from qae_app.rewards.registry import RewardSet
from qae_app.rewards.specs import reads_gold_answer


def run_task(cfg: TrainConfig) -> Task:
    """The run's training task: --data with its held-out split, prompted by --prompt-template / --system-prompt, its
    rows' gold answers required only where the rewards read them."""
    return load_task(
        cfg.data,
        cfg.heldout_fraction,
        cfg.seed,
        prompt_format=cfg.prompt_format,
        require_answer=reads_gold_answer(cfg.reward),
        heldout_by=cfg.heldout_by,
    )


def run_benchmark(cfg, bench: str, option: str) -> tuple[str, list[Problem], Task]:
    """What the run's evaluation (`cfg`: a TrainConfig's --eval-bench, or `qae eval`'s EvalConfig --bench) reads,
    prompted and answered as `run_task`."""
    return load_benchmark(bench, option, cfg.prompt_format, require_answer=reads_gold_answer(cfg.reward))


def run_rewards(cfg: TrainConfig, reward: str) -> RewardSet:
    """The rewards a run (or its --eval-every evaluation, whose task may name another `reward`) scores with."""
    return RewardSet.of(
        cfg.reward, cfg.reward_weights, reward, cfg.verify_timeout_s, names.reward_values(cfg.reward_values)
    )


def reward_prompt(prompt: Prompt, problem) -> Prompt:
    """A prompt as rewards get it, as TRL gives it: the row's own chat messages where the model was sent them
    (conversational data, a --system-prompt message first or not), else the text a model without a chat template
    reads (registry.reward_inputs then gives the completion the same form)."""
    return [dict(message) for message in prompt] if sends_row_messages(prompt, problem) else prompt_text(prompt)


@dataclass
class ScoredBatch:
    """One generation batch's responses, scored: [B * G] each, sample j of prompt i at i * G + j."""

    rewards: list[float]  # the total plus the overlong penalty: what the estimator sees
    correct: list[bool]  # full marks (registry.RewardSet.correct)
    verified: list[bool]  # no component None
    components: dict[str, list[float | None]]  # what the store keeps per response (empty: not stored)
    warning: dict | None  # a `warnings` row: responses a user function did not score in time
    parts: dict[str, list[float]] = field(default_factory=dict)  # each stored component's weighted part of the total
    weights: dict[str, float] = field(default_factory=dict)  # each stored component's weight


def score_batch(
    rewards: RewardSet, cfg: TrainConfig, samples: list, problems: list, prompts: list, step: int
) -> ScoredBatch:
    """Score a batch's `samples` (each with prompt_index into `problems` and `prompts`, its text and token ids)."""
    asked = [s.prompt_index for s in samples]
    totals, components = rewards.score(
        [s.text for s in samples],
        [reward_prompt(prompts[i], problems[i]) for i in asked],
        [problems[i] for i in asked],
        step,
        [s.response_ids for s in samples],
    )
    shaped = [
        total + overlong_penalty(len(s.response_ids), cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        for total, s in zip(totals, samples, strict=True)
    ]
    stored = cfg.reward is not None
    return ScoredBatch(
        shaped,
        rewards.correct(components),
        rewards.verified(components),
        components if stored else {},
        rewards.timeout_warning(step, len(samples)),
        rewards.parts(components) if stored else {},
        {name: rewards.weight_of[name] for name in components} if stored else {},
    )
