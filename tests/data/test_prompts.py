"""Prompts as the user writes them (qae_app/data/prompt_format.py): a template over the row's columns (literal braces
such as LaTeX's `\\boxed{}` kept), a system prompt, and a `prompt` column of chat messages sent as it is; every error
names the template (or the row), the column and what the data has."""

import json

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import Problem, load_math_file
from qae_app.data.prompt_format import PromptFormat, fill_template, placeholders, prompt_text
from qae_app.data.tasks import MATH_PROMPT_TEMPLATE, load_benchmark, load_task


def problem(**columns) -> Problem:
    return Problem(prompt_id="p1", question=columns.get("question", "What is 2+2?"), answer="4", columns=columns)


# ---------------------------------------------------------------------------------------------------------------
# templates


def test_placeholders_are_identifiers_and_everything_else_is_literal():
    assert placeholders("{question} then {hint} and {extra_info.index}") == ["question", "hint", "extra_info.index"]
    # LaTeX and other braces: not an identifier between them, so not a placeholder
    assert placeholders("\\boxed{} \\frac{1}{2} { spaced } {1, 2} {\\alpha} {{question}}") == []
    assert placeholders(MATH_PROMPT_TEMPLATE) == ["question"]


def test_fill_template_by_hand():
    p = problem(question="What is 2+2?", hint="count", level=3, tests=["4", "four"], meta={"source": "mine"})
    assert fill_template("{question} Hint: {hint}.", p, "t") == "What is 2+2? Hint: count."
    # text as it is; anything else as JSON
    assert fill_template("{level}|{tests}|{meta.source}", p, "t") == '3|["4", "four"]|mine'
    assert fill_template("Put it in \\boxed{}: {question}", p, "t") == "Put it in \\boxed{}: What is 2+2?"
    assert fill_template("\\boxed{\\frac{1}{2}} {question}", p, "t") == "\\boxed{\\frac{1}{2}} What is 2+2?"
    assert (
        fill_template("{{question}} is {question}; \\frac{{a}}{{b}}", p, "t")
        == "{question} is What is 2+2?; \\frac{a}{b}"
    )
    # a value is inserted as it is: braces in the data are not read again
    assert fill_template("{question}", problem(question="Is {hint} a set?", hint="x"), "t") == "Is {hint} a set?"


def test_question_and_answer_are_always_there():
    """`{question}` is the problem's text whichever column it came from (`problem` in MATH-500), `{answer}` its gold
    answer; a column of that name in the row comes first (GSM8K's `answer` is the worked solution)."""
    p = Problem(prompt_id="p", question="Solve x.", answer="7", columns={"problem": "Solve x.", "id": "p"})
    assert fill_template("{question} ({answer})", p, "t") == "Solve x. (7)"
    gsm = Problem(prompt_id="g", question="q", answer="5", columns={"question": "q", "answer": "2+3=5\n#### 5"})
    assert fill_template("{answer}", gsm, "t") == "2+3=5\n#### 5"


def test_a_missing_column_names_the_template_the_column_and_the_columns_there_are():
    p = problem(question="q", hint="h", extra_info={"index": 4})
    with pytest.raises(QAEUserError) as e:
        fill_template("Solve {questoin} with \\text{Answer}", p, "prompt-template", "'mine.jsonl' line 3")
    message = str(e.value)
    assert message.startswith("prompt-template: 'Solve {questoin} with \\text{Answer}' names column 'questoin'")
    assert "'mine.jsonl' line 3 has no such column" in message
    assert "its columns: question, hint, extra_info, extra_info.index, answer" in message
    assert "{{questoin}}" in message  # how to write literal braces
    null = problem(question="q", hint=None)
    with pytest.raises(QAEUserError, match="names column 'hint', but problem 'p1' has no value for it"):
        fill_template("{hint}", null, "prompt-template")


# ---------------------------------------------------------------------------------------------------------------
# the prompt a task sends, and the text stored for it


CHAT = [{"role": "system", "content": "You grade poems."}, {"role": "user", "content": "Rate: roses are red"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_chat_prompt_column_is_sent_as_it_is(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"prompt": CHAT, "answer": "5", "topic": "poems"}, {"question": "2+2?", "answer": "4"}],
    )
    task = load_task(str(path))
    chat, text = task.train
    assert task.prompt(chat) == CHAT  # system message and all, no template added
    assert task.prompt(text) == MATH_PROMPT_TEMPLATE.replace("{question}", "2+2?")  # a text row: today's template
    assert chat.question == "Rate: roses are red"  # {question}: the last user message
    assert prompt_text(task.prompt(chat)) == "You grade poems.\n\nRate: roses are red"


def test_system_prompt_goes_before_the_user_message_and_a_template_replaces_the_default(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "2+2?", "answer": "4", "hint": "add"}])
    task = load_task(str(path), prompt_format=PromptFormat(system_prompt="Be brief."))
    [p] = task.train
    assert task.prompt(p) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": MATH_PROMPT_TEMPLATE.replace("{question}", "2+2?")},
    ]
    task = load_task(str(path), prompt_format=PromptFormat(template="{question} ({hint})"))
    assert task.prompt(p) == "2+2? (add)"
    # a built-in task takes a template too (its problems have a question and an answer)
    arith = load_task("arith", prompt_format=PromptFormat(template="q {question}"))
    assert arith.prompt(arith.train[0]) == "q " + arith.train[0].question


def test_system_prompt_with_chat_rows(tmp_path):
    user_only = write_jsonl(tmp_path / "u.jsonl", [{"prompt": CHAT[1:], "answer": "5"}])
    task = load_task(str(user_only), prompt_format=PromptFormat(system_prompt="You grade poems."))
    assert task.prompt(task.train[0]) == CHAT
    with_system = write_jsonl(tmp_path / "s.jsonl", [{"prompt": CHAT, "answer": "5"}])
    with pytest.raises(QAEUserError) as e:
        load_task(str(with_system), prompt_format=PromptFormat(system_prompt="Other."))
    assert "system-prompt: 's.jsonl' line 1 has a system message of its own ('You grade poems.')" in str(
        e.value
    ).replace(str(tmp_path) + "/", "")
    # a template builds one user message from the columns instead of the row's messages
    task = load_task(str(with_system), prompt_format=PromptFormat(template="Q: {question}"))
    assert task.prompt(task.train[0]) == "Q: Rate: roses are red"


def test_template_errors_are_found_when_the_task_loads(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"question": "a", "answer": "1", "hint": "h"}, {"question": "b", "answer": "2"}]
    )
    with pytest.raises(QAEUserError) as e:
        load_task(str(path), prompt_format=PromptFormat(template="{question} {hint}"))
    assert "prompt-template: '{question} {hint}' names column 'hint', but 'd.jsonl' line 2 has no such column" in str(
        e.value
    ).replace(str(tmp_path) + "/", "")
    expected = r"^prompt-template: '\{hint\}' names column 'hint', but '.*d\.jsonl' line 2"
    with pytest.raises(QAEUserError, match=expected):
        load_benchmark(str(path), option="eval-bench", prompt_format=PromptFormat(template="{hint}"))
    # a template that names no question reads files that have none
    nq = write_jsonl(tmp_path / "nq.jsonl", [{"text": "hello", "label": "x"}])
    task = load_task(str(nq), require_answer=False, prompt_format=PromptFormat(template="Echo: {text}"))
    assert task.prompt(task.train[0]) == "Echo: hello"


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "'bad.jsonl' line 1 gives `prompt` as an empty list"),
        (["hi"], "'bad.jsonl' line 1 gives `prompt` as a list, but item 1 is not a chat message"),
        ([{"role": "user"}], "'bad.jsonl' line 1: chat message 1 has no text content"),
        ([{"role": "user", "content": [{"type": "image"}]}], "'bad.jsonl' line 1: chat message 1 has no text content"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
            "'bad.jsonl' line 1: its chat messages end with an assistant message",
        ),
    ],
)
def test_malformed_chat_messages_are_refused_by_row(tmp_path, messages, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": messages, "answer": "1"}])
    with pytest.raises(QAEUserError) as e:
        load_math_file(path)
    assert message in str(e.value).replace(str(tmp_path) + "/", "")


def test_parquet_chat_rows_keep_their_messages(tmp_path):
    """A Parquet list of structs comes back with every struct field, None where a message lacks it: those are
    dropped, the rest kept as the file has them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "U", "name": "ann"}], "answer": "1"}
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    task = load_task(str(tmp_path / "c.parquet"))
    assert task.prompt(task.train[0]) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U", "name": "ann"},
    ]
