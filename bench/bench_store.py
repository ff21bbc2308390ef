"""Benchmark: what the store and the row building cost a run, as a share of its wall time.

    python bench/bench_store.py [--steps 300]

Trains the default run (`qae train` at its defaults: built-in model and task, 300 steps, held-out evaluation every 25)
in a temporary folder, in this process, with the functions that build a step's rows and metrics wrapped in a timer
(`trainer.group_results`, `rows.group_rows`, `rows.rollout_rows`, `rows.step_metrics`). The store's own cost is the
run's `store_s` column: the CPU time of the writer thread, which saves each step's rows under pending/ and writes
the steps since its last write to DuckDB every few seconds, while the next step trains. Its CPU time is what it can
take from training on a busy machine (an upper bound: on a second core it overlaps for free).

The last line is (store CPU + row building) / wall time; the goal is at most 3%. It goes to the results log
(bench/harness.py), as --paper-scale's MB/s do.

    python bench/bench_store.py --paper-scale [--steps 4] [--store-responses all|N|none]

The paper's step size, without training: steps of 512 prompts x 16 responses whose lengths follow a log-normal
clipped to 2-12k characters (median 6.5k, mean ~7k, about 57 MB a step; text made of words drawn from the MATH-500
solutions, so it compresses as model text does), handed to the store's writer as the trainer hands them (`add_step`,
then `flush_when_due`). Prints, per step and overall, the writer's MB/s of response text (wall and CPU of this
process), what was saved under pending/, and the file's bytes per response. Goal: >= 30 MB/s on 2 cores.

    python bench/bench_store.py --tokens [--steps 3] [--prompts 32] [--median-tokens 4000]

Every token's numbers (`token_values`, --store-tokens): what they cost the store per step at the paper's shape, 512
prompts x 16 responses of up to 20k tokens. That shape is 164M tokens a step, more than this machine can write in a
benchmark's time, so it measures a scaled step (--prompts x 16 responses, lengths log-normal around --median-tokens,
clipped to 200-20k) handed to the writer as the trainer hands it, reads the file's bytes per token and the writer's
seconds per million tokens, and extrapolates both linearly to the paper's step: every response at 20k tokens (the
worst case), and --store-tokens auto's sample of 64 responses a step. The extrapolation assumes the cost per token
does not depend on the step's size (each step is one insert of list columns; the file grows by the same compressed
blocks), which the two scaled sizes it prints let you check. Token texts are pieces of the MATH-500 solutions cut as a
BPE tokenizer cuts words (a leading space, ~4 characters); log-probs and entropies float32 draws of the shape a
policy gives (most log-probs near 0, a long tail), so they compress as real ones do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import report

from qae_app.config import build_config
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.train import trainer

GOAL_SHARE = "<= 3"  # % of a run's wall time: store CPU + row building
GOAL_MB_S = ">= 30"  # the writer's MB/s of response text, wall, at the paper's step size, on 2 cores
MATH_DATA = Path(os.environ.get("QAE_MATH_DATA", Path(__file__).resolve().parents[2] / "shared/data/math"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps (default: 300; --paper-scale: 4)")
    parser.add_argument("--paper-scale", action="store_true", help="512 x 16 responses of 2-12k characters a step")
    parser.add_argument("--store-responses", default="all", help="all, N per group, or none (--paper-scale)")
    parser.add_argument("--tokens", action="store_true", help="per-token values: MB a step at the paper's shape")
    parser.add_argument("--prompts", type=int, default=32, help="--tokens: prompts of the scaled step (x 16)")
    parser.add_argument("--median-tokens", type=int, default=4000, help="--tokens: median response length")
    args = parser.parse_args()
    if args.tokens:
        tokens_scale(args.steps or 3, args.prompts, args.median_tokens)
        return
    if args.paper_scale:
        paper_scale(args.steps or 4, args.store_responses)
        return
    args.steps = args.steps or 300

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    for name in ("group_results", "group_rows", "rollout_rows", "step_metrics"):  # as the trainer module calls them
        setattr(trainer, name, timed(name, getattr(trainer, name)))

    with tempfile.TemporaryDirectory() as runs_dir:
        cfg = build_config(run_name="store", steps=args.steps)
        trainer.Trainer(cfg, Path(runs_dir), cpu=True).fit()
        path = db_path(Path(runs_dir), "store")
        run = query(path, "SELECT wall_s, setup_s FROM runs").iloc[0]
        steps = query(
            path,
            "SELECT count(*) AS n, sum(store_s) AS store, median(store_s) AS median_store, "
            "max(store_s) AS max_store, sum(step_s) AS step FROM steps",
        ).iloc[0]
        writes = query(path, "SELECT count(*) AS n FROM steps WHERE store_s > 0.01")["n"].item()
    rows_s = sum(spent.values())
    wall = run["wall_s"]
    print(f"{steps['n']} steps in {wall:.1f} s wall ({run['setup_s']:.1f} s start-up, {steps['step']:.1f} s of steps)")
    print(
        f"store (writer thread CPU): {steps['store']:.2f} s = {steps['store'] / wall:.1%} of the wall time; "
        f"median {steps['median_store'] * 1e3:.2f} ms a step (saving its rows), max "
        f"{steps['max_store'] * 1e3:.0f} ms, {writes} steps over 10 ms (the database writes)"
    )
    print(
        f"row building: {rows_s:.2f} s = {rows_s / wall:.1%} ("
        + ", ".join(f"{name} {seconds * 1e3 / steps['n']:.2f} ms" for name, seconds in spent.items())
        + " a step)"
    )
    share = (steps["store"] + rows_s) / wall
    print(f"store + row building / wall time: {share:.1%}")
    report(
        "bench_store: store + row building, share of a run's wall time",
        round(100 * share, 2),
        GOAL_SHARE,
        unit="%",
        note=f"{steps['n']} steps in {wall:.1f} s wall; store (writer thread CPU) {steps['store']:.2f} s "
        f"= {steps['store'] / wall:.1%}, row building {rows_s / wall:.1%}",
    )


PROMPTS, GROUP_SIZE = 512, 16
MIN_CHARS, MAX_CHARS = 2_000, 12_000


def response_texts(rng: random.Random, words: list[str], n: int) -> list[str]:
    """`n` responses, lengths log-normal (median 6.5k characters) clipped to [MIN_CHARS, MAX_CHARS]."""
    corpus = " ".join(rng.choice(words) for _ in range(400_000))  # ~2.5 MB of text to cut responses from
    texts = []
    for _ in range(n):
        length = int(min(MAX_CHARS, max(MIN_CHARS, rng.lognormvariate(math.log(6_500), 0.45))))
        start = rng.randrange(0, len(corpus) - length)
        texts.append(corpus[start : start + length])
    return texts


def paper_step(rng: random.Random, words: list[str], step: int) -> tuple[dict, int]:
    """One step's tables as the trainer builds them (rows.group_rows / rollout_rows), and its response characters."""
    texts = response_texts(rng, words, PROMPTS * GROUP_SIZE)
    groups, rollouts = [], []
    for g in range(PROMPTS):
        rewards = [float(rng.random() < 0.4) for _ in range(GROUP_SIZE)]
        n_correct = int(sum(rewards))
        regime = {0: "all_wrong", GROUP_SIZE: "all_correct"}.get(n_correct, "hard" if n_correct < 8 else "easy")
        baseline = 0.0 if regime in ("hard", "all_wrong") else 1.0
        groups.append(
            dict(
                group_idx=g,
                prompt_id=f"p{step}-{g}",
                prompt="Find x. " * 40,
                answer="42",
                n_correct=n_correct,
                group_size=GROUP_SIZE,
                baseline=baseline,
                regime=regime,
                filtered=False,
            )
        )
        for i, reward in enumerate(rewards):
            advantage = 0.0 if regime.startswith("all") else reward - baseline
            text = texts[g * GROUP_SIZE + i]
            rollouts.append(
                dict(
                    group_idx=g,
                    sample_idx=i,
                    prompt_id=f"p{step}-{g}",
                    response=text,
                    reward=reward,
                    correct=bool(reward),
                    verified=True,
                    advantage=advantage,
                    gated=advantage == 0.0,
                    regime=regime,
                    n_tokens=len(text) // 4,
                    truncated=False,
                    entropy=0.5,
                    logprob=-100.0,
                    filtered=False,
                )
            )
    metrics = {name: 0.5 for name in STEP_METRICS}
    return dict(steps=[metrics], groups=groups, rollouts=rollouts), sum(map(len, texts))


def paper_scale(steps: int, store_responses: str) -> None:
    from qae_app.store.rows import stored_responses
    from qae_app.store.writer import RunWriter

    solutions = [json.loads(line) for line in (MATH_DATA / "math500.jsonl").read_text().splitlines() if line.strip()]
    words = " ".join(row.get("solution", "") + " " + row.get("problem", "") for row in solutions).split()
    rng = random.Random(0)
    print(
        f"paper scale: {steps} steps of {PROMPTS} x {GROUP_SIZE} responses of {MIN_CHARS}-{MAX_CHARS} characters, "
        f"--store-responses {store_responses}"
    )
    with tempfile.TemporaryDirectory() as runs_dir:
        path = db_path(Path(runs_dir), "paper")
        writer = RunWriter(path, "paper")
        writer.create_run("paper", {"steps": steps}, "qae", 0.4, "bench", "bench", 0)
        total_chars = total_wall = total_cpu = 0.0
        for step in range(1, steps + 1):
            tables, _ = paper_step(rng, words, step)
            tables["rollouts"] = stored_responses(tables["rollouts"], store_responses, seed=0, step=step)
            chars = sum(len(r["response"]) for r in tables["rollouts"] if r["response"] is not None)
            wall, cpu = time.perf_counter(), time.process_time()
            writer.add_step(step, **tables)
            assert writer.flush_when_due()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            pending = sum(f.stat().st_size for f in writer.pending_dir.glob("*")) if writer.pending_dir.exists() else 0
            print(
                f"step {step}: {chars / 1e6:.1f} MB of response text in {wall:.2f} s wall, {cpu:.2f} s CPU: "
                f"{chars / 1e6 / wall:.1f} MB/s; pending/ holds {pending / 1e6:.1f} MB"
            )
            total_chars, total_wall, total_cpu = total_chars + chars, total_wall + wall, total_cpu + cpu
        wall, cpu = time.perf_counter(), time.process_time()
        assert writer.wait_until_written(timeout_s=600)  # what is still queued or under pending/ counts too
        total_wall, total_cpu = total_wall + time.perf_counter() - wall, total_cpu + time.process_time() - cpu
        size = path.stat().st_size + (
            path.with_suffix(".duckdb.wal").stat().st_size if path.with_suffix(".duckdb.wal").exists() else 0
        )
        stored = query(path, "SELECT count(*) AS n, count(response) AS texts, sum(gated::INT) AS gated FROM rollouts")
    n = int(stored["n"].item())
    print(
        f"writer: {total_chars / 1e6:.0f} MB of response text in {total_wall:.1f} s wall ({total_cpu:.1f} s CPU of "
        f"this process): {total_chars / 1e6 / total_wall:.1f} MB/s wall, {total_chars / 1e6 / total_cpu:.1f} MB/s "
        "per CPU second"
    )
    print(
        f"file: {size / 1e6:.0f} MB for {n} responses ({int(stored['texts'].item())} with text, "
        f"{int(stored['gated'].item())} gated): {size / n:,.0f} bytes per response, "
        f"{size / max(total_chars, 1):.2f} bytes per character of text"
    )
    which = "" if store_responses == "all" else f" (--store-responses {store_responses})"
    note = (
        f"{steps} steps, {total_chars / 1e6:.0f} MB of text in {total_wall:.1f} s wall, {total_cpu:.1f} s CPU; "
        f"file {size / n:,.0f} bytes per response, {size / max(total_chars, 1):.2f} per character"
    )
    report(
        f"bench_store: writer at the paper's step size, MB/s wall{which}",
        round(total_chars / 1e6 / total_wall, 2),
        GOAL_MB_S,
        unit="MB/s",
        note=note,
    )
    report(
        f"bench_store: writer at the paper's step size, MB/s per CPU second{which}",
        round(total_chars / 1e6 / total_cpu, 2),
        None,
        unit="MB/s",
        note=note,
    )


PAPER_TOKENS, PAPER_MAX_TOKENS = PROMPTS * GROUP_SIZE * 20_000, 20_000  # the paper's step, every response at 20k


def token_pieces(words: list[str]) -> list[str]:
    """The words cut as a BPE tokenizer cuts them: a leading space, then pieces of up to 4 characters."""
    pieces = []
    for word in words:
        word = " " + word
        pieces += [word[i : i + 4] for i in range(0, len(word), 4)]
    return pieces


def token_rows(rng: random.Random, pieces: list[str], prompts: int, median: int) -> tuple[list[dict], int]:
    """A scaled step's `token_values` rows (prompts x 16 responses) and its tokens."""
    import numpy as np

    generator = np.random.default_rng(rng.randrange(2**32))
    rows, total = [], 0
    for g in range(prompts):
        for i in range(GROUP_SIZE):
            n = int(min(PAPER_MAX_TOKENS, max(200, rng.lognormvariate(math.log(median), 0.6))))
            start = rng.randrange(0, len(pieces) - n)
            # most tokens nearly certain, a long tail: -Exp(0.3) log-probs; entropies Exp(0.8) nats
            logprob = (-generator.exponential(0.3, n)).astype(np.float32)
            old = (logprob + generator.normal(0, 1e-3, n)).astype(np.float32)
            entropy = generator.exponential(0.8, n).astype(np.float32)
            rows.append(
                dict(
                    group_idx=g,
                    sample_idx=i,
                    tokens=pieces[start : start + n],
                    logprob=logprob.tolist(),
                    entropy=entropy.tolist(),
                    old_logprob=old.tolist(),
                )
            )
            total += n
    return rows, total


def tokens_scale(steps: int, prompts: int, median: int) -> None:
    """--tokens: the writer on scaled steps of per-token values; bytes and seconds per token, extrapolated."""
    from qae_app.store.tokens import AUTO_SAMPLE
    from qae_app.store.writer import RunWriter

    solutions = [json.loads(line) for line in (MATH_DATA / "math500.jsonl").read_text().splitlines() if line.strip()]
    pieces = token_pieces(" ".join(row.get("solution", "") for row in solutions).split() * 3)
    rng = random.Random(0)
    print(
        f"scaled steps: {steps} of {prompts} x {GROUP_SIZE} responses, lengths log-normal around {median} tokens "
        f"(200-{PAPER_MAX_TOKENS}); the paper's step is {PROMPTS} x {GROUP_SIZE} x up to {PAPER_MAX_TOKENS} tokens"
    )
    with tempfile.TemporaryDirectory() as runs_dir:
        path = db_path(Path(runs_dir), "tokens")
        writer = RunWriter(path, "tokens")
        writer.create_run("tokens", {"steps": steps}, "qae", 0.4, "bench", "bench", 0)
        before = path.stat().st_size
        tokens = wall = cpu = 0.0
        for step in range(1, steps + 1):
            rows, n = token_rows(rng, pieces, prompts, median)
            t_wall, t_cpu = time.perf_counter(), time.process_time()
            writer.add_step(step, steps=[{"reward_mean": 0.5}], token_values=rows)
            assert writer.wait_until_written(timeout_s=600)
            t_wall, t_cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
            print(f"step {step}: {n / 1e6:.2f}M tokens in {t_wall:.1f} s wall, {t_cpu:.1f} s CPU")
            tokens, wall, cpu = tokens + n, wall + t_wall, cpu + t_cpu
        size = (
            path.stat().st_size
            - before
            + (path.with_suffix(".duckdb.wal").stat().st_size if path.with_suffix(".duckdb.wal").exists() else 0)
        )
        stored = query(path, "SELECT sum(len(tokens)) AS n FROM token_values")["n"].item()
    assert int(stored) == tokens, (stored, tokens)
    per_token, s_per_m = size / tokens, wall / tokens * 1e6
    paper_mb, sample_mb = per_token * PAPER_TOKENS / 1e6, per_token * AUTO_SAMPLE * PAPER_MAX_TOKENS / 1e6
    print(
        f"file: {size / 1e6:.1f} MB for {tokens / 1e6:.2f}M tokens: {per_token:.2f} bytes a token; writer "
        f"{s_per_m:.2f} s wall ({cpu / tokens * 1e6:.2f} s CPU) per million tokens"
    )
    print(
        f"extrapolated to the paper's step ({PROMPTS} x {GROUP_SIZE} x {PAPER_MAX_TOKENS} tokens, linearly in "
        f"tokens): {paper_mb:,.0f} MB and {s_per_m * PAPER_TOKENS / 1e6:,.0f} s a step with --store-tokens all; "
        f"{sample_mb:.1f} MB and {s_per_m * AUTO_SAMPLE * PAPER_MAX_TOKENS / 1e6:.1f} s with auto's {AUTO_SAMPLE} "
        "responses a step"
    )
    note = (
        f"measured on {steps} scaled steps of {prompts} x {GROUP_SIZE} responses around {median} tokens "
        f"({tokens / 1e6:.2f}M tokens, {per_token:.2f} bytes and {s_per_m:.2f} s wall per million tokens), "
        f"extrapolated linearly to {PROMPTS} x {GROUP_SIZE} x {PAPER_MAX_TOKENS}"
    )
    report(
        "bench_store: per-token values, MB a step at the paper's shape (--store-tokens all, extrapolated)",
        round(paper_mb, 1),
        None,
        unit="MB",
        note=note,
    )
    report(
        f"bench_store: per-token values, MB a step at the paper's shape (--store-tokens auto: {AUTO_SAMPLE} "
        "responses, extrapolated)",
        round(sample_mb, 2),
        "<= 50",
        unit="MB",
        note=note,
    )
    report("bench_store: per-token values, file bytes a token", round(per_token, 3), None, unit="bytes", note=note)


if __name__ == "__main__":
    main()
