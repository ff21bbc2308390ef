"""Supervised warm start of the built-in tiny model on the arithmetic task's training split.

RL needs a policy that is sometimes right: from random weights every group is all-wrong and no estimator has signal.
`qae warmstart` trains the tiny model with cross-entropy on the answers (never on held-out problems) for a fixed number
of steps, deterministically for a given seed, and stops early on purpose: sampled held-out accuracy is about a third,
leaving RL room to improve it. Its output is what ships in `qae_app/assets/tiny/`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from qae_app.models import build_tiny_model
from qae_app.tasks import arith_task


@dataclass
class WarmstartConfig:
    steps: int = 525  # optimizer steps: ~30% sampled held-out accuracy, measured; more steps leave RL little to do
    batch_size: int = 64  # problems per step
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2  # fixed so the result does not depend on the machine's core count


def _batch(tokenizer, problems):
    """(input_ids, labels) with loss on the answer tokens only; right-padded."""
    rows = []
    for p in problems:
        prompt = tokenizer.encode(p.question)
        target = tokenizer.encode_target(p.answer)
        rows.append((prompt + target, [-100] * len(prompt) + target))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def warmstart(out_dir: Path, cfg: WarmstartConfig = WarmstartConfig(), on_step=None) -> Path:
    torch.set_num_threads(cfg.threads)
    model, tokenizer = build_tiny_model(cfg.seed)
    task = arith_task()
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
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save(out_dir)
    return out_dir
