"""The full plant matrix of issue 40 (every file x every variant x every command, tests/plants.py), run in real
subprocesses: tests/scripts/plant_commands.py runs every command on a batch of cases in one process, so torch loads
once a batch. A test takes the plants of one planted file (`plants_of`), so no test runs for long and the matrix
is spread over test files, and so over xdist's workers (tests/cli/test_planted_run_folders.py for the run's own
files, tests/cli/test_planted_checkpoints.py for its checkpoint's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.plants import COMMANDS, OTHER, RUN, SECRET, Plant, all_plants, make_case, snapshot

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "scripts" / "plant_commands.py"
BATCH = 16  # cases per driver process
DRIVER_TIMEOUT_S = 600  # a backstop only: the driver's own watchdog ends a hung command after HANG_S

# what each command does on the untouched folder: `stop` on a run nobody trains says so, exit 2
CONTROL_EXIT = {name: (2 if name == "stop" else 0) for name, _ in COMMANDS}


def plants_of(target: str) -> list[Plant]:
    """Every plant of the matrix whose planted file (or folder) is `target`."""
    return [plant for plant in all_plants() if plant.target == target]


def planted_targets() -> list[str]:
    return list(dict.fromkeys(plant.target for plant in all_plants()))


def file_named(plant: Plant) -> str:
    """What a refusal must name: the planted file, or the folder for a linked folder."""
    return Path(plant.target).name.removesuffix(".wal") if plant.target.endswith(".wal") else Path(plant.target).name


def problems(plant: Plant, result: dict) -> list[str]:
    """What is wrong with one command's result on one plant (empty when it behaved)."""
    name, output, found = result["command"], result["output"], []
    if result.get("ran_payload"):
        found.append("the planted payload ran")
    if result.get("exception"):
        found.append("traceback: " + result["exception"][-600:])
    if SECRET in output:
        found.append("printed a file from outside the run folder")
    if result["exit"] not in (0, 2):
        found.append(f"exit {result['exit']}")
    if result["exit"] == 2 and CONTROL_EXIT[name] == 0:
        if output.count("error:") != 1:
            found.append(f"{output.count('error:')} error messages")
        if file_named(plant) not in output and "checkpoint" not in output:
            found.append(f"the refusal does not name {file_named(plant)}")
    if name in ("runs", "runs-after") and result["exit"] == 0 and not re.search(rf"^{OTHER}\s", output, re.M):
        found.append(f"the other run '{OTHER}' is not listed")
    if name == "show-other" and result["exit"] != 0:
        found.append(f"the other run '{OTHER}' is not shown")
    return [f"{plant.name} / {name}: {what}" for what in found]


def run_driver(cases: list[Path]) -> tuple[list[dict], str | None, str]:
    """Each case's command results from one driver process; the (case, command) it hung on, if it did."""
    process = subprocess.run(
        [sys.executable, str(DRIVER), *map(str, cases)],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
        env=dict(os.environ, COLUMNS="300"),
    )
    results, started = [], None
    for line in process.stdout.splitlines():
        record = json.loads(line)
        if record.get("start"):
            started = record
        else:
            results.append(record)
            started = None
    hung = None if started is None else f"{Path(started['case']).name} / {started['command']}"
    return results, hung, process.stderr[-3000:]


def matrix_problems(base: Path, tmp_path: Path, plants: list[Plant]) -> list[str]:
    """Every command on every plant, each case made, run in a driver process, then removed (the cases of the whole
    matrix together would take gigabytes): what went wrong, as `problems` says it, plus hangs and writes outside
    the run folder."""
    found = []
    for start in range(0, len(plants), BATCH):
        batch = {}
        for i, plant in enumerate(plants[start : start + BATCH], start):
            case = tmp_path / f"case-{i:03d}"
            case.mkdir()
            runs = make_case(base, case, plant)
            batch[case] = (plant, runs, snapshot(case, leave_out=(runs / RUN, case / "export")))
        pending = list(batch)
        while pending:
            results, hung, stderr = run_driver(pending)
            for result in results:
                found += problems(batch[Path(result["case"])][0], result)
            if hung is None:
                break
            found.append(f"hung: {hung}\n{stderr}")
            pending = pending[pending.index(tmp_path / hung.split(" / ")[0]) + 1 :]
        for case, (plant, runs, before) in batch.items():
            if snapshot(case, leave_out=(runs / RUN, case / "export")) != before:
                found.append(f"{plant.name}: a write outside the run folder")
            shutil.rmtree(case)
    return found
