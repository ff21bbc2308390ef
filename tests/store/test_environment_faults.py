"""Faults of the machine, not of the data (issue 28): a read-only file system, a file-size limit (`ulimit -f`), a full
disk. Each ends with exit 2 and one message naming the cause and what to do; none is called a damaged database, and
nothing already stored is lost. Real faults, not mocks: a read-only bind mount (skipped where this process may not
mount) and a real RLIMIT_FSIZE in a child process."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import read_run
from qae_app.store.run_folder import db_path, list_checkpoints

runner = CliRunner()
QAE = str(Path(sys.executable).parent / "qae")
TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0"]


def _flat(output: str) -> str:
    return "".join(output.replace("│", "").split())  # the console wraps long paths anywhere


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished two-step run with a checkpoint per step."""
    runs = tmp_path_factory.mktemp("envfaults") / "runs"
    result = runner.invoke(
        app, ["train", *TINY, "--checkpoint-every", "1", "--run-name", "base", "--runs-dir", str(runs)]
    )
    assert result.exit_code == 0, result.output
    return runs


@pytest.fixture
def read_only_copy(trained_run, tmp_path):
    """A copy of the runs folder, bind-mounted read-only (a real EROFS); skipped where mounting is not allowed."""
    source, mounted = tmp_path / "source", tmp_path / "ro"
    shutil.copytree(trained_run, source)
    mounted.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "--bind", str(source), str(mounted)], capture_output=True).returncode != 0
    ):
        pytest.skip("this process may not mount a read-only file system")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mounted)], check=True, capture_output=True)
        yield mounted
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--resume", "base", "--steps", "3"],
        ["sweep", "--steps", "1", "--name", "study"],
        ["eval", "--model", "base", "--limit", "2", "--samples", "1"],
        ["train", "--run-name", "new", "--steps", "1"],
    ],
)
def test_a_read_only_runs_dir_is_named_as_such(read_only_copy, command):
    """`train --resume` and `sweep` ended in an OSError traceback; `eval --model RUN` called a healthy file damaged
    ("the steps logged in this file are lost unless you restore it from a backup")."""
    before = db_path(read_only_copy, "base").read_bytes()
    result = runner.invoke(app, [*command, "--runs-dir", str(read_only_copy)])
    output = _flat(result.output)
    assert result.exit_code == 2, result.output
    assert "read-only" in output.lower() and "Traceback" not in output and not isinstance(result.exception, OSError)
    assert "restoreitfromabackup" not in output and "lostunless" not in output, result.output
    assert "writable--runs-dir" in output, result.output
    assert db_path(read_only_copy, "base").read_bytes() == before


def _limited(max_bytes: int):
    def limit() -> None:  # in the child: a real file-size limit, and SIGXFSZ ignored so a write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def _qae(args: list[str], max_bytes: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [QAE, *args],
        capture_output=True,
        text=True,
        preexec_fn=_limited(max_bytes),
        env=dict(os.environ, COLUMNS="200"),
        timeout=600,
    )


@pytest.mark.slow
def test_a_new_run_under_a_file_size_limit_names_the_limit_not_damage(tmp_path):
    """Under `ulimit -f` the new run's database could not grow: it was called damaged, with its (never logged) steps
    'lost unless you restore it from a backup'."""
    done = _qae(["train", *TINY, "--run-name", "small", "--runs-dir", str(tmp_path / "runs")], 64 * 1024)
    output = _flat(done.stdout + done.stderr)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "file-sizelimit" in output and "ulimit-f" in output, output
    assert "Traceback" not in output and "restoreitfromabackup" not in output, output


@pytest.mark.slow
def test_a_checkpoint_past_a_file_size_limit_says_the_data_is_safe_and_resumes(tmp_path):
    """A checkpoint larger than `ulimit -f` allows (the optimizer state, 6 MB) was a Python traceback, exit 1. Now:
    the cause, that the steps stored are safe, and the resume that continues once the limit is raised."""
    runs = tmp_path / "runs"
    done = _qae(
        ["train", *TINY, "--checkpoint-every", "1", "--run-name", "cut", "--runs-dir", str(runs)], 4 * 1024 * 1024
    )
    output = _flat(done.stdout + done.stderr)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "file-sizelimit" in output and "Traceback" not in output, output
    assert "qaetrain--resumecut" in output and "safe" in output, output
    assert not list_checkpoints(runs / "cut")  # the partial checkpoint is not taken for a valid one
    resumed = runner.invoke(app, ["train", "--resume", "cut", "--runs-dir", str(runs)])  # no limit now
    assert resumed.exit_code == 0, resumed.output
    assert read_run(db_path(runs, "cut"))["last_step"] == 2


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_names_the_space_needed_and_resumes(tmp_path):
    """A real full disk: a 6 MB tmpfs holds the run's database and first files but not a checkpoint (13 MB)."""
    small = tmp_path / "small"
    small.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("this process may not mount a small file system")
    try:
        runs = small / "runs"
        done = _qae(
            ["train", *TINY, "--checkpoint-every", "1", "--run-name", "full", "--runs-dir", str(runs)],
            resource.RLIM_INFINITY,
        )
        output = _flat(done.stdout + done.stderr)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "thediskisfull" in output and "Traceback" not in output, output
        assert "needsabout9.6MB" in output and "freeonthediskof" in output, output
        assert "qaetrain--resumefull" in output and "Thedataissafe" in output, output
        moved = tmp_path / "runs"
        shutil.copytree(runs, moved)  # "space freed": the same folder on a disk with room
        resumed = runner.invoke(app, ["train", "--resume", "full", "--runs-dir", str(moved)])
        assert resumed.exit_code == 0, resumed.output
        assert read_run(db_path(moved, "full"))["last_step"] == 2
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_an_export_to_a_read_only_or_full_disk_is_one_message(trained_run, tmp_path, disk):
    """Issue 39's last two `qae export --out` cases (the others are tests/evaluation/test_export.py's): an --out on a
    read-only file system, or on a disk without room for the model (3 MB on a 1 MB tmpfs). One message naming the
    cause, exit 2, the run unchanged."""
    mounted = tmp_path / "disk"
    mounted.mkdir()
    options = "size=1m" if disk == "full" else "size=1m,ro"
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mounted)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("this process may not mount a file system")
    try:
        before = db_path(trained_run, "base").read_bytes()
        result = runner.invoke(
            app,
            ["export", "base", "--out", str(mounted / "hf"), "--runs-dir", str(trained_run)],
            env={"COLUMNS": "300"},
        )
        output = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert output.count("error:") == 1 and isinstance(result.exception, SystemExit)  # (no traceback)
        assert ("read-only" if disk == "read-only" else "disk is full") in output, output
        assert "The run is unchanged" in output and db_path(trained_run, "base").read_bytes() == before
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
