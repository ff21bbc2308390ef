"""Bad values only the commands check (qae_app/cli): a sweep's size and grid, the inspecting commands' options, a RUN
argument named as such: one message that names the option and the value, exit code 2, nothing written in the runs
folder, and a sweep refused before it announces its runs. The check is tests/bad_input.py's."""

import pytest

from qae_app.cli.sweep import MAX_SWEEP_RUNS
from tests.bad_input import HUGE, assert_one_message_exit_2_and_nothing_written

# (command line, what the message must contain: the option or file, and the value)
BAD_VALUES = [
    # issue 28: sizes bounded before any work
    (["sweep", "--seeds", "1000000"], f"seeds: 1000000 makes 1,000,000 runs, more than the {MAX_SWEEP_RUNS}"),
    (["sweep", "--seeds", HUGE], f"seeds: {HUGE} makes"),
    (["sweep", "--estimator", "qae,grpo", "--k", "0.1,0.2,0.3", "--seeds", "200"], "seeds: 200 makes 800 runs"),
    (["sweep", "--group-size", "1000000"], "group-size x prompts-per-step: 1,000,000 x 8"),
    # issue 28: nonsense that was accepted silently
    (["sweep", "--k", "0.4,0.40"], "k: '0.4,0.40' gives the same K twice (0.4 and 0.40)"),
    (["sweep", "--name", ""], "name: '' is not a plain name"),
    (["sweep", "--max-gen-batches", "3"], "max-gen-batches: 3 acts only with --dynamic-sampling"),
    # the inspecting commands
    (["show", "some-run", "--every", "1e30"], "Invalid value for '--every': Input should be a valid integer"),
    (["show", "some-run", "--every", "-1"], "every: -1 is negative. Use 0"),
    (["rollouts", "some-run", "--limit", "-1"], "limit: -1 shows nothing. Use a positive number of responses"),
    (["rollouts", "some-run", "--limit", "0"], "limit: 0 shows nothing. Use a positive number of responses"),
    # each message names the option the user gave, with an example of its own kind
    (["sweep", "--name", "a/b"], "error: name: 'a/b' is not a plain name"),
    (["sweep", "--k", ","], "k: ',' names nothing. Give a comma-separated list, e.g. 0.3,0.4"),
    (["sweep", "--estimator", ","], "estimator: ',' names nothing. Give a comma-separated list, e.g. qae,grpo"),
    (["sweep", "--parallel", "0"], "parallel: 0. Use 1 to"),
    # a RUN argument is named as such, not as --run-name
    (["show", "../base"], "error: run: '../base' is not a plain name"),
    (["rollouts", "../base"], "error: run: '../base' is not a plain name"),
    (["compare", "../base"], "error: run: '../base' is not a plain name"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[" ".join(a)[:60] for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    assert_one_message_exit_2_and_nothing_written(tmp_path, args, message)
