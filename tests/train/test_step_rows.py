"""The rows of a real step are the values the step computed: `group_results` (which turns each of its tensors into
Python values once) against a reference that reads every value per group, element by element, on the inputs of a
real training step."""

import pytest

from qae_app.algo.advantages import REGIMES
from qae_app.config import build_config
from qae_app.store.rows import GroupResult
from qae_app.train.step_results import group_results
from qae_app.train.trainer import Trainer


def reference_tokens(group_idx, group, first_row, tokens):
    """Each response's mismatch and per-token values, one response at a time (TokenSources.fill spelled out)."""
    mismatch, values = [], []
    for j, sample in enumerate(group):
        row = None if first_row is None else first_row + j
        known = row is not None and row < len(tokens.trainer.mismatch)
        mismatch.append(tokens.trainer.mismatch[row] if known else None)
        if tokens.kept is not None and group_idx * len(group) + j not in tokens.kept:
            values.append(None)
            continue
        values.append(
            {
                "tokens": tokens.pieces(sample.response_ids),
                "logprob": sample.token_logprobs,
                "entropy": sample.token_entropies
                if sample.token_entropies is not None
                else tokens.trainer.entropies.get(row),
                "old_logprob": tokens.trainer.old_logprobs.get(row),
            }
        )
    return mismatch, values


def reference_group_results(batches, trained, adv, rewards, correct, G, from_engine, pass_stats, tokens=None):
    """What group_results returns, spelled out one group and one response at a time (item() per value)."""
    results, local, done = [], 0, 0
    for b in batches:
        for i, problem in enumerate(b.problems):
            group = b.samples[i * G : (i + 1) * G]
            first_row = done * G if trained[local] else None
            if from_engine:
                entropies = [sum(s.token_entropies) / max(len(s.token_entropies), 1) for s in group]
                logprobs = [sum(s.token_logprobs) for s in group]
            elif trained[local]:
                entropies, logprobs = (stats[done * G : (done + 1) * G] for stats in pass_stats)
            else:
                entropies = logprobs = [None] * G
            done += bool(trained[local])  # (the update's rows are the trained groups', in order)
            results.append(
                GroupResult(
                    group_idx=b.first_group + i,
                    prompt_id=problem.prompt_id,
                    prompt=b.prompts[i],
                    answer=problem.answer,
                    baseline=adv.baseline[local].item(),
                    regime=REGIMES[adv.regime[local].item()],
                    responses=[s.text for s in group],
                    rewards=[rewards[local, j].item() for j in range(G)],
                    correct=[bool(correct[local, j].item()) for j in range(G)],
                    verified=b.verified[i * G : (i + 1) * G],
                    advantages=[adv.advantages[local, j].item() for j in range(G)],
                    n_tokens=[len(s.response_ids) for s in group],
                    truncated=[s.truncated for s in group],
                    entropies=entropies,
                    logprobs=logprobs,
                    filtered=not trained[local],
                )
            )
            if tokens is not None:
                results[-1].mismatch, results[-1].token_values = reference_tokens(
                    b.first_group + i, group, first_row, tokens
                )
            local += 1
    return results


@pytest.mark.slow  # (a Trainer and two steps with dynamic sampling: 36 s on the shared 2-core machine)
def test_group_results_equal_the_per_value_reference_on_a_real_step(tmp_path, monkeypatch):
    seen = []
    fast = group_results

    def checked(*args):
        got = fast(*args)
        seen.append((got, reference_group_results(*args)))
        return got

    monkeypatch.setattr("qae_app.train.trainer.group_results", checked)
    # dynamic sampling: groups of several generation batches, some filtered (their entropies and log-probs None)
    cfg = build_config(
        run_name="rows",
        steps=2,
        eval_every=0,
        checkpoint_every=0,
        group_size=4,
        prompts_per_step=4,
        seed=5,
        dynamic_sampling=True,
        max_gen_batches=2,
    )
    with Trainer(cfg, tmp_path, cpu=True) as trainer:
        for step in (1, 2):
            trainer.train_step(step)
    assert len(seen) == 2
    assert any(r.filtered for got, _ in seen for r in got) and any(not r.filtered for got, _ in seen for r in got)
    for got, want in seen:
        assert got == want  # dataclass equality: every field, every value, exactly
        for result in got:  # and the same Python types the store receives
            assert all(type(v) is float for v in result.rewards + result.advantages + [result.baseline])
            assert all(type(v) is bool for v in result.correct)
