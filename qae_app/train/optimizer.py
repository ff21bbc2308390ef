"""What the update is set up with, once per run: the optimizer and its learning-rate schedule."""

from __future__ import annotations

import torch


def optimizer_and_schedule(trainable: list[torch.nn.Parameter], lr: float, weight_decay: float, warmup_steps: int):
    """AdamW over `trainable` and its LR schedule: a linear warmup over `warmup_steps` updates, then constant."""
    # the fused kernel (one pass over all parameters) is several times faster than the per-tensor loop on CPU too
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0
    )
    return optimizer, schedule
