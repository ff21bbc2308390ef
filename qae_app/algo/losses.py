"""Policy loss: the registered loss of each token (algo/policy_loss_registry.py: clip, clip_cov, kl_cov, gspo,
cispo), then what every loss shares (the top-entropy mask, aggregation, k3 KL, the entropy bonus), token entropy, and
the sampler-trainer mismatch: truncated importance sampling weights and what the mismatch measures.

Shapes: N sequences (a mini-batch of responses), T response positions. `mask` is 1 on response tokens.
Advantages are per sequence ([N]) and broadcast over its tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qae_app.algo.policy_loss_registry import LossTokens, get_policy_loss
from qae_app.core.errors import QAEUserError
from qae_app.core.names import LOSS_AGGREGATIONS  # how per-token losses become one number, by name


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, to backpropagate
    pg_loss: torch.Tensor  # scalar, policy-gradient part
    kl: torch.Tensor  # scalar, mean k3 KL over tokens (0 without a reference)
    clip_low_count: torch.Tensor  # tokens the loss clipped from below (clip: A < 0, ratio < 1 - clip_low)
    clip_high_count: torch.Tensor  # tokens the loss clipped from above (clip: A > 0, ratio > 1 + clip_high)
    entropy_sum: torch.Tensor | None = None  # no grad: sum of the trained tokens' entropies (with `entropy`)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = True
):
    """Log-prob of each target token and the entropy of each position's distribution, both (N, T).

    logits (N, T, vocab) are divided by the sampling temperature, so both describe the distribution sampled from;
    computed in float32 at least (bf16/fp16 logits are upcast; float64 stays float64).
    """
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp_all = F.log_softmax(logits, dim=-1)  # (N, T, vocab)
    token_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N, T)
    if not with_entropy:  # the training forward needs only the log-probs
        return token_logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N, T)
    return token_logp, entropy


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str, normalizer: dict) -> torch.Tensor:
    """Reduce (N, T) per-token values to a scalar.

    normalizer: {"tokens": response tokens in the full mini-batch, "sequences": sequences in it, "max_len": int}.
    Using the full mini-batch's counts (not this tensor's) keeps the loss and its gradient identical when gated
    sequences, whose per-token loss is exactly 0, are left out of the forward pass.
    """
    if how == "token":
        return (per_token * mask).sum() / max(normalizer["tokens"], 1)
    if how == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (N,)
        return per_seq.sum() / max(normalizer["sequences"], 1)
    if how == "seq_mean_token_sum_norm":
        per_seq = (per_token * mask).sum(-1) / normalizer["max_len"]  # (N,)
        return per_seq.sum() / max(normalizer["sequences"], 1)
    raise QAEUserError(f"loss_agg: unknown value '{how}'. Choose one of: {', '.join(LOSS_AGGREGATIONS)}.")


def policy_loss(
    logp: torch.Tensor,  # (N, T) current policy
    old_logp: torch.Tensor,  # (N, T) policy that sampled (no grad)
    advantages: torch.Tensor,  # (N,)
    mask: torch.Tensor,  # (N, T) float
    clip_low: float | None,
    clip_high: float | None,
    aggregation: str,
    normalizer: dict,
    ref_logp: torch.Tensor | None = None,  # (N, T) frozen reference, for the KL term
    kl_beta: float = 0.0,
    token_weights: torch.Tensor | None = None,  # (N, T) no grad: each token's policy-loss weight (tis_weights)
    *,
    loss: str = "clip",  # the policy loss, by name (algo/policy_loss_registry.py)
    params: dict | None = None,  # its own options beyond the PPO clip (LossSettings.params)
    selected: torch.Tensor | None = None,  # (N, T) bool: the tokens its mini-batch selection picked
    trained: torch.Tensor | None = None,  # (N, T) bool: the tokens the top-entropy quantile kept; None: every one
    entropy: torch.Tensor | None = None,  # (N, T) the current policy's token entropies, with grad (the bonus)
    entropy_coef: float = 0.0,  # the bonus: minus entropy_coef x the trained tokens' mean entropy
) -> LossOutput:
    """The policy loss `loss` of one micro-batch, and what every loss shares: the top-entropy quantile's mask (a token
    it drops contributes nothing; the normalizer stays the mini-batch's, as TRL's), the rollout correction's weights
    (not on the KL term, as in TRL), the aggregation, the k3 KL to the reference, and the entropy bonus, whose mean
    is over the mini-batch's trained tokens (normalizer["trained_tokens"]) whatever the aggregation (as TRL's)."""
    terms = get_policy_loss(loss).loss(
        LossTokens(logp, old_logp, advantages, mask, selected),
        {**(params or {}), "clip_low": clip_low, "clip_high": clip_high},
    )
    per_token = terms.loss if trained is None else terms.loss * trained
    if token_weights is not None:
        per_token = per_token * token_weights
    pg_loss = aggregate(per_token, mask, aggregation, normalizer)
    loss_value = pg_loss
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None and kl_beta > 0:
        delta = ref_logp - logp
        kl = aggregate(torch.exp(delta) - delta - 1.0, mask, aggregation, normalizer)  # k3 estimator, >= 0
        loss_value = loss_value + kl_beta * kl
    entropy_sum = None
    if entropy is not None:
        weights = mask if trained is None else mask * trained
        entropy_total = (entropy * weights).sum()
        loss_value = loss_value - entropy_coef * entropy_total / max(normalizer.get("trained_tokens", 1), 1)
        entropy_sum = entropy_total.detach()
    with torch.no_grad():
        on = mask.bool()
        clip_low_count, clip_high_count = (terms.clipped_low & on).sum(), (terms.clipped_high & on).sum()
    return LossOutput(loss_value, pg_loss.detach(), kl.detach(), clip_low_count, clip_high_count, entropy_sum)


# ---------------------------------------------------------------------------------------------------------------
# the sampler and the trainer: by how much their numbers differ, and the correction


@torch.no_grad()
def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_old / pi_sampler, cap) per token, (N, T), detached; pi_old the trainer's
    log-probs of the sampling weights, pi_sampler the engine's while it sampled (TRL's importance_sampling_ratio with
    vllm_importance_sampling_cap; verl's token-level rollout IS in truncate mode). Where both are the same numbers
    every weight is exactly 1."""
    return torch.exp(old_logp - sampler_logp).clamp(max=cap)


@torch.no_grad()
def mismatch_sums(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(4,) float64 over the tokens `mask` (N, T) marks, with d = old_logp - sampler_logp (N, T): [sum |d|, sum of the
    k3 terms exp(d) - d - 1, token count, max exp(d)] (max -inf without tokens). Sums, so that mini-batches and
    processes add up; mean |d| = sums[0] / sums[2], the k3 estimate of KL(sampler || trainer) = sums[1] / sums[2]
    (verl's mismatch_k3_kl)."""
    on = mask.bool()
    d = (old_logp - sampler_logp)[on].double()  # (tokens,)
    ratio_max = d.exp().max() if d.numel() else torch.tensor(-math.inf, dtype=torch.float64, device=d.device)
    return torch.stack(
        [
            d.abs().sum(),
            (d.exp() - d - 1.0).sum(),
            torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device),
            ratio_max,
        ]
    )
