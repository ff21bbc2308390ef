"""The run folder (qae_app/store/run_folder.py) as operators meet it: liveness that survives pid reuse, a lock taken
before anything slow, run creation that is atomic for every command, checkpoints verified before they are trusted, and
resume refusing what it cannot do honestly."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.store.reader import read_run, read_runs, read_steps
from qae_app.store.run_folder import (
    LOCK_FILE,
    MANIFEST,
    TRAINER_STATE,
    RunLock,
    checkpoint_problem,
    db_path,
    effective_status,
    latest_checkpoint,
    list_checkpoints,
    trainer_alive,
)
from qae_app.train.session import resume_config
from qae_app.train.trainer import Trainer

QAE = str(Path(sys.executable).parent / "qae")
OPTS = dict(steps=4, prompts_per_step=2, group_size=4, eval_every=0, checkpoint_every=2, seed=1)


def run(runs_dir, name, **opts):
    return Trainer(build_config(run_name=name, **dict(OPTS, **opts)), runs_dir, cpu=True).fit()


def qae(*args, runs_dir):
    return subprocess.run(
        [QAE, *args, "--runs-dir", str(runs_dir)], capture_output=True, text=True, env=dict(os.environ, COLUMNS="200")
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    run(runs_dir, "done")
    return runs_dir


def copy_run(finished, tmp_path, name="r") -> Path:
    shutil.copytree(finished / "done", tmp_path / name)
    return tmp_path / name


def test_liveness_is_the_lock_not_the_pid(tmp_path):
    """After a container restart the resuming trainer can be pid 1 again; a pid file naming a live pid must not make
    a dead run look alive."""
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / LOCK_FILE).write_text("1")  # pid 1 is alive, but holds no lock on this file
    assert not trainer_alive(folder)
    assert effective_status("running", folder) == "stopped"
    lock = RunLock(folder).acquire("test")
    assert trainer_alive(folder) and effective_status("running", folder) == "running"
    with pytest.raises(QAEUserError, match=f"being trained right now by process {os.getpid()}"):
        RunLock(folder).acquire("resume", attempts=2)
    lock.release()
    assert not trainer_alive(folder)


def test_a_stale_lock_file_with_a_live_pid_does_not_block_resume(finished, tmp_path):
    folder = copy_run(finished, tmp_path)
    (folder / LOCK_FILE).write_text("1")
    result = Trainer(resume_config(tmp_path, "r", steps=5), tmp_path, resume=True, cpu=True).fit()
    assert result.status == "finished" and read_steps(db_path(tmp_path, "r"))["step"].tolist() == [1, 2, 3, 4, 5]


def test_the_lock_is_taken_before_the_model_loads(finished, tmp_path, monkeypatch):
    folder = copy_run(finished, tmp_path)
    loaded = []
    monkeypatch.setattr("qae_app.train.trainer.load_policy", lambda *a, **kw: loaded.append(a))
    lock = RunLock(folder).acquire("test")
    try:
        with pytest.raises(QAEUserError, match="being trained right now"):
            Trainer(resume_config(tmp_path, "r"), tmp_path, resume=True, cpu=True)
    finally:
        lock.release()
    assert loaded == []


def test_a_run_being_created_is_invisible_and_a_failed_creation_leaves_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        assert list(tmp_path.glob(".creating-new-*/trainer.lock"))  # locked while it is being built...
        assert read_runs(tmp_path).empty  # ...and no command sees it
        raise QAEUserError("model: refused by the test")

    monkeypatch.setattr("qae_app.train.trainer.load_policy", refuse)
    with pytest.raises(QAEUserError, match="refused by the test"):
        Trainer(build_config(run_name="new", **OPTS), tmp_path, cpu=True)
    assert list(tmp_path.iterdir()) == []


def test_a_run_session_claims_the_folder_and_close_lets_go_of_it(tmp_path):
    """RunSession alone, no trainer: while it is open the run is locked (and, before its store opens, invisible);
    leaving `with` before open_store leaves nothing, and after it leaves the run, with its row, unlocked."""
    from accelerate import Accelerator

    from qae_app.train.session import RunSession
    from qae_app.train.trainer_state import TrainerState

    cfg, acc = build_config(run_name="s", **OPTS), Accelerator(cpu=True)
    with RunSession(tmp_path, "s", cfg, acc):
        (staging,) = tmp_path.glob(".creating-s-*")
        assert trainer_alive(staging) and read_runs(tmp_path).empty
    assert list(tmp_path.iterdir()) == []
    with RunSession(tmp_path, "s", cfg, acc) as session:
        assert session.open_store(TrainerState(k=0.4)) == {}  # (a new run: no earlier sessions' times)
        assert trainer_alive(tmp_path / "s") and read_run(db_path(tmp_path, "s"))["status"] == "running"
    assert not trainer_alive(tmp_path / "s") and [p.name for p in tmp_path.iterdir()] == ["s"]
    assert read_run(db_path(tmp_path, "s"))["k"] == 0.4


def test_a_creation_killed_midway_does_not_block_the_name(tmp_path):
    (tmp_path / ".creating-new-99999").mkdir()  # what a kill -9 during creation leaves: hidden, unlocked
    assert read_runs(tmp_path).empty
    assert run(tmp_path, "new", steps=1).status == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_two_fresh_runs_with_one_name_at_once(tmp_path):
    """The second to finish setting up finds the name taken, says so, and leaves nothing behind."""
    first = Trainer(build_config(run_name="twin", **OPTS), tmp_path, cpu=True)
    with pytest.raises(QAEUserError, match="a run 'twin' already exists"):
        Trainer(build_config(run_name="twin", **OPTS), tmp_path, cpu=True)
    first.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["twin"]


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_checkpoint_that_checks_out(finished, tmp_path):
    folder = copy_run(finished, tmp_path)
    newest = latest_checkpoint(folder)
    assert newest.name == "step-4" and checkpoint_problem(newest) is None
    weights = newest / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the weights: loads silently unless checked
    weights.write_bytes(bytes(data))
    assert "policy.safetensors does not match its checksum" in checkpoint_problem(newest)
    result = qae("train", "--resume", "r", runs_dir=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "skipping checkpoint step-4: policy.safetensors does not match its checksum" in out
    assert "resuming run r from checkpoint step-2" in out
    assert read_steps(db_path(tmp_path, "r"))["step"].tolist() == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_is_not_trusted(finished, tmp_path):
    folder = copy_run(finished, tmp_path)
    for checkpoint in list_checkpoints(folder):
        (checkpoint / MANIFEST).unlink()
    result = qae("train", "--resume", "r", "--steps", "5", runs_dir=tmp_path)
    assert result.returncode == 2
    assert "no checkpoint of run 'r' checks out" in " ".join(result.stderr.split())


@pytest.mark.slow
def test_a_checkpoint_without_its_trainer_state_is_named_not_passed_over(finished, tmp_path):
    """A step-N folder missing trainer_state.json was left out of the checkpoints silently: with the newest one
    damaged the run resumed from an older one without a word, and with all of them damaged it said the run had no
    checkpoint and trained it again from step 0, where any other damage is named and refused."""
    folder = copy_run(finished, tmp_path)
    (latest_checkpoint(folder) / TRAINER_STATE).unlink()
    result = qae("train", "--resume", "r", runs_dir=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "skipping checkpoint step-4: trainer_state.json is missing" in out
    assert "resuming run r from checkpoint step-2" in out
    for checkpoint in list_checkpoints(folder):
        (checkpoint / TRAINER_STATE).unlink(missing_ok=True)
    result = qae("train", "--resume", "r", "--steps", "6", runs_dir=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no checkpoint of run 'r' checks out" in " ".join(result.stderr.split())
    assert "training it again from step 0" not in result.stdout


@pytest.mark.slow
def test_resume_without_the_database_refuses_instead_of_losing_steps(finished, tmp_path):
    folder = copy_run(finished, tmp_path)
    (folder / "qae.duckdb").unlink()
    result = qae("train", "--resume", "r", "--steps", "6", runs_dir=tmp_path)
    said = " ".join(result.stderr.split())
    assert result.returncode == 2 and "run 'r' in" in said, said
    assert (
        "has no qae.duckdb: it was deleted or moved aside, and with it the rows of the steps up to its checkpoint "
        "step-4. Nothing was written"
    ) in said


def test_resume_of_a_run_killed_before_its_first_checkpoint_without_a_row_starts_it_again(finished, tmp_path):
    """What an older version left when killed between creating the database and writing the run's row."""
    folder = copy_run(finished, tmp_path)
    shutil.rmtree(folder / "checkpoints")
    (folder / "qae.duckdb").unlink()
    from qae_app.store.writer import RunWriter

    RunWriter(folder / "qae.duckdb", "r")  # tables, no run row
    result = Trainer(resume_config(tmp_path, "r", steps=2), tmp_path, resume=True, cpu=True).fit()
    assert result.status == "finished" and read_run(db_path(tmp_path, "r"))["status"] == "finished"
    assert read_steps(db_path(tmp_path, "r"))["step"].tolist() == [1, 2]


@pytest.mark.slow
def test_resume_refuses_fewer_steps_than_done(finished, tmp_path):
    copy_run(finished, tmp_path)
    result = qae("train", "--resume", "r", "--steps", "2", runs_dir=tmp_path)
    assert result.returncode == 2
    assert "steps: 2 is below the 4 steps run 'r' has already done" in " ".join(result.stderr.split())
    assert read_run(db_path(tmp_path, "r"))["config"].count('"steps": 4') == 1  # nothing was changed


def test_resume_refuses_an_edited_data_file(tmp_path):
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(f'{{"id": {i}, "question": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8)))
    Trainer(build_config(run_name="m", data=str(data), **dict(OPTS, steps=1)), tmp_path, cpu=True).fit()
    data.write_text(data.read_text().replace('"answer": "1"', '"answer": "2"', 1))
    with pytest.raises(QAEUserError, match="changed since run 'm' was started"):
        Trainer(resume_config(tmp_path, "m", steps=2), tmp_path, resume=True, cpu=True)


def test_resume_keeps_the_options_given_even_when_they_equal_the_defaults(finished, tmp_path):
    """A run started with --steps 4 --checkpoint-every 2, resumed with --steps 300 --checkpoint-every 50 (the
    defaults): both are what the user asked for."""
    copy_run(finished, tmp_path)
    cfg = resume_config(tmp_path, "r", steps=300, checkpoint_every=50)
    assert (cfg.steps, cfg.checkpoint_every) == (300, 50)
    assert resume_config(tmp_path, "r").steps == 4
    with pytest.raises(QAEUserError, match="--group-size 16 conflicts with run 'r', which was started with 4"):
        resume_config(tmp_path, "r", group_size=16)
