"""The DuckDB store: round trip, whole-step transactions, replacing replayed steps, and a reader holding the lock."""

import multiprocessing
import time

import duckdb
import pytest

from qae_app.errors import QAEUserError
from qae_app.store import (
    STEP_METRICS,
    RunWriter,
    query,
    read_rollouts,
    read_runs,
    read_steps,
    resolve_run,
    validate_run_name,
)


def _rows(step: int, n: int = 4):
    steps = [{name: float(step) for name in STEP_METRICS}]
    groups = [{"group_idx": 0, "prompt_id": "p", "prompt": "1+1=", "answer": "2", "n_correct": 1, "group_size": n,
               "baseline": 0.0, "regime": "hard"}]
    rollouts = [{"group_idx": 0, "sample_idx": i, "prompt_id": "p", "response": "<b>2</b>" if i == 0 else "3",
                 "reward": float(i == 0), "verified": True, "advantage": 1.5 if i == 0 else 0.0, "gated": i != 0,
                 "regime": "hard", "n_tokens": 2, "truncated": False, "entropy": 0.1, "logprob": -0.5}
                for i in range(n)]
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


def test_nan_metrics_are_stored_as_null(writer):
    rows = _rows(1)
    rows["steps"][0]["entropy_neg"] = float("nan")
    writer.add_step(1, **rows)
    writer.flush()
    assert query(writer.path, "SELECT entropy_neg IS NULL AS missing FROM steps")["missing"].item()


def _hold_read_lock(path: str, seconds: float, ready) -> None:
    con = duckdb.connect(path, read_only=True)
    ready.set()
    time.sleep(seconds)
    con.close()


def test_writer_keeps_rows_while_a_reader_holds_the_file(writer):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    reader = ctx.Process(target=_hold_read_lock, args=(str(writer.path), 3.0, ready))
    reader.start()
    assert ready.wait(60)
    writer.lock_timeout_s = 0.2
    writer.add_step(1, **_rows(1))
    assert writer.flush() is False  # busy: nothing lost, still buffered
    assert len(writer.pending) == 1 and writer.flush_retries == 1
    assert len(list(writer.pending_dir.glob("*.pkl"))) == 1  # and safe on disk, not only in memory
    writer.add_step(2, **_rows(2))
    assert writer.flush(timeout_s=30)  # waits for the reader to close
    reader.join()
    assert read_steps(writer.path)["step"].tolist() == [1, 2]
    assert list(writer.pending_dir.glob("*")) == []


def test_rows_spilled_while_a_reader_held_the_file_survive_a_kill(writer):
    """A trainer killed while a reader held the file: the next writer of the run (a resume) writes what was saved,
    in order: the rows, the run's status, and a truncation queued after them."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    reader = ctx.Process(target=_hold_read_lock, args=(str(writer.path), 2.0, ready))
    reader.start()
    assert ready.wait(60)
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


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", ".hidden", "x" * 101, "a b"])
def test_run_names_that_are_paths_are_refused(name):
    with pytest.raises(QAEUserError, match="run-name"):
        validate_run_name(name)


def test_unknown_run_lists_existing(writer, tmp_path):
    with pytest.raises(QAEUserError, match="existing: r1"):
        resolve_run(tmp_path, "nope")


def test_writer_migrates_a_file_from_before_the_source_column(tmp_path):
    path = tmp_path / "old" / "qae.duckdb"
    path.parent.mkdir()
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE evals (run_id VARCHAR, step INTEGER, benchmark VARCHAR, subset VARCHAR, "
                "metric VARCHAR, k INTEGER, value DOUBLE, n_problems INTEGER)")
    con.execute("INSERT INTO evals VALUES ('old', 3, 'arith-heldout', 'all', 'avg@k', 1, 0.5, 264)")
    con.close()
    RunWriter(path, "old")
    rows = query(path, "SELECT step, value, source FROM evals").to_dict("records")
    assert rows == [{"step": 3, "value": 0.5, "source": "train"}]  # kept, and attributed to the trainer
