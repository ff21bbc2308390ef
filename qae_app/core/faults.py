"""Fault injection for the crash-safety tests: `QAE_FAULT=<point>@<step>` kills this process with SIGKILL (as
`kill -9` would) when execution reaches that point at that step, `QAE_FAULT=raise:<point>@<step>` raises there, and
`QAE_FAULT=term:<point>@<step>` sends SIGTERM to this process's group (as systemd or Slurm do), and
`QAE_FAULT=hup:<point>@<step>` SIGHUP (as a terminal that closes does).

Points: `db_commit` (inside a step's database transaction, before COMMIT), `after_step_rows` (rows queued in the store,
before they are written), `checkpoint_rename` (checkpoint written to `step-N.tmp`, before the rename), `finishing` (the
run is writing its final status; the step is the last one done), `scoring` (responses sent to the verifier),
`verifier_start` (math-verify worker number N of its pool, before it reports ready), `done` (`qae train` said the run
is done; the step is the last one done). `<point>@*` matches every N. Unset,
this costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal


class InjectedFault(RuntimeError):
    pass


def fault_point(point: str, step: int) -> None:
    spec = os.environ.get("QAE_FAULT")
    if not spec:
        return
    action, _, target = spec.rpartition(":")
    if target not in (f"{point}@{step}", f"{point}@*"):
        return
    if action == "raise":
        raise InjectedFault(f"injected fault at {point}, step {step}")
    if action in ("term", "hup"):
        os.killpg(os.getpgrp(), signal.SIGTERM if action == "term" else signal.SIGHUP)
        return
    os.kill(os.getpid(), signal.SIGKILL)
