"""Benchmark: what skipping gated (zero-advantage) responses saves, and the vectorized estimator against a loop.

    python bench/bench_step.py [--steps 40]

Two trainers with the same seed run the same steps on the built-in task, one skipping gated sequences in the update
and one not; their losses must agree (the skip is exact) and the update times give the speed-up. Prints ratios
measured in this run; no thresholds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from qae_app.advantages import compute_advantages, quantile_rank
from qae_app.config import build_config
from qae_app.trainer import Trainer


def update_times(skip: bool, steps: int, runs_dir: str) -> tuple[list[float], list[float], list[float]]:
    cfg = build_config(run_name=f"skip-{skip}", steps=steps, eval_every=0, checkpoint_every=0)
    trainer = Trainer(cfg, runs_dir, cpu=True)
    trainer.skip_gated = skip
    times, losses, zero = [], [], []
    for step in range(1, steps + 1):
        metrics = trainer.train_step(step).metrics
        times.append(metrics["update_s"])
        losses.append(metrics["loss"])
        zero.append(metrics["frac_zero_adv"])
    return times, losses, zero


def estimator_speed(groups: int = 4096, G: int = 16) -> tuple[float, float]:
    torch.manual_seed(0)
    rewards = (torch.rand(groups, G) < torch.rand(groups, 1)).float()
    start = time.perf_counter()
    compute_advantages("qae", rewards)
    vectorized = time.perf_counter() - start
    start = time.perf_counter()
    m = quantile_rank(0.4, G)
    for row in rewards.tolist():  # the obvious per-group loop
        baseline = sorted(row)[m - 1]
        mean = sum(row) / G
        std = (sum((r - mean) ** 2 for r in row) / (G - 1)) ** 0.5
        [(r - baseline) / (std + 1e-6) for r in row]
    loop = time.perf_counter() - start
    return vectorized, loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs_dir:
        skip_t, skip_loss, zero = update_times(True, args.steps, runs_dir)
        full_t, full_loss, _ = update_times(False, args.steps, runs_dir)
    max_diff = max(abs(a - b) for a, b in zip(skip_loss, full_loss))
    print(f"steps: {args.steps} of 8 prompts x 16 samples, mean zero-advantage fraction {statistics.mean(zero):.3f}")
    print(f"update time per step, median: skip gated {statistics.median(skip_t) * 1e3:.1f} ms, "
          f"all sequences {statistics.median(full_t) * 1e3:.1f} ms, "
          f"ratio {statistics.median(full_t) / statistics.median(skip_t):.2f}x")
    print(f"largest loss difference between the two: {max_diff:.2e} (the skip is exact)")
    vectorized, loop = estimator_speed()
    print(f"QAE advantages for 4096 groups of 16: vectorized {vectorized * 1e3:.2f} ms, python loop "
          f"{loop * 1e3:.1f} ms, ratio {loop / vectorized:.0f}x")


if __name__ == "__main__":
    main()
