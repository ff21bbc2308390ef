"""SIGHUP is a stop like SIGTERM (issue 48 M2): a closed terminal or a dropped ssh session killed `qae train` at once
(exit 129, status left `running`, no checkpoint at the stop: a 300-step run hung up at step 5 resumed from step 0).
Real `qae train` and `qae sweep` processes, sent SIGHUP with kill, and one on a real pseudo-terminal that is closed
under it; `accelerate launch` is tests/e2e/test_launch_teardown.py's."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import threading

from qae_app.store.reader import read_last_step, read_run
from qae_app.store.run_folder import latest_checkpoint, trainer_alive
from tests.e2e.test_crash_safety import QAE, WIDE
from tests.e2e.test_launch_teardown import documented_exit_code, wait_until
from tests.e2e.test_stop import first_step_stored

TRAIN = ["--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "100", "--cpu"]
STOPPED = "stopped by Ctrl-C, SIGTERM, SIGHUP"  # docs/cli.md's exit code of a run stopped after its step

# a reward of the user's own: its functions run in worker processes of the trainer's process group, which a hangup
# reaches too
REWARD = """def ends_with_answer(completions, answer, **kwargs):
    return [float(completions[0].strip().endswith(str(answer[0])))]
"""


def assert_stopped_at_a_step_with_its_checkpoint(run_dir) -> int:
    db = run_dir / "qae.duckdb"
    stopped_at = read_last_step(db)
    assert read_run(db)["status"] == "interrupted" and stopped_at >= 1
    assert latest_checkpoint(run_dir).name == f"step-{stopped_at}"  # written on the way out, not at step 100
    assert not trainer_alive(run_dir)
    return stopped_at


def test_sighup_stops_a_run_after_its_step_with_a_checkpoint_and_it_resumes(tmp_path):
    """The issue's `qae train --steps 300 ... & kill -HUP $!`: the documented exit, the run interrupted at a step
    boundary with that step's checkpoint, and a resume continues from it."""
    runs = tmp_path / "runs"
    trainer = subprocess.Popen(
        [QAE, "train", "--run-name", "h", "--steps", "300", *TRAIN, "--runs-dir", str(runs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=WIDE,
        start_new_session=True,
    )
    try:
        wait_until(lambda: first_step_stored(runs / "h"), trainer, "first step stored")
        trainer.send_signal(signal.SIGHUP)
        out, _ = trainer.communicate(timeout=300)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == documented_exit_code(STOPPED), out
    said = " ".join(out.split())
    assert "SIGHUP: stopping after this step" in said and "qae train --resume h" in said, said
    stopped_at = assert_stopped_at_a_step_with_its_checkpoint(runs / "h")
    resumed = subprocess.run(
        [QAE, "train", "--resume", "h", "--steps", str(stopped_at + 1), "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=WIDE,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming run h from checkpoint step-{stopped_at}" in " ".join(resumed.stdout.split())
    assert read_last_step(runs / "h" / "qae.duckdb") == stopped_at + 1


def _drain(master: int) -> None:
    """Read the terminal's output as a terminal does, until it is closed (a full pseudo-terminal blocks its writer)."""
    try:
        while os.read(master, 65536):
            pass
    except OSError:
        pass


def test_a_closed_terminal_stops_the_run_with_a_checkpoint(tmp_path):
    """`qae train` on a real terminal (a pseudo-terminal, its controlling one) that closes, as an ssh session drops:
    the kernel hangs it up and sends SIGHUP, and the shell passes SIGHUP to its job's process group (the reward
    workers included). Every write to the terminal fails from then on (EIO), the progress bar's included; the run
    still stops after its step with a checkpoint, interrupted, with the documented exit."""
    runs = tmp_path / "runs"
    reward = tmp_path / "reward_fn.py"
    reward.write_text(REWARD)
    master, slave = pty.openpty()

    def own_terminal() -> None:  # (after start_new_session's setsid: the pseudo-terminal becomes its terminal)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    trainer = subprocess.Popen(
        [
            QAE,
            "train",
            "--run-name",
            "t",
            "--steps",
            "300",
            *TRAIN,
            "--reward",
            f"{reward}:ends_with_answer",
            "--runs-dir",
            str(runs),
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=dict(WIDE, TERM="xterm"),
        start_new_session=True,
        preexec_fn=own_terminal,
    )
    os.close(slave)
    reader = threading.Thread(target=_drain, args=(master,), daemon=True)
    reader.start()
    try:
        wait_until(lambda: first_step_stored(runs / "t"), trainer, "first step stored")
        os.close(master)  # the terminal goes away: the kernel hangs up its other side
        os.killpg(trainer.pid, signal.SIGHUP)  # and the shell that ran the job passes the hangup to its group
        assert trainer.wait(timeout=300) == documented_exit_code(STOPPED)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert_stopped_at_a_step_with_its_checkpoint(runs / "t")


def test_sighup_stops_a_sweep_as_qae_stop_does(tmp_path):
    """`qae sweep` hung up: its running point stops after its step with a checkpoint, no other point starts, and the
    sweep exits as an interrupted one (re-running it resumes)."""
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
            "300",
            *TRAIN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    first = runs / "sw-qae-k0.4-s0"
    try:
        wait_until(lambda: first_step_stored(first), sweep, "the first point's first step stored")
        sweep.send_signal(signal.SIGHUP)
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode == documented_exit_code(STOPPED), out
    assert "re-run the same command to resume the sweep" in " ".join(out.split())
    assert_stopped_at_a_step_with_its_checkpoint(first)
    assert not (runs / "sw-qae-k0.4-s1").exists()  # the sweep started no other point
