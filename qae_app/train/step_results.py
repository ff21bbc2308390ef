"""What a step reports of its groups: `group_results` turns the step's generation batches, advantages and the
update's no-grad pass into one `GroupResult` per group (plain Python values, what the store's rows are made of)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qae_app.algo.advantages import REGIMES
from qae_app.data.prompt_format import prompt_text
from qae_app.store.rows import GroupResult, component_rows, group_rows, rollout_rows
from qae_app.store.signal import component_signal_rows
from qae_app.store.tokens import token_rows
from qae_app.train.token_values import TrainerTokens
from qae_app.train.update import UpdateResult


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
    return StepRows(group_rows(results), rollout_rows(results), component_rows(results),
                    component_signal_rows(results, weights), token_rows(results))


def group_results(batches: list, trained: list[bool], adv, rewards, correct, group_size: int,
                  from_engine: bool, pass_stats, tokens: TokenSources | None = None) -> list[GroupResult]:
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
            group = b.samples[i * G:(i + 1) * G]
            first_trained = done * G if trained[local] else None  # its first response's row in the update
            if from_engine:
                entropies = [sum(s.token_entropies) / max(len(s.token_entropies), 1) for s in group]
                logprobs = [sum(s.token_logprobs) for s in group]
            elif trained[local]:
                entropies, logprobs = (stats[done * G:(done + 1) * G] for stats in pass_stats)
            else:
                entropies = logprobs = [None] * G
            done += trained[local]
            result = GroupResult(
                group_idx=b.first_group + i, prompt_id=problem.prompt_id, prompt=prompt_text(b.prompts[i]),
                answer=problem.answer, baseline=baselines[local],
                regime=REGIMES[regimes[local]], responses=[s.text for s in group],
                rewards=rewards[local], correct=correct[local],
                verified=b.verified[i * G:(i + 1) * G], advantages=advantages[local],
                n_tokens=[len(s.response_ids) for s in group], truncated=[s.truncated for s in group],
                entropies=entropies, logprobs=logprobs, filtered=not trained[local],
                model_prompt=group[0].model_prompt,
                components={name: values[i * G:(i + 1) * G] for name, values in b.components.items()},
                parts={name: values[i * G:(i + 1) * G] for name, values in b.parts.items()})
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
        for j, (sample, row) in enumerate(zip(samples, rows)):
            if self.kept is not None and result.group_idx * G + j not in self.kept:
                values.append(None)
                continue
            entropy = sample.token_entropies if sample.token_entropies is not None else \
                self.trainer.entropies.get(row)
            values.append({"tokens": self.pieces(sample.response_ids), "logprob": sample.token_logprobs,
                           "entropy": entropy, "old_logprob": self.trainer.old_logprobs.get(row)})
        result.token_values = values


def sampling_policy_stats(batch: dict, updated: UpdateResult, n: int) -> tuple[list[float], list[float]] | None:
    """The first `n` responses' mean token entropy and summed log-prob under the sampling policy, from the update's
    no-grad pass over them (policy_update's full_pass), for their rows; None for no response."""
    if not n:
        return None
    mask = batch["response_mask"][:n]
    return (((updated.entropy[:n] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist(),  # (N,)
            (updated.old_logp[:n] * mask).sum(-1).tolist())  # (N,)
