"""Benchmark: peak memory of the trainer's own policy update, measured, against `qae plan`'s prediction.

    python bench/bench_memory.py --vocab 151936 --hidden 256 --layers 2 --tokens 8192
    python bench/bench_memory.py --arch qwen3 --vocab 151936 --hidden 1024 --intermediate 3072 --heads 16 \\
        --kv-heads 8 --head-dim 128 --layers 2 --tokens 4096 --gradient-checkpointing [--lora-rank 16]
    python bench/bench_memory.py --model-config FOLDER_OR_GGUF --layers 2 --tokens 2048   # a real model's shapes
    python bench/bench_memory.py --tokens 4096 --logprob-chunk-tokens 0                   # the full logits

A transformers Llama or Qwen3 with the given shapes (random weights, float32; depth reduced to --layers) takes two RL
steps of `update.policy_update`, the function `qae train` runs, as the trainer sets it up: its AdamW
(`optimizer.optimizer_and_schedule`), its decision on the chunked log-prob head (`chunked_head.logprob_chunk_tokens`:
the chunks by default, the full logits for a LoRA model), `policy.enable_gradient_checkpointing`, `lora.apply_lora`. The
batch is `--sequences` synthetic sequences of --tokens tokens in all (half prompt, half response) with advantages +1,
-1, +1, ... (none gated); `--micro-batch-size` sequences go through each forward (default: all). Two steps, so that the
second backward runs with AdamW's moments allocated, as every step of a run after its first does.

Measured from outside: the update runs in a child process (this script with --child) and the parent reads the child's
peak resident set size from the kernel when it exits (bench/harness.py, as `/usr/bin/time -v`). "measured" is
that peak minus the child's resident size before the model is built (torch and transformers imported), which is
what `qae plan` predicts (on a GPU: the memory the run allocates). The last line printed is
`measured X GB predicted Y GB ratio Z` (ratio = measured / predicted); the ratio goes to the results log
(bench/harness.py) with tests/analysis/test_plan.py's goal, within 20%.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import add_child_options, peak_rss_of_child, ran_as_child, report

GB = 1e9
GOAL_RATIO = "between 0.8 and 1.2"  # measured / predicted, as tests/analysis/test_plan.py checks it


def current_rss() -> int:
    """This process's resident set size now, in bytes (Linux)."""
    with open("/proc/self/statm") as statm:
        import os

        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_shape(args):
    """The ModelShape of the model the child builds: --model-config's, or the options', --layers always applied."""
    from dataclasses import replace

    from qae_app.analysis.memory_plan import ModelShape
    from qae_app.analysis.memory_plan import model_shape as shape_of_model

    if args.model_config:
        return replace(shape_of_model(args.model_config), layers=args.layers)
    heads = args.heads or max(1, args.hidden // 64)
    return ModelShape(
        source="bench options",
        model_type=args.arch,
        vocab=args.vocab,
        hidden=args.hidden,
        intermediate=args.intermediate or 4 * args.hidden,
        layers=args.layers,
        heads=heads,
        kv_heads=args.kv_heads or heads,
        head_dim=args.head_dim or args.hidden // heads,
        tied_embeddings=not args.untied,
    )


def configuration(args, shape) -> str:
    """What the update ran on, in the results log's name: 'llama vocab 151936 hidden 256 x2 layers, 4096 tokens,
    chunked head'."""
    source = f"{Path(args.model_config).name} " if args.model_config else ""
    head = (
        "full logits"
        if args.lora_rank or args.logprob_chunk_tokens == 0
        else f"chunks of {args.logprob_chunk_tokens}"
        if args.logprob_chunk_tokens
        else "chunked head"
    )
    return (
        f"{source}{shape.model_type} vocab {shape.vocab} hidden {shape.hidden} x{shape.layers} layers, "
        f"{args.tokens} tokens in {args.sequences} sequences"
        + (f", micro-batches of {args.micro_batch_size}" if args.micro_batch_size else "")
        + (", checkpointing" if args.gradient_checkpointing else "")
        + (f", LoRA rank {args.lora_rank}" if args.lora_rank else "")
        + (", bf16 mixed precision" if args.mixed_precision == "bf16" else "")
        + f", {head}"
    )


def update_shape(args, shape):
    """What qae plan is told about the update the child runs."""
    from qae_app.analysis.memory_plan import UpdateShape, default_chunk_tokens

    length = args.tokens // args.sequences
    micro = args.micro_batch_size or args.sequences
    return UpdateShape(
        micro_tokens=micro * length,
        head_tokens=micro * (length - length // 2 + 1),
        chunk_tokens=(
            0
            if args.lora_rank or args.logprob_chunk_tokens == 0
            else args.logprob_chunk_tokens or default_chunk_tokens(shape.vocab)
        ),
        gradient_checkpointing=args.gradient_checkpointing,
        lora_rank=args.lora_rank,
        activation_bytes=2 if args.mixed_precision == "bf16" else 4,
        autocast_weight_copy=args.mixed_precision == "bf16",
    )


def run_update(args) -> None:
    """In the child: build the model and the batch as the trainer does, run two policy updates."""
    import contextlib

    import torch
    import transformers

    from qae_app.algo.chunked_head import logprob_chunk_tokens
    from qae_app.models.lora import apply_lora, trainable_parameters
    from qae_app.models.policy import disable_dropout, enable_gradient_checkpointing, quiet_transformers
    from qae_app.train import update
    from qae_app.train.optimizer import optimizer_and_schedule

    quiet_transformers()
    baseline = current_rss()
    shape = model_shape(args)
    config_class, model_class = (
        (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
        if shape.qk_norm
        else (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    )
    config = config_class(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(4096, args.tokens),
        tie_word_embeddings=shape.tied_embeddings,
    )
    torch.manual_seed(0)
    model = disable_dropout(model_class(config))
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    keyword = update.logits_keyword(model)
    if args.lora_rank:
        model = apply_lora(model, args.lora_rank, None, None)
    chunk_tokens = logprob_chunk_tokens(model, args.logprob_chunk_tokens, print)  # the trainer's decision
    optimizer, _ = optimizer_and_schedule(trainable_parameters(model), 1e-5, 0.0, 0)
    length = args.tokens // args.sequences
    prompt = length // 2
    ids = torch.randint(1, shape.vocab, (args.sequences, length))  # (N, T)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "response_mask": torch.cat(
            [torch.zeros(args.sequences, prompt - 1), torch.ones(args.sequences, length - prompt)], dim=1
        ),
    }  # (N, T-1)
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(args.sequences)])  # (N,)
    options = update.UpdateOptions(
        num_mini_batches=1,
        ppo_epochs=1,
        micro_batch_size=args.micro_batch_size or args.sequences,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token",
        kl_beta=0.0,
        max_grad_norm=1.0,
        max_new_tokens=length - prompt,
        temperature=1.0,
        logits_keyword=keyword,
        logprob_chunk_tokens=chunk_tokens,
    )
    setup = current_rss()
    precision = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if args.mixed_precision == "bf16"  # what accelerate does
        else contextlib.nullcontext()
    )
    for step in range(2):
        with precision:
            result = update.policy_update(model, optimizer, batch, advantages, options, seed=step, full_pass=True)
        print(f"step {step + 1}: loss {result.stats['loss']:.6f}, grad_norm {result.stats['grad_norm']:.6f}")
    print(
        f"log-prob chunk {chunk_tokens or 'off (full logits)'}; {sum(p.numel() for p in model.parameters()):,} "
        f"parameters"
    )
    print(f"baseline_rss {baseline / GB:.3f} GB (torch and transformers imported); after setup {setup / GB:.3f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    parser.add_argument(
        "--model-config",
        default=None,
        help="a model folder, .gguf file or HF id whose shapes to "
        "use (qae plan's model_shape); --layers still sets the depth",
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 4 x hidden")
    parser.add_argument("--heads", type=int, default=None, help="default: hidden / 64")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--untied", action="store_true", help="a separate LM head (default: tied to the embeddings)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the batch in all")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward (default: all)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument(
        "--mixed-precision",
        choices=["no", "bf16"],
        default="no",
        help="as qae train's: bf16 runs the update under bf16 autocast on float32 weights",
    )
    parser.add_argument(
        "--logprob-chunk-tokens",
        type=int,
        default=None,
        help="as qae train's: tokens per chunk of the log-prob head, 0 for the full logits",
    )
    add_child_options(parser)
    args = parser.parse_args()
    if ran_as_child(args, run_update):
        return
    from qae_app.analysis.memory_plan import update_components

    shape = model_shape(args)
    components = update_components(shape, update_shape(args, shape))
    predicted = sum(size for _, size, _ in components)
    peak, output = peak_rss_of_child(__file__, sys.argv[1:])
    print(output, end="")
    baseline = float(output.split("baseline_rss ")[1].split()[0]) * GB
    for name, size, what in components:
        print(f"  predicted {name:<16} {size / GB:7.3f} GB  {what}")
    measured = peak - baseline
    print(f"peak_rss {peak / GB:.2f} GB (baseline {baseline / GB:.2f} GB)")
    report(
        f"bench_memory: measured / predicted update memory, {configuration(args, shape)}",
        round(measured / predicted, 4),
        GOAL_RATIO,
        unit="x",
        note=f"measured {measured / GB:.2f} GB (peak {peak / GB:.2f} GB less {baseline / GB:.2f} GB before the "
        f"model), predicted {predicted / GB:.2f} GB",
    )
    print(f"measured {measured / GB:.2f} GB predicted {predicted / GB:.2f} GB ratio {measured / predicted:.2f}")


if __name__ == "__main__":
    main()
