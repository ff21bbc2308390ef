"""Whether an optimizer step can move the weights it trains, in the dtype they are stored in.

bfloat16 keeps 8 significant bits: a weight of 0.02 moves in steps of 1.2e-4, so an AdamW update of about lr (its
normalised step, |m / sqrt(v)| ~ 1) = 1e-6 rounds back to the weight it started from. Trained in place at such a
learning rate, bfloat16 weights barely move (10 AdamW steps at lr 1e-6 on N(0, 0.02) weights changed 1.9% of them;
the built-in model under `--dtype bfloat16 --lr 1e-6`, 1.5%) while the run looks healthy. float32 master weights
(`--dtype float32 --mixed-precision bf16`: bfloat16 compute, float32 weights and AdamW moments) keep every update.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qae_app.core.errors import QAEUserError

# below this share of the weights moved by an lr-sized step, a run trains a fraction of its model: refused
MIN_MOVED_FRACTION = 0.9
SAMPLED_PER_TENSOR = 1 << 16  # a strided sample of each weight: the share is a statistic, not a census
LOW_PRECISION = (torch.bfloat16, torch.float16)


def fraction_moved_by_a_step(parameters: Iterable[torch.Tensor], lr: float) -> float:
    """The share of the weights that a step of size `lr` changes once stored back in each weight's own dtype (1.0
    when every weight is float32 or wider). Weights are sampled with a stride, at most SAMPLED_PER_TENSOR each."""
    moved = total = 0
    with torch.no_grad():
        for weight in parameters:
            flat = weight.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // SAMPLED_PER_TENSOR)]
            if weight.dtype in LOW_PRECISION:
                stepped = (sample.float() - lr).to(weight.dtype)  # AdamW's step, stored as the weight is
                moved += int((stepped != sample).sum())
            else:
                moved += sample.numel()
            total += sample.numel()
    return moved / total if total else 1.0


def check_updates_move_the_weights(parameters: Iterable[torch.Tensor], lr: float, dtype: str) -> None:
    """Refuse, before any step, a run whose optimizer would update low-precision weights in place at a learning rate
    their precision cannot represent."""
    moved = fraction_moved_by_a_step(parameters, lr)
    if moved < MIN_MOVED_FRACTION:
        raise QAEUserError(
            f"lr: with --dtype {dtype} the optimizer updates {dtype} weights in place, and a step of --lr {lr:g} "
            f"changes only {moved:.1%} of them ({dtype} keeps 8 significant bits: a weight of 0.02 moves in steps of "
            "1.2e-4), so most of the model would never train. Keep float32 master weights: --dtype float32 "
            "--mixed-precision bf16 (bf16 compute, float32 weights and AdamW moments), or raise --lr."
        )
