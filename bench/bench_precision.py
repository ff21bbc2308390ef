"""Benchmark: the update in bf16 mixed precision (float32 master weights) against float32, on the SmolLM2 CPU recipe.

    python bench/bench_precision.py [--steps 6] [--warmup 1] [--rollout-dtype bfloat16] [--threads 1]
    python bench/bench_precision.py --accuracy-seeds 3     # the recipe's 40 steps per seed and arm: hours on a CPU

Two trainers of the recipe (recipes/cpu-smollm2-qae.toml), each in a process of its own, one with `--mixed-precision
bf16` (the forward and backward under bf16 autocast, float32 weights and AdamW moments) and one in float32, both
sampling from a bfloat16 copy (`--rollout-dtype bfloat16`, the sampler a CPU with bf16 matmuls runs), take RL steps in
turn (the order alternating, bench/harness.py), each step timed by the trainer itself (`update_s`: the forwards,
backwards and optimizer steps, and the weight sync into the sampling copy). Per step pair: the bf16 update's time over
the float32 one's. Per arm: the sampler/trainer gap the run stores (`mismatch_logp_abs`, `mismatch_k3_kl`,
`mismatch_ratio_max`, docs/metrics.md): with both sides in bf16 the gap should narrow. The two arms sample alike at step
1 (same weights, same seed) and drift apart as their updates differ.

Whether bf16 pays depends on the CPU: where oneDNN has bf16 kernels (AVX512_BF16, AMX: the `cpu` column of the
results log names the flags) a bf16 matmul runs at several times the float32 rate; without them (AVX2 only) torch
emulates it, slower than float32. `--accuracy-seeds N` then runs the whole recipe N times per arm (`qae train
--config ... --seed s`, float32 and `--mixed-precision bf16`, both `--rollout-dtype bfloat16`) and reports the held-out
accuracy gain of each (step 0 to the last evaluation): whether bf16 learns as well. It needs a quiet machine and, to
be worth it, a CPU with bf16 kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from harness import ROOT, GatedChild, describe, pair_order, pair_ratios, report, spread

RECIPE = ROOT / "recipes" / "cpu-smollm2-qae.toml"
GAP = ("mismatch_logp_abs", "mismatch_k3_kl", "mismatch_ratio_max")
ARMS = {"float32": "no", "bf16 mixed": "bf16"}  # label -> --mixed-precision


def bf16_kernels() -> bool:
    """Whether oneDNN has bf16 matmul kernels for this CPU (what makes bf16 faster than float32 on it)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


GATE_TAG = "BENCH_PRECISION_GATE"  # an arm waits here, between steps, for the parent's go (a line on its stdin)
STEP_TAG = "BENCH_PRECISION_STEP "  # then one JSON line of the step's metrics


def arm_child(label: str, steps: int, rollout_dtype: str, threads: int) -> None:
    """One arm's trainer in this process, one step per go from the parent; trainer.train_step writes nothing.

    Each arm has a process of its own: accelerate keeps one mixed-precision setting per process (AcceleratorState is
    a singleton), so a second Trainer with another --mixed-precision in the same process is refused."""
    from qae_app.config import build_config
    from qae_app.train.trainer import Trainer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as runs:
        trainer = Trainer(
            build_config(
                RECIPE,
                run_name=label.replace(" ", "-"),
                steps=steps,
                eval_every=0,
                checkpoint_every=0,
                mixed_precision=ARMS[label],
                rollout_dtype=rollout_dtype,
            ),
            Path(runs),
            cpu=True,
        )
        for step in range(1, steps + 1):
            print(GATE_TAG, flush=True)
            sys.stdin.readline()
            metrics = trainer.train_step(step).metrics
            print(STEP_TAG + json.dumps({name: metrics[name] for name in ("update_s", *GAP)}), flush=True)
        print(GATE_TAG, flush=True)


class Arm(GatedChild):
    """An arm's child process (arm_child), stepping when the parent says go."""

    def __init__(self, label: str, steps: int, rollout_dtype: str, threads: int):
        command = [sys.executable, __file__, "--arm", label, "--steps", str(steps)]
        command += ["--rollout-dtype", rollout_dtype, "--threads", str(threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        super().__init__(f"the {label} arm", command, env, GATE_TAG)
        self.label = label

    @property
    def steps(self) -> list[dict]:
        """The metrics of every step it has taken."""
        return [json.loads(line[len(STEP_TAG) :]) for line in self.output if line.startswith(STEP_TAG)]

    def step(self) -> dict:
        self.go()
        self.wait_at_gate()
        return self.steps[-1]


def paired_steps(steps: int, warmup: int, rollout_dtype: str, threads: int) -> dict[str, list[dict]]:
    """Each arm's metrics per step, the arms (one process each) stepping in turn; the setups run together."""
    arms = [Arm(label, steps, rollout_dtype, threads) for label in ARMS]
    try:
        for arm in arms:
            arm.wait_at_gate()
        for step in range(1, steps + 1):
            done = {arms[which].label: arms[which].step() for which in pair_order(step)}
            print(
                f"step {step}: "
                + "; ".join(
                    f"{label} update {done[label]['update_s']:.1f} s, mismatch |dlogp| "
                    f"{done[label]['mismatch_logp_abs']:.4f}"
                    for label in ARMS
                ),
                flush=True,
            )
        for arm in arms:
            arm.proc.stdin.close()
            arm.proc.wait()
    finally:
        for arm in arms:
            arm.kill()
    return {arm.label: arm.steps[warmup:] for arm in arms}


def accuracy_gain(seed: int, mixed: str, rollout_dtype: str, runs: Path) -> float:
    """Held-out accuracy at the last evaluation minus step 0's, of one whole recipe run."""
    from qae_app.store.reader import query
    from qae_app.store.run_folder import DB_FILE

    name = f"{mixed}-{seed}"
    command = [
        str(Path(sys.executable).parent / "qae"),
        "train",
        "--config",
        str(RECIPE),
        "--seed",
        str(seed),
        "--mixed-precision",
        mixed,
        "--rollout-dtype",
        rollout_dtype,
        "--runs-dir",
        str(runs),
        "--run-name",
        name,
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    curve = query(
        runs / name / DB_FILE,
        "SELECT step, avg(value) AS value FROM evals WHERE metric = 'avg@k' AND "
        "subset = 'all' GROUP BY step ORDER BY step",
    )["value"].tolist()
    return curve[-1] - curve[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="RL steps of each arm, in turn")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out (allocations, lazy imports)")
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--accuracy-seeds", type=int, default=0, help="also run the whole recipe per seed and arm")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # a child process's side
    args = parser.parse_args()
    if args.arm:
        arm_child(args.arm, args.steps, args.rollout_dtype, args.threads)
        return
    torch.set_num_threads(args.threads)
    kernels = "oneDNN bf16 kernels" if bf16_kernels() else "no oneDNN bf16 kernels (bf16 emulated)"
    metrics = paired_steps(args.steps, args.warmup, args.rollout_dtype, args.threads)
    ratios = pair_ratios([m["update_s"] for m in metrics["bf16 mixed"]], [m["update_s"] for m in metrics["float32"]])
    print(f"update time bf16 mixed / float32 per step pair: {describe(ratios)} ({kernels})")
    report(
        "bench_precision: update time, bf16 mixed precision / float32, SmolLM2 recipe",
        round(spread(ratios).median, 4),
        None,
        unit="x",
        spread=spread(ratios),
        note=f"{kernels}; medians {statistics.median(m['update_s'] for m in metrics['bf16 mixed']):.1f} against "
        f"{statistics.median(m['update_s'] for m in metrics['float32']):.1f} s; sampler "
        f"--rollout-dtype {args.rollout_dtype}; {args.threads} threads; {args.steps} steps, "
        f"{args.warmup} dropped",
    )
    for label, values in metrics.items():
        gap = {name: statistics.median(m[name] for m in values) for name in GAP}
        print(
            f"{label} trainer, {args.rollout_dtype} sampler: median "
            + ", ".join(f"{k} {v:.4g}" for k, v in gap.items())
        )
        report(
            f"bench_precision: sampler/trainer mean |dlogp|, {label} trainer, {args.rollout_dtype} sampler, "
            "SmolLM2 recipe",
            round(gap["mismatch_logp_abs"], 6),
            None,
            unit="nats",
            note=f"medians over {len(values)} steps; k3 KL {gap['mismatch_k3_kl']:.3g}, largest ratio "
            f"{gap['mismatch_ratio_max']:.3g}",
        )
    if args.accuracy_seeds:
        runs = Path(tempfile.mkdtemp(prefix="bench-precision-runs-"))
        gains = {
            label: [accuracy_gain(seed, mixed, args.rollout_dtype, runs) for seed in range(args.accuracy_seeds)]
            for label, mixed in ARMS.items()
        }
        for label, values in gains.items():
            print(f"{label}: held-out accuracy gain per seed {', '.join(f'{g:+.3f}' for g in values)}")
            report(
                f"bench_precision: held-out accuracy gain, {label} trainer, SmolLM2 recipe",
                round(statistics.mean(values), 4),
                None,
                unit="accuracy",
                note=f"seeds 0-{args.accuracy_seeds - 1}: {', '.join(f'{g:+.3f}' for g in values)}; "
                f"--rollout-dtype {args.rollout_dtype}; runs in {runs}",
            )
        differences = [b - f for b, f in zip(gains["bf16 mixed"], gains["float32"], strict=True)]
        print(f"bf16 mixed minus float32, paired by seed: {', '.join(f'{d:+.3f}' for d in differences)}")
        report(
            "bench_precision: held-out accuracy gain, bf16 mixed minus float32 paired by seed, SmolLM2 recipe",
            round(statistics.mean(differences), 4),
            None,
            unit="accuracy",
            note=f"seeds 0-{args.accuracy_seeds - 1}: {', '.join(f'{d:+.3f}' for d in differences)}; each seed's "
            f"two runs sample alike until their updates differ; --rollout-dtype {args.rollout_dtype}",
        )
    print(f"bf16 mixed / float32 update time: {spread(ratios).median:.2f}x")


if __name__ == "__main__":
    main()
