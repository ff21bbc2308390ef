"""The plant harness (issue 40): every file of a real run folder replaced by each hostile variant (tests/plants.py),
and every command that reads run folders run on it. Over every plant and command: no payload runs, nothing outside
the run folder is written, no command hangs, no traceback; a refusal is exit 2 with one message naming the file,
and the untouched run beside it is still listed and shown.

The full matrix (every file x every variant x every command) runs the commands in real subprocesses
(tests/scripts/plant_commands.py, one process per batch of cases, so torch loads once a batch) and is slow; the quick
set runs the torch-free readers in this process on a subset of plants, one of each kind of harm."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from tests.plants import (
    COMMANDS,
    MARKER,
    OTHER,
    QUICK,
    RUN,
    SECRET,
    Plant,
    all_plants,
    make_base_run,
    make_case,
    snapshot,
)

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "scripts" / "plant_commands.py"
READERS = ("runs", "show", "show-other", "rollouts", "compare", "tag")
BATCH = 12  # cases per driver process
DRIVER_TIMEOUT_S = 3600  # a backstop only: the driver's own watchdog ends a hung command after HANG_S


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The one small real run every case copies (two steps of the built-in model, a checkpoint, labels, pending/)."""
    return make_base_run(tmp_path_factory.mktemp("base"))


def file_named(plant: Plant) -> str:
    """What a refusal must name: the planted file, or the folder for a linked folder."""
    return Path(plant.target).name.removesuffix(".wal") if plant.target.endswith(".wal") else Path(plant.target).name


# what each command does on the untouched folder: `stop` on a run nobody trains says so, exit 2
CONTROL_EXIT = {name: (2 if name == "stop" else 0) for name, _ in COMMANDS}


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


def run_in_process(runs: Path, names=READERS) -> list[dict]:
    runner, results = CliRunner(), []
    for name, args in COMMANDS:
        if name not in names:
            continue
        result = runner.invoke(app, [*args, "--runs-dir", str(runs)], env={"COLUMNS": "300"})
        exception = None if isinstance(result.exception, (SystemExit, type(None))) else repr(result.exception)
        results.append({"command": name, "exit": result.exit_code, "exception": exception, "output": result.output})
    return results


@pytest.mark.parametrize(
    "plant", QUICK + [Plant("qae.duckdb", "link-out"), Plant("qae.duckdb", "fifo")], ids=lambda plant: plant.name
)
def test_a_planted_file_breaks_no_reader(base, tmp_path, plant):
    runs = make_case(base, tmp_path, plant)
    before = snapshot(tmp_path, leave_out=(runs / RUN,))
    found, outputs = [], []
    for result in run_in_process(runs):
        result["ran_payload"] = (tmp_path / MARKER).exists()
        if problems(plant, result):
            outputs.append(f"--- {result['command']} (exit {result['exit']}):\n{result['output'][-2000:]}")
        found += problems(plant, result)
    assert snapshot(tmp_path, leave_out=(runs / RUN,)) == before, "a write outside the run folder"
    assert found == [], "\n".join(outputs)


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


@pytest.mark.slow
def test_every_plant_under_every_command(base, tmp_path):
    """Every file x every variant x every command (tests/plants.py): each case made, run in a driver process, then
    removed (the cases together would take gigabytes)."""
    plants, found = all_plants(), []
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
    assert found == []


@pytest.mark.parametrize("variant", ["config-nan-text", "config-huge-int", "config-bad-records"])
def test_settings_qae_did_not_write_are_refused_by_name(base, tmp_path, variant):
    """L10: a crafted `config` column ('NaN' for a count, a 4,000-digit integer, a launch record of text) ended `qae
    show`, `qae compare` and `qae runs` in tracebacks. The settings are checked as qae writes them: the run is refused
    in one message naming its database, and listed as unreadable with why beside the other runs."""
    runs = make_case(base, tmp_path, Plant("qae.duckdb", variant))
    results = {result["command"]: result for result in run_in_process(runs, names=("runs", "show", "compare"))}
    for name in ("show", "compare"):
        said = " ".join(results[name]["output"].split())
        assert results[name]["exit"] == 2 and said.count("error:") == 1, (name, said)
        assert f"{runs / RUN / 'qae.duckdb'} holds settings qae did not write" in said, (name, said)
    listed = results["runs"]["output"]
    assert results["runs"]["exit"] == 0 and re.search(rf"^{RUN}\s+unreadable", listed, re.M), listed
    assert re.search(rf"^{OTHER}\s+finished", listed, re.M), listed
