"""After the update: how it changed the token entropy of the step's trained responses (dH), over all groups and per
regime (the step columns dH, dH_hard, dH_easy; `--log-entropy-delta`)."""

from __future__ import annotations

import math

import torch

from qae_app.algo.advantages import REGIMES, quantile_regimes
from qae_app.train.update import OneProcess, UpdateOptions, logprobs_in_chunks

ENTROPY_CHANGE_METRICS = ("dH", "dH_hard", "dH_easy")  # what entropy_change measures, by its column names


def entropy_change(
    model,
    batch,
    entropy_before: torch.Tensor,
    correct: torch.Tensor,
    split_k: float,
    group_size: int,
    options: UpdateOptions,
    accelerator=None,
    n_local: int | None = None,
) -> dict:
    """dH, dH_hard, dH_easy: the token-weighted mean change of token entropy over the step's trained responses
    (the first `n_local` rows of the batch, default all; `correct` (B, G) their verdicts) from before the update
    (`entropy_before`, the same pass) to after it, over all groups and per regime (`response_regimes` at `split_k`,
    the K that splits groups into hard and easy)."""
    n = batch["input_ids"].shape[0]
    acc = accelerator or OneProcess(batch["input_ids"].device)
    n_local = n if n_local is None else n_local
    _, entropy_after = logprobs_in_chunks(
        model, batch, torch.arange(n, device=acc.device), options, acc, with_entropy=True
    )
    mask = batch["response_mask"][:n_local]
    change = ((entropy_after - entropy_before)[:n_local] * mask).sum(-1)  # (N,) summed over each response
    tokens = mask.sum(-1)  # (N,)
    regime = response_regimes(correct, split_k, group_size).to(acc.device)  # (N,)
    parts = {
        "dH": torch.ones_like(tokens, dtype=torch.bool),
        "dH_hard": regime == REGIMES.index("hard"),
        "dH_easy": regime == REGIMES.index("easy"),
    }
    sums = torch.tensor(
        [[change[m].sum().item(), tokens[m].sum().item()] for m in parts.values()],
        dtype=torch.float64,
        device=acc.device,
    )  # (3, 2): change, tokens
    if acc.num_processes > 1:
        sums = acc.reduce(sums, reduction="sum")
    return {name: (c / t if t else math.nan) for name, (c, t) in zip(parts, sums.tolist(), strict=True)}


def response_regimes(correct: torch.Tensor, split_k: float, group_size: int) -> torch.Tensor:
    """(B * G,) the regime code (advantages.REGIMES) of each response's group, by the quantile rule on the group's
    verdicts `correct` (B, G) bool at `split_k` (advantages.quantile_regimes), so every estimator's groups split the
    same way."""
    if correct.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    return quantile_regimes(correct, split_k).repeat_interleave(group_size)  # (B,) -> (B * G,)
