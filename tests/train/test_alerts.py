"""The alerts (train/alerts.py, levels in core/alert_levels.py): each one on a run of steps built to trip it and on one
that does not, through `watch` as the trainer calls it, with what fires once and what a resume keeps; and --alerts'
options, checked before a run starts."""

import json

import pytest

from qae_app.config import build_config
from qae_app.core.alert_levels import ALERT_KINDS, ALERTS, AlertSettings, parse_alerts
from qae_app.core.errors import QAEUserError
from qae_app.store.signal import primary_component
from qae_app.train.alerts import CHECKS, StepFacts, watch
from qae_app.train.trainer_state import TrainerState

CFG = build_config(entropy_high=1.5)


def run(
    steps: list[dict],
    alerts: str = "on",
    signal: list[list[dict]] | None = None,
    primary=None,
    state: TrainerState | None = None,
    start: int = 1,
) -> list[tuple[int, str]]:
    """(step, kind) of every warning `watch` gives over `steps` (each a `steps` row's metrics)."""
    state = state or TrainerState()
    settings = parse_alerts(alerts)
    fired = []
    for i, metrics in enumerate(steps):
        rows = signal[i] if signal is not None else []
        facts = StepFacts(
            start + i, {"entropy": 1.0, "frac_zero_adv": 0.8, **metrics}, rows, primary_component(primary, rows)
        )
        fired += [(start + i, row["kind"]) for row in watch(state, facts, settings, CFG)]
    return fired


def shares(primary: float | None, fmt: float | None) -> list[dict]:
    return [
        {"name": "antonym", "weight": 1.0, "adv_share": primary, "frac_differs": 0.0},
        {"name": "one_word", "weight": 0.2, "adv_share": fmt, "frac_differs": 0.5},
    ]


def test_the_registry_is_the_list_of_names():
    assert list(CHECKS) == list(ALERTS)
    assert set(ALERT_KINDS) == (set(ALERTS) - {"entropy_band"}) | {"entropy_low", "entropy_high"}


def test_reward_signal_fires_once_when_a_format_reward_carries_everything_for_a_streak():
    hacked = [shares(0.0, 1.0)] * 5
    assert run([{}] * 5, signal=hacked) == [(3, "reward_signal")]
    # a step without any signal neither grows nor ends the streak
    assert run([{}] * 4, signal=[shares(0.0, 1.0), shares(None, None), shares(0.0, 1.0), shares(0.0, 1.0)]) == [
        (4, "reward_signal")
    ]
    # the primary carrying some, or nobody carrying nearly all, or the primary named is the one that carries it
    assert run([{}] * 5, signal=[shares(0.1, 0.9)] * 5) == []
    assert run([{}] * 5, signal=[shares(0.0, 0.5)] * 5, alerts="signal_share=0.6") == []
    assert run([{}] * 5, signal=hacked, primary="one_word") == []
    # again after the streak ended
    assert run([{}] * 7, signal=[*hacked[:3], shares(0.5, 0.5), *hacked[:3]]) == [
        (3, "reward_signal"),
        (7, "reward_signal"),
    ]


def test_the_message_names_the_component_and_the_primary_reward():
    state = TrainerState()
    for step in (1, 2, 3):
        rows = shares(0.0, 1.0)
        facts = StepFacts(step, {"entropy": 1.0, "frac_zero_adv": 0.8}, rows, primary_component(None, rows))
        fired = watch(state, facts, AlertSettings(), CFG)
    assert fired[0]["message"].startswith(
        "one_word (weight 0.2) carried 100% of the advantage, and antonym, the primary reward, none of it"
    )


def test_a_primary_reward_that_names_no_component_is_refused_with_the_components():
    with pytest.raises(QAEUserError, match=r"primary-reward: 'exact' is not a component .*\(antonym, one_word\)"):
        primary_component("exact", shares(0.0, 1.0))


# the entropy of the built-in default run's first 60 steps (`qae train`, 2026-12-05), 3 decimals: no trend, 10-20%
# a step of jitter, on which entropy_slope=0.1 (the default before) fired 5 times (as the run stored: steps 34, 47,
# 50, 52, 55), "falling" and "rising" in turn
DEFAULT_RUN_ENTROPY = [
    0.463, 0.431, 0.39, 0.457, 0.448, 0.41, 0.485, 0.471, 0.435, 0.462, 0.412, 0.496, 0.441, 0.414, 0.513, 0.305,
    0.49, 0.432, 0.309, 0.477, 0.467, 0.445, 0.319, 0.427, 0.497, 0.478, 0.379, 0.489, 0.361, 0.419, 0.475, 0.484,
    0.313, 0.278, 0.404, 0.454, 0.35, 0.315, 0.501, 0.511, 0.343, 0.349, 0.492, 0.49, 0.433, 0.353, 0.288, 0.522,
    0.412, 0.534, 0.203, 0.297, 0.44, 0.498, 0.415, 0.354, 0.349, 0.341, 0.5, 0.371,
]  # fmt: skip


def test_entropy_slope_fires_on_a_fast_move_inside_the_band():
    assert run([{"entropy": e} for e in (1.0, 1.3, 1.6, 1.7)], alerts="window=3") == [(3, "entropy_slope")]
    assert run([{"entropy": e} for e in (1.0, 0.75, 0.5)], alerts="window=3") == [(3, "entropy_slope")]
    assert run([{"entropy": e} for e in (1.0, 1.02, 1.01, 1.03)], alerts="window=3") == []
    # 12% a step: a move the noise of a healthy run makes; the level is the user's to lower
    assert run([{"entropy": e} for e in (1.0, 1.12, 1.25, 1.3)], alerts="window=3") == []
    assert run([{"entropy": e} for e in (1.0, 1.12, 1.25, 1.3)], alerts="window=3,entropy_slope=0.1") == [
        (3, "entropy_slope")
    ]


def test_entropy_slope_is_quiet_on_the_noise_of_a_healthy_run():
    steps = [{"entropy": e} for e in DEFAULT_RUN_ENTROPY]
    assert [kind for _, kind in run(steps)] == []
    assert [kind for _, kind in run(steps, alerts="entropy_slope=0.1")].count("entropy_slope") == 5


def test_entropy_band_is_one_of_the_alerts_and_can_be_turned_off():
    rising = [{"entropy": e} for e in (1.0, 1.0, 20.0)]
    assert run(rising, alerts="entropy_slope=off") == [(3, "entropy_high")]
    assert run(rising, alerts="entropy_slope=off,entropy_band=off") == []
    assert run([{"entropy": 1.0}] * 3) == []


def test_length_collapse_and_runaway_compare_the_last_window_with_the_first():
    lengths = lambda *values: [{"response_len": v} for v in values]  # noqa: E731
    assert run(lengths(10, 10, 6, 4), alerts="window=2") == [(4, "length_collapse")]
    assert run(lengths(10, 10, 15, 25), alerts="window=2") == [(4, "length_runaway")]
    assert run(lengths(10, 10, 12, 8, 11), alerts="window=2") == []
    assert run(lengths(10, 10, 4, 4, 4), alerts="window=2") == [(4, "length_collapse")]  # once while it holds


def test_truncation_jump_is_against_the_window_before():
    cut = lambda *values: [{"truncated_frac": v} for v in values]  # noqa: E731
    assert run(cut(0.0, 0.05, 0.4), alerts="window=2") == [(3, "truncation_jump")]
    assert run(cut(0.5, 0.5, 0.6), alerts="window=2") == []  # high, but no jump


def test_mismatch_fires_on_capped_tokens_or_a_k3_far_above_the_run_median():
    assert run([{"mismatch_capped": 30, "mismatch_capped_frac": 0.03, "mismatch_k3_kl": 1e-3}]) == [(1, "mismatch")]
    assert run([{"mismatch_capped": 1, "mismatch_capped_frac": 0.001, "mismatch_k3_kl": 1e-3}]) == []

    def k3(*values):
        return [{"mismatch_k3_kl": v, "mismatch_capped": 0, "mismatch_capped_frac": 0.0} for v in values]

    assert run(k3(1e-4, 1e-4, 5e-3), alerts="window=2") == [(3, "mismatch")]
    assert run(k3(1e-4, 1.2e-4, 1e-4, 3e-4), alerts="window=2") == []
    # float32 rounding (the built-in default run: 1.8e-12 against a median of 1.8e-13) is no mismatch, any multiple
    assert run(k3(1.8e-13, 1.8e-13, 1.8e-12), alerts="window=2") == []


def test_the_mismatch_message_says_how_many_tokens_the_sampler_disagrees_on():
    state = TrainerState()
    fired = watch(
        state,
        StepFacts(1, {"mismatch_capped": 42.0, "mismatch_capped_frac": 0.05, "mismatch_k3_kl": 2e-3}, [], None),
        AlertSettings(),
        CFG,
    )
    assert fired[0]["message"].startswith("the sampler is not the trainer: 42 tokens capped (5.0% of the tokens")


def test_saturation_and_no_signal_are_streaks():
    assert run([{"frac_all_correct": 1.0}] * 4) == [(3, "reward_saturation")]
    assert run([{"frac_all_correct": v} for v in (1.0, 0.5, 1.0, 1.0)]) == []
    assert run([{"frac_zero_adv": 1.0}] * 3) == [(3, "no_signal")]
    assert run([{"frac_zero_adv": float("nan")}] * 3) == [(3, "no_signal")]  # nothing trained: no signal either
    assert run([{"frac_zero_adv": v} for v in (1.0, 0.8, 1.0)]) == []


def test_alerts_off_says_nothing_and_still_remembers_the_run():
    state = TrainerState()
    assert run([{"frac_zero_adv": 1.0}] * 3, alerts="off", state=state) == []
    assert state.alerts["streaks"]["no_signal"] == 3  # turned on at a resume, it knows the run's past
    assert run([{"frac_zero_adv": 1.0}], state=state, start=4) == []  # (the 4th of a streak of 3: said at the 3rd)


def test_the_alerts_record_survives_a_checkpoint_and_a_planted_one_is_refused(tmp_path):
    state = TrainerState()
    run([{"entropy": 1.0 + i / 10, "response_len": 5.0} for i in range(4)], state=state)
    state.save(tmp_path / "trainer_state.json")
    assert TrainerState.load(tmp_path / "trainer_state.json").alerts == state.alerts
    stored = json.loads((tmp_path / "trainer_state.json").read_text())
    stored["alerts"]["history"]["entropy"] = ["import os"]
    (tmp_path / "trainer_state.json").write_text(json.dumps(stored))
    assert "alerts" in TrainerState.problem(tmp_path / "trainer_state.json")


@pytest.mark.parametrize(
    "given, said",
    [
        ("windw=3", "alerts: unknown name 'windw'"),
        ("window=1", "alerts: window=1 is not a whole number from 2 to 10000"),
        ("window=2.5", "alerts: window=2.5 is not a whole number"),
        ("signal_share=nan", "alerts: signal_share=nan is not a number from 0.5 to 1"),
        ("entropy_slope=fast", "alerts: entropy_slope=fast is not a number"),
        ("mismatch=3", "alerts: mismatch=3: this alert is on or off"),
        ("window", "alerts: 'window' is not NAME=VALUE"),
    ],
)
def test_bad_alerts_options_are_one_clear_error(given, said):
    with pytest.raises(QAEUserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        build_config(alerts=given)


def test_alerts_options_set_levels_and_turn_alerts_off():
    settings = parse_alerts(" window=8, entropy_slope=0.2 ,length_runaway=off")
    assert settings["window"] == 8 and settings["entropy_slope"] == 0.2 and settings["streak"] == 3
    assert "length_runaway" not in settings.enabled and "length_collapse" in settings.enabled
    assert parse_alerts("off").enabled == frozenset() and parse_alerts("on") == AlertSettings()


def test_primary_reward_without_reward_is_refused():
    with pytest.raises(QAEUserError, match="primary-reward: 'x' names a component of --reward, and no --reward"):
        build_config(primary_reward="x")
