"""What tells runs apart: each run's options that differ from the default or from the other runs shown with it.

Two runs made with `--dynamic-sampling` and `--log-entropy-attribution` have the same estimator, K and steps: a
listing of those alone shows them identically. `what_differs` names, for the runs of one view (`qae runs`, the Runs
table, the runs picked in the dashboard's sidebar):

- `shared`: the options every run has at the same value, not its default (said once for the view: `steps=20`);
- `per_run`: each run's options whose value varies across the view (each run's value, its default included, so
  seed 0 and seed 1 both say so; a switch that is off is not named), and, with one run, its options not at their
  default.

An option's default is the one `qae train` would have used for that run: a built-in task's own model and response
length, and the defaults resolved from other options (the sampler's dtype follows --dtype), are no differences. An
option a run's config lacks (stored by an older version) had its default. The run's name and its sweep's id and name
only label it and are never named; K and the quantile are not named for an estimator that does not use them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from qae_app.config import FIELDS, TrainConfig
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.formatting import clipped
from qae_app.data.tasks import task_defaults

# Never named: they label a run, not what it trains or how
LABELS = ("run_name", "sweep_id", "sweep_name")
FIRST, LAST = ("estimator", "k"), ("seed",)  # "estimator=grpo, ..., seed=1": the setup first, the replicate last
QAE_ONLY = ("k", "quantile")
# the options whose defaults other options resolve (TrainConfig.__post_init__), and those they follow
RESOLVED_FROM = ("data", "dtype", "engine", "mixed_precision")

TEXT_CHARS = 60
Options = list[tuple[str, Any]]


@dataclass
class Differences:
    shared: Options = field(default_factory=list)  # (option, value): the same in every run, not the default
    per_run: list[Options] = field(default_factory=list)  # each run's (option, value) that tell it apart


def _order(keys: Iterable[str]) -> list[str]:
    keys = list(keys)
    return (
        [k for k in FIRST if k in keys]
        + [k for k in keys if k not in FIRST and k not in LAST]
        + [k for k in LAST if k in keys]
    )


OPTIONS = _order(name for name in FIELDS if name not in LABELS)


def defaults_of(config: dict) -> dict:
    """The options `qae train` would have used for this run had none been given but those the defaults follow
    (the task, the dtype, the engine, the mixed precision)."""
    plain = {name: spec.default for name, spec in FIELDS.items()}
    # (text only: a crafted value of another type is compared with the plain defaults; resolving reads no file)
    driving = {key: config[key] for key in RESOLVED_FROM if isinstance(config.get(key), str)}
    resolved = TrainConfig(**{**task_defaults(driving.get("data", plain["data"])), **driving}).to_dict()
    return {**resolved, **{key: plain[key] for key in RESOLVED_FROM}}  # (those are options of their own)


def _comparable(value: Any) -> Any:
    """A value as compared: numbers (and numbers stored as text, as K is) as floats, lists and dicts as JSON."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    return json.dumps(value, sort_keys=True, default=str)


def _is_off(value: Any) -> bool:
    return value is None or value is False


def reads_k(config: dict) -> bool:
    """Whether the run of a stored config read K: its estimator's record says (a mean baseline does not); an
    estimator this qae has no record of counts as reading K, so its K still tells runs apart."""
    record = ESTIMATORS.get(str(config.get("estimator", "qae")))
    return record is None or record.reads_k


def what_differs(configs: list[dict | None], leave_out: Iterable[str] = ()) -> Differences:
    """For the runs of one view (their stored configs; None for a run without one: unreadable, or not a training
    run), what is shared and not the default, and what tells each run apart. `leave_out`: options the view shows in
    columns of their own (the estimator, the steps)."""
    known = [(i, config) for i, config in enumerate(configs) if config is not None]
    defaults = {i: defaults_of(config) for i, config in known}
    per_run: list[Options] = [[] for _ in configs]
    shared: Options = []
    for key in (key for key in OPTIONS if key not in set(leave_out)):
        using = [(i, config) for i, config in known if key not in QAE_ONLY or reads_k(config)]
        values = {i: config.get(key, defaults[i][key]) for i, config in using}
        not_default = {i for i, value in values.items() if _comparable(value) != _comparable(defaults[i][key])}
        if not not_default:
            continue
        if (
            len(using) > 1
            and len({_comparable(value) for value in values.values()}) == 1
            and len(not_default) == len(using)
        ):
            shared.append((key, values[using[0][0]]))
            continue
        for i, value in values.items():
            if len(using) == 1 or i in not_default or not _is_off(value):
                per_run[i].append((key, value))
    return Differences(shared=shared, per_run=per_run)


def value_text(value: Any) -> str:
    """An option's value, compactly: 1e-05, a list as a+b, text quoted when it holds a space (a long text cut, its
    length said)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return "+".join(value_text(item) for item in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    text = clipped(value, TEXT_CHARS)  # a prompt template or a path: its start, and how long it is
    return json.dumps(text, ensure_ascii=False) if not text or any(c.isspace() or c in ',"' for c in text) else text


def option_text(key: str, value: Any) -> str:
    """'dynamic_sampling' for a switch that is on, else 'lr=1e-05'."""
    return key if value is True else f"{key}={value_text(value)}"


def options_text(options: Options) -> str:
    """'dynamic_sampling, lr=1e-05'."""
    return ", ".join(option_text(key, value) for key, value in options)
