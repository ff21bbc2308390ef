"""Data files as the user writes them: JSONL, Parquet and CSV with any columns, every field kept in
`Problem.columns`; the gold answer needed only where the reward reads one (`require_answer`); a bad CSV file gets one
message that says what is wrong and where."""

import json
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import load_math_file
from qae_app.data.tasks import load_task

ROWS = [
    {"id": "r1", "question": "Name a prime above 10.", "answer": "11", "hint": "try 11", "tests": ["11", "13"]},
    {"id": "r2", "question": "Spell 'cat' backwards.", "answer": "tac", "hint": "t first", "tests": ["tac"]},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_text(text, encoding=encoding)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_each_format_loads_the_same_problems_with_extra_columns(tmp_path, suffix):
    path = tmp_path / f"mine{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, ROWS)
        tests = [["11", "13"], ["tac"]]
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
        tests = [["11", "13"], ["tac"]]
    else:  # a CSV cell is text: a list is written as the user wrote it
        write_csv(
            path,
            'id,question,answer,hint,tests\nr1,Name a prime above 10.,11,try 11,"11,13"\n'
            "r2,Spell 'cat' backwards.,tac,t first,tac\n",
        )
        tests = ["11,13", "tac"]
    problems = load_math_file(path)
    assert [(p.prompt_id, p.question, p.answer) for p in problems] == [
        ("r1", "Name a prime above 10.", "11"),
        ("r2", "Spell 'cat' backwards.", "tac"),
    ]
    assert [p.columns["hint"] for p in problems] == ["try 11", "t first"]
    assert [p.columns["tests"] for p in problems] == tests
    assert list(problems[0].columns) == ["id", "question", "answer", "hint", "tests"]


def test_csv_quoting_newlines_bom_and_gsm8k_answers(tmp_path):
    """The csv module's dialect (RFC 4180): quoted commas, doubled quotes, a newline inside a quoted cell; a UTF-8
    byte-order mark (Excel writes one) is not part of the first column's name; GSM8K's '####' works as in JSONL."""
    path = write_csv(
        tmp_path / "gsm.csv",
        '\ufeffquestion,answer\n"Tom has 2 apples, buys 3. ""How many?""","2 + 3 = 5\n#### 5"\n'
        '"What is 1,000 + 1?","1,000 + 1\n#### 1,001"\n',
    )
    problems = load_math_file(path)
    assert [(p.prompt_id, p.question, p.answer) for p in problems] == [
        ("gsm-2", 'Tom has 2 apples, buys 3. "How many?"', "5"),
        ("gsm-4", "What is 1,000 + 1?", "1001"),
    ]
    assert list(problems[0].columns) == ["question", "answer"]


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "What is 2+2?,4\nWhat is 3+3?,6\n",
            "no-header.csv' has no question column in its header (its first line: What is 2+2?, 4). A CSV file's first "
            "line names its columns",
        ),
        ("question,answer,\n1+1?,2,\n", "no-header.csv' line 1 has an empty column name (column 3)"),
        ("question,answer,question\n1+1?,2,x\n", "no-header.csv' line 1 names column 'question' twice"),
        (
            "question,answer\n1+1?,2\n2+2?,4,extra\n",
            "no-header.csv' line 3 has 3 cells, but the header (line 1) names 2 columns",
        ),
        ("question,answer\n1+1?\n", "no-header.csv' line 2 has 1 cell, but the header (line 1) names 2 columns"),
        ('question,answer\n"1+1?,2\n', "no-header.csv' is not valid CSV (unexpected end of data at line 2)"),
        ("question,answer\n", "no-header.csv' is empty"),
    ],
)
def test_bad_csv_is_one_message_naming_the_file_and_line(tmp_path, text, message):
    path = write_csv(tmp_path / "no-header.csv", text)
    with pytest.raises(QAEUserError) as e:
        load_math_file(path)
    assert message in str(e.value)


def test_csv_that_is_not_utf8_says_so(tmp_path):
    path = write_csv(tmp_path / "latin.csv", "question,answer\nCafé?,2\n", encoding="latin-1")
    with pytest.raises(QAEUserError, match=r"latin\.csv' is not UTF-8 text \(byte 0xe9 at line 2.*CSV"):
        load_math_file(path)
    utf16 = write_csv(tmp_path / "utf16.csv", "question,answer\n1+1?,2\n", encoding="utf-16")
    with pytest.raises(QAEUserError, match=r"utf16\.csv' is UTF-16 text; CSV must be UTF-8"):
        load_math_file(utf16)


def test_tsv_is_tab_separated(tmp_path):
    path = write_csv(tmp_path / "t.tsv", "question\tanswer\thint\nWhat is 2, plus 2?\t4\tsmall\n")
    [problem] = load_math_file(path)
    assert (problem.question, problem.answer, problem.columns["hint"]) == ("What is 2, plus 2?", "4", "small")


# ---------------------------------------------------------------------------------------------------------------
# the gold answer only where a reward reads it


def test_a_file_without_answers_loads_when_none_is_required(tmp_path):
    path = write_jsonl(
        tmp_path / "open.jsonl",
        [{"question": "Write a haiku.", "min_lines": 3}, {"question": "Write a limerick.", "answer": ""}],
    )
    with pytest.raises(QAEUserError, match=r"open\.jsonl' line 1 has no answer"):
        load_math_file(path)  # today's default: every row needs one
    problems = load_math_file(path, require_answer=False)
    assert [(p.question, p.answer) for p in problems] == [("Write a haiku.", ""), ("Write a limerick.", "")]
    assert problems[0].columns == {"question": "Write a haiku.", "min_lines": 3}
    task = load_task(str(path), require_answer=False)
    assert [p.answer for p in task.train] == ["", ""]
    with pytest.raises(QAEUserError, match="line 1 has no answer"):
        load_task(str(path))


def test_an_answer_given_is_still_checked_when_none_is_required(tmp_path):
    """require_answer=False lets a row go without an answer; one that gives an answer that cannot be read (NaN) is
    still refused: it would be scored against the text 'nan'."""
    path = tmp_path / "nan.jsonl"
    path.write_text('{"question": "q", "answer": NaN}\n')
    with pytest.raises(QAEUserError, match="gives its answer as NaN"):
        load_math_file(path, require_answer=False)
