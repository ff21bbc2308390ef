"""Prompts as the user writes them: a template over the data row's columns, a system prompt, or the row's own chat
messages.

What a task sends the model for a problem (`build_prompt`) is text, or a list of chat messages:

- A row whose `prompt` column is a list of chat messages (TRL's conversational format, verl's) is sent as it is,
  through the tokenizer's chat template, unless the user gives a template. `--system-prompt` goes first, unless the
  row has a system message of its own (refused: one of the two would be lost).
- Otherwise the template is filled from the row (the task's own by default: `tasks.MATH_PROMPT_TEMPLATE` for a data
  file) and sent as one user message; with `--system-prompt`, a system message goes before it.

Template syntax: `{name}` is replaced by the row's column `name` (`{extra_info.index}` reads a nested field), and
`{question}` / `{answer}` by the problem's text and gold answer where the row has no column of that name. Only a
name that is an identifier between single braces is a placeholder, so LaTeX and other braces stay as written
(`\\boxed{}`, `\\frac{1}{2}`, `{1, 2}`); `{{name}}` is the literal text `{name}` (for `\\text{Answer}`, write
`\\text{{Answer}}`). A text value is inserted as it is (never read as a template again), any other value as JSON. A
placeholder that is no column of the row is an error naming the template, the column and the row's columns.

A model without a chat template (the built-in model, a base model's tokenizer) reads a list of messages as their
contents joined by blank lines (`prompt_text`), which is also the text stored as each group's `prompt`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.data.datasets import Problem, clean_text, describe_columns

Messages = list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]
Prompt = str | Messages  # what a rollout engine encodes: text, or chat messages

_NAME = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_PLACEHOLDER_RE = re.compile(r"\{\{(" + _NAME + r")\}\}|\{(" + _NAME + r")\}")  # {{literal}} or {placeholder}
MESSAGE_SEPARATOR = "\n\n"  # between the contents of chat messages, for a model without a chat template


@dataclass(frozen=True)
class PromptFormat:
    """What the user asked of the prompts: `--prompt-template` and `--system-prompt` (None: not given)."""

    template: str | None = None
    system_prompt: str | None = None


def placeholders(template: str) -> list[str]:
    """The column names a template reads, in order (`{{name}}` is literal text, not one)."""
    return [m.group(2) for m in _PLACEHOLDER_RE.finditer(template) if m.group(2) is not None]


def _lookup(columns: dict, name: str):
    """(found, value) of column `name`: a top-level column of that name, else a dotted path into nested fields."""
    if name in columns:
        return True, columns[name]
    value = columns
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def template_columns(problem: Problem) -> dict:
    """What a template may read of a problem: its row's columns, with `question` and `answer` (the problem's text and
    gold answer) where the row has no column of that name and the problem has one."""
    columns = dict(problem.columns)
    for name, value in (("question", problem.question), ("answer", problem.answer)):
        if name not in columns and value:
            columns[name] = value
    return columns


def fill_template(template: str, problem: Problem, option: str = "prompt-template", where: str | None = None) -> str:
    """`template` with each placeholder replaced by the problem's column (module docstring); `option` and `where`
    (default: the problem's origin) name the template and the row in the error for a column it lacks."""
    columns = template_columns(problem)

    def replace(match: re.Match) -> str:
        if match.group(1) is not None:  # {{name}}: the literal text {name}
            return "{" + match.group(1) + "}"
        name = match.group(2)
        found, value = _lookup(columns, name)
        if not found or value is None:
            row = where or problem.origin or f"problem '{problem.prompt_id}'"
            said = (
                f"{row} has no value for it (null)"
                if found
                else f"{row} has no such column (its columns: {describe_columns(columns)})"
            )
            raise QAEUserError(
                f"{option}: '{clipped(template)}' names column '{name}', but {said}. Use a column "
                f"every row has, or write {{{{{name}}}}} for the literal text {{{name}}}."
            )
        return clean_text(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _PLACEHOLDER_RE.sub(replace, template)


def build_prompt(
    problem: Problem, template: str, system_prompt: str | None = None, row_messages: bool = True
) -> Prompt:
    """What the model is sent for `problem`: the row's chat messages where it has them and `row_messages` (no user
    template), else `template` filled from the row; `system_prompt` before either (module docstring)."""
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    if row_messages and problem.messages is not None:
        if system and problem.messages[0]["role"] == "system":
            row = problem.origin or f"problem '{problem.prompt_id}'"
            raise QAEUserError(
                f"system-prompt: {row} has a system message of its own "
                f"('{clipped(problem.messages[0]['content'], 60)}'), which --system-prompt would "
                "contradict. Drop --system-prompt, or the rows' own system messages."
            )
        return system + [dict(m) for m in problem.messages]
    text = fill_template(template, problem)
    return system + [{"role": "user", "content": text}] if system else text


def prompt_text(prompt: Prompt) -> str:
    """A prompt as one text: itself, or its messages' contents joined by blank lines (what a model without a chat
    template reads, and what the `prompt` column of a run's groups stores)."""
    if isinstance(prompt, str):
        return prompt
    return MESSAGE_SEPARATOR.join(m["content"] for m in prompt)


def sends_row_messages(prompt: Prompt, problem) -> bool:
    """Whether `prompt` is `problem`'s own chat messages as the row has them (a --system-prompt message may go first):
    TRL's conversational format, whose rewards get messages, not text (rewards/registry.reward_inputs)."""
    messages = getattr(problem, "messages", None)
    if not messages or not isinstance(prompt, list) or len(prompt) < len(messages):
        return False
    return prompt[len(prompt) - len(messages) :] == [dict(message) for message in messages]


def check_prompt_options(template: str | None, system_prompt: str | None) -> None:
    """Both are text a tokenizer can read (a command line's bytes that are not UTF-8 arrive as lone surrogates,
    which no tokenizer or database takes), and a template names a column: without one every prompt would be the
    same text."""
    for flag, value in (("prompt-template", template), ("system-prompt", system_prompt)):
        bad = next((i for i, ch in enumerate(value or "") if "\ud800" <= ch <= "\udfff"), None)
        if bad is not None:
            raise QAEUserError(
                f"{flag}: '{clipped(value)}' is not UTF-8 text (character {bad + 1} is a byte that no "
                "UTF-8 character starts with). Write it in UTF-8."
            )
    if template is not None and not placeholders(template):
        raise QAEUserError(
            f"prompt-template: '{clipped(template)}' names no column, so every prompt would be this "
            "same text. Put the row's text in it with a placeholder such as {question} (or any column "
            "of the data: {name})."
        )
