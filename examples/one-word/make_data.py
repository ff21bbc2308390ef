"""Write data.jsonl: the prompts of the one-word task, one JSON object a line.

Each row asks for one word that starts with a given letter, in one of several phrasings:
`{"id": "b-03", "question": "Give me one word that begins with B.", "letter": "b", "answer": "b"}`.
`letter` is the column the reward reads (reward.py); `answer` repeats it because a data file needs a gold-answer
column today. Every (phrasing, letter) pair appears once, in a fixed order, so the file never changes:

    python examples/one-word/make_data.py    # rewrites examples/one-word/data.jsonl
"""

import json
from pathlib import Path

# 22 letters: q, x, y and z start too few everyday words for the task to be fair
LETTERS = "abcdefghijklmnoprstuvw"
PHRASINGS = (
    "Reply with a single word that starts with the letter {L}.",
    "Give me one word that begins with {L}.",
    "Say one word starting with the letter {L}, and nothing else.",
    "Write a single English word whose first letter is {L}.",
    "Think of a word that starts with {L}. Reply with only that word.",
    "One word, beginning with the letter {L}, please.",
    "Answer with exactly one word: a word that starts with {L}.",
    "Which word starting with {L} comes to mind first? Reply with the word only.",
    "Respond with just one word that has {L} as its first letter.",
    "Type a single word beginning with the letter {L}. No sentences.",
    "Name any word that starts with the letter {L}. One word only.",
    "I need one word starting with {L}. Just the word, nothing more.",
)


def rows() -> list[dict]:
    return [
        {
            "id": f"{letter}-{i:02d}",
            "question": phrasing.replace("{L}", letter.upper()),
            "letter": letter,
            "answer": letter,
        }
        for letter in LETTERS
        for i, phrasing in enumerate(PHRASINGS)
    ]


if __name__ == "__main__":
    path = Path(__file__).with_name("data.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {len(rows())} rows to {path}")
