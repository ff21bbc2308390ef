"""Runs grouped by their config, as W&B groups them: the Training curves page draws each group's mean curve and a
band across its runs instead of one line per run. Pure functions of configs and DataFrames (no Streamlit).

By default the runs are grouped by everything but the seed (and the keys `qae compare` ignores: names, bookkeeping,
the evaluation's sampling), so the seeds of one setup form a group; any config keys can be picked instead.
"""

from __future__ import annotations

import charts
import pandas as pd

from qae_app.analysis import run_comparison

# the values a metric can take: its band is cut there (a fraction's t-interval easily leaves [0, 1] with 3 seeds)
UNIT_INTERVAL = (0.0, 1.0)
NON_NEGATIVE = (0.0, None)


def metric_bounds(metric: str) -> tuple[float | None, float | None]:
    if metric.startswith(("frac_", "clip_frac")) or metric in ("accuracy", "heldout_accuracy"):
        return UNIT_INTERVAL
    if (
        metric.startswith("entropy")
        or metric.endswith("_s")
        or metric in ("response_len", "grad_norm", "adv_abs_mean", "n_tokens")
    ):
        return NON_NEGATIVE
    return (None, None)


def config_keys(configs: dict[str, dict]) -> list[str]:
    """The keys the runs' configs have, the ones whose values differ between them first (what one groups by)."""
    keys = list(dict.fromkeys(key for config in configs.values() for key in config))

    def differs(key: str) -> bool:
        return len({repr(config.get(key)) for config in configs.values()}) > 1

    return sorted(keys, key=lambda key: (not differs(key), key))


def group_runs(configs: dict[str, dict], keys: list[str] | None = None) -> dict[str, list[str]]:
    """Group label -> its runs (in the given order). `keys`: the config keys whose values make a group; none: every key
    but the seed and what `qae compare` ignores (run_comparison.group_key). A label names the keys whose values differ
    between the groups ("estimator=qae, k=0.4"), or "all" when there is one group."""

    def key_of(config: dict) -> tuple:
        if keys:
            return tuple((key, repr(config.get(key, "-"))) for key in keys)
        return run_comparison.group_key(config)

    members: dict[tuple, list[str]] = {}
    for run_id, config in configs.items():
        members.setdefault(key_of(config), []).append(run_id)
    shared = [dict(key) for key in members]  # per group, the values that make it (absent: not part of its key)
    names = list(dict.fromkeys(name for config in shared for name in config))
    varying = [name for name in names if len({repr(config.get(name)) for config in shared}) > 1]
    varying.sort(key=lambda name: name != "estimator")  # the estimator first, as on Compare
    labels = {}
    for key, config, run_ids in zip(members, shared, members.values(), strict=True):
        first = configs[run_ids[0]]  # the values as the config has them (a picked key's are kept as repr)
        labels[key] = ", ".join(f"{name}={first.get(name, '-')}" for name in varying if name in config) or "all"
    return {labels[key]: run_ids for key, run_ids in members.items()}


def group_frames(
    frames: dict[str, pd.DataFrame], groups: dict[str, list[str]], metrics: list[str], band: str
) -> dict[str, pd.DataFrame]:
    """Per group, one steps frame: `step`, and for each metric its mean over the group's runs that have the step,
    the band (charts.BAND_LOW / BAND_HIGH: `band`, charts.across_seeds, cut at the metric's bounds) and how many runs
    have it (charts.BAND_N). Drawn by charts.lines as one line and band per group."""
    out = {}
    for label, run_ids in groups.items():
        members = [frames[run_id] for run_id in run_ids if run_id in frames]
        steps = sorted({int(step) for frame in members for step in frame["step"]})
        step = pd.Series(steps, name="step")
        columns = {"step": step}  # built apart and joined once (a column inserted at a time fragments the frame)
        for metric in metrics:
            curves = [frame[["step", metric]].rename(columns={metric: "value"}) for frame in members if metric in frame]
            if not curves:
                continue
            curve = charts.across_seeds(curves, band, metric_bounds(metric)).set_index("step")
            columns[metric] = step.map(curve["mean"])
            columns[metric + charts.BAND_LOW] = step.map(curve["low"])
            columns[metric + charts.BAND_HIGH] = step.map(curve["high"])
            columns[metric + charts.BAND_N] = step.map(curve["n"]).fillna(0).astype(int)
        out[label] = pd.DataFrame(columns)
    return out
