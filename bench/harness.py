"""What every benchmark in bench/ measures with and reports to: paired timing, a child process's peak memory, and the
results log.

Paired timing, for the benchmarks that compare two sides (A against B): run them alternately, one pair at a time, and
report the median of the per-pair ratios A/B with its spread. Why pairs: on a shared machine the load drifts over
minutes. Running every A and then every B puts that drift on one side only; a pair's two timings are seconds apart, so
their ratio is what the load leaves alone, and the spread of the ratios over pairs says how much to believe the
median. Within a pair the order alternates (A then B, then B then A), so neither side always runs second (a warm
cache, a finished background job).

    ratios = pair_ratios(a_times, b_times)          # a_times[i] and b_times[i] measured next to each other
    print(f"gated / dense {describe(ratios)}")       # "0.33x (middle half 0.28-0.38, min-max 0.21-0.45, 20 pairs)"

Peak memory, measured from outside: run a script as a child process and read its peak resident set size from the
kernel when it exits (`os.wait4`, what `/usr/bin/time -v` reports): `peak_rss_of_child`, `add_child_options`,
`ran_as_child`.

The results log, `bench/results.jsonl`: each benchmark ends with `report(...)` for its headline figure(s), which
appends one JSON line (the figure, its unit and goal, whether it was met, when, on which commit, under what load, on
what machine, by which command). `python bench/results.py render` makes docs/performance.md from it.

    report("bench_cli: qae runs, 20 runs", 0.80, "< 1", unit="s")
    report("vs_trl: qae/TRL step time per pair, arith G=4", s.median, "<= 0.8", unit="x", spread=s)

`QAE_BENCH_RESULTS=PATH` sends the lines elsewhere (`/dev/null`: a trial run that should not count; the tests do so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
RESULTS_LOG = ROOT / "bench" / "results.jsonl"
RESULTS_ENV = "QAE_BENCH_RESULTS"  # another log path: the tests' and trial runs' results stay out of the real one
GENERATED = ("bench/results.jsonl", "docs/performance.md")  # writing a result does not make the tree dirty

# ---------------------------------------------------------------------------------------------------------------
# paired timing


def pair_order(index: int) -> tuple[int, int]:
    """Which side runs first in pair `index`: (0, 1) for even pairs, (1, 0) for odd ones."""
    return (0, 1) if index % 2 == 0 else (1, 0)


class GatedChild:
    """One side of a benchmark in a child process that prints `gate` (a line) between its steps and waits there for
    the parent's go (a line on its stdin): the parent lets the sides step in turn, so load that drifts within seconds
    falls on all alike, and their setups run together, untimed."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], gate: str):
        self.name = name  # in the failure message: "the float32 arm", "qae run"
        self.gate = gate
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env
        )
        self.output: list[str] = []  # every line it printed but the gates

    def wait_at_gate(self) -> None:
        """Read its output up to its next gate (its setup, or the step it was let go for); fail if it ends first."""
        for line in self.proc.stdout:
            if line.startswith(self.gate):
                return
            self.output.append(line)
        self.fail()

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def fail(self) -> NoReturn:
        self.kill()
        self.stderr.seek(0)
        sys.stderr.write("".join(self.output)[-3000:] + self.stderr.read()[-6000:])
        raise SystemExit(f"{self.name} failed (exit {self.proc.returncode})")


def alternate(
    side_a: Callable[[int], float], side_b: Callable[[int], float], pairs: int
) -> tuple[list[float], list[float]]:
    """Run `side_a(i)` and `side_b(i)` for i in range(pairs), in the order pair_order(i) gives; each returns the
    seconds it measured. Returns (a_times, b_times), pair by pair."""
    sides = (side_a, side_b)
    times: tuple[list[float], list[float]] = ([], [])
    for index in range(pairs):
        for which in pair_order(index):
            times[which].append(sides[which](index))
    return times


def pair_ratios(a_times: Sequence[float], b_times: Sequence[float]) -> list[float]:
    """a_times[i] / b_times[i] for each pair."""
    if len(a_times) != len(b_times) or not a_times:
        raise ValueError(
            f"paired timings need the same, non-zero count on both sides: {len(a_times)} and {len(b_times)}"
        )
    return [a / b for a, b in zip(a_times, b_times, strict=True)]


@dataclass(frozen=True)
class RatioSpread:
    median: float
    low_quartile: float  # the middle half of the per-pair ratios lies between the quartiles
    high_quartile: float
    low: float
    high: float
    pairs: int


def spread(ratios: Sequence[float]) -> RatioSpread:
    """Median, quartiles (statistics.quantiles, inclusive method) and extremes of per-pair ratios."""
    if len(ratios) == 1:
        (only,) = ratios
        return RatioSpread(only, only, only, only, only, 1)
    low_quartile, _, high_quartile = statistics.quantiles(ratios, n=4, method="inclusive")
    return RatioSpread(statistics.median(ratios), low_quartile, high_quartile, min(ratios), max(ratios), len(ratios))


def describe(ratios: Sequence[float]) -> str:
    """'0.33x (middle half 0.28-0.38, min-max 0.21-0.45, 20 pairs)'; with fewer than 4 pairs the ratios themselves."""
    s = spread(ratios)
    if s.pairs < 4:
        return f"{s.median:.2f}x (per pair {', '.join(f'{r:.2f}' for r in ratios)})"
    return (
        f"{s.median:.2f}x (middle half {s.low_quartile:.2f}-{s.high_quartile:.2f}, min-max {s.low:.2f}-"
        f"{s.high:.2f}, {s.pairs} pairs)"
    )


# ---------------------------------------------------------------------------------------------------------------
# peak memory of a child process


def peak_rss_of_child(script: str, argv: list[str]) -> tuple[int, str]:
    """(peak RSS in bytes of `python script *argv --child`, its output); exits with the output if the child failed."""
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(script), *argv, "--child"], stdout=subprocess.PIPE, text=True
    )
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


# ---------------------------------------------------------------------------------------------------------------
# the results log

NUMBER = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"
GOAL = re.compile(rf"(<=|>=|==|<|>)\s*{NUMBER}")
GOAL_RANGE = re.compile(rf"between\s+{NUMBER}\s+and\s+{NUMBER}")  # both ends included
COMPARE = {"<=": float.__le__, ">=": float.__ge__, "==": float.__eq__, "<": float.__lt__, ">": float.__gt__}


def goal_met(value: float, goal: str | None) -> bool | None:
    """Whether `value` meets `goal` ("<= 0.8", ">= 30", "< 1", "== 0", "between 0.8 and 1.2"); None without a goal."""
    if goal is None:
        return None
    if match := GOAL.fullmatch(goal.strip()):
        operator, bound = match.groups()
        return COMPARE[operator](float(value), float(bound))
    if match := GOAL_RANGE.fullmatch(goal.strip()):
        low, high = map(float, match.groups())
        return low <= value <= high
    raise ValueError(
        f"goal: '{goal}' is not a comparison with a number. Write it as '<= 0.8', '>= 30', '< 1', '> 2', "
        "'== 0' or 'between 0.8 and 1.2' (in the figure's unit), or None for a figure without a goal"
    )


def results_log() -> Path:
    """Where report() appends: $QAE_BENCH_RESULTS if set, else bench/results.jsonl."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_LOG)


def git_commit(root: Path = ROOT) -> str | None:
    """HEAD's short hash, '+dirty' when tracked files differ from it (as `git describe --dirty`: untracked files and
    the results log and its page do not count); None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                *(f":(exclude){path}" for path in GENERATED),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if changed else "")


# the /proc/cpuinfo flags that decide which matmul kernels a figure ran on: vector width, fused multiply-add, and the
# bf16 / int8 instructions (AVX512_BF16, AMX) that make --rollout-dtype and --mixed-precision bf16 fast on a CPU
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)


def cpu_facts(cpuinfo: str) -> tuple[str | None, list[str]]:
    """(the CPU's model name, which of CPU_FLAGS it has) from the text of /proc/cpuinfo (x86 'flags', Arm
    'Features'); (None, []) where it names neither."""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith(("model name", "Model"))),
        None,
    )
    flags_line = next(
        (line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))), ""
    )
    present = set(flags_line.split())
    return model, [flag for flag in CPU_FLAGS if flag in present]


def machine() -> dict:
    """The machine's facts a figure depends on: its cores (and those this process may use), its CPU model and the
    matmul-relevant CPU flags it has (CPU_FLAGS)."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model, flags = cpu_facts(cpuinfo.read())
        cpu = model or cpu
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": os.cpu_count(), "usable_cores": usable, "cpu": cpu, "cpu_flags": flags}


def cpu_label(machine_facts: dict | None) -> str:
    """'AMD EPYC (avx2, fma)': the CPU and its flags as a figure's line names them; '' when the line names none."""
    facts = machine_facts or {}
    cpu = facts.get("cpu") or ""
    flags = facts.get("cpu_flags")
    return f"{cpu} ({', '.join(flags)})" if cpu and flags else cpu


def invoking_command() -> str:
    """The command that ran this benchmark, as a user would type it: 'python bench/bench_cli.py --runs 5', or
    '.venv-vllm/bin/python ...' when an environment other than the README's .venv ran it (the vLLM one)."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    python = "python"
    environment = Path(sys.prefix).name
    if sys.prefix != sys.base_prefix and environment != ".venv":  # a virtual environment, not the README's
        python = f"{environment}/bin/python" if Path(sys.prefix).parent == ROOT else f"{sys.prefix}/bin/python"
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:  # under accelerate launch (its config, FSDP or not, is the bench's to say in its note)
        accelerate = "accelerate" if python == "python" else python.removesuffix("python") + "accelerate"
        return shlex.join([accelerate, "launch", "--num_processes", str(processes), str(shown), *sys.argv[1:]])
    return shlex.join([python, str(shown), *sys.argv[1:]])


def report(
    name: str,
    value: float,
    goal: str | None,
    *,
    unit: str,
    command: str | None = None,
    note: str | None = None,
    spread: RatioSpread | None = None,
    log: Path | None = None,
) -> dict:
    """Append one figure to the results log (default: results_log()) as a JSON line, and return the line's fields.

    name: what was measured, '<script>: <what>', the same at every run (the page shows the latest of each name).
    goal: a comparison in the figure's unit ('<= 0.8', '>= 30'), or None; the line says whether it was met.
    command: what to run to measure it again (default: this process's command line). spread: a paired ratio's
    middle half and min-max (value is then its median)."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"report: {name} measured {value}, which the log cannot hold. Report a finite number")
    entry = {
        "name": name,
        "value": value,
        "unit": unit,
        "goal": goal,
        "met": goal_met(value, goal),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "load": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "machine": machine(),
        "command": command or invoking_command(),
        "note": note,
    }
    if spread is not None:
        entry["spread"] = {
            "middle_half": [round(spread.low_quartile, 4), round(spread.high_quartile, 4)],
            "min_max": [round(spread.low, 4), round(spread.high, 4)],
            "pairs": spread.pairs,
        }
    path = log or results_log()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:  # one write of one line: appends from two processes do not interleave
        out.write(json.dumps(entry) + "\n")
    return entry  # (nothing printed: the benchmark's own last line stays the last one)


def read_results(path: Path | None = None) -> list[dict]:
    """Every line of the log, in file order."""
    path = path or RESULTS_LOG
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg}). Fix or delete that line") from err
    return entries


def latest(entries: Sequence[dict]) -> list[dict]:
    """The latest figure of each name, names in the order they first appear (withdrawals left out: `withdrawals`).
    Latest: the greatest date (an ISO date or date-time; none counts as oldest), and of equal dates the later line in
    the log."""
    first_seen: dict[str, int] = {}
    newest: dict[str, tuple[str, int, dict]] = {}
    for index, entry in enumerate(entries):
        if "withdrawn" in entry:
            continue
        name = entry["name"]
        first_seen.setdefault(name, index)
        key = (entry.get("date") or "", index, entry)
        if name not in newest or key[:2] > newest[name][:2]:
            newest[name] = key
    return [newest[name][2] for name in sorted(first_seen, key=first_seen.get)]


def withdraw(name: str, reason: str, *, command: str, log: Path | None = None) -> dict:
    """Append a withdrawal of the figures named `name` to the results log: they stay in the log as measured, and the
    page marks the latest one withdrawn, with `reason` (what was wrong with the goal or the limit it was judged
    against), until a newer figure of that name is measured. `command`: what replaces it, or how it was found out."""
    if not reason.strip():
        raise ValueError(f"withdraw: {name} needs a reason, which the page shows beside the figure")
    entry = {
        "withdrawn": name,
        "reason": reason,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "machine": machine(),
        "command": command,
    }
    path = log or results_log()
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")
    return entry


def withdrawals(entries: Sequence[dict]) -> dict[str, dict]:
    """The latest withdrawal of each name that has one (`withdraw`)."""
    found: dict[str, dict] = {}
    for entry in entries:
        if "withdrawn" in entry and entry["date"] >= found.get(entry["withdrawn"], {}).get("date", ""):
            found[entry["withdrawn"]] = entry
    return found
