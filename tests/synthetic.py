"""Synthetic runs written through the real `RunWriter`, for dashboard and CLI tests and
bench/bench_dashboard.py: big runs (1,000 steps, 128,000 rollouts) without training.

Each prompt has a fixed difficulty; a response is correct with that probability (rising slowly over the run), and
QAE's paper rule is applied by hand to the binary rewards of each group (c correct of G, success rate p = c / G):
all correct / all wrong: no signal; p <= 1 - K: hard, baseline 0; else easy, baseline 1; advantages
(reward - baseline) / (unbiased std + 1e-6), and exactly 0 where reward equals the baseline.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from qae_app.core.estimators import ESTIMATORS
from qae_app.store.rows import GroupResult, group_rows, rollout_rows, step_metrics
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter

EPS = 1e-6


def qae_group(rewards: list[float], k: float) -> tuple[float, str, list[float]]:
    """(baseline, regime, advantages) of one group of binary rewards under QAE's paper rule."""
    g, c = len(rewards), int(sum(rewards))
    if c == g:
        return 1.0, "all_correct", [0.0] * g
    if c == 0:
        return 0.0, "all_wrong", [0.0] * g
    baseline, regime = (0.0, "hard") if c / g <= 1 - k else (1.0, "easy")
    mean = c / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (g - 1))
    return baseline, regime, [(r - baseline) / (std + EPS) if r != baseline else 0.0 for r in rewards]


def write_run(
    runs_dir: Path,
    run_id: str,
    steps: int = 20,
    prompts_per_step: int = 4,
    group_size: int = 8,
    n_prompts: int = 40,
    k: float = 0.4,
    seed: int = 0,
    eval_every: int = 0,
    eval_problems: int = 8,
    eval_k: int = 4,
    status: str | None = "finished",
    start_step: int = 1,
    writer: RunWriter | None = None,
    config: dict | None = None,
) -> RunWriter:
    """Write `steps` steps of a synthetic QAE run into runs_dir/run_id (created if new) and return its writer.
    `status=None` leaves the stored status as it is (`running` for a new run); `start_step` continues a run."""
    rng = random.Random(seed * 1_000_003 + start_step)
    path = db_path(runs_dir, run_id)
    if writer is None:
        writer = RunWriter(path, run_id)
        if start_step == 1:
            cfg = {
                **dict(
                    steps=steps,
                    prompts_per_step=prompts_per_step,
                    group_size=group_size,
                    k=k,
                    seed=seed,
                    estimator="qae",
                    model="builtin:tiny",
                    data="arith",
                    eval_every=eval_every,
                    lr=1e-5,
                    entropy_low=0.5,
                    entropy_high=3.0,
                ),
                **(config or {}),
            }
            estimator = cfg["estimator"]  # (a mean baseline's row has no K)
            writer.create_run(run_id, cfg, estimator, ESTIMATORS[estimator].k_in_use(k), "builtin:tiny", "arith", seed)
    difficulty = [random.Random(seed + i).random() for i in range(n_prompts)]
    total = (config or {}).get("steps", steps + start_step - 1)
    for step in range(start_step, start_step + steps):
        progress = step / max(total, 1)
        groups = []
        for g in range(prompts_per_step):
            prompt = (step * prompts_per_step + g) % n_prompts
            p_correct = min(0.98, difficulty[prompt] * (0.6 + 0.4 * progress) + 0.05)
            rewards = [1.0 if rng.random() < p_correct else 0.0 for _ in range(group_size)]
            baseline, regime, advantages = qae_group(rewards, k)
            a, b = divmod(prompt, 21)
            responses = [str(a + b) if r else str(a + b + rng.randint(1, 9)) for r in rewards]
            n_tokens = [rng.randint(2, 40) for _ in rewards]
            groups.append(
                GroupResult(
                    group_idx=g,
                    prompt_id=f"p{prompt:04d}",
                    prompt=f"{a}+{b}=",
                    answer=str(a + b),
                    baseline=baseline,
                    regime=regime,
                    responses=responses,
                    rewards=rewards,
                    correct=[r == 1.0 for r in rewards],
                    verified=[True] * group_size,
                    advantages=advantages,
                    n_tokens=n_tokens,
                    truncated=[n == 40 for n in n_tokens],
                    entropies=[max(0.01, rng.gauss(0.9 - 0.5 * progress, 0.15)) for _ in rewards],
                    logprobs=[-rng.random() * n for n in n_tokens],
                )
            )
        group_table, rollout_table = group_rows(groups), rollout_rows(groups)
        metrics = {name: None for name in STEP_METRICS}
        metrics.update(step_metrics(group_table, rollout_table))
        metrics.update(
            k=k,
            loss=0.1 * rng.random(),
            pg_loss=0.1 * rng.random(),
            kl=0.0,
            grad_norm=rng.random(),
            clip_frac=0.01,
            clip_frac_low=0.005,
            clip_frac_high=0.005,
            lr=1e-5,
            n_updates=1.0,
            rollout_s=0.5,
            reward_s=0.05,
            update_s=0.4,
            step_s=1.0,
        )
        tables = dict(steps=[metrics], groups=group_table, rollouts=rollout_table)
        if eval_every and step % eval_every == 0:
            samples = [
                dict(
                    benchmark="heldout",
                    problem_id=f"e{i:03d}",
                    sample_idx=j,
                    response=f"{i} + {j} = {i + j}",
                    extracted=str(i + j if (i + j + step) % 3 else 0),
                    correct=bool((i + j + step) % 3),
                    verified=True,
                    n_tokens=6,
                    source="train",
                )
                for i in range(eval_problems)
                for j in range(eval_k)
            ]
            accuracy = sum(s["correct"] for s in samples) / len(samples)
            metrics["heldout_accuracy"] = accuracy
            tables["eval_samples"] = samples
            tables["evals"] = [
                dict(
                    benchmark="heldout",
                    subset="all",
                    metric="avg@k",
                    k=eval_k,
                    value=accuracy,
                    n_problems=eval_problems,
                    source="train",
                )
            ]
        writer.add_step(step, **tables)
        if step % 50 == 0:
            assert writer.flush(timeout_s=30)
    assert writer.flush(timeout_s=30)
    if status is not None:
        writer.update_run(status=status)
    return writer
