"""Run by tests/test_accelerate.py under `accelerate launch` with 1 and with 2 processes: a few RL steps whose
responses do not depend on the process count, so the two updates can be compared.

The rollout engine is the real HF engine, called once per prompt with a seed made from the step and the prompt's
position in the step (the trainer's own engine seeds per process, so its samples differ between 1 and 2 processes).
Writes the final parameters to <runs_dir>/<run_name>.params.pt from the main process.

    accelerate launch --num_processes N tests/scripts/same_samples.py RUNS_DIR RUN_NAME
"""

import sys
from pathlib import Path

import torch

from qae_app.config import build_config
from qae_app.trainer import Trainer

OPTIONS = dict(steps=3, prompts_per_step=4, group_size=8, num_mini_batches=4, micro_batch_size=3, eval_every=0,
               checkpoint_every=0, warmup_steps=4, seed=5)


class SeededPerPrompt:
    """The trainer's HF engine, sampling each prompt's group from its own seed: (step, global prompt index)."""

    def __init__(self, engine, first_prompt: int):
        self.engine, self.first_prompt, self.step = engine, first_prompt, 0

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        self.step += 1
        samples = []
        for i, prompt in enumerate(prompts):
            for sample in self.engine.generate([prompt], n, temperature, max_new_tokens,
                                               seed=1000 * self.step + self.first_prompt + i):
                sample.prompt_index = i
                samples.append(sample)
        return samples

    def sync_weights(self, model):
        self.engine.sync_weights(model)


def main(runs_dir: str, run_name: str) -> None:
    trainer = Trainer(build_config(run_name=run_name, **OPTIONS), Path(runs_dir), cpu=True)
    acc = trainer.accelerator
    trainer.engine = SeededPerPrompt(trainer.engine, acc.process_index * OPTIONS["prompts_per_step"]
                                     // acc.num_processes)
    trainer.fit()
    if acc.is_main_process:
        params = {name: p.detach().cpu() for name, p in acc.unwrap_model(trainer.model).named_parameters()}
        torch.save(params, Path(runs_dir) / f"{run_name}.params.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
