"""Rewards: answer extraction, the exact_int check, and math-verify in a pool with a hard deadline per item.

Every pool here runs real math-verify in real worker processes. Pools that must prove math-verify itself gets it right
use `shortcuts=False`, so no answer is settled by string comparison before math-verify sees it.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.data.datasets import load_math_file
from qae_app.rewards.answers import FINAL_ANSWER_WINDOW, extract_answer
from qae_app.rewards.builtin_verifiers import REWARD_FUNCTIONS, BuiltinVerifier, exact_int_reward, get_reward_function
from qae_app.rewards.verifier_pool import MathVerifierPool, ScoringInterrupted

MATH_DATA = Path(os.environ.get("QAE_MATH_DATA") or Path(__file__).resolve().parents[3] / "shared/data/math")
needs_data = pytest.mark.skipif(not MATH_DATA.is_dir(), reason=f"math data folder {MATH_DATA} not found")

# MATH-500 gold answers that do not verify against themselves when written as `\boxed{<gold>}`: none with
# math-verify 0.9.0 (checked on all 500). Add "unique_id": "reason" here if a math-verify upgrade breaks some.
MATH500_KNOWN_FAILURES: dict[str, str] = {}

# math-verify hangs on this (sympy tries to evaluate the power tower); it never returns, so it really times out.
NEVER_RETURNS = "\\boxed{9^{9^{9^{9}}}}"
ANOTHER_TOWER = "\\boxed{8^{9^{9^{9}}}}"


def as_model_would_write(gold: str) -> str:
    return f"Working through it step by step, we find the value. So the answer is \\boxed{{{gold}}}."


@pytest.fixture(scope="module")
def strict_pool():
    """math-verify decides every item: no string shortcuts, no length bound."""
    with MathVerifierPool(timeout_s=3.0, num_workers=2, shortcuts=False, max_answer_chars=None) as pool:
        yield pool


# ---------------------------------------------------------------------------------------------------------------
# extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # balanced braces inside
        ("\\boxed{\\boxed{7}}", "7"),
        ("$\\fbox{12}$", "12"),
        ("hence \\boxed 5 is it", "5"),
        ("\\boxed {3}", "3"),
        ("\\boxed{8} and then an unterminated \\boxed{9", "8"),  # the last *complete* box
        ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("blah\nAnswer: 17\n", "17"),
        ("the answer is 1, no wait\nthe final answer is 2.", "2"),
        ("step\n#### 1,000", "1,000"),
        ("no final answer here", None),
        ("\\boxed{}", None),
        ("\\boxedx{3}", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "hostile, expected",
    [
        ("x" * 100_000 + "\\boxed{1}", "1"),
        ("{" * 5000 + "\\boxed{" + "{" * 5000 + "1" + "}" * 4000, None),  # the box never closes
        ("\\boxed{" * 20_000, None),  # thousands of unterminated boxes: each must not rescan the rest
        ("answer is " * 20_000, None),
        ("\\boxed{" + "9" * 10_000 + "}", "9" * 10_000),
        ("}" * 50_000 + "{" * 50_000, None),
    ],
)
def test_extract_answer_on_hostile_text(hostile, expected):
    """What each hostile text gives. How long it takes is measured by `python bench/bench_verifier.py` (slowest of
    these 4.0 ms on 2 cores; 10x more nested boxes cost about 10x, not 100x), not bounded here."""
    assert extract_answer(hostile) == expected


def test_extract_answer_reads_only_the_tail_of_a_huge_response():
    """Extraction runs in the trainer, outside any verifier deadline: only the last FINAL_ANSWER_WINDOW characters
    are read, so a multi-megabyte response costs what its tail costs, and a box that far from the end is not final."""
    tail = "so the answer is \\boxed{\\frac{1}{2}} and that is all."
    junk = "\\boxed{7}{" * 250_000  # 2.5 MB of boxes and unmatched braces
    assert len(junk) > 100 * FINAL_ANSWER_WINDOW
    assert extract_answer(junk + tail) == extract_answer(tail) == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1}" + "x" * FINAL_ANSWER_WINDOW) is None
    assert extract_answer("\\boxed{1}" + "x" * (FINAL_ANSWER_WINDOW - len("\\boxed{1}"))) == "1"


# ---------------------------------------------------------------------------------------------------------------
# exact_int and the registry


def test_exact_int_reward():
    responses = ["7", " 7\n", "07", "7.0", "-7", "seven", "", "7 "]
    assert exact_int_reward(responses, ["7"] * len(responses)) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert exact_int_reward(["-3"], ["-3"]) == [1.0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        exact_int_reward(["1", "2"], ["1"])


def test_registry_names_and_unknown_name():
    assert {"exact_int", "math"} <= set(REWARD_FUNCTIONS)
    assert get_reward_function("exact_int") is exact_int_reward
    with pytest.raises(QAEUserError, match=r"unknown reward function 'mth'.*exact_int, chain_final, math"):
        get_reward_function("mth")


def test_the_math_reward_is_scored_by_the_verifiers_own_pool():
    """A task's `math` reward: the extracted final answer checked by math-verify in the BuiltinVerifier's own worker
    processes (no pool shared across verifiers, none left running after the BuiltinVerifier closes)."""
    assert REWARD_FUNCTIONS["math"] is None  # no inline function: only a BuiltinVerifier scores it
    with BuiltinVerifier("math", timeout_s=3.0) as verifier:
        scores = verifier(["\\boxed{\\dfrac{2}{4}}", "answer: 3", "nothing"], ["\\frac{1}{2}", "4", "1"])
        workers = verifier.pool.worker_pids()
    assert scores == [1.0, 0.0, 0.0]
    assert workers and verifier.pool.worker_pids() == []
    for pid in workers:  # closed with the BuiltinVerifier: joined, so the pid is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---------------------------------------------------------------------------------------------------------------
# math-verify: what verifies and what does not


def test_equivalent_forms_verify_and_wrong_answers_do_not(strict_pool):
    cases = [  # (response, gold, expected)
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("The answer is 27.", "27", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("\\boxed{28}", "27", 0.0),
        ("\\boxed{26}", "27", 0.0),
        ("\\boxed{-27}", "27", 0.0),
        ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
        ("I don't know.", "27", 0.0),  # no final answer: wrong, not "could not verify"
    ]
    assert strict_pool.score([c[0] for c in cases], [c[1] for c in cases]) == [c[2] for c in cases]


@needs_data
@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "aime24.jsonl", "aime25.jsonl", "amc23.jsonl"])
def test_gold_answers_verify_and_off_by_one_does_not(strict_pool, name):
    problems = load_math_file(MATH_DATA / name)
    golds = [p.answer for p in problems]
    scores = strict_pool.score([as_model_would_write(g) for g in golds], golds)
    assert [p.prompt_id for p, s in zip(problems, scores, strict=True) if s != 1.0] == []
    integers = [g for g in golds if g.lstrip("-").isdigit()]
    assert len(integers) >= 0.95 * len(golds)
    wrong = strict_pool.score([as_model_would_write(str(int(g) + 1)) for g in integers], integers)
    assert wrong == [0.0] * len(integers)


@needs_data
def test_math500_gold_answers_verify(strict_pool):
    problems = load_math_file(MATH_DATA / "math500.jsonl")
    scores = strict_pool.score([as_model_would_write(p.answer) for p in problems], [p.answer for p in problems])
    failures = {p.prompt_id for p, s in zip(problems, scores, strict=True) if s != 1.0}
    assert failures <= set(MATH500_KNOWN_FAILURES), sorted(failures - set(MATH500_KNOWN_FAILURES))
    assert len(failures) <= 0.01 * len(problems)
    # the next problem's gold is (almost always) a wrong answer; only math-equivalent pairs such as "5" / "x=5" pass
    shifted = [problems[(i + 1) % len(problems)].answer for i in range(len(problems))]
    pairs = [(a.answer, b) for a, b in zip(problems, shifted, strict=True) if a.answer.strip() != b.strip()]
    accepted = strict_pool.score([as_model_would_write(b) for _, b in pairs], [a for a, _ in pairs])
    assert sum(s == 1.0 for s in accepted) <= 0.01 * len(pairs)


@needs_data
def test_dapo_gold_answers_verify_sample(strict_pool):
    problems = load_math_file(MATH_DATA / "dapo17k.parquet")[::60]  # 299 of 17,917
    scores = strict_pool.score([as_model_would_write(p.answer) for p in problems], [p.answer for p in problems])
    assert [p.prompt_id for p, s in zip(problems, scores, strict=True) if s != 1.0] == []


# ---------------------------------------------------------------------------------------------------------------
# The deadline: hostile answers, timeouts, crashes

TIMEOUT_S = 2.0


@pytest.fixture()
def deadline_pool():
    with MathVerifierPool(timeout_s=TIMEOUT_S, num_workers=2, shortcuts=False, max_answer_chars=None) as pool:
        assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]  # workers started: startup is not part of what we time
        yield pool


@pytest.mark.parametrize(
    "response, gold",
    [
        (NEVER_RETURNS, "1"),
        ("So the answer is \\boxed{" + "1+" * 50_000 + "1}", "1"),  # 100k characters inside the box
        ("x" * 100_000, "1"),
        ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "2"),
        ("\\boxed{" * 3 + "1", "1"),
        ("\\boxed{" + "7" * 10_000 + "}", "7"),
        ("\\boxed{" + "7" * 10_000 + "}", "7" * 9_999 + "8"),
    ],
)
def test_hostile_answers_are_scored_in_bounded_time(deadline_pool, response, gold):
    scored, timeouts = deadline_pool.items_scored, deadline_pool.timeouts
    [score] = deadline_pool.score([response], [gold])
    assert score in (0.0, None)
    # nothing to verify (no final answer), a worker answered it, or it was cut at its deadline; no time bound here:
    # a loaded machine is slow, not wrong, and without the deadline the call never returns
    answered, cut = deadline_pool.items_scored - scored, deadline_pool.timeouts - timeouts
    assert (answered, cut) in ([(0, 0), (1, 0)] if score == 0.0 else [(0, 1)])
    assert (deadline_pool.crashes, deadline_pool.batch_cutoffs) == (0, 0)
    assert deadline_pool.score(["\\boxed{\\frac{6}{8}}"], ["\\frac{3}{4}"]) == [1.0]  # the pool goes on


def test_timeout_kills_and_replaces_the_worker(deadline_pool):
    pids_before = set(deadline_pool.worker_pids())
    started_before = deadline_pool.workers_started
    start = time.monotonic()
    scores = deadline_pool.score([NEVER_RETURNS, "\\boxed{2}", "\\boxed{3}"], ["1", "2", "3"])
    elapsed = time.monotonic() - start
    assert scores == [None, 1.0, 1.0]  # the stuck item is "could not verify"; the others were scored meanwhile
    assert elapsed >= TIMEOUT_S  # the stuck item had its whole deadline before it was cut
    assert deadline_pool.timeouts == 1
    assert deadline_pool.workers_started == started_before + 2  # killed after its quick try, then after its timeout
    assert len(deadline_pool.worker_pids()) == 2 and set(deadline_pool.worker_pids()) != pids_before  # replaced
    assert deadline_pool.score(["\\boxed{5}"] * 4, ["5"] * 4) == [1.0] * 4


def test_stuck_items_time_out_concurrently(deadline_pool):
    scores = deadline_pool.score([NEVER_RETURNS, ANOTHER_TOWER, "\\boxed{4}"], ["1", "1", "4"])
    assert scores == [None, None, 1.0]
    assert deadline_pool.peak_busy == 2  # both workers were busy at once, not one after the other
    assert deadline_pool.timeouts == 2


def test_identical_answers_are_verified_once(deadline_pool):
    """A group whose samples all give the same hanging answer costs one timeout, not one per sample."""
    scores = deadline_pool.score([NEVER_RETURNS] * 6 + ["\\boxed{\\frac{2}{4}}"] * 3, ["1"] * 6 + ["0.5"] * 3)
    assert scores == [None] * 6 + [1.0] * 3
    assert (deadline_pool.timeouts, deadline_pool.batch_cutoffs) == (1, 0)
    assert deadline_pool.items_scored == 1 + 1  # the fixture's warm-up item and the one distinct fraction


def test_crashed_worker_scores_none_and_is_replaced():
    with MathVerifierPool(timeout_s=60.0, num_workers=1, shortcuts=False) as pool:
        assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]
        [pid] = pool.worker_pids()
        killer = threading.Timer(0.5, os.kill, args=(pid, signal.SIGKILL))  # dies while stuck on NEVER_RETURNS
        killer.start()
        scores = pool.score([NEVER_RETURNS, "\\boxed{2}"], ["1", "2"])
        killer.join()
        assert scores == [None, 1.0]
        assert (pool.crashes, pool.timeouts) == (1, 0)  # noticed the death; waiting out the 60 s deadline is a timeout
        assert pool.worker_pids() != [pid]


def test_a_batch_of_hanging_answers_is_bounded_and_honest_answers_are_scored_first():
    """Towers first in the batch: each gets a quick try, the honest answers are scored, then the towers' full tries
    run until the batch bound cuts the rest off (None, counted)."""
    towers = [f"\\boxed{{{base}^{{9^{{9^{{9}}}}}}}}" for base in range(2, 10)]  # 8 distinct answers that hang
    honest = [f"\\boxed{{\\frac{{{k}}}{{{k + 1}}}}}" for k in range(1, 9)]
    with MathVerifierPool(timeout_s=2.0, num_workers=2, shortcuts=False, batch_timeout_s=4.0) as pool:
        scores = pool.score(towers + honest, ["1"] * 8 + [f"\\frac{{{2 * k}}}{{{2 * k + 2}}}" for k in range(1, 9)])
        assert scores == [None] * 8 + [1.0] * 8
        # 4 s hold at most two rounds of 2-second full tries on 2 workers: some towers were cut off, none was lost
        assert pool.batch_cutoffs > 0 and pool.timeouts + pool.batch_cutoffs == 8
        assert pool.score(["\\boxed{0.5}"], ["\\frac{1}{2}"]) == [1.0]  # the pool goes on


def test_a_worker_that_dies_while_starting_is_replaced(monkeypatch):
    monkeypatch.setenv("QAE_FAULT", "verifier_start@2")  # SIGKILL worker 2 (the first replacement) before it is ready
    with MathVerifierPool(timeout_s=1.0, num_workers=1, shortcuts=False) as pool:
        assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]
        # the tower's quick try kills worker 1; worker 2 dies starting; worker 3 takes over and the call goes on
        assert pool.score([NEVER_RETURNS, "\\boxed{2}"], ["1", "2"]) == [None, 1.0]
        assert (pool.start_failures, pool.crashes, pool.timeouts) == (1, 0, 1)


def test_workers_that_keep_dying_while_starting_give_a_message_that_says_so(monkeypatch):
    monkeypatch.setenv("QAE_FAULT", "verifier_start@*")
    with MathVerifierPool(timeout_s=1.0, num_workers=2, shortcuts=False, max_start_failures=3) as pool:
        with pytest.raises(
            RuntimeError,
            match=r"died while starting, 3 times in a row \(exit codes -9 \(killed by "
            r"SIGKILL\), -9 \(killed by SIGKILL\), -9 \(killed by SIGKILL\)\); "
            "something kills new processes",
        ):
            pool.score(["\\boxed{1}"], ["1"])
        assert pool.start_failures == 3 and pool.worker_pids() == []
        monkeypatch.delenv("QAE_FAULT")
        assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]  # the cause gone, the same pool works again


def test_interrupt_and_close_during_a_call_raise_scoring_interrupted():
    with MathVerifierPool(timeout_s=60.0, num_workers=1, shortcuts=False) as pool:
        assert pool.score(["\\boxed{1}"], ["1"]) == [1.0]
        for stop in (pool.interrupt, pool.close):  # close() from another thread interrupts the call first
            stopper = threading.Timer(0.3, stop)  # the tower holds the call for 10 s (its quick try) at least
            stopper.start()
            with pytest.raises(ScoringInterrupted, match="interrupted by shutdown"):
                pool.score([NEVER_RETURNS, "\\boxed{2}"], ["1", "2"])
            stopper.join()
            assert pool.worker_pids() == []  # the interrupted call's workers are gone: none can answer a later call
            assert pool.score(["\\boxed{3}"], ["3"]) == [1.0]  # and a later call starts fresh ones


SIGNAL_SCRIPT = r"""
import json, signal, sys
from qae_app.rewards.verifier_pool import MathVerifierPool, ScoringInterrupted

def main(mode, n):
    seen = []
    with MathVerifierPool(timeout_s=30.0, num_workers=2, shortcuts=False) as pool:
        def on_signal(signum, frame):  # what the trainer does: note it; "interrupt" also abandons the scoring call
            seen.append([signum, pool.items_scored])
            if mode == "interrupt":
                pool.interrupt()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, on_signal)
        pool.score(["\\boxed{1}"], ["1"])
        started, scored = pool.workers_started, pool.items_scored
        responses = [f"\\boxed{{\\frac{{{k}}}{{{k + 1}}}}}" for k in range(1, n + 1)]
        golds = [f"\\frac{{{2 * k}}}{{{2 * k + 2}}}" for k in range(1, n + 1)]
        print("scoring", flush=True)
        try:
            scores = pool.score(responses, golds)
        except ScoringInterrupted as err:
            scores = str(err)
        print(json.dumps(dict(scores=scores, seen=seen, before=scored, crashes=pool.crashes,
                              restarts=pool.workers_started - started)), flush=True)

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
"""


def _signal_the_group_mid_batch(tmp_path, signum, mode, n=400):
    """Run SIGNAL_SCRIPT as its own process group (as a shell, systemd or Slurm starts a job), send `signum` to the
    whole group once it is scoring, and return what it reported."""
    script = tmp_path / "score_then_signal.py"
    script.write_text(SIGNAL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(n)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )  # its own process group, with its workers in it
    try:
        assert proc.stdout.readline().strip() == "scoring"
        os.killpg(proc.pid, signum)
        report = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    [(seen_signal, scored_at_signal)] = report["seen"]
    assert seen_signal == signum
    assert report["before"] <= scored_at_signal < report["before"] + n  # it came while the batch was being scored
    return report


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_signal_to_the_process_group_does_not_kill_the_workers(tmp_path, signum):
    """A closed terminal sends SIGHUP to its process group as Ctrl-C sends SIGINT (issue 48 M2): the trainer's to
    handle, as SIGTERM is."""
    report = _signal_the_group_mid_batch(tmp_path, signum, "finish")
    assert report["scores"] == [1.0] * 400  # every answer verified: none turned into "unverified" by the signal
    assert (report["crashes"], report["restarts"]) == (0, 0)


@pytest.mark.slow
def test_a_scoring_call_abandoned_at_shutdown_raises_instead_of_returning_nones(tmp_path):
    report = _signal_the_group_mid_batch(tmp_path, signal.SIGTERM, "interrupt")
    assert "interrupted by shutdown" in report["scores"]
    assert report["crashes"] == 0


def test_default_shortcuts_skip_the_workers():
    with MathVerifierPool() as pool:
        scores = pool.score(
            ["\\boxed{042}", "\\boxed{43}", "\\boxed{" + "9" * 5000 + "}", "nothing", "\\boxed{\\frac{1}{2}}"],
            ["42", "42", "1", "1", "\\frac{1}{2}"],
        )
        assert scores == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert pool.workers_started == 0  # all settled without math-verify


# ---------------------------------------------------------------------------------------------------------------
# DAPO's overlong reward shaping and the reward values, by hand


def test_overlong_penalty_before_at_inside_and_past_the_buffer():
    from qae_app.rewards.builtin_verifiers import overlong_penalty

    # max_new_tokens 20, buffer 4: the penalty starts after 16 tokens and reaches -F at 20
    assert overlong_penalty(12, 20, 4, 1.0) == 0.0  # before the buffer
    assert overlong_penalty(16, 20, 4, 1.0) == 0.0  # at its start: exactly max_new_tokens - buffer
    assert overlong_penalty(17, 20, 4, 1.0) == -0.25  # inside: -(17 - 16) / 4 * 1
    assert overlong_penalty(18, 20, 4, 0.5) == -0.25  # -(18 - 16) / 4 * 0.5
    assert overlong_penalty(20, 20, 4, 1.0) == -1.0  # the whole buffer: -F
    assert overlong_penalty(22, 20, 4, 1.0) == -1.5  # past it (the formula as written, not clamped)
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: shaping off
    # the paper's numbers: 20480 tokens, buffer 4096 -> free up to 16384, -0.5 at 18432
    assert overlong_penalty(16384, 20480, 4096, 1.0) == 0.0
    assert overlong_penalty(18432, 20480, 4096, 1.0) == -0.5


def test_shaped_rewards_add_the_penalty_to_the_reward_values_and_keep_the_verdict():
    from qae_app.rewards.builtin_verifiers import shape_rewards

    scores = [1.0, 0.0, None, 1.0, 0.0]
    lengths = [3, 3, 3, 7, 8]  # max_new_tokens 8, buffer 4: 7 tokens -> -0.75, 8 -> -1
    rewards, correct = shape_rewards(scores, lengths, (-1.0, 1.0), 8, 4, 1.0)
    assert rewards == [1.0, -1.0, -1.0, 0.25, -2.0]  # unverifiable (None) counts as wrong
    assert correct == [True, False, False, True, False]
    rewards, correct = shape_rewards(scores, lengths, (0.0, 1.0), 8, 0, 1.0)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0] and correct == [True, False, False, True, False]
