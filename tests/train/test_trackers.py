"""`qae train --report-to` (issue 38): every step's metrics and each evaluation reach TensorBoard and MLflow as the
run's DuckDB rows hold them, read back with each tracker's own reader (TensorBoard's EventAccumulator on the event
files, MLflow's client on a local file store); the config is there as hyperparameters; a tracker that is unknown or
not installed is one clear error before anything is written."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import duckdb
import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.core.errors import QAEUserError
from qae_app.core.trackers_check import report_to_trackers
from qae_app.store.schema import STEP_METRICS
from qae_app.train.trackers import TENSORBOARD_DIR, metric_name

runner = CliRunner()
TINY = [
    "--steps",
    "3",
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--eval-every",
    "2",
    "--checkpoint-every",
    "0",
    "--cpu",
]


def test_an_unknown_tracker_is_refused_before_the_run_starts(tmp_path):
    result = runner.invoke(
        app,
        ["train", "--run-name", "r", "--report-to", "tensorboard,neptune", *TINY, "--runs-dir", str(tmp_path / "runs")],
        env={"COLUMNS": "200"},
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "report-to: 'neptune' is not a tracker qae sends metrics to" in said, said
    assert "tensorboard, mlflow, wandb, trackio" in said
    assert not (tmp_path / "runs" / "r").exists()


def test_a_tracker_not_installed_is_one_clear_error(monkeypatch):
    installed = importlib.util.find_spec  # (the dev extra installs every tracker: trackio is made to look absent)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "trackio" else installed(name, *args)
    )
    with pytest.raises(QAEUserError, match=r"report-to: trackio is not installed\. Install it"):
        report_to_trackers("trackio")
    assert report_to_trackers(None) == [] and report_to_trackers("none") == []


def test_metric_names_are_ones_mlflow_takes():
    assert metric_name("eval", "math-500", "level=1", "avg@k") == "eval/math-500/level_1/avg_k"


def stored(db) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """metric -> step -> value of every non-NULL number in the run's steps and evals rows."""
    with duckdb.connect(str(db), read_only=True) as con:
        steps = con.execute("SELECT * FROM steps ORDER BY step").df()
        evals = con.execute("SELECT step, benchmark, subset, metric, value FROM evals").df()
        warnings = con.execute("SELECT step, kind FROM warnings").df()
    rows = {}
    for step, kind in warnings.itertuples(index=False):  # each warning: an event, `warnings/<kind>` = 1 at its step
        rows.setdefault(metric_name("warnings", kind), {})[int(step)] = 1.0
    for metric in STEP_METRICS:
        values = {
            int(s): float(v)
            for s, v in zip(steps["step"], steps[metric], strict=True)
            if v is not None and math.isfinite(v)
        }
        if values:
            rows[metric] = values
    eval_rows = {}
    for row in evals.to_dict("records"):
        eval_rows.setdefault(metric_name("eval", row["benchmark"], row["subset"], row["metric"]), {})[
            int(row["step"])
        ] = float(row["value"])
    return rows, eval_rows


@pytest.mark.slow  # a real run of 3 steps with two evaluations: 10-60 s on a loaded CPU
def test_tensorboard_and_mlflow_get_every_stored_step_metric_and_evaluation(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[trackers]')")
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store_uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    runs = tmp_path / "runs"
    result = runner.invoke(
        app, ["train", "--run-name", "tracked", "--report-to", "tensorboard,mlflow", *TINY, "--runs-dir", str(runs)]
    )
    assert result.exit_code == 0, result.output
    rows, eval_rows = stored(runs / "tracked" / "qae.duckdb")
    assert {"entropy", "accuracy", "frac_zero_adv", "step_s", "store_s"} <= set(rows)
    assert set(eval_rows) and all(set(values) == {0, 2, 3} for values in eval_rows.values())  # steps 0, 2 and last

    events = EventAccumulator(str(runs / "tracked" / TENSORBOARD_DIR)).Reload()
    logged = {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    client = mlflow.tracking.MlflowClient(store_uri)
    run = client.search_runs([client.get_experiment_by_name("qae").experiment_id])[0]
    assert run.info.run_name == "tracked"
    for metric, values in {**rows, **eval_rows}.items():
        assert logged[metric] == pytest.approx(values, rel=1e-6), metric  # TensorBoard keeps float32
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}
        assert history == pytest.approx(values, rel=1e-12), metric
    assert set(run.data.metrics) == set(rows) | set(eval_rows)  # nothing else was sent
    assert run.data.params["steps"] == "3" and run.data.params["report_to"] == "tensorboard,mlflow"
    assert run.data.params["lora_targets"] == "null"  # None, as JSON


@pytest.mark.parametrize("uri", [None, "nosuch:/store"], ids=["unset", "unknown-scheme"])
def test_an_mlflow_store_it_cannot_open_is_one_clear_error_before_the_run_starts(tmp_path, monkeypatch, uri):
    """MLflow 3 keeps runs in sqlite:///mlflow.db when MLFLOW_TRACKING_URI is unset, which mlflow-skinny (the
    trackers extra) cannot open: the run was created, then a 180-line traceback, and `qae runs` listed it stopped."""
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[trackers]')")
    if uri is None and importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow opens sqlite:///mlflow.db (sqlalchemy is installed)")
    monkeypatch.chdir(tmp_path)
    if uri is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = runner.invoke(
        app,
        ["train", "--run-name", "r", "--report-to", "mlflow", *TINY, "--runs-dir", str(tmp_path / "runs")],
        env={"COLUMNS": "200"},
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "report-to: mlflow cannot keep runs at" in said, said
    assert "MLFLOW_TRACKING_URI" in said and "Traceback" not in said and said.count("error:") == 1
    assert not (tmp_path / "runs" / "r").exists()


def wandb_records(path) -> list:
    """The records of a W&B transaction log (run-<id>.wandb: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    records each have a header of crc32, length and kind: 1 whole, 2 first, 3 middle, 4 last part), as W&B's Record
    messages. wandb 0.31 has no Python reader of its own any more."""
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, pos, part, found = path.read_bytes(), 7, b"", []
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of a block too short for a header, or zero padding
            pos += left
            continue
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        part = data if kind in (1, 2) else part + data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            found.append(record)
    return found


@pytest.mark.slow  # a real run of 3 steps with two evaluations, and W&B's service process: 20-60 s on a loaded CPU
def test_wandb_offline_gets_every_stored_step_metric_and_evaluation(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = tmp_path / "runs"
    result = runner.invoke(
        app, ["train", "--run-name", "tracked", "--report-to", "wandb", *TINY, "--runs-dir", str(runs)]
    )
    assert result.exit_code == 0, result.output
    rows, eval_rows = stored(runs / "tracked" / "qae.duckdb")
    [log] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "tracked" and run.project == "qae"
    logged = {}
    for history in (r.history for r in records if r.WhichOneof("record_type") == "history"):
        # (a key W&B adds itself, _step, _runtime and _timestamp, may come as a nested key of one part)
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in history.item}
        for metric, value in items.items():
            if not metric.startswith("_"):
                logged.setdefault(metric, {})[items["_step"]] = value
    assert set(logged) == set(rows) | set(eval_rows)  # nothing else was sent
    for metric, values in {**rows, **eval_rows}.items():
        assert logged[metric] == pytest.approx(values, rel=1e-12), metric
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["steps"] == 3 and config["report_to"] == "wandb"


@pytest.mark.slow  # a real run of 3 steps with two evaluations: 10-60 s on a loaded CPU
def test_trackio_gets_every_stored_step_metric_and_evaluation(tmp_path):
    """trackio's local store (a SQLite file per project under TRACKIO_DIR: a row per log call, the metrics as JSON)
    read back with Python's sqlite3 (the layout of trackio 0.43, the dev extra's)."""
    import os
    import sqlite3
    import subprocess
    import sys

    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed (pip install trackio)")
    runs = tmp_path / "runs"
    # in a process of its own: trackio reads TRACKIO_DIR once, when it is imported
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qae_app.cli",
            "train",
            "--run-name",
            "tracked",
            "--report-to",
            "trackio",
            *TINY,
            "--runs-dir",
            str(runs),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio")),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows, eval_rows = stored(runs / "tracked" / "qae.duckdb")
    with sqlite3.connect(tmp_path / "trackio" / "qae.db") as con:
        logs = con.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
        [(config,)] = con.execute("SELECT config FROM configs WHERE run_name = 'tracked'").fetchall()
    assert {name for name, _, _ in logs} == {"tracked"}
    logged = {}
    for _, step, metrics in logs:
        for metric, value in json.loads(metrics).items():
            logged.setdefault(metric, {})[step] = value
    assert set(logged) == set(rows) | set(eval_rows)  # nothing else was sent
    for metric, values in {**rows, **eval_rows}.items():
        assert logged[metric] == pytest.approx(values, rel=1e-12), metric
    config = json.loads(config)
    assert config["steps"] == 3 and config["report_to"] == "trackio"


def test_warnings_are_tracker_events_and_signal_shares_metrics(tmp_path):
    """Issue 49: a fired alert reaches TensorBoard as an event (a 1 at its step, its message as text), and each
    reward component's component_signal values as `reward/<name>/<column>`."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qae_app.train.trackers import Trackers

    trackers = Trackers(["tensorboard"], "r", tmp_path, {"steps": 4})
    trackers.log_step(
        4,
        {
            "steps": [{"entropy": 0.5}],
            "component_signal": [
                {
                    "name": "one_word",
                    "weight": 0.2,
                    "value_mean": 0.4,
                    "frac_differs": 0.3,
                    "frac_signal": 0.3,
                    "adv_share": 1.0,
                },
                {
                    "name": "antonym",
                    "weight": 1.0,
                    "value_mean": 0.0,
                    "frac_differs": 0.0,
                    "frac_signal": 0.0,
                    "adv_share": 0.0,
                },
            ],
            "warnings": [{"kind": "reward_signal", "message": "one_word carried 100%"}],
        },
    )
    trackers.finish()
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR), size_guidance={"tensors": 0}).Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["warnings/reward_signal"] == [(4, 1.0)]
    assert scalars["reward/one_word/adv_share"] == [(4, 1.0)] and scalars["reward/antonym/weight"] == [(4, 1.0)]
    text = events.Tensors("warnings/reward_signal/text_summary")
    assert [(e.step, e.tensor_proto.string_val[0].decode()) for e in text] == [(4, "step 4: one_word carried 100%")]


def test_wandb_without_an_api_key_is_refused_in_one_line_before_the_run_is_made(tmp_path):
    """Issue 48 L6: `--report-to wandb` with no W&B key here ended in wandb's UsageError traceback, exit 1, its run
    folder made; an MLflow store qae cannot open was already refused in one line. A real `qae train` process with no
    key: no WANDB_API_KEY, no netrc entry, no wandb settings of this user's."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_") and key != "NETRC"}
    env.update(HOME=str(tmp_path / "home"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), COLUMNS="300")
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qae_app.cli",
            "train",
            "--run-name",
            "r",
            "--report-to",
            "wandb",
            *TINY,
            "--runs-dir",
            str(runs),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and said.count("error:") == 1 and "Traceback" not in said, said
    assert "report-to: wandb has no API key here" in said and "WANDB_MODE=offline" in said, said
    assert not runs.exists() or not any(runs.iterdir())  # refused before the run was made
