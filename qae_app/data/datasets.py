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
"fi\\x0cve") is dropped. A lone surrogate (a JSON `"\\ud800"` escape with no partner) is not text and cannot be
stored: it becomes U+FFFD. `meta` keeps `subject`, `level` and `source` where the file has them.

A file that is not UTF-8 (binary, UTF-16), nests JSON deeper than Python's parser allows, has a gold answer longer
than the verifier reads (`names.MAX_ANSWER_CHARS`, so never scorable), or gives some answers GSM8K's way (after
'####') and others without it (a solution taken whole could never be matched) is refused with one message naming it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.host_faults import check_path_names
from qae_app.core.names import MAX_ANSWER_CHARS


@dataclass(frozen=True)
class Problem:
    prompt_id: str  # stable id, unique within the task (used to follow one prompt across steps)
    question: str  # the problem as given, before any prompt template
    answer: str  # gold final answer, as a string ("19", "\\frac{1}{2}")
    meta: dict = field(default_factory=dict, hash=False, compare=False)  # subject, level, source...
    # every field of the data row as loaded (JSON values): what a prompt template and a user's reward function read
    columns: dict = field(default_factory=dict, hash=False, compare=False)


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
_LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid surrogates, so any left is alone
_BYTE_ORDER_MARKS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
                     b"\xfe\xff": "UTF-16"}  # longest first: the UTF-32 LE mark starts like UTF-16 LE's
_INT_RE = re.compile(r"[+-]?\d+")


def replace_lone_surrogates(text: str) -> str:
    """U+FFFD for each lone surrogate: they come from JSON escapes like "\\ud800" and cannot be encoded (or stored)."""
    return _LONE_SURROGATE_RE.sub("\ufffd", text)


def clean_text(text: str) -> str:
    """Undo mangled LaTeX escapes, drop other control characters (keeps tabs and newlines), replace lone
    surrogates."""
    text = replace_lone_surrogates(text)

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
        if not math.isfinite(value):  # JSON's NaN / Infinity (or a missing value in a Parquet float column)
            raise ValueError("NaN" if value != value else "Infinity")
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


def _json_int(digits: str) -> int | str:
    """An integer literal; kept as its digits when int() would refuse it (more than 4,300 digits)."""
    limit = sys.get_int_max_str_digits()
    return digits if limit and len(digits.lstrip("-")) > limit else int(digits)


def _decode_text(path: Path) -> str:
    """The file as text: UTF-8 (with or without a byte-order mark), else a QAEUserError that says what it is."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise QAEUserError(f"data: cannot read '{path}' ({e.strerror}). Check the path and its permissions.") from e
    for mark, encoding in _BYTE_ORDER_MARKS.items():
        if raw.startswith(mark):
            raise QAEUserError(f"data: '{path}' is {encoding} text; JSONL must be UTF-8. Convert it, e.g. "
                               f"`iconv -f {encoding} -t UTF-8 '{path}' > fixed.jsonl`.")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise QAEUserError(f"data: '{path}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, offset "
                           f"{e.start}); is it a binary file? Pass a UTF-8 JSONL file (one JSON object per line) "
                           "or a Parquet file.") from e


def _parse_json(text: str, where: str) -> object:
    """json.loads with huge integers kept as digits; a QAEUserError naming `where` for anything unparseable."""
    try:
        return json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise QAEUserError(f"data: {where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                           f"{text[:80]!r}. Each line must be one JSON object.") from e
    except RecursionError as e:
        raise QAEUserError(f"data: {where} nests JSON arrays or objects too deeply to parse. A problem record is a "
                           "flat object; fix or remove it.") from e


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
    text = _decode_text(path)
    if suffix == ".json" and text.lstrip().startswith("["):  # a JSON array of records
        records = _parse_json(text, f"'{path}'")
        return list(enumerate(records, start=1)), "record"
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        rows.append((number, _parse_json(line, f"'{path}' line {number}")))
    return rows, "line"


def load_math_file(path: Path) -> list[Problem]:
    """All problems in a JSONL or Parquet math file, in file order. Raises QAEUserError on anything unreadable."""
    path = Path(path)
    check_path_names("data", path)
    if path.is_dir():
        raise QAEUserError(f"data: '{path}' is a directory. Pass the path of a JSONL or Parquet math file in it.")
    if not path.is_file():
        raise QAEUserError(f"data: file '{path}' does not exist. Pass the path of a JSONL or Parquet math file.")
    rows, unit = _read_rows(path)
    if not rows:
        raise QAEUserError(f"data: '{path}' is empty. Pass a file with at least one problem.")

    problems = []
    seen_ids: dict[str, int] = {}
    after_marker, without_marker = [], []  # GSM8K-style rows (final answer after '####') and the other rows
    for number, row in rows:
        where = f"'{path}' {unit} {number}"
        if not isinstance(row, dict):
            raise QAEUserError(
                f"data: {where} is a {type(row).__name__}, not a JSON object. Write one object per line."
            )
        question = _row_question(row, where)
        answer, given, marked = _row_answer(row, where)
        (after_marker if marked else without_marker).append((number, given))
        prompt_id = _row_id(row, path, number)
        if prompt_id in seen_ids:
            raise QAEUserError(
                f"data: {where} repeats id '{prompt_id}' (first at {unit} {seen_ids[prompt_id]}). "
                "Ids must be unique within a file; fix or remove the id column."
            )
        seen_ids[prompt_id] = number
        problems.append(Problem(prompt_id=prompt_id, question=question, answer=answer, meta=_row_meta(row),
                                columns=_row_columns(row)))
    _check_final_answer_markers(path, unit, len(rows), after_marker, without_marker)
    return problems


def _row_question(row: dict, where: str) -> str:
    """The problem text of a file's row (`where` names it in errors): the first of QUESTION_COLUMNS present."""
    question_column = next((c for c in QUESTION_COLUMNS if _get(row, c) is not None), None)
    question = _question_text(_get(row, question_column)) if question_column else ""
    given = _get(row, question_column) if question_column else None
    if not question and given is not None and not isinstance(given, (str, list, tuple)) \
            and not hasattr(given, "tolist"):
        kind = {bool: "true/false", int: "a number", float: "a number", dict: "an object"}.get(type(given),
                                                                                              "not text")
        raise QAEUserError(
            f"data: {where} gives its question as {kind} ({question_column} = {given!r:.40}), not text. Write "
            "the problem as a string (a number too: \"5\")."
        )
    if not question:
        raise QAEUserError(
            f"data: {where} has no question (columns: {_describe_columns(row)}). "
            f"Put the problem text in one of: {', '.join(QUESTION_COLUMNS)} "
            "(`prompt` may be a list of chat messages; the user message is used)."
        )
    return question


def _row_answer(row: dict, where: str) -> tuple[str, str, bool]:
    """The gold answer of a file's row (`where` names it in errors): the first of ANSWER_COLUMNS present and not
    empty, as the text a response must match; with the value as given, and whether it is given after a GSM8K
    '####' marker."""
    answer = ""
    for column in ANSWER_COLUMNS:
        value = _get(row, column)
        if value is not None:
            try:
                answer = _answer_text(value, column)
            except ValueError as err:
                raise QAEUserError(
                    f"data: {where} gives its answer as {err} ({column}), which is not a number a response "
                    "can match (it would be stored as the text 'nan'). Give the gold answer, or remove the "
                    "row.") from None
            if answer:
                break
    if not answer:
        raise QAEUserError(
            f"data: {where} has no answer (columns: {_describe_columns(row)}). "
            f"Put the gold final answer in one of: {', '.join(ANSWER_COLUMNS)}."
        )
    if len(answer) > MAX_ANSWER_CHARS:
        raise QAEUserError(
            f"data: {where} has a {len(answer):,}-character answer ({answer[:20]}...). The verifier scores "
            f"answers of at most {MAX_ANSWER_CHARS:,} characters, so no response could match it; shorten it or "
            "remove the row."
        )
    marked = column == "answer" and isinstance(value, str) and "####" in value
    return answer, str(value), marked


def _row_id(row: dict, path: Path, number: int) -> str:
    """A file's row's prompt id: the first of ID_COLUMNS present, else `<file stem>-<row number>`."""
    raw_id = next((_get(row, c) for c in ID_COLUMNS if _get(row, c) is not None), None)
    return replace_lone_surrogates(str(raw_id)) if raw_id is not None else f"{path.stem}-{number}"


def _row_columns(row: dict) -> dict:
    """The row's fields with lone surrogates replaced in its text, so they can be stored and passed on as JSON."""
    def clean(value):
        if isinstance(value, str):
            return replace_lone_surrogates(value)
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
            return [clean(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]
        return value
    return {str(key): clean(value) for key, value in row.items()}


def _row_meta(row: dict) -> dict:
    """What a problem keeps of its row besides the question, answer and id: subject, level and source."""
    meta = {key: replace_lone_surrogates(row[key]) if isinstance(row[key], str) else row[key]
            for key in ("subject", "level") if row.get(key) is not None}
    source = next((_get(row, c) for c in SOURCE_COLUMNS if _get(row, c) is not None), None)
    if source is not None:
        meta["source"] = replace_lone_surrogates(str(source))
    return meta


def _check_final_answer_markers(path: Path, unit: str, n_rows: int, after_marker: list[tuple[int, str]],
                                without_marker: list[tuple[int, str]]) -> None:
    """Refuse a file where some rows give their answer after GSM8K's '####' and others without it (`after_marker`,
    `without_marker`: (row number, answer as given) each): a GSM8K solution whose '#### N' line was lost would be
    taken whole as the gold answer, which nothing matches."""
    if not (after_marker and without_marker):
        return
    number, text = without_marker[0]
    shown = text if len(text) <= 60 else text[:60] + "..."
    raise QAEUserError(
        f"data: '{path}' {unit} {number} gives its answer without a final '#### N' ({shown!r}), while "
        f"{len(after_marker)} of {n_rows} rows ({unit} {after_marker[0][0]} first) give theirs after "
        "'####', as GSM8K does. Taken whole, that text would be a gold answer no response can match: end it "
        "with '#### <final answer>' or remove the row"
        + (f" ({len(without_marker)} rows lack it)." if len(without_marker) > 1 else ".")
    )
