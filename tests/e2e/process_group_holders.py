"""`qae train` as the `qae` entry point runs it, under `accelerate launch`, reporting at exit what still holds a
torch.distributed ProcessGroup: run as `accelerate launch ... tests/e2e/process_group_holders.py OUT train ...`.

The report is written by an atexit handler, which runs before the interpreter's teardown and without a garbage
collection of its own, so it sees what that teardown would have destroyed: a process group still held then has gloo's
threads torn down with the interpreter, and a finished rank could abort (SIGABRT) after its run was stored."""

import atexit
import gc
import json
import os
import sys


def holders_of_process_groups() -> list[str]:
    """Each live object (collected or not yet) holding a ProcessGroup in an attribute, a dict or a list: its type and
    where it holds it. (ProcessGroup objects themselves are not tracked by the garbage collector.)"""
    import torch.distributed as dist

    found = []
    for holder in gc.get_objects():
        try:
            if isinstance(holder, dict):
                items = holder.items()
            elif isinstance(holder, (list, tuple)):
                items = enumerate(holder)
            elif hasattr(holder, "__dict__") and not isinstance(holder, type):
                items = vars(holder).items()
            else:
                continue
            found += [f"{type(holder).__name__}.{key}" for key, value in items if isinstance(value, dist.ProcessGroup)]
        except Exception:  # (an object whose attributes cannot be listed holds nothing we can see)
            continue
    return found


def report(out: str) -> None:
    rank = os.environ.get("RANK", "0")
    with open(f"{out}.{rank}.json", "w") as file:
        json.dump(holders_of_process_groups(), file)


if __name__ == "__main__":
    atexit.register(report, sys.argv.pop(1))
    from qae_app.cli import launch
    from qae_app.cli.main import app

    launch.own_process = True  # as the `qae` entry point sets it
    sys.argv[0] = "qae"
    app()
