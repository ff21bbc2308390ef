"""The alerts the trainer watches for: one registry of checks, each a function of the step (its metrics, its
`component_signal` rows) and of what the run saw before (the `alerts` record of the trainer state, saved with each
checkpoint, so a resumed run watches on as if it had not stopped). The names, their levels and what `--alerts` may set
live in core/alert_levels.py; the entropy band's own check in entropy_band.py.

    fired = watch(state, StepFacts(step, metrics, signal_rows, primary), settings, cfg)   # `warnings` rows

An alert fires once when its condition starts to hold, or, for a streak alert, when the condition has held `streak`
steps in a row; it fires again only after the condition stopped holding.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from qae_app.config import TrainConfig
from qae_app.core.alert_levels import ALERTS, AlertSettings
from qae_app.train.entropy_band import entropy_warning
from qae_app.train.trainer_state import TrainerState

HISTORY = ("entropy", "response_len", "truncated_frac", "mismatch_k3_kl")  # step metrics the checks look back on
# a mismatch_k3_kl below this is float32 rounding, however many times its median: a float32 sampler beside a float32
# trainer differs by ~1e-6 nats a token, so k3 ~ d^2 / 2 ~ 1e-12 (the built-in default run: 1.8e-12 was "10x the
# median" and fired); a bfloat16 sampler's is ~1e-4 and above
ROUNDING_K3 = 1e-8
KEPT_STEPS = 1000  # at most this many of each: the run's median of mismatch_k3_kl is over its last 1000 steps


@dataclass
class StepFacts:
    step: int
    metrics: dict  # the step's `steps` row
    signal: list[dict]  # its `component_signal` rows (runs given --reward)
    primary: str | None  # the primary reward component (--primary-reward, else the first); None without components


@dataclass(frozen=True)
class Alert:
    check: Callable  # (facts, record, settings, cfg, state) -> message, a warnings row (dict), or None
    streak: bool = False  # fires when the condition held `streak` steps in a row
    edge: bool = True  # fires once until the condition stops holding (False: the check keeps its own state)


CHECKS: dict[str, Alert] = {}
# what a streak alert's check returns for a step that says nothing either way (reward_signal at a step without any
# signal): the streak neither grows nor ends
NEUTRAL = "neutral"


def register(name: str, streak: bool = False, edge: bool = True):
    if name not in ALERTS:
        raise ValueError(f"alert '{name}' has no entry in qae_app.core.alert_levels.ALERTS: add its meaning there")

    def decorator(check: Callable) -> Callable:
        CHECKS[name] = Alert(check, streak, edge)
        return check

    return decorator


def new_record() -> dict:
    """What the alerts remember of a run (the trainer state's `alerts`, JSON): recent values of HISTORY, the first
    window of response lengths, the steps seen, each streak's length and the alerts whose condition holds."""
    return {"history": {name: [] for name in HISTORY}, "first_lengths": [], "steps": 0, "streaks": {}, "active": []}


def watch(state: TrainerState, facts: StepFacts, settings: AlertSettings, cfg: TrainConfig) -> list[dict]:
    """The `warnings` rows (kind, message) of the alerts that fire at this step; updates state.alerts (and the
    entropy band's fields) whatever is enabled, so an alert turned on at a resume knows the run's past."""
    record = state.alerts if state.alerts is not None else new_record()
    state.alerts = record
    fired = []
    for name, alert in CHECKS.items():
        said = alert.check(facts, record, settings, cfg, state)
        if alert.streak and said == NEUTRAL:
            said = None
        elif alert.streak:
            count = record["streaks"].get(name, 0) + 1 if said is not None else 0
            record["streaks"][name] = count
            said = said if count == settings["streak"] else None
        elif alert.edge:
            holding = said is not None
            said = said if holding and name not in record["active"] else None
            record["active"] = sorted((set(record["active"]) | {name}) if holding else (set(record["active"]) - {name}))
        if said is not None and name in settings.enabled:
            fired.append(said if isinstance(said, dict) else {"kind": name, "message": said})
    _remember(record, facts.metrics, settings["window"])
    return fired


def _remember(record: dict, metrics: dict, window: int) -> None:
    record["steps"] += 1
    for name in HISTORY:
        value = _value(metrics.get(name))
        if value is not None:
            record["history"][name] = [*record["history"][name], value][-KEPT_STEPS:]
    length = _value(metrics.get("response_len"))
    if length is not None and len(record["first_lengths"]) < window:
        record["first_lengths"].append(length)


def _value(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------------------------
# the checks, in the order they are said


@register("reward_signal", streak=True)
def _reward_signal(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    rows = {row["name"]: row for row in facts.signal}
    primary = rows.get(facts.primary)
    if primary is None:
        return None
    if all(row["adv_share"] is None or row["adv_share"] != row["adv_share"] for row in facts.signal):
        return NEUTRAL  # no signal at all this step: no_signal's business
    if (primary["adv_share"] or 0) > 0:
        return None
    carriers = [
        row for row in facts.signal if row is not primary and (row["adv_share"] or 0) >= settings["signal_share"]
    ]
    if not carriers:
        return None
    row = max(carriers, key=lambda r: r["adv_share"])
    return (
        f"{row['name']} (weight {row['weight']:g}) carried {row['adv_share']:.0%} of the advantage, and "
        f"{facts.primary}, the primary reward, none of it, in {settings['streak']} steps with signal in a row: "
        f"the policy is taught {row['name']}, not the task (reward hacking). See the responses where "
        f"{row['name']} scores and {facts.primary} does not (the dashboard's Rollouts page filters by component); "
        f"lower {row['name']}'s weight, or make {facts.primary} reachable (a warm start, an easier split, a "
        "larger G)."
    )


@register("entropy_band", edge=False)
def _entropy_band(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> dict | None:
    entropy = facts.metrics.get("entropy")
    return entropy_warning(state, math.nan if entropy is None else float(entropy), cfg)


@register("entropy_slope")
def _entropy_slope(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    window = settings["window"]
    now = _value(facts.metrics.get("entropy"))
    if now is None:
        return None
    values = [*record["history"]["entropy"], now][-window:]
    mean = sum(values) / len(values)
    if len(values) < window or mean <= 0:
        return None
    x_mean = (window - 1) / 2
    slope = sum((x - x_mean) * (v - mean) for x, v in enumerate(values)) / sum((x - x_mean) ** 2 for x in range(window))
    if abs(slope) / mean < settings["entropy_slope"]:
        return None
    how = (
        "rising: lower --k so more prompts are hard, or check whether a reward pays for anything the model says "
        "(a format reward the policy games raises entropy)"
        if slope > 0
        else "falling: raise --k so more prompts are easy (collapse risk)"
    )
    return (
        f"entropy moved {slope / mean:+.0%} of its mean a step over the last {window} steps ({values[0]:.3f} -> "
        f"{values[-1]:.3f} nats), faster than --alerts entropy_slope={settings['entropy_slope']:g}: {how}."
    )


def _lengths(facts: StepFacts, record: dict, window: int) -> tuple[float, float] | None:
    """(the first window's mean length, the last window's), once the two windows do not overlap."""
    now = _value(facts.metrics.get("response_len"))
    if now is None or record["steps"] + 1 < 2 * window or len(record["first_lengths"]) < window:
        return None
    last = [*record["history"]["response_len"], now][-window:]
    return sum(record["first_lengths"]) / window, sum(last) / window


@register("length_collapse")
def _length_collapse(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    lengths = _lengths(facts, record, settings["window"])
    if lengths is None or lengths[1] > lengths[0] / settings["length_ratio"]:
        return None
    return (
        f"responses shrank to {lengths[1]:.1f} tokens (the last {settings['window']} steps' mean) from "
        f"{lengths[0]:.1f} (the first {settings['window']}'s): is a reward paying for short answers, or is the "
        "policy dropping its reasoning? Read the shortest responses (`qae rollouts RUN`)."
    )


@register("length_runaway")
def _length_runaway(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    lengths = _lengths(facts, record, settings["window"])
    if lengths is None or lengths[1] < lengths[0] * settings["length_ratio"]:
        return None
    return (
        f"responses grew to {lengths[1]:.1f} tokens (the last {settings['window']} steps' mean) from "
        f"{lengths[0]:.1f} (the first {settings['window']}'s), truncated_frac "
        f"{facts.metrics.get('truncated_frac', math.nan):.2f}: raise --max-new-tokens, or shape long answers "
        "down (--overlong-buffer)."
    )


@register("truncation_jump")
def _truncation_jump(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    now, before = (
        _value(facts.metrics.get("truncated_frac")),
        record["history"]["truncated_frac"][-settings["window"] :],
    )
    if now is None or not before:
        return None
    mean = sum(before) / len(before)
    if now - mean < settings["truncation_jump"]:
        return None
    return (
        f"{now:.0%} of the responses hit --max-new-tokens {cfg.max_new_tokens}, up from {mean:.0%} over the "
        f"{len(before)} steps before: they are cut before an answer. Raise --max-new-tokens, or shape long answers "
        "down (--overlong-buffer)."
    )


@register("mismatch")
def _mismatch(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    metrics = facts.metrics
    capped, share = _value(metrics.get("mismatch_capped")), _value(metrics.get("mismatch_capped_frac"))
    k3, earlier = _value(metrics.get("mismatch_k3_kl")), record["history"]["mismatch_k3_kl"]
    advice = (
        "compare --rollout-dtype with --dtype (a bfloat16 sampler beside a float32 trainer), keep "
        "--rollout-correction tis on, and check the engine's weight sync"
    )
    if capped is not None and share is not None and share >= settings["mismatch_capped"]:
        return (
            f"the sampler is not the trainer: {capped:.0f} tokens capped ({share:.1%} of the tokens the loss "
            f"weighs have pi_old / pi_sampler above --rollout-correction-cap {cfg.rollout_correction_cap:g}; "
            f"mismatch_k3_kl {metrics.get('mismatch_k3_kl', math.nan):.3g}): {advice}."
        )
    if k3 is None or len(earlier) < settings["window"]:
        return None
    median = statistics.median(earlier)
    if median <= 0 or k3 < settings["mismatch_k3"] * median or k3 < ROUNDING_K3:
        return None
    return (
        f"the sampler is not the trainer: mismatch_k3_kl {k3:.3g} is {k3 / median:.0f}x the run's median "
        f"{median:.3g}" + (f", {capped:.0f} tokens capped" if capped is not None else "") + f": {advice}."
    )


@register("reward_saturation", streak=True)
def _saturation(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    share = _value(facts.metrics.get("frac_all_correct"))
    if share is None or share < settings["saturation"]:
        return None
    return (
        f"{share:.0%} of the groups were all correct, {settings['streak']} steps in a row: they carry no signal "
        "and the run is spending its steps on solved prompts. Move to a harder split, or stop here (held-out "
        "accuracy says whether it generalised)."
    )


@register("no_signal", streak=True)
def _no_signal(facts: StepFacts, record: dict, settings: AlertSettings, cfg, state) -> str | None:
    gated = facts.metrics.get("frac_zero_adv")
    if gated is not None and not (isinstance(gated, float) and math.isnan(gated)) and gated < 1.0:
        return None
    return (
        f"no group had signal for {settings['streak']} steps in a row: every response of each group got the same "
        "reward, so nothing is learned. Try a larger --group-size, an easier split, a longer --max-new-tokens or "
        "a warm start (`qae preview` shows which helps)."
    )
