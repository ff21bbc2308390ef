"""Run by tests/e2e/test_accelerate.py under `accelerate launch` with 1 and with 2 processes: a few RL steps whose
responses do not depend on the process count, so the two updates can be compared.

The rollout engine is the real HF engine, called once per prompt with a seed made from the step and the prompt's
position in the step (the trainer's own engine seeds per process, so its samples differ between 1 and 2 processes).
Writes the final parameters to <runs_dir>/<run_name>.params.pt from the main process.

With `dynamic` (tests/train/test_dapo.py), the run uses dynamic sampling and the prompts in the second half of every
generation batch get G identical responses: their groups have no signal, so under 2 processes the second one never
has a group to train.

With `lockstep`, the trainer runs its forward passes as it does on sharded weights (FSDP, ZeRO-3, which accelerate
cannot set up on CPU): every process as many as the busiest one. Each process then writes how many forwards its model
ran to <runs_dir>/<run_name>.forwards.<rank>.

With `checkpointing`, the run uses --gradient-checkpointing; with `budget`, token-budget micro-batches
(--max-tokens-per-micro-batch 40: a few sequences each). With `lora` (tests/models/test_lora.py), the run trains LoRA
adapters of rank 4 with a KL term (the reference: the policy with its adapters off). With `attribution`
(tests/train/test_attribution.py), the run logs --log-entropy-attribution. With `bf16rollout`
(tests/train/test_rollout_correction.py), the engine samples from a bfloat16 copy of the weights and the trainer
corrects for it (--rollout-dtype bfloat16, so --rollout-correction tis). With `rewards` (tests/e2e/test_accelerate.py),
the run scores with the two rewards of tests/hacking_rewards.py (a correctness reward that never fires, a format
reward of weight 0.2), so its component_signal rows and a reward_signal alert come from groups of both processes.
With a policy loss's name (tests/e2e/test_policy_loss_processes.py: clip_cov,
kl_cov, gspo, cispo), the run trains with it, its selections set to pick many tokens; with `entropy`, the entropy
controls on too (a top-entropy quantile, an adaptive bonus).

Under FSDP2 (launched with configs/accelerate/fsdp2.yaml) the saved parameters are gathered whole.

    accelerate launch --num_processes N tests/scripts/same_samples.py RUNS_DIR RUN_NAME [dynamic][+lockstep][+lora]...
        (+shared: the training forward shares each group's prompt wherever two rows do: train/shared_prompts.py)
    accelerate launch ... tests/scripts/same_samples.py RUNS_DIR RUN_NAME MODE,MODE,...
        (one run per mode, named RUN_NAME-MODE with '.' for '+', one after the other in the same processes: a
        launch's processes spend ~10 s each importing torch and transformers, a run of the built-in model ~1.5 s)
"""

import dataclasses
import sys
from pathlib import Path

import torch

from qae_app.config import build_config
from qae_app.models.sharding import full_state_dict, is_sharded
from qae_app.train.trainer import Trainer

OPTIONS = dict(
    steps=3,
    prompts_per_step=4,
    group_size=8,
    num_mini_batches=4,
    micro_batch_size=3,
    eval_every=0,
    checkpoint_every=0,
    warmup_steps=4,
    seed=5,
)


class SeededPerPrompt:
    """The trainer's HF engine, sampling each prompt's group from its own seed: (step, global prompt index)."""

    def __init__(self, engine, first_prompt: int, uniform_from: int | None = None):
        self.engine, self.first_prompt, self.step = engine, first_prompt, 0
        self.uniform_from = uniform_from  # prompts at this position of a batch and later get n identical responses

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        self.step += 1
        samples = []
        for i, prompt in enumerate(prompts):
            uniform = self.uniform_from is not None and self.first_prompt + i >= self.uniform_from
            drawn = self.engine.generate(
                [prompt],
                1 if uniform else n,
                temperature,
                max_new_tokens,
                seed=1000 * self.step + self.first_prompt + i,
            )
            for sample in drawn * n if uniform else drawn:
                samples.append(dataclasses.replace(sample, prompt_index=i))
        return samples

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    def release_memory(self):
        self.engine.release_memory()

    def close(self):
        self.engine.close()


DYNAMIC = dict(dynamic_sampling=True, max_gen_batches=6, reward_values="-1,1")
MEMORY_MODES = {"checkpointing": dict(gradient_checkpointing=True), "budget": dict(max_tokens_per_micro_batch=40)}
LORA = dict(lora_rank=4, kl_beta=0.1, lr=1e-3)
BF16_ROLLOUT = dict(rollout_dtype="bfloat16")
LOSSES = {
    "clip_cov": dict(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=0.0),
    "kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=0.1),
    "gspo": dict(policy_loss="gspo", gspo_clip_low=0.002, gspo_clip_high=0.002),
    "cispo": dict(policy_loss="cispo", cispo_weight_cap=1.0001),
}
ENTROPY = dict(top_entropy_quantile=0.5, entropy_coef=0.01, entropy_target=5.0)
HACKING = str(Path(__file__).resolve().parents[1] / "hacking_rewards.py")
REWARDS = dict(reward=[f"{HACKING}:exact_with_unit", f"{HACKING}:one_char"], reward_weights="1,0.2")


def main(runs_dir: str, run_name: str, mode: str = "") -> None:
    modes = set(mode.split("+"))
    if "shared" in modes:  # each group's prompt once in every training forward, however little that spares here
        from qae_app.train import shared_prompts

        shared_prompts.MIN_SPARED_WORK = 0
    options = dict(
        OPTIONS,
        **(DYNAMIC if "dynamic" in modes else {}),
        **(LORA if "lora" in modes else {}),
        **(BF16_ROLLOUT if "bf16rollout" in modes else {}),
        **(REWARDS if "rewards" in modes else {}),
        log_entropy_attribution="attribution" in modes,
    )
    for mode_name, mode_options in {**MEMORY_MODES, **LOSSES, "entropy": ENTROPY}.items():
        if mode_name in modes:
            options.update(mode_options)
    trainer = Trainer(build_config(run_name=run_name, **options), Path(runs_dir), cpu=True)
    acc = trainer.accelerator
    per_step = options["prompts_per_step"]
    trainer.engine = SeededPerPrompt(
        trainer.engine,
        acc.process_index * per_step // acc.num_processes,
        uniform_from=per_step // 2 if "dynamic" in modes else None,
    )
    forwards = [0]
    if "lockstep" in modes:
        trainer.lockstep = True

        def count(module, args, kwargs):  # the training and no-grad passes (generate is not counted)
            if not generating[0]:
                forwards[0] += 1

        generating = [False]
        acc.unwrap_model(trainer.model).register_forward_pre_hook(count, with_kwargs=True)
        generate = trainer.engine.generate

        def generate_uncounted(*args, **kwargs):
            generating[0] = True
            try:
                return generate(*args, **kwargs)
            finally:
                generating[0] = False

        trainer.engine.generate = generate_uncounted
    trainer.fit()
    if "lockstep" in modes:
        (Path(runs_dir) / f"{run_name}.forwards.{acc.process_index}").write_text(str(forwards[0]))
    model = acc.unwrap_model(trainer.model)
    params = (
        full_state_dict(model)
        if is_sharded(model)  # (a collective: every process gathers)
        else {name: p.detach().cpu() for name, p in model.named_parameters()}
    )
    if acc.is_main_process:
        torch.save(params, Path(runs_dir) / f"{run_name}.params.pt")


if __name__ == "__main__":
    runs_dir, run_name, *mode = sys.argv[1:4]
    if mode and "," in mode[0]:  # several runs one after the other in this launch (its processes start once)
        for one_mode in mode[0].split(","):
            main(runs_dir, f"{run_name}-{one_mode.replace('+', '.')}", one_mode)  # (a run name has no '+')
    else:
        main(runs_dir, run_name, *mode)
