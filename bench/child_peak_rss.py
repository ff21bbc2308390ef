"""Peak memory of a benchmark measured from outside: run a script as a child process and read its peak resident set
size from the kernel when it exits (`os.wait4`, what `/usr/bin/time -v` reports)."""

import argparse
import os
import subprocess
import sys


def peak_rss_of_child(script: str, argv: list[str]) -> tuple[int, str]:
    """(peak RSS in bytes of `python script *argv --child`, its output); exits with the output if the child failed."""
    child = subprocess.Popen([sys.executable, os.path.abspath(script), *argv, "--child"], stdout=subprocess.PIPE,
                             text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait for it again)
    if child.returncode != 0:
        raise SystemExit(f"the child process failed (exit code {child.returncode}); output:\n{output}")
    return usage.ru_maxrss * 1024, output  # (kilobytes on Linux)


def add_child_options(parser: argparse.ArgumentParser) -> None:
    """The options of the child side: torch's thread count, and the hidden --child that `peak_rss_of_child` adds."""
    parser.add_argument("--threads", type=int, default=None, help="torch threads in the child (default: torch's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def ran_as_child(args: argparse.Namespace, work) -> bool:
    """In the child (--child): set torch's threads, run `work(args)` and say so; in the parent: False."""
    if not args.child:
        return False
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work(args)
    return True
