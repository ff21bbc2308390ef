"""Evaluation: sample k responses per problem, score them, and report avg@k, pass@k and maj@k.

- avg@k: mean accuracy over all k samples of all problems (the paper's avg@32).
- pass@k': unbiased estimator of Chen et al. 2021 from the k samples, for k' in 1, 2, 4, ... <= k (and k).
- maj@k: the majority answer among the k extracted answers is correct (ties: the answer seen first wins).

Each is reported for the whole benchmark (subset "all") and, where problems carry them, per subject and level.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from qae_app.metrics import avg_at_k, maj_at_k, pass_at_k, pass_k_values
from qae_app.rewards import Scorer, extract_answer
from qae_app.rollout import RolloutEngine
from qae_app.tasks import Problem


@dataclass
class EvalResult:
    benchmark: str
    k: int
    samples: list[dict]  # one per (problem, sample): problem_id, sample_idx, response, extracted, correct, ...
    metrics: list[dict]  # benchmark, subset, metric, k, value, n_problems

    def value(self, metric: str, k: int | None = None, subset: str = "all") -> float:
        k = self.k if k is None else k
        for row in self.metrics:
            if row["metric"] == metric and row["k"] == k and row["subset"] == subset:
                return row["value"]
        raise KeyError((metric, k, subset))


def sample_and_score(engine: RolloutEngine, problems: list[Problem], prompts: list[str], scorer: Scorer, k: int,
                     temperature: float, max_new_tokens: int, seed: int, on_batch=None,
                     batch_problems: int = 64) -> list[dict]:
    """k samples for each problem, scored. `on_batch(n_done)` is called after each batch (progress bars)."""
    rows: list[dict] = []
    for start in range(0, len(problems), batch_problems):
        chunk = problems[start : start + batch_problems]
        samples = engine.generate(prompts[start : start + batch_problems], k, temperature, max_new_tokens,
                                  seed=seed + start)
        texts = [s.text for s in samples]
        rewards = scorer(texts, [chunk[s.prompt_index].answer for s in samples])
        counters = defaultdict(int)
        for sample, text, reward in zip(samples, texts, rewards):
            problem = chunk[sample.prompt_index]
            rows.append({
                "problem_id": problem.prompt_id,
                "sample_idx": counters[sample.prompt_index],
                "response": text,
                "extracted": extract_answer(text) if scorer.name == "math" else text.strip(),
                "correct": reward == 1.0,
                "verified": reward is not None,
                "n_tokens": len(sample.response_ids),
            })
            counters[sample.prompt_index] += 1
        if on_batch is not None:
            on_batch(len(chunk))
    return rows


def summarize(benchmark: str, problems: list[Problem], samples: list[dict], k: int) -> list[dict]:
    """Metric rows for the whole benchmark and for each subject / level present in the problems' meta."""
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for row in samples:
        by_problem[row["problem_id"]].append(row)
    subsets: dict[str, list[Problem]] = {"all": problems}
    for key in ("subject", "level"):
        for p in problems:
            if key in p.meta and p.meta[key] is not None:
                subsets.setdefault(f"{key}={p.meta[key]}", []).append(p)
    metrics = []
    for subset, members in subsets.items():
        groups = [by_problem[p.prompt_id] for p in members if by_problem[p.prompt_id]]
        if not groups:
            continue
        n = len(groups)

        def add(metric: str, kk: int, value: float) -> None:
            metrics.append({"benchmark": benchmark, "subset": subset, "metric": metric, "k": kk, "value": value,
                            "n_problems": n})

        add("avg@k", k, sum(avg_at_k([r["correct"] for r in g]) for g in groups) / n)
        for kk in pass_k_values(k):
            add("pass@k", kk, sum(pass_at_k(len(g), sum(r["correct"] for r in g), kk) for g in groups) / n)
        add("maj@k", k, sum(maj_at_k([r["extracted"] for r in g], [r["correct"] for r in g]) for g in groups) / n)
    return metrics


def evaluate(engine: RolloutEngine, benchmark: str, problems: list[Problem], prompts: list[str], scorer: Scorer,
             k: int, temperature: float, max_new_tokens: int, seed: int, on_batch=None) -> EvalResult:
    samples = sample_and_score(engine, problems, prompts, scorer, k, temperature, max_new_tokens, seed, on_batch)
    return EvalResult(benchmark, k, samples, summarize(benchmark, problems, samples, k))
