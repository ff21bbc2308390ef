"""`qae preview`: is this task learnable at this group size, and which K? Answered before a GPU-hour is spent.

A preview samples N prompts x G responses from the policy as `qae train` with the same options samples its first
step: the first N prompts of the run's data stream, in batches of prompts_per_step, each batch with the seed of step
1's generation batch (engines.sampling.step_seed), the run's engine, temperature and max-new-tokens. So its first
prompts_per_step groups are the responses step 1 of that run trains on (with the hf engine on one process). It scores
them as `qae train` does (scoring/reward_path.py: --reward, else the task's own) and works out, from the rewards
[N, G]:

- the reward distribution, and each group's success rate;
- the groups with no signal (every reward equal): no estimator learns from them;
- what QAE at each K of `--ks` gates (advantage exactly 0) against GRPO, with the regimes: the trainer's own estimator
  code (algo.advantages.step_advantages, with the run's --quantile, --scale, --shaping and --reward-values);
- a suggested K: what --k auto would choose from this success rate (names.AUTO_K_RULE);
- the response lengths, and the share cut by max-new-tokens.

A preview is data like a run: a run folder whose runs row has estimator `preview`, its responses the `groups` and
`rollouts` rows of step 1 (under the run's own estimator and K), its findings the `previews` and `preview_k` rows
(store/schema.py). `qae preview` prints them as read back from the file, `qae rollouts RUN` lists its responses and
the dashboard's Preview page draws them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path

import torch

from qae_app.algo.advantages import REGIMES, Advantages, EstimatorConfig, step_advantages
from qae_app.config import TrainConfig
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import Problem
from qae_app.data.prompt_format import prompt_text
from qae_app.data.tasks import Task, prompts_at
from qae_app.engines.base import Sample
from qae_app.engines.sampling import step_seed
from qae_app.rewards.registry import data_columns
from qae_app.scoring.reward_path import ScoredBatch, run_rewards, run_task, score_batch
from qae_app.store.rows import GroupResult, component_rows, group_rows, rollout_rows
from qae_app.store.run_folder import db_path, validate_run_name
from qae_app.store.signal import component_signal_rows, primary_component, signal_sentence
from qae_app.store.tokens import token_rows
from qae_app.store.writer import RunWriter

PREVIEW_ESTIMATOR = "preview"  # the runs row's estimator: what tells a preview's folder from a training run's
PREVIEW_STEP = 1  # the step its rows are stored under: the training step whose responses it samples
NO_SIGNAL_HINT = "try a larger G, an easier split, a longer max-new-tokens, or a warm start"


@dataclass(frozen=True)
class PreviewOptions:
    """What `qae preview` adds to the run's own options."""

    prompts: int = names.PREVIEW_PROMPTS  # prompts sampled (N), each --group-size times
    ks: tuple[float, ...] = tuple(float(k) for k in names.PREVIEW_KS.split(","))  # the K values QAE is shown at


def parse_ks(text: str) -> tuple[float, ...]:
    """'0.2,0.4' -> (0.2, 0.4), sorted, without repeats; QAEUserError naming --ks for anything else."""
    advice = f"Pass K values in (0, 1) separated by commas, e.g. {names.PREVIEW_KS}."
    try:
        ks = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise QAEUserError(f"ks: '{text}' is not a list of numbers. {advice}") from None
    if not ks:
        raise QAEUserError(f"ks: '{text}' names no K. {advice}")
    outside = [k for k in ks if not 0.0 < k < 1.0]  # (NaN too: it compares False)
    if outside:
        raise QAEUserError(f"ks: {outside[0]} is outside (0, 1): QAE's K is a quantile level. {advice}")
    return tuple(sorted(set(ks)))


def check_prompts(prompts: int, task: Task, data: str) -> None:
    if prompts < 1:
        raise QAEUserError(
            f"prompts: {prompts} samples nothing. Use a positive number of prompts, e.g. {names.PREVIEW_PROMPTS}."
        )
    if prompts > len(task.train):
        raise QAEUserError(
            f"prompts: {prompts} is more than the {len(task.train)} training problems of '{data}' "
            f"(each would be sampled twice). Use at most {len(task.train)}."
        )


# ---------------------------------------------------------------------------------------------------------------
# sampling and scoring


@dataclass
class Sampled:
    """N prompts x G responses, scored as the run scores them: sample j of prompt i at i * G + j."""

    problems: list[Problem]  # [N]
    prompts: list  # [N] (text, or chat messages)
    samples: list[Sample]  # [N * G]; prompt_index is global (into problems)
    rewards: list[float] = field(default_factory=list)  # [N * G]: the rewards' total, shaped, as the estimator sees it
    correct: list[bool] = field(default_factory=list)  # [N * G]: full marks
    verified: list[bool] = field(default_factory=list)  # [N * G]: no component None (could not verify)
    components: dict[str, list[float | None]] = field(default_factory=dict)  # name -> [N * G] (with --reward)
    parts: dict[str, list[float]] = field(default_factory=dict)  # name -> [N * G] its weighted part of the reward
    weights: dict[str, float] = field(default_factory=dict)  # name -> its weight

    def add(self, scored: ScoredBatch) -> None:
        self.rewards += scored.rewards
        self.correct += scored.correct
        self.verified += scored.verified
        for name, values in scored.components.items():
            self.components.setdefault(name, []).extend(values)
        for name, values in scored.parts.items():
            self.parts.setdefault(name, []).extend(values)
        self.weights.update(scored.weights)


def sample_and_score(
    engine, task: Task, cfg: TrainConfig, n_prompts: int, on_progress: Callable[[str, int], None] | None = None
) -> Sampled:
    """The first `n_prompts` prompts of the run's data stream, `cfg.group_size` responses each, sampled a batch of
    prompts_per_step at a time with step 1's seeds, and scored by the run's rewards (scoring/reward_path.py, as
    `qae train` scores: --reward, else the task's own). `on_progress(phase, prompts_done)`: phase 'sampling' before a
    batch is sampled, 'scoring' before it is scored."""
    problems = [task.train[i] for i in prompts_at(task, cfg.seed, 0, n_prompts)]
    sampled = Sampled(problems, [task.prompt(p) for p in problems], [])
    with run_rewards(cfg, task.reward) as rewards:
        rewards.check(data_columns(task.train + task.heldout))  # (user functions imported, their columns checked)
        for batch, start in enumerate(range(0, n_prompts, cfg.prompts_per_step)):
            if on_progress is not None:
                on_progress("sampling", start)
            chunk = slice(start, start + cfg.prompts_per_step)
            drawn = engine.generate(
                sampled.prompts[chunk],
                cfg.group_size,
                cfg.temperature,
                cfg.max_new_tokens,
                step_seed(cfg.seed, PREVIEW_STEP, 0, batch),
            )
            if on_progress is not None:
                on_progress("scoring", start)
            sampled.add(score_batch(rewards, cfg, drawn, problems[chunk], sampled.prompts[chunk], PREVIEW_STEP))
            for sample in drawn:  # (the engine's index is into the batch)
                sample.prompt_index += start
            sampled.samples += drawn
    if on_progress is not None:
        on_progress("done", n_prompts)
    return sampled


# ---------------------------------------------------------------------------------------------------------------
# what the rewards say


def estimator_config(cfg: TrainConfig, k: float) -> EstimatorConfig:
    return EstimatorConfig(k=k, quantile=cfg.quantile, scale=cfg.scale)


def gating_row(estimator: str, k: float | None, adv: Advantages) -> dict:
    """A `preview_k` row: the share of responses with advantage exactly 0, over all and over the groups with signal,
    and the groups of each regime."""
    zero = adv.advantages == 0  # [N, G]
    regimes = [REGIMES[code] for code in adv.regime.tolist()]  # [N]
    informative = torch.tensor([r not in names.NO_SIGNAL_REGIMES for r in regimes])  # [N]
    return {
        "estimator": estimator,
        "k": k,
        "frac_zero_adv": zero.float().mean().item(),
        "frac_zero_adv_informative": zero[informative].float().mean().item() if informative.any() else None,
        **{f"n_{name}": regimes.count(name) for name in REGIMES},
        "suggested": False,
    }


def gating_rows(
    rewards: torch.Tensor, correct: torch.Tensor, cfg: TrainConfig, ks: tuple[float, ...], suggested_k: float | None
) -> list[dict]:
    """QAE at each K of `ks` (and the suggested K), then GRPO: what each would gate of these rewards [N, G] (shaped)
    and verdicts [N, G] (bool), with the run's reward values, quantile, scale and shaping."""
    values = names.reward_values(cfg.reward_values)
    rows = []
    for k in sorted({*ks, *([suggested_k] if suggested_k is not None else [])}):
        adv = step_advantages("qae", rewards, correct, values, estimator_config(cfg, k), cfg.shaping)
        rows.append({**gating_row("qae", k, adv), "suggested": k == suggested_k})
    adv = step_advantages("grpo", rewards, correct, values, estimator_config(cfg, names.DEFAULT_K), cfg.shaping)
    return [*rows, gating_row("grpo", None, adv)]


def verdict(
    n_signal: int,
    n_groups: int,
    group_size: int,
    regimes: list[str],
    truncated_frac: float,
    signal: list[dict] = (),
    primary: str | None = None,
) -> str:
    """One line: 'learnable: 20 of 32 groups (62%) have signal at G=8', with several reward components which of them
    carries it ('; all signal comes from one_word (weight 0.2); antonym never differs within a group': `signal`, the
    component_signal rows, `primary` the task's component), or 'no signal: ...' and what to try."""
    if n_signal:
        said = f"learnable: {n_signal} of {n_groups} groups ({n_signal / n_groups:.0%}) have signal at G={group_size}"
        by_component = signal_sentence(signal, primary) if signal else None
        return f"{said}; {by_component}" if by_component else said
    if all(r == "all_wrong" for r in regimes):
        what = "every group all-wrong"
        hint = (
            NO_SIGNAL_HINT
            if truncated_frac < 0.5
            else (
                f"{truncated_frac:.0%} of the responses were cut at max-new-tokens: try a longer max-new-tokens, a "
                "larger G, an easier split, or a warm start"
            )
        )
    elif all(r == "all_correct" for r in regimes):
        what, hint = "every group all-correct", "try a harder split, or a larger G to find the failures"
    else:
        what = (
            f"every group's rewards are equal ({regimes.count('all_wrong')} all-wrong, "
            f"{regimes.count('all_correct')} all-correct)"
        )
        hint = NO_SIGNAL_HINT
    return f"no signal: {what} at G={group_size}; {hint}"


def suggestion_why(accuracy: float, suggested_k: float, rows: list[dict]) -> str:
    at_k = next(row for row in rows if row["suggested"])
    grpo = rows[-1]
    return (
        f"success rate {accuracy:.3f}: K={suggested_k:g} by the rule --k auto uses ({names.AUTO_K_RULE}); at "
        f"K={suggested_k:g} QAE gates {at_k['frac_zero_adv']:.0%} of the responses ({at_k['n_hard']} hard, "
        f"{at_k['n_easy']} easy groups), GRPO {grpo['frac_zero_adv']:.0%}"
    )


# ---------------------------------------------------------------------------------------------------------------
# the rows it stores


def preview_tables(
    sampled: Sampled, cfg: TrainConfig, ks: tuple[float, ...], pieces: Callable[[list[int]], list[str]] | None = None
) -> dict[str, list[dict]]:
    """The step's tables: `groups` and `rollouts` under the run's own estimator (and K; --k auto: the K it would
    choose), the `previews` row and the `preview_k` rows; with several reward components their `component_signal`
    rows, and with `pieces` (token ids -> each token's text) every response's `token_values`."""
    N, G = len(sampled.problems), cfg.group_size
    lengths = [len(s.response_ids) for s in sampled.samples]
    rewards = torch.tensor(sampled.rewards, dtype=torch.float64).view(N, G)  # [N, G]
    correct = torch.tensor(sampled.correct, dtype=torch.bool).view(N, G)  # [N, G]
    accuracy = correct.float().mean().item()
    no_signal = rewards.amax(dim=1) == rewards.amin(dim=1)  # [N]
    suggested_k = names.auto_k(accuracy) if not no_signal.all() else None
    by_k = gating_rows(rewards, correct, cfg, ks, suggested_k)
    run_k = names.auto_k(accuracy) if cfg.k == "auto" else float(cfg.k)
    adv = step_advantages(
        cfg.estimator,
        rewards,
        correct,
        names.reward_values(cfg.reward_values),
        estimator_config(cfg, run_k),
        cfg.shaping,
    )
    groups = _group_results(sampled, adv, rewards, correct, G, pieces)
    signal = component_signal_rows(groups, sampled.weights)
    truncated_frac = sum(s.truncated for s in sampled.samples) / len(sampled.samples)
    summary = {
        "n_prompts": N,
        "group_size": G,
        "max_new_tokens": cfg.max_new_tokens,
        "accuracy": accuracy,
        "reward_mean": rewards.mean().item(),
        "frac_no_signal": no_signal.float().mean().item(),
        "frac_unverified": sampled.verified.count(False) / len(sampled.verified),
        "truncated_frac": truncated_frac,
        "response_len": sum(lengths) / len(lengths),
        "suggested_k": suggested_k,
        "verdict": verdict(
            int((~no_signal).sum()),
            N,
            G,
            [g.regime for g in groups],
            truncated_frac,
            signal,
            primary_component(cfg.primary_reward, signal),
        ),
        "suggested_why": None if suggested_k is None else suggestion_why(accuracy, suggested_k, by_k),
    }
    return {
        "groups": group_rows(groups),
        "rollouts": rollout_rows(groups),
        "previews": [summary],
        "preview_k": by_k,
        **({"reward_components": component_rows(groups)} if sampled.components else {}),
        **({"component_signal": signal} if signal else {}),
        **({"token_values": token_rows(groups)} if pieces is not None else {}),
    }


def _group_results(
    sampled: Sampled,
    adv: Advantages,
    rewards: torch.Tensor,
    correct: torch.Tensor,
    G: int,
    pieces: Callable[[list[int]], list[str]] | None = None,
) -> list[GroupResult]:
    baselines, regimes, advantages = adv.baseline.tolist(), adv.regime.tolist(), adv.advantages.tolist()
    rewards_, correct_ = rewards.tolist(), correct.tolist()
    results = []
    for i, problem in enumerate(sampled.problems):
        group = sampled.samples[i * G : (i + 1) * G]
        measured = all(s.token_entropies is not None and s.token_logprobs is not None for s in group)
        results.append(
            GroupResult(
                group_idx=i,
                prompt_id=problem.prompt_id,
                prompt=prompt_text(sampled.prompts[i]),
                answer=problem.answer,
                baseline=baselines[i],
                regime=REGIMES[regimes[i]],
                responses=[s.text for s in group],
                rewards=rewards_[i],
                correct=correct_[i],
                verified=sampled.verified[i * G : (i + 1) * G],
                advantages=advantages[i],
                n_tokens=[len(s.response_ids) for s in group],
                truncated=[s.truncated for s in group],
                entropies=[
                    sum(s.token_entropies) / max(len(s.token_entropies), 1) if measured else None for s in group
                ],
                logprobs=[sum(s.token_logprobs) if measured else None for s in group],
                model_prompt=group[0].model_prompt if group else None,
                components={name: values[i * G : (i + 1) * G] for name, values in sampled.components.items()},
                parts={name: values[i * G : (i + 1) * G] for name, values in sampled.parts.items()},
                token_values=None
                if pieces is None
                else [
                    {
                        "tokens": pieces(s.response_ids),
                        "logprob": s.token_logprobs,
                        "entropy": s.token_entropies,
                        "old_logprob": None,
                    }
                    for s in group
                ],
            )
        )
    return results


# ---------------------------------------------------------------------------------------------------------------
# `qae preview`: check, sample, store


def preview_run_id(cfg: TrainConfig, runs_dir: Path) -> str:
    run_id = validate_run_name(cfg.run_name or f"preview-{datetime.now():%Y%m%d-%H%M%S}")
    if db_path(runs_dir, run_id).parent.exists():
        raise QAEUserError(f"run-name: '{run_id}' already exists in {runs_dir}. Pick another --run-name.")
    return run_id


def run_preview(
    cfg: TrainConfig,
    runs_dir: Path,
    options: PreviewOptions,
    on_progress: Callable[[str, int], None] | None = None,
    device: str | None = None,
) -> tuple[str, Path]:
    """Everything `qae preview` does but print: (run id, database path). `device`: where the hf engine samples
    (default: the GPU when there is one, as `qae train`)."""
    from qae_app.engines.factory import make_engine
    from qae_app.models.policy import check_prompt_lengths, load_policy, rollout_positions, token_texts

    run_id = preview_run_id(cfg, Path(runs_dir))  # before anything slow
    task = run_task(cfg)
    check_prompts(options.prompts, task, cfg.data)
    policy, codec = load_policy(cfg.model, cfg.dtype)
    policy.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    by_id = [
        (p.prompt_id, task.prompt(p)) for p in (task.train[i] for i in prompts_at(task, cfg.seed, 0, options.prompts))
    ]
    check_prompt_lengths(policy, codec, by_id, cfg.max_new_tokens, "data", cfg.system_prompt)
    engine = make_engine(
        cfg.engine,
        policy,
        codec,
        model_path=cfg.model,
        rollout_dtype=cfg.rollout_dtype,
        sleep=False,
        gpu_memory_utilization=cfg.vllm_gpu_memory,
        max_model_len=rollout_positions(policy, codec, by_id, cfg.max_new_tokens),
    )
    try:
        sampled = sample_and_score(engine, task, cfg, options.prompts, on_progress)
    finally:
        engine.close()  # (vLLM: its engine and process group)
    tables = preview_tables(sampled, cfg, options.ks, partial(token_texts, codec))
    path = db_path(runs_dir, run_id)
    writer = RunWriter(path, run_id)
    config = {**cfg.to_dict(), "preview_prompts": options.prompts, "preview_ks": list(options.ks)}
    writer.create_run(run_id, config, PREVIEW_ESTIMATOR, None, cfg.model, cfg.data, cfg.seed)
    writer.add_step(PREVIEW_STEP, **tables)
    writer.update_run(status="finished")
    if not writer.wait_until_written(timeout_s=60):
        writer.sync_pending()  # written by the file's next writer
    return run_id, path
