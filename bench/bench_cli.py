"""Benchmark: the reading commands start at once. `qae --help`, `qae runs`, `qae show` and `qae rollouts` import
neither torch nor transformers (tests/structure/test_structure.py asserts it); this measures their wall time as a user
meets it, a fresh `qae` process each time, on a runs dir of 20 runs (synthetic, 300 steps each, written through the real
store.writer.RunWriter), against `python -c "import torch"` for scale.

    python bench/bench_cli.py [--runs 20] [--repeats 5]

Last line: `qae runs` median seconds over the 1 s goal. Each command's median goes to the results log
(bench/harness.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
QAE = str(Path(sys.executable).parent / "qae")
GOAL_S = 1.0  # `qae runs`


def wall(command: list[str], repeats: int) -> tuple[float, float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    from tests.synthetic import write_run

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runs_dir:
        for i in range(args.runs):
            write_run(Path(runs_dir), f"run-{i:02d}", steps=args.steps, prompts_per_step=8, group_size=16, seed=i)
        commands = {
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "qae --help": [QAE, "--help"],
            f"qae runs ({args.runs} runs)": [QAE, "runs", "--runs-dir", runs_dir],
            "qae show": [QAE, "show", "run-00", "--runs-dir", runs_dir],
            "qae rollouts": [QAE, "rollouts", "run-00", "--runs-dir", runs_dir],
        }
        results = {}
        for name, command in commands.items():
            results[name] = wall(command, args.repeats)
            median, low, high = results[name]
            print(f"{name:28s} median {median:6.2f} s  (min {low:.2f}, max {high:.2f}, {args.repeats} runs)")
    runs = results[f"qae runs ({args.runs} runs)"][0]
    print(f"qae runs on {args.runs} runs: {runs:.2f} s against the 1 s goal: ratio {runs / GOAL_S:.2f}")
    for name, (median, low, high) in results.items():
        report(
            f"bench_cli: {name}",
            round(median, 3),
            f"< {GOAL_S:g}" if name.startswith("qae runs") else None,
            unit="s",
            note=f"median of {args.repeats} runs (min {low:.2f}, max {high:.2f}), a fresh process each",
        )


if __name__ == "__main__":
    main()
