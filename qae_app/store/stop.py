"""Stopping a live run the way Ctrl-C does (after its current step, with a checkpoint), from another terminal
(`qae stop RUN`) or the dashboard's stop control: both call this module. The trainer to signal is the process that
holds the run's lock right now, which the kernel says (/proc/locks), not a pid read from a file: a stale or planted
record never gets a stranger's process signalled. Under `accelerate launch` that is the main process; the stop
request reaches every rank through the step boundary's all-reduce (session.should_stop), and the launcher ends when
they do."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.store.run_folder import LOCK_FILE, lock_holder_pid, trainer_alive


def lock_holders(lock_file: Path) -> set[int]:
    """The pids that hold a flock on `lock_file`, as the kernel lists them (Linux's /proc/locks)."""
    try:
        info = os.stat(lock_file, follow_symlinks=False)
        table = Path("/proc/locks").read_text()
    except OSError:
        return set()
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            holders.add(int(fields[4]))
    return holders


def trainer_of(folder: Path) -> int:
    """The pid of the process training the run in `folder`; QAEUserError when none is."""
    if not trainer_alive(folder):
        raise QAEUserError(f"run: '{folder.name}' is not running (no trainer holds it). Nothing was signalled; "
                           f"continue it with `qae train --resume {folder.name}`.")
    recorded = lock_holder_pid(folder)
    if recorded is None or recorded not in lock_holders(folder / LOCK_FILE):
        raise QAEUserError(f"run: '{folder.name}' is held by a process this machine's lock table does not name as "
                           f"the one its lock file records ({recorded}): another machine's trainer on a shared "
                           "folder, or a record that is not qae's. Nothing was signalled; stop it where it runs.")
    return recorded


def request_stop(folder: Path) -> int:
    """SIGTERM the run's trainer (it stops after its current step, with a checkpoint) and return its pid, without
    waiting; QAEUserError when no trainer of this machine holds the run."""
    pid = trainer_of(folder)
    os.kill(pid, signal.SIGTERM)
    return pid


def stop_run(folder: Path, timeout_s: float, on_wait=None, on_signalled=None) -> bool:
    """SIGTERM the run's trainer and wait up to `timeout_s` for it to let the run go (its checkpoint written); True
    when it did. `on_signalled()` is called once the trainer was found and signalled."""
    request_stop(folder)
    if on_signalled is not None:
        on_signalled()
    deadline = time.monotonic() + timeout_s
    while trainer_alive(folder):
        if time.monotonic() > deadline:
            return False
        if on_wait is not None:
            on_wait()
        time.sleep(0.5)
    return True
