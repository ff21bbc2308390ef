"""Every token's numbers: which responses' per-token values the store keeps (--store-tokens) and their `token_values`
rows.

A kept response's row holds, position by position over its response tokens (the closing stop token included):
`tokens`, each token's own text (special tokens written out; a character a byte-level tokenizer split over two
tokens shows as U+FFFD in each), `logprob`, the sampler's log-prob of the token (the engine's, while it sampled;
NULL where the engine returns none), `entropy`, the sampling distribution's entropy at the position (the engine's, as
the hf engine measures it; else the trainer's no-grad pass over the sampling weights, for the trained responses: vLLM
returns no entropy) and `old_logprob`, the trainer's log-prob under the sampling weights, the policy ratio's
denominator, for the responses the update forwarded (NULL for the others: gated responses skip the update's passes,
and a filtered group is never trained). The sampler/trainer gap of a token is old_logprob - logprob.

What a run keeps costs 4 bytes a number and the token's text, at DuckDB's compression (bench/bench_store.py --tokens
measures it; docs/performance.md), so `auto` keeps every response of a step of at most AUTO_ALL_TOKENS tokens (CPU-sized
runs) and AUTO_SAMPLE responses a step above it (the paper's step, 512 x 16 responses of up to 20k tokens).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from qae_app.store.rows import GroupResult

AUTO_ALL_TOKENS = 1 << 20  # prompts_per_step x group_size x max_new_tokens up to this: every response's tokens
AUTO_SAMPLE = 64  # responses a step whose tokens `auto` keeps above it
TOKEN_COLUMNS = ("tokens", "logprob", "entropy", "old_logprob")

STORE_TOKENS_HELP = (
    "Which responses' per-token values the store keeps (each token's text, the sampler's log-prob "
    "and entropy, the trainer's old log-prob): auto (every response where a step samples at most "
    f"{AUTO_ALL_TOKENS:,} tokens, prompts-per-step x group-size x max-new-tokens, else {AUTO_SAMPLE} "
    "a step), all, N responses a step (a seeded draw, the same on a rerun), or none."
)


def check_store_tokens(value: str) -> str:
    """`value` if --store-tokens can take it; else ValueError with the fix."""
    if value in ("auto", "all", "none") or (value.isdigit() and int(value) >= 1):
        return value
    raise ValueError(
        f"store-tokens: '{value}' is not auto, all, none or a whole number of responses a step (>= 1). "
        f"Use auto (the default), all, e.g. {AUTO_SAMPLE}, or none."
    )


def responses_kept(keep: str, tokens_per_step: int) -> int | None:
    """How many responses a step keeps the tokens of: None for every one, else a count (0: none). `tokens_per_step`:
    prompts_per_step x group_size x max_new_tokens, what `auto` decides by."""
    if keep == "all" or (keep == "auto" and tokens_per_step <= AUTO_ALL_TOKENS):
        return None
    if keep == "auto":
        return AUTO_SAMPLE
    return 0 if keep == "none" else int(keep)


def kept_responses(count: int | None, n_responses: int, seed: int, step: int) -> set[int] | None:
    """The step-wide response indexes (group_idx x G + sample_idx) whose tokens are kept: None for all, else `count`
    of the step's `n_responses` drawn by a generator seeded by (seed, step), the same on every process and rerun."""
    if count is None or count >= n_responses:
        return None
    return set(random.Random(f"{seed}:{step}:tokens").sample(range(n_responses), count))


def token_rows(groups: Sequence[GroupResult]) -> list[dict]:
    """The `token_values` rows of the responses whose values the groups carry."""
    rows = []
    for g in groups:
        for i, values in enumerate(g.token_values or ()):
            if values is not None:
                rows.append({"group_idx": g.group_idx, "sample_idx": i, **{c: values.get(c) for c in TOKEN_COLUMNS}})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# how a kept response's numbers read (`qae rollouts --tokens`, the dashboard's token view)

# --color-by -> (what it shows, the value at which the colour is full): 0 is no colour; a log-prob is coloured by
# how far below 0 it is, the gap by its size either way
COLOR_SCALES = {
    "logprob": ("the sampler's log-prob of the token", 5.0),
    "entropy": ("the sampling distribution's entropy at the token, nats", 3.0),
    "gap": ("old_logprob - logprob: the trainer's log-prob minus the sampler's", 0.5),
}


def token_numbers(row: dict) -> list[dict]:
    """One dict per token of a `token_values` row: token, logprob, entropy, old_logprob, gap (None where missing)."""

    def values(name: str) -> list:
        stored = row.get(name)
        return [None] * len(row["tokens"]) if _missing(stored) else [_number(v) for v in stored]

    logprob, entropy, old = values("logprob"), values("entropy"), values("old_logprob")
    # a row read from the run folder as it is: a damaged one shows the tokens it has values for
    return [
        {
            "token": str(token),
            "logprob": lp,
            "entropy": h,
            "old_logprob": o,
            "gap": o - lp if o is not None and lp is not None else None,
        }
        for token, lp, h, o in zip(row["tokens"], logprob, entropy, old, strict=False)
    ]


def strength(value: float | None, color_by: str) -> float:
    """0..1: how strongly a token is coloured for its number."""
    if value is None:
        return 0.0
    full = COLOR_SCALES[color_by][1]
    amount = -value if color_by == "logprob" else abs(value)
    return max(0.0, min(1.0, amount / full))


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _missing(value) -> bool:
    """A NULL list as a reader gives it: None, NaN or pandas' NA (anything that is not a sequence)."""
    return value is None or isinstance(value, str) or not hasattr(value, "__len__")
