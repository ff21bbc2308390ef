"""Every token's numbers from the trainer's side: what the update's passes know of each trained response that the store
keeps (store/tokens.py), and how many tokens the sampler and the trainer disagree on beyond the TIS cap.

The engine's numbers (each token's log-prob and entropy while it sampled) come with the samples themselves; the
trainer adds its old log-prob (the ratio's denominator) for the responses the update forwarded, and its entropy where
the engine measured none (vLLM). Only the kept responses' tokens leave the device; the counts are reduced over every
process, so two processes store one process's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

CAPPED_METRICS = ("mismatch_capped", "mismatch_capped_frac")  # their `steps` columns (store.STEP_METRICS)


@dataclass
class TrainerTokens:
    """The trainer's per-token numbers of this process's trained responses (rows in trained order)."""

    old_logprobs: dict[int, list[float]] = field(default_factory=dict)  # kept row -> [tokens] (forwarded rows only)
    entropies: dict[int, list[float]] = field(default_factory=dict)  # kept row -> [tokens] (a full pass only)
    mismatch: list[float | None] = field(default_factory=list)  # [N] mean |old - sampler| per response, or None


def trained_response_ids(batches: list, trained: list[bool], group_size: int) -> list[int]:
    """The step-wide index (group_idx x G + sample_idx) of each of this process's trained responses, in the order the
    update packs them. `trained` (B,): one flag per group of every batch, in order."""
    ids, local = [], 0
    for b in batches:
        for i in range(len(b.problems)):
            if trained[local]:
                first = (b.first_group + i) * group_size
                ids += range(first, first + group_size)
            local += 1
    return ids


def trainer_tokens(batch: dict, updated, n_local: int, kept_rows: list[int]) -> TrainerTokens:
    """The trainer's numbers of the first `n_local` rows of the update's `batch` (`updated`: its UpdateResult), the
    kept rows' per-token lists; [] mismatch where the engine returned no log-probs."""
    out = TrainerTokens()
    if not n_local or updated.computed_logp is None:
        return out
    mask = batch["response_mask"][:n_local].bool()  # (N, T-1)
    have_old = updated.have_old[:n_local]  # (N,)
    old = updated.computed_logp[:n_local]  # (N, T-1)
    if "sampler_logp" in batch:
        gap = (old - batch["sampler_logp"][:n_local]).abs() * mask  # (N, T-1)
        per_row = gap.sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
        out.mismatch = [
            value if known else None for value, known in zip(per_row.tolist(), have_old.tolist(), strict=True)
        ]
    for row in kept_rows:
        on = mask[row]
        if bool(have_old[row]):
            out.old_logprobs[row] = old[row][on].tolist()
        if updated.entropy is not None:
            out.entropies[row] = updated.entropy[row][on].tolist()
    return out


def capped_tokens(batch: dict, updated, advantages: torch.Tensor, n_local: int, cap: float, accelerator) -> dict:
    """mismatch_capped (tokens whose pi_old / pi_sampler is above `cap`) and mismatch_capped_frac, over the tokens the
    policy loss weighs (forwarded, advantage != 0) of every process; NULLs without the sampler's log-probs.
    `advantages` (N,) of the batch's rows."""
    if "sampler_logp" not in batch or updated.computed_logp is None:
        return dict.fromkeys(CAPPED_METRICS)
    weighed = updated.have_old & (advantages != 0)  # (N,)
    weighed[n_local:] = False  # (not a placeholder)
    on = batch["response_mask"].bool() & weighed[:, None]  # (N, T-1)
    ratio = torch.exp(updated.computed_logp - batch["sampler_logp"])  # (N, T-1)
    counts = torch.tensor(
        [float(((ratio > cap) & on).sum()), float(on.sum())], dtype=torch.float64, device=accelerator.device
    )  # (2,): capped, weighed
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    capped, tokens = counts.tolist()
    return {"mismatch_capped": capped, "mismatch_capped_frac": capped / tokens if tokens else None}
