"""The one-word task's reward: 1.0 for a reply that is one word starting with the row's letter, else 0.0.

TRL's reward signature, so it works as it is with `qae train --reward examples/one-word/reward.py:one_word` and with
TRL's GRPOTrainer (`reward_funcs=[one_word]`): `completions` are the sampled responses (strings, or chat messages
whose last one is the reply), `prompts` are not read, and every column of the data row comes as a keyword argument
holding one value per completion; this reward reads `letter`. It never returns None: the rule is always decidable.

The rule, in order: strip whitespace; then one pair of enclosing quotes or `**`; then one trailing `.` or `!`; what
is left must be letters only (A-Z, a-z), at least 3 of them, the first one the row's letter (either case).
So "Banana", "banana." and "**Bread**" score 1 for letter b; "B", "Be" (under 3 letters), "Big cat" (two words),
"B-52" and "Sure! Banana" score 0. The rule checks the form, not a dictionary: "Bzzt" scores 1.
"""

import re

_WORD = re.compile(r"[A-Za-z]{3,}")
_WRAPPERS = ('"', "'", "**", "*", "`")


def reply_text(completion) -> str:
    """The reply as text: a string as it is, or the content of the last message of a chat completion."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def single_word(text: str) -> str | None:
    """The one word the reply consists of, or None when it is not exactly one word of letters."""
    text = text.strip()
    for mark in _WRAPPERS:
        if len(text) > 2 * len(mark) and text.startswith(mark) and text.endswith(mark):
            text = text[len(mark) : -len(mark)].strip()
            break
    if text[-1:] in (".", "!"):
        text = text[:-1]
    return text if _WORD.fullmatch(text) else None


def one_word(completions: list, prompts: list | None = None, letter: list[str] | None = None, **columns) -> list[float]:
    """1.0 when a completion is one word of 3+ letters that starts with its row's `letter`, else 0.0."""
    if letter is None:
        raise ValueError("one_word reads the data column 'letter'; the data has no such column")
    if len(letter) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(letter)} letters")
    scores = []
    for completion, wanted in zip(completions, letter, strict=True):
        word = single_word(reply_text(completion))
        scores.append(1.0 if word is not None and word[0].lower() == str(wanted).strip().lower() else 0.0)
    return scores
