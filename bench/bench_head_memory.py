"""Benchmark: peak memory of the vocabulary projection's log-probs, full logits (plain) against chunked.

    python bench/bench_head_memory.py --vocab 151936 --hidden 256 --tokens 4096 --path plain
    python bench/bench_head_memory.py --vocab 151936 --hidden 256 --tokens 4096 --path chunked [--chunk-tokens 441]

One LM head (vocab, hidden) and hidden states (1, tokens, hidden) go through what the trainer does with them: a
no-grad pass for the old log-probs and entropies, then a pass with gradients (log-probs only) and its backward, which
gives the head's weight and the hidden states their gradients. `plain` builds the full logits and calls
losses.token_logprobs_and_entropy; `chunked` calls chunked_head.head_logprobs_and_entropy.

The measurement is made from outside: the script runs the passes in a child process (itself, with --child) and reads
that process's peak resident set size from the kernel when it exits (os.wait4's rusage, as `/usr/bin/time -v` does).
The last line printed is `peak_rss X GB`; the peak goes to the results log (bench/harness.py), for the chunked path
with its goal: under one float32 logits tensor.

Measured here (CPU, float32, vocab 151,936, hidden 256; the child's RSS before the passes is 0.39 GB: torch, the
head, the hidden states):

    tokens   plain      chunked (default chunk: 441 tokens)
    1,024    2.89 GB    1.37 GB
    4,096   10.36 GB    1.38 GB
    8,192   (not run: ~20 GB)   1.38 GB

The chunked path's extra ~1 GB is three float32 chunks of logits (0.27 GB each) and the weight's float32 gradient,
whatever the token count (--chunk-tokens 64: 0.69 GB at 4,096 tokens); the plain path holds about four float32
(tokens, vocab) tensors at its peak.
"""

from __future__ import annotations

import argparse
import sys

from harness import add_child_options, peak_rss_of_child, ran_as_child, report

GB = 1e9


def run_passes(args) -> None:
    """In the child: the head's no-grad pass and its pass with gradients, then exit."""
    import resource

    import torch
    import torch.nn.functional as F

    from qae_app.algo.chunked_head import head_logprobs_and_entropy
    from qae_app.algo.losses import token_logprobs_and_entropy

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, dtype=dtype)
    hidden = torch.randn(1, args.tokens, args.hidden, dtype=dtype, requires_grad=True)  # (1, tokens, hidden)
    targets = torch.randint(0, args.vocab, (1, args.tokens))
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (kilobytes on Linux)

    def logprobs(with_entropy):
        if args.path == "plain":
            return token_logprobs_and_entropy(F.linear(hidden, head.weight), targets, args.temperature, with_entropy)
        return head_logprobs_and_entropy(
            hidden, head.weight, None, targets, args.temperature, with_entropy, args.chunk_tokens
        )

    with torch.no_grad():  # old log-probs and entropies
        old_logp, entropy = logprobs(with_entropy=True)
    logp, _ = logprobs(with_entropy=False)
    logp.mean().backward()
    print(
        f"path {args.path}: mean log-prob {old_logp.mean().item():.4f}, mean entropy {entropy.mean().item():.4f}, "
        f"|grad W| {head.weight.grad.norm().item():.4g}, |grad hidden| {hidden.grad.norm().item():.4g}"
    )
    print(f"setup_rss {setup_rss / GB:.2f} GB (torch, the head, the hidden states, before the passes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--path", choices=["plain", "chunked"], required=True)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="chunked path only (default: 256 MiB of logits)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    add_child_options(parser)
    args = parser.parse_args()
    if ran_as_child(args, run_passes):
        return
    logits_bytes = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens x {args.vocab} vocab: one float32 logits tensor is {logits_bytes / GB:.2f} GB")
    peak, output = peak_rss_of_child(__file__, sys.argv[1:])
    print(output, end="")
    report(
        f"bench_head_memory: peak RSS, {args.path} head, {args.tokens} tokens x {args.vocab} vocab, hidden "
        f"{args.hidden}, {args.dtype}",
        round(peak / GB, 3),
        f"< {logits_bytes / GB:.3g}" if args.path == "chunked" else None,
        unit="GB",
        note="the child's peak resident set size, torch and the head included; goal (chunked): under one float32 "
        "logits tensor" + (f"; --chunk-tokens {args.chunk_tokens}" if args.chunk_tokens else ""),
    )
    print(f"peak_rss {peak / GB:.2f} GB")


if __name__ == "__main__":
    main()
