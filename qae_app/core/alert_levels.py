"""The trainer's alerts by name, and the levels they fire at: one registry that `--alerts` is checked against before a
run starts, that the checks read (qae_app/train/alerts.py) and that docs/metrics.md's table of alerts is checked
against (tests/structure/test_readme.py). Torch-free: the config and the dashboard read it.

Every alert is on by default and fires once when its condition starts to hold (a streak alert when the streak reaches
`streak` steps), not at every step it holds: a `warnings` row whose kind is its name, a line under the progress line,
a mark on the dashboard's charts and, with --report-to, a tracker event. `--alerts` changes them:

    --alerts on                                   every alert at its default level (the default)
    --alerts off                                  none, the entropy band's warning included
    --alerts window=8,entropy_slope=0.3           levels by name (ALERT_LEVELS)
    --alerts length_runaway=off,streak=5          an alert off by name (ALERTS)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from qae_app.core.errors import QAEUserError

# name -> when it fires. The `warnings` row's kind is the name (entropy_band's: entropy_low or entropy_high).
ALERTS: dict[str, str] = {
    "reward_signal": "a reward component other than the primary one (the first --reward's, or --primary-reward) "
    "carries at least `signal_share` of the step's advantage mass while the primary carries none, "
    "`streak` steps in a row: the policy is taught that component, not the task (reward hacking)",
    "entropy_band": "the smoothed token entropy leaves the band --entropy-low / --entropy-high (default: the "
    "starting entropy / 3 and x 3): kinds entropy_low and entropy_high, with the way K steers back",
    "entropy_slope": "the least-squares slope of the step entropy over the last `window` steps, as a share of its "
    "mean there, is at least `entropy_slope` per step, up or down: entropy moving fast while still "
    "inside its band",
    "length_collapse": "the mean response length over the last `window` steps fell to the run's first `window` "
    "steps' mean / `length_ratio` or below",
    "length_runaway": "the mean response length over the last `window` steps rose to the run's first `window` "
    "steps' mean x `length_ratio` or above",
    "truncation_jump": "truncated_frac is at least `truncation_jump` above its mean over the `window` steps before",
    "mismatch": "the sampler is not the trainer: at least `mismatch_capped` of the tokens the policy loss weighs have "
    "pi_old / pi_sampler above --rollout-correction-cap (the tokens tis caps: mismatch_capped_frac), or "
    "mismatch_k3_kl is at least `mismatch_k3` x its median over the run's earlier steps (from the "
    "`window`-th step on) and above 1e-8 (below it, float32 rounding)",
    "reward_saturation": "at least `saturation` of the step's groups are all correct (no signal left), `streak` "
    "steps in a row",
    "no_signal": "no group of the step has signal (every trained advantage is 0), `streak` steps in a row",
}

# the `warnings` kinds the alerts write (entropy_band writes two)
ALERT_KINDS = tuple(
    kind for name in ALERTS for kind in (("entropy_low", "entropy_high") if name == "entropy_band" else (name,))
)
# the `steps` column each alert's marks are drawn on in the dashboard's Training curves
ALERT_CHARTS = {
    "reward_signal": "signal",
    "entropy_low": "entropy",
    "entropy_high": "entropy",
    "entropy_slope": "entropy",
    "length_collapse": "response_len",
    "length_runaway": "response_len",
    "truncation_jump": "response_len",
    "mismatch": "mismatch_k3_kl",
    "reward_saturation": "accuracy",
    "no_signal": "frac_zero_adv",
}


class Level(NamedTuple):
    default: float
    help: str
    whole: bool  # a whole number (steps)
    low: float  # the least it may be (inclusive)
    high: float  # the most it may be (inclusive)


ALERT_LEVELS: dict[str, Level] = {
    "window": Level(
        5, "steps the windowed alerts look back over (entropy_slope, length_*, truncation_jump)", True, 2, 10_000
    ),
    "streak": Level(
        3, "steps in a row a streak alert waits for (reward_signal, reward_saturation, no_signal)", True, 1, 10_000
    ),
    "signal_share": Level(
        0.9, "reward_signal: the share of the advantage mass one non-primary component carries", False, 0.5, 1.0
    ),
    # 0.2, not 0.1: a step's entropy is a mean over one batch, and on healthy runs it jitters by 10-20% a step. At 0.1
    # the built-in default run (300 steps, entropy 0.43 -> 0.26) fired 32 times, and 24 tiny-model runs of 100 steps
    # (4 policy losses x grpo/qae x 3 seeds, entropy drifting ~0.1 nat in all) 4-12 times each, alternately "falling"
    # and "rising"; at 0.2 once in all 2,700 steps. A steady fall to 40% within 5 steps (or a rise to 2.5x) still fires
    "entropy_slope": Level(
        0.2, "entropy_slope: the slope's size / the mean entropy over the window, per step", False, 1e-6, 10.0
    ),
    "length_ratio": Level(
        2.0, "length_collapse / length_runaway: the factor from the first window's mean length", False, 1.01, 1e6
    ),
    "truncation_jump": Level(
        0.2, "truncation_jump: the rise of truncated_frac over the window's mean", False, 1e-6, 1.0
    ),
    "mismatch_capped": Level(0.01, "mismatch: the share of loss tokens above the cap", False, 1e-9, 1.0),
    "mismatch_k3": Level(10.0, "mismatch: mismatch_k3_kl over its median so far", False, 1.0, 1e9),
    "saturation": Level(0.95, "reward_saturation: the share of all-correct groups", False, 1e-6, 1.0),
}


@dataclass(frozen=True)
class AlertSettings:
    """What `--alerts` said: the alerts on, and every level."""

    enabled: frozenset[str] = frozenset(ALERTS)
    levels: dict[str, float] = field(default_factory=lambda: {name: lv.default for name, lv in ALERT_LEVELS.items()})

    def __getitem__(self, level: str) -> float:
        return self.levels[level]


ALERTS_HELP = (
    "The alerts the trainer watches for (each a `warnings` row, a line under the progress line, a mark on "
    "the dashboard's charts, a tracker event): on (the default), off, or a comma list of LEVEL=NUMBER and "
    "ALERT=off, e.g. window=8,entropy_slope=0.3,length_runaway=off. Alerts: "
    + ", ".join(ALERTS)
    + ". Levels (default): "
    + ", ".join(f"{name} ({lv.default:g})" for name, lv in ALERT_LEVELS.items())
    + ". What each means: docs/metrics.md#alerts."
)


def parse_alerts(text: str) -> AlertSettings:
    """--alerts as settings; QAEUserError naming the item, its problem and the fix."""
    text = str(text).strip()
    if text in ("on", ""):
        return AlertSettings()
    if text == "off":
        return AlertSettings(enabled=frozenset())
    enabled, levels = set(ALERTS), {name: lv.default for name, lv in ALERT_LEVELS.items()}
    for item in (part.strip() for part in text.split(",")):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not name or not value:
            raise QAEUserError(
                f"alerts: '{item}' is not NAME=VALUE. Use on, off, or e.g. window=8,"
                "length_runaway=off (levels: " + ", ".join(ALERT_LEVELS) + ")."
            )
        if name in ALERTS and value in ("on", "off"):  # (entropy_slope and truncation_jump name a level too)
            (enabled.add if value == "on" else enabled.discard)(name)
        elif name in ALERT_LEVELS:
            levels[name] = _level(name, value)
        elif name in ALERTS:
            raise QAEUserError(
                f"alerts: {name}={value}: this alert is on or off. Its levels are set by their own "
                "names (" + ", ".join(ALERT_LEVELS) + ")."
            )
        else:
            raise QAEUserError(
                f"alerts: unknown name '{name}'. Alerts (on/off): {', '.join(ALERTS)}; levels: "
                f"{', '.join(ALERT_LEVELS)}."
            )
    return AlertSettings(frozenset(enabled), levels)


def _level(name: str, value: str) -> float:
    level = ALERT_LEVELS[name]
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    whole = number.is_integer() if math.isfinite(number) else False
    if not (level.low <= number <= level.high) or (level.whole and not whole):
        kind = "a whole number" if level.whole else "a number"
        raise QAEUserError(
            f"alerts: {name}={value} is not {kind} from {level.low:g} to {level.high:g} ({level.help}). "
            f"The default is {level.default:g}."
        )
    return int(number) if level.whole else number
