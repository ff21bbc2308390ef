"""Stopping a live run the way Ctrl-C does (after its current step, with a checkpoint), from another terminal
(`qae stop RUN`) or the dashboard's stop control: both call this module. A process is signalled only when it is
proven to be the run's trainer: the kernel lists it as holding the flock on the run's lock file (/proc/locks), it holds
that file open under the run's own name (/proc/PID/fd), the file has no other name, and the pid recorded in it is
that process's. A stale or planted record, a lock file hard-linked in from another run or from any process's locked
pid file, or a link never gets a stranger's process signalled. Under `accelerate launch` the trainer is the main
process; the stop request reaches every rank through the step boundary's all-reduce (session.should_stop), and the
launcher ends when they do.

A sweep (`qae stop --sweep`): each `qae sweep` process running it holds a shared flock on its folder's sweep.lock
(hold_sweep) for as long as it runs; the holders of that lock, proven the same way, are sent SIGTERM (the sweep then
stops its running points the trainer's way and starts no other), and so is each live run of the sweep, as above."""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.store.run_folder import (
    LOCK_FILE,
    NotARegularFile,
    check_regular_file,
    lock_holder_pid,
    open_regular_file,
    trainer_alive,
)

SWEEP_LOCK_FILE = "sweep.lock"  # in a sweep's folder: every `qae sweep` process running it holds a shared flock


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


def holders_by_its_name(lock_file: Path) -> set[int]:
    """The pids the kernel lists as holding a flock on `lock_file` that hold it open under this very name. A holder
    of the same file under another name (a hard link: another process's locked pid file, another run's lock) is not
    one; nor is anyone where the file is a link, a FIFO or has other names (NotARegularFile)."""
    if not check_regular_file(lock_file, writing=True):  # (writing: a file of several names is refused too)
        return set()
    info = os.stat(lock_file, follow_symlinks=False)
    name = os.path.realpath(lock_file)
    return {pid for pid in lock_holders(lock_file) if _holds_open(pid, name, (info.st_dev, info.st_ino))}


def _holds_open(pid: int, name: str, file_id: tuple[int, int]) -> bool:
    """Whether process `pid` has the file `file_id` (device, inode) open under the path `name`."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's process (then it could not be signalled either)
        return False
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link) == name and (os.stat(link).st_dev, os.stat(link).st_ino) == file_id:
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def trainer_of(folder: Path) -> int:
    """The pid of the process proven to be training the run in `folder` (see the module's docstring); QAEUserError
    when none is."""
    try:
        holders = holders_by_its_name(folder / LOCK_FILE)
    except NotARegularFile as err:
        raise QAEUserError(
            f"stop: {err} Nothing was signalled: no process holding it is proven to be the trainer of '{folder.name}'."
        ) from None
    if not trainer_alive(folder):
        raise QAEUserError(
            f"run: '{folder.name}' is not running (no trainer holds it). Nothing was signalled; "
            f"continue it with `qae train --resume {folder.name}`."
        )
    recorded = lock_holder_pid(folder)
    if recorded is None or recorded not in holders:
        raise QAEUserError(
            f"run: '{folder.name}' is held by a process this machine's lock table does not name as "
            f"the one its lock file records ({recorded}) and that holds the file under the run's own "
            "name: another machine's trainer on a shared folder, or a record that is not qae's. "
            "Nothing was signalled; stop it where it runs."
        )
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


def hold_sweep(sweep_folder: Path) -> int:
    """Take a shared flock on the sweep's lock file (several `qae sweep` processes may run one sweep); returns the fd
    that holds it, to close when the sweep process is done."""
    fd = open_regular_file(sweep_folder / SWEEP_LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _sweep_holders(sweep_folder: Path) -> set[int]:
    """The `qae sweep` processes proven to hold the sweep's lock (holders_by_its_name); none where it is planted."""
    try:
        return holders_by_its_name(sweep_folder / SWEEP_LOCK_FILE)
    except NotARegularFile:
        return set()


def sweep_running(sweep_folders: list[Path], run_folders: list[Path]) -> bool:
    """Whether a `qae sweep` process holds one of the sweeps or a trainer holds one of their runs."""
    return any(_sweep_holders(folder) for folder in sweep_folders) or any(
        trainer_alive(folder) for folder in run_folders
    )


def stop_sweep(
    name: str, sweep_folders: list[Path], run_folders: list[Path], timeout_s: float, on_signalled=None
) -> list[Path]:
    """SIGTERM every `qae sweep` process holding one of `sweep_folders` and the trainer of every live run among
    `run_folders`, then wait up to `timeout_s` for all of them to let go. Returns the runs that were live; raises
    QAEUserError when nothing was running, or still runs after the wait. `on_signalled()`: once all were signalled."""
    sweeps = {pid for folder in sweep_folders for pid in _sweep_holders(folder)}
    live = [folder for folder in run_folders if trainer_alive(folder)]
    if not sweeps and not live:
        raise QAEUserError(
            f"sweep: nothing of sweep '{name}' is running (no `qae sweep` process, no trainer of its "
            "runs). Nothing was signalled; re-run the sweep's command to continue it."
        )
    for pid in sweeps:  # first: a stopping sweep starts no other point
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended since the kernel listed it
            pass
    for folder in live:
        try:
            request_stop(folder)
        except QAEUserError:  # it let go meanwhile (or is another machine's: its sweep stops it)
            pass
    if on_signalled is not None:
        on_signalled()
    deadline = time.monotonic() + timeout_s
    while sweep_running(sweep_folders, run_folders):
        if time.monotonic() > deadline:
            raise QAEUserError(
                f"stop: sweep '{name}' is still running after {timeout_s:g} s (a long step, or a "
                "large checkpoint). It will stop on its own; check with `qae runs`."
            )
        time.sleep(0.5)
    return live
