"""A run folder is data, and only its own: a symlink planted in it never points qae's reads or writes at another run
or any other file, and a FIFO or a device never hangs a command or fills memory. Each is refused by name, exit 2,
nothing written outside the folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.run_folder import checkpoint_problem, latest_checkpoint

runner = CliRunner()
TRAIN = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--cpu"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A runs folder holding two finished one-step runs, `victim` and `evil`, each with a checkpoint."""
    runs_dir = tmp_path_factory.mktemp("runs")
    for name in ("victim", "evil"):
        result = runner.invoke(app, ["train", "--run-name", name, *TRAIN, "--runs-dir", str(runs_dir)])
        assert result.exit_code == 0, result.output
    return runs_dir


@pytest.fixture
def runs(two_runs, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(two_runs, runs_dir)
    return runs_dir


def qae(*args, runs_dir) -> subprocess.CompletedProcess:
    """The command in a process of its own: a hang fails the test after 120 s instead of holding the suite."""
    return subprocess.run(
        [sys.executable, "-m", "qae_app.cli", *args, "--runs-dir", str(runs_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, COLUMNS="300"),
    )


def test_a_database_linked_to_another_run_is_refused_and_the_other_run_untouched(runs):
    victim = (runs / "victim" / "qae.duckdb").read_bytes()
    (runs / "evil" / "qae.duckdb").unlink()
    (runs / "evil" / "qae.duckdb").symlink_to("../victim/qae.duckdb")
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "qae.duckdb is a symbolic link" in result.stdout + result.stderr
    assert (runs / "victim" / "qae.duckdb").read_bytes() == victim


def test_a_lock_file_linked_outside_is_not_truncated(runs, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    (runs / "evil" / "trainer.lock").unlink(missing_ok=True)
    (runs / "evil" / "trainer.lock").symlink_to(notes)
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    assert result.returncode == 2 and "trainer.lock is a symbolic link" in result.stdout + result.stderr
    assert notes.read_text() == "my notes\n"
    listed = qae("runs", runs_dir=runs)  # a reader takes the planted lock for no trainer: the run is not live
    assert listed.returncode == 0 and "evil" in listed.stdout


def test_a_database_hard_linked_to_another_run_is_refused_and_the_other_run_untouched(runs):
    """A hard link is a regular file, so the symlink checks passed it: `qae train --resume evil` with `evil/qae.duckdb`
    hard-linked to `victim/qae.duckdb` (a tar archive unpacked into the runs folder makes one) trained into the
    victim's file, its id and rows replaced, exit 0."""
    victim = (runs / "victim" / "qae.duckdb").read_bytes()
    (runs / "evil" / "qae.duckdb").unlink()
    os.link(runs / "victim" / "qae.duckdb", runs / "evil" / "qae.duckdb")
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "qae.duckdb is a hard link" in output, output
    assert (runs / "victim" / "qae.duckdb").read_bytes() == victim


@pytest.mark.parametrize("command", [["train", "--resume", "evil", "--steps", "2"], ["rm", "evil", "--yes"]])
def test_a_lock_file_hard_linked_outside_is_not_truncated(runs, tmp_path, command):
    """The lock is taken on a file of the run's own: a hard-linked trainer.lock was truncated to a process id."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    (runs / "evil" / "trainer.lock").unlink(missing_ok=True)
    os.link(notes, runs / "evil" / "trainer.lock")
    result = qae(*command, runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "trainer.lock is a hard link" in output, output
    assert notes.read_text() == "my notes\n"


def test_a_resume_writes_its_config_into_the_run_folder_not_through_a_hard_link(runs):
    """The resume rewrites config.json: written in place, a hard link took it to the file it shares (here the
    victim's config, which then named the other run). It is replaced instead, as labels.json is."""
    victim = (runs / "victim" / "config.json").read_bytes()
    (runs / "evil" / "config.json").unlink()
    os.link(runs / "victim" / "config.json", runs / "evil" / "config.json")
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (runs / "victim" / "config.json").read_bytes() == victim
    assert os.stat(runs / "evil" / "config.json").st_nlink == 1


@pytest.mark.parametrize("command", [["runs"], ["show", "evil"], ["train", "--resume", "evil", "--steps", "2"]])
def test_a_fifo_lock_file_hangs_no_command(runs, command):
    (runs / "evil" / "trainer.lock").unlink(missing_ok=True)
    os.mkfifo(runs / "evil" / "trainer.lock")
    result = qae(*command, runs_dir=runs)
    if command[0] == "train":
        assert result.returncode == 2 and "trainer.lock is not a regular file" in result.stdout + result.stderr
    else:
        assert result.returncode == 0 and "evil" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("plant", ["fifo", "/dev/zero"])
def test_a_config_that_is_a_fifo_or_a_device_is_named_not_read(runs, plant):
    config = runs / "evil" / "config.json"
    config.unlink()
    os.mkfifo(config) if plant == "fifo" else config.symlink_to(plant)
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert "config.json is " + ("not a regular file" if plant == "fifo" else "a symbolic link") in output


def test_a_checkpoint_whose_manifest_lists_nothing_or_a_link_is_not_trusted(runs, tmp_path):
    checkpoint = latest_checkpoint(runs / "evil")
    assert checkpoint is not None and checkpoint_problem(checkpoint) is None
    manifest = (checkpoint / "manifest.json").read_text()
    (checkpoint / "manifest.json").write_text("{}")
    assert checkpoint_problem(checkpoint) == "manifest.json lists no files"
    (checkpoint / "manifest.json").write_text(manifest)
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the Hub")
    listed = next(name for name in __import__("json").loads(manifest) if name.startswith("model/"))
    (checkpoint / listed).unlink()
    (checkpoint / listed).symlink_to(outside)
    assert "is a symbolic link" in checkpoint_problem(checkpoint)


@pytest.mark.parametrize("folder", ["checkpoints", "pending", "tensorboard"])
def test_a_folder_of_the_run_linked_outside_is_refused_before_anything_is_written_through_it(runs, tmp_path, folder):
    """The plant harness found it: `checkpoints -> elsewhere` and `qae train --resume` wrote its new checkpoint
    through the link, outside the run folder. Each folder qae writes into is one of the run folder's own."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if (runs / "evil" / folder).exists():
        (runs / "evil" / folder).rename(tmp_path / f"{folder}-moved")
    (runs / "evil" / folder).symlink_to(outside)
    result = qae("train", "--resume", "evil", "--steps", "2", "--report-to", "tensorboard", runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and f"{folder} is a symbolic link" in output, output
    assert list(outside.iterdir()) == []


def test_the_writer_saves_no_write_through_a_linked_pending_folder(tmp_path):
    from qae_app.core.errors import QAEUserError
    from qae_app.store.writer import RunWriter

    RunWriter(tmp_path / "r" / "qae.duckdb", "r")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if (tmp_path / "r" / "pending").exists():
        (tmp_path / "r" / "pending").rmdir()
    (tmp_path / "r" / "pending").symlink_to(outside)
    with pytest.raises(QAEUserError, match="pending is a symbolic link"):
        RunWriter(tmp_path / "r" / "qae.duckdb", "r")
    assert list(outside.iterdir()) == []


def test_a_resume_refused_after_taking_the_lock_lets_it_go(runs, tmp_path):
    """Seen in the plant harness, in one process: a resume refused after it took the run's lock (a linked
    checkpoints/) kept holding it, so `qae rm` next said the run was being trained right now."""
    from qae_app.store.run_folder import trainer_alive

    shutil.move(runs / "evil" / "checkpoints", tmp_path / "checkpoints")
    (runs / "evil" / "checkpoints").symlink_to(tmp_path / "checkpoints")
    refused = runner.invoke(app, ["train", "--resume", "evil", "--steps", "2", "--runs-dir", str(runs)])
    assert refused.exit_code == 2 and "checkpointsisasymboliclink" in "".join(refused.output.split())
    assert not trainer_alive(runs / "evil")
    removed = runner.invoke(app, ["rm", "evil", "--yes", "--runs-dir", str(runs)])
    assert removed.exit_code == 0 and not (runs / "evil").exists(), removed.output
    assert (tmp_path / "checkpoints").is_dir()  # the link was removed, not what it points at


# ---------------------------------------------------------------------------------------------------------------
# issue 48: a resume needs a run


@pytest.mark.parametrize("linked", [False, True], ids=["folder", "linked-folder"])
@pytest.mark.parametrize(
    "command", [["train", "--resume", "exp1", "--steps", "2"], ["migrate", "exp1"]], ids=["resume", "migrate"]
)
def test_a_command_writing_a_run_refuses_a_folder_that_holds_no_run_and_writes_nothing(runs, tmp_path, linked, command):
    """H1: `qae train --resume exp1` on a folder holding a config.json of someone's own and no database started a new
    run in it, its config.json overwritten; through a linked run folder, outside the runs dir. `qae migrate exp1`
    wrote its lock there and dropped the key it did not know from that config.json. Each needs a run: refused by
    name, the unknown key named, nothing written."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "config.json").write_text('{"user": "project settings"}\n')
    if linked:
        (runs / "exp1").symlink_to(project)
    else:
        shutil.copytree(project, runs / "exp1")
    folder = runs / "exp1"
    before = sorted((path.name, path.read_bytes()) for path in folder.iterdir())
    result = qae(*command, runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and output.count("error:") == 1 and "Traceback" not in output, output
    assert "'exp1' in" in output and "is not a run: it holds no qae.duckdb" in output
    assert "'user', no setting of a qae run" in output and "Nothing was written" in output
    assert sorted((path.name, path.read_bytes()) for path in folder.iterdir()) == before


def test_a_run_whose_config_holds_a_key_no_run_has_is_refused_by_name(runs):
    """H1's unknown key: every key a run's config.json holds was written by qae (no option was ever dropped), so one
    it does not know is not a setting it may leave out silently."""
    config = runs / "evil" / "config.json"
    config.write_text(config.read_text().replace("{", '{"user": "project settings", ', 1))
    before = config.read_bytes()
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "holds 'user', no setting of a qae run" in output, output
    assert config.read_bytes() == before and not (runs / "evil" / "checkpoints" / "step-2").exists()


def test_rm_of_a_linked_run_folder_removes_the_link_and_keeps_what_it_points_at(runs, tmp_path):
    """M3: `qae rm t2`, t2 a link to a run folder outside the runs dir, took the run's lock through the link (a
    trainer.lock written outside), renamed the link to `.removing-t2-<pid>`, then failed in shutil.rmtree (a traceback,
    exit 1): the run was hidden from `qae runs` and the dashboard and never restored."""
    outside = tmp_path / "outside"
    shutil.copytree(runs / "evil", outside / "t2", symlinks=True)
    (outside / "t2" / "trainer.lock").unlink(missing_ok=True)
    (runs / "t2").symlink_to(outside / "t2")
    before = sorted((path.relative_to(outside), path.stat().st_mtime_ns) for path in outside.rglob("*"))
    result = qae("rm", "t2", "--yes", runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0 and "Traceback" not in output, output
    assert f"t2 was a link to {outside / 't2'}: the link is removed, the folder it points at is kept" in output
    assert sorted(path.name for path in runs.iterdir()) == ["evil", "victim"]  # nothing hidden, nothing left over
    assert sorted((path.relative_to(outside), path.stat().st_mtime_ns) for path in outside.rglob("*")) == before


@pytest.mark.parametrize("planted", ["step-2", "step-2.tmp"])
def test_a_checkpoint_folder_that_is_a_link_is_refused_before_a_save_removes_it(runs, tmp_path, planted):
    """L9: `checkpoints/step-2 -> outside` (passed over as no checkpoint of the run's) crashed the resume when it
    reached step 2: save_checkpoint removes the old step-2 first, and shutil.rmtree refused the link (`OSError:
    Cannot call rmtree on a symbolic link`). A resume refuses it by name before training, and a save removes only a
    link, never what it points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("kept")
    (runs / "evil" / "checkpoints" / planted).symlink_to(outside)
    result = qae("train", "--resume", "evil", "--steps", "2", runs_dir=runs)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and output.count("error:") == 1 and "Traceback" not in output, output
    assert f"checkpoints/{planted} is a symbolic link" in output
    assert sorted(path.name for path in outside.iterdir()) == ["keep.txt"]
    from qae_app.store.run_folder import remove_entry

    remove_entry(runs / "evil" / "checkpoints" / planted)  # what a save does to the step it replaces
    assert not (runs / "evil" / "checkpoints" / planted).is_symlink() and (outside / "keep.txt").read_text() == "kept"
