"""Runs people manage: `qae tag`, `qae note` (while the run trains, without its database lock), `qae runs --tag`,
`qae show`, and `qae rm` (a live run refused, asked first unless --yes, a sweep's runs by --sweep)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.labels import LABELS_FILE, read_labels
from qae_app.store.run_folder import RunLock, trainer_alive
from tests.synthetic import write_run

runner = CliRunner()


def qae(*args, runs_dir, input=None):
    result = runner.invoke(app, [*args, "--runs-dir", str(runs_dir)], input=input, env={"COLUMNS": "200"})
    return result.exit_code, result.output


@pytest.fixture
def runs(tmp_path):
    runs_dir = tmp_path / "runs"
    for name, seed in (("base-s0", 0), ("base-s1", 1), ("other", 2)):
        sweep = {"sweep_id": "sw1", "sweep_name": "base"} if name.startswith("base") else {}
        write_run(runs_dir, name, steps=2, prompts_per_step=2, group_size=4, seed=seed, config=sweep)
    return runs_dir


def test_tags_and_a_note_round_trip_while_the_database_is_held(runs):
    with duckdb.connect(str(runs / "base-s0" / "qae.duckdb")):  # a trainer's write lock on the file
        assert qae("tag", "base-s0", "baseline", "paper", runs_dir=runs)[0] == 0
        assert qae("tag", "base-s0", "paper", "lr-too-high", runs_dir=runs)[0] == 0  # no duplicate
        assert qae("note", "base-s0", "the paper's baseline", runs_dir=runs)[0] == 0
    labels = read_labels(runs / "base-s0")
    assert labels.tags == ["baseline", "paper", "lr-too-high"] and labels.note == "the paper's baseline"
    assert qae("tag", "base-s0", "paper", "--remove", runs_dir=runs)[0] == 0
    assert read_labels(runs / "base-s0").tags == ["baseline", "lr-too-high"]
    code, shown = qae("show", "base-s0", runs_dir=runs)
    assert code == 0 and "tags baseline, lr-too-high" in shown and "note the paper's baseline" in shown
    assert qae("note", "base-s0", "", runs_dir=runs)[0] == 0 and read_labels(runs / "base-s0").note == ""


def test_runs_lists_tags_and_filters_by_one(runs):
    qae("tag", "base-s0", "baseline", runs_dir=runs)
    qae("tag", "base-s1", "baseline", runs_dir=runs)
    code, listed = qae("runs", "--tag", "baseline", runs_dir=runs)
    assert code == 0 and "2 run(s)" in listed and "base-s0" in listed and "other" not in listed
    assert "tags" in listed.splitlines()[2] or "tags" in listed  # the column appears once a run has tags
    code, none = qae("runs", "--tag", "nope", runs_dir=runs)
    assert code == 0 and "no run tagged 'nope'" in none


@pytest.mark.parametrize(
    "args, message",
    [
        (["tag", "base-s0", "two words"], "tag: 'two words' is not a tag"),
        (["tag", "nope", "x"], "no run 'nope'"),
        (["note", "base-s0", "x" * 2001], "note: 2,001 characters, more than 2,000"),
        (["rm", "nope", "--yes"], "no run 'nope'"),
        (["rm", "--yes"], "name the runs to delete"),
        (["stop"], "name the run to stop"),
        (["stop", "--sweep", "nope"], "no run of sweep 'nope'"),
        (["stop", "--sweep", "base"], "nothing of sweep 'base' is running"),
        (["rm", "other", "--sweep", "NOPE", "--yes"], "no run of sweep 'NOPE'"),  # issue 48 L8: it deleted `other`
    ],
)
def test_a_bad_tag_note_or_rm_is_one_message_and_changes_nothing(runs, args, message):
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    code, output = qae(*args, runs_dir=runs)
    assert code == 2 and message in " ".join(output.split()), output
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before


def test_rm_refuses_a_live_run_asks_first_and_deletes_a_sweeps_runs(runs):
    lock = RunLock(runs / "other").acquire("test")  # as a live trainer holds it
    try:
        code, output = qae("rm", "other", "--yes", runs_dir=runs)
        assert code == 2 and "'other' is being trained right now" in output and (runs / "other").is_dir()
        assert "Stop it first with `qae stop other`" in " ".join(output.split())
    finally:
        lock.release()
    code, output = qae("rm", "other", runs_dir=runs, input="n\n")  # a "no" is an answer: exit 0 (docs/cli.md)
    assert code == 0 and "nothing deleted" in output and (runs / "other").is_dir()
    code, output = qae("rm", "other", runs_dir=runs, input="y\n")
    assert code == 0 and not (runs / "other").exists()
    assert sorted(p.name for p in runs.iterdir()) == ["base-s0", "base-s1"]
    code, output = qae("rm", "--sweep", "base", "--yes", runs_dir=runs)
    assert code == 0 and "deleted 2 run(s)" in output and list(runs.iterdir()) == []


def test_a_planted_labels_file_reads_as_no_labels(runs):
    (runs / "base-s0" / LABELS_FILE).symlink_to("/etc/hostname")
    assert read_labels(runs / "base-s0").tags == []
    assert qae("tag", "base-s0", "x", runs_dir=runs)[0] == 0  # replaced, not followed
    assert not (runs / "base-s0" / LABELS_FILE).is_symlink() and read_labels(runs / "base-s0").tags == ["x"]


def test_stop_of_a_run_nobody_trains_says_only_that(runs):
    """It printed "stopping run other after its current step..." and then that the run was not running."""
    code, output = qae("stop", "other", runs_dir=runs)
    assert code == 2 and "'other' is not running" in output and "Nothing was signalled" in output
    assert "stopping run" not in output and output.count("error:") == 1, output


def test_runs_shows_each_runs_note_under_the_table(runs):
    """`qae note` said its note was shown by `qae runs`; only `qae show` printed it."""
    qae("note", "base-s1", "lr too high:\nhalve it", runs_dir=runs)
    qae("note", "other", "y" * 2000, runs_dir=runs)
    code, listed = qae("runs", runs_dir=runs)
    lines = listed.splitlines()
    assert code == 0 and "note base-s1: lr too high: halve it" in lines, listed  # one line per note
    assert "note other: " + "y" * 120 + "… (2,000 characters; qae show other)" in lines, listed
    assert not any(line.startswith("note base-s0") for line in lines)


def test_rm_under_a_reader_leaves_it_reading_what_it_opened(runs):
    """`qae rm` does not race a reader (issue 38): a reader holding the run's database keeps reading it while the run
    is deleted, and the listing no longer shows the run."""
    with duckdb.connect(str(runs / "base-s0" / "qae.duckdb"), read_only=True) as reader:
        code, output = qae("rm", "base-s0", "--yes", runs_dir=runs)
        assert code == 0 and "deleted 1 run(s): base-s0" in output and not (runs / "base-s0").exists()
        assert reader.execute("SELECT list(step ORDER BY step) FROM steps").fetchone()[0] == [1, 2]
    code, listed = qae("runs", runs_dir=runs)
    assert code == 0 and "2 run(s)" in listed and "base-s0" not in listed
    assert sorted(p.name for p in runs.iterdir()) == ["base-s1", "other"]  # nothing left half-deleted


# a process that is no trainer: it keeps its own pid file locked, as daemons do, and says when it is signalled (issue
# 48 M1's reproduction)
STRANGER = """import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
os.write(fd, str(os.getpid()).encode())
fcntl.flock(fd, fcntl.LOCK_EX)
signal.signal(signal.SIGTERM, lambda s, f: (open(sys.argv[2], 'w').write('15'), sys.exit()))
print('held', flush=True)
time.sleep(120)
"""


@pytest.fixture
def stranger(tmp_path, request):
    """stranger(pid_file) -> a live non-qae process holding an exclusive flock on `pid_file`; `tmp_path /
    'got-signal'` appears if it is ever sent SIGTERM."""

    def start(pid_file):
        process = subprocess.Popen(
            [sys.executable, "-c", STRANGER, str(pid_file), str(tmp_path / "got-signal")],
            stdout=subprocess.PIPE,
            text=True,
        )
        request.addfinalizer(process.kill)
        assert process.stdout.readline().strip() == "held"
        return process

    return start


@pytest.mark.parametrize("holder", ["pid-file", "live-run"])
def test_stop_never_signals_a_process_holding_a_file_hard_linked_in_as_the_lock(runs, tmp_path, stranger, holder):
    """M1: `qae stop evil2` signalled whatever process held a flock on a file hard-linked in as evil2's trainer.lock:
    a daemon's locked pid file (SIGTERM delivered) or another live run's lock (it stopped it). The kernel's lock table
    names the holder of the inode, which a hard link shares; the holder must hold the run's own lock by its own name.
    """
    shutil.copytree(runs / "base-s0", runs / "evil2")
    (runs / "evil2" / "trainer.lock").unlink(missing_ok=True)
    shared = tmp_path / "stranger.pid" if holder == "pid-file" else runs / "other" / "trainer.lock"
    process = stranger(shared)  # (for "live-run": as `other`'s trainer holds its lock, pid recorded)
    os.link(shared, runs / "evil2" / "trainer.lock")
    code, output = qae("stop", "evil2", "--timeout", "10", runs_dir=runs)
    said = " ".join(output.split())
    assert code == 2 and said.count("error:") == 1 and "trainer.lock is a hard link" in said, said
    assert "Nothing was signalled" in said and "stopping run" not in said
    assert process.poll() is None and not (tmp_path / "got-signal").exists()
    assert not trainer_alive(runs / "evil2")  # a lock of several names is no trainer's: evil2 is not live


def test_stop_never_signals_a_process_that_locked_the_lock_file_under_another_name(runs, tmp_path, stranger):
    """M1, its other name removed: a daemon's locked pid file moved in as evil2's trainer.lock has one name again,
    records the daemon's pid, and the kernel lists the daemon as its holder; but the daemon opened it as its own pid
    file, not as the run's lock, so it is not this run's trainer."""
    shutil.copytree(runs / "base-s0", runs / "evil2")
    (runs / "evil2" / "trainer.lock").unlink(missing_ok=True)
    process = stranger(tmp_path / "stranger.pid")
    os.link(tmp_path / "stranger.pid", runs / "evil2" / "trainer.lock")
    (tmp_path / "stranger.pid").unlink()
    code, output = qae("stop", "evil2", "--timeout", "10", runs_dir=runs)
    said = " ".join(output.split())
    assert code == 2 and "holds the file under the run's own name" in said and "Nothing was signalled" in said, said
    assert process.poll() is None and not (tmp_path / "got-signal").exists()


def test_many_tags_are_read_whole_and_a_tag_or_note_never_rewrites_labels_it_could_not_read(runs):
    """L2: 1,700 tags of 40 characters (70 KB, over the 64 KiB labels reader's limit) read as none, and the next
    `qae tag` or `qae note` wrote the file back from that: the note and every tag gone. Labels qae writes are read
    whole; a file that does not read whole is refused by `qae tag` and `qae note`, never rewritten."""
    tags = [f"t{i:04d}-" + "x" * 33 for i in range(1700)]
    assert qae("tag", "base-s0", *tags, runs_dir=runs)[0] == 0
    assert qae("note", "base-s0", "the paper's baseline", runs_dir=runs)[0] == 0
    assert (runs / "base-s0" / LABELS_FILE).stat().st_size > 64 * 1024
    assert qae("tag", "base-s0", "one-more", runs_dir=runs)[0] == 0
    labels = read_labels(runs / "base-s0")
    assert labels.tags == [*tags, "one-more"] and labels.note == "the paper's baseline"
    code, shown = qae("show", "base-s0", runs_dir=runs)
    assert code == 0 and "one-more" in shown and "note the paper's baseline" in shown
    (runs / "base-s0" / LABELS_FILE).write_text('{"tags": ["kept"], "note": "kept", "colour": "red"}')  # by hand
    with open(runs / "base-s0" / LABELS_FILE, "ab") as f:  # and a file larger than any qae writes
        f.truncate(2 << 20)
    before = (runs / "base-s0" / LABELS_FILE).read_bytes()
    for args in (["tag", "base-s0", "x"], ["note", "base-s0", "y"]):
        code, output = qae(*args, runs_dir=runs)
        said = " ".join(output.split())
        assert code == 2 and said.count("error:") == 1 and "labels.json is larger than" in said, said
        assert (runs / "base-s0" / LABELS_FILE).read_bytes() == before
    (runs / "base-s0" / LABELS_FILE).write_text('{"tags": ["kept", "two words"], "note": "kept"}')
    code, output = qae("tag", "base-s0", "x", runs_dir=runs)
    assert code == 2 and "holds tags or a note that qae did not write" in " ".join(output.split()), output


def test_labels_larger_than_a_reader_reads_are_never_written():
    from qae_app.core.errors import QAEUserError
    from qae_app.store.labels import MAX_LABELS_BYTES, Labels, write_labels

    tags = [f"t{i:06d}-" + "x" * 31 for i in range(MAX_LABELS_BYTES // 40)]
    with pytest.raises(QAEUserError, match="more than the 1,048,576 a run's labels may"):
        write_labels(Path("/nonexistent"), Labels(tags=tags))
