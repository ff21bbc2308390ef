"""Supervised warm start of the built-in tiny model on a built-in task's training split.

RL needs a policy that is sometimes right: from random weights every group is all-wrong and no estimator has signal.
`qae warmstart --task T` trains the tiny model with cross-entropy on the gold responses of T's training problems (never
on held-out ones) for the task's fixed number of steps (`tasks.BUILTIN_TASKS[T].warmstart_steps`), deterministically
for a given seed, and stops early on purpose: sampled held-out accuracy stays between about a fifth and a half,
leaving RL room to improve it. The gold response is the answer for `arith` and the scratchpad plus answer for
`chain` (`Problem.meta["gold_response"]`). Its output is what ships in `qae_app/assets/` under the task's model name;
it is saved to `./warmstart/<task>` unless the shipped folder is asked for by name.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from qae_app.config import check_range
from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import Problem
from qae_app.data.tasks import BUILTIN_TASKS
from qae_app.models.policy import BUILTIN_CHECKPOINTS, build_tiny_model


@dataclass
class WarmstartConfig:
    task: str = "arith"  # a key of tasks.BUILTIN_TASKS
    steps: int | None = None  # optimizer steps; None: the task's shipped recipe
    batch_size: int = 64  # problems per step
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2  # fixed so the result does not depend on the machine's core count

    def resolved(self) -> WarmstartConfig:
        """A copy with the recipe's steps filled in; checked."""
        warm_startable = [name for name, task in BUILTIN_TASKS.items() if task.warmstart_steps > 0]
        if self.task not in warm_startable:
            reason = (
                f"'{self.task}' starts RL from the pretrained {BUILTIN_TASKS[self.task].model} as it is, with no "
                "warm start"
                if self.task in BUILTIN_TASKS
                else f"unknown built-in task '{self.task}'"
            )
            raise QAEUserError(f"task: {reason}. Choose one of: {', '.join(warm_startable)}.")
        steps = BUILTIN_TASKS[self.task].warmstart_steps if self.steps is None else self.steps
        if steps < 1:
            raise QAEUserError(f"steps: {steps}. Use a positive number of supervised steps.")
        check_range("seed", self.seed)  # the range `qae train` takes (torch refuses seeds beyond 64 bits)
        return dataclasses.replace(self, steps=steps)


def check_out_dir(out_dir: Path) -> Path:
    """`out_dir` if the checkpoint can be saved there (checked before training, not after)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise QAEUserError(
            f"out: {out_dir} is a file, not a folder. Pass a folder for the checkpoint (it is made if missing)."
        )
    return out_dir


def default_out_dir(task: str) -> Path:
    """Where `qae warmstart` saves by default: `warmstart/<task>` under the current folder, never inside the installed
    package (a rebuild there replaces the checkpoint every `qae train --data <task>` loads)."""
    return Path.cwd() / "warmstart" / task


def shipped_dir(task: str) -> Path:
    """Where the shipped checkpoint of `task` lives (what `qae train --data <task>` loads by default): written only
    when asked for (`qae warmstart --into-package`, or `--out` naming it)."""
    return BUILTIN_CHECKPOINTS[BUILTIN_TASKS[task].model]


def gold_response(problem: Problem) -> str:
    return problem.meta.get("gold_response", problem.answer)


def _batch(tokenizer, problems):
    """(input_ids, labels) with loss on the response tokens only; right-padded."""
    rows = []
    for p in problems:
        prompt = tokenizer.encode(p.question)
        target = tokenizer.encode_target(gold_response(p))
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def warmstart(out_dir: Path, cfg: WarmstartConfig | None = None, on_step=None) -> Path:
    """Train the tiny model on `cfg.task` and save it (weights, config, tokenizer) to `out_dir`.
    `on_step(step, loss, model, tokenizer)` is called after each optimizer step."""
    cfg = (cfg or WarmstartConfig()).resolved()
    out_dir = check_out_dir(out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # for the result's sake, and only while it trains: the caller's count after
    try:
        model, tokenizer = _train(cfg, on_step)
    finally:
        torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save(out_dir)
    return out_dir


def _train(cfg: WarmstartConfig, on_step):
    """The warm start's supervised steps: (model, tokenizer) after them."""
    model, tokenizer = build_tiny_model(cfg.seed)
    task = BUILTIN_TASKS[cfg.task].build()
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    model.train()
    for step in range(cfg.steps):
        input_ids, labels = _batch(tokenizer, rng.sample(task.train, cfg.batch_size))
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(step, loss.item(), model, tokenizer)
    return model, tokenizer
