"""The reward registry: specs as the user writes them, weighted totals computed by hand, and user functions run in the
verifier's worker processes, each of their failures one clear message."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import Problem
from qae_app.rewards.builtin_verifiers import BuiltinVerifier, shape_rewards
from qae_app.rewards.registry import RewardError, RewardSet, data_columns
from qae_app.rewards.specs import (
    check_named_again,
    check_reward_options,
    parse_reward_spec,
    parse_reward_specs,
    parse_reward_weights,
)

USER_REWARDS = """
import os, time
from pathlib import Path

Path(MARKER).write_text(str(os.getpid()))  # who imported this file

def exact(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def columns_seen(completions, prompts, answer, step, tests, **kwargs):
    # one completion per call, every column a list aligned with completions, step an int
    assert len(completions) == len(prompts) == len(answer) == len(tests) == 1, (completions, tests)
    return [len(tests[0]) + step + (0.5 if prompts[0].endswith("=") else 0.0)]

def only_completions(completions):
    return [float(len(completions[0]))]

def parts(completions, **kwargs):
    return {"short": [1.0 if len(c) <= 2 else 0.0 for c in completions], "half": [0.5] * len(completions)}

def continuous(completions, **kwargs):
    return [min(1.0, len(c) / 4) for c in completions]

def unsure(completions, **kwargs):
    return [None if c == "?" else 1 for c in completions]

def boom(completions, **kwargs):
    return [helper(c) for c in completions]

def helper(text):
    raise ValueError(f"cannot score {text!r}")

def too_many(completions, **kwargs):
    return [1.0, 0.0]

def not_a_list(completions, **kwargs):
    return 1.0

def nan(completions, **kwargs):
    return [float("nan")]

def infinite(completions, **kwargs):
    return [float("-inf")]

def words(completions, **kwargs):
    return ["correct"]

def needs_tests(completions, unit_tests):
    return [1.0]

def slow_on_some(completions, **kwargs):
    if completions[0] == "slow":
        time.sleep(60)
    return [1.0]

def hangs(completions, **kwargs):
    while True:
        time.sleep(1)

def huge(completions, **kwargs):
    return [1e308]
"""

PROBLEMS = [
    Problem("p1", "1+1=", "2", columns={"question": "1+1=", "tests": ["a", "b"]}),
    Problem("p2", "2+2=", "4", columns={"question": "2+2=", "tests": ["c"]}),
]


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    path = folder / "my_rewards.py"
    path.write_text(textwrap.dedent(USER_REWARDS).replace("MARKER", repr(str(folder / "imported-by"))))
    return path


def user_set(path: Path, *functions: str, weights=None, timeout_s: float = 3.0) -> RewardSet:
    return RewardSet(parse_reward_specs([f"{path}:{fn}" for fn in functions]), weights, timeout_s)


def score(rewards: RewardSet, completions: list[str], step: int = 0):
    problems = [PROBLEMS[i % 2] for i in range(len(completions))]
    rewards.check(data_columns(PROBLEMS))
    return rewards.score(completions, [p.question for p in problems], problems, step)


# ---------------------------------------------------------------------------------------------------------------
# specs


@pytest.mark.parametrize(
    "text, kind, target, function",
    [
        ("math", "builtin", "math", None),
        ("exact_int", "builtin", "exact_int", None),
        ("rewards.py:score", "file", "rewards.py", "score"),
        ("tasks/fmt/r.py:check_format", "file", "tasks/fmt/r.py", "check_format"),
        ("C:\\work\\r.py:score", "file", "C:\\work\\r.py", "score"),  # the function is after the last colon
        ("mypkg.rewards:score", "module", "mypkg.rewards", "score"),
    ],
)
def test_a_spec_names_a_builtin_a_file_or_a_module(text, kind, target, function):
    spec = parse_reward_spec(text)
    assert (spec.kind, spec.target, spec.function) == (kind, target, function)
    assert spec.name == (function or target)


@pytest.mark.parametrize(
    "text, message",
    [
        ("mth", "'mth' is not a built-in reward. Pass a built-in reward (exact_int, chain_final, math, final_number)"),
        ("r.py:", "names no function after the last ':'"),
        ("r.py:2fast", "'2fast' is not a Python name"),
        ("my-pkg:score", "'my-pkg' is neither a .py file nor a dotted module name"),
    ],
)
def test_a_bad_spec_is_named_with_the_forms_it_may_take(text, message):
    with pytest.raises(QAEUserError, match="^reward: ") as err:
        parse_reward_spec(text)
    assert message in str(err.value)


def test_weights_are_one_finite_number_per_reward():
    assert parse_reward_weights(None, 2) == (1.0, 1.0)
    assert parse_reward_weights("1, 0.5,-2", 3) == (1.0, 0.5, -2.0)
    for text, message in (
        ("1,x", "not a comma list of numbers"),
        ("1,nan", "not a finite number"),
        ("1", "1 weight (1) for 2 rewards"),
        ("1e308,1e308", "sum to more than a number holds"),
    ):  # (issue 48 L5: an inf total)
        with pytest.raises(QAEUserError, match="^reward-weights: ") as err:
            parse_reward_weights(text, 2)
        assert message in str(err.value)
    with pytest.raises(QAEUserError, match="reward-weights: 1,2 weighs the rewards of --reward, and none is given"):
        check_reward_options(None, "1,2")
    with pytest.raises(QAEUserError, match="two rewards are named score"):
        parse_reward_specs(["a.py:score", "b.py:score"])


def test_a_resume_names_reward_code_again_before_any_is_imported():
    check_named_again(["math"], None, "r")  # a built-in runs no user code: nothing to name
    check_named_again(["r.py:score"], ["r.py:score"], "r")
    with pytest.raises(
        QAEUserError,
        match="run 'r' scores with reward code \\(r.py:score\\). A run folder never runs "
        "code by itself: .*qae train --resume r --reward math --reward r.py:score",
    ):
        check_named_again(["math", "r.py:score"], None, "r")
    with pytest.raises(
        QAEUserError, match="qae train --resume r --reward math --reward r.py:score --reward-weights 1,0.5`"
    ):
        check_named_again(["math", "r.py:score"], None, "r", "1,0.5")


def test_a_missing_reward_file_is_named_before_any_worker_starts(tmp_path):
    with pytest.raises(QAEUserError, match=f"reward: {tmp_path}/none.py:f: {tmp_path}/none.py does not exist"):
        RewardSet(parse_reward_specs([f"{tmp_path}/none.py:f"]))


# ---------------------------------------------------------------------------------------------------------------
# totals, components, correct: by hand


def test_the_default_reward_is_the_verifier_shaped_as_before_bit_for_bit():
    """One built-in reward, weight 1: the totals are shape_rewards' rewards before the penalty, for 0/1 and -1/1."""
    responses, answers = ["2", " 4 ", "5", "x"], ["2", "4", "4", "4"]
    problems = [Problem(f"p{i}", "q", a) for i, a in enumerate(answers)]
    for values in ((0.0, 1.0), (-1.0, 1.0)):
        with RewardSet.of(None, None, "exact_int", values=values) as rewards, BuiltinVerifier("exact_int") as verifier:
            totals, components = rewards.score(responses, ["q"] * 4, problems)
            shaped, correct = shape_rewards(verifier(responses, answers), [1] * 4, values, 8)
        assert totals == shaped and [type(t) for t in totals] == [float] * 4
        assert rewards.correct(components) == correct == [True, True, False, False]
        assert components == {"exact_int": [1.0, 1.0, 0.0, 0.0]}


def test_a_weighted_sum_of_a_builtin_a_function_and_named_parts(rewards_file):
    """exact_int (w 1) + parts (w 2: short and half, each weighted 2): '2' for gold 2 scores 1 + 2 * (1 + 0.5) = 4;
    '123' for gold 4 scores 0 + 2 * (0 + 0.5) = 1."""
    specs = parse_reward_specs(["exact_int", f"{rewards_file}:parts"])
    with RewardSet(specs, (1.0, 2.0)) as rewards:
        totals, components = score(rewards, ["2", "123"])
        assert totals == [4.0, 1.0]
        assert components == {"exact_int": [1.0, 0.0], "short": [1.0, 0.0], "half": [0.5, 0.5]}
        # full marks: every positive-weight component at 1 or more; half's 0.5 keeps both from it
        assert rewards.correct(components) == [False, False]
        assert rewards.verified(components) == [True, True]


def test_correct_means_full_marks_for_a_continuous_reward_and_none_is_unverified(rewards_file):
    with user_set(rewards_file, "continuous") as rewards:
        totals, components = score(rewards, ["a", "abcd", "abcdefgh"])
        assert totals == [0.25, 1.0, 1.0]
        assert rewards.correct(components) == [False, True, True]
    with user_set(rewards_file, "unsure") as rewards:
        totals, components = score(rewards, ["?", "2"])
        assert components == {"unsure": [None, 1.0]} and totals == [0.0, 1.0]  # None counts 0 in the sum
        assert rewards.verified(components) == [False, True] and rewards.correct(components) == [False, True]


def test_a_function_gets_its_row_columns_answer_and_step_as_trl_passes_them(rewards_file):
    """columns_seen returns len(tests) + step + 0.5 for a prompt ending in '=': p1 has 2 tests, p2 has 1."""
    with user_set(rewards_file, "columns_seen", "only_completions") as rewards:
        totals, components = score(rewards, ["a", "bb"], step=7)
    assert components == {"columns_seen": [9.5, 8.5], "only_completions": [1.0, 2.0]}
    assert totals == [10.5, 10.5]


def test_user_code_runs_in_a_worker_process_never_in_this_one(rewards_file):
    marker = rewards_file.parent / "imported-by"
    marker.unlink(missing_ok=True)
    with user_set(rewards_file, "exact") as rewards:
        totals, _ = score(rewards, ["2", "3"])
        workers = rewards.pool.worker_pids()
    assert totals == [1.0, 0.0]
    assert int(marker.read_text()) in workers and int(marker.read_text()) != os.getpid()
    assert not [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(rewards_file)]


# ---------------------------------------------------------------------------------------------------------------
# failures: one message each


@pytest.mark.parametrize(
    "function, message",
    [
        ("too_many", "returned 2 scores for 1 completion: [1.0, 0.0]. Return one score per completion"),
        ("not_a_list", "returned 1.0 (a float) where a list of scores goes"),
        ("nan", "returned nan as a score: a score must be a finite number, or None"),
        ("infinite", "returned -inf as a score: a score must be a finite number"),
        ("words", "returned 'correct' (a str) as a score: a score is a number (float, int or bool), or None"),
    ],
)
def test_a_bad_return_value_is_one_message_naming_it(rewards_file, function, message):
    with user_set(rewards_file, function) as rewards, pytest.raises(RewardError) as err:
        score(rewards, ["2"], step=3)
    assert str(err.value).startswith(
        f"reward: {rewards_file}:{function} failed at step 3 on response 1 of 1 ('2'): it "
    )
    assert message in str(err.value)


def test_an_exception_shows_the_users_own_traceback_once(rewards_file):
    with user_set(rewards_file, "boom") as rewards, pytest.raises(RewardError) as err:
        score(rewards, ["2", "3"])
    text = str(err.value)
    assert text.count("Traceback (most recent call last)") == 1
    assert f'File "{rewards_file}", line' in text and "in helper" in text
    assert text.rstrip().endswith("ValueError: cannot score '2'")
    assert "qae_app" not in text  # qae's own frames are left out


def test_a_column_the_function_asks_for_and_the_data_lacks_is_named(rewards_file):
    with user_set(rewards_file, "needs_tests") as rewards, pytest.raises(QAEUserError) as err:
        rewards.check(data_columns(PROBLEMS))
    assert str(err.value) == (
        f"reward: {rewards_file}:needs_tests: the function asks for 'unit_tests', which the data does not have. The "
        "data's columns: question, tests; every reward also gets completions, prompts, completion_ids, answer, step. "
        "Give the parameter a default, take **kwargs, or use data with that column."
    )


def test_a_function_that_is_not_in_the_file_is_named_with_those_that_are(rewards_file):
    with (
        user_set(rewards_file, "scroe") as rewards,
        pytest.raises(RewardError, match="has no function 'scroe' \\(its functions: boom, "),
    ):
        rewards.check(data_columns(PROBLEMS))


def test_a_response_past_the_deadline_scores_none_and_is_counted(rewards_file):
    with user_set(rewards_file, "slow_on_some", timeout_s=0.6) as rewards:
        totals, components = score(rewards, ["fast", "slow", "fast"], step=2)
        warning = rewards.timeout_warning(2, 3)
    assert components == {"slow_on_some": [1.0, None, 1.0]}
    assert warning["kind"] == "reward_timeout"
    assert (
        f"{rewards_file}:slow_on_some: 1 of 3" in warning["message"]
        and "--verify-timeout-s 0.6 s" in warning["message"]
    )


def test_a_function_that_hangs_on_every_response_stops_with_one_message(rewards_file):
    with user_set(rewards_file, "hangs", timeout_s=0.3) as rewards, pytest.raises(RewardError) as err:
        score(rewards, ["a", "b"], step=4)
    assert str(err.value) == (
        f"reward: {rewards_file}:hangs scored none of the 2 responses of step 4 within "
        "--verify-timeout-s 0.3 s: it hangs, or is far slower than that. Fix it (or raise "
        "--verify-timeout-s) and resume the run."
    )


def test_a_file_that_cannot_be_imported_is_refused_with_its_error_before_scoring(tmp_path):
    (tmp_path / "broken.py").write_text("def score(completions, **kwargs)\n    return [1.0]\n")
    with RewardSet(parse_reward_specs([f"{tmp_path}/broken.py:score"])) as rewards, pytest.raises(RewardError) as err:
        rewards.check(data_columns(PROBLEMS))
    text = str(err.value)
    assert text.startswith(f"reward: {tmp_path}/broken.py:score: importing it raised:\n")
    assert f'File "{tmp_path}/broken.py", line 1' in text and "SyntaxError: expected ':'" in text
    with (
        RewardSet(parse_reward_specs(["no_such_module.rewards:score"])) as rewards,
        pytest.raises(
            RewardError,
            match="ModuleNotFoundError: No module named 'no_such_module'\n\\(a module must be importable here",
        ),
    ):
        rewards.check(data_columns(PROBLEMS))


def test_a_weighted_sum_past_what_a_number_holds_is_refused_not_stored(rewards_file):
    """Issue 48 L5: finite weights times finite scores can still sum to infinity; stored, its advantages and loss were
    NULL. The sum is refused with the components and weights that made it."""
    with user_set(rewards_file, "huge", "exact", weights=(2.0, 1.0)) as rewards, pytest.raises(RewardError) as err:
        score(rewards, ["2", "4"])
    assert str(err.value).startswith(
        "reward-weights: response 1's weighted sum of its rewards is inf (huge 1e+308 "
        "x 2, exact 1.0 x 1), past what a number holds."
    )


def test_a_failing_library_function_is_not_called_the_users_to_fix(tmp_path):
    """A run stopped by an installed module's function (trl.rewards:...) is told to check what the function was given,
    not to fix the library, and the command it offers carries every --reward and the --reward-weights. Checked to
    fail before: "Once the function is fixed" for TRL's own function, and no --reward-weights in the command."""
    from types import SimpleNamespace

    from qae_app.cli.main import _with_reward_resume
    from qae_app.config import TrainConfig
    from qae_app.rewards.registry import RewardError
    from qae_app.rewards.specs import parse_reward_spec

    rewards = ["trl.rewards:think_format_reward", "math"]
    trainer = SimpleNamespace(
        runs_dir=tmp_path,
        run_id="r",
        state=SimpleNamespace(step=2),
        cfg=TrainConfig(reward=rewards, reward_weights="1,0.5"),
    )
    failed = RewardError("reward: trl.rewards:think_format_reward failed at step 3", parse_reward_spec(rewards[0]))
    said = str(_with_reward_resume(trainer, failed))
    assert "is fixed" not in said and "trl.rewards is an installed module" in said
    assert (
        f"continue it with: qae train --resume r --reward trl.rewards:think_format_reward --reward math "
        f"--reward-weights 1,0.5 --runs-dir {tmp_path} (add"
    ) in said
