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

`causal_lm_logprobs` is what `Trainer._forward_logprobs` computes, through this path: it runs a Hugging Face causal
LM with `logits_to_keep=1` (the model builds the logits of its last position only), takes the final hidden states
from its decoder, and passes them with `get_output_embeddings().weight` (tied embeddings are the same Parameter) to
`head_logprobs_and_entropy`. It refuses models whose logits are not `lm_head(last hidden state)` (Gemma's
soft-capping, Cohere's logit scale, Granite's logits scaling, ...) and heads sharded by FSDP1 or ZeRO-3.

FSDP2 (`fully_shard`, qae_app/models/sharding.py or accelerate's): after the model's forward the FSDP unit that owns the
head (the root, which holds embeddings, final norm and head) is unsharded explicitly (`FSDPModule.unshard()`: a no-op
where the root kept its weights gathered after the forward, as FSDP2 does by default; an all-gather otherwise), so
`get_output_embeddings().weight` is the gathered Parameter FSDP2 swapped into the module, the one its own forward reads.
Its gradient lands where the plain path's does, in that Parameter's `.grad`, and FSDP2's end-of-backward callback
reduce-scatters it into the sharded parameter (the unit's post-backward runs there for any group that the autograd graph
did not reach through the unit's outputs, which is the case here: the loss does not use the logits). A tied head is the
embedding's Parameter, gathered once, its gradient the sum of both uses as on the plain path.

Memory: the default chunk (`default_chunk_tokens`) makes one float32 chunk of logits `names.LOGPROB_CHUNK_BYTES` (256
MiB): 441 tokens for a 151,936 vocabulary. A chunk holds ~3 such tensors at once (logits, log-probs, and their exp or
gradient), so the head's working memory is ~0.75 GB whatever the token count, plus the weight's gradient buffer.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from qae_app.core.errors import QAEUserError

# the default chunk: in names, where `qae plan` (torch-free) reads it too
from qae_app.core.names import default_chunk_tokens


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
            if grad_entropy is not None:
                entropy = -(probs * logp_all).sum(-1, keepdim=True)  # (c, 1)
                # what multiplies -p, written over the log-probs: (c, V)
                per_prob = logp_all.add_(entropy).mul_(grad_entropy[start:end, None].to(compute_dtype))
                if grad_logp is not None:
                    per_prob.add_(grad_logp[start:end, None].to(compute_dtype))
            else:
                per_prob = grad_logp[start:end, None].to(compute_dtype)  # (c, 1), broadcast over the vocabulary
            grad_z = probs.mul_(per_prob).neg_()  # (c, V)
            del logp_all, per_prob
            if grad_logp is not None:
                grad_z[torch.arange(end - start, device=grad_z.device), targets[start:end]] += grad_logp[start:end].to(
                    compute_dtype
                )
            grad_logits = grad_z.div_(temperature)  # through z = logits / temperature
            if want_hidden:
                # in the weight's dtype, as autograd does on the plain path (the upcast's backward casts back)
                grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.T, h.to(compute_dtype))  # (V, H) += (V, c) @ (c, H)
            if want_bias:
                grad_bias += grad_logits.sum(0)
            del grad_z, grad_logits
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if want_weight else None,
            grad_bias.to(bias.dtype) if want_bias else None,
            None,
            None,
            None,
            None,
        )


def head_logprobs_and_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
):
    """Log-prob of each target token and the entropy of each position's distribution, both shaped like `targets`.

    hidden (..., H) are the states the LM head reads, head_weight (vocab, H) and head_bias (vocab,) | None the head,
    targets (...) token ids. Equal to `losses.token_logprobs_and_entropy(F.linear(hidden, head_weight, head_bias),
    targets, temperature, with_entropy)` (gradients too, through both outputs) while holding `chunk_tokens` rows of
    logits at a time (default: `default_chunk_tokens(vocab)`). Float32 outputs (float64 for float64 weights).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match the hidden states' "
            f"{tuple(hidden.shape)} without their last dimension; pass one target per position."
        )
    if head_weight.dim() != 2 or head_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"head_weight: shape {tuple(head_weight.shape)} is not (vocab, {hidden.shape[-1]}) for hidden "
            f"states of width {hidden.shape[-1]}. A sharded weight (FSDP, ZeRO-3) cannot be used here: "
            "compute the full logits and use losses.token_logprobs_and_entropy."
        )
    if hidden.dtype != head_weight.dtype:
        raise ValueError(
            f"hidden: dtype {hidden.dtype} differs from head_weight's {head_weight.dtype}; cast one to "
            "the other (autocast is not supported here)."
        )
    vocab = head_weight.shape[0]
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab)
    if chunk_tokens < 1:
        raise ValueError(
            f"chunk_tokens: {chunk_tokens} must be at least 1 (or None for the default, "
            f"{default_chunk_tokens(vocab)} here)."
        )
    if temperature <= 0:
        raise ValueError(f"temperature: {temperature} must be positive.")
    flat_targets = targets.reshape(-1)  # (M,)
    if flat_targets.numel() and bool(((flat_targets < 0) | (flat_targets >= vocab)).any()):
        bad = flat_targets[(flat_targets < 0) | (flat_targets >= vocab)][0].item()
        raise ValueError(f"targets: token id {bad} is outside the head's vocabulary [0, {vocab}).")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (M, H)
    logp, entropy = _ChunkedHeadLogprobs.apply(
        flat_hidden, head_weight, head_bias, flat_targets, float(temperature), with_entropy, int(chunk_tokens)
    )
    return logp.view(targets.shape), entropy.view(targets.shape) if entropy is not None else None


# ---- Hugging Face causal LMs ---------------------------------------------------------------------------------------

# config fields with which a model changes its logits after the head, each with the value that leaves them unchanged
# (Gemma 2/3 soft-capping, RecurrentGemma's, Cohere's logit scale, Granite's logits scaling)
LOGIT_TRANSFORM_FIELDS = {
    "final_logit_softcapping": None,
    "logits_soft_cap": None,
    "logit_scale": 1.0,
    "logits_scaling": 1.0,
}


def wrapper_chain(model: torch.nn.Module) -> list[torch.nn.Module]:
    """[model, the module it wraps, ...]: through DDP / FSDP / DeepSpeed (`.module`) and torch.compile (`._orig_mod`)
    wrappers; the last is the Hugging Face model."""
    chain = [model]
    while True:
        inner = getattr(chain[-1], "module", None)
        inner = inner if isinstance(inner, torch.nn.Module) else getattr(chain[-1], "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return chain
        chain.append(inner)


def _sharding_of(chain: list[torch.nn.Module], head_weight: torch.Tensor) -> str | None:
    """'FSDP2', 'FSDP1' or 'DeepSpeed ZeRO-3' where the head's weight is sharded across processes (gathered by the
    wrapper's forward, its gradient reduce-scattered by the wrapper's hooks), else None."""
    if getattr(head_weight, "ds_id", None) is not None:  # ZeRO-3 partitions the parameter in place
        return "DeepSpeed ZeRO-3"
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        if any(isinstance(m, FullyShardedDataParallel) for m in chain):
            return "FSDP1"
        if isinstance(head_weight, DTensor) or _fsdp2_owner_of_head(chain[-1]) is not None:
            return "FSDP2"
    return None


def _fsdp2_owner_of_head(core: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP2 unit whose parameters include the LM head's: the head module itself or its nearest ancestor that is an
    FSDPModule (the root under qae_app/models/sharding.py and accelerate's wrapping); None when there is none (or no
    torch.distributed in this build)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    head = core.get_output_embeddings()
    head_name = next((name for name, module in core.named_modules() if module is head), None)
    if head_name is None:
        return None
    parts = head_name.split(".") if head_name else []
    for depth in range(len(parts), -1, -1):
        module = core.get_submodule(".".join(parts[:depth]))
        if isinstance(module, FSDPModule):
            return module
    return None


def gathered_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (vocab, H), bias (vocab,) | None) of the LM head as the model's forward uses it: its own Parameters,
    or under FSDP2 the gathered Parameters of the unit that owns it (unsharded here if they are not already; call
    after the forward, which leaves the root gathered). Gradients reaching them are reduce-scattered by FSDP2 as the
    plain path's are."""
    from torch.distributed.tensor import DTensor

    core = wrapper_chain(model)[-1]
    weight, bias = plain_head(core)
    owner = _fsdp2_owner_of_head(core)
    if owner is not None:
        owner.unshard()  # (waits for the all-gather; nothing to do when already gathered)
        weight, bias = plain_head(core)
    if isinstance(weight, DTensor):
        raise QAEUserError(
            "model: its LM head weight is sharded (a DTensor) and no FSDP2 unit gathers it; the chunked "
            "log-probs need the whole weight. Use --logprob-chunk-tokens 0 for the full logits."
        )
    return weight, bias


def plain_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (vocab, H), bias (vocab,) | None) of the LM head of an unwrapped Hugging Face causal LM whose logits are
    `head(decoder's last hidden state)`; a clear error for a model that transforms them after the head."""
    config = getattr(model, "config", None)
    configs = [config] + ([config.get_text_config()] if hasattr(config, "get_text_config") else [])
    for cfg in configs:
        for field, unchanged in LOGIT_TRANSFORM_FIELDS.items():
            value = getattr(cfg, field, unchanged)
            if value is not None and value != unchanged:
                raise QAEUserError(
                    f"model: its config sets {field}={value}, so its logits are not the LM head's output and the "
                    "chunked log-probs (qae_app.algo.chunked_head) would be wrong for it. Compute the full logits "
                    "and use losses.token_logprobs_and_entropy instead."
                )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise QAEUserError(
            f"model: {type(model).__name__} has no nn.Linear output embedding (get_output_embeddings() "
            f"gave {type(head).__name__}); the chunked log-probs need one. Compute the full logits and "
            "use losses.token_logprobs_and_entropy instead."
        )
    return head.weight, head.bias


def _logits_keyword(model: torch.nn.Module) -> str:
    """The forward's keyword for computing the last positions' logits only (transformers >= 4.50; before: num_...)."""
    parameters = inspect.signature(model.forward).parameters
    keyword = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)
    if keyword is None:
        raise QAEUserError(
            f"model: {type(model).__name__}.forward takes no logits_to_keep, so it would build the full "
            "logits anyway; use losses.token_logprobs_and_entropy on them instead."
        )
    return keyword


def _check_logits_are_the_head_of_hidden(model_name: str, model_logits, last_hidden, weight, bias) -> None:
    """The model's own logits of its last position (n, 1, V) must be the head applied to the captured hidden state
    (n, 1, H): this catches a model that transforms its logits (or its head's input) in a way no config field says."""
    with torch.no_grad():
        if model_logits.shape[-1] != weight.shape[0]:
            raise QAEUserError(
                f"model: its logits have {model_logits.shape[-1]} entries per position but its LM head "
                f"{weight.shape[0]} rows (a padded vocabulary the model cuts?); the chunked log-probs "
                "cannot be used. Use losses.token_logprobs_and_entropy on the full logits instead."
            )
        ours = F.linear(last_hidden, weight, bias).double()
        theirs = model_logits.double()
        tolerance = 4 * torch.finfo(weight.dtype).eps * (1 + theirs.abs().max())
        gap = (ours - theirs).abs().max()
        if gap > tolerance:
            raise QAEUserError(
                f"model: {model_name}'s logits differ from its LM head applied to its last hidden state "
                f"(by up to {gap.item():.3g}): it transforms them (a logit scale, soft-capping, ...), so the chunked "
                "log-probs would be wrong for it. Use losses.token_logprobs_and_entropy on the full logits instead."
            )


def whole_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]:
    """(the unwrapped model, its LM head's weight and bias as they stand: under FSDP2 possibly the shards; use
    `gathered_head` after the forward), or the QAEUserError of a head sharded by FSDP1 or ZeRO-3, whose gathered
    weight and gradient reduction this module does not reach."""
    chain = wrapper_chain(model)
    core = chain[-1]
    weight, bias = plain_head(core)
    sharding = _sharding_of(chain, weight)
    if sharding not in (None, "FSDP2"):
        raise QAEUserError(
            f"model: its LM head is sharded by {sharding}; the chunked log-probs "
            "(qae_app.algo.chunked_head) need the whole weight on this process, which they get from "
            "FSDP2 (fully_shard) only. "
            "Use FSDP2 (configs/accelerate/fsdp2.yaml), or --logprob-chunk-tokens 0 for the full "
            "logits."
        )
    return core, weight, bias


def check_chunked_head(model: torch.nn.Module) -> int:
    """The vocabulary size of `model` (possibly wrapped) if `causal_lm_logprobs` can run it, else the QAEUserError it
    would raise: a head sharded by FSDP1 or ZeRO-3, logits that are not the head's output (by config, or found by one
    forward of a two-token sequence on the unwrapped model: no collective, except under FSDP2, where the unwrapped
    model is the sharded root and every process must call this). For deciding once per run, before training."""
    core, weight, _ = whole_head(model)
    _logits_keyword(core)
    probe = torch.zeros(1, 2, dtype=torch.long, device=weight.device)  # (1, 2) token 0 twice
    was_training = core.training
    core.eval()
    try:
        with torch.no_grad():
            causal_lm_logprobs(core, probe, torch.ones_like(probe), 0, 1.0, with_entropy=False)
    finally:
        core.train(was_training)
        owner = _fsdp2_owner_of_head(core)
        if owner is not None:
            owner.reshard()  # (back onto the shards the optimizer holds)
    return weight.shape[0]


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first: int,
    temperature: float,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
    **model_kwargs,
):
    """Log-probs and (if asked) entropies (n, T-1) of each sequence's next tokens, 0 at the positions before `first`:
    what `Trainer._forward_logprobs` computes from the full logits, without building them.

    input_ids and attention_mask (n, T). Position t's distribution predicts token t + 1, and the head runs only from
    position `first` on (as `logits_to_keep=T - first` on the plain path). `model` may be wrapped (DDP, Accelerate):
    the forward goes through the wrapper (DDP's gradient synchronization needs that), with `logits_to_keep=1`, and a
    hook on the decoder keeps its last hidden state (n, T, H), normalized, as the head reads it. Under FSDP2 the head
    is its gathered weight (`gathered_head`); FSDP1 and ZeRO-3 are refused: use the plain path for them.

    `model_kwargs` go to the model's forward as well (a KV cache of the positions before input_ids, their
    position_ids: qae_app.train.shared_prompts); attention_mask then covers the cache's columns too.

    In `Trainer._forward_logprobs` the model call, `token_logprobs_and_entropy` and the padding are then
    `return causal_lm_logprobs(model, input_ids, batch["attention_mask"][rows], first, self.cfg.temperature,
    with_entropy)`.
    """
    width = input_ids.shape[1]
    if not 0 <= first < width:
        raise ValueError(f"first: {first} must be a position of the sequences, in [0, {width}).")
    core, _, _ = whole_head(model)
    captured = {}

    def keep_last_hidden_state(module, args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    hook = core.get_decoder().register_forward_hook(keep_last_hidden_state)
    try:
        # use_cache=False: the model would otherwise build a KV cache (its config says use_cache) that nothing reads
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **{"use_cache": False, **model_kwargs, _logits_keyword(core): 1},
        )
    finally:
        hook.remove()
    hidden = captured["hidden"]  # (n, T, H)
    weight, bias = gathered_head(model)  # (after the forward: under FSDP2 the gathered weight it used)
    _check_logits_are_the_head_of_hidden(type(core).__name__, out.logits[:, -1:], hidden[:, -1:], weight, bias)
    logp, entropy = head_logprobs_and_entropy(
        hidden[:, first:-1], weight, bias, input_ids[:, first + 1 :], temperature, with_entropy, chunk_tokens
    )  # (n, T-1-first) each
    if first:
        logp = F.pad(logp, (first, 0))  # (n, T-1)
        entropy = F.pad(entropy, (first, 0)) if entropy is not None else None
    return logp, entropy


def logprob_chunk_tokens(model, requested: int | None, say) -> int:
    """The update's logprob_chunk_tokens, decided once for the run: `requested` (None: 256 MiB of float32 logits per
    chunk), or 0 (the full logits) where the model cannot take the chunked head (a head sharded by FSDP1 or ZeRO-3,
    soft-capped logits, a peft-wrapped model), which `say` tells once."""
    if requested == 0:
        return 0
    try:
        vocab = check_chunked_head(model)
    except QAEUserError as err:
        say(f"[yellow]note:[/] log-probs from the full logits, not in chunks of tokens: {err}")
        return 0
    return requested or default_chunk_tokens(vocab)
