"""Policy loss: clipping, KL, entropy, and the gradient being unchanged when gated sequences are skipped."""

import math

import pytest
import torch

from qae_app.algo.losses import LOSS_AGGREGATIONS, policy_loss, token_logprobs_and_entropy
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
    out = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.28, "token",
                      {"tokens": 1, "sequences": 1, "max_len": 1})
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
    kw = dict(old_logp=logp, advantages=torch.zeros(1), mask=torch.ones(1, 2), clip_low=0.2, clip_high=0.28,
              aggregation="token", normalizer={"tokens": 2, "sequences": 1, "max_len": 2}, kl_beta=1.0)
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
    for a, b in zip(full, kept):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
