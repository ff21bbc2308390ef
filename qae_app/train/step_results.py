"""What a step produces: its sampled and scored batches (`GenerationBatch`, `SampledStep`), what its update reports
(`StepUpdate`), its output for the store (`StepOutput`, `step_tables`); and what it reports of its groups:
`group_results` turns the step's generation batches, advantages and the update's no-grad pass into one `GroupResult`
per group (plain Python values, what the store's rows are made of)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qae_app.algo.advantages import REGIMES
from qae_app.data.prompt_format import prompt_text
from qae_app.store.rows import GroupResult, component_rows, group_rows, rollout_rows, stored_responses
from qae_app.store.signal import component_signal_rows
from qae_app.store.tokens import token_rows
from qae_app.train.token_values import TrainerTokens
from qae_app.train.update import UpdateResult


@dataclass
class StepOutput:
    """Everything one RL step produced; `fit` alone writes it."""

    metrics: dict  # one `steps` row (STEP_METRICS names; heldout_accuracy filled in by fit)
    groups: list[dict]  # B `groups` rows, gathered from every process
    rollouts: list[dict]  # B * G `rollouts` rows
    warnings: list[dict] = field(default_factory=list)  # `warnings` rows: kind, message
    components: list[dict] = field(default_factory=list)  # `reward_components` rows (with --reward)
    chosen_k: float | None = None  # the K that --k auto picked at this step, if it did
    signal: list[dict] = field(default_factory=list)  # `component_signal` rows (with --reward)
    tokens: list[dict] = field(default_factory=list)  # `token_values` rows (--store-tokens)


@dataclass
class GenerationBatch:
    """This process's share of one generation batch (prompts_per_step prompts) of a step, sampled and scored."""

    index: int  # 0 for a step's first batch; more with dynamic sampling
    first_group: int  # step-wide group_idx of this process's first group: index * prompts_per_step + its offset
    problems: list  # [B] tasks.Problem
    prompts: list  # [B] data.prompt_format.Prompt: text or chat messages, as the engine was given them
    samples: list  # [B * G] engines.base.Sample, sample j of prompt i at i * G + j
    verified: list[bool]  # [B * G] the verifier gave a verdict
    rewards: torch.Tensor  # (B, G) shaped: reward values plus the overlong penalty
    correct: torch.Tensor  # (B, G) bool, the verifier's verdicts
    components: dict = field(default_factory=dict)  # name -> [B * G] each response's value (stored with --reward)
    reward_warning: dict | None = None  # a user reward left responses unscored at the deadline
    parts: dict = field(default_factory=dict)  # name -> [B * G] each component's weighted part of the reward
    weights: dict = field(default_factory=dict)  # name -> its weight


@dataclass
class SampledStep:
    """This process's share of one step's responses, sampled and scored: every generation batch's, in order."""

    batches: list[GenerationBatch]
    trained: list[bool]  # [B] which of this process's groups train (dynamic sampling filters out the others)
    n_trained: int  # the groups that train, over every process
    rewards: torch.Tensor  # (B, G) shaped rewards of this process's groups of every batch, in order
    correct: torch.Tensor  # (B, G) bool
    samples: list  # [B * G] engines.base.Sample, sample j of group i at i * G + j
    trained_samples: list  # [N] the samples of the trained groups, in order
    # the engine measured every response's token entropies and log-probs while sampling (the filtered ones' too);
    # else the rows take the trained ones' from the update's no-grad pass
    engine_measured: bool
    rollout_s: float
    reward_s: float
    cap_warning: dict | None  # the `warnings` row when dynamic sampling found too few groups with signal
    kept_tokens: set[int] | None = None  # step-wide response indexes whose per-token values are stored (None: all)
    weights: dict = field(default_factory=dict)  # each reward component's weight (with --reward)


@dataclass
class StepUpdate:
    """What the step's update reports for the step's rows."""

    stats: dict  # its columns of the `steps` row: NO_UPDATE's names, dH's, the attribution's, lr
    # per trained response, in order, from the update's no-grad pass: mean token entropy, summed log-prob (None: the
    # engine measured them, or this process trained no response)
    response_stats: tuple[list[float], list[float]] | None = None
    tokens: TrainerTokens = field(default_factory=TrainerTokens)  # the update's per-token numbers of kept responses


@dataclass
class HeldoutEval:
    accuracy: float  # avg@k on the whole benchmark
    evals: list[dict]  # `evals` rows
    samples: list[dict]  # `eval_samples` rows


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    steps_done: int
    status: str  # finished, interrupted (Ctrl-C / SIGTERM / SIGHUP; resumable)


def step_tables(
    out: StepOutput | None, heldout: HeldoutEval | None, keep: str = "all", seed: int = 0, step: int = 0
) -> dict[str, list[dict]]:
    """What `fit` hands the store for one step (step 0: the evaluation before training), by table; the response
    texts as --store-responses `keep` says (every row stays, so counts are exact)."""
    tables = {}
    if out is not None:
        tables.update(
            steps=[out.metrics],
            groups=out.groups,
            rollouts=stored_responses(out.rollouts, keep, seed, step),
            warnings=out.warnings,
            **({"reward_components": out.components} if out.components else {}),
            **({"component_signal": out.signal} if out.signal else {}),
            **({"token_values": out.tokens} if out.tokens else {}),
        )
    if heldout is not None:
        tables.update(evals=heldout.evals, eval_samples=heldout.samples)
    return tables


@dataclass
class StepRows:
    """A step's rows of every process (gathered on the main one), in group_idx order, by table."""

    groups: list[dict]  # `groups`
    rollouts: list[dict]  # `rollouts`
    components: list[dict]  # `reward_components`
    signal: list[dict]  # `component_signal`
    tokens: list[dict]  # `token_values`


def step_rows(results: list[GroupResult], weights: dict[str, float]) -> StepRows:
    """The rows of a step's groups (`weights`: each reward component's)."""
    return StepRows(
        group_rows(results),
        rollout_rows(results),
        component_rows(results),
        component_signal_rows(results, weights),
        token_rows(results),
    )


def group_results(
    batches: list,
    trained: list[bool],
    adv,
    rewards,
    correct,
    group_size: int,
    from_engine: bool,
    pass_stats,
    tokens: TokenSources | None = None,
) -> list[GroupResult]:
    """This process's groups of every generation batch, in order (`trained` (B,), `adv`, `rewards` and `correct`
    (B, G): one entry per group). A response's mean token entropy and summed log-prob come from the engine when it
    measured them while sampling (`from_engine`), else from the no-grad pass over the trained responses
    (`pass_stats`: two lists, one value per trained response, in order); a filtered group the engine did not measure
    never went through the model, and gets None. A batch's reward components (`components`, [B * G] per name) and
    their weighted parts go with their group, where the run stores them (--reward given); `tokens`: what the store
    keeps per token, and of whom."""
    G = group_size
    # each tensor to Python values once, not an item() or tolist() per group: the same values
    baselines, regimes, advantages = adv.baseline.tolist(), adv.regime.tolist(), adv.advantages.tolist()
    rewards, correct = rewards.tolist(), correct.tolist()
    results, local, done = [], 0, 0  # local: group index over all batches; done: trained groups seen
    for b in batches:
        for i, problem in enumerate(b.problems):
            group = b.samples[i * G : (i + 1) * G]
            first_trained = done * G if trained[local] else None  # its first response's row in the update
            if from_engine:
                entropies = [sum(s.token_entropies) / max(len(s.token_entropies), 1) for s in group]
                logprobs = [sum(s.token_logprobs) for s in group]
            elif trained[local]:
                entropies, logprobs = (stats[done * G : (done + 1) * G] for stats in pass_stats)
            else:
                entropies = logprobs = [None] * G
            done += trained[local]
            result = GroupResult(
                group_idx=b.first_group + i,
                prompt_id=problem.prompt_id,
                prompt=prompt_text(b.prompts[i]),
                answer=problem.answer,
                baseline=baselines[local],
                regime=REGIMES[regimes[local]],
                responses=[s.text for s in group],
                rewards=rewards[local],
                correct=correct[local],
                verified=b.verified[i * G : (i + 1) * G],
                advantages=advantages[local],
                n_tokens=[len(s.response_ids) for s in group],
                truncated=[s.truncated for s in group],
                entropies=entropies,
                logprobs=logprobs,
                filtered=not trained[local],
                model_prompt=group[0].model_prompt,
                components={name: values[i * G : (i + 1) * G] for name, values in b.components.items()},
                parts={name: values[i * G : (i + 1) * G] for name, values in b.parts.items()},
            )
            if tokens is not None:
                tokens.fill(result, group, first_trained)
            results.append(result)
            local += 1
    return results


@dataclass
class TokenSources:
    """Where a group's per-token values come from: the samples (the engine's log-probs and entropies), the update
    (`trainer`: its old log-probs, its entropies without the engine's, each response's mismatch), which responses the
    store keeps (`kept`: step-wide indexes; None: all) and each token's text (`pieces`: token ids -> texts)."""

    trainer: TrainerTokens
    kept: set[int] | None
    pieces: Callable[[list[int]], list[str]]

    def fill(self, result: GroupResult, samples: list, first_trained: int | None) -> None:
        """Set the group's `mismatch` and `token_values` (GroupResult). `first_trained`: its first response's row
        among the update's, None for a group the update never saw (filtered)."""
        G = len(samples)
        rows = [None] * G if first_trained is None else list(range(first_trained, first_trained + G))
        mismatch = self.trainer.mismatch
        result.mismatch = [mismatch[row] if row is not None and row < len(mismatch) else None for row in rows]
        values = []
        for j, (sample, row) in enumerate(zip(samples, rows, strict=True)):
            if self.kept is not None and result.group_idx * G + j not in self.kept:
                values.append(None)
                continue
            entropy = sample.token_entropies if sample.token_entropies is not None else self.trainer.entropies.get(row)
            values.append(
                {
                    "tokens": self.pieces(sample.response_ids),
                    "logprob": sample.token_logprobs,
                    "entropy": entropy,
                    "old_logprob": self.trainer.old_logprobs.get(row),
                }
            )
        result.token_values = values


def sampling_policy_stats(batch: dict, updated: UpdateResult, n: int) -> tuple[list[float], list[float]] | None:
    """The first `n` responses' mean token entropy and summed log-prob under the sampling policy, from the update's
    no-grad pass over them (policy_update's full_pass), for their rows; None for no response."""
    if not n:
        return None
    mask = batch["response_mask"][:n]
    return (
        ((updated.entropy[:n] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist(),  # (N,)
        (updated.old_logp[:n] * mask).sum(-1).tolist(),
    )  # (N,)
