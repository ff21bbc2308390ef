"""Load math problem files (JSONL or Parquet) into `Problem`s.

One function, `load_math_file(path)`. The format is detected per row from the columns present, so these all load:

| format            | question                    | gold answer                                  | prompt_id          |
|-------------------|-----------------------------|----------------------------------------------|--------------------|
| GSM8K             | `question`                  | `answer` after the last `#### `, no commas   | `<stem>-<line>`    |
| MATH-500          | `problem`                   | `answer`                                     | `unique_id`        |
| AIME'24/'25, AMC  | `problem` (or `question`)   | `answer` (int, str or float: 27.0 -> "27")   | `id`               |
| DAPO-17k (verl)   | `prompt`: the user message  | `reward_model.ground_truth`                  | `extra_info.index` |
| generic JSONL     | `question/problem/prompt`   | `answer` or `ground_truth`                   | `id`, if present   |

Integer answers are written canonically ("025" -> "25"). Text is cleaned of stray control characters: DAPO-17k has
escapes that were mangled by a JSON round trip ("\\frac" stored as form feed + "rac", "\\beta" as backspace + "eta");
those are turned back into the LaTeX command, and any other control character (PDF ligature debris such as
"fi\\x0cve") is dropped. `meta` keeps `subject`, `level` and `source` where the file has them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from qae_app.errors import QAEUserError


@dataclass(frozen=True)
class Problem:
    prompt_id: str  # stable id, unique within the task (used to follow one prompt across steps)
    question: str  # the problem as given, before any prompt template
    answer: str  # gold final answer, as a string ("19", "\\frac{1}{2}")
    meta: dict = field(default_factory=dict, hash=False, compare=False)  # subject, level, source...


JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
QUESTION_COLUMNS = ("problem", "question", "prompt")  # first one present wins
ANSWER_COLUMNS = ("reward_model.ground_truth", "answer", "ground_truth")  # first one present and non-empty wins
ID_COLUMNS = ("unique_id", "id", "extra_info.index", "idx")
SOURCE_COLUMNS = ("data_source", "competition", "source")

# A control character that is a mangled one-letter escape ("\f" in "\frac" read as form feed) becomes the LaTeX
# command again, but only when the letters after it complete a command name; otherwise it is dropped.
_MANGLED_ESCAPES = {
    "\x07": ("a", ("lpha", "pprox", "ngle")),
    "\x08": ("b", ("eta", "inom", "oxed", "egin", "ar", "ig", "ot")),
    "\x0b": ("v", ("ec", "arepsilon", "arphi", "ee", "dots")),
    "\x0c": ("f", ("rac", "orall")),
    "\x0d": ("r", ("ight", "ho", "angle", "m", "ceil", "floor")),
}
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 (except \t, \n) and C1 controls
_INT_RE = re.compile(r"[+-]?\d+")


def clean_text(text: str) -> str:
    """Undo mangled LaTeX escapes and drop other control characters (keeps tabs and newlines)."""

    def fix(match: re.Match) -> str:
        ch = match.group(0)
        letter, tails = _MANGLED_ESCAPES.get(ch, ("", ()))
        if tails and text.startswith(tails, match.end()):
            return "\\" + letter
        return ""

    return _CONTROL_RE.sub(fix, text)


def _get(row: dict, dotted: str):
    """row["a"]["b"] for "a.b"; None when any part is missing."""
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _answer_text(value, column: str) -> str:
    if isinstance(value, bool):
        return ""  # not an answer; reported as missing
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    text = clean_text(str(value)).strip()
    if column == "answer" and "####" in text:  # GSM8K: worked solution, final answer after the last "#### "
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if _INT_RE.fullmatch(text) and len(text) < 1000:
        text = str(int(text))  # "025" -> "25", "+3" -> "3"
    return text


def _question_text(value) -> str:
    if isinstance(value, str):
        return clean_text(value).strip()
    if isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and not isinstance(value, dict)):
        messages = value.tolist() if hasattr(value, "tolist") else value  # chat messages: take the user's
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        return clean_text(str(users[-1])).strip() if users else ""
    return ""


def _describe_columns(row: dict) -> str:
    names = []
    for key, value in row.items():
        names.append(key)
        if isinstance(value, dict):
            names.extend(f"{key}.{sub}" for sub in value)
    return ", ".join(names) or "(none)"


def _read_rows(path: Path) -> tuple[list[tuple[int, dict]], str]:
    """(line or row number counted from 1, record) pairs, and the word for the unit ("line" or "row")."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
            raise QAEUserError(f"data: cannot read '{path}' as Parquet ({e}). Pass a valid .parquet file.") from e
        return list(enumerate(records, start=1)), "row"
    if suffix not in JSONL_SUFFIXES:
        raise QAEUserError(
            f"data: '{path}' has suffix '{path.suffix}'; expected one of "
            f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}. Rename the file or convert it to JSONL."
        )
    text = path.read_text(encoding="utf-8-sig")
    if suffix == ".json" and text.lstrip().startswith("["):  # a JSON array of records
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise QAEUserError(f"data: '{path}' is not valid JSON ({e.msg} at line {e.lineno}). Fix the file.") from e
        return list(enumerate(records, start=1)), "record"
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            raise QAEUserError(
                f"data: '{path}' line {number} is not valid JSON ({e.msg} at column {e.colno}): {line[:80]!r}. "
                "Each line must be one JSON object."
            ) from e
    return rows, "line"


def load_math_file(path: Path) -> list[Problem]:
    """All problems in a JSONL or Parquet math file, in file order. Raises QAEUserError on anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise QAEUserError(f"data: file '{path}' does not exist. Pass the path of a JSONL or Parquet math file.")
    rows, unit = _read_rows(path)
    if not rows:
        raise QAEUserError(f"data: '{path}' is empty. Pass a file with at least one problem.")

    problems = []
    seen_ids: dict[str, int] = {}
    for number, row in rows:
        where = f"'{path}' {unit} {number}"
        if not isinstance(row, dict):
            raise QAEUserError(
                f"data: {where} is a {type(row).__name__}, not a JSON object. Write one object per line."
            )
        question_column = next((c for c in QUESTION_COLUMNS if _get(row, c) is not None), None)
        question = _question_text(_get(row, question_column)) if question_column else ""
        if not question:
            raise QAEUserError(
                f"data: {where} has no question (columns: {_describe_columns(row)}). "
                f"Put the problem text in one of: {', '.join(QUESTION_COLUMNS)} "
                "(`prompt` may be a list of chat messages; the user message is used)."
            )
        answer = ""
        for column in ANSWER_COLUMNS:
            value = _get(row, column)
            if value is not None:
                answer = _answer_text(value, column)
                if answer:
                    break
        if not answer:
            raise QAEUserError(
                f"data: {where} has no answer (columns: {_describe_columns(row)}). "
                f"Put the gold final answer in one of: {', '.join(ANSWER_COLUMNS)}."
            )
        raw_id = next((_get(row, c) for c in ID_COLUMNS if _get(row, c) is not None), None)
        prompt_id = str(raw_id) if raw_id is not None else f"{path.stem}-{number}"
        if prompt_id in seen_ids:
            raise QAEUserError(
                f"data: {where} repeats id '{prompt_id}' (first at {unit} {seen_ids[prompt_id]}). "
                "Ids must be unique within a file; fix or remove the id column."
            )
        seen_ids[prompt_id] = number
        meta = {key: row[key] for key in ("subject", "level") if row.get(key) is not None}
        source = next((_get(row, c) for c in SOURCE_COLUMNS if _get(row, c) is not None), None)
        if source is not None:
            meta["source"] = str(source)
        problems.append(Problem(prompt_id=prompt_id, question=question, answer=answer, meta=meta))
    return problems
