"""Reward functions: score a policy's responses against gold answers.

Contract (open-r1 style): a reward function maps `(responses: list[str], answers: list[str]) -> list[float | None]`,
one score per response. `None` means "could not verify" (the verifier timed out or crashed); the caller counts
those and never treats them as a silent 0.

| name        | scores                                                                                           |
|-------------|--------------------------------------------------------------------------------------------------|
| `exact_int` | built-in arithmetic task: 1.0 when the stripped response is exactly the gold integer, else 0.0   |
| `math`      | math files: the last `\\boxed{...}` (or a final "answer is X" line) checked with math-verify     |

Math-verify can hang on hostile input (`\\boxed{9^{9^{9^{9}}}}` never returns) and its own timeout uses
`signal.alarm`, which only works in the main thread. So `math` scoring runs in a `MathVerifierPool`: worker
processes (started with "spawn", never fork: the parent holds torch threads) with math-verify's own timeouts off and
a hard deadline per item enforced by the parent. A worker that misses the deadline is killed (SIGKILL) and replaced;
its item scores None. A worker that crashes is replaced the same way. The pool goes on.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

from qae_app.errors import QAEUserError

RewardFunction = Callable[[list[str], list[str]], list[float | None]]

# ---------------------------------------------------------------------------------------------------------------
# Answer extraction (pure string work, linear time on any input)

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_RE = re.compile(r"[{}]")
_SPACE_FORM_RE = re.compile(r"[ \t]+([^\s$]+)")  # "\boxed 5"
_FINAL_LINE_RE = re.compile(r"answer\s*(?:is|:)|####", re.IGNORECASE)
_INT_RE = re.compile(r"-?\d+")


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


def extract_answer(text: str) -> str | None:
    """The final answer in a response: the content of the last complete `\\boxed{...}` / `\\fbox{...}` /
    `\\boxed X`, else what follows the last "answer is" / "Answer:" / "####" on its line; None if neither.

    Linear time in len(text), whatever the text (deep nesting, unterminated boxes, huge numbers).
    """
    boxes = list(_BOX_RE.finditer(text))
    if boxes:
        pairs = _matching_braces(text)
        for box in reversed(boxes):  # the last box that is complete and non-empty
            start = box.end()
            while start < len(text) and text[start] == " ":
                start += 1
            if start < len(text) and text[start] == "{":
                end = pairs.get(start)
                if end is not None and text[start + 1:end].strip():
                    return text[start + 1:end].strip()
            else:
                m = _SPACE_FORM_RE.match(text, box.end())
                if m:
                    return m.group(1)
    last = None
    for last in _FINAL_LINE_RE.finditer(text):
        pass
    if last is None:
        return None
    line_end = text.find("\n", last.end())
    return _clean_final(text[last.end():line_end if line_end >= 0 else len(text)].lstrip(" \t:"))


# ---------------------------------------------------------------------------------------------------------------
# exact_int: the built-in arithmetic task


def exact_int_reward(responses: list[str], answers: list[str]) -> list[float | None]:
    """1.0 when the response, stripped of whitespace, is exactly the gold integer string; else 0.0. Never None."""
    _check_lengths(responses, answers)
    return [1.0 if _INT_RE.fullmatch(r.strip()) and r.strip() == a.strip() else 0.0 for r, a in zip(responses, answers)]


def _canonical_int(digits: str) -> str:
    """"-007" -> "-7", "-0" -> "0", without int() (which refuses more than 4,300 digits)."""
    magnitude = digits.lstrip("-").lstrip("0") or "0"
    return "-" + magnitude if digits.startswith("-") and magnitude != "0" else magnitude


def _check_lengths(responses: list[str], answers: list[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"got {len(responses)} responses but {len(answers)} answers; pass one answer per response")


# ---------------------------------------------------------------------------------------------------------------
# math: math-verify in worker processes with a hard deadline per item


def _parse_gold(gold: str):
    from math_verify import parse

    parsed = parse("$" + gold + "$", parsing_timeout=None)
    return parsed or parse("\\boxed{" + gold + "}", parsing_timeout=None)


def verify_math(prediction: str, gold: str) -> float | None:
    """math-verify on one extracted answer, with no timeout: call it only inside a pool worker (or on trusted input).

    1.0 / 0.0; None when the gold itself does not parse (nothing to verify against).
    """
    from math_verify import parse, verify

    gold_parsed = _gold_cache.get(gold)
    if gold_parsed is None:
        gold_parsed = _gold_cache[gold] = _parse_gold(gold)
        if len(_gold_cache) > 10_000:
            _gold_cache.pop(next(iter(_gold_cache)))
    if not gold_parsed:
        return None
    pred_parsed = parse("\\boxed{" + prediction + "}", parsing_timeout=None)
    if not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0


_gold_cache: dict[str, list] = {}  # per process; a group of G responses shares one gold


def _worker_main(conn, memory_limit_mb: int | None) -> None:
    """Worker loop: receive (item_id, prediction, gold), send (item_id, score). Exits when the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes the pool
    if memory_limit_mb:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" is expected here
    verify_math("1", "1")  # import sympy and warm up before declaring ready, so startup never eats a deadline
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        item_id, prediction, gold = message
        try:
            result = verify_math(prediction, gold)
        except Exception:  # math-verify swallows most errors; anything that escapes is "could not verify"
            result = None
        conn.send((item_id, result))


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection, the parent's end
    started_at: float
    ready: bool = False
    item: int | None = None  # index into the current score() call's results
    deadline: float = 0.0


class MathVerifierPool:
    """Score responses with math-verify in `num_workers` processes, each item under a hard `timeout_s` deadline.

    Use as a context manager (or call `close()`); workers start on the first `score()`. Not thread-safe across
    concurrent `score()` calls (a lock serializes them). Counters `timeouts`, `crashes` and `workers_started` say
    what happened so far. Workers are spawned, so the program's `__main__` must be importable (a script file or
    `-m` module with an `if __name__ == "__main__":` guard, not code piped to `python -`).
    """

    def __init__(self, timeout_s: float = 3.0, num_workers: int = 2, max_answer_chars: int | None = 1000,
                 shortcuts: bool = True, memory_limit_mb: int | None = 4096, startup_timeout_s: float = 120.0):
        """
        timeout_s: seconds one item may take in a worker, counted from when it is sent; then it scores None.
        num_workers: worker processes scoring concurrently.
        max_answer_chars: an extracted answer longer than this scores 0.0 without math-verify (None: no bound).
        shortcuts: score the easy cases without math-verify (answer string equals the gold; both plain integers).
        memory_limit_mb: address-space limit per worker, so a hostile answer cannot exhaust memory (None: no limit).
        startup_timeout_s: how long a new worker may take to import math-verify before the pool gives up.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.max_answer_chars = max_answer_chars
        self.shortcuts = shortcuts
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = 0  # items whose worker was killed at the deadline
        self.crashes = 0  # workers that died while scoring
        self.workers_started = 0
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._context = multiprocessing.get_context("spawn")

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def __enter__(self) -> MathVerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers (politely, then SIGKILL). The pool restarts them if `score()` is called again."""
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in workers:
            w.process.join(timeout=1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(target=_worker_main, args=(child_conn, self.memory_limit_mb),
                                        name="qae-math-verify", daemon=True)
        process.start()
        child_conn.close()
        self.workers_started += 1
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, w: _Worker) -> _Worker:
        if w.process.is_alive():
            w.process.kill()  # SIGKILL: a worker stuck in sympy ignores anything gentler
        w.process.join()
        w.conn.close()
        new = self._start_worker()
        self._workers[self._workers.index(w)] = new
        return new

    # -- scoring ------------------------------------------------------------------------------------------------

    def _shortcut(self, prediction: str | None, gold: str) -> float | None:
        """A score without math-verify, or None when math-verify must decide."""
        if prediction is None:
            return 0.0  # no final answer in the response: wrong, not unverifiable
        if self.max_answer_chars is not None and len(prediction) > self.max_answer_chars:
            return 0.0
        if not self.shortcuts:
            return None
        if prediction == gold.strip():
            return 1.0
        if _INT_RE.fullmatch(prediction) and _INT_RE.fullmatch(gold.strip()):
            return 1.0 if _canonical_int(prediction) == _canonical_int(gold.strip()) else 0.0
        return None

    def score(self, responses: list[str], answers: list[str]) -> list[float | None]:
        """One score per response: 1.0 / 0.0, or None when math-verify did not answer in time or crashed."""
        _check_lengths(responses, answers)
        results: list[float | None] = [None] * len(responses)
        pending: deque[tuple[int, str, str]] = deque()
        for i, (response, gold) in enumerate(zip(responses, answers)):
            prediction = extract_answer(response)
            quick = self._shortcut(prediction, gold)
            if quick is not None:
                results[i] = quick
            else:
                pending.append((i, prediction, gold))
        if not pending:
            return results
        with self._lock:
            try:
                self._run(pending, results)
            except BaseException:
                self.close()  # a worker may still hold an item of this call; never let it answer the next one
                raise
        return results

    def _run(self, pending: deque[tuple[int, str, str]], results: list[float | None]) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        while pending or any(w.item is not None for w in self._workers):
            # hand out items to idle, ready workers
            for w in self._workers:
                if w.ready and w.item is None and pending:
                    i, prediction, gold = pending.popleft()
                    try:
                        w.conn.send((i, prediction, gold))
                    except OSError:  # died since its last message: requeue the item, replace the worker
                        pending.appendleft((i, prediction, gold))
                        self.crashes += 1
                        self._replace(w)
                        continue
                    w.item, w.deadline = i, time.monotonic() + self.timeout_s
            # wait for a result, a death, a ready message, or the next deadline
            deadlines = [w.deadline for w in self._workers if w.item is not None]
            deadlines += [w.started_at + self.startup_timeout_s for w in self._workers if not w.ready]
            waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            ready = set(wait(waitables, timeout=max(0.0, min(deadlines) - time.monotonic())))
            for w in list(self._workers):
                if w.conn in ready:
                    try:
                        message = w.conn.recv()
                    except (EOFError, OSError):
                        self._on_death(w, results)
                        continue
                    if message[0] == "ready":
                        w.ready = True
                    elif message[0] == w.item:
                        results[w.item] = message[1]
                        w.item = None
                elif w.process.sentinel in ready:
                    self._on_death(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.item is not None and now >= w.deadline:
                    results[w.item] = None
                    self.timeouts += 1
                    self._replace(w)
                elif not w.ready and now >= w.started_at + self.startup_timeout_s:
                    raise RuntimeError(f"a math-verify worker did not start within {self.startup_timeout_s:.0f} s; "
                                       "check that `import math_verify` works in this environment")

    def _on_death(self, w: _Worker, results: list[float | None]) -> None:
        w.process.join()
        if not w.ready:
            raise RuntimeError(f"a math-verify worker exited during startup (exit code {w.process.exitcode}); "
                               "check that `import math_verify` works in this environment")
        if w.item is not None:
            results[w.item] = None
        self.crashes += 1
        self._replace(w)


_default_pool: MathVerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_math_pool() -> MathVerifierPool:
    """The shared pool behind `math_reward` (created on first use, closed at exit)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = MathVerifierPool()
            atexit.register(_default_pool.close)
        return _default_pool


def math_reward(responses: list[str], answers: list[str]) -> list[float | None]:
    """math-verify on the extracted final answer: 1.0 / 0.0, None if the verifier timed out or crashed."""
    return default_math_pool().score(responses, answers)


# ---------------------------------------------------------------------------------------------------------------
# Registry

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "exact_int": exact_int_reward,
    "math": math_reward,
}


def get_reward_function(name: str) -> RewardFunction:
    if name not in REWARD_FUNCTIONS:
        raise QAEUserError(f"reward: unknown reward function '{name}'. Choose one of: {', '.join(REWARD_FUNCTIONS)}.")
    return REWARD_FUNCTIONS[name]


class Scorer:
    """The reward function of a task, with its own verifier pool when it needs one; use as a context manager.

    `Scorer("math", timeout_s=3)` owns a `MathVerifierPool` with that per-item deadline; other rewards run inline.
    """

    def __init__(self, name: str, timeout_s: float = 3.0):
        self.name = name
        self.pool = MathVerifierPool(timeout_s=timeout_s) if name == "math" else None
        self.fn = self.pool.score if self.pool is not None else get_reward_function(name)

    def __call__(self, responses: list[str], answers: list[str]) -> list[float | None]:
        return self.fn(responses, answers)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
