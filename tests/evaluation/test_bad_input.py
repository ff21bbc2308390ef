"""Bad values of `qae eval`'s options, which share the training options' ranges: one message that names the
option and the value, exit code 2, and nothing written in the runs folder. The check is tests/bad_input.py's."""

import pytest

from tests.bad_input import HUGE, assert_one_message_exit_2_and_nothing_written

# (command line, what the message must contain: the option or file, and the value)
BAD_VALUES = [
    # qae eval shares the training options' ranges
    (["eval", "--temperature", "1e-300"], "temperature: 1e-300 is less than 0.01"),
    (["eval", "--verify-timeout-s", "nan"], "verify-timeout-s: nan is not a finite number"),
    (["eval", "--verify-timeout-s", "inf"], "verify-timeout-s: inf is not a finite number"),
    (["eval", "--seed", "-1"], "seed: -1 is less than 0"),
    (["eval", "--samples", HUGE], f"samples: {HUGE} is more than 2,147,483,647"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[" ".join(a)[:60] for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    assert_one_message_exit_2_and_nothing_written(tmp_path, args, message)
