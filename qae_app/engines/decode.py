"""A hand-written sampling loop over a Llama-family model's own modules, used by the HF engine instead of
`model.generate` where it can be (`supports_decode_loop`): what vLLM does on a GPU, on the CPU.

Why: at a batch of 32, SmolLM2-135M spends its decode step in many small matmuls and in `generate`'s per-token
bookkeeping (a cache that grows by concatenation, logits processors, stopping criteria, finished rows still computed).
This loop
- runs each distinct prompt through the model once (a group's G samples share it) and computes the LM head only at its
  last position;
- keeps the keys and values in one preallocated buffer per layer, rows left-aligned as generate's left padding does,
  so a step writes one column instead of copying the cache;
- multiplies by the query/key/value weights as one matrix and by the gate/up weights as one matrix (bigger matmuls
  run nearer the machine's limit; each output equals the separate product to float32 rounding);
- drops rows that emitted a stop token from the batch and the cache (in batches, so the copy pays back);
- on a CPU in bfloat16 where oneDNN packs weights (AVX512_BF16, AMX), packs each weight once per call into oneDNN's
  blocked layout (what torch.compile's freezing does), so a step's matmuls do not re-lay the weight out each time
  (each product is F.linear's to the bit, checked once per process by `decode_kernels.packing_matches`);
- draws the sampling noise the way torch's exponential_ does (a double uniform, -log1p(-u)) but vectorised (2.5x
  faster at SmolLM2's vocabulary on an Intel Xeon; the same numbers from the same generator state, checked once per
  process by `_uniform_gives_exponential`);
- runs the prompts' common opening (a chat template's system message) through the model once for the whole batch.
Which kernels run is the CPU's business (`decode_kernels`), since what was fastest on an Intel Xeon with AVX512_BF16
made the loop slower than generate on an AMD EPYC with AVX512_BF16 (issue 50): packing or F.linear, and the draw a
few rows at a time or whole, are timed once per process on the model's shapes and the faster kept (either gives the
same numbers to the bit); SDPA or float32 grouped matmuls for each new token's attention, which differ in the last
bits, follow the CPU's features, so the same seed samples the same responses in every process.
bench/bench_generate.py's roofline part prints the choice and how close the loop comes to what the CPU allows in its
dtype.

What it samples is what `generate` samples: softmax(logits / T) drawn the way `torch.multinomial` draws one
sample (argmax of p / q, q ~ Exp(1) over the whole (rows, vocab) batch, every row's noise drawn each step as
generate draws it for its finished rows too), so with the same seed the tokens equal generate's wherever the logits
agree to the last bit: in float32 (tests/engines/test_decode.py checks tokens and log-probs against generate on the
built-in model and SmolLM2). In bfloat16 the loop's kernels round otherwise than generate's, so tokens may part ways
where two are nearly tied; the log-probs agree with the bfloat16 model's own forward as closely as generate's do
(checked there too, and on a sharp policy late in training). Neither cached decode matches a full-sequence bfloat16
forward more closely than that forward matches float32: bfloat16 rounds every key, value and residual to 8 bits, and
one token at a time against a cache rounds at other places than all positions at once (SmolLM2 at T 0.7, on an AMD
EPYC with AVX2, 2026-12-05: mean |dlogp| to the full bf16 forward 0.036 for the loop, 0.033 for generate; of that
forward to float32, 0.029). Only plain sampling (no top-k/top-p/min-p) on unsharded, un-adapted (no LoRA) weights
takes this path.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os

import torch
import torch.nn.functional as F

from qae_app.engines import decode_kernels
from qae_app.engines.decode_kernels import Kernels

# the module classes whose forward this loop re-implements; any other model (or a peft-wrapped linear) uses generate
_LLAMA_CLASSES = {"LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")}
COMPACT_FRACTION = 8  # drop finished rows once they are 1/8 of the batch: one cache copy per several finished rows


def supports_decode_loop(model: torch.nn.Module) -> bool:
    """Whether `model` is a Llama-family causal LM made of plain linear layers, the structure `sample` assumes."""
    classes = _LLAMA_CLASSES.get(type(model).__name__)
    if classes is None or getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer).__name__, type(attn).__name__, type(mlp).__name__) != classes:
            return False
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(linear) is not torch.nn.Linear for linear in linears):
            return False
    return type(model.lm_head) is torch.nn.Linear and model.lm_head.bias is None


class _Linear:
    """x @ weight.T (+ bias) as the loop computes it: with `pack` on a CPU in bfloat16 where oneDNN packs
    (decode_kernels.can_pack), from the weight packed once into oneDNN's blocked layout, which F.linear would otherwise
    re-lay out at every call; elsewhere F.linear, or the `module` itself where one is given (its forward hooks run, as
    generate runs them; a hooked module is never packed)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: int,
        module: torch.nn.Module | None = None,
        pack: bool = True,
    ):
        self.weight, self.bias, self.module, self.packed = weight, bias, module, None
        hooked = module is not None and bool(module._forward_hooks or module._forward_pre_hooks)
        if pack and not hooked and decode_kernels.can_pack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)  # rows: a hint for the layout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return self.module(x) if self.module is not None else F.linear(x, self.weight, self.bias)


def _fused(linears: list[torch.nn.Linear], rows: int, pack: bool) -> _Linear:
    """The linears stacked along their outputs: one matmul computes them all (one linear: the module itself)."""
    if len(linears) == 1:
        return _Linear(linears[0].weight, linears[0].bias, rows, module=linears[0], pack=pack)
    biases = [linear.bias for linear in linears]
    return _Linear(
        torch.cat([linear.weight for linear in linears]),
        torch.cat(biases) if all(b is not None for b in biases) else None,
        rows,
        pack=pack,
    )


@functools.cache
def _uniform_gives_exponential() -> bool:
    """Whether -log1p(-u), u a float64 torch.rand, is what this torch's CPU exponential_ draws from the same
    generator state, to the bit (torch draws a double uniform per number and transforms it one at a time)."""
    draws = []
    for draw in (
        lambda g: torch.empty(4096).exponential_(1, generator=g),
        lambda g: torch.rand(4096, dtype=torch.float64, generator=g).neg_().log1p_().neg_().float(),
    ):
        generator = torch.Generator().manual_seed(1)
        draws.append((draw(generator), torch.rand(8, generator=generator)))  # the generator's state after
    (exponential, after), (uniform, uniform_after) = draws
    return torch.equal(exponential, uniform) and torch.equal(after, uniform_after)


def _exponential_noise(rows: int, columns: int, device) -> torch.Tensor:
    """(rows, columns) float32 draws of Exp(1) from torch's global generator: the numbers `exponential_` draws, which
    `torch.multinomial` divides by, vectorised on a CPU where they are the same (`_uniform_gives_exponential`)."""
    if torch.device(device).type == "cpu" and _uniform_gives_exponential():
        return torch.rand(rows, columns, dtype=torch.float64, device=device).neg_().log1p_().neg_().float()
    return torch.empty((rows, columns), device=device).exponential_(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layers:
    """The model's weights as the loop uses them, fused once per call (the training model changes between calls)."""

    def __init__(self, model: torch.nn.Module, rows: int, kernels: Kernels):
        config = model.config
        self.model, self.kernels = model, kernels
        first = model.model.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.scaling = first.scaling
        layers = model.model.layers
        pack = kernels.pack
        self.qkv = [
            _fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], rows, pack)
            for layer in layers
        ]
        self.o = [_fused([layer.self_attn.o_proj], rows, pack) for layer in layers]
        self.gate_up = [_fused([layer.mlp.gate_proj, layer.mlp.up_proj], rows, pack) for layer in layers]
        self.down = [_fused([layer.mlp.down_proj], rows, pack) for layer in layers]
        self.lm_head = _fused([model.lm_head], rows, pack)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q (rows, heads, seq, head_dim) over k, v (rows, kv_heads, columns, head_dim); query head h
        reads key head h // (heads / kv_heads), as transformers' repeat_kv pairs them. `mask`: for one new token per
        row (seq 1) a (rows, columns) bias, 0 or -inf per column; for a prompt pass a (rows, 1, seq, columns) bool,
        True where a query may read a key, or None for plain causal attention."""
        seq = q.shape[2]
        if seq == 1 and not self.kernels.sdpa_per_token:
            return decode_kernels.grouped_attention(q, k, v, mask, self.kv_heads, self.scaling)
        causal = mask is None and seq > 1
        if seq == 1 and mask is not None:
            mask = mask[:, None, None, :]  # (rows, 1, 1, columns)
        return decode_kernels.sdpa_attention(q, k, v, mask, causal, self.scaling)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        start: int,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, (rows, seq, hidden), for `tokens` (rows, seq) at `positions`
        (rows, seq), writing their keys and values into columns start..start+seq of the per-layer buffers
        (rows, kv_heads, columns, head_dim) and attending to columns 0..start+seq. `key_mask` (rows, start+seq) is
        True where a column holds a token (not left padding); None when no row is padded."""
        model = self.model.model
        rows, seq = tokens.shape
        hidden = model.embed_tokens(tokens)  # (rows, seq, hidden)
        cos, sin = model.rotary_emb(hidden, positions)  # (rows, seq, head_dim)
        cos, sin = cos[:, None], sin[:, None]
        heads, kv_heads, end = self.heads, self.kv_heads, start + seq
        mask = None
        if key_mask is not None and seq == 1:  # (rows, end): 0 where a column holds a token, -inf where it is padding
            mask = torch.zeros(key_mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
                ~key_mask, float("-inf")
            )
        elif key_mask is not None:  # a prompt pass, (rows, 1, seq, end): causal, a padding query reads itself
            query_columns = start + torch.arange(seq, device=hidden.device)[:, None]  # (seq, 1)
            key_columns = torch.arange(end, device=hidden.device)  # (end,)
            mask = ((key_columns <= query_columns) & key_mask[:, None, None, :]) | (key_columns == query_columns)
        for index, layer in enumerate(model.layers):
            mlp = layer.mlp
            x = layer.input_layernorm(hidden)
            qkv = self.qkv[index](x).view(rows, seq, heads + 2 * kv_heads, self.head_dim).transpose(1, 2)
            qk = qkv[:, : heads + kv_heads]  # (rows, heads + kv_heads, seq, head_dim): both rotated at once
            qk = qk * cos + _rotate_half(qk) * sin
            keys[index][:, :, start:end] = qk[:, heads:]
            values[index][:, :, start:end] = qkv[:, heads + kv_heads :]
            out = self.attend(qk[:, :heads], keys[index][:, :, :end], values[index][:, :, :end], mask)
            out = self.o[index](out.transpose(1, 2).reshape(rows, seq, heads * self.head_dim))
            hidden = hidden + out
            x = layer.post_attention_layernorm(hidden)
            gate, up = self.gate_up[index](x).chunk(2, dim=-1)
            hidden = hidden + self.down[index](mlp.act_fn(gate) * up)
        return model.norm(hidden)


def draw(logits: torch.Tensor, temperature: float, rows: torch.Tensor, batch: int, chunk_rows: int | None):
    """(tokens, log-probs, entropies) of the rows `rows` (ascending) of a batch of `batch` rows, sampled as generate
    does.

    generate samples torch.multinomial(softmax(scores), 1), which draws q ~ Exp(1) of the whole (batch, vocab) batch
    and takes argmax(p / q); finished rows are sampled too. Drawing the same noise and keeping the active rows' part
    gives the same tokens for the same seed. With `chunk_rows` the work goes that many batch rows at a time (None: all
    at once): each row's numbers are its own (softmax and logsumexp are per row; the generator draws the noise row
    after row), so the result is the whole batch's to the bit, while the temporaries can stay in the core's cache and
    in malloc's heap (on an Intel Xeon the whole 32 x 49152 batch at once had its ~40 MB of temporaries mapped and
    faulted in afresh every step; decode_kernels measures which is faster here)."""
    chunk = chunk_rows or batch
    active = rows.tolist()
    parts = []
    for begin in range(0, batch, chunk):
        end = min(begin + chunk, batch)
        noise = _exponential_noise(end - begin, logits.shape[-1], logits.device)  # for finished rows too
        first, last = bisect.bisect_left(active, begin), bisect.bisect_left(active, end)
        if first < last:
            part = noise if last - first == end - begin else noise[rows[first:last] - begin]
            parts.append(_draw_rows(logits[first:last], temperature, part))
    return tuple(torch.cat(columns) for columns in zip(*parts, strict=True))


def _draw_rows(logits: torch.Tensor, temperature: float, noise: torch.Tensor):
    """`_draw` for some rows, given their noise: the log-prob of token t is s_t - logsumexp(s) and the entropy
    logsumexp(s) - sum(p * s): no full-vocabulary log-softmax, and no 0 x -inf to clean up."""
    scores = logits.float()  # (rows, vocab), divided by T as transformers' TemperatureLogitsWarper does (x / 1 is x)
    if temperature != 1.0:
        scores = scores / temperature
    probs = torch.softmax(scores, dim=-1)
    normalizer = torch.logsumexp(scores, dim=-1)  # (rows,)
    entropy = normalizer - (probs * scores).sum(-1)
    tokens = torch.div(probs, noise, out=noise).argmax(-1)  # (rows,): torch.multinomial's own arithmetic
    return tokens, scores.gather(-1, tokens[:, None]).squeeze(-1) - normalizer, entropy


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    encoded: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    stop_ids: list[int],
    kernels: Kernels | None = None,
) -> list[tuple[list[int], list[float], list[float]]]:
    """Per row of `encoded` (token ids; consecutive equal rows are a group sharing its prompt): the generated tokens
    (up to and including the first stop id, or max_new_tokens of them), their log-probs and the entropy at each
    position, sampled from softmax(logits / T) with torch's global generator. `kernels`: the CPU-specific choices
    (decode_kernels; by default those it chose for this CPU, once per process)."""
    device = next(model.parameters()).device
    batch = len(encoded)
    kernels = kernels or decode_kernels.for_model(model, draw)
    layers = _Layers(model, batch, kernels)
    width = max(len(ids) for ids in encoded)
    columns = width + max_new_tokens
    keys, values = _empty_cache(model, layers, batch, columns, device)
    lengths = torch.tensor([len(ids) for ids in encoded], device=device)
    logits, common = _prompt_pass(model, layers, encoded, width, keys, values)  # (batch, vocab)
    # True where a column holds a token: the prompts' common prefix, then each prompt's rest left-padded to `width`
    key_mask = torch.zeros(batch, columns, dtype=torch.bool, device=device)
    key_mask[:, :width] = (torch.arange(width, device=device) >= (common + width - lengths)[:, None]) | (
        torch.arange(width, device=device) < common
    )

    # the decode loop: a token for every row still sampling, one forward per step, from the cache
    rows = torch.arange(batch, device=device)  # the batch rows still sampling, in the buffers' order
    generated: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    entropies: list[list[float]] = [[] for _ in range(batch)]
    stops = torch.tensor(sorted(set(stop_ids)), device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # per buffer row
    for step in range(max_new_tokens):
        tokens, token_logp, entropy = draw(logits, temperature, rows, batch, kernels.draw_rows)
        for row, done, token, lp, ent in zip(
            rows.tolist(), finished.tolist(), tokens.tolist(), token_logp.tolist(), entropy.tolist(), strict=True
        ):
            if not done:  # a finished row kept in the batch until the next compaction samples nothing more
                generated[row].append(token)
                logprobs[row].append(lp)
                entropies[row].append(ent)
        finished = finished | torch.isin(tokens, stops)
        if bool(finished.all()) or step + 1 == max_new_tokens:
            break
        if int(finished.sum()) * COMPACT_FRACTION >= len(rows):  # drop the finished rows from batch and cache
            keep = (~finished).nonzero().squeeze(1)
            rows, tokens, lengths, key_mask = rows[keep], tokens[keep], lengths[keep], key_mask[keep]
            keys = [k[keep] for k in keys]
            values = [v[keep] for v in values]
            finished = finished[keep]
        column = width + step
        key_mask[:, column] = True
        hidden = layers.forward(
            tokens[:, None], (lengths + step)[:, None], keys, values, column, key_mask[:, : column + 1]
        )
        logits = layers.lm_head(hidden[:, -1])  # (rows, vocab)
    return list(zip(generated, logprobs, entropies, strict=True))


def _empty_cache(
    model: torch.nn.Module, layers: _Layers, batch: int, columns: int, device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the keys and the values (batch, kv_heads, columns, head_dim) of a decode of `columns` positions."""
    dtype = model.model.embed_tokens.weight.dtype
    # zeros, not empty: a masked column's score is dropped, but 0 x (a NaN value) would still reach the output
    keys = [
        torch.zeros(batch, layers.kv_heads, columns, layers.head_dim, dtype=dtype, device=device)
        for _ in model.model.layers
    ]
    return keys, [torch.zeros_like(k) for k in keys]


COMMON_PREFIX_MIN = 8  # tokens all prompts must share before their common prefix gets a forward of its own


def _prompt_pass(
    model: torch.nn.Module,
    layers: _Layers,
    encoded: list[list[int]],
    width: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> tuple[torch.Tensor, int]:
    """The prompt pass: each group's prompt once (consecutive equal rows of `encoded`), all groups in one forward,
    its keys and values then copied into the first `width` columns of the group's rows of `keys` and `values`.
    Where the distinct prompts open alike (a chat template's system message: 27 of SmolLM2's ~46 tokens on `add`),
    that common prefix goes through the model once, into columns 0..common, and each prompt's rest follows it,
    left-padded to `width`; otherwise (common 0) the prompts are left-padded to `width` whole, as generate pads them.
    Returns (the logits (batch, vocab) of each row's first token, the LM head run at the last position only; common)."""
    device, dtype = keys[0].device, keys[0].dtype
    prompts = [ids for ids, _ in itertools.groupby(encoded)]
    group = torch.tensor([g for g, (_, rows) in enumerate(itertools.groupby(encoded)) for _ in rows], device=device)
    common = len(os.path.commonprefix(prompts)) if len(prompts) > 1 else 0
    common = min(common, min(len(ids) for ids in prompts) - 1)  # every prompt keeps a token of its own
    common = common if common >= COMMON_PREFIX_MIN else 0
    prompt_keys = [
        torch.zeros(len(prompts), *k.shape[1:2], width, k.shape[3], dtype=dtype, device=device) for k in keys
    ]
    prompt_values = [torch.zeros_like(k) for k in prompt_keys]
    if common:  # the shared opening once, its keys and values then every prompt's
        shared = torch.tensor([prompts[0][:common]], device=device)  # (1, common)
        layers.forward(
            shared,
            torch.arange(common, device=device)[None],
            [k[:1] for k in prompt_keys],
            [v[:1] for v in prompt_values],
            0,
            None,
        )  # (into the first prompt's rows of the buffers)
        for k, v in zip(prompt_keys, prompt_values, strict=True):
            k[1:, :, :common], v[1:, :, :common] = k[:1, :, :common], v[:1, :, :common]
    rest_lengths = torch.tensor([len(ids) - common for ids in prompts], device=device)
    rest = width - common
    rest_mask = torch.arange(rest, device=device) >= (rest - rest_lengths)[:, None]  # (prompts, rest)
    rest_ids = torch.tensor([[0] * (width - len(ids)) + ids[common:] for ids in prompts], device=device)
    # as generate numbers left-padded positions: the padding's clamped to the first real one's
    positions = common + (rest_mask.long().cumsum(-1) - 1).clamp(min=0)
    key_mask = torch.cat([torch.ones(len(prompts), common, dtype=torch.bool, device=device), rest_mask], dim=1)
    # (no mask: plain causal attention, which SDPA aligns at the first column, so only without a common prefix)
    hidden = layers.forward(
        rest_ids,
        positions,
        prompt_keys,
        prompt_values,
        common,
        None if not common and bool(key_mask.all()) else key_mask,
    )
    for index in range(len(keys)):
        keys[index][:, :, :width] = prompt_keys[index][group]
        values[index][:, :, :width] = prompt_values[index][group]
    return layers.lm_head(hidden[group, -1]), common  # (batch, vocab)
