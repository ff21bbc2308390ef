"""How the trainer hands a step's rows to the store: saved under pending/ without a sync each step, synced before
each checkpoint, and the same rows in the database whether a step went there at once or through pending/. A real
Trainer, a real DuckDB file and real files under pending/."""

import math
import os
from pathlib import Path

import pandas as pd
import pytest

from qae_app.config import build_config
from qae_app.store import writer
from qae_app.store.reader import query
from qae_app.store.run_folder import CHECKPOINTS_DIR, db_path
from qae_app.store.schema import TABLES, TIMING_METRICS, pending_write_from_json
from qae_app.train.trainer import Trainer
from tests.conftest import TINY_RUN_OPTIONS

OPTS = dict(TINY_RUN_OPTIONS, steps=3, eval_every=2, checkpoint_every=2)
NOT_COMPARED = {"logged_at", *TIMING_METRICS}  # when a row was queued, and seconds: differ run to run


def never_due(monkeypatch) -> None:
    """After the run's first database write, no other is due until the run ends: every step goes through pending/."""
    monkeypatch.setattr(writer, "WRITE_SHARE", 1e-12)
    monkeypatch.setattr(writer, "MAX_ROW_DELAY_S", math.inf)


def table_rows(path: Path, table: str) -> pd.DataFrame:
    columns = [name for name in TABLES[table] if name not in NOT_COMPARED and name != "run_id"]
    return query(path, f"SELECT {', '.join(columns)} FROM {table} ORDER BY ALL")


@pytest.mark.slow  # (a Trainer of 3 steps: over a minute on the shared 2-core machine)
def test_a_checkpoint_is_saved_after_the_rows_of_its_steps_are_synced(tmp_path, monkeypatch):
    """The steps up to a checkpoint are not trained again on resume, so their rows must be on disk (not only in the
    OS's cache) before it exists. The OS's fsync runs as always: the test notes what it was given, and when."""
    never_due(monkeypatch)
    trainer = Trainer(build_config(run_name="sync", **OPTS), tmp_path, cpu=True)
    checkpoints = trainer.session.run_dir / CHECKPOINTS_DIR
    synced = []  # (kind and step of a saved write, or the file's name; the checkpoints that existed then)
    real_fsync = os.fsync

    def noting_fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        what = path.name
        if path.suffix == ".json" and path.parent.name == "pending":
            write = pending_write_from_json(path.read_text())
            what = (write.kind, write.step)
        synced.append((what, sorted(p.name for p in checkpoints.glob("step-*"))))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", noting_fsync)
    trainer.fit()
    # step 0's evaluation went to the database at once (the first write is due at once); every later step waited
    # under pending/, and was synced before the first checkpoint after it (step 2, and the last step's, step 3)
    first_sync = {what: existed for what, existed in reversed(synced)}
    assert {
        what: first_sync.get(what)
        for what in [("step", 1), ("step_update", 1), ("step", 2), ("step", 3), ("step_update", 2)]
    } == {
        ("step", 1): [],
        ("step_update", 1): [],
        ("step", 2): [],
        ("step", 3): ["step-2"],
        ("step_update", 2): ["step-2"],
    }
    assert "pending" in first_sync  # the folder too: it holds their names
    assert query(db_path(tmp_path, "sync"), "SELECT step FROM steps ORDER BY step")["step"].tolist() == [1, 2, 3]


@pytest.mark.slow  # (two Trainers of 3 steps)
def test_rows_through_pending_equal_rows_written_at_once(tmp_path, monkeypatch):
    """Every table's rows, value for value, whether each step went to the database as it was handed over or waited
    under pending/ (JSON) until the run's end: the hand-off changes no stored value."""
    monkeypatch.setattr(writer, "WRITE_SHARE", math.inf)  # every step's write is due at once
    Trainer(build_config(run_name="at-once", **OPTS), tmp_path, cpu=True).fit()
    never_due(monkeypatch)
    Trainer(build_config(run_name="pending", **OPTS), tmp_path, cpu=True).fit()
    for table in TABLES:
        if table == "runs":
            continue
        want = table_rows(db_path(tmp_path, "at-once"), table)
        got = table_rows(db_path(tmp_path, "pending"), table)
        pd.testing.assert_frame_equal(got, want, check_exact=True, obj=table)  # (NaN equals NaN here)
    rollouts = table_rows(db_path(tmp_path, "pending"), "rollouts")
    assert len(rollouts) == OPTS["steps"] * OPTS["prompts_per_step"] * OPTS["group_size"]
