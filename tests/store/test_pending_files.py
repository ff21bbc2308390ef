"""A planted file under a run's pending/ folder is data, never SQL: every table and column name a saved write carries
is checked against the schema before anything is applied, so a crafted name cannot run a statement (DuckDB runs every
statement of a string: `COPY ... TO` writes any path the user can), and a write that breaks the schema is named with
what to do, not applied."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.core.errors import QAEUserError
from qae_app.store.reader import query, read_run
from qae_app.store.run_folder import PENDING_DIR
from qae_app.store.schema import PendingWrite
from qae_app.store.writer import RunWriter

INJECTED = "status = 'x' WHERE 1=1; COPY (SELECT 1) TO '{marker}'; UPDATE runs SET error"
PLANTS = {
    "sql in a run field": {"kind": "run", "fields": {INJECTED: None}},
    "sql in a step metric": {"kind": "step_update", "step": 1, "fields": {INJECTED: 1.0}},
    "sql as a table name": {"kind": "step", "step": 1, "tables": {"steps; COPY (SELECT 1) TO '{marker}'; --": []}},
    "sql in a row's column": {"kind": "step", "step": 1, "tables": {"rollouts": [{INJECTED: 1}]}},
    "a truncation before step 0": {"kind": "truncate", "step": -1},
    "a bogus status": {"kind": "run", "fields": {"status": "pwned"}},
    "a step that is no number": {"kind": "step_update", "step": "1; DROP TABLE steps", "fields": {"loss": 1.0}},
    "a value no column holds": {"kind": "step_update", "step": 1, "fields": {"loss": {"nested": [1]}}},
    "an unknown key": {"kind": "truncate", "step": 1, "sql": "DROP TABLE steps"},
    # issue 48 L3: each was a traceback (TypeError in fromisoformat, DuckDB's InvalidInputException, ...)
    "a timestamp that is a number": {
        "kind": "step",
        "step": 1,
        "tables": {"steps": [{"loss": 0.5}]},
        "logged_at": {"$datetime": 12345},
    },
    "a 4,000-digit integer in a row": {"kind": "step", "step": 1, "tables": {"steps": [{"reward_mean": 10**4000}]}},
    "text in a number column": {"kind": "step", "step": 1, "tables": {"rollouts": [{"reward": "NaN or so"}]}},
    "text in a flag column": {"kind": "step", "step": 1, "tables": {"rollouts": [{"gated": "yes"}]}},
    "a count past an INTEGER": {"kind": "step", "step": 1, "tables": {"groups": [{"n_correct": 1e12}]}},
    "text as a run's timestamp": {"kind": "run", "fields": {"updated_at": "yesterday"}},
    "a step past any step": {"kind": "step_update", "step": 2**40, "fields": {"loss": 1.0}},
}


@pytest.fixture
def run_file(tmp_path):
    """A run's database with one step row, as a trainer leaves it."""
    path = tmp_path / "runs" / "r" / "qae.duckdb"
    writer = RunWriter(path, "r")
    writer.create_run("r", {"seed": 0}, "qae", 0.4, "builtin:tiny", "arith", 0)
    writer.add_step(1, steps=[{"loss": 0.5}])
    assert writer.flush()
    return path


def plant(run_file, record: dict, marker) -> None:
    text = json.dumps(record).replace("{marker}", str(marker).replace("'", "''"))
    (run_file.parent / PENDING_DIR).mkdir(exist_ok=True)
    (run_file.parent / PENDING_DIR / "00000001-step.json").write_text(text)


@pytest.mark.parametrize("record", PLANTS.values(), ids=PLANTS.keys())
def test_a_planted_pending_write_is_refused_by_name_before_anything_is_applied(run_file, tmp_path, record):
    marker = tmp_path / "marker"
    plant(run_file, record, marker)
    before = query(run_file, "SELECT * FROM steps"), read_run(run_file)
    with pytest.raises(QAEUserError, match="00000001-step.json is not a write qae saved") as refused:
        RunWriter(run_file, "r")
    assert "Move it out of" in str(refused.value)
    assert not marker.exists()
    after = query(run_file, "SELECT * FROM steps"), read_run(run_file)
    assert after[0].equals(before[0]) and repr(after[1]) == repr(before[1])  # (repr: NaN equals NaN)


def test_a_pending_write_nested_past_the_parser_is_named_not_a_traceback(run_file):
    (run_file.parent / PENDING_DIR).mkdir(exist_ok=True)
    (run_file.parent / PENDING_DIR / "00000001-step.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(QAEUserError, match="nested deeper than any row"):
        RunWriter(run_file, "r")


def test_resume_and_eval_on_a_planted_run_name_the_file_and_run_nothing(tmp_path):
    """The reproduction: `qae train --resume` and `qae eval --model RUN` applied the planted statement (exit 0)."""
    runs_dir, marker = tmp_path / "runs", tmp_path / "marker"
    trained = CliRunner().invoke(
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
            str(runs_dir),
        ],
    )
    assert trained.exit_code == 0, trained.output
    plant(runs_dir / "r" / "qae.duckdb", PLANTS["sql in a run field"], marker)
    for args in (
        ["train", "--resume", "r", "--steps", "2"],
        ["eval", "--model", "r", "--limit", "2", "--samples", "1"],
    ):
        result = CliRunner().invoke(app, [*args, "--runs-dir", str(runs_dir)], env={"COLUMNS": "300"})
        assert result.exit_code == 2 and "is not a write qae saved" in result.output, (args, result.output)
        assert not marker.exists()


@pytest.mark.parametrize(
    "crafted",
    [
        "DROP TABLE steps; CREATE VIEW steps AS SELECT 1 AS step, content AS loss FROM read_text('{secret}')",
        "CREATE MACRO count(x) AS 0",
    ],
)
def test_a_run_file_holding_views_or_macros_is_refused_before_any_query(run_file, tmp_path, crafted):
    """qae writes tables only: a view named like its table ran as SQL (`qae show` printed a file from outside the
    folder), and a macro can shadow a function qae's queries call."""
    import duckdb

    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    with duckdb.connect(str(run_file)) as con:
        con.execute(crafted.format(secret=secret))
    result = CliRunner().invoke(app, ["show", "r", "--runs-dir", str(run_file.parent.parent)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "holds views or macros" in result.output, result.output
    assert "the secret" not in result.output
    with pytest.raises(QAEUserError, match="holds views or macros"):
        RunWriter(run_file, "r")


def test_the_writers_database_reaches_the_run_file_and_nothing_else(run_file, tmp_path):
    """Defence in depth under the name checks: whatever SQL reached the writer's connection could not write or read
    another path."""
    import duckdb

    writer = RunWriter(run_file, "r")
    with writer._open() as con:
        assert con.execute("SELECT count(*) FROM steps").fetchone() == (1,)
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"COPY (SELECT 1) TO '{tmp_path / 'marker.csv'}'")
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"ATTACH '{tmp_path / 'other.duckdb'}' AS other")
    assert not (tmp_path / "marker.csv").exists() and not (tmp_path / "other.duckdb").exists()


def a_saved_write() -> str:
    from qae_app.store.schema import PendingWrite, pending_write_json

    return pending_write_json(PendingWrite("step", step=1, tables={"steps": [{"loss": 0.5, "reward_mean": 0.25}]}))


DAMAGED = {"empty": b"", "cut": a_saved_write().encode()[:40], "binary": bytes(range(256)) * 4}


@pytest.mark.parametrize("damage", DAMAGED.values(), ids=DAMAGED.keys())
def test_a_damaged_pending_write_is_named_with_what_to_do(run_file, damage):
    """Empty (a full disk), cut (a copy stopped midway) or binary: a traceback that did not name the file, 8 of 8."""
    (run_file.parent / PENDING_DIR).mkdir(exist_ok=True)
    (run_file.parent / PENDING_DIR / "00000001-step.json").write_bytes(damage)
    with pytest.raises(QAEUserError, match="00000001-step.json is not a write qae saved") as refused:
        RunWriter(run_file, "r")
    assert f"Move it out of {run_file.parent / PENDING_DIR}" in str(refused.value)
    assert query(run_file, "SELECT step, loss FROM steps").values.tolist() == [[1, 0.5]]  # nothing applied


def test_a_resume_with_a_cut_pending_write_is_one_message(tmp_path):
    runs_dir = tmp_path / "runs"
    trained = CliRunner().invoke(
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
            str(runs_dir),
        ],
    )
    assert trained.exit_code == 0, trained.output
    (runs_dir / "r" / PENDING_DIR).mkdir(exist_ok=True)
    (runs_dir / "r" / PENDING_DIR / "00000001-step.json").write_bytes(DAMAGED["cut"])
    result = CliRunner().invoke(
        app, ["train", "--resume", "r", "--steps", "2", "--runs-dir", str(runs_dir)], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert result.output.count("error:") == 1 and "00000001-step.json is not a write qae saved" in result.output


# ---------------------------------------------------------------------------------------------------------------
# issue 48 L1: a saved truncation drops rows, and only a resume drops rows


def _counts(path) -> list[int]:
    return (
        query(
            path,
            "SELECT (SELECT count(*) FROM steps) AS s, (SELECT count(*) FROM groups) AS g, "
            "(SELECT count(*) FROM rollouts) AS r",
        )
        .iloc[0]
        .tolist()
    )


def test_a_planted_truncation_empties_no_run_on_eval_and_none_below_a_resumes_checkpoint(tmp_path):
    """`{"kind": "truncate", "step": 0}` planted in pending/ emptied the run on `qae eval --model r` (its rows -> 0,
    exit 0, nothing said). Only a resume takes up a saved truncation, and never below the checkpoint it resumes
    from: the steps that checkpoint holds keep their rows."""
    runs_dir = tmp_path / "runs"
    trained = CliRunner().invoke(
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
            str(runs_dir),
        ],
    )
    assert trained.exit_code == 0, trained.output
    db = runs_dir / "r" / "qae.duckdb"
    before, step_1 = _counts(db), query(db, "SELECT * FROM rollouts WHERE step = 1 ORDER BY ALL")
    (runs_dir / "r" / PENDING_DIR).mkdir(exist_ok=True)
    (runs_dir / "r" / PENDING_DIR / "00000001-truncate.json").write_text('{"kind": "truncate", "step": 0}')
    evaluated = CliRunner().invoke(
        app,
        ["eval", "--model", "r", "--limit", "2", "--samples", "1", "--runs-dir", str(runs_dir)],
        env={"COLUMNS": "300"},
    )
    assert evaluated.exit_code == 0, evaluated.output
    assert _counts(db) == before and before[0] == 1  # (its evaluation went in too: evals, eval_samples)
    assert (runs_dir / "r" / PENDING_DIR / "00000001-truncate.json").exists()  # left for a resume
    resumed = CliRunner().invoke(
        app, ["train", "--resume", "r", "--steps", "2", "--runs-dir", str(runs_dir)], env={"COLUMNS": "300"}
    )
    assert resumed.exit_code == 0, resumed.output
    assert query(db, "SELECT step FROM steps ORDER BY step")["step"].tolist() == [1, 2]
    assert query(db, "SELECT * FROM rollouts WHERE step = 1 ORDER BY ALL").equals(step_1)  # kept, not dropped
    assert list((runs_dir / "r" / PENDING_DIR).glob("*")) == []


def test_a_truncation_a_resume_saved_is_taken_up_by_the_next_resume_alone(run_file):
    """What a real saved truncation is: a resume from step 2 found the file held and saved its truncation and the
    steps it trained again (3, 4), then was killed. `qae eval` leaves them all for the next resume; that resume, from
    a checkpoint at step 4, keeps steps 1-2 as stored, takes 3-4 from pending/ and drops the old step 5."""
    writer = RunWriter(run_file, "r")
    for step in (2, 3, 4, 5):  # the first session's steps 1-5, all stored
        writer.add_step(step, steps=[{"loss": float(step)}])
    assert writer.flush()
    killed = RunWriter(run_file, "r", resume_from=2)
    killed.pending.append(PendingWrite("truncate", step=2))
    for step in (3, 4):  # trained again, with other values
        killed.add_step(step, steps=[{"loss": 10.0 + step}])
    killed._spill()  # as while a reader held the file; then the process dies
    del killed
    evaluating = RunWriter(run_file, "r")
    assert evaluating.pending == [] and evaluating.flush()
    assert query(run_file, "SELECT loss FROM steps ORDER BY step")["loss"].tolist() == [0.5, 2.0, 3.0, 4.0, 5.0]
    resumed = RunWriter(run_file, "r", resume_from=4)
    assert [w.kind for w in resumed.pending] == ["truncate", "step", "step"]
    assert resumed.truncate_after(4)
    assert query(run_file, "SELECT loss FROM steps ORDER BY step")["loss"].tolist() == [0.5, 2.0, 13.0, 14.0]
    assert list(resumed.pending_dir.glob("*")) == []
