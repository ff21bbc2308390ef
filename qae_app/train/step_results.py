"""What a step reports of its groups: `group_results` turns the step's generation batches, advantages and the
update's no-grad pass into one `GroupResult` per group (plain Python values, what the store's rows are made of)."""

from __future__ import annotations

from qae_app.algo.advantages import REGIMES
from qae_app.data.prompt_format import prompt_text
from qae_app.store.rows import GroupResult
from qae_app.train.update import UpdateResult


def group_results(batches: list, trained: list[bool], adv, rewards, correct, group_size: int,
                  from_engine: bool, pass_stats) -> list[GroupResult]:
    """This process's groups of every generation batch, in order (`trained` (B,), `adv`, `rewards` and `correct`
    (B, G): one entry per group). A response's mean token entropy and summed log-prob come from the engine when it
    measured them while sampling (`from_engine`), else from the no-grad pass over the trained responses
    (`pass_stats`: two lists, one value per trained response, in order); a filtered group the engine did not measure
    never went through the model, and gets None. A batch's reward components (`components`, [B * G] per name) go
    with their group, where the run stores them (--reward given)."""
    G = group_size
    # each tensor to Python values once, not an item() or tolist() per group: the same values
    baselines, regimes, advantages = adv.baseline.tolist(), adv.regime.tolist(), adv.advantages.tolist()
    rewards, correct = rewards.tolist(), correct.tolist()
    results, local, done = [], 0, 0  # local: group index over all batches; done: trained groups seen
    for b in batches:
        for i, problem in enumerate(b.problems):
            group = b.samples[i * G:(i + 1) * G]
            if from_engine:
                entropies = [sum(s.token_entropies) / max(len(s.token_entropies), 1) for s in group]
                logprobs = [sum(s.token_logprobs) for s in group]
            elif trained[local]:
                entropies, logprobs = (stats[done * G:(done + 1) * G] for stats in pass_stats)
                done += 1
            else:
                entropies = logprobs = [None] * G
            results.append(GroupResult(
                group_idx=b.first_group + i, prompt_id=problem.prompt_id, prompt=prompt_text(b.prompts[i]),
                answer=problem.answer, baseline=baselines[local],
                regime=REGIMES[regimes[local]], responses=[s.text for s in group],
                rewards=rewards[local], correct=correct[local],
                verified=b.verified[i * G:(i + 1) * G], advantages=advantages[local],
                n_tokens=[len(s.response_ids) for s in group], truncated=[s.truncated for s in group],
                entropies=entropies, logprobs=logprobs, filtered=not trained[local],
                model_prompt=group[0].model_prompt,
                components={name: values[i * G:(i + 1) * G] for name, values in b.components.items()}))
            local += 1
    return results


def sampling_policy_stats(batch: dict, updated: UpdateResult, n: int) -> tuple[list[float], list[float]] | None:
    """The first `n` responses' mean token entropy and summed log-prob under the sampling policy, from the update's
    no-grad pass over them (policy_update's full_pass), for their rows; None for no response."""
    if not n:
        return None
    mask = batch["response_mask"][:n]
    return (((updated.entropy[:n] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist(),  # (N,)
            (updated.old_logp[:n] * mask).sum(-1).tolist())  # (N,)
