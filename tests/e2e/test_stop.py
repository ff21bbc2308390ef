"""`qae stop RUN` from another terminal: the live run stops after its current step with a checkpoint, status
interrupted, and resumes; a run that is not running, or a lock record that is not the holder's, signals nobody."""

from __future__ import annotations

import os
import subprocess
import sys

from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import read_last_step, read_run, read_steps
from qae_app.store.run_folder import LOCK_FILE, latest_checkpoint
from tests.e2e.test_launch_teardown import documented_exit_code, wait_until
from tests.same_steps import assert_same_metrics

runner = CliRunner()


def first_step_stored(run_dir) -> bool:
    return (run_dir / "qae.duckdb").exists() and bool(read_last_step(run_dir / "qae.duckdb"))


TRAIN = ["--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "100", "--cpu"]


def test_stop_ends_a_live_run_with_a_checkpoint_and_it_resumes(tmp_path):
    """The run stops at a step boundary with a checkpoint of that step, and its resume equals the run that was never
    stopped, step for step. (How many steps the stop took is not asserted: the database lags the trainer by the
    steps its rows wait under pending/ for the next write, a few seconds' worth.)"""
    runs = tmp_path / "runs"
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qae_app.cli",
            "train",
            "--run-name",
            "r",
            "--steps",
            "500",
            *TRAIN,
            "--runs-dir",
            str(runs),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: first_step_stored(runs / "r"), trainer, "first step stored")
        result = runner.invoke(app, ["stop", "r", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        # the trainer's own exit for a stop it was asked for, as docs/cli.md says
        assert trainer.wait(timeout=120) == documented_exit_code("stopped by Ctrl-C, SIGTERM, SIGHUP")
    finally:
        if trainer.poll() is None:
            trainer.kill()
    db = runs / "r" / "qae.duckdb"
    stopped_at = read_last_step(db)
    assert read_run(db)["status"] == "interrupted" and f"interrupted at step {stopped_at}" in result.output
    assert latest_checkpoint(runs / "r").name == f"step-{stopped_at}"  # written on the way out, not at step 100
    assert "qae train --resume r" in result.output
    resumed = runner.invoke(app, ["train", "--resume", "r", "--steps", str(stopped_at + 2), "--runs-dir", str(runs)])
    assert resumed.exit_code == 0 and read_last_step(db) == stopped_at + 2
    # the same run never stopped (a constant LR and a data order by position: --steps changes neither)
    whole = runner.invoke(
        app, ["train", "--run-name", "whole", "--steps", str(stopped_at + 2), *TRAIN, "--runs-dir", str(runs)]
    )
    assert whole.exit_code == 0, whole.output
    got, want = read_steps(db).set_index("step"), read_steps(runs / "whole" / "qae.duckdb").set_index("step")
    assert got.index.tolist() == list(range(1, stopped_at + 3))  # every step once
    assert_same_metrics(want, got)


def test_stop_signals_nobody_for_a_run_that_is_not_running_or_a_record_not_the_holders(tmp_path):
    runs = tmp_path / "runs"
    assert (
        runner.invoke(
            app,
            [
                "train",
                "--run-name",
                "r",
                "--steps",
                "1",
                "--prompts-per-step",
                "2",
                "--group-size",
                "4",
                "--eval-every",
                "0",
                "--cpu",
                "--runs-dir",
                str(runs),
            ],
        ).exit_code
        == 0
    )
    (runs / "r" / LOCK_FILE).write_text(str(os.getpid()))  # a stale record naming a live process: this one
    result = runner.invoke(app, ["stop", "r", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "is not running" in result.output  # and this test process was not signalled
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(runs / 'r' / LOCK_FILE)!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = runner.invoke(app, ["stop", "r", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
        assert result.exit_code == 2 and "Nothing was signalled" in result.output  # the record names this process
        assert holder.poll() is None
    finally:
        holder.kill()


def test_stop_ends_every_rank_of_a_two_process_launch(tmp_path):
    from tests.e2e.test_launch_teardown import launch, processes_mentioning

    runs = tmp_path / "runs"
    launcher = launch(
        runs,
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
        wait_until(lambda: first_step_stored(runs / "k"), launcher, "first step stored")
        result = runner.invoke(app, ["stop", "k", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        # the launcher's code for a rank that exited 130 (docs/cli.md)
        assert launcher.wait(timeout=120) == documented_exit_code("`ChildFailedError` report")
        assert processes_mentioning(str(runs)) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
    db = runs / "k" / "qae.duckdb"
    assert read_run(db)["status"] == "interrupted"
    assert latest_checkpoint(runs / "k").name == f"step-{read_last_step(db)}"


def test_stop_sweep_ends_its_running_point_and_the_sweep_starts_no_other(tmp_path):
    """`qae stop --sweep NAME` (issue 38): the sweep process and its trainer are found through the locks they hold
    (the sweep's sweep.lock, the run's trainer.lock), the running point stops with a checkpoint, the next is not
    started, and the sweep exits as an interrupted one."""
    runs = tmp_path / "runs"
    sweep = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qae_app.cli",
            "sweep",
            "--estimator",
            "qae",
            "--seeds",
            "2",
            "--name",
            "sw",
            "--runs-dir",
            str(runs),
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
            "--cpu",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    first = runs / "sw-qae-k0.4-s0"
    try:
        wait_until(lambda: first_step_stored(first), sweep, "the first point's first step stored")
        result = runner.invoke(app, ["stop", "--sweep", "sw", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        assert sweep.wait(timeout=120) == 130  # `qae sweep` interrupted: re-run it to resume
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, 9)
    db = first / "qae.duckdb"
    stopped_at = read_last_step(db)
    assert read_run(db)["status"] == "interrupted" and latest_checkpoint(first).name == f"step-{stopped_at}"
    said = " ".join(result.output.split())
    assert f"run sw-qae-k0.4-s0 interrupted at step {stopped_at}" in said, said
    assert not (runs / "sw-qae-k0.4-s1").exists()  # the sweep started no other point
    again = runner.invoke(app, ["stop", "--sweep", "sw", "--runs-dir", str(runs)], env={"COLUMNS": "300"})
    assert again.exit_code == 2 and "nothing of sweep 'sw' is running" in " ".join(again.output.split())
