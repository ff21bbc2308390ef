"""Each real benchmark file loads with the right count and answers; bad files fail with errors that say where."""

import json
import os
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import clean_text, load_math_file

MATH_DATA = Path(os.environ.get("QAE_MATH_DATA") or Path(__file__).resolve().parents[3] / "shared/data/math")
needs_data = pytest.mark.skipif(not MATH_DATA.is_dir(), reason=f"math data folder {MATH_DATA} not found")


# (file, count, index of a spot-checked problem, its prompt_id, its gold answer, a phrase of its question)
REAL_FILES = [
    ("aime24.jsonl", 30, 0, "60", "204", "Aya goes for a $9$-kilometer-long walk"),
    ("aime24.jsonl", 30, 7, "67", "25", "There exist real numbers $x$ and $y$"),  # stored as "025"
    ("aime25.jsonl", 30, 0, "2025-I-1", "70", "integer bases $b>9$"),
    ("amc23.jsonl", 40, 0, "0", "27", "Cities $A$ and $B$ are $45$ miles apart"),  # stored as 27.0
    ("math500.jsonl", 500, 0, "test/precalculus/807.json", "\\left( 3, \\frac{\\pi}{2} \\right)", "(0,3)"),
    ("gsm8k_test.jsonl", 1319, 0, "gsm8k_test-1", "18", "Janet\u2019s ducks lay 16 eggs"),
    ("dapo17k.parquet", 17917, 0, "0", "34", "In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$"),
]


@needs_data
@pytest.mark.parametrize("name, count, index, prompt_id, answer, phrase", REAL_FILES)
def test_real_file_loads(name, count, index, prompt_id, answer, phrase):
    problems = load_math_file(MATH_DATA / name)
    assert len(problems) == count
    assert len({p.prompt_id for p in problems}) == count  # ids are unique
    p = problems[index]
    assert (p.prompt_id, p.answer) == (prompt_id, answer)
    assert phrase in p.question
    assert all(p.question and p.answer for p in problems)


@needs_data
def test_math500_meta_and_gsm8k_comma_answers():
    math500 = load_math_file(MATH_DATA / "math500.jsonl")
    assert math500[0].meta == {"subject": "Precalculus", "level": 2}
    gsm8k = load_math_file(MATH_DATA / "gsm8k_test.jsonl")
    raw = [json.loads(line)["answer"] for line in (MATH_DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    with_comma = [i for i, a in enumerate(raw) if "," in a.rsplit("#### ", 1)[1]]
    assert with_comma, "GSM8K test has answers like 1,000"
    for i in with_comma:
        assert gsm8k[i].answer == raw[i].rsplit("#### ", 1)[1].replace(",", "").strip()
        assert gsm8k[i].answer.lstrip("-").replace(".", "").isdigit()


@needs_data
def test_dapo_control_characters_are_repaired():
    problems = {p.prompt_id: p for p in load_math_file(MATH_DATA / "dapo17k.parquet")}
    assert all(not any(ord(ch) < 32 and ch not in "\n\t" for ch in p.question) for p in problems.values())
    # index 6391 was stored with a form feed for the "\f" of "\frac"
    assert "The answer is in the form \\frac{m}{n}" in problems["6391"].question
    # index 8197 has form feeds where PDF ligatures were: "fi\x0cve" -> "five"
    assert "congruent to the other five is placed" in problems["8197"].question
    assert problems["14591"].meta == {"source": "DAPO-17k"}
    assert "=\\beta$" in problems["14591"].question  # backspace + "eta"


def test_clean_text():
    assert clean_text("form \x0crac{m}{n}") == "form \\frac{m}{n}"
    assert clean_text("fi\x0cve \x0cfigure") == "five figure"
    assert clean_text("a\x08eta b\x14c\x88") == "a\\beta bc"
    assert clean_text("keeps\ttabs\nand newlines") == "keeps\ttabs\nand newlines"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_generic_jsonl_formats_and_fallback_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"question": "1+1?", "answer": 2},
            "",  # blank lines are skipped but still counted
            {"prompt": "2+2?", "ground_truth": "4", "level": 1},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+3?"}], "answer": 6.0},
            {"problem": "half?", "answer": "\\frac{1}{2}", "id": "h"},
        ],
    )
    problems = load_math_file(path)
    assert [(p.prompt_id, p.question, p.answer) for p in problems] == [
        ("mine-1", "1+1?", "2"),
        ("mine-3", "2+2?", "4"),
        ("mine-4", "3+3?", "6"),
        ("h", "half?", "\\frac{1}{2}"),
    ]
    assert problems[1].meta == {"level": 1}


def test_malformed_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "1"}, '{"question": "q2", "answer": '])
    with pytest.raises(QAEUserError, match=r"bad\.jsonl' line 2 is not valid JSON"):
        load_math_file(path)


def test_missing_answer_column_says_what_it_has_and_what_is_accepted(tmp_path):
    rows = [{"question": "q", "answer": "1"}, {"question": "q", "solution": "s"}]
    path = write_jsonl(tmp_path / "noanswer.jsonl", rows)
    with pytest.raises(QAEUserError) as e:
        load_math_file(path)
    message = str(e.value)
    assert "noanswer.jsonl' line 2 has no answer" in message
    assert "columns: question, solution" in message
    assert "answer" in message.split("one of:")[1] and "ground_truth" in message


def test_missing_question_column(tmp_path):
    path = write_jsonl(tmp_path / "noq.jsonl", [{"text": "q", "answer": "1"}])
    expected = r"line 1 has no question \(columns: text, answer\).*problem, question, prompt"
    with pytest.raises(QAEUserError, match=expected):
        load_math_file(path)


def test_missing_empty_and_unsupported_files(tmp_path):
    with pytest.raises(QAEUserError, match=r"nope\.jsonl' does not exist"):
        load_math_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(QAEUserError, match=r"empty\.jsonl' is empty"):
        load_math_file(tmp_path / "empty.jsonl")
    (tmp_path / "data.txt").write_text("question,answer\n1+1,2\n")
    with pytest.raises(QAEUserError, match=r"suffix '\.txt'"):
        load_math_file(tmp_path / "data.txt")


def test_gsm8k_row_without_its_final_answer_marker_is_refused(tmp_path):
    """In a GSM8K file a solution whose '#### N' was lost would be taken whole as the gold answer, which no response
    matches: that prompt would score 0 forever. A file that gives its answers after '####' must do so on every row."""
    rows = [
        {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
        {"question": "Ann has 4 pens and loses 1. How many?", "answer": "4 - 1 = <<4-1=3>>3 pens are left."},
        {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
    ]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    with pytest.raises(QAEUserError) as e:
        load_math_file(path)
    message = str(e.value)
    assert "gsm.jsonl' line 2" in message and "4 - 1 = <<4-1=3>>3 pens" in message
    assert "'####'" in message and "2 of 3 rows" in message and "line 1" in message
    # a file of plain short answers (no row with '####') is the generic format and loads as before
    plain = write_jsonl(
        tmp_path / "plain.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    )
    assert [p.answer for p in load_math_file(plain)] == ["2", "4"]


def test_duplicate_ids_are_rejected(tmp_path):
    rows = [{"id": 1, "problem": "a", "answer": 1}, {"id": 1, "problem": "b", "answer": 2}]
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(QAEUserError, match=r"line 2 repeats id '1' \(first at line 1\)"):
        load_math_file(path)


def test_parquet_in_verl_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {
                "data_source": "toy",
                "prompt": [{"content": "x\x0crac{1}{2}?", "role": "user"}],
                "reward_model": {"ground_truth": "7", "style": "rule"},
                "extra_info": {"answer": "", "index": 41},
            },
        ]
    )
    pq.write_table(table, tmp_path / "toy.parquet")
    [p] = load_math_file(tmp_path / "toy.parquet")
    assert (p.prompt_id, p.question, p.answer, p.meta) == ("41", "x\\frac{1}{2}?", "7", {"source": "toy"})


def test_lone_surrogates_become_replacement_characters(tmp_path):
    """json.loads keeps a lone "\\ud800" escape as a code point no encoder (or database) accepts."""
    (tmp_path / "s.jsonl").write_text(
        '{"id": "a\\ud800", "problem": "x\\udfffy", "answer": "\\ud83d\\ude00 1", "subject": "s\\ud800"}\n'
    )
    [problem] = load_math_file(tmp_path / "s.jsonl")
    assert (problem.prompt_id, problem.question, problem.meta["subject"]) == ("a\ufffd", "x\ufffdy", "s\ufffd")
    assert problem.answer == "\U0001f600 1"  # a valid surrogate pair is one character, kept
    problem.question.encode("utf-8")  # storable


def test_huge_integers_and_long_answers_are_refused_by_length(tmp_path):
    """A 5,000-digit integer breaks int() (4,300-digit limit); it is read as digits and refused as too long to
    verify, like the same answer written as a string."""
    for name, answer in (("int", "7" * 5000), ("text", '"' + "7" * 5000 + '"')):
        (tmp_path / f"{name}.jsonl").write_text('{"problem": "q", "answer": ' + answer + "}\n")
        with pytest.raises(QAEUserError, match=r"line 1 has a 5,000-character answer .* at most 1,000 characters"):
            load_math_file(tmp_path / f"{name}.jsonl")
    (tmp_path / "ok.jsonl").write_text('{"problem": "q", "answer": ' + "7" * 900 + ', "id": ' + "9" * 4400 + "}\n")
    [problem] = load_math_file(tmp_path / "ok.jsonl")
    assert problem.answer == "7" * 900 and problem.prompt_id == "9" * 4400  # long ids are kept as their digits
