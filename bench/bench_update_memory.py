"""Benchmark: peak memory of one whole policy update (update.policy_update), with and without the memory options.

    python bench/bench_update_memory.py --path plain
    python bench/bench_update_memory.py --path chunked
    python bench/bench_update_memory.py --path chunked --gradient-checkpointing

A transformers Llama at a reduced real shape (vocab 151,936 as Qwen's, hidden 256, 2 layers, float32, random weights)
takes one update on `--sequences` sequences of `--tokens` tokens in all (half prompt, half response), in one
micro-batch, as the trainer runs it: a no-grad pass for the old log-probs and entropies (the rows' statistics), then
one mini-batch's forward and backward and an AdamW step. `plain` computes the full logits (--logprob-chunk-tokens 0),
`chunked` the chunked vocabulary projection (its default chunk, 441 tokens here).

Measured from outside, as bench_head_memory.py does: the update runs in a child process (this script with --child)
and the parent reads the child's peak resident set size from the kernel when it exits (os.wait4's rusage, as
`/usr/bin/time -v` does). The last line printed is `peak_rss X GB`; the README's Memory table lists the figures.
"""

from __future__ import annotations

import argparse
import resource
import sys

from child_peak_rss import peak_rss_of_child

GB = 1e9


def run_update(args) -> None:
    """In the child: build the model and the batch, run one policy_update, print what it computed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qae_app import update
    from qae_app.chunked_head import default_chunk_tokens
    from qae_app.models import enable_gradient_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=max(4096, args.tokens), tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    length = args.tokens // args.sequences
    prompt = length // 2
    ids = torch.randint(1, args.vocab, (args.sequences, length))  # (N, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "response_mask": torch.cat([torch.zeros(args.sequences, prompt - 1),
                                         torch.ones(args.sequences, length - prompt)], dim=1)}  # (N, T-1)
    advantages = torch.linspace(-1.0, 1.0, args.sequences)  # (N,) none gated: every sequence is forwarded
    options = update.UpdateOptions(
        num_mini_batches=1, ppo_epochs=1, micro_batch_size=args.sequences, clip_low=0.2, clip_high=0.28,
        loss_agg="token", kl_beta=0.0, max_grad_norm=1.0, max_new_tokens=length - prompt, temperature=1.0,
        logits_keyword=update.logits_keyword(model),
        logprob_chunk_tokens=default_chunk_tokens(args.vocab) if args.path == "chunked" else 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (kilobytes on Linux)
    result = update.policy_update(model, optimizer, batch, advantages, options, seed=0, full_pass=True)
    print(f"path {args.path}{' + gradient checkpointing' if args.gradient_checkpointing else ''}: "
          f"loss {result.stats['loss']:.6f}, grad_norm {result.stats['grad_norm']:.6f}, "
          f"mean entropy {result.entropy[batch['response_mask'].bool()].mean().item():.4f}")
    print(f"setup_rss {setup_rss / GB:.2f} GB (torch, the model, the batch, before the update)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the batch in all")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--path", choices=["plain", "chunked"], required=True)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the child (default: torch's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        run_update(args)
        return
    peak, output = peak_rss_of_child(__file__, sys.argv[1:])
    print(output, end="")
    print(f"peak_rss {peak / GB:.2f} GB")


if __name__ == "__main__":
    main()
