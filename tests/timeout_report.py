"""Says which test ran past pytest-timeout's limit, and where it was, when it ends its worker.

pytest-timeout's thread method (pyproject.toml: it also ends a test blocked in C code) writes the stacks to the
worker's terminal and ends the process with os._exit. Under pytest-xdist nobody reads that terminal: the run said only
"[gw0] node down: Not properly terminated" and "worker 'gw0' crashed while running <test>", the same words as a
segfault or the OOM killer. Here the timer, run out, writes what happened and every thread's stack to a file; the
controller adds it to the crashed test's report. Without xdist pytest-timeout's own report reaches the terminal."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import pytest

NOTES = "QAE_TEST_TIMEOUT_NOTES"  # the folder the workers write their notes in (set by the controller, inherited)


def note_path(nodeid: str) -> Path:
    return Path(os.environ[NOTES]) / (hashlib.sha1(nodeid.encode()).hexdigest() + ".txt")


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist: before it starts any worker
        os.environ[NOTES] = tempfile.mkdtemp(prefix="qae-test-timeouts-")


def _thread_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "".join(
        f"\n--- thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    )


def _timed_out(nodeid: str, timeout_s: float) -> None:
    note = (
        f"{nodeid} ran past pytest-timeout's {timeout_s:g} s (pyproject.toml's `timeout`); its process was ended. "
        f"Where each thread was:{_thread_stacks()}"
    )
    try:
        note_path(nodeid).write_text(note)
    finally:
        os._exit(1)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method, with a note the controller reads (the signal method fails the test itself)."""
    worker = hasattr(item.config, "workerinput")
    if not worker or settings.method != "thread" or not settings.timeout or settings.timeout <= 0:
        return None  # pytest-timeout's own
    timer = threading.Timer(settings.timeout, _timed_out, (item.nodeid, settings.timeout))
    timer.name, timer.daemon = "test timeout", True
    timer.start()
    item.cancel_timeout = timer.cancel  # pytest-timeout's cancel hook calls it
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report, sched) -> None:
    """In the controller: the crashed test's report says why, when a timeout was the crash."""
    note = note_path(crashitem)
    if note.is_file():
        report.longrepr = f"{report.longrepr}\n{note.read_text()}"
