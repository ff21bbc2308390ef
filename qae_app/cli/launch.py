"""The processes of an `accelerate launch`: each rank ends with its launcher, and a finished run tears its process
group down before the interpreter exits."""

from __future__ import annotations

import sys

# set by the `qae` entry point and `python -m qae_app.cli`: this process is the command's own, and ends with it (a
# test that calls a command in its own process keeps its signal handling)
own_process = False


def end_with_the_launcher() -> None:
    """Under `accelerate launch` (torch's elastic launcher) every rank runs in a session of its own, so a kill -9 of
    the launcher's process group never reaches it: the ranks trained on, holding the run's lock. Linux's parent-death
    signal ends a rank with the launcher that started it; the run resumes from its newest checkpoint."""
    import os

    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the signal was asked for
        os._exit(1)


def end_processes() -> None:
    """Tear down the process group of an `accelerate launch` run that finished: left to the interpreter's exit, gloo's
    threads were destroyed still running and a process aborted ('terminate called without an active exception',
    SIGABRT) after its run had finished and been stored. Whatever else holds the group must let go first (the
    trainer's release_models: FSDP2's modules hold it), or it outlives this call."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def done_with_the_run() -> None:
    """The run is stored (its final status written, its lock let go): from here the process only says so and exits. A
    SIGTERM or SIGHUP now (a supervisor, `qae stop` a moment too late, the terminal closing) changes nothing; without a
    handler it killed the process by the signal after "done" (exit -15), which reads as a failed run."""
    if own_process:
        import signal

        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda signum, frame: None)
