"""Policy loss: clipping, KL, entropy, the gradient being unchanged when gated sequences are skipped, and the
sampler-trainer mismatch (truncated importance sampling weights, the mismatch sums) on hand-computed cases."""

import math

import pytest
import torch

from qae_app.algo.losses import (
    LOSS_AGGREGATIONS,
    mismatch_sums,
    policy_loss,
    tis_weights,
    token_logprobs_and_entropy,
)
from qae_app.models.policy import build_tiny_model


def test_entropy_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(2, 3, 64)
    targets = torch.zeros(2, 3, dtype=torch.long)
    logp, entropy = token_logprobs_and_entropy(logits, targets, temperature=1.0)
    assert entropy.shape == logp.shape == (2, 3)
    assert torch.allclose(entropy, torch.full((2, 3), math.log(64)))
    assert torch.allclose(logp, torch.full((2, 3), -math.log(64)))


def test_temperature_scales_logits():
    logits = torch.tensor([[[2.0, 0.0]]])
    logp, _ = token_logprobs_and_entropy(logits, torch.tensor([[0]]), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(math.exp(1) / (math.exp(1) + 1)))


def _loss(ratio: float, adv: float):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = policy_loss(
        logp,
        torch.zeros(1, 1),
        torch.tensor([adv]),
        torch.ones(1, 1),
        0.2,
        0.28,
        "token",
        {"tokens": 1, "sequences": 1, "max_len": 1},
    )
    out.loss.backward()
    return out, logp.grad.item()


def test_clip_higher_bounds():
    # A > 0: clipped above 1 + 0.28 (gradient 0), not at 1.2
    out, grad = _loss(1.25, 1.0)
    assert grad != 0 and out.clip_high_count.item() == 0
    out, grad = _loss(1.3, 1.0)
    assert grad == 0 and out.clip_high_count.item() == 1
    # A < 0: clipped below 1 - 0.2
    out, grad = _loss(0.75, -1.0)
    assert grad == 0 and out.clip_low_count.item() == 1
    out, grad = _loss(0.85, -1.0)
    assert grad != 0 and out.clip_low_count.item() == 0
    # ratio 1: loss = -A, gradient -A * ratio
    out, grad = _loss(1.0, 2.0)
    assert out.loss.item() == pytest.approx(-2.0) and grad == pytest.approx(-2.0)


def test_k3_kl_is_zero_at_reference_and_positive_away_from_it():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    kw = dict(
        old_logp=logp,
        advantages=torch.zeros(1),
        mask=torch.ones(1, 2),
        clip_low=0.2,
        clip_high=0.28,
        aggregation="token",
        normalizer={"tokens": 2, "sequences": 1, "max_len": 2},
        kl_beta=1.0,
    )
    assert policy_loss(logp, ref_logp=logp, **kw).kl.item() == pytest.approx(0.0)
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    kl = policy_loss(logp, ref_logp=ref, **kw).kl.item()
    # k3 = exp(ref - logp) - (ref - logp) - 1, averaged over the 2 tokens
    expected = ((0.5 - math.log(0.5) - 1) + (2 - math.log(2) - 1)) / 2
    assert kl == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("aggregation", sorted(LOSS_AGGREGATIONS))
def test_skipping_gated_sequences_leaves_the_gradient_unchanged(aggregation):
    """Forward/backward over only the non-zero-advantage sequences, with the full mini-batch's normalizer, gives the
    same gradient as the full mini-batch: the skip is exact, not an approximation."""
    model, _ = build_tiny_model(seed=3)
    torch.manual_seed(0)
    n, t = 12, 7
    input_ids = torch.randint(4, 60, (n, t))
    mask = torch.zeros(n, t - 1)
    for i in range(n):
        mask[i, 2 : 2 + (i % 4) + 1] = 1  # responses of different lengths
    advantages = torch.tensor([0, 1.5, 0, 0, -2.0, 0, 0, 0, 0.7, 0, 0, 0], dtype=torch.float)
    with torch.no_grad():
        old, _ = token_logprobs_and_entropy(model(input_ids).logits[:, :-1], input_ids[:, 1:], 1.0)
    old = old + 0.05 * torch.randn_like(old)  # ratios away from 1, so clipping is exercised
    normalizer = {"tokens": mask.sum().item(), "sequences": n, "max_len": t}

    def grads(rows):
        model.zero_grad()
        logp, _ = token_logprobs_and_entropy(model(input_ids[rows]).logits[:, :-1], input_ids[rows, 1:], 1.0)
        out = policy_loss(logp, old[rows], advantages[rows], mask[rows], 0.2, 0.28, aggregation, normalizer)
        out.loss.backward()
        return out.loss.item(), [p.grad.clone() for p in model.parameters()]

    full_loss, full = grads(torch.arange(n))
    kept_loss, kept = grads((advantages != 0).nonzero().squeeze(1))
    assert kept_loss == pytest.approx(full_loss, abs=1e-7)
    assert any(g.abs().sum() > 0 for g in full)
    for a, b in zip(full, kept, strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the sampler and the trainer


def test_tis_weights_are_the_capped_ratio_of_old_to_sampler_probabilities():
    """d = old - sampler per token: 0 -> 1; 0.5 -> e^0.5 (under the cap); ln 3 -> 3, capped at 2; -1 -> e^-1 (a
    weight below 1 is never raised). Detached."""
    old = torch.tensor([[-1.0, -2.0, -0.25, -3.0]], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([[-1.0, -2.5, -0.25 - math.log(3.0), -2.0]], dtype=torch.float64)
    weights = tis_weights(old, sampler, cap=2.0)
    assert weights.shape == (1, 4)
    assert not weights.requires_grad
    assert weights.tolist() == [[1.0, math.exp(0.5), 2.0, math.exp(-1.0)]]


def test_identical_log_probs_give_weights_of_exactly_1_and_the_same_loss_bit_for_bit():
    logp = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).clamp(max=0)
    weights = tis_weights(logp, logp.clone(), cap=2.0)
    assert torch.equal(weights, torch.ones_like(logp))
    current = logp + 0.01
    args = (
        current,
        logp,
        torch.tensor([1.0, -0.5, 0.0], dtype=torch.float64),
        torch.ones_like(logp),
        0.2,
        0.28,
        "token",
        {"tokens": 15, "sequences": 3, "max_len": 5},
    )
    assert torch.equal(policy_loss(*args, token_weights=weights).loss, policy_loss(*args).loss)


def test_token_weights_scale_each_tokens_policy_loss_term():
    """Ratio 1 everywhere (logp = old), advantage 1, token aggregation over 3 tokens: loss = -(w1 + w2 + w3) / 3."""
    logp = torch.full((1, 3), -1.0, dtype=torch.float64)
    weights = torch.tensor([[1.0, 0.5, 2.0]], dtype=torch.float64)
    out = policy_loss(
        logp,
        logp.clone(),
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones_like(logp),
        0.2,
        0.28,
        "token",
        {"tokens": 3, "sequences": 1, "max_len": 3},
        token_weights=weights,
    )
    assert out.loss.item() == -3.5 / 3


def test_mismatch_sums_over_the_masked_tokens_by_hand():
    """d = [0, 0.5] on the two response tokens (the third is masked out, whatever its d): sum |d| = 0.5, k3 terms
    (e^0 - 0 - 1) + (e^0.5 - 0.5 - 1), 2 tokens, max ratio e^0.5."""
    old = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    sampler = torch.tensor([[-1.0, -2.5, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    sums = mismatch_sums(old, sampler, mask)
    assert sums.tolist() == [0.5, 0.0 + (math.exp(0.5) - 0.5 - 1.0), 2.0, math.exp(0.5)]
    assert mismatch_sums(old, sampler, torch.zeros_like(mask)).tolist() == [0.0, 0.0, 0.0, -math.inf]
