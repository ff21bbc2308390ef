"""The DuckDB store: round trip, whole-step transactions, replacing replayed steps, and a reader holding the lock."""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from qae_app.core.errors import QAEUserError
from qae_app.store.reader import query, read_rollouts, read_run, read_runs, read_steps, resolve_run
from qae_app.store.run_file import RunFileError
from qae_app.store.run_folder import db_path, validate_run_name
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import MAX_ROW_DELAY_S, RunWriter, read_pending_write


def _rows(step: int, n: int = 4):
    steps = [{name: float(step) for name in STEP_METRICS}]
    groups = [
        {
            "group_idx": 0,
            "prompt_id": "p",
            "prompt": "1+1=",
            "answer": "2",
            "n_correct": 1,
            "group_size": n,
            "baseline": 0.0,
            "regime": "hard",
        }
    ]
    rollouts = [
        {
            "group_idx": 0,
            "sample_idx": i,
            "prompt_id": "p",
            "response": "<b>2</b>" if i == 0 else "3",
            "reward": float(i == 0),
            "verified": True,
            "advantage": 1.5 if i == 0 else 0.0,
            "gated": i != 0,
            "regime": "hard",
            "n_tokens": 2,
            "truncated": False,
            "entropy": 0.1,
            "logprob": -0.5,
        }
        for i in range(n)
    ]
    return dict(steps=steps, groups=groups, rollouts=rollouts)


@pytest.fixture
def writer(tmp_path):
    w = RunWriter(tmp_path / "r1" / "qae.duckdb", "r1")
    w.create_run("r1", {"k": "0.4"}, "qae", 0.4, "builtin:tiny", "arith", 0)
    return w


def test_round_trip_and_replay_replaces_rows(writer, tmp_path):
    for step in (1, 2, 3):
        writer.add_step(step, **_rows(step))
    assert writer.flush()
    steps = read_steps(writer.path)
    assert steps["step"].tolist() == [1, 2, 3]
    assert set(STEP_METRICS) <= set(steps.columns)
    # a resumed run truncates after its checkpoint and writes steps again: each step is stored once
    writer.truncate_after(1)
    writer.add_step(2, **_rows(2))
    writer.add_step(2, **_rows(2))
    assert writer.flush()
    assert read_steps(writer.path)["step"].tolist() == [1, 2]
    assert query(writer.path, "SELECT count(*) AS n FROM rollouts")["n"].item() == 8
    runs = read_runs(tmp_path)
    assert runs["run_id"].tolist() == ["r1"] and runs["steps"].item() == 2


def test_rollout_filters_use_bound_parameters(writer):
    writer.add_step(1, **_rows(1))
    writer.flush()
    assert len(read_rollouts(writer.path, 1, gated=True)) == 3
    assert read_rollouts(writer.path, 1, gated=False)["response"].tolist() == ["<b>2</b>"]
    assert len(read_rollouts(writer.path, 1, regime="easy")) == 0
    assert len(read_rollouts(writer.path, 1, search="<B>")) == 1  # case-insensitive substring, not SQL
    assert len(read_rollouts(writer.path, 1, search="' OR 1=1 --")) == 0
    assert len(read_rollouts(writer.path, 1, search="%")) == 0  # no LIKE wildcards either


def test_rollouts_read_without_text_and_by_group_give_the_same_rows(tmp_path):
    """The Rollouts page counts and filters a step without its texts (~60 MB at the paper's step size) and reads the
    texts of the groups it shows only: both must be the whole read's rows, cut by column or by group."""
    import pandas as pd  # not at the top: a test imports this module in a process that must not load pandas

    from tests.synthetic import write_run

    write_run(tmp_path, "r", steps=2, prompts_per_step=4, group_size=4)
    path = tmp_path / "r" / "qae.duckdb"
    whole = read_rollouts(path, 2)
    bare = read_rollouts(path, 2, with_text=False)
    assert "response" not in bare and "prompt" not in bare
    pd.testing.assert_frame_equal(bare, whole.drop(columns=["prompt", "response"]))
    page = read_rollouts(path, 2, gated=True, group_ids=[1, 3])
    expected = whole[whole["gated"] & whole["group_idx"].isin([1, 3])].reset_index(drop=True)
    assert set(page["group_idx"]) == {1, 3} and not expected.empty
    pd.testing.assert_frame_equal(page, expected)


def test_nan_metrics_are_stored_as_null(writer):
    rows = _rows(1)
    rows["steps"][0]["entropy_neg"] = float("nan")
    writer.add_step(1, **rows)
    writer.flush()
    assert query(writer.path, "SELECT entropy_neg IS NULL AS missing FROM steps")["missing"].item()


class ReadLock:
    """Another process holding the run file open read-only for `seconds` (a reader in another process, as the
    dashboard is). A fresh interpreter, not multiprocessing's spawn, which would re-run whatever `__main__` the test
    process has (Streamlit's AppTest leaves it pointing at the dashboard's app.py)."""

    def __init__(self, path: Path, seconds: float):
        code = (
            "import sys, time, duckdb\n"
            "con = duckdb.connect(sys.argv[1], read_only=True)\n"
            "print('ready', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n"
            "con.close()\n"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout.readline().strip() == "ready"  # the file is held from here on

    def join(self) -> None:
        assert self.process.wait(timeout=60) == 0


def test_opening_a_file_a_reader_holds_says_why_it_waits(writer):
    """A resume opening its run's file waited up to 60 s without a word while a reader held it."""
    writer.add_step(1, **_rows(1))
    assert writer.flush()
    reader = ReadLock(writer.path, 2.5)
    waits = []
    RunWriter(writer.path, "r1", on_wait=waits.append)  # returns once the reader lets go
    reader.join()
    assert len(waits) == 1 and waits[0].startswith("held by process"), waits  # said once, naming the holder
    told = []
    RunWriter(writer.path, "r1", on_wait=told.append)  # nobody holds it now: nothing to say
    assert told == []


def test_writer_keeps_rows_while_a_reader_holds_the_file(writer):
    reader = ReadLock(writer.path, 3.0)
    writer.lock_timeout_s = 0.2
    writer.add_step(1, **_rows(1))
    assert writer.flush() is False  # busy: nothing lost, still buffered
    assert len(writer.pending) == 1 and writer.flush_retries == 1
    assert len(list(writer.pending_dir.glob("*.json"))) == 1  # and safe on disk, not only in memory
    writer.add_step(2, **_rows(2))
    assert writer.flush(timeout_s=30)  # waits for the reader to close
    reader.join()
    assert read_steps(writer.path)["step"].tolist() == [1, 2]
    assert list(writer.pending_dir.glob("*")) == []


def test_rows_spilled_while_a_reader_held_the_file_survive_a_kill(writer):
    """A trainer killed while a reader held the file: the next writer of the run (a resume) writes what was saved,
    in order: the rows, the run's status, and a truncation queued after them."""
    reader = ReadLock(writer.path, 2.0)
    for step in (1, 2, 3):
        writer.add_step(step, **_rows(step))
        assert writer.flush() is False
    writer.update_step(2, write_s=7.0)
    assert writer.update_run(status="interrupted") is False
    path = writer.path
    del writer  # the process dies: only the files under pending/ remain
    reader.join()
    resumed = RunWriter(path, "r1")
    assert [w.kind for w in resumed.pending] == ["step", "step", "step", "step_update", "run"]
    assert resumed.truncate_after(2)  # a resume from the checkpoint at step 2 drops step 3 and writes the rest
    steps = read_steps(path)
    assert steps["step"].tolist() == [1, 2] and steps["write_s"].tolist() == [1.0, 7.0]
    assert query(path, "SELECT status FROM runs")["status"].tolist() == ["interrupted"]
    assert list(resumed.pending_dir.glob("*")) == []


class FakeClock:
    """The writer's clock, moved by hand: when a flush is due must not depend on how fast this machine is."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_steps_between_database_writes_are_safe_on_disk_and_written_together(tmp_path):
    """Opening the file and each INSERT cost the same for one step as for ten, so the trainer writes steps together
    (flush_when_due): a step is written at once only when the last write is long enough ago. Until then its rows are
    saved under pending/ (a kill -9 loses nothing: the next writer of the run writes them), and its late timings
    join its row before it is written."""
    clock = FakeClock()
    path = tmp_path / "r1" / "qae.duckdb"
    writer = RunWriter(path, "r1", clock=clock)
    writer.create_run("r1", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    writer.add_step(1, **_rows(1))
    assert writer.flush_when_due()  # the first write is due at once: a new run shows its first step
    assert read_steps(path)["step"].tolist() == [1]
    for step in (2, 3, 4):
        writer.add_step(step, **_rows(step))
        assert writer.flush_when_due()  # not due: queued and saved, which is not a failure
    writer.update_step(3, write_s=7.0)
    assert writer.flush_when_due()
    assert read_steps(path)["step"].tolist() == [1]  # readers see whole steps only, later
    assert len(list(writer.pending_dir.glob("*.json"))) == 4  # three steps and an update, each safe on disk

    clock.now += MAX_ROW_DELAY_S  # rows reach readers at most this late
    assert writer.flush_when_due()
    steps = read_steps(path)
    assert steps["step"].tolist() == [1, 2, 3, 4] and steps["write_s"].tolist() == [1.0, 2.0, 7.0, 4.0]
    assert query(path, "SELECT count(*) AS n FROM rollouts")["n"].item() == 16
    assert list(writer.pending_dir.glob("*")) == []

    for step in (5, 6):
        writer.add_step(step, **_rows(step))
        assert writer.flush_when_due()
    del writer  # killed before the next write was due: only the files under pending/ remain
    resumed = RunWriter(path, "r1", clock=clock)
    assert [w.step for w in resumed.pending] == [5, 6]
    assert resumed.flush()
    assert read_steps(path)["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert query(path, "SELECT count(*) AS n FROM rollouts WHERE step >= 5")["n"].item() == 8


def test_saved_writes_are_synced_when_asked_not_each_step(tmp_path, monkeypatch):
    """A step saved under pending/ is whole on disk without an fsync (a kill cannot lose what the OS holds), which
    cost 3-45 ms a step on a busy disk; sync_pending (called before each checkpoint) syncs every saved write and the
    folder that holds their names. The OS's fsync runs as always: the test only notes which files it was given."""
    synced = []
    real_fsync = os.fsync

    def noting_fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", noting_fsync)
    clock = FakeClock()
    writer = RunWriter(tmp_path / "r1" / "qae.duckdb", "r1", clock=clock)
    writer.create_run("r1", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    writer.add_step(1, **_rows(1))
    assert writer.flush_when_due()  # written to the database (DuckDB syncs its own file)
    for step in (2, 3):
        writer.add_step(step, **_rows(step))
        assert writer.flush_when_due()
    saved = sorted(writer.pending_dir.glob("*.json"))
    assert len(saved) == 2 and synced == []
    writer.sync_pending()
    assert sorted(synced) == sorted([*saved, writer.pending_dir])
    assert [read_pending_write(path).step for path in saved] == [2, 3]

    synced.clear()
    clock.now += MAX_ROW_DELAY_S
    assert writer.flush_when_due()  # in the database now: nothing left to sync
    writer.sync_pending()
    assert synced == [] and read_steps(writer.path)["step"].tolist() == [1, 2, 3]


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", ".hidden", "x" * 101, "a b"])
def test_run_names_that_are_paths_are_refused(name):
    with pytest.raises(QAEUserError, match="run-name"):
        validate_run_name(name)


def test_unknown_run_lists_existing(writer, tmp_path):
    with pytest.raises(QAEUserError, match="runs there, last written first: r1\\)"):
        resolve_run(tmp_path, "nope")


def test_unknown_run_lists_the_runs_last_written_first_and_how_many_more(tmp_path):
    """Not the last ten by name, which left out most of a long runs dir without saying so."""
    import os

    for i in range(12):
        RunWriter(db_path(tmp_path, f"run{i:02d}"), f"run{i:02d}")
        os.utime(db_path(tmp_path, f"run{i:02d}"), (1_000_000 + i * (-1) ** i, 1_000_000 + i * (-1) ** i))
    newest_first = sorted(range(12), key=lambda i: -(i * (-1) ** i))
    listed = ", ".join(f"run{i:02d}" for i in newest_first[:10]) + ", and 2 more"
    with pytest.raises(QAEUserError) as err:
        resolve_run(tmp_path, "nope")
    assert f"(runs there, last written first: {listed})" in str(err.value)


def test_qae_migrate_brings_a_file_from_before_the_source_column_to_the_current_format(tmp_path):
    """The writer refuses a file of an older format, naming `qae migrate`; migrated, its earlier rows hold what
    they meant (an evaluation from before `source` was the trainer's) and the writer takes it."""
    from qae_app.store.run_file import OldRunFormat
    from qae_app.train.run_migration import migrate_run

    path = tmp_path / "old" / "qae.duckdb"
    path.parent.mkdir()
    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE evals (run_id VARCHAR, step INTEGER, benchmark VARCHAR, subset VARCHAR, "
        "metric VARCHAR, k INTEGER, value DOUBLE, n_problems INTEGER)"
    )
    con.execute("INSERT INTO evals VALUES ('old', 3, 'arith-heldout', 'all', 'avg@k', 1, 0.5, 264)")
    con.close()
    with pytest.raises(OldRunFormat, match=r"written by an older qae .*`qae migrate old --runs-dir"):
        RunWriter(path, "old")
    changes = migrate_run(tmp_path, "old")
    assert "added evals.source (earlier rows: 'train')" in changes and "added the runs table" in changes
    assert migrate_run(tmp_path, "old") == []
    RunWriter(path, "old")
    rows = query(path, "SELECT step, value, source FROM evals").to_dict("records")
    assert rows == [{"step": 3, "value": 0.5, "source": "train"}]  # kept, and attributed to the trainer


# ---------------------------------------------------------------------------------------------------------------
# a full disk, a damaged file, text that cannot be encoded

FILL_SCRIPT = r"""
import json, random, sys
from qae_app.store.schema import STEP_METRICS
from qae_app.store.reader import read_run
from qae_app.store.writer import RunWriter

path = sys.argv[1] + "/run/qae.duckdb"
writer = RunWriter(path, "run")
writer.create_run("run", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
error = None
rng = random.Random(0)
for step in range(1, 10_000):  # 1 MB of incompressible responses a step, until the disk is full
    writer.add_step(step, steps=[{name: 0.0 for name in STEP_METRICS}], rollouts=[
        {"group_idx": 0, "sample_idx": i, "response": rng.randbytes(8_000).hex()} for i in range(64)])
    try:
        writer.flush()
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
        break
try:  # what the trainer records at the end: the run's row changes after the failed step, which is retried first
    writer.update_run(status="failed", error=error)
    stored = read_run(path)["error"]
except Exception as err:
    stored = f"not stored: {type(err).__name__}: {err}"
print(json.dumps({"raised": error, "stored": stored}))
"""


def _fill_on_tmpfs(tmp_path) -> subprocess.CompletedProcess:
    """A real full disk: a 3 MB tmpfs mounted in a private user and mount namespace (no root needed)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    (tmp_path / "fill.py").write_text(FILL_SCRIPT)
    return subprocess.run(
        [
            "unshare",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=3m tmpfs "{mount}" && exec "{sys.executable}" "{tmp_path / "fill.py"}" "{mount}"',
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _fill_under_a_file_size_limit(tmp_path) -> subprocess.CompletedProcess:
    """Where namespaces are not allowed: RLIMIT_FSIZE makes writes past 3 MB fail (EFBIG) as a full disk would."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))

    (tmp_path / "fill.py").write_text(FILL_SCRIPT)
    return subprocess.run(
        [sys.executable, str(tmp_path / "fill.py"), str(tmp_path)],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "fill, cause",
    [(_fill_on_tmpfs, "No space left on device"), (_fill_under_a_file_size_limit, "File too large")],
    ids=["tmpfs", "rlimit"],
)
def test_a_full_disk_is_reported_as_itself(tmp_path, fill, cause):
    """A failed COMMIT has already ended DuckDB's transaction; the ROLLBACK after it used to fail with "cannot
    rollback - no transaction is active", which replaced the real cause in the raised and the stored error."""
    if fill is _fill_on_tmpfs and (
        shutil.which("unshare") is None
        or subprocess.run(["unshare", "--map-root-user", "--mount", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("user namespaces are not available here; the rlimit case covers the same path")
    result = fill(tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for error in (report["raised"], report["stored"]):  # stored, or the reason it could not be: the real cause
        assert cause in error and "cannot rollback" not in error


def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "header":
        path.write_bytes(b"\xde\xad" * 2048 + data[4096:])
    elif how == "flipped":  # one bit in the first data block: DuckDB's block checksum catches it on read
        data[12288] ^= 0x01
        path.write_bytes(data)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "Could not read enough bytes"),
        ("header", "not a valid DuckDB database file"),
        ("flipped", "Corrupt database file"),
    ],
)
def test_a_damaged_file_is_named_with_what_can_be_recovered(writer, tmp_path, how, reason):
    for step in (1, 2):  # 1.6 MB of responses: a file of several 256 KiB blocks, so cutting it in half loses some
        rows = _rows(step, 400)
        for row in rows["rollouts"]:
            row["response"] = f"{row['sample_idx']} " + "x" * 2000
        writer.add_step(step, **rows)
    assert writer.flush()
    (tmp_path / "r1" / "checkpoints" / "step-20" / "model").mkdir(parents=True)
    (tmp_path / "r1" / "checkpoints" / "step-20" / "trainer_state.json").write_text("{}")
    (tmp_path / "r1" / "config.json").write_text("{}")
    good = RunWriter(tmp_path / "r0" / "qae.duckdb", "r0")
    good.create_run("r0", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    _damage(writer.path, how)

    for read in (read_run, read_steps, lambda path: read_rollouts(path, 1)):
        with pytest.raises(RunFileError) as caught:
            read(writer.path)
        message = str(caught.value)
        assert f"cannot read {writer.path}: " in message and reason in message
        assert "checkpoints (step-20)" in message and str(tmp_path / "r1/checkpoints/step-20/model") in message
    with pytest.raises(RunFileError, match=f"cannot read {writer.path}: "):  # so does a resume (the writer)
        RunWriter(writer.path, "r1")
    runs = read_runs(tmp_path).set_index("run_id")
    assert runs.loc["r1", "status"] == "unreadable" and reason in runs.loc["r1", "error"]  # listed, not omitted
    assert runs.loc["r0", "status"] == "stopped"  # the healthy run beside it reads as usual (no trainer holds it)


def test_lone_surrogates_are_stored_as_replacement_characters(writer):
    rows = _rows(1)
    rows["groups"][0]["prompt"] = "x\ud800y"
    rows["rollouts"][0]["response"] = "\udfff"
    writer.add_step(1, **rows)
    assert writer.flush()
    writer.update_run(status="failed", error="bad \ud800 text")
    assert query(writer.path, "SELECT prompt FROM groups")["prompt"].tolist() == ["x\ufffdy"]
    assert read_rollouts(writer.path, 1)["response"].iloc[0] == "\ufffd"
    assert read_run(writer.path)["error"] == "bad \ufffd text"


def test_a_file_whose_free_blocks_duckdb_dropped_is_not_damaged(writer):
    """DuckDB cuts free blocks off the end of its file: a resume must not call such a file truncated."""
    for step in (1, 2):
        rows = _rows(step, 400)
        for row in rows["rollouts"]:
            row["response"] = "x" * 2000
        writer.add_step(step, **rows)
    assert writer.flush() and writer.truncate_after(0)
    with duckdb.connect(str(writer.path), read_only=True) as con:
        block_size, total, used = con.execute(
            "SELECT block_size, total_blocks, used_blocks FROM pragma_database_size()"
        ).fetchone()
    assert writer.path.stat().st_size < block_size * total  # blocks listed but not in the file: they are free
    RunWriter(writer.path, "r1").add_step(3, **_rows(3))  # opens as the healthy file it is


def _awkward_rows(step: int) -> dict:
    """Rows with every kind of value the trainer hands the store: NaN and None among floats, None among ints and
    bools, a lone surrogate, an empty string, unicode, and evaluation rows of two benchmarks."""
    rows = _rows(step)
    rows["steps"][0].update(entropy_neg=float("nan"), dH=None, k=None, heldout_accuracy=0.25)
    rows["groups"][0].update(prompt="x\ud800y", answer="", filtered=None)
    rows["rollouts"][1].update(response="∑ é 😀", entropy=float("nan"), logprob=None, correct=None, n_tokens=None)
    rows["rollouts"][2].update(verified=None, reward=float("inf"))
    rows["rollouts"][3].update(entropy=np.float32(0.25), n_tokens=np.int64(7))  # numpy scalars too
    rows["evals"] = [
        {"benchmark": b, "subset": "all", "metric": "pass@1", "k": 1, "value": v, "n_problems": 3, "source": "train"}
        for b, v in (("arith", 0.5), ("gsm8k", float("nan")))
    ]
    rows["warnings"] = [{"kind": "entropy", "message": "low \udfff"}]
    return rows


def _table_contents(path: Path) -> dict[str, list[tuple]]:
    with duckdb.connect(str(path), read_only=True) as con:
        return {
            table: con.execute(f"SELECT * EXCLUDE (run_id) FROM {table} ORDER BY ALL").fetchall()
            for table in ("steps", "groups", "rollouts", "evals", "warnings")
        }


def test_rows_are_stored_as_a_pandas_frame_of_them_would_be(tmp_path):
    """The writer hands DuckDB NumPy columns, not a pandas frame (importing pandas alone cost more than a run's
    database writes): what lands in the file must be what the frame of the same rows gave."""
    import pandas as pd

    ours = RunWriter(tmp_path / "ours" / "qae.duckdb", "r")
    ours.create_run("r", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    for step in (1, 2):
        ours.add_step(step, **_awkward_rows(step))
    assert ours.flush()
    contents = _table_contents(ours.path)

    reference = tmp_path / "reference.duckdb"
    shutil.copy(ours.path, reference)
    with duckdb.connect(str(reference)) as con:
        for table, stored in contents.items():
            con.execute(f"DELETE FROM {table}")
            for step in (1, 2):
                records = [
                    {
                        name: (
                            value.replace("\ud800", "\ufffd").replace("\udfff", "\ufffd")
                            if isinstance(value, str)
                            else value
                        )
                        for name, value in record.items()
                    }
                    for record in _awkward_rows(step)[table]
                ]
                frame = pd.DataFrame.from_records(records)
                frame.insert(0, "run_id", "r")
                frame["step"] = step
                if table == "steps":
                    frame["logged_at"] = [row[1] for row in stored if row[0] == step]
                con.register("_frame", frame)
                con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _frame")
    assert _table_contents(reference) == contents
    assert contents["steps"][0][list(STEP_METRICS).index("entropy_neg") + 2] is None  # NaN is NULL, as before
    assert [row[5] for row in contents["rollouts"][:4]] == [1.0, 0.0, float("inf"), 0.0]  # reward


def test_writing_rows_does_not_import_pandas(tmp_path):
    """The trainer's process writes its rows without pandas (its import, about 0.3-0.9 s, was most of the store's
    cost in a default run); readers still get frames."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.store.test_store import _awkward_rows\n"
        "from qae_app.store.writer import RunWriter\n"
        "w = RunWriter(Path(sys.argv[1]), 'r')\n"
        "w.create_run('r', {}, 'qae', 0.4, 'builtin:tiny', 'arith', 0)\n"
        "w.add_step(1, **_awkward_rows(1))\n"
        "w.update_step(1, eval_s=0.5)\n"
        "assert w.flush()\n"
        "w.update_run(status='finished', wall_s=1.0)\n"
        "print(sorted(m for m in ('pandas', 'pyarrow') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r" / "qae.duckdb")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    # the value the subprocess set by hand (update_step(1, eval_s=0.5)) reached the file: a stored value, not a timing
    assert read_steps(tmp_path / "r" / "qae.duckdb")["eval_s"].tolist() == [0.5]


def test_a_paper_sized_step_goes_to_the_database_at_once_not_to_pending(tmp_path):
    """A step whose text is over WRITE_NOW_CHARS is written when queued even though a write is not due: saving it
    under pending/ first wrote every response twice. Its response text is stored with zstd."""
    from qae_app.store.writer import WRITE_NOW_CHARS

    clock = FakeClock()
    path = tmp_path / "big" / "qae.duckdb"
    writer = RunWriter(path, "big", clock=clock)
    writer.create_run("big", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    writer.add_step(1, **_rows(1))
    assert writer.flush_when_due()
    writer.add_step(2, **_rows(2))
    assert writer.flush_when_due() and len(list(writer.pending_dir.glob("*.json"))) == 1  # small: saved, not due
    big = _rows(3, n=8)
    text = "x = 2 + 2 is 4. " * (WRITE_NOW_CHARS // (16 * 8) + 1)  # eight of these are over the threshold
    big["rollouts"] = [dict(row, response=text) for row in big["rollouts"]]
    writer.add_step(3, **big)
    assert writer.flush_when_due()  # still not due by the clock
    assert read_steps(path)["step"].tolist() == [1, 2, 3] and list(writer.pending_dir.glob("*")) == []
    assert query(path, "SELECT sum(length(response)) AS n FROM rollouts WHERE step = 3")["n"].item() == 8 * len(text)
    del writer  # (the writer detaches after each write: the file is checkpointed)
    with duckdb.connect(str(path), read_only=True) as con:
        compression = con.execute(
            "SELECT DISTINCT compression FROM pragma_storage_info('rollouts') WHERE "
            "column_name = 'response' AND segment_type = 'VARCHAR'"
        ).fetchall()
    assert ("ZSTD",) in compression, compression


def test_store_responses_keeps_n_texts_a_group_by_a_seeded_draw_and_every_row():
    from qae_app.store.rows import check_store_responses, stored_responses

    rows = [dict(group_idx=g, sample_idx=i, response=f"r{g}-{i}", gated=i % 2 == 0) for g in range(3) for i in range(8)]
    kept = stored_responses(rows, "2", seed=5, step=7)
    assert len(kept) == len(rows) and [r["gated"] for r in kept] == [r["gated"] for r in rows]  # counts exact
    texts = {g: [r["sample_idx"] for r in kept if r["group_idx"] == g and r["response"] is not None] for g in range(3)}
    assert all(len(indexes) == 2 for indexes in texts.values())
    assert all(r["response"] == f"r{r['group_idx']}-{r['sample_idx']}" for r in kept if r["response"] is not None)
    assert stored_responses(list(reversed(rows)), "2", seed=5, step=7) == list(reversed(kept))  # order-free draw
    assert stored_responses(rows, "2", seed=5, step=8) != kept  # another step, another draw
    assert stored_responses(rows, "all", 0, 1) is rows
    assert all(r["response"] is None for r in stored_responses(rows, "none", 0, 1))
    assert all(r["response"] is not None for r in stored_responses(rows, "9", 0, 1))  # more than G: every one
    for bad in ("0", "-1", "some", "1.5"):
        with pytest.raises(ValueError, match=f"store-responses: '{re.escape(bad)}' is not all, none or a whole"):
            check_store_responses(bad)
