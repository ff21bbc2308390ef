"""Every process of an `accelerate launch` stops with its launcher: torch's launcher starts each rank in a session of
its own, so a `kill -9` of the launcher's process group never reached the ranks, which trained on holding the run's
lock (8 of 8 tries with FSDP2 x 2), and a --resume beside them died in a gloo traceback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from qae_app.store.reader import query, read_steps
from qae_app.store.run_folder import checkpoint_step, latest_checkpoint
from tests.launching import ONE_MACHINE
from tests.same_steps import assert_same_metrics, kept_steps

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = shutil.which("accelerate", path=str(Path(sys.executable).parent))


def processes_mentioning(text: str) -> list[int]:
    """The pids of this machine's processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def wait_until(ready, process: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    """Wait for `ready()` while `process` runs: a readiness wait, not a speed bound (the limit only ends a hang)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout_s:g} s")
        time.sleep(0.5)


def documented_exit_code(phrase: str) -> int:
    """The exit code docs/cli.md's table of exit codes gives for the row that mentions `phrase`: the tests that stop
    runs assert it, so code and docs agree."""
    text = (ROOT / "docs" / "cli.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    found = [int(code) for code, when in rows[1:] if phrase in when]
    assert len(found) == 1, f"docs/cli.md's exit codes name {phrase!r} {len(found)} times"
    return found[0]


def launch(runs_dir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            str(ROOT / "configs/accelerate/fsdp2.yaml"),
            "--num_processes",
            "2",
            *ONE_MACHINE,
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "qae_app.cli",
            "train",
            "--runs-dir",
            str(runs_dir),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stored_rows(runs_dir: Path, run: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's steps (indexed by step) and its rollouts, as the database holds them."""
    db = runs_dir / run / "qae.duckdb"
    return read_steps(db).set_index("step"), query(
        db, "SELECT step, group_idx, sample_idx, response, reward, advantage FROM rollouts ORDER BY ALL"
    )


@pytest.mark.slow
def test_kill_9_of_a_launch_ends_every_rank_and_the_run_resumes_into_the_uninterrupted_one(tmp_path):
    """kill -9 of the launch's process group, wherever the run is: no rank trains on, and the resume gives the rows
    of an uninterrupted launch of as many steps (the learning rate does not depend on the step count)."""
    runs_dir, options = (
        tmp_path / "runs",
        ["--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "1"],
    )
    launcher = launch(runs_dir, "--run-name", "k", "--steps", "500", *options)
    try:
        wait_until(lambda: latest_checkpoint(runs_dir / "k") is not None, launcher, "first checkpoint")
        assert len(processes_mentioning(str(runs_dir))) >= 3  # the launcher and its two ranks
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while processes_mentioning(str(runs_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_mentioning(str(runs_dir)) == []
    finally:
        for pid in processes_mentioning(str(runs_dir)):
            os.kill(pid, signal.SIGKILL)
    # one step past all it kept (a --steps below the steps a run logged is refused)
    steps = max(kept_steps(runs_dir / "k") + [checkpoint_step(latest_checkpoint(runs_dir / "k"))]) + 1
    resumed = launch(runs_dir, "--resume", "k", "--steps", str(steps))
    assert resumed.wait(timeout=600) == 0
    reference = launch(runs_dir, "--run-name", "ref", "--steps", str(steps), *options)
    assert reference.wait(timeout=600) == 0
    (want, want_rollouts), (got, got_rollouts) = stored_rows(runs_dir, "ref"), stored_rows(runs_dir, "k")
    assert got.index.tolist() == list(range(1, steps + 1))
    assert_same_metrics(want, got)
    pd.testing.assert_frame_equal(want_rollouts, got_rollouts)


@pytest.mark.parametrize(
    "signum, row",
    [
        (signal.SIGTERM, "SIGTERM sent to the `accelerate launch` process"),
        (signal.SIGHUP, "SIGHUP sent to the `accelerate launch` process"),
    ],
    ids=["SIGTERM", "SIGHUP"],
)
def test_a_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint_and_the_documented_code(tmp_path, signum, row):
    """SIGTERM to `accelerate launch` itself (a supervisor's stop), or SIGHUP (its terminal closed, issue 48 M2): its
    code is the launcher's, 143 or 129 (docs/cli.md), and every rank stops after its step with a checkpoint (torch's
    launcher passes the signal on), the run interrupted, as one process stops."""
    from qae_app.store.reader import read_last_step, read_run
    from tests.e2e.test_stop import first_step_stored

    runs_dir = tmp_path / "runs"
    launcher = launch(
        runs_dir,
        "--run-name",
        "k",
        "--steps",
        "500",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "100",
    )
    try:
        wait_until(lambda: first_step_stored(runs_dir / "k"), launcher, "first step stored")
        os.kill(launcher.pid, signum)
        assert launcher.wait(timeout=300) == documented_exit_code(row)
        assert processes_mentioning(str(runs_dir)) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    db = runs_dir / "k" / "qae.duckdb"
    assert read_run(db)["status"] == "interrupted"
    assert latest_checkpoint(runs_dir / "k").name == f"step-{read_last_step(db)}"


def test_a_second_launch_on_a_live_run_is_refused_before_any_collective(tmp_path):
    """A resume launched beside a live launch of the same run: refused by the run's lock with one message (the main
    process's), no rank left waiting in a collective, and the live run trains on."""
    runs_dir = tmp_path / "runs"
    first = launch(
        runs_dir,
        "--run-name",
        "k",
        "--steps",
        "500",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "1",
    )
    try:
        wait_until(lambda: latest_checkpoint(runs_dir / "k") is not None, first, "first checkpoint")
        second = subprocess.run(
            [
                ACCELERATE,
                "launch",
                "--config_file",
                str(ROOT / "configs/accelerate/fsdp2.yaml"),
                "--num_processes",
                "2",
                *ONE_MACHINE,
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                "-m",
                "qae_app.cli",
                "train",
                "--resume",
                "k",
                "--runs-dir",
                str(runs_dir),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, COLUMNS="300"),
        )
        output = second.stdout + second.stderr
        assert second.returncode != 0
        assert output.count("is being trained right now") == 1, output[-3000:]
        assert "gloo" not in output.lower() and first.poll() is None  # the live run trains on
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


@pytest.mark.slow
def test_a_finished_sharded_run_lets_go_of_its_process_groups_before_the_interpreter_exits(tmp_path):
    """FSDP2's modules hold their process group: a finished run whose networks lived on to the interpreter's exit had
    gloo's threads destroyed with it, and a rank aborted (SIGABRT, 'terminate called without an active exception')
    after its run was stored; the launch failed (CI, 2026-12-03). At exit nothing may hold one any more."""
    import json

    out = tmp_path / "holders"
    finished = subprocess.run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            str(ROOT / "configs/accelerate/fsdp2.yaml"),
            "--num_processes",
            "2",
            *ONE_MACHINE,
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(ROOT / "tests/e2e/process_group_holders.py"),
            str(out),
            "train",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "k",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--kl-beta",
            "0.05",
        ],  # (a sharded reference model too)
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, COLUMNS="300"),
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads(Path(f"{out}.{rank}.json").read_text()) == [], f"rank {rank}"
