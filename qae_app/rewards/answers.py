"""The final answer in a policy's response: what the rewards (qae_app/rewards/builtin_verifiers.py) score and the math
verifier's workers (qae_app/rewards/verifier_pool.py) check.

Pure string work, linear time on any input: extraction runs in the trainer, outside any verifier deadline, so a
hostile response (deep nesting, thousands of unterminated boxes, a multi-megabyte text) costs milliseconds.
"""

from __future__ import annotations

import re

from qae_app.core.names import CHAIN_ANSWER_MARKER

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"[{}]")
_SPACE_FORM_RE = re.compile(r"[ \t]+([^\s$]+)")  # "\boxed 5"
_FINAL_LINE_RE = re.compile(r"answer\s*(?:is|:)|####", re.IGNORECASE)
INTEGER_RE = re.compile(r"-?\d+")  # an integer answer as written: an optional minus, digits


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each '{' -> position of its matching '}' (unmatched ones are absent). One pass, no recursion."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for m in _BRACE_RE.finditer(text):
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _clean_final(value: str) -> str | None:
    value = value.strip().strip("*").strip().rstrip(".").strip()
    if value.startswith("$") and value.endswith("$") and len(value) > 1:
        value = value.strip("$").strip().rstrip(".").strip()
    return value or None


# Only the end of a response can hold its final answer: a box followed by more than this many characters is not
# final. Bounding the scan keeps extraction (which runs in the trainer, outside any verifier deadline) at a few
# milliseconds even on a multi-megabyte response.
FINAL_ANSWER_WINDOW = 20_000


def extract_answer(text: str) -> str | None:
    """The final answer in a response: the content of the last complete `\\boxed{...}` / `\\fbox{...}` /
    `\\boxed X`, else what follows the last "answer is" / "Answer:" / "####" on its line; None if neither.

    Only the last `FINAL_ANSWER_WINDOW` characters are read. Linear time in that, whatever the text (deep nesting,
    unterminated boxes, huge numbers).
    """
    text = text[-FINAL_ANSWER_WINDOW:]
    boxes = list(_BOX_RE.finditer(text))
    if boxes:
        pairs = _matching_braces(text)
        for box in reversed(boxes):  # the last box that is complete and non-empty
            start = box.end()
            while start < len(text) and text[start] == " ":
                start += 1
            if start < len(text) and text[start] == "{":
                end = pairs.get(start)
                if end is not None and text[start + 1 : end].strip():
                    return text[start + 1 : end].strip()
            else:
                m = _SPACE_FORM_RE.match(text, box.end())
                if m:
                    return m.group(1)
    matches = list(_FINAL_LINE_RE.finditer(text))
    last = matches[-1] if matches else None
    if last is None:
        return None
    line_end = text.find("\n", last.end())
    return _clean_final(text[last.end() : line_end if line_end >= 0 else len(text)].lstrip(" \t:"))


def chain_final_answer(response: str) -> str | None:
    """The final answer of a chain response: the text after the last " so " (`names.CHAIN_ANSWER_MARKER`),
    stripped; None without the marker."""
    _, marker, final = response.rpartition(CHAIN_ANSWER_MARKER)
    return final.strip() if marker else None


def check_lengths(responses: list[str], answers: list[str]) -> None:
    """A reward scores one response against one gold answer: refuse lists of different lengths."""
    if len(responses) != len(answers):
        raise ValueError(f"got {len(responses)} responses but {len(answers)} answers; pass one answer per response")


# An instruct model answers a plain question in words ("The answer is 14.", "7 + 7 = 14", "14"), rarely with a box:
# the number it ends on is its answer, unless it wrote the `Answer: N` line a prompt may ask for.
_ANSWER_LINE_RE = re.compile(r"^[ \t*#]*answer[ \t*]*:[ \t*$]*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE | re.MULTILINE)
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 14, -3, 1,234, 2.5: a comma only between digit triples


def final_number_answer(text: str) -> str | None:
    """The answer of an instruct model's plain-language response: the number on the last `Answer: N` line when it
    wrote one, else the last number in the response; commas between digit triples dropped (`1,234` -> `1234`), a
    trailing sentence period not taken for a decimal point; None when the response holds no number.

    Only the last `FINAL_ANSWER_WINDOW` characters are read; linear time (regular expressions without nesting)."""
    text = text[-FINAL_ANSWER_WINDOW:]
    lines = list(_ANSWER_LINE_RE.finditer(text))
    if lines:
        return lines[-1].group(1).replace(",", "")
    matches = list(_NUMBER_RE.finditer(text))
    last = matches[-1] if matches else None
    return last.group(0).replace(",", "") if last is not None else None
