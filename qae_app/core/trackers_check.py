"""What `qae train --report-to` names, checked before the run is made: each tracker known (core.names.TRACKERS),
installed, for MLflow a store it can open, and for W&B an API key (or its offline mode). The trackers themselves are
train/trackers.py's."""

from __future__ import annotations

import importlib.util

from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped


def report_to_trackers(value: str | None) -> list[str]:
    """The trackers --report-to names ("tensorboard,mlflow"; none or "": none), each known and installed, checked
    before anything runs; one QAEUserError naming the option, the value and the fix otherwise."""
    wanted = list(
        dict.fromkeys(name.strip() for name in (value or "").split(",") if name.strip() and name.strip() != "none")
    )
    for name in wanted:
        if name not in names.TRACKERS:
            raise QAEUserError(
                f"report-to: '{clipped(name)}' is not a tracker qae sends metrics to. Use a comma list "
                f"of {', '.join(names.TRACKERS)}, or leave it out (the run's DuckDB file only)."
            )
    missing = [
        name for name in wanted if not any(importlib.util.find_spec(module) for module in names.TRACKER_MODULES[name])
    ]
    if missing:
        raise QAEUserError(
            f"report-to: {', '.join(missing)} is not installed. Install it (pip install -e "
            f"'.[trackers]' brings tensorboard and mlflow-skinny; or pip install {' '.join(missing)}), "
            "or drop it from --report-to."
        )
    if "mlflow" in wanted:
        check_mlflow_store()
    if "wandb" in wanted:
        check_wandb_login()
    return wanted


def check_mlflow_store() -> None:
    """The MLflow store MLFLOW_TRACKING_URI names (unset: MLflow 3's sqlite:///mlflow.db, which mlflow-skinny cannot
    open) opens here, before the run is made: MLflow's client builds its store without contacting a server."""
    import mlflow

    try:
        mlflow.MlflowClient()
    except Exception as err:  # MLflow raises its own kinds (an unsupported scheme, a store it cannot build)
        uri = mlflow.get_tracking_uri()
        said = " ".join(str(err).split())
        raise QAEUserError(
            f"report-to: mlflow cannot keep runs at {clipped(uri)} ({clipped(said, 200)}). Set "
            "MLFLOW_TRACKING_URI to your MLflow server (http://HOST:5000) or to a folder (file:./mlruns "
            "with MLFLOW_ALLOW_FILE_STORE=true), install the full mlflow for its sqlite store, or "
            "drop mlflow from --report-to."
        ) from None


def check_wandb_login() -> None:
    """W&B logs online only with an API key (WANDB_API_KEY, or `wandb login`'s netrc entry): without one wandb.init
    stops the run with its own traceback once the run is made. Its offline and disabled modes need none. Read from
    wandb's own settings and credentials, without contacting a server or prompting."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth.authenticate import authenticate_session
    except ImportError:  # (a wandb older than 0.31: wandb.init says it itself)
        return
    settings = wandb_setup.singleton().settings
    if settings.mode in ("offline", "disabled", "dryrun") or settings.api_key:
        return
    if authenticate_session(host=settings.base_url, source="qae", prompt=False, update_session=False) is None:
        raise QAEUserError(
            f"report-to: wandb has no API key here to log to {clipped(settings.base_url)} "
            "(WANDB_API_KEY is unset and `wandb login` was never run). Run `wandb login` or set "
            "WANDB_API_KEY, set WANDB_MODE=offline to keep its logs on disk (`wandb sync` later), or "
            "drop wandb from --report-to."
        )
