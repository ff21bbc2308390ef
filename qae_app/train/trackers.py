"""`qae train --report-to tensorboard,mlflow,wandb,trackio`: every step's metrics and each evaluation, also sent to the
trackers a team watches, through accelerate's tracker classes (`accelerate.tracking`: the ones `Accelerator(log_with=
...)` builds), on the main process only. Off by default; the run's DuckDB file stays the record.

What is sent: the run's config as hyperparameters (once a session); at each step the `steps` row's metrics under the
column names of `schema.STEP_METRICS` (the same values the row holds; NULLs are not sent), the step's times known only
later (write_s, checkpoint_s, step_s, store_s) with the next step, and each evaluation's values as
`eval/<benchmark>/<subset>/<metric>` (characters MLflow refuses, such as `@` and `=`, as `_`). With several reward
components, each one's `component_signal` values as `reward/<name>/<column>` (value_mean, frac_signal, adv_share, ...).
Each `warnings` row (an alert that fired, the entropy band, ...) is an event: `warnings/<kind>` = 1 at its step, and
its message as text (`warnings/<kind>`: TensorBoard's text, W&B's and trackio's logged string; MLflow, which logs
numbers only, gets it as an artifact `warnings/<kind>/step-<N>.txt`).

Where it goes: TensorBoard writes event files into the run folder (`runs/<run>/tensorboard`, so `tensorboard --logdir
runs` shows every run); MLflow, W&B and trackio go where their own settings say (MLFLOW_TRACKING_URI, WANDB_MODE,
...), in the experiment or project $QAE_TRACKER_PROJECT (default `qae`), as a run named by the run's id. A session
of a resumed run is a new run there under the same name (TensorBoard: more event files in the same folder).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from qae_app.core.trackers_check import report_to_trackers

PROJECT_ENV = "QAE_TRACKER_PROJECT"
DEFAULT_PROJECT = "qae"
TENSORBOARD_DIR = "tensorboard"  # inside the run folder
LATE_TIMES = ("write_s", "checkpoint_s", "step_s", "store_s")  # session.record_step_times, sent with the next step
NOT_A_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-./ ]")


def hyperparameters(config: dict) -> dict:
    """The config as trackers take hyperparameters: numbers, text and booleans as they are, anything else (None, a
    list, the launch's description) as JSON text."""
    return {
        key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value) for key, value in config.items()
    }


def metric_name(*parts: str) -> str:
    return NOT_A_METRIC_NAME.sub("_", "/".join(str(part) for part in parts))


def finite_values(row: dict, columns) -> dict[str, float]:
    """The row's values of `columns` that are numbers (NULL, text and NaN are not sent)."""
    out = {}
    for column in columns:
        value = row.get(column)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[column] = float(value)
    return out


def start_trackers(report_to: str | None, run_id: str, run_dir: Path, config: dict) -> Trackers | None:
    """The trackers --report-to names, started with the run's config (None when it names none)."""
    wanted = report_to_trackers(report_to)
    return Trackers(wanted, run_id, run_dir, config) if wanted else None


class Trackers:
    """The trackers of one session of a run (main process only): `log_step` with each step's tables, `log_times`
    with the times recorded for a step later, `finish` at the end (idempotent)."""

    def __init__(self, wanted: list[str], run_id: str, run_dir: Path, config: dict):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        project = os.environ.get(PROJECT_ENV, DEFAULT_PROJECT)
        made = {
            "tensorboard": lambda cls: cls(TENSORBOARD_DIR, run_dir),
            "mlflow": lambda cls: cls(experiment_name=project, run_name=run_id),
            "wandb": lambda cls: cls(project, name=run_id),
            "trackio": lambda cls: cls(project, name=run_id),
        }
        self.trackers = []
        for name in wanted:
            tracker = made[name](LOGGER_TYPE_TO_CLASS[name])
            tracker.start()
            self.trackers.append(tracker)
            tracker.store_init_configuration(hyperparameters(config))

    def log(self, values: dict[str, float], step: int) -> None:
        if values:
            for tracker in self.trackers:
                tracker.log(values, step=step)

    def log_step(self, step: int, tables: dict[str, list[dict]]) -> None:
        """The step's metrics (its `steps` row, but the times sent later), its evaluations, each reward component's
        signal and each warning as an event."""
        from qae_app.store.schema import STEP_METRICS, TABLES

        values = {}
        for row in tables.get("steps", []):
            values.update(finite_values(row, [name for name in STEP_METRICS if name not in LATE_TIMES]))
        for row in tables.get("evals", []):
            values.update(
                {
                    metric_name("eval", row["benchmark"], row["subset"], row["metric"]): value
                    for value in finite_values(row, ["value"]).values()
                }
            )
        signal_columns = [c for c in TABLES["component_signal"] if c not in ("run_id", "step", "name")]
        for row in tables.get("component_signal", []):
            values.update(
                {
                    metric_name("reward", row["name"], column): value
                    for column, value in finite_values(row, signal_columns).items()
                }
            )
        warnings = tables.get("warnings", [])
        values.update({metric_name("warnings", row["kind"]): 1.0 for row in warnings})
        self.log(values, step)
        for row in warnings:
            self.event(metric_name("warnings", row["kind"]), f"step {step}: {row['message']}", step)

    def event(self, key: str, text: str, step: int) -> None:
        """`text` at `step` under `key`, as each tracker keeps text."""
        for tracker in self.trackers:
            if tracker.name == "mlflow":
                import mlflow

                mlflow.log_text(text, f"{key}/step-{step}.txt")
            else:
                tracker.log({key: text}, step=step)

    def log_times(self, step: int, seconds: dict) -> None:
        self.log(finite_values(seconds, LATE_TIMES), step)

    def finish(self) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish()
