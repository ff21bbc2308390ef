"""Nothing lost, nothing hung: real `qae train` processes killed with SIGKILL at chosen points (fault injection,
`qae_app/core/faults.py`) and at an arbitrary moment, stopped with Ctrl-C, crashed, and read by a polling reader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from qae_app.config import build_config
from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.run_folder import RunLock, db_path, latest_checkpoint, trainer_alive, write_manifest
from qae_app.train.trainer import Trainer
from tests.e2e.test_launch_teardown import documented_exit_code
from tests.same_steps import assert_same_metrics, kept_steps, saved_steps

OPTS = dict(steps=6, prompts_per_step=4, group_size=8, eval_every=0, checkpoint_every=2, seed=1)
PER_STEP = OPTS["prompts_per_step"] * OPTS["group_size"]
QAE = str(Path(sys.executable).parent / "qae")
WIDE = dict(os.environ, COLUMNS="250")  # rich tables wide enough not to abbreviate cells


def cli_args(**opts) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]


def start_train(runs_dir: Path, name: str, env_extra: dict | None = None, **opts) -> subprocess.Popen:
    env = dict(WIDE, **(env_extra or {}))
    return subprocess.Popen(
        [QAE, "train", "--run-name", name, "--runs-dir", str(runs_dir), *cli_args(**opts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )  # its own process group: a group SIGTERM spares pytest


def assert_same_steps(reference: Path, run: Path, n_steps: int) -> None:
    ref = read_steps(reference).set_index("step")
    got = read_steps(run).set_index("step")
    assert got.index.tolist() == list(range(1, n_steps + 1))  # every step exactly once
    assert_same_metrics(ref, got)
    counts = query(run, "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step")
    assert counts["n"].tolist() == [PER_STEP] * n_steps
    groups = query(run, "SELECT step, count(*) AS n FROM groups GROUP BY step ORDER BY step")
    assert groups["n"].tolist() == [OPTS["prompts_per_step"]] * n_steps


def wait_for_stored_steps(path: Path, n: int, timeout_s: float = 300) -> None:
    """Until the run's database holds `n` steps (a signal sent then lands in a later step), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if query(path, "SELECT count(*) AS n FROM steps")["n"].item() >= n:
                return
        except Exception:  # noqa: BLE001 - the file is not there yet, or the trainer holds it for a moment
            pass
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run, trained as the runs under test are: a `qae train` process of its own. (Trained inside
    pytest, its float results could differ in the last digits from a fresh process's: earlier tests may have changed
    the process's torch settings, e.g. its thread count, and with it the order of floating-point reductions.)"""
    runs_dir = tmp_path_factory.mktemp("reference")
    proc = start_train(runs_dir, "ref", **OPTS)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    return db_path(runs_dir, "ref")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["db_commit@5", "after_step_rows@3", "checkpoint_rename@4", "db_commit@1"])
def test_kill_9_at_a_chosen_point_then_resume_equals_the_uninterrupted_run(tmp_path, reference, fault):
    proc = start_train(tmp_path, "cut", {"QAE_FAULT": fault}, **OPTS)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, out
    stored = query(db_path(tmp_path, "cut"), "SELECT status FROM runs")["status"].item()
    assert stored == "running"  # it had no chance to say otherwise
    assert read_run(db_path(tmp_path, "cut"))["status"] == "stopped"  # but nothing holds its lock: readers say so
    point, step = fault.split("@")
    stored = read_steps(db_path(tmp_path, "cut"))["step"].tolist()
    assert stored == list(range(1, len(stored) + 1))  # whole steps, in order (a killed write is rolled back whole)
    # nothing lost but the step in flight: the rest is in the database or saved under pending/ (steps are written
    # together every few seconds), and a step's rows are saved before its checkpoint is
    kept = set(stored) | set(saved_steps(tmp_path / "cut"))
    assert set(range(1, int(step) + (point == "checkpoint_rename"))) <= kept
    ckpt = latest_checkpoint(tmp_path / "cut")
    if fault == "checkpoint_rename@4":
        assert ckpt.name == "step-2" and (tmp_path / "cut" / "checkpoints" / "step-4.tmp").exists()

    listed = subprocess.run([QAE, "runs", "--runs-dir", str(tmp_path)], capture_output=True, text=True, env=WIDE)
    assert "stopped" in listed.stdout  # a dead trainer is not shown as running

    resumed = subprocess.run(
        [QAE, "train", "--resume", "cut", "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_steps(reference, db_path(tmp_path, "cut"), OPTS["steps"])
    assert read_run(db_path(tmp_path, "cut"))["status"] == "finished"
    assert not trainer_alive(tmp_path / "cut")


@pytest.mark.slow
def test_resuming_a_run_killed_before_its_first_checkpoint_replays_it_and_drops_no_logged_step(tmp_path, reference):
    """No checkpoint to resume from: the resume trains again from step 0 (same seed, so the same steps), says so,
    and refuses a --steps below the steps already logged (their rows would be dropped and never trained again)."""
    proc = start_train(tmp_path, "nock", {"QAE_FAULT": "after_step_rows@5"}, **dict(OPTS, checkpoint_every=0))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, out
    assert not (tmp_path / "nock" / "checkpoints").exists() or latest_checkpoint(tmp_path / "nock") is None
    kept = kept_steps(tmp_path / "nock")
    assert kept == [1, 2, 3, 4]  # step 5 was in flight
    refused = subprocess.run(
        [QAE, "train", "--resume", "nock", "--steps", "3", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=WIDE,
    )
    message = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2, message
    assert "steps: 3 is below the 4 steps run 'nock' has logged" in message
    assert kept_steps(tmp_path / "nock") == kept  # nothing dropped
    resumed = subprocess.run(
        [QAE, "train", "--resume", "nock", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=WIDE,
    )
    said = " ".join((resumed.stdout + resumed.stderr).split())
    assert resumed.returncode == 0, said
    assert "has no checkpoint: training it again from step 0" in said and "4 steps it logged" in said
    assert_same_steps(reference, db_path(tmp_path, "nock"), OPTS["steps"])


@pytest.mark.slow
def test_kill_9_at_an_arbitrary_moment_then_resume(tmp_path, tmp_path_factory):
    opts = dict(OPTS, steps=30, checkpoint_every=4)
    ref_dir = tmp_path_factory.mktemp("ref30")
    Trainer(build_config(run_name="ref30", **opts), ref_dir, cpu=True).fit()
    proc = start_train(tmp_path, "cut", **opts)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until it is mid-run (its second checkpoint), then kill without warning
        newest = latest_checkpoint(tmp_path / "cut") if (tmp_path / "cut").exists() else None
        if newest is not None and newest.name != "step-4":
            break
        time.sleep(0.05)
    time.sleep(0.137)  # an arbitrary point inside a later step
    proc.kill()
    proc.wait()
    resumed = subprocess.run(
        [QAE, "train", "--resume", "cut", "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ref = read_steps(db_path(ref_dir, "ref30")).set_index("step")
    got = read_steps(db_path(tmp_path, "cut")).set_index("step")
    assert got.index.tolist() == list(range(1, 31))
    assert_same_metrics(ref, got)


@pytest.mark.slow
def test_ctrl_c_checkpoints_marks_interrupted_and_resumes(tmp_path, reference):
    proc = start_train(tmp_path, "cc", **dict(OPTS, steps=400, checkpoint_every=100))
    wait_for_stored_steps(db_path(tmp_path, "cc"), 3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "qae train --resume cc" in out
    path = db_path(tmp_path, "cc")
    info = read_run(path)
    last = int(info["last_step"])
    assert info["status"] == "interrupted" and last >= 3
    assert latest_checkpoint(tmp_path / "cc").name == f"step-{last}"  # checkpoint at the stop, not 100 steps back
    assert not trainer_alive(tmp_path / "cc")
    listed = subprocess.run([QAE, "runs", "--runs-dir", str(tmp_path)], capture_output=True, text=True, env=WIDE)
    assert "interrupted" in listed.stdout
    # the resumed run equals the uninterrupted reference wherever they overlap (same seed, same options but steps)
    subprocess.run(
        [
            QAE,
            "train",
            "--resume",
            "cc",
            "--steps",
            str(OPTS["steps"] if last < 6 else last + 1),
            "--runs-dir",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    got = read_steps(path).set_index("step")
    assert got.index.tolist() == list(range(1, len(got) + 1))
    if last < 6:
        assert_same_steps(reference, path, OPTS["steps"])


@pytest.mark.slow
def test_a_repeated_sigterm_still_checkpoints_at_the_stop(tmp_path):
    """A supervisor may send SIGTERM more than once (the sweep re-sent it every 2 s; the kernel's parent-death signal
    fires once per thread of a dying sweep): the second used to abort the run mid-step or mid-checkpoint, losing the
    steps since the last checkpoint. Only Ctrl-C again stops at once; a repeated SIGTERM is the same request."""
    proc = start_train(tmp_path, "tt", **dict(OPTS, steps=400, checkpoint_every=100))
    wait_for_stored_steps(db_path(tmp_path, "tt"), 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.02)  # the second arrives while the step (or its checkpoint) is under way
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    info = read_run(db_path(tmp_path, "tt"))
    assert info["status"] == "interrupted", out
    assert latest_checkpoint(tmp_path / "tt").name == f"step-{int(info['last_step'])}", out  # nothing lost
    assert f"Continue it from its newest checkpoint, step-{int(info['last_step'])}, with" in " ".join(out.split())
    # what it said is true of SIGTERM: no "Ctrl-C again" to a process that got no Ctrl-C
    assert "Ctrl-C again" not in out and "SIGTERM: stopping after this step" in " ".join(out.split())


@pytest.mark.slow
def test_a_crash_marks_the_run_failed_with_the_error(tmp_path):
    proc = start_train(tmp_path, "boom", {"QAE_FAULT": "raise:after_step_rows@2"}, **OPTS)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out
    info = read_run(db_path(tmp_path, "boom"))
    assert info["status"] == "failed" and "injected fault at after_step_rows, step 2" in info["error"]
    assert read_steps(db_path(tmp_path, "boom"))["step"].tolist() == [1, 2]  # finished steps are kept
    listed = subprocess.run([QAE, "runs", "--runs-dir", str(tmp_path)], capture_output=True, text=True, env=WIDE)
    assert "failed" in listed.stdout


@pytest.mark.slow
def test_resume_refuses_a_conflicting_config_and_a_live_trainer(tmp_path):
    Trainer(build_config(run_name="r", **dict(OPTS, steps=2)), tmp_path, cpu=True).fit()
    result = subprocess.run(
        [QAE, "train", "--resume", "r", "--group-size", "4", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "--group-size 4 conflicts with run 'r', which was started with 8" in " ".join(result.stderr.split())
    lock = RunLock(tmp_path / "r").acquire("test")  # this test process stands in for a live trainer
    try:
        result = subprocess.run(
            [QAE, "train", "--resume", "r", "--runs-dir", str(tmp_path)], capture_output=True, text=True
        )
    finally:
        lock.release()
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and f"is being trained right now by process {os.getpid()}" in message


@pytest.mark.slow
def test_a_reader_polling_every_100ms_never_hurts_the_writer(tmp_path):
    """As the dashboard does: open read-only, query, close, every 100 ms, for the whole run."""
    opts = dict(OPTS, steps=40, checkpoint_every=20)
    proc = start_train(tmp_path, "live", **opts)
    path = db_path(tmp_path, "live")
    reads = partial_steps = reader_busy = mid_run_reads = 0
    while proc.poll() is None:
        time.sleep(0.1)
        if not path.exists():
            continue
        try:
            con = duckdb.connect(str(path), read_only=True)
        except duckdb.Error:
            reader_busy += 1  # the trainer held the file for its write: try again next tick
            continue
        try:
            steps = con.execute("SELECT step FROM steps").fetchall()
            per_step = dict(con.execute("SELECT step, count(*) FROM rollouts GROUP BY step").fetchall())
            groups = dict(con.execute("SELECT step, count(*) FROM groups GROUP BY step").fetchall())
        except duckdb.Error:
            # the file is created before its tables: only possible in the first instant
            continue
        finally:
            con.close()
        reads += 1
        mid_run_reads += 0 < len(steps) < opts["steps"]  # a read between the trainer's writes, not before or after
        for (step,) in steps:  # every step a reader sees is whole
            if per_step.get(step) != PER_STEP or groups.get(step) != opts["prompts_per_step"]:
                partial_steps += 1
        if set(per_step) - {s for (s,) in steps}:
            partial_steps += 1
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    # (a count of reads, not more than 20 of them: how many fit in a run is the machine's speed, not the writer's)
    assert mid_run_reads >= 1 and partial_steps == 0, (reads, mid_run_reads)
    final = read_steps(path)
    assert final["step"].tolist() == list(range(1, 41))  # zero lost rows
    assert query(path, "SELECT count(*) AS n FROM rollouts")["n"].item() == 40 * PER_STEP
    assert read_run(path)["status"] == "finished"


@pytest.mark.slow
def test_resume_checks_the_checkpoint_data_position(tmp_path):
    Trainer(build_config(run_name="dp", **dict(OPTS, steps=2)), tmp_path, cpu=True).fit()
    state = tmp_path / "dp" / "checkpoints" / "step-2" / "trainer_state.json"
    state.write_text(state.read_text().replace('"data_position": 8', '"data_position": 5'))
    write_manifest(state.parent)  # an intact checkpoint that belongs to another config, not a corrupted one
    result = subprocess.run(
        [QAE, "train", "--resume", "dp", "--runs-dir", str(tmp_path)], capture_output=True, text=True, env=WIDE
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is at prompt 5 of the data, but 2 steps of 4 prompts end at 8" in " ".join(result.stderr.split())


@pytest.mark.slow
def test_resume_refuses_another_number_of_processes(tmp_path):
    """Each process samples with its own seed: a run checkpointed by 2 processes and resumed by 1 trains other steps
    than the ones it logged (steps 11-20 of such a resume differed from the uninterrupted run), so it is refused."""
    Trainer(build_config(run_name="np", **dict(OPTS, steps=2)), tmp_path, cpu=True).fit()
    state = tmp_path / "np" / "checkpoints" / "step-2" / "trainer_state.json"
    assert json.loads(state.read_text())["num_processes"] == 1
    state.write_text(state.read_text().replace('"num_processes": 1', '"num_processes": 2'))
    write_manifest(state.parent)  # an intact checkpoint of a 2-process run
    result = subprocess.run(
        [QAE, "train", "--resume", "np", "--steps", "4", "--runs-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=WIDE,
    )
    message = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, message
    assert "resume: run 'np' was trained by 2 processes and this resume has 1" in message
    assert read_steps(db_path(tmp_path, "np"))["step"].tolist() == [1, 2]


@pytest.mark.slow
def test_a_sigterm_while_the_run_writes_its_final_status_is_ignored(tmp_path):
    """systemd or Slurm sending SIGTERM to the group just as the run ends: it used to exit -15 with status running."""
    proc = start_train(tmp_path, "late", {"QAE_FAULT": f"term:finishing@{OPTS['steps']}"}, **OPTS)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert read_run(db_path(tmp_path, "late"))["status"] == "finished"
    assert read_steps(db_path(tmp_path, "late"))["step"].tolist() == list(range(1, OPTS["steps"] + 1))


@pytest.mark.parametrize("entry", ["qae", "python -m qae_app.cli"])
def test_a_sigterm_after_the_run_said_done_is_not_its_death(tmp_path, entry):
    """A SIGTERM to the group once `qae train` printed "done" (a supervisor stopping what still held the run a moment
    ago): the process died by the signal (exit -15), reading as a failed run; it now exits 0, the run stored whole."""
    command = [QAE] if entry == "qae" else [sys.executable, "-m", "qae_app.cli"]
    opts = dict(OPTS, steps=2)
    proc = subprocess.Popen(
        [*command, "train", "--run-name", "done", "--runs-dir", str(tmp_path), *cli_args(**opts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(WIDE, QAE_FAULT="term:done@2"),
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == documented_exit_code('a SIGTERM once it printed "done"') == 0, out
    assert "done: 2 steps, status finished" in out
    assert read_run(db_path(tmp_path, "done"))["status"] == "finished"


@pytest.mark.slow
def test_a_reader_holding_the_database_neither_fails_nor_blocks_the_run(tmp_path):
    """A notebook's `duckdb.connect(path, read_only=True)` left open: training goes on, the rows wait safely on disk
    under pending/, and are all written once the reader lets go."""
    opts = dict(OPTS, steps=8, checkpoint_every=4)
    proc = start_train(tmp_path, "held", **opts)
    path = db_path(tmp_path, "held")
    deadline = time.monotonic() + 300
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    con = None
    while con is None and time.monotonic() < deadline:
        try:
            con = duckdb.connect(str(path), read_only=True)
        except duckdb.Error:
            time.sleep(0.05)  # the trainer is writing right now
    try:
        # while the reader holds the file, steps keep coming (and a checkpoint is taken) and wait under pending/
        while len(list((tmp_path / "held" / "pending").glob("*-step.json"))) < 5 and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and latest_checkpoint(tmp_path / "held").name == "step-4"
        listed = subprocess.run([QAE, "runs", "--runs-dir", str(tmp_path)], capture_output=True, text=True, env=WIDE)
        assert listed.returncode == 0
    finally:
        con.close()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "training goes on and the rows wait" in " ".join(out.split())
    assert read_steps(path)["step"].tolist() == list(range(1, 9))
    assert query(path, "SELECT count(*) AS n FROM rollouts")["n"].item() == 8 * PER_STEP
    assert read_run(path)["status"] == "finished" and not list((tmp_path / "held" / "pending").glob("*"))


@pytest.mark.slow
def test_sigterm_to_the_process_group_while_scoring_finishes_the_step_then_stops(tmp_path, reference):
    """systemd / Slurm preemption: SIGTERM to the whole group as the step's responses are being scored. The step is
    scored in full and stored, the run stops at that boundary with a checkpoint, and the resumed run equals the
    uninterrupted one (the verifier workers ignore the signal: tests/rewards/test_rewards.py kills a batch's group)."""
    proc = start_train(tmp_path, "term", {"QAE_FAULT": "term:scoring@3"}, **OPTS)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out
    assert read_run(db_path(tmp_path, "term"))["status"] == "interrupted"
    assert read_steps(db_path(tmp_path, "term"))["step"].tolist() == [1, 2, 3]
    assert latest_checkpoint(tmp_path / "term").name == "step-3"
    resumed = subprocess.run(
        [QAE, "train", "--resume", "term", "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert_same_steps(reference, db_path(tmp_path, "term"), OPTS["steps"])
