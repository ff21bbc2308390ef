"""`qae sweep` running its points as real processes: the points listed and kept when the sweep runs again, a killed
sweep resumed losing no run, two points trained at once, a sweep copied on disk keeping its seed count, and a point
another run took meanwhile left alone. The grid, its refusals and `qae compare` are tests/cli/test_sweep.py's."""

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.sweep import plan_sweep
from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.run_folder import db_path
from tests.cli.test_sweep import TINY

runner = CliRunner()
QAE = [sys.executable, "-m", "qae_app.cli"]


@pytest.mark.slow
def test_a_sweep_runs_its_points_lists_them_and_keeps_them_when_run_again(tmp_path):
    runs = tmp_path / "runs"
    command = [*QAE, "sweep", "--estimator", "qae,grpo", "--name", "s", "--runs-dir", str(runs), *TINY]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "sweep 2 done" in first.stdout
    ids = ["s-grpo-s0", "s-qae-k0.4-s0"]
    for run_id in ids:
        info = read_run(db_path(runs, run_id))
        config = json.loads(info["config"])
        assert info["status"] == "finished" and read_steps(db_path(runs, run_id))["step"].tolist() == [1, 2]
        assert config["sweep_name"] == "s" and config["estimator"] == run_id.split("-")[1]
    created = {run_id: read_run(db_path(runs, run_id))["created_at"] for run_id in ids}

    listed = runner.invoke(app, ["runs", "--sweep", "s", "--runs-dir", str(runs)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and all(run_id in listed.output for run_id in ids)
    assert "no run of sweep 'other'" in runner.invoke(app, ["runs", "--sweep", "other", "--runs-dir", str(runs)]).output

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "sweep 2 kept" in again.stdout, again.stdout + again.stderr
    assert {run_id: read_run(db_path(runs, run_id))["created_at"] for run_id in ids} == created
    other = subprocess.run([*command[: -len(TINY)], "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "belongs to sweep" in " ".join(other.stderr.split())


def _pids_of(pattern: str) -> list[int]:
    """Processes whose command line contains `pattern` (read from /proc: no pgrep needed)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if pattern.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return [pid for pid in pids if pid != os.getpid()]


@pytest.mark.slow
def test_a_killed_sweep_resumes_keeping_finished_runs_and_losing_none(tmp_path):
    runs = tmp_path / "runs"
    options = [
        "--steps",
        "4",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "1",
    ]
    command = [*QAE, "sweep", "--estimator", "qae", "--seeds", "3", "--name", "k", "--runs-dir", str(runs), *options]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first, second = db_path(runs, "k-qae-k0.4-s0"), db_path(runs, "k-qae-k0.4-s1")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait for: first run finished, second run past its first checkpoint
        time.sleep(0.5)
        try:
            if (
                first.exists()
                and read_run(first)["status"] == "finished"
                and second.exists()
                and len(query(second, "SELECT step FROM steps")) >= 2
            ):
                break
        except Exception:  # noqa: BLE001 - a file being written may be unreadable for a moment
            continue
    else:
        sweep.kill()
        pytest.fail("the sweep did not reach its second run in time")
    sweep.kill()  # kill -9: the sweep has no chance to stop its child; the kernel sends the child SIGTERM
    sweep.wait()
    deadline = time.monotonic() + 120
    while _pids_of("k-qae-k0.4-s1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _pids_of("k-qae-k0.4-s1"), "the trainer outlived its killed sweep"
    created = read_run(first)["created_at"]
    assert read_run(second)["status"] in ("interrupted", "stopped", "finished")
    assert not db_path(runs, "k-qae-k0.4-s2").exists()

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_run(first)["created_at"] == created  # kept, not trained again
    for seed in range(3):
        path = db_path(runs, f"k-qae-k0.4-s{seed}")
        assert read_run(path)["status"] == "finished"
        assert read_steps(path)["step"].tolist() == [1, 2, 3, 4]  # every step once: none lost, none duplicated


@pytest.mark.slow
def test_parallel_2_trains_two_runs_at_once(tmp_path):
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            *QAE,
            "sweep",
            "--estimator",
            "qae",
            "--seeds",
            "2",
            "--parallel",
            "2",
            "--name",
            "p",
            "--runs-dir",
            str(runs),
            *TINY,
            "--steps",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # the two trainer processes lived at the same time: each was started before the other exited (one at a time,
    # the second starts after the first exited). The sweep's log of each point says when its process started and
    # exited; the database's timestamps cannot say it (a trainer goes on after its last write: the final checkpoint,
    # the exit, and on a loaded machine one may take its 4 steps while the other is still importing torch)
    (a_start, a_exit), (b_start, b_exit) = (
        process_lifetime(runs / ".sweeps" / "p" / f"p-qae-k0.4-s{seed}.log") for seed in (0, 1)
    )
    assert a_start < b_exit and b_start < a_exit


def process_lifetime(log: Path) -> tuple[datetime, datetime]:
    """(start, exit) of the one trainer process a sweep's point log records."""
    text = log.read_text()
    starts = re.findall(r"^# qae sweep \S+: start \S+ at (\S+)$", text, re.M)
    exits = re.findall(r"^# qae sweep \S+: \S+ exited with code 0 at (\S+) after [\d.]+ s$", text, re.M)
    assert len(starts) == 1 and len(exits) == 1, text
    return datetime.fromisoformat(starts[0]), datetime.fromisoformat(exits[0])


@pytest.mark.slow
def test_a_real_sweep_copied_on_disk_keeps_its_seed_count(tmp_path):
    """A real `qae sweep` (2 estimators x 2 seeds), every run folder then copied with `cp -r`: compare still sees 2
    seeds a group and the same numbers."""
    runs = tmp_path / "runs"
    done = subprocess.run(
        [*QAE, "sweep", "--estimator", "qae,grpo", "--seeds", "2", "--name", "cp", "--runs-dir", str(runs), *TINY],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    compare = [*QAE, "compare", "--sweep", "cp", "--baseline", "grpo", "--json", "--runs-dir", str(runs)]
    before = json.loads(subprocess.run(compare, capture_output=True, text=True, timeout=300).stdout)
    for folder in [p for p in runs.iterdir() if p.name.startswith("cp-")]:
        subprocess.run(["cp", "-r", str(folder), str(folder) + "-backup"], check=True)
    after = json.loads(subprocess.run(compare, capture_output=True, text=True, timeout=300).stdout)
    for group, old in zip(after["groups"], before["groups"], strict=True):
        assert group["n"] == old["n"] == 2 and group["seeds"] == [0, 1] and group["metrics"] == old["metrics"]
        assert sorted(group["excluded"]) == sorted(run + "-backup" for run in group["runs"])
    assert after["differences"] == before["differences"]


@pytest.mark.slow
def test_a_point_whose_name_another_run_took_meanwhile_is_skipped_not_trained(tmp_path):
    """A plain `qae train --run-name X` that took the name of a sweep's next point after the sweep planned it: the
    sweep resumed (trained!) the foreign run, or failed the point advising `--resume X`. Now the point is skipped,
    said to be taken by another run, and the foreign run is left alone."""
    from qae_app.cli.sweep import run_sweep

    options = {"steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_every": 0, "checkpoint_every": 1}
    sweep = plan_sweep(tmp_path, "qae", None, 1, dict(options), name="race")
    taken = sweep.points[0].run_name
    result = runner.invoke(
        app, ["train", *TINY[:-2], "--steps", "1", "--run-name", taken, "--runs-dir", str(tmp_path)]
    )  # another user's run, started between planning and training
    assert result.exit_code == 0, result.output
    before = db_path(tmp_path, taken).read_bytes()
    states = run_sweep(sweep, tmp_path)
    assert states == {taken: "taken"}
    assert db_path(tmp_path, taken).read_bytes() == before and read_run(db_path(tmp_path, taken))["last_step"] == 1


FLAGGED = """
from pathlib import Path


def short(completions, step, **kwargs):
    if step == 2 and Path(__file__).with_name("fail-at-2").exists():
        raise RuntimeError("not yet")
    return [1.0 if len(c.strip()) <= 2 else 0.0 for c in completions]
"""


@pytest.mark.slow
def test_a_sweep_scores_with_a_reward_file_and_resumes_a_point_it_failed(tmp_path):
    """`qae sweep --reward rewards.py:short` (a path relative to where qae runs): its point fails at step 2 while a
    flag file is there; the same command re-run once it is gone resumes the point (naming the reward again), which
    finishes with each component of steps 1-2 stored per response."""
    (tmp_path / "rewards.py").write_text(FLAGGED)
    (tmp_path / "fail-at-2").write_text("")
    runs = tmp_path / "runs"
    command = [
        *QAE,
        "sweep",
        "--estimator",
        "qae",
        "--name",
        "rw",
        "--runs-dir",
        str(runs),
        *TINY,
        "--reward",
        "exact_int",
        "--reward",
        "rewards.py:short",
        "--reward-weights",
        "1,0.5",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert first.returncode != 0 and "RuntimeError: not yet" in first.stdout + first.stderr, first.stdout
    db = db_path(runs, "rw-qae-k0.4-s0")
    assert read_run(db)["status"] == "failed" and read_steps(db)["step"].tolist() == [1]
    (tmp_path / "fail-at-2").unlink()
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert read_run(db)["status"] == "finished" and read_steps(db)["step"].tolist() == [1, 2]
    rows = query(
        db,
        "SELECT r.reward, e.value AS exact, s.value AS short, r.response FROM rollouts r "
        "JOIN reward_components e USING (step, group_idx, sample_idx) "
        "JOIN reward_components s USING (step, group_idx, sample_idx) "
        "WHERE e.name = 'exact_int' AND s.name = 'short'",
    )
    assert len(rows) == 2 * 2 * 4
    assert rows["short"].tolist() == [float(len(r.strip()) <= 2) for r in rows["response"]]
    assert rows["reward"].tolist() == pytest.approx((rows["exact"] + 0.5 * rows["short"]).tolist())
    record = json.loads((runs / "rw-qae-k0.4-s0" / "config.json").read_text())["reward_files"]["rewards.py:short"]
    assert record["path"] == str(tmp_path / "rewards.py") and "earlier" not in record
