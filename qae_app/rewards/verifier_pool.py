"""The `math` reward's verifier: math-verify in worker processes, with a hard deadline per item and per call.

Math-verify can hang on hostile input (`\\boxed{9^{9^{9^{9}}}}` never returns) and its own timeout uses
`signal.alarm`, which only works in the main thread. So `math` scoring (builtin_verifiers.BuiltinVerifier) runs in a
`MathVerifierPool`: worker processes (forked from a fork server that has imported and warmed math-verify, or
spawned; never forked from the parent, which holds torch threads) with math-verify's own timeouts off and a hard
deadline per item enforced by the parent. A worker that misses the deadline is killed (SIGKILL) and replaced, in
milliseconds thanks to the fork server; its item scores None. A worker that crashes is replaced the same way. The
pool goes on.

A whole `score()` call is bounded too (`batch_timeout_s`): items still unscored then score None, so a batch of power
towers costs a few timeouts, not one timeout per tower. Every item first gets a quick try (a sixth of its timeout);
one that needs longer waits until every other item had its quick try, then gets its full timeout: a few hanging
answers cannot starve the honest ones of the batch's time. Identical answers to the same gold are verified once.
Workers ignore SIGINT, SIGTERM and SIGHUP: a signal sent to the whole process group (Ctrl-C, `kill -TERM -PGID`,
systemd, Slurm, a terminal that closes) is the trainer's to handle, and the pool finishes or abandons its call as the
trainer decides (`interrupt()` makes the call raise `ScoringInterrupted`).
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401 - its exit handler must be registered before ours (see the end)
import os
import signal
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import wait

from qae_app.core.faults import fault_point
from qae_app.core.names import MAX_ANSWER_CHARS
from qae_app.rewards.answers import INTEGER_RE, check_lengths, extract_answer


class WorkersDidNotStart(RuntimeError):
    """The pool's workers could not start: each died before it said it was ready, `max_start_failures` in a row
    (`exit_codes`: theirs), or one was not ready within `startup_timeout_s` (`exit_codes` empty)."""

    def __init__(self, message: str, exit_codes: tuple = ()):
        super().__init__(message)
        self.exit_codes = exit_codes


class ScoringInterrupted(Exception):
    """A `score()` call was cut short by shutdown (`interrupt()` or `close()` during the call): its scores are
    incomplete, so the caller must not store them as a finished step."""


# ---------------------------------------------------------------------------------------------------------------
# the worker processes


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
WORKER_IGNORED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # the trainer's to handle


def _worker_main(
    conn,
    memory_limit_mb: int | None,
    number: int = 0,
    fault_spec: str | None = None,
    handler: Callable | None = None,
    init: tuple | None = None,
) -> None:
    """Worker loop: receive (item_id, *payload), send (item_id, handler(*payload)). Exits when the pipe closes.

    number: this worker's start number in its pool (1, 2, ...); fault_spec: the parent's QAE_FAULT (a worker forked
    from the fork server would otherwise see the server's environment), for the crash tests' `verifier_start@N`.
    handler: what scores an item (default: math-verify on (prediction, gold)); init: (function, *args) run once
    before the worker says it is ready (user_functions.load_user_rewards imports the user's rewards here).
    """
    # Ctrl-C, SIGTERM and SIGHUP sent to the process group are the parent's to handle; it closes the pool. The parent
    # started this process with them blocked, so none could kill it before these lines run.
    for sig in WORKER_IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_IGNORED_SIGNALS)
    if memory_limit_mb:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" is expected here
    if handler is None:
        handler = verify_math
        verify_math("1", "1")  # import sympy and warm up before declaring ready, so startup never eats a deadline
    if init is not None:
        init[0](*init[1:])
    if fault_spec:
        os.environ["QAE_FAULT"] = fault_spec
        fault_point("verifier_start", number)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        item_id, *payload = message
        try:
            result = handler(*payload)
        except Exception:  # math-verify swallows most errors; anything that escapes is "could not verify"
            result = None
        conn.send((item_id, result))


def default_batch_timeout_s(timeout_s: float, n_items: int, num_workers: int) -> float:
    """How long one `score()` call may take, counted from its first item sent: one and a half per-item timeouts (the
    slowest item's quick try and full try, with room for replacing its worker) plus a quarter of a timeout for each
    round of `num_workers` items.

    Honest answers verify in milliseconds, so a batch of them ends far inside this; a batch of answers that hang
    (power towers) is cut off after a few timeouts instead of costing one timeout per answer.
    """
    return timeout_s * (1.5 + math.ceil(n_items / num_workers) / 4)


def _worker_context() -> multiprocessing.context.BaseContext:
    """Where the platform has it, "forkserver": a server process imports and warms math-verify once
    (`qae_app.rewards.verifier_preload`) and every worker is forked from it, so replacing a killed worker takes
    milliseconds instead of a fresh multi-second sympy import. Otherwise "spawn". Never plain fork: the parent holds
    torch threads."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["qae_app.rewards.verifier_preload"])
        return context
    return multiprocessing.get_context("spawn")


@contextmanager
def _program_main_hidden():
    """While starting a worker (and the fork server), make `__main__` an empty module: workers need nothing from the
    program's main script, and multiprocessing would otherwise re-run its top level in each new process (slow for a
    heavy script; wrong when a framework has swapped `__main__`, as Streamlit's AppTest does). This also lets a pool run
    from code piped to `python -`."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: object  # multiprocessing.connection.Connection, the parent's end
    started_at: float
    ready: bool = False
    item: int | None = None  # index into the current score() call's unique items
    deadline: float = 0.0
    quick_try: bool = False  # the item's first, short try: missing its deadline requeues it instead of scoring None


# ---------------------------------------------------------------------------------------------------------------
# the pool


def _canonical_int(digits: str) -> str:
    """ "-007" -> "-7", "-0" -> "0", without int() (which refuses more than 4,300 digits)."""
    magnitude = digits.lstrip("-").lstrip("0") or "0"
    return "-" + magnitude if digits.startswith("-") and magnitude != "0" else magnitude


_INTERRUPT_POLL_S = 0.1  # longest wait between checks of interrupt(): how fast a shutdown request is noticed
QUICK_TRY_FRACTION = 1 / 6  # an item's first try gets this fraction of timeout_s; honest answers need milliseconds
_live_pools: weakref.WeakSet = weakref.WeakSet()


class MathVerifierPool:
    """Score responses with math-verify in `num_workers` processes, each item under a hard `timeout_s` deadline and
    each call under a `batch_timeout_s` bound.

    Use as a context manager (or call `close()`); workers start on the first `score()`. Not thread-safe across
    concurrent `score()` calls (a lock serializes them). Counters say what happened so far: `timeouts` (items killed
    at their deadline), `batch_cutoffs` (items left unscored at a call's bound), `crashes` (workers that died while
    scoring), `start_failures` (workers that died while starting), `workers_started`, `items_scored`. Workers never
    import the program's `__main__`, so any script (or code piped to `python -`) can use a pool.
    """

    def __init__(
        self,
        timeout_s: float = 3.0,
        num_workers: int = 2,
        max_answer_chars: int | None = MAX_ANSWER_CHARS,
        shortcuts: bool = True,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
        batch_timeout_s: float | None = None,
        max_start_failures: int = 3,
        extract: Callable[[str], str | None] = extract_answer,
        handler: Callable | None = None,
        init: tuple | None = None,
    ):
        """
        timeout_s: seconds one item may take in a worker, counted from when it is sent; then it scores None.
        num_workers: worker processes scoring concurrently.
        max_answer_chars: an extracted answer longer than this scores 0.0 without math-verify (None: no bound).
        shortcuts: score the easy cases without math-verify (answer string equals the gold; both plain integers).
        memory_limit_mb: address-space limit per worker, so a hostile answer cannot exhaust memory (None: no limit).
        startup_timeout_s: how long a new worker may take to import math-verify before the pool gives up.
        batch_timeout_s: seconds one `score()` call may take from its first item sent; items unscored then score
            None (None: `default_batch_timeout_s` of the call's size).
        max_start_failures: workers that may die while starting, in a row, before `score()` raises.
        extract: the response's final answer, which math-verify checks against the gold (default: the last box or
            "answer is" line; `answers.final_number_answer` for instruct models answering in words).
        handler, init: another job for the workers (`run_items` hands them items): the function that scores an item
            in a worker, and (function, *args) each worker runs when it starts (user_functions: a user's rewards).
        """
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s}: must be a finite number of seconds > 0")
        if batch_timeout_s is not None and not (math.isfinite(batch_timeout_s) and batch_timeout_s > 0):
            raise ValueError(f"batch_timeout_s={batch_timeout_s}: must be a finite number of seconds > 0, or None")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1")
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.max_answer_chars = max_answer_chars
        self.shortcuts = shortcuts
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.max_start_failures = max_start_failures
        self.extract = extract
        self.handler, self.init = handler, init
        self.role, self.startup_hint = (
            ("math-verify", "check that `python -c 'import math_verify'` works in this environment")
            if handler is None
            else ("reward", "does importing a reward's module hang or take minutes?")
        )
        self.timeouts = 0  # items whose worker was killed at the item deadline
        self.batch_cutoffs = 0  # items left unscored when a call reached its batch bound
        self.crashes = 0  # workers that died while scoring
        self.start_failures = 0  # workers that died before they were ready
        self.workers_started = 0
        self.items_scored = 0  # items a worker answered
        self.peak_busy = 0  # the most items being verified at once (workers verify side by side)
        self.died_items: dict[int, int | None] = {}  # the last call's items whose worker died on them -> exit code
        self._failed_starts: list[int | None] = []  # exit codes of the workers that died starting, since the last ready
        self._workers: list[_Worker] = []
        self._lock = threading.RLock()
        self._interrupted = threading.Event()
        self._scoring_thread: int | None = None
        self._context = _worker_context()
        _live_pools.add(self)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def __enter__(self) -> MathVerifierPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def interrupt(self) -> None:
        """Shutting down: the `score()` call in progress (or, if none is, the next one) stops within ~0.1 s and
        raises `ScoringInterrupted` instead of returning incomplete scores. Safe from a signal handler or any thread."""
        self._interrupted.set()

    def close(self) -> None:
        """Stop all workers (politely, then SIGKILL). The pool restarts them if `score()` is called again.

        Called during a `score()` call (from another thread, or from a signal handler inside it), it interrupts that
        call, which raises `ScoringInterrupted`."""
        if self._scoring_thread is not None:
            self.interrupt()
            if self._scoring_thread == threading.get_ident():
                return  # a signal handler inside score(): the call closes the workers on its way out
        with self._lock:
            self._close_workers()
            self._interrupted.clear()

    def _close_workers(self) -> None:
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
        process = self._context.Process(
            target=_worker_main,
            name="qae-math-verify",
            daemon=True,
            args=(
                child_conn,
                self.memory_limit_mb,
                self.workers_started + 1,
                os.environ.get("QAE_FAULT"),
                self.handler,
                self.init,
            ),
        )
        # Start it with those signals blocked: the new process (and the fork server, the first time) inherits the
        # mask, so a signal to the whole process group cannot kill it before it has set them to be ignored. The fork
        # server never unblocks them, so it survives such a signal too. Start multiprocessing's resource tracker
        # first: starting it unblocks both signals in this thread, which would undo our block.
        resource_tracker.ensure_running()
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_IGNORED_SIGNALS)
        try:
            with _program_main_hidden():
                process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
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
        if INTEGER_RE.fullmatch(prediction) and INTEGER_RE.fullmatch(gold.strip()):
            return 1.0 if _canonical_int(prediction) == _canonical_int(gold.strip()) else 0.0
        return None

    def score(self, responses: list[str], answers: list[str]) -> list[float | None]:
        """One score per response: 1.0 / 0.0, or None when math-verify did not answer in time or crashed.

        Raises `ScoringInterrupted` when `interrupt()` or `close()` cut the call short: then no score is returned.
        """
        check_lengths(responses, answers)
        results: list[float | None] = [None] * len(responses)
        # identical (answer, gold) pairs are verified once: a group's samples often agree, and a policy stuck on one
        # hostile answer costs one timeout, not one per sample
        unique: dict[tuple[str, str], list[int]] = {}
        for i, (response, gold) in enumerate(zip(responses, answers, strict=True)):
            prediction = self.extract(response)
            quick = self._shortcut(prediction, gold)
            if quick is not None:
                results[i] = quick
            else:
                unique.setdefault((prediction, gold), []).append(i)
        if not unique:
            return results
        items = list(unique)
        item_results = self.run_items(items)
        for item, score in zip(items, item_results, strict=True):
            for i in unique[item]:
                results[i] = score
        return results

    def run_items(self, items: list[tuple], timeout_s: float | None = None) -> list:
        """What the workers' handler gives for each item (a tuple of its arguments), in order; None for an item that
        ran past its deadline, or whose worker died. `timeout_s`: this call's deadline per item instead of the
        pool's (and the batch bound that follows from it). Raises `ScoringInterrupted` as `score` does."""
        with self._lock:
            self._scoring_thread = threading.get_ident()
            pool_timeouts = self.timeout_s, self.batch_timeout_s
            if timeout_s is not None:
                self.timeout_s, self.batch_timeout_s = timeout_s, None
            try:
                return self._run(items)
            except BaseException:
                self._close_workers()  # a worker may still hold an item of this call; never let it answer the next
                raise
            finally:
                self._scoring_thread = None
                self.timeout_s, self.batch_timeout_s = pool_timeouts

    def _run(self, items: list[tuple]) -> list:
        """Score the (prediction, gold) `items` on the workers: every item's quick try first, in order, then the full
        timeout of those whose quick try ran out. An item that a worker does not finish in time, or that the batch's
        deadline cuts off, scores None."""
        results: list[float | None] = [None] * len(items)
        self.died_items = {}
        pending = deque((i, True) for i in range(len(items)))  # (item, quick try?): quick tries first, in order
        budget_s = self.batch_timeout_s or default_batch_timeout_s(self.timeout_s, len(items), self.num_workers)
        batch_deadline = None  # set when the first item is sent: starting the workers is not the batch's time
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        while pending or any(w.item is not None for w in self._workers):
            if self._interrupted.is_set():
                self._interrupted.clear()
                raise ScoringInterrupted(
                    f"math scoring was interrupted by shutdown after {len(items) - len(pending)}"
                    f" of {len(items)} distinct answers were sent to the verifier"
                )
            now = time.monotonic()
            if batch_deadline is not None and now >= batch_deadline:
                self._cut_off_batch(len(pending))
                return results
            if self._hand_out(items, pending, now) and batch_deadline is None:
                batch_deadline = now + budget_s
            self._receive(self._wait_for_workers(now, batch_deadline), results)
            self._enforce_deadlines(pending, results)
        return results

    def _cut_off_batch(self, n_pending: int) -> None:
        """The batch's deadline passed: the items not sent and those still running score None (counted in
        batch_cutoffs); the busy workers are replaced."""
        busy = [w for w in self._workers if w.item is not None]
        self.batch_cutoffs += n_pending + len(busy)
        for w in busy:
            self._replace(w)  # its item stays None

    def _hand_out(self, items: list[tuple[str, str]], pending: deque, now: float) -> bool:
        """Send pending items to the idle, ready workers, each with its deadline (a quick try's is a fraction of the
        timeout); returns whether any was sent. A worker that died since its last message is replaced and its item
        goes back to the front of `pending`."""
        sent = False
        for w in self._workers:
            if w.ready and w.item is None and pending:
                i, quick_try = pending.popleft()
                try:
                    w.conn.send((i, *items[i]))
                except OSError:  # died since its last message: requeue the item, replace the worker
                    pending.appendleft((i, quick_try))
                    self.crashes += 1
                    self._replace(w)
                    continue
                w.item, w.quick_try = i, quick_try
                w.deadline = now + self.timeout_s * (QUICK_TRY_FRACTION if quick_try else 1)
                self.peak_busy = max(self.peak_busy, sum(v.item is not None for v in self._workers))
                sent = True
        return sent

    def _wait_for_workers(self, now: float, batch_deadline: float | None) -> set:
        """Wait for a result, a death, a ready message, the next deadline, or the next interrupt check; returns the
        workers' connections and process sentinels that are ready."""
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        deadlines += [w.started_at + self.startup_timeout_s for w in self._workers if not w.ready]
        deadlines += [batch_deadline] if batch_deadline is not None else []
        waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        timeout = min(_INTERRUPT_POLL_S, max(0.0, min(deadlines, default=now) - time.monotonic()))
        return set(wait(waitables, timeout=timeout))

    def _receive(self, ready: set, results: list[float | None]) -> None:
        """Read what the `ready` workers sent (a result into `results`, or that a worker is ready) and handle the
        ones that died."""
        for w in list(self._workers):
            if w.conn in ready:
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    self._on_death(w, results)
                    continue
                if message[0] == "ready":
                    w.ready = True
                    self._failed_starts.clear()
                elif message[0] == w.item:
                    results[w.item] = message[1]
                    self.items_scored += 1
                    w.item = None
            elif w.process.sentinel in ready:
                self._on_death(w, results)

    def _enforce_deadlines(self, pending: deque, results: list[float | None]) -> None:
        """Replace each worker past its item's deadline: a quick try goes back into `pending` for its full timeout
        (after every other quick try), a full try scores None (counted in timeouts). A worker that does not start
        in time ends the run with an error."""
        now = time.monotonic()
        for w in list(self._workers):
            if w.item is not None and now >= w.deadline:
                if w.quick_try:
                    pending.append((w.item, False))  # its full timeout comes after every other quick try
                else:
                    results[w.item] = None
                    self.timeouts += 1
                self._replace(w)
            elif not w.ready and now >= w.started_at + self.startup_timeout_s:
                raise WorkersDidNotStart(
                    f"a {self.role} worker did not start within {self.startup_timeout_s:.0f} s; {self.startup_hint}"
                )

    def _on_death(self, w: _Worker, results: list[float | None]) -> None:
        w.process.join()
        if not w.ready:
            # killed while starting (a signal, the out-of-memory killer) or a broken install: retry a few times,
            # then say which it looks like
            self.start_failures += 1
            self._failed_starts.append(w.process.exitcode)
            if len(self._failed_starts) >= self.max_start_failures:
                codes = ", ".join(_describe_exit(code) for code in self._failed_starts)
                killed = all(code is not None and code < 0 for code in self._failed_starts)
                hint = (
                    "something kills new processes: the out-of-memory killer, or a memory limit below "
                    f"memory_limit_mb={self.memory_limit_mb}?"
                    if killed
                    else self.startup_hint
                )
                failed, self._failed_starts = tuple(self._failed_starts), []
                raise WorkersDidNotStart(
                    f"{self.role} workers died while starting, {self.max_start_failures} times "
                    f"in a row (exit codes {codes}); {hint}",
                    failed,
                )
            self._replace(w)
            return
        if w.item is not None:
            results[w.item] = None
            self.died_items[w.item] = w.process.exitcode
        self.crashes += 1
        self._replace(w)


def _close_live_pools() -> None:
    """At exit, before multiprocessing's own exit handler: it would SIGTERM the (daemon) workers and wait for them,
    and they ignore SIGTERM."""
    for pool in list(_live_pools):
        pool.close()


atexit.register(_close_live_pools)  # registered after multiprocessing.util's handler (imported above), so runs first
