"""Which kernels the decode loop (`qae_app.engines.decode`) runs on this machine, chosen once per process.

Three of the loop's choices differ in speed, and which is faster depends on the CPU (its vector width, whether oneDNN
has bf16 kernels for it, its cache sizes), not on anything the loop can know in advance. On an Intel Xeon with
AVX512_BF16, packing cut the bf16 matmuls' time by ~25% and SDPA read the cache 3x faster than oneDNN's bf16 batched
matmul; on an AMD EPYC with AVX512_BF16 the loop with those choices was 1.5x slower than `model.generate` (issue 50);
on an AMD EPYC with AVX2 only, oneDNN cannot pack bf16 weights at all and the grouped matmuls in float32 attend a bf16
cache 2x faster than SDPA (at 100-300 cache columns, 2026-12-05). (The Intel figures: 2026-12-04,
bench/bench_generate.py; `python bench/bench_generate.py --only-roofline` prints what this module chose.)

- `pack`: bf16 weights packed once per call into oneDNN's blocked layout, where this torch and CPU pack them and the
  packed product is F.linear's to the bit (`packing_matches`), or F.linear. Measured (below).
- `draw_rows`: the sampling draw DRAW_ROWS batch rows at a time (its vocabulary-wide temporaries stay in cache) or
  the whole batch at once (to the bit the same tokens, log-probs and entropies: each row's numbers are its own).
  Measured.
- `sdpa_per_token`: attention of each new token by scaled_dot_product_attention over the cache's column slices, or
  by two float32 batched matmuls with each key head serving its group of query heads. Both compute the scores and
  the softmax in float32 but sum in another order, so they differ in the last float32 bits, which can change
  which token is drawn. So this one is never timed: a choice that followed the clock would let the same
  seed sample other responses from one launch to the next, or in each process of one launch. It follows the CPU:
  SDPA in bf16 where oneDNN has bf16 kernels (AVX512_BF16 or AMX, the Intel case), the grouped matmuls otherwise
  (in float32 always, and in bf16 on AVX2, the AMD case). Every process of a machine chooses alike, and so does a
  resume on the same kind of machine.

The two measured choices alternate their options a few times and keep each one's fastest run (the one the load
disturbed least); the option the loop starts from is kept unless the other is faster by SWITCH_MARGIN. Either way
the numbers are the same to the bit; the measurements take well under a second on SmolLM2 and are cached for the
process. `tests/engines/test_decode.py` forces each option and checks the samples.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DRAW_ROWS = 4  # batch rows sampled at a time when drawing in chunks: 4 x SmolLM2's 49152 floats fit a core's L2
SWITCH_MARGIN = 0.9  # the other option must take at most this share of the default's time to be chosen
ROUNDS = 5  # timed runs of each option, alternating
PROBE_ROWS = 32  # the batch the measurements use: the trainer's 4 prompts x 8 of the CPU recipe


@dataclass(frozen=True)
class Kernels:
    """The loop's choices (see the module's docstring); `Kernels()` is the loop's defaults."""

    pack: bool = True  # pack bf16 weights for oneDNN where this CPU can (else F.linear)
    sdpa_per_token: bool = False  # per new token: SDPA (else the grouped matmul); the default for bf16 is SDPA
    draw_rows: int | None = DRAW_ROWS  # rows per sampling chunk (None: the whole batch at once)


def fastest(
    default: Callable[[], object],
    other: Callable[[], object],
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> bool:
    """Whether `other` is faster than `default` by SWITCH_MARGIN: each run `rounds` times, alternating (after one
    untimed run each), each one's fastest run compared."""
    default(), other()
    best = [float("inf"), float("inf")]
    for index in range(rounds):
        for which in (0, 1) if index % 2 == 0 else (1, 0):
            start = clock()
            (default, other)[which]()
            best[which] = min(best[which], clock() - start)
    return best[1] < SWITCH_MARGIN * best[0]


@functools.cache
def packing_matches() -> bool:
    """Whether this torch packs a bfloat16 linear weight for oneDNN on this CPU (the private ops torch.compile's
    freezing uses) and the packed product equals F.linear's to the bit; any failure means the loop keeps plain
    weights."""
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=generator).bfloat16()
        x = torch.randn(5, 3, 64, generator=generator).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), F.linear(x, weight))
    except (AttributeError, RuntimeError):
        return False


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` is one the loop may pack: bf16 on a CPU whose oneDNN packs to F.linear's bit."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and packing_matches()


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, kv_heads: int, scaling: float
) -> torch.Tensor:
    """Attention of one query per row, q (rows, heads, 1, head_dim), over k, v (rows, kv_heads, columns, head_dim)
    with `bias` (rows, columns), 0 or -inf per column: two batched matmuls, each key head serving its group of query
    heads at once (query head h reads key head h // (heads / kv_heads), as transformers' repeat_kv pairs them). In
    float32 whatever the inputs' dtype, as SDPA's CPU kernel computes the scores and the softmax, so the two differ
    only in the order of float32 sums (in bfloat16 the scores would be rounded to 8 bits before the softmax); the
    output in q's dtype."""
    rows, heads, _, head_dim = q.shape
    grouped = q.float().reshape(rows, kv_heads, heads // kv_heads, head_dim)  # (rows, kv_heads, group, head_dim)
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)) * scaling + bias.float()[:, None, None, :]
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())  # (rows, kv_heads, group, head_dim)
    return out.to(q.dtype).view(rows, heads, 1, head_dim)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool, scaling: float
) -> torch.Tensor:
    """scaled_dot_product_attention with grouped key heads (enable_gqa where torch has it, torch >= 2.5)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, is_causal=causal, scale=scaling, enable_gqa=True
            )
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scaling)


_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@functools.cache
def onednn_has_bf16_kernels() -> bool:
    """Whether oneDNN computes bf16 natively on this CPU (AVX512_BF16 or AMX): there SDPA attends a bf16 cache
    fastest."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def choose(
    device_type: str,
    dtype: torch.dtype,
    hidden: int,
    intermediate: int,
    vocab: int,
    draw: Callable,
) -> Kernels:
    """The loop's kernels for a model of these shapes, in `dtype` on `device_type` (see the module's docstring): the
    faster option of `pack` and `draw_rows` (`draw` being the loop's sampling draw, decode.draw), the attention by the
    CPU; off a CPU, the defaults."""
    if device_type != "cpu":
        return Kernels(pack=False, sdpa_per_token=dtype == torch.bfloat16, draw_rows=None)
    sdpa = dtype == torch.bfloat16 and onednn_has_bf16_kernels()  # by the CPU, never by the clock (docstring)
    generator = torch.Generator().manual_seed(0)
    # the draw's noise comes from torch's global generator: measuring must not move it (a run's samples follow its seed)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        pack = False
        weight = (torch.randn(intermediate, hidden, generator=generator) * 0.05).to(dtype)
        if can_pack(weight):
            x = torch.randn(PROBE_ROWS, hidden, generator=generator).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PROBE_ROWS)
            pack = not fastest(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), lambda: F.linear(x, weight)
            )
        logits = torch.randn(PROBE_ROWS, vocab, generator=generator).to(dtype)
        rows = torch.arange(PROBE_ROWS)
        chunked = not fastest(
            lambda: draw(logits, 1.0, rows, PROBE_ROWS, DRAW_ROWS),
            lambda: draw(logits, 1.0, rows, PROBE_ROWS, None),
            rounds=3,
        )
    return Kernels(pack=pack, sdpa_per_token=sdpa, draw_rows=DRAW_ROWS if chunked else None)


def for_model(model: torch.nn.Module, draw: Callable) -> Kernels:
    """The kernels for a Llama-family `model` as it is (its device, dtype and shapes), chosen once per process;
    `draw`: the loop's sampling draw (decode.draw), timed in row chunks and whole."""
    config = model.config
    weight = model.lm_head.weight
    return choose(
        weight.device.type,
        weight.dtype,
        config.hidden_size,
        config.intermediate_size,
        weight.shape[0],
        draw,
    )
