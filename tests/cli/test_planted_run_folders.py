"""The plant harness (issue 40): every file of a real run folder replaced by each hostile variant (tests/plants.py),
and every command that reads run folders run on it. Over every plant and command: no payload runs, nothing outside
the run folder is written, no command hangs, no traceback; a refusal is exit 2 with one message naming the file,
and the untouched run beside it is still listed and shown.

The full matrix (every file x every variant x every command, tests/plant_matrix.py) runs the commands in real
subprocesses, one test per planted file, and is slow; the checkpoint's files are test_planted_checkpoints.py's. The
quick set runs the torch-free readers in this process on a subset of plants, one of each kind of harm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from tests.plant_matrix import matrix_problems, planted_targets, plants_of, problems
from tests.plants import COMMANDS, MARKER, OTHER, QUICK, RUN, Plant, make_case, snapshot

READERS = ("runs", "show", "show-other", "rollouts", "compare", "tag")


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


@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in planted_targets() if not t.startswith("checkpoints")])
def test_every_plant_of_a_run_file_under_every_command(base, tmp_path, target):
    """Every variant of one of the run's own files (its database, config, labels, lock, pending writes) x every
    command, in driver processes (tests/plant_matrix.py); the checkpoint's files are test_planted_checkpoints.py's."""
    assert matrix_problems(base, tmp_path, plants_of(target)) == []


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
