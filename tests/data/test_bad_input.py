"""Bad data files and benchmark names (qae_app/data), given to `qae train --data / --eval-bench` and `qae eval
--bench`: one message that names the option and the file (and where in it), exit code 2, and nothing written in the runs
folder. The check and the bad files `{d}` names are tests/bad_input.py's."""

import pytest

from tests.bad_input import assert_one_message_exit_2_and_nothing_written

# (command line, what the message must contain: the option or file, and the value; {{ }} are braces, as `{d}` is
# filled in by str.format)
BAD_VALUES = [
    # data files
    (["train", "--data", "{d}/binary.jsonl"], "binary.jsonl' is not UTF-8 text (byte 0x80 at line 2, offset 128)"),
    (["train", "--data", "{d}/utf16.jsonl"], "utf16.jsonl' is UTF-16 text; JSONL must be UTF-8"),
    (["train", "--data", "{d}/deep.jsonl"], "deep.jsonl' line 1 nests JSON arrays or objects too deeply"),
    (["train", "--data", "{d}/bigint.jsonl"], "bigint.jsonl' line 1 has a 5,000-character answer (7777"),
    (["train", "--data", "{d}/bigint_text.jsonl"], "bigint_text.jsonl' line 1 has a 5,000-character answer (7777"),
    (["train", "--data", "{d}/folder.jsonl"], "folder.jsonl' is a directory"),
    (
        ["train", "--data", "{d}/big_prompt.jsonl"],
        "data: prompt 'big_prompt-1' is 1,000,073 tokens, and with "
        "--max-new-tokens 8 it needs 1,000,081 positions, but the model's "
        "context is 128",
    ),
    # issue 28: nonsense that was accepted silently
    (["train", "--data", "{d}/no_heldout.jsonl", "--eval-every", "1"], "eval-every: 1, but"),
    (["train", "--data", "{d}/nan_answer.jsonl"], "nan_answer.jsonl' line 2 gives its answer as NaN"),
    (["train", "--data", "{d}/inf_answer.jsonl"], "inf_answer.jsonl' line 1 gives its answer as Infinity"),
    (["train", "--data", "{d}/" + "x" * 300 + ".jsonl"], "a name over 255 bytes, longer than the file system"),
    # each message names the option the user gave, with an example of its own kind
    (["train", "--eval-bench", "nofile.jsonl"], "eval-bench: 'nofile.jsonl' is neither a built-in task"),
    (["eval", "--bench", "nofile.jsonl"], "bench: 'nofile.jsonl' is neither a built-in task"),
    (["train", "--data", "nofile.jsonl"], "data: 'nofile.jsonl' is neither a built-in task"),
    (
        ["train", "--data", "{d}/number_question.jsonl"],
        "line 1 gives its question as a number (question = 5), not text",
    ),
    (["eval", "--bench", "{d}/binary.jsonl"], "bench: '{d}/binary.jsonl' is not UTF-8 text"),  # the file's error too
    (["train", "--eval-bench", "{d}/binary.jsonl"], "eval-bench: '{d}/binary.jsonl' is not UTF-8 text"),
    # issue 37: CSV files, templates and system prompts
    (["train", "--data", "{d}/ragged.csv"], "ragged.csv' line 3 has 3 cells, but the header (line 1) names 2 columns"),
    (
        ["train", "--data", "{d}/headless.csv"],
        "headless.csv' has no question column in its header (its first line: 1+1?, 2)",
    ),
    (["eval", "--bench", "{d}/ragged.csv"], "bench: '{d}/ragged.csv' line 3 has 3 cells"),
    (
        ["train", "--data", "{d}/hint.jsonl", "--prompt-template", "{{question}} {{hint}}"],
        "prompt-template: '{{question}} {{hint}}' names column 'hint', but '{d}/hint.jsonl' line 2 has no such column",
    ),
    (["train", "--data", "{d}/hint.jsonl", "--prompt-template", "Think."], "prompt-template: 'Think.' names no column"),
    (["eval", "--bench", "{d}/hint.jsonl", "--prompt-template", "Think."], "prompt-template: 'Think.' names no column"),
    (
        ["train", "--data", "{d}/hints.jsonl", "--eval-bench", "{d}/hint.jsonl", "--prompt-template", "{{hint}}"],
        "prompt-template: '{{hint}}' names column 'hint', but '{d}/hint.jsonl' line 2 has no such column",
    ),
    (
        ["train", "--data", "{d}/chat_system.jsonl", "--system-prompt", "Be brief."],
        "system-prompt: '{d}/chat_system.jsonl' line 1 has a system message of its own ('Be kind.')",
    ),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[" ".join(a)[:60] for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    assert_one_message_exit_2_and_nothing_written(tmp_path, args, message)
