"""Token log-probs and entropies through the vocabulary projection, a chunk of tokens at a time.

`losses.token_logprobs_and_entropy` takes the full logits (N, T, vocab): with a 150k vocabulary and 4,096 tokens that
is 2.5 GB per float32 copy, and the log-softmax, its exp and the backward hold several. Here the LM head's matmul is
fused with the log-softmax: `head_logprobs_and_entropy` takes the hidden states (N, T, H) and the head's weight
(vocab, H), and a custom autograd function computes `chunk_tokens` rows of logits at a time, in the forward and again
in the backward (recomputing them instead of saving them, as verl's and Liger-Kernel's fused linear cross-entropy do).
Saved for the backward: the hidden states, the weight, the bias and the targets; never logits.

Numbers are those of the plain path: the logits are the head's matmul in the weights' dtype (as the model's own head
computes them), then upcast to float32 (float64 stays float64), divided by the temperature, and log-softmaxed; the
entropy is -sum(p * log p). So float64 agrees with the plain path to rounding, and bf16 weights give the same
logits. In the backward the logits' gradient is float32; the hidden states' gradient is its matmul with the weight in
the weight's dtype (what autograd does on the plain path), and the weight's gradient is computed and summed over the
chunks in float32 (one float32 (vocab, H) buffer, cast to the weight's dtype at the end), so bf16 rounding does not
add up over the chunks.

Memory: the default chunk (`default_chunk_tokens`) makes one float32 chunk of logits `CHUNK_BYTES` (256 MiB): 441
tokens for a 151,936 vocabulary. A chunk holds ~3 such tensors at once (logits, log-probs, and their exp or
gradient), so the head's working memory is ~0.75 GB whatever the token count, plus the weight's gradient buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 256 * 2**20  # one float32 chunk of logits (chunk_tokens x vocab x 4 bytes) by default


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one float32 chunk of logits is CHUNK_BYTES (441 for a 151,936 vocabulary), >= 1."""
    return max(1, CHUNK_BYTES // (vocab_size * 4))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The softmax runs in float32 at least, as in `losses.token_logprobs_and_entropy`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_log_softmax(hidden, weight, bias, temperature: float) -> torch.Tensor:
    """Log-softmax of one chunk's logits: (c, H) -> (c, vocab), float32 or float64."""
    logits = F.linear(hidden, weight, bias)  # (c, vocab) in the weight's dtype, as the model's head
    scaled = logits.to(_compute_dtype(weight.dtype)).div_(temperature)  # (a new tensor: .to copies or linear made it)
    del logits
    return F.log_softmax(scaled, dim=-1)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), bias (V,) | None, targets (M,)) -> (logp (M,), entropy (M,) | None).

    Differentiable in hidden, weight and bias through both outputs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_tokens):
        rows = hidden.shape[0]
        compute_dtype = _compute_dtype(weight.dtype)
        logp = torch.empty(rows, dtype=compute_dtype, device=hidden.device)
        entropy = torch.empty(rows, dtype=compute_dtype, device=hidden.device) if with_entropy else None
        for start in range(0, rows, chunk_tokens):
            end = min(start + chunk_tokens, rows)
            logp_all = _chunk_log_softmax(hidden[start:end], weight, bias, temperature)  # (c, V)
            logp[start:end] = logp_all.gather(-1, targets[start:end, None]).squeeze(-1)
            if with_entropy:
                entropy[start:end] = -(logp_all.exp().mul_(logp_all)).sum(-1)
            del logp_all
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a tensor of zeros
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:  # neither output reaches the loss
            return None, None, None, None, None, None, None
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        rows = hidden.shape[0]
        compute_dtype = _compute_dtype(weight.dtype)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # accumulated over chunks in float32 at least (bf16 sums would lose bits at every chunk)
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=compute_dtype, device=bias.device) if want_bias else None
        for start in range(0, rows, chunk_tokens):
            end = min(start + chunk_tokens, rows)
            h = hidden[start:end]  # (c, H)
            logp_all = _chunk_log_softmax(h, weight, bias, temperature)  # (c, V)
            probs = logp_all.exp()  # (c, V); becomes the gradient of the scaled logits z = logits / temperature
            # d logp_t / dz = onehot(t) - p;  d entropy / dz_j = -p_j (log p_j + entropy)
            # so dL/dz = onehot(t) g_logp - p * (g_logp + g_entropy (log p + entropy))
            per_prob = logp_all  # reused in place: (c, V) -> what multiplies -p
            if grad_entropy is not None:
                g_ent = grad_entropy[start:end, None].to(compute_dtype)  # (c, 1)
                entropy = -(probs * logp_all).sum(-1, keepdim=True)  # (c, 1)
                per_prob.add_(entropy).mul_(g_ent)
                if grad_logp is not None:
                    per_prob.add_(grad_logp[start:end, None].to(compute_dtype))
            else:
                per_prob = grad_logp[start:end, None].to(compute_dtype)  # (c, 1), broadcast over the vocabulary
            grad_z = probs.mul_(per_prob).neg_()  # (c, V)
            del logp_all, per_prob
            if grad_logp is not None:
                grad_z[torch.arange(end - start, device=grad_z.device), targets[start:end]] += \
                    grad_logp[start:end].to(compute_dtype)
            grad_logits = grad_z.div_(temperature)  # through z = logits / temperature
            if want_hidden:
                # in the weight's dtype, as autograd does on the plain path (the upcast's backward casts back)
                grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.T, h.to(compute_dtype))  # (V, H) += (V, c) @ (c, H)
            if want_bias:
                grad_bias += grad_logits.sum(0)
            del grad_z, grad_logits
        return (grad_hidden,
                grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if want_bias else None,
                None, None, None, None)


def head_logprobs_and_entropy(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor | None,
                              targets: torch.Tensor, temperature: float, with_entropy: bool = True,
                              chunk_tokens: int | None = None):
    """Log-prob of each target token and the entropy of each position's distribution, both shaped like `targets`.

    hidden (..., H) are the states the LM head reads, head_weight (vocab, H) and head_bias (vocab,) | None the head,
    targets (...) token ids. Equal to `losses.token_logprobs_and_entropy(F.linear(hidden, head_weight, head_bias),
    targets, temperature, with_entropy)` (gradients too, through both outputs) while holding `chunk_tokens` rows of
    logits at a time (default: `default_chunk_tokens(vocab)`). Float32 outputs (float64 for float64 weights).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the hidden states' "
                         f"{tuple(hidden.shape)} without their last dimension; pass one target per position.")
    if head_weight.dim() != 2 or head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"head_weight: shape {tuple(head_weight.shape)} is not (vocab, {hidden.shape[-1]}) for hidden "
                         f"states of width {hidden.shape[-1]}. A sharded weight (FSDP, ZeRO-3) cannot be used here: "
                         "compute the full logits and use losses.token_logprobs_and_entropy.")
    if hidden.dtype != head_weight.dtype:
        raise ValueError(f"hidden: dtype {hidden.dtype} differs from head_weight's {head_weight.dtype}; cast one to "
                         "the other (autocast is not supported here).")
    vocab = head_weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be at least 1 (or None for the default, "
                         f"{default_chunk_tokens(vocab)} here).")
    if temperature <= 0:
        raise ValueError(f"temperature: {temperature} must be positive.")
    flat_targets = targets.reshape(-1)  # (M,)
    if flat_targets.numel() and bool(((flat_targets < 0) | (flat_targets >= vocab)).any()):
        bad = flat_targets[(flat_targets < 0) | (flat_targets >= vocab)][0].item()
        raise ValueError(f"targets: token id {bad} is outside the head's vocabulary [0, {vocab}).")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (M, H)
    logp, entropy = _ChunkedHeadLogprobs.apply(flat_hidden, head_weight, head_bias, flat_targets, float(temperature),
                                               with_entropy, int(chunk_tokens))
    return logp.view(targets.shape), entropy.view(targets.shape) if entropy is not None else None

