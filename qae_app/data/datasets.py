"""Load data files (JSONL, Parquet or CSV, with any columns) into `Problem`s.

One function, `load_math_file(path)`. Every field of a row is kept in `Problem.columns` (what a prompt template and a
user's reward read); the question, gold answer and id are found per row from the columns present, so these all load:

| format            | question                    | gold answer                                  | prompt_id          |
|-------------------|-----------------------------|----------------------------------------------|--------------------|
| GSM8K             | `question`                  | `answer` after the last `#### `, no commas   | `<stem>-<line>`    |
| MATH-500          | `problem`                   | `answer`                                     | `unique_id`        |
| AIME'24/'25, AMC  | `problem` (or `question`)   | `answer` (int, str or float: 27.0 -> "27")   | `id`               |
| DAPO-17k (verl)   | `prompt`: the user message  | `reward_model.ground_truth`                  | `extra_info.index` |
| generic JSONL/CSV | `question/problem/prompt`   | `answer` or `ground_truth`                   | `id`, if present   |

A CSV file (`.csv`, or `.tsv` separated by tabs) is read with Python's csv module (RFC 4180 quoting: a cell with a
comma, quote or newline is quoted, a quote in it doubled); its first line names the columns and every cell is text.
A row without a gold answer is refused unless `require_answer=False` (a reward that reads no gold answer), and one
without a question unless `require_question=False` (a prompt template that names other columns); the answer is then
"" and the question "".

Integer answers are written canonically ("025" -> "25"). Text is cleaned of stray control characters: DAPO-17k has
escapes that were mangled by a JSON round trip ("\\frac" stored as form feed + "rac", "\\beta" as backspace + "eta");
those are turned back into the LaTeX command, and any other control character (PDF ligature debris such as
"fi\\x0cve") is dropped. A lone surrogate (a JSON `"\\ud800"` escape with no partner) is not text and cannot be
stored: it becomes U+FFFD. `meta` keeps `subject`, `level` and `source` where the file has them.

A file that is not UTF-8 (binary, UTF-16), nests JSON deeper than Python's parser allows, has a gold answer longer
than the verifier reads (`names.MAX_ANSWER_CHARS`, so never scorable), or gives some answers GSM8K's way (after
'####') and others without it (a solution taken whole could never be matched) is refused with one message naming it;
so is a CSV file without a header line, with a row of more or fewer cells than the header names, or with broken
quoting.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
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
    # the row's `prompt` column where it is a list of chat messages ({"role", "content", ...} each): sent as it is
    messages: list | None = field(default=None, hash=False, compare=False)
    origin: str = field(default="", hash=False, compare=False)  # where it came from, for messages: "'f.jsonl' line 3"


JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".tsv")  # comma- and tab-separated
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
_BYTE_ORDER_MARKS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}  # longest first: the UTF-32 LE mark starts like UTF-16 LE's
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


def describe_columns(row: dict) -> str:
    """A row's column names for a message, a nested field's as `outer.inner`."""
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


def _decode_text(path: Path, kind: str = "JSONL") -> str:
    """The file as text: UTF-8 (with or without a byte-order mark), else a QAEUserError that says what it is; `kind`
    ("JSONL", "CSV") names the format in it."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise QAEUserError(f"data: cannot read '{path}' ({e.strerror}). Check the path and its permissions.") from e
    for mark, encoding in _BYTE_ORDER_MARKS.items():
        if raw.startswith(mark):
            raise QAEUserError(
                f"data: '{path}' is {encoding} text; {kind} must be UTF-8. Convert it, e.g. "
                f"`iconv -f {encoding} -t UTF-8 '{path}' > fixed{path.suffix.lower()}`."
            )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        what = "a UTF-8 JSONL file (one JSON object per line)" if kind == "JSONL" else f"the {kind} file saved as UTF-8"
        raise QAEUserError(
            f"data: '{path}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, offset "
            f"{e.start}); is it a binary file, or saved in another encoding? Pass {what}, or a "
            "Parquet file."
        ) from e


def _parse_json(text: str, where: str) -> object:
    """json.loads with huge integers kept as digits; a QAEUserError naming `where` for anything unparseable."""
    try:
        return json.loads(text, parse_int=_json_int)
    except json.JSONDecodeError as e:
        raise QAEUserError(
            f"data: {where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            f"{text[:80]!r}. Each line must be one JSON object."
        ) from e
    except RecursionError as e:
        raise QAEUserError(
            f"data: {where} nests JSON arrays or objects too deeply to parse. A problem record is a "
            "flat object; fix or remove it."
        ) from e


def _read_rows(path: Path, require_question: bool = True) -> tuple[list[tuple[int, dict]], str]:
    """(line or row number counted from 1, record) pairs, and the word for the unit ("line" or "row")."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
            raise QAEUserError(f"data: cannot read '{path}' as Parquet ({e}). Pass a valid .parquet file.") from e
        return list(enumerate(records, start=1)), "row"
    if suffix in CSV_SUFFIXES:
        return _read_csv(path, _decode_text(path, "CSV"), require_question), "line"
    if suffix not in JSONL_SUFFIXES:
        raise QAEUserError(
            f"data: '{path}' has suffix '{path.suffix}'; expected one of "
            f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES + CSV_SUFFIXES)}. Rename the file or convert it to JSONL."
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


def _read_csv(path: Path, text: str, require_question: bool) -> list[tuple[int, dict]]:
    """(first line of the record, {column: cell}) for each row of a CSV file's text; its first line is the header."""
    reader = csv.reader(
        io.StringIO(text, newline=""), delimiter="\t" if path.suffix.lower() == ".tsv" else ",", strict=True
    )
    rows: list[tuple[int, dict]] = []
    try:
        header = next(reader, None)
        if header is None:
            return rows
        _check_csv_header(path, header, require_question)
        while True:
            start = reader.line_num + 1
            cells = next(reader, None)
            if cells is None:
                return rows
            if not cells:  # a blank line
                continue
            if len(cells) != len(header):
                raise QAEUserError(
                    f"data: '{path}' line {start} has {len(cells)} cell{'s' * (len(cells) != 1)}, but the header "
                    f"(line 1) names {len(header)} columns ({', '.join(header)}). Give each row one cell per column; "
                    'quote a cell that holds the separator or a newline ("a, b").'
                )
            rows.append((start, dict(zip(header, cells, strict=True))))
    except csv.Error as e:
        raise QAEUserError(
            f"data: '{path}' is not valid CSV ({e} at line {reader.line_num}). Quote a cell that "
            'holds a comma, quote or newline, doubling the quotes inside it ("say ""hi""").'
        ) from None


def _check_csv_header(path: Path, header: list[str], require_question: bool) -> None:
    """Refuse a header with an empty or repeated name, or (`require_question`) no question column: a file whose first
    line is data, not column names."""
    seen = set()
    for number, name in enumerate(header, start=1):
        if not name.strip():
            raise QAEUserError(
                f"data: '{path}' line 1 has an empty column name (column {number}). The first line "
                "of a CSV file names every column: name it, or remove the empty column."
            )
        if name in seen:
            raise QAEUserError(f"data: '{path}' line 1 names column '{name}' twice. Give each column its own name.")
        seen.add(name)
    if require_question and not any(c in header for c in QUESTION_COLUMNS):
        shown = ", ".join(h if len(h) <= 40 else h[:40] + "..." for h in header[:8])
        raise QAEUserError(
            f"data: '{path}' has no question column in its header (its first line: {shown}). A CSV file's first line "
            f"names its columns, e.g. `question,answer`: add that line, or name the problem's column one of: "
            f"{', '.join(QUESTION_COLUMNS)} (or write a --prompt-template of your columns)."
        )


def load_math_file(path: Path, require_answer: bool = True, require_question: bool = True) -> list[Problem]:
    """All problems in a JSONL, Parquet or CSV data file, in file order. Raises QAEUserError on anything unreadable.
    `require_answer`: refuse a row without a gold answer (else its answer is ""): for a reward that reads one.
    `require_question`: refuse a row without a question (else it is ""): for a prompt that shows it."""
    path = Path(path)
    check_path_names("data", path)
    if path.is_dir():
        raise QAEUserError(f"data: '{path}' is a directory. Pass the path of a JSONL, Parquet or CSV file in it.")
    if not path.is_file():
        raise QAEUserError(f"data: file '{path}' does not exist. Pass the path of a JSONL, Parquet or CSV file.")
    rows, unit = _read_rows(path, require_question)
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
        messages = _row_messages(row, where)
        question = _row_question(row, where, require_question)
        answer, given, marked = _row_answer(row, where, require_answer)
        if given is not None:  # (a row without an answer, where none is required, has no marker to check)
            (after_marker if marked else without_marker).append((number, given))
        prompt_id = _row_id(row, path, number)
        if prompt_id in seen_ids:
            raise QAEUserError(
                f"data: {where} repeats id '{prompt_id}' (first at {unit} {seen_ids[prompt_id]}). "
                "Ids must be unique within a file; fix or remove the id column."
            )
        seen_ids[prompt_id] = number
        problems.append(
            Problem(
                prompt_id=prompt_id,
                question=question,
                answer=answer,
                meta=_row_meta(row),
                columns=_row_columns(row),
                messages=messages,
                origin=where,
            )
        )
    _check_final_answer_markers(path, unit, len(rows), after_marker, without_marker)
    return problems


def _row_question(row: dict, where: str, required: bool = True) -> str:
    """The problem text of a file's row (`where` names it in errors): the first of QUESTION_COLUMNS present; ""
    for a row without one unless `required`."""
    question_column = next((c for c in QUESTION_COLUMNS if _get(row, c) is not None), None)
    question = _question_text(_get(row, question_column)) if question_column else ""
    given = _get(row, question_column) if question_column else None
    if not question and not required:
        return ""
    if (
        not question
        and given is not None
        and not isinstance(given, (str, list, tuple))
        and not hasattr(given, "tolist")
    ):
        kind = {bool: "true/false", int: "a number", float: "a number", dict: "an object"}.get(type(given), "not text")
        raise QAEUserError(
            f"data: {where} gives its question as {kind} ({question_column} = {given!r:.40}), not text. Write "
            'the problem as a string (a number too: "5").'
        )
    if not question:
        raise QAEUserError(
            f"data: {where} has no question (columns: {describe_columns(row)}). "
            f"Put the problem text in one of: {', '.join(QUESTION_COLUMNS)} "
            "(`prompt` may be a list of chat messages), or pass a --prompt-template of the columns it has."
        )
    return question


def _row_messages(row: dict, where: str) -> list | None:
    """The row's `prompt` column as chat messages where it is a list (TRL's conversational format, verl's), each
    with a text `content` and a `role`, the last not the assistant's; fields a Parquet file fills with null for the
    messages without them are left out. None where `prompt` is not a list."""
    value = row.get("prompt")
    if hasattr(value, "tolist") and not isinstance(value, dict):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    if not value:
        raise QAEUserError(
            f"data: {where} gives `prompt` as an empty list. Give chat messages "
            '([{"role": "user", "content": "..."}]) or the prompt as text.'
        )
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise QAEUserError(
                f"data: {where} gives `prompt` as a list, but item {number} is not a chat message "
                f"({clipped(repr(message), 60)}). Each item is "
                '{"role": "system" | "user" | "assistant", "content": "..."}.'
            )
        if not isinstance(message.get("content"), str):
            raise QAEUserError(
                f"data: {where}: chat message {number} has no text content "
                f"({clipped(repr(message), 60)}). Give each message's `content` as text."
            )
        messages.append({str(k): clean_text(v) if k == "content" else v for k, v in message.items() if v is not None})
    if messages[-1]["role"] == "assistant":
        raise QAEUserError(
            f"data: {where}: its chat messages end with an assistant message; the model writes the "
            "next assistant turn, so the last message is the user's. Drop the trailing answer (a "
            "reward reads the gold answer from its own column)."
        )
    return messages


def _row_answer(row: dict, where: str, required: bool = True) -> tuple[str, str | None, bool]:
    """The gold answer of a file's row (`where` names it in errors): the first of ANSWER_COLUMNS present and not
    empty, as the text a response must match; with the value as given, and whether it is given after a GSM8K
    '####' marker. A row without one is refused if `required`, else its answer is "" (given as None)."""
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
                    "row."
                ) from None
            if answer:
                break
    if not answer and not required:
        return "", None, False
    if not answer:
        raise QAEUserError(
            f"data: {where} has no answer (columns: {describe_columns(row)}). "
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
    meta = {
        key: replace_lone_surrogates(row[key]) if isinstance(row[key], str) else row[key]
        for key in ("subject", "level")
        if row.get(key) is not None
    }
    source = next((_get(row, c) for c in SOURCE_COLUMNS if _get(row, c) is not None), None)
    if source is not None:
        meta["source"] = replace_lone_surrogates(str(source))
    return meta


def _check_final_answer_markers(
    path: Path, unit: str, n_rows: int, after_marker: list[tuple[int, str]], without_marker: list[tuple[int, str]]
) -> None:
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
