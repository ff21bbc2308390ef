"""The training forward with each group's prompt computed once: a group's G responses share their prompt, so its
tokens but the last go through the model once per distinct prompt (and the opening all prompts share, a chat
template's system message, once for all), their keys and values are indexed out to each response's row (what the
engine's prompt pass and vLLM's prefix caching do when sampling), and each response runs from its prompt's last token
on. The gradient of the shared keys and values sums over the group's rows (the backward of
the indexing), so the loss and its gradient are the full forward's to float32 rounding; on short answers to long
prompts most of the update's work is gone (SmolLM2's chat prompt is ~60 tokens against responses of <= 16).

    logp, entropy = shared_prompt_logprobs(model, batch, rows, temperature, with_entropy, chunk_tokens)
    # None where sharing spares fewer prompt tokens than pay for the extra forwards (MIN_SPARED_WORK)

The prompt pass calls the unwrapped model (a DDP wrapper runs its forward once per backward: the response pass);
under sharded weights (FSDP, ZeRO-3) or gradient checkpointing (which drops the cache) the trainer does not share.
"""

from __future__ import annotations

import inspect
import os

import torch

from qae_app.algo.chunked_head import causal_lm_logprobs, wrapper_chain
from qae_app.algo.losses import token_logprobs_and_entropy

# prompt tokens spared x parameters below which the second forward costs more than it saves: a forward's fixed cost
# (Python and dispatch, ~7 ms on the built-in model's 4 layers) is worth ~250 tokens of the built-in model's 0.8M
# parameters, and under one token of SmolLM2's 135M
MIN_SPARED_WORK = 2e8
COMMON_OPENING_MIN = 8  # tokens all distinct prompts must open with to get a forward of their own


def prompt_groups(input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """(the distinct prompts, in order of first appearance; each row's index into them) of rows whose first
    `prompt_lengths` (n,) tokens of `input_ids` (n, T) are their prompt."""
    index: dict[tuple[int, ...], int] = {}
    group = [
        index.setdefault(tuple(ids[:length]), len(index))
        for ids, length in zip(input_ids.tolist(), prompt_lengths.tolist(), strict=True)
    ]
    return [list(prompt) for prompt in index], group


def common_opening(prompts: list[list[int]]) -> int:
    """How many tokens the distinct `prompts` all open with (a chat template's system message), where there are
    several and they share at least COMMON_OPENING_MIN; else 0. At most the shortest's length - 1."""
    if len(prompts) < 2:
        return 0
    common = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
    return common if common >= COMMON_OPENING_MIN else 0


def spared_tokens(prompts: list[list[int]], group: list[int], common: int) -> int:
    """Prompt tokens the shared forward does not compute again: each row's prompt but its last token (which starts
    the row's own span), less the common opening once and each distinct prompt's rest once."""
    return sum(len(prompts[g]) - 1 for g in group) - common - sum(len(p) - 1 - common for p in prompts)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward's keyword for a KV cache: `cache` (transformers >= 5.x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prompts_cache(core: torch.nn.Module, prompts: list[list[int]], common: int, device):
    """(the KV cache of each distinct prompt but its last token, (k, kv_heads, prefix, head_dim) per layer; its
    attention mask (k, prefix), right-padded; the forward's keyword for it): the common opening once, then each
    prompt's rest at positions common.., with gradients."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=core.config)
    except TypeError:  # transformers before 4.56 builds its layers as they come
        cache = DynamicCache()
    keyword = _cache_keyword(core)
    keep = next(
        (
            {name: 1}
            for name in ("logits_to_keep", "num_logits_to_keep")
            if name in inspect.signature(core.forward).parameters
        ),
        {},
    )  # (its logits are not needed)
    if common:  # the common opening once, (1, common), its cache then every distinct prompt's
        core(input_ids=torch.tensor([prompts[0][:common]], device=device), use_cache=True, **keep, **{keyword: cache})
        cache.batch_select_indices(torch.zeros(len(prompts), dtype=torch.long, device=device))
    rest = max(len(p) for p in prompts) - 1 - common  # each prompt's rest but its last token, right-padded
    rest_mask = torch.tensor(
        [[1] * (len(p) - 1 - common) + [0] * (rest - len(p) + 1 + common) for p in prompts], device=device
    )  # (k, rest)
    prefix_mask = torch.cat([torch.ones(len(prompts), common, dtype=torch.long, device=device), rest_mask], dim=1)
    if rest:
        rest_ids = torch.tensor([p[common:-1] + [0] * (rest - len(p) + 1 + common) for p in prompts], device=device)
        positions = common + torch.arange(rest, device=device).expand(len(prompts), rest)
        core(
            input_ids=rest_ids,
            attention_mask=prefix_mask,
            position_ids=positions,
            use_cache=True,
            **keep,
            **{keyword: cache},
        )
    return cache, prefix_mask, keyword


def shared_prompt_logprobs(
    model: torch.nn.Module,
    batch: dict,
    rows: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int = 0,
):
    """Token log-probs and (if asked) entropies (n, T-1) of the response tokens of the batch's sequences `rows`, 0 at
    every other position, with each distinct prompt's tokens but the last computed once (see the module's
    docstring); None when sharing saves nothing (`prompt_groups`) or a row has no response token. `chunk_tokens`:
    the vocabulary projection that many tokens at a time (chunked_head), else the full logits."""
    input_ids = batch["input_ids"][rows]  # (n, T)
    response_mask = batch["response_mask"][rows]  # (n, T-1)
    n, width = input_ids.shape
    response_lengths = response_mask.sum(-1).long()  # (n,)
    if n < 2 or bool((response_lengths == 0).any()):
        return None
    starts = response_mask.argmax(-1)  # (n,) the position of each prompt's last token: it predicts the response's first
    prompts, group = prompt_groups(input_ids, starts + 1)
    common = common_opening(prompts)
    if not common and min(len(p) for p in prompts) < 2:  # (a prompt of one token would leave a row of padding only)
        return None
    core = wrapper_chain(model)[-1]
    if spared_tokens(prompts, group, common) * sum(p.numel() for p in core.parameters()) < MIN_SPARED_WORK:
        return None
    device = input_ids.device
    cache, prefix_mask, keyword = _prompts_cache(core, prompts, common, device)
    group_index = torch.tensor(group, device=device)
    cache.batch_select_indices(group_index)  # (n, kv_heads, prefix, head_dim) per layer: the backward sums the group

    # each row from its prompt's last token on, right-padded: (n, span); position j predicts token j + 1
    span = int(response_lengths.max()) + 1
    columns = starts[:, None] + torch.arange(span, device=device)  # (n, span)
    in_row = columns < width
    span_ids = torch.where(in_row, input_ids.gather(1, columns.clamp(max=width - 1)), 0)  # (n, span)
    span_mask = (torch.arange(span, device=device) <= response_lengths[:, None]).long()  # (n, span)
    attention_mask = torch.cat([prefix_mask[group_index], span_mask], dim=1)  # (n, prefix + span)
    extra = {"position_ids": columns, keyword: cache, "use_cache": True}
    if chunk_tokens:
        logp, entropy = causal_lm_logprobs(
            model, span_ids, attention_mask, 0, temperature, with_entropy, chunk_tokens, **extra
        )  # (n, span-1) each
    else:
        logits = model(input_ids=span_ids, attention_mask=attention_mask, **extra).logits[:, :-1]
        logp, entropy = token_logprobs_and_entropy(logits, span_ids[:, 1:], temperature, with_entropy)

    # back to the batch's layout: (n, T-1), the response's j-th token at column start + j
    predicts = torch.arange(span - 1, device=device) < response_lengths[:, None]  # (n, span-1)
    target = columns[:, :-1].clamp(max=width - 2)
    # (scatter_add: the positions past a row's response may share a column, each adding 0)
    out = [
        torch.zeros(n, width - 1, dtype=logp.dtype, device=device).scatter_add(
            1, target, torch.where(predicts, values, 0.0)
        )
        for values in (logp, entropy)
        if values is not None
    ]
    return out[0], (out[1] if entropy is not None else None)
