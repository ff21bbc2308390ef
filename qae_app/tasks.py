"""Tasks: what the policy is asked, and the gold answer its response is checked against.

A task is a list of `Problem`s plus the name of the reward function that scores responses to it
(`rewards.REWARD_FUNCTIONS`). Two kinds exist:

- `arith`: the built-in task. `a op b =` with operands 0..20 and op in `+ - *`; the model answers with the integer
  and stops. 1,323 problems, a fixed held-out split of 20% (chosen by a seeded shuffle, so it never changes).
  Scored by an exact integer check (fast, never hangs).
- a math file (JSONL or Parquet in the GSM8K, MATH-500, AIME, AMC or DAPO-17k formats, see `datasets.py`), prompted to
  put the final answer in `\\boxed{}` and scored with math-verify.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from qae_app.datasets import Problem, load_math_file
from qae_app.errors import QAEUserError


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Problem]
    heldout: list[Problem]
    reward: str  # a key of rewards.REWARD_FUNCTIONS
    prompt_template: str  # "{question}" is replaced by the problem text

    def prompt(self, problem: Problem) -> str:
        return self.prompt_template.replace("{question}", problem.question)


# ---------------------------------------------------------------------------------------------------------------
# The built-in arithmetic task

ARITH_OPERATORS = ("+", "-", "*")
ARITH_MAX_OPERAND = 20
ARITH_HELDOUT_FRACTION = 0.2
ARITH_SPLIT_SEED = 1234  # fixed forever: changing it changes which problems are held out

MATH_PROMPT_TEMPLATE = (
    "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
)


def _arith_value(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def arith_problems() -> list[Problem]:
    """All 21 * 21 * 3 = 1,323 problems, in a fixed order."""
    problems = []
    for op in ARITH_OPERATORS:
        for a in range(ARITH_MAX_OPERAND + 1):
            for b in range(ARITH_MAX_OPERAND + 1):
                question = f"{a}{op}{b}="
                problems.append(Problem(prompt_id=question, question=question, answer=str(_arith_value(a, op, b)),
                                        meta={"op": op}))
    return problems


def arith_task() -> Task:
    problems = arith_problems()
    order = list(range(len(problems)))
    random.Random(ARITH_SPLIT_SEED).shuffle(order)
    n_heldout = int(len(problems) * ARITH_HELDOUT_FRACTION)
    heldout = [problems[i] for i in sorted(order[:n_heldout])]
    train = [problems[i] for i in sorted(order[n_heldout:])]
    return Task(name="arith", train=train, heldout=heldout, reward="exact_int", prompt_template="{question}")


BUILTIN_TASKS = {"arith": arith_task}


def load_task(name_or_path: str, heldout_fraction: float = 0.0, seed: int = 0) -> Task:
    """A built-in task by name, or a math data file (all of it trains unless `heldout_fraction` > 0)."""
    if name_or_path in BUILTIN_TASKS:
        return BUILTIN_TASKS[name_or_path]()
    path = Path(name_or_path)
    if not path.exists():
        raise QAEUserError(
            f"data: '{name_or_path}' is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor an existing file. "
            "Pass a JSONL or Parquet file in the GSM8K, MATH-500, AIME, AMC or DAPO-17k format."
        )
    problems = load_math_file(path)
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    n_heldout = int(len(problems) * heldout_fraction)
    heldout = [problems[i] for i in sorted(order[:n_heldout])]
    train = [problems[i] for i in sorted(order[n_heldout:])]
    return Task(name=path.stem, train=train, heldout=heldout, reward="math", prompt_template=MATH_PROMPT_TEMPLATE)


def load_benchmark(bench: str) -> tuple[str, list[Problem], Task]:
    """(name, problems, task) of what `qae eval --bench` and `qae train --eval-bench` evaluate: a built-in task's
    held-out split (named `<task>-heldout`) or a whole math file (named by its stem)."""
    task = load_task(bench)
    problems = task.heldout if task.heldout else task.train
    name = f"{task.name}-heldout" if task.heldout else task.name
    return name, problems, task
