"""Selections over a whole mini-batch's response tokens: Clip-Cov's random cut, KL-Cov's top covariance share, and the
top-entropy quantile. Each is the same whatever the micro-batch plan and however many processes share the mini-batch.

How:
- One no-grad pass over every response of the mini-batch (gated ones too: each token counts in the covariance's means
  and in the entropy quantile) gives each token's log-prob and entropy under the current weights, before the
  mini-batch's forward/backward passes (update.py: `select_tokens`). Its selection reaches every micro-batch as a
  (N, T) mask.
- The canonical token order is the one-process order: responses by their global index (processes number them process
  by process, as update.mini_batch_plan does, so a process's tokens are one contiguous block of it), tokens by
  position. Each process passes its members of the mini-batch in that order (`SelectionTokens`), and learns where its
  block starts from one gather of a count per process.
- The covariance's means are float64 sums all-reduced over the processes (with the token count).
- Clip-Cov draws its share with one generator seeded from the update's seed, the epoch and the mini-batch (the same on
  every process, and whether or not an all-gated mini-batch was skipped), as a permutation of the candidates' canonical
  ranks: each process keeps the drawn ranks in its block.
- KL-Cov's top k: each process's k largest in canonical order (a stable sort), gathered (k per process, padded), then
  the k largest of those by covariance and, among equal ones, canonical rank. Exact: every token of the top k overall
  is in its process's top k.
- The entropy quantile: every token's entropy gathered (each process's padded to the longest share), the threshold the
  (1 - q) quantile by linear interpolation (torch.quantile's, TRL's), every token at or above it kept.

Shapes: n rows (this process's members of the mini-batch, in global order), T positions; M of their response tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SelectionTokens(NamedTuple):
    """This process's members of one mini-batch, in global order, from the selection pass (no grad)."""

    logp: torch.Tensor  # (n, T) current weights
    old_logp: torch.Tensor  # (n, T) the sampling policy's (the current ones where the update has none yet)
    advantages: torch.Tensor  # (n,)
    mask: torch.Tensor  # (n, T) float
    entropy: torch.Tensor | None  # (n, T) current weights; None when no entropy quantile is asked for


def block_of(count: int, accelerator) -> tuple[int, int]:
    """(where this process's block of `count` items starts in canonical order, the total over every process)."""
    acc = accelerator
    if acc.num_processes == 1:
        return 0, count
    counts = acc.gather(torch.tensor([count], device=acc.device)).tolist()  # (P,)
    return sum(counts[: acc.process_index]), sum(counts)


def covariance(t: SelectionTokens, accelerator) -> tuple[torch.Tensor, int]:
    """((M,) float64 (A - mean A)(logp - mean logp) of each response token, canonical order; the token count over
    every process). The means are over every response token of the mini-batch on every process."""
    on = t.mask.bool()
    adv = t.advantages[:, None].expand_as(t.logp)[on].double()  # (M,)
    logp = t.logp[on].double()  # (M,)
    sums = torch.stack(
        [adv.sum(), logp.sum(), torch.tensor(float(adv.numel()), dtype=torch.float64, device=adv.device)]
    )
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").to(adv.device)
    count = int(sums[2])
    if count == 0:
        return adv, 0
    return (adv - sums[0] / count) * (logp - sums[1] / count), count


def _scatter(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(M,) bool in canonical order -> (n, T) bool at the response tokens of `mask`."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    out[mask.bool()] = flat
    return out


@torch.no_grad()
def clip_cov_selection(t: SelectionTokens, params: dict, accelerator, generator: torch.Generator):
    """Clip-Cov (Cui et al. 2025; verl's compute_policy_loss_clip_cov): of the tokens PPO's clip leaves alone whose
    covariance lies strictly inside (clip_cov_lb, clip_cov_ub), a uniformly random max(int(clip_cov_ratio x tokens),
    1) (all of them if fewer). Returns ((n, T) bool, how many over every process)."""
    cov, total_tokens = covariance(t, accelerator)
    on = t.mask.bool()
    ratio = torch.exp(t.logp - t.old_logp)[on]  # (M,)
    adv = t.advantages[:, None].expand_as(t.logp)[on]  # (M,)
    clipped = -adv * ratio.clamp(1 - params["clip_low"], 1 + params["clip_high"]) > -adv * ratio
    candidate = (cov > params["clip_cov_lb"]) & (cov < params["clip_cov_ub"]) & ~clipped  # (M,)
    start, total = block_of(int(candidate.sum()), accelerator)
    drawn = torch.zeros(total, dtype=torch.bool)
    if total:
        share = max(int(params["clip_cov_ratio"] * total_tokens), 1)
        drawn[torch.randperm(total, generator=generator)[:share]] = True
    flat = torch.zeros_like(candidate)
    flat[candidate] = drawn[start : start + int(candidate.sum())].to(flat.device)
    return _scatter(flat, t.mask), int(drawn.sum())


@torch.no_grad()
def kl_cov_selection(t: SelectionTokens, params: dict, accelerator, generator: torch.Generator | None = None):
    """KL-Cov (Cui et al. 2025; verl's compute_policy_loss_kl_cov): the max(1, int(tokens x kl_cov_ratio)) tokens of
    largest covariance, of any advantage; equal covariances go by canonical order. Returns ((n, T) bool, how many)."""
    acc = accelerator
    cov, total_tokens = covariance(t, acc)
    if total_tokens == 0:
        return torch.zeros_like(t.mask, dtype=torch.bool), 0
    k = max(1, int(total_tokens * params["kl_cov_ratio"]))
    start, _ = block_of(cov.numel(), acc)
    local = torch.sort(cov, descending=True, stable=True).indices[:k]  # (<= k,) this process's k largest
    values = torch.full((k,), -torch.inf, dtype=torch.float64, device=cov.device)
    ranks = torch.full((k,), total_tokens, dtype=torch.long, device=cov.device)  # (padding ranks after every token)
    values[: len(local)], ranks[: len(local)] = cov[local], start + local
    if acc.num_processes > 1:
        values, ranks = (acc.gather(x.to(acc.device)).to(cov.device) for x in (values, ranks))  # (P k,)
    by_rank = torch.argsort(ranks, stable=True)
    top = ranks[by_rank[torch.sort(values[by_rank], descending=True, stable=True).indices[:k]]]  # (k,) ranks
    mine = top[(top >= start) & (top < start + cov.numel())] - start
    flat = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    flat[mine] = True
    return _scatter(flat, t.mask), k


def gather_values(values: torch.Tensor, accelerator) -> torch.Tensor:
    """Every process's `values` (M_p,), one after another: each padded to the longest for the gather, the padding
    dropped."""
    acc = accelerator
    if acc.num_processes == 1:
        return values
    sizes = acc.gather(torch.tensor([values.numel()], device=acc.device)).tolist()
    padded = torch.zeros(max(sizes), dtype=values.dtype, device=acc.device)
    padded[: values.numel()] = values
    gathered = acc.gather(padded).view(len(sizes), max(sizes)).to(values.device)  # (P, max M_p)
    return torch.cat([row[:size] for row, size in zip(gathered, sizes, strict=True)])


def linear_quantile(values: torch.Tensor, p: float) -> torch.Tensor:
    """torch.quantile(values, p)'s linear interpolation, without its limit of 2**24 values."""
    ordered = values.sort().values
    position = p * (ordered.numel() - 1)
    below = int(position // 1)
    above = min(below + 1, ordered.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], position - below)


@torch.no_grad()
def top_entropy_mask(t: SelectionTokens, quantile: float, accelerator) -> tuple[torch.Tensor, int]:
    """The response tokens whose entropy is at or above the (1 - quantile) quantile of every response token's of the
    mini-batch (Wang et al. 2025; TRL's top_entropy_quantile). Returns ((n, T) bool, how many over every process)."""
    on = t.mask.bool()
    every = gather_values(t.entropy[on].double(), accelerator)  # (tokens over every process,)
    if every.numel() == 0:
        return torch.zeros_like(on), 0
    threshold = linear_quantile(every, 1.0 - quantile)
    return on & (t.entropy.double() >= threshold), int((every >= threshold).sum())
