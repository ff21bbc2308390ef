"""Policy loss: clipped importance ratio with separate low/high clip, aggregation, k3 KL, token entropy.

Shapes: N sequences (a mini-batch of responses), T response positions. `mask` is 1 on response tokens.
Advantages are per sequence ([N]) and broadcast over its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qae_app.core.errors import QAEUserError
from qae_app.core.names import LOSS_AGGREGATIONS  # how per-token losses become one number, by name


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, to backpropagate
    pg_loss: torch.Tensor  # scalar, policy-gradient part
    kl: torch.Tensor  # scalar, mean k3 KL over tokens (0 without a reference)
    clip_low_count: torch.Tensor  # tokens clipped from below (A < 0, ratio < 1 - clip_low)
    clip_high_count: torch.Tensor  # tokens clipped from above (A > 0, ratio > 1 + clip_high)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                               with_entropy: bool = True):
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
    clip_low: float,
    clip_high: float,
    aggregation: str,
    normalizer: dict,
    ref_logp: torch.Tensor | None = None,  # (N, T) frozen reference, for the KL term
    kl_beta: float = 0.0,
) -> LossOutput:
    adv = advantages[:, None]  # (N, 1) broadcast over tokens
    ratio = torch.exp(logp - old_logp)  # (N, T)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # pessimistic bound, as PPO
    pg_loss = aggregate(per_token, mask, aggregation, normalizer)

    if ref_logp is not None and kl_beta > 0:
        delta = ref_logp - logp
        kl_per_token = torch.exp(delta) - delta - 1.0  # k3 estimator, >= 0
        kl = aggregate(kl_per_token, mask, aggregation, normalizer)
        loss = pg_loss + kl_beta * kl
    else:
        kl = torch.zeros((), device=logp.device)
        loss = pg_loss

    with torch.no_grad():
        on = mask.bool()
        clip_low_count = ((ratio < 1.0 - clip_low) & (adv < 0) & on).sum()
        clip_high_count = ((ratio > 1.0 + clip_high) & (adv > 0) & on).sum()
    return LossOutput(loss, pg_loss.detach(), kl.detach(), clip_low_count, clip_high_count)
