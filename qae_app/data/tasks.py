"""Tasks: what the policy is asked, and the gold answer its response is checked against.

A task is a list of `Problem`s plus the name of the reward function that scores responses to it
(`builtin_verifiers.REWARD_FUNCTIONS`). Two kinds exist:

- `arith`: the built-in task. `a op b =` with operands 0..20 and op in `+ - *`; the model answers with the integer
  and stops. 1,323 problems, a fixed held-out split of 20% (chosen by a seeded shuffle, so it never changes).
  Scored by an exact integer check (fast, never hangs).
- `chain`: the built-in task with long responses. Three or four operands 1..9 joined by `+ - *`, evaluated left to
  right and written with the brackets that say so (`((7+5)*3)-4=`); the model writes each intermediate result and
  then the final answer (`7+5=12,12*3=36,36-4=32 so 32`, 16-34 characters). 8,192 problems, a fixed held-out split
  of 256. Scored on the final answer only (`chain_final`), so a wrong scratchpad that lands on the right number counts.
- `add`: the built-in task for a small instruct model (SmolLM2-135M-Instruct, `names.SMOLLM2_MODEL`), in plain
  language: "What is 17 + 8? Reply with just the number." with operands 0..ADD_MAX_OPERAND. A fixed held-out split
  of ADD_N_HELDOUT problems. Scored by `final_number` (the last `Answer: N` line, else the response's last number,
  checked with math-verify), since such a model answers in words ("The answer is 25.") and rarely with a box.
- a data file (JSONL, Parquet or CSV: the GSM8K, MATH-500, AIME, AMC and DAPO-17k formats or any columns, see
  `datasets.py`), prompted to put the final answer in `\\boxed{}` (a row whose `prompt` is chat messages is sent as
  it is) and scored with math-verify.

Any task takes the user's `--prompt-template` and `--system-prompt` (`PromptFormat`, see `prompts.py`): `load_task`
and `load_benchmark` apply them, so `qae train`, its held-out evaluation and `qae eval` prompt alike.

The built-in tasks are selectable as `arith` / `chain` or `builtin:arith` / `builtin:chain`; each names the model
`qae train` starts from and the response length it needs (`BUILTIN_TASKS`), so `qae train --data builtin:chain` needs
no other option.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.core.host_faults import check_path_names
from qae_app.core.names import CHAIN_ANSWER_MARKER, SMOLLM2_MODEL
from qae_app.data.datasets import Problem, describe_columns, load_math_file
from qae_app.data.prompt_format import Prompt, PromptFormat, build_prompt, placeholders


@dataclass(frozen=True)
class Task:
    name: str
    train: list[Problem]
    heldout: list[Problem]
    reward: str  # a key of builtin_verifiers.REWARD_FUNCTIONS
    prompt_template: str  # each {column} is replaced by the row's (prompt_format.py): "{question}" by the problem text
    system_prompt: str | None = None  # a system message before every prompt (--system-prompt)
    row_messages: bool = True  # a row's own chat messages are its prompt (off when the user gives a template)

    def prompt(self, problem: Problem) -> Prompt:
        """What the model is sent for `problem`: text, or chat messages (prompt_format.build_prompt)."""
        return build_prompt(problem, self.prompt_template, self.system_prompt, self.row_messages)

    def with_format(self, prompt_format: PromptFormat | None) -> Task:
        """This task with the user's --prompt-template and --system-prompt, every problem's prompt built once so a
        column a template names and a row lacks is refused now, not mid-run."""
        if prompt_format is None or prompt_format == PromptFormat():
            return self
        given = prompt_format.template is not None
        task = dataclasses.replace(
            self,
            prompt_template=prompt_format.template if given else self.prompt_template,
            system_prompt=prompt_format.system_prompt,
            row_messages=not given,
        )
        for problem in task.train + task.heldout:
            task.prompt(problem)
        return task


# ---------------------------------------------------------------------------------------------------------------
# The built-in arithmetic task

ARITH_OPERATORS = ("+", "-", "*")
ARITH_MAX_OPERAND = 20
ARITH_HELDOUT_FRACTION = 0.2
ARITH_SPLIT_SEED = 1234  # fixed forever: changing it changes which problems are held out

MATH_PROMPT_TEMPLATE = "{question}\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def _arith_value(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def arith_problems() -> list[Problem]:
    """All 21 * 21 * 3 = 1,323 problems, in a fixed order."""
    problems = []
    for op in ARITH_OPERATORS:
        for a in range(ARITH_MAX_OPERAND + 1):
            for b in range(ARITH_MAX_OPERAND + 1):
                question = f"{a}{op}{b}="
                problems.append(
                    Problem(prompt_id=question, question=question, answer=str(_arith_value(a, op, b)), meta={"op": op})
                )
    return problems


def arith_task() -> Task:
    problems = arith_problems()
    order = list(range(len(problems)))
    random.Random(ARITH_SPLIT_SEED).shuffle(order)
    n_heldout = int(len(problems) * ARITH_HELDOUT_FRACTION)
    heldout = [problems[i] for i in sorted(order[:n_heldout])]
    train = [problems[i] for i in sorted(order[n_heldout:])]
    return Task(name="arith", train=train, heldout=heldout, reward="exact_int", prompt_template="{question}")


# ---------------------------------------------------------------------------------------------------------------
# The built-in chained-arithmetic task: long responses (a scratchpad), scored on the final answer only

CHAIN_MAX_OPERAND = 9  # operands are 1..9
CHAIN_OPERAND_COUNTS = (3, 4)  # drawn with equal probability
CHAIN_N_PROBLEMS = 8192
CHAIN_N_HELDOUT = 256
CHAIN_SEED = 4321  # fixed forever: changing it changes every problem and the held-out split


def chain_question(operands: list[int], ops: list[str]) -> str:
    """`((7+5)*3)-4=`: brackets make left-to-right evaluation the ordinary reading."""
    text = str(operands[0])
    for i, (op, b) in enumerate(zip(ops, operands[1:], strict=True)):
        text = f"{text}{op}{b}"
        if i < len(ops) - 1:
            text = f"({text})"
    return text + "="


def chain_response(operands: list[int], ops: list[str]) -> tuple[str, int]:
    """(`7+5=12,12*3=36,36-4=32 so 32`, 32): each intermediate result, then the final answer."""
    value = operands[0]
    steps = []
    for op, b in zip(ops, operands[1:], strict=True):
        result = _arith_value(value, op, b)
        steps.append(f"{value}{op}{b}={result}")
        value = result
    return ",".join(steps) + CHAIN_ANSWER_MARKER + str(value), value


def chain_problems() -> list[Problem]:
    """8,192 distinct problems drawn by a fixed seed, in the order drawn. The gold scratchpad is in
    `meta["gold_response"]` (what `qae warmstart` trains on); the reward looks only at the final answer."""
    return list(_chain_problem_pool())


@functools.cache
def _chain_problem_pool() -> tuple[Problem, ...]:  # drawn once per process: ~0.1-0.5 s of pure-Python sampling
    rng = random.Random(CHAIN_SEED)
    problems: list[Problem] = []
    seen: set[str] = set()
    while len(problems) < CHAIN_N_PROBLEMS:
        n = rng.choice(CHAIN_OPERAND_COUNTS)
        operands = [rng.randint(1, CHAIN_MAX_OPERAND) for _ in range(n)]
        ops = [rng.choice(ARITH_OPERATORS) for _ in range(n - 1)]
        question = chain_question(operands, ops)
        if question in seen:
            continue
        seen.add(question)
        response, value = chain_response(operands, ops)
        problems.append(
            Problem(
                prompt_id=question,
                question=question,
                answer=str(value),
                meta={"operands": n, "ops": "".join(ops), "gold_response": response},
            )
        )
    return tuple(problems)


def chain_task() -> Task:
    problems = chain_problems()
    order = list(range(len(problems)))
    random.Random(CHAIN_SEED).shuffle(order)
    heldout = [problems[i] for i in sorted(order[:CHAIN_N_HELDOUT])]
    train = [problems[i] for i in sorted(order[CHAIN_N_HELDOUT:])]
    return Task(name="chain", train=train, heldout=heldout, reward="chain_final", prompt_template="{question}")


# ---------------------------------------------------------------------------------------------------------------
# The built-in addition task in plain language, for a small instruct model

ADD_MAX_OPERAND = 29  # operands 0..29: 900 problems; SmolLM2-135M-Instruct starts at 20% (README)
ADD_N_HELDOUT = 150
ADD_SPLIT_SEED = 2500  # fixed forever: changing it changes which problems are held out
ADD_PROMPT_TEMPLATE = "{question} Reply with just the number."


def add_problems() -> list[Problem]:
    """All (ADD_MAX_OPERAND + 1) ** 2 additions, in a fixed order."""
    return [
        Problem(prompt_id=f"{a}+{b}", question=f"What is {a} + {b}?", answer=str(a + b), meta={"op": "+"})
        for a in range(ADD_MAX_OPERAND + 1)
        for b in range(ADD_MAX_OPERAND + 1)
    ]


def add_task() -> Task:
    problems = add_problems()
    order = list(range(len(problems)))
    random.Random(ADD_SPLIT_SEED).shuffle(order)
    heldout = [problems[i] for i in sorted(order[:ADD_N_HELDOUT])]
    train = [problems[i] for i in sorted(order[ADD_N_HELDOUT:])]
    return Task(name="add", train=train, heldout=heldout, reward="final_number", prompt_template=ADD_PROMPT_TEMPLATE)


# ---------------------------------------------------------------------------------------------------------------
# Registry of built-in tasks


@dataclass(frozen=True)
class BuiltinTask:
    build: Callable[[], Task]
    model: str  # the warm-started policy `qae train --data <task>` starts from unless --model is given
    max_new_tokens: int  # response length `qae train` / `qae eval` use unless --max-new-tokens is given
    warmstart_steps: int  # supervised steps of the shipped checkpoint's recipe (`qae warmstart --task <task>`)


BUILTIN_PREFIX = "builtin:"
BUILTIN_TASKS = {
    # 525 steps: ~30% sampled held-out accuracy, measured; more steps leave RL little to do
    "arith": BuiltinTask(arith_task, model="builtin:tiny", max_new_tokens=8, warmstart_steps=525),
    # 330 steps: ~34% sampled held-out accuracy, measured (300: 20%, 400: 54%: it rises steeply here).
    # The longest gold response is 34 characters + eos; 48 leaves room for a wrong, longer scratchpad.
    "chain": BuiltinTask(chain_task, model="builtin:tiny-chain", max_new_tokens=48, warmstart_steps=330),
    # no warm start: the pretrained instruct model starts RL as it is. "42<|im_end|>" is 2 tokens, "The answer is
    # 42." about 7; 16 leaves room for a short sentence and cuts the rambling ones
    "add": BuiltinTask(add_task, model=SMOLLM2_MODEL, max_new_tokens=16, warmstart_steps=0),
}


def builtin_task_name(data: str) -> str | None:
    """'chain' for `chain` or `builtin:chain`; None for anything that is not a built-in task's name."""
    name = data[len(BUILTIN_PREFIX) :] if data.startswith(BUILTIN_PREFIX) else data
    return name if name in BUILTIN_TASKS else None


def task_defaults(data: str) -> dict:
    """What a built-in task sets unless the user does: {"model": ..., "max_new_tokens": ...}; {} for a file."""
    name = builtin_task_name(data)
    if name is None:
        return {}
    return {"model": BUILTIN_TASKS[name].model, "max_new_tokens": BUILTIN_TASKS[name].max_new_tokens}


def load_task(
    name_or_path: str,
    heldout_fraction: float = 0.0,
    seed: int = 0,
    option: str = "data",
    prompt_format: PromptFormat | None = None,
    require_answer: bool = True,
    heldout_by: str | None = None,
) -> Task:
    """A built-in task by name, or a data file (all of it trains unless `heldout_fraction` > 0); `option`: the
    command-line option that named it, for the error messages. `prompt_format`: the user's template and system
    prompt (checked against every problem here). `require_answer`: refuse a file's row without a gold answer (a
    reward that reads none passes False). `heldout_by`: a column whose rows are held out together
    (`heldout_split`)."""
    prompt_format = prompt_format or PromptFormat()
    builtin = builtin_task_name(name_or_path)
    if builtin is not None:
        return BUILTIN_TASKS[builtin].build().with_format(prompt_format)
    path = Path(name_or_path)
    check_path_names(option, path)
    if not path.exists():
        names = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_TASKS)
        if name_or_path.startswith(BUILTIN_PREFIX):
            raise QAEUserError(f"{option}: '{name_or_path}' is not a built-in task. Choose one of: {names}.")
        raise QAEUserError(
            f"{option}: '{name_or_path}' is neither a built-in task ({names}) nor an existing file. "
            "Pass a JSONL, Parquet or CSV data file (the GSM8K, MATH-500, AIME, AMC or DAPO-17k format, or any "
            "columns with --prompt-template)."
        )
    try:  # (a user's template that does not show the question reads files without one)
        problems = load_math_file(
            path,
            require_answer=require_answer,
            require_question=prompt_format.template is None or "question" in placeholders(prompt_format.template),
        )
    except QAEUserError as err:  # the file's problem, said of the option that named it (--eval-bench, --bench)
        if option == "data" or not str(err).startswith("data: "):
            raise
        raise QAEUserError(f"{option}: {str(err)[len('data: ') :]}") from None
    held = heldout_split(problems, heldout_fraction, seed, heldout_by, str(path))
    heldout = [problem for i, problem in enumerate(problems) if i in held]
    train = [problem for i, problem in enumerate(problems) if i not in held]
    task = Task(name=path.stem, train=train, heldout=heldout, reward="math", prompt_template=MATH_PROMPT_TEMPLATE)
    return task.with_format(prompt_format)


def heldout_split(
    problems: list[Problem], fraction: float, seed: int, by: str | None = None, origin: str = "the data"
) -> set[int]:
    """Indices of the held-out rows: int(fraction * rows) rows in a seeded shuffle, or with `by` (a column name) every
    row of int(fraction * distinct values) of that column's values in a seeded shuffle, so rows that share a value
    (one problem in several phrasings) are held out together or not at all. QAEUserError naming the first row that
    lacks the column."""
    if by is None:
        order = list(range(len(problems)))
        random.Random(seed).shuffle(order)
        return set(order[: int(len(problems) * fraction)])
    keys = []
    for problem in problems:
        if by not in problem.columns:
            row = problem.origin or f"problem '{problem.prompt_id}' of {origin}"
            raise QAEUserError(
                f"heldout-by: {row} has no column '{clipped(by)}' (its columns: "
                f"{describe_columns(problem.columns)}). Name a column every row has."
            )
        value = problem.columns[by]
        keys.append(value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False))
    values = list(dict.fromkeys(keys))  # distinct, in the file's order
    random.Random(seed).shuffle(values)
    held = set(values[: int(len(values) * fraction)])
    return {i for i, key in enumerate(keys) if key in held}


def load_benchmark(
    bench: str, option: str = "bench", prompt_format: PromptFormat | None = None, require_answer: bool = True
) -> tuple[str, list[Problem], Task]:
    """(name, problems, task) of what `qae eval --bench` and `qae train --eval-bench` evaluate: a built-in task's
    held-out split (named `<task>-heldout`) or a whole data file (named by its stem), prompted as `prompt_format`
    says (the same for both commands); `require_answer` as for `load_task`."""
    task = load_task(bench, option=option, prompt_format=prompt_format, require_answer=require_answer)
    problems = task.heldout if task.heldout else task.train
    name = f"{task.name}-heldout" if task.heldout else task.name
    return name, problems, task


# ---------------------------------------------------------------------------------------------------------------
# the training data stream: which prompt each position holds


def prompts_at(task: Task, seed: int, start: int, count: int) -> list[int]:
    """Indices into task.train of the data stream's positions start .. start + count - 1: an epoch-wise seeded
    shuffle, so a position always holds the same prompt and a resumed run, restarting at the checkpoint's
    data_position, sees exactly the prompts the uninterrupted run would have."""
    n = len(task.train)
    indices = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, n)
        indices.append(_epoch_order(seed, epoch, n)[offset])
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 10_007 + epoch).shuffle(order)
    return tuple(order)
