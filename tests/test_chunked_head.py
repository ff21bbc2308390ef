"""Chunked log-probs through the LM head: equal to the plain path (full logits, then losses.token_logprobs_and_entropy)
in values and gradients, for any chunk size, and through real Hugging Face models."""

import math

import pytest
import torch
import torch.nn.functional as F

from qae_app.chunked_head import default_chunk_tokens, head_logprobs_and_entropy
from qae_app.losses import token_logprobs_and_entropy


def plain_head_logprobs(hidden, weight, bias, targets, temperature, with_entropy=True):
    """The reference: the full logits (N, T, vocab), then the plain path."""
    return token_logprobs_and_entropy(F.linear(hidden, weight, bias), targets, temperature, with_entropy)


def head_inputs(n=3, t=5, width=8, vocab=50, dtype=torch.float64, seed=0, scale=1.0):
    """(hidden (n, t, width), weight (vocab, width), bias (vocab,), targets (n, t)), the first three leaves that
    require grad."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, t, width, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n, t), generator=gen)
    return hidden, weight, bias, targets


def values_and_grads(compute, leaves, upstream_logp, upstream_entropy=None):
    """(logp, entropy, grads of sum(upstream_logp * logp + upstream_entropy * entropy) w.r.t. leaves)."""
    logp, entropy = compute()
    loss = (upstream_logp * logp).sum()
    if upstream_entropy is not None:
        loss = loss + (upstream_entropy * entropy).sum()
    return logp.detach(), entropy.detach() if entropy is not None else None, torch.autograd.grad(loss, leaves)


def max_relative_gap(ours, reference):
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max().clamp(min=1e-300)).item()


# ---- the head alone --------------------------------------------------------------------------------------------------


def test_zero_weights_give_the_uniform_distribution():
    """Hand-computed: all logits 0 -> every token has log-prob -log V, every position entropy log V."""
    vocab = 64
    hidden = torch.randn(2, 3, 4)
    logp, entropy = head_logprobs_and_entropy(hidden, torch.zeros(vocab, 4), None, torch.zeros(2, 3, dtype=torch.long),
                                              temperature=0.5, chunk_tokens=4)
    assert logp.shape == entropy.shape == (2, 3)
    assert torch.allclose(logp, torch.full((2, 3), -math.log(vocab)))
    assert torch.allclose(entropy, torch.full((2, 3), math.log(vocab)))


# chunk sizes: 1, one that divides none of the 15 rows' splits evenly, the default, exactly all rows, more than all
@pytest.mark.parametrize("chunk_tokens", [1, 4, None, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_values_and_gradients_equal_the_plain_path(chunk_tokens, temperature):
    hidden, weight, bias, targets = head_inputs()
    leaves = (hidden, weight, bias)
    gen = torch.Generator().manual_seed(1)
    up_logp, up_entropy = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, bias, targets, temperature), leaves, up_logp,
                           up_entropy)
    ours = values_and_grads(lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, temperature,
                                                              chunk_tokens=chunk_tokens), leaves, up_logp, up_entropy)
    assert ours[0].dtype == ours[1].dtype == torch.float64
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-10)
    for mine, theirs in zip(ours[2], ref[2]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_log_probs_alone_and_no_bias_equal_the_plain_path():
    """The trainer's grad pass: log-probs only (no entropy computed), a head without bias."""
    hidden, weight, _, targets = head_inputs(vocab=37)
    up_logp = torch.randn(3, 5, dtype=torch.float64)
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, None, targets, 1.3, False), (hidden, weight),
                           up_logp)
    ours = values_and_grads(lambda: head_logprobs_and_entropy(hidden, weight, None, targets, 1.3, False, 6),
                            (hidden, weight), up_logp)
    assert ours[1] is None
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    for mine, theirs in zip(ours[2], ref[2]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_entropy_alone_has_the_plain_gradient():
    """A loss of the entropy only (the log-probs' gradient is None in the backward)."""
    hidden, weight, bias, targets = head_inputs(vocab=20)
    leaves = (hidden, weight, bias)
    ref = torch.autograd.grad(plain_head_logprobs(hidden, weight, bias, targets, 0.9)[1].sum(), leaves)
    ours = torch.autograd.grad(head_logprobs_and_entropy(hidden, weight, bias, targets, 0.9, chunk_tokens=2)[1].sum(),
                               leaves)
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_masked_padding_positions_give_the_plain_gradient():
    """Padded positions (pad id targets, mask 0) as the loss sees them: the masked loss's gradient is the plain one."""
    hidden, weight, bias, targets = head_inputs(n=4, t=6, vocab=30)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 3:] = 0  # a short response
    mask[3] = 0  # a placeholder row
    targets = torch.where(mask.bool(), targets, torch.zeros_like(targets))  # pad id 0 after the end
    leaves = (hidden, weight, bias)
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, bias, targets, 1.0, False), leaves, mask)
    ours = values_and_grads(lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, False, 5), leaves,
                            mask)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    assert ours[2][0][3].abs().max() == 0  # no gradient reaches a fully masked row
    for mine, theirs in zip(ours[2], ref[2]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_float32_equals_the_plain_path_to_float32_rounding():
    """Values within 1e-6 (relative to the largest) of the plain path's; gradients within 2e-6: on these sizes each
    path's gradients are ~1e-6 from the float64 ones (float32's own rounding over sums of 1000 terms, in another
    order)."""
    hidden, weight, bias, targets = head_inputs(n=4, t=33, width=32, vocab=1000, dtype=torch.float32, scale=0.5)
    leaves = (hidden, weight, bias)
    up_logp, up_entropy = torch.randn(2, 4, 33, generator=torch.Generator().manual_seed(2))
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, bias, targets, 0.8), leaves, up_logp,
                           up_entropy)
    ours = values_and_grads(lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 0.8, chunk_tokens=10),
                            leaves, up_logp, up_entropy)
    for mine, theirs, bound in zip([ours[0], ours[1], *ours[2]], [ref[0], ref[1], *ref[2]], [1e-6] * 2 + [2e-6] * 3):
        assert mine.dtype == theirs.dtype == torch.float32
        assert max_relative_gap(mine, theirs) < bound


def test_bf16_weights_give_bf16_gradients_close_to_float32():
    """bf16 head: logits from the bf16 matmul (as the model's head), softmax in float32, gradients in bf16; compared
    with the float32 computation on the same (bf16-representable) numbers, to bf16's precision."""
    hidden, weight, bias, targets = head_inputs(n=2, t=40, width=32, vocab=500, dtype=torch.bfloat16, scale=0.3)
    leaves = (hidden, weight, bias)
    up_logp, up_entropy = torch.randn(2, 2, 40, generator=torch.Generator().manual_seed(3))
    ours = values_and_grads(lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 0.9, chunk_tokens=7),
                            leaves, up_logp, up_entropy)
    as_float32 = [x.detach().float().requires_grad_() for x in leaves]
    ref = values_and_grads(lambda: plain_head_logprobs(*as_float32, targets, 0.9), as_float32, up_logp, up_entropy)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert [g.dtype for g in ours[2]] == [torch.bfloat16] * 3
    assert (ours[0] - ref[0]).abs().max() < 0.05  # log-probs ~ -6: bf16 logits (8 bits) are off by ~1e-2
    assert (ours[1] - ref[1]).abs().max() < 0.05
    for mine, theirs in zip(ours[2], ref[2]):
        assert max_relative_gap(mine, theirs) < 2e-2
    # and the same numbers as the plain path on the bf16 head (its logits upcast to float32)
    plain_bf16 = plain_head_logprobs(*leaves, targets, 0.9)
    torch.testing.assert_close(ours[0], plain_bf16[0].detach(), rtol=0, atol=1e-5)


def test_gradcheck_in_float64():
    hidden, weight, bias, targets = head_inputs(n=2, t=3, width=4, vocab=6)

    def both_outputs(h, w, b):
        return head_logprobs_and_entropy(h, w, b, targets, 0.7, chunk_tokens=4)

    assert torch.autograd.gradcheck(both_outputs, (hidden, weight, bias))


def test_without_grad_it_keeps_nothing_for_a_backward():
    hidden, weight, bias, targets = head_inputs()
    with torch.inference_mode():
        logp, entropy = head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, chunk_tokens=4)
    ref = plain_head_logprobs(hidden, weight, bias, targets, 1.0)
    assert not logp.requires_grad and logp.grad_fn is None
    torch.testing.assert_close(logp, ref[0].detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(entropy, ref[1].detach(), rtol=0, atol=1e-10)


def test_default_chunk_is_256_mib_of_float32_logits():
    assert default_chunk_tokens(151936) == 441  # 441 x 151936 x 4 bytes = 255.6 MiB
    assert default_chunk_tokens(64) == 2**20
    assert default_chunk_tokens(10**9) == 1


def test_bad_inputs_name_the_argument():
    hidden, weight, bias, targets = head_inputs(vocab=10)
    with pytest.raises(ValueError, match="chunk_tokens: 0"):
        head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match="token id 10 is outside"):
        head_logprobs_and_entropy(hidden, weight, bias, torch.full_like(targets, 10), 1.0)
    with pytest.raises(ValueError, match="targets: shape"):
        head_logprobs_and_entropy(hidden, weight, bias, targets[:, :2], 1.0)
    with pytest.raises(ValueError, match="head_weight: shape"):
        head_logprobs_and_entropy(hidden, weight.reshape(-1), bias, targets, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        head_logprobs_and_entropy(hidden.float(), weight, bias, targets, 1.0)
