"""Statistics for comparing runs across seeds: Student t against tables and closed forms, intervals, paired
differences and per-run metrics against hand computations, grouping by config, and runs read back from DuckDB."""

import math

import pandas as pd
import pytest

from qae_app.analysis.run_comparison import (
    RUN_METRICS,
    RunRecord,
    area_under_curve,
    compare_to_baseline,
    find_group,
    group_key,
    group_runs,
    least_squares_slope,
    mean_interval,
    paired_difference,
    regularized_incomplete_beta,
    run_metrics,
    sample_size_note,
    student_t_cdf,
    student_t_ppf,
    student_t_two_sided_p,
)
from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError

# ---------------------------------------------------------------------------------------------------------------
# Student t


@pytest.mark.parametrize(
    "df, quantile", [(1, 12.7062047), (2, 4.3026527), (4, 2.7764451), (10, 2.2281389), (30, 2.0422725)]
)
def test_t_quantiles_match_the_table(df, quantile):
    assert student_t_ppf(0.975, df) == pytest.approx(quantile, abs=1e-6)
    assert student_t_ppf(0.025, df) == pytest.approx(-quantile, abs=1e-6)
    assert student_t_two_sided_p(quantile, df) == pytest.approx(0.05, abs=1e-8)


@pytest.mark.parametrize("t", [-7.5, -1.0, -0.3, 0.0, 0.5, 2.0, 40.0])
def test_t_cdf_matches_closed_forms(t):
    # df = 1 is the Cauchy distribution; df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_two_sided_p_values_by_hand():
    assert student_t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)  # 1 - 2 atan(1) / pi
    assert student_t_two_sided_p(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6), abs=1e-12)  # 0.1835034
    assert student_t_two_sided_p(-2.0, 2) == student_t_two_sided_p(2.0, 2)
    assert student_t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert student_t_two_sided_p(math.inf, 5) == 0.0
    # large df approaches the normal: P(|Z| >= 1.959964) = 0.05
    assert student_t_two_sided_p(1.959964, 1e7) == pytest.approx(0.05, abs=1e-6)


def test_incomplete_beta_closed_forms():
    for x in (0.0, 0.01, 0.3, 0.5, 0.77, 0.999, 1.0):
        assert regularized_incomplete_beta(1, 1, x) == pytest.approx(x, abs=1e-13)
        assert regularized_incomplete_beta(3, 1, x) == pytest.approx(x**3, abs=1e-13)
        assert regularized_incomplete_beta(1, 4, x) == pytest.approx(1 - (1 - x) ** 4, abs=1e-13)
    with pytest.raises(ValueError):
        regularized_incomplete_beta(1, 1, 1.5)


# ---------------------------------------------------------------------------------------------------------------
# Intervals and paired differences


def test_mean_interval_by_hand():
    e = mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, half-width t_{0.975,2} / sqrt(3)
    half = 4.3026527 / math.sqrt(3)
    assert (e.mean, e.sd, e.n) == (2.0, 1.0, 3)
    assert e.low == pytest.approx(2 - half, abs=1e-6) and e.high == pytest.approx(2 + half, abs=1e-6)
    assert "wide" in e.note
    one = mean_interval([0.4, math.nan])  # a run without the metric is left out, and n says so
    assert (one.mean, one.low, one.high, one.n) == (0.4, None, None, 1) and "no interval" in one.note
    assert mean_interval([]).mean is None
    assert mean_interval([0.1, 0.2, 0.3, 0.4, 0.5]).note is None  # 5 seeds: no warning


def test_sample_size_notes():
    # n=0 said "one seed" (a group that shares no seed with the baseline): it says there is nothing to estimate from
    assert "one seed" not in sample_size_note(0) and "no seed shared with the baseline" in sample_size_note(0)
    assert "no interval" in sample_size_note(1) and "one seed" in sample_size_note(1)
    assert sample_size_note(2).startswith("n=2: no interval") and "12.7 standard errors" in sample_size_note(2)
    assert "wide" in sample_size_note(4)
    assert sample_size_note(5) is None


def test_paired_difference_by_hand():
    # differences 0.1, 0.2, 0.1 (seed 3 only in one group, so it is not paired): mean 2/15, sd 1/sqrt(300),
    # t = mean / (sd / sqrt 3) = 4 exactly; df = 2 gives p = 1 - 4 / sqrt(18)
    group = {0: 0.6, 1: 0.7, 2: 0.8, 3: 0.9}
    baseline = {0: 0.5, 1: 0.5, 2: 0.7}
    d = paired_difference(group, baseline)
    assert d.seeds == [0, 1, 2] and d.n == 3
    assert d.mean == pytest.approx(2 / 15, abs=1e-12)
    assert d.sd == pytest.approx(1 / math.sqrt(300), abs=1e-12)
    assert d.p_value == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-9)  # 0.0571910
    half = 4.3026527 * (1 / math.sqrt(300)) / math.sqrt(3)
    assert d.low == pytest.approx(2 / 15 - half, abs=1e-6) and d.high == pytest.approx(2 / 15 + half, abs=1e-6)
    assert d.low < 0 < d.high  # p > 0.05 and the interval covers 0: the same verdict


def test_paired_difference_edge_cases():
    same_shift = paired_difference({0: 0.5, 1: 0.6}, {0: 0.4, 1: 0.5})
    assert same_shift.mean == pytest.approx(0.1) and same_shift.p_value in (0.0, 1.0)
    equal = paired_difference({0: 0.5, 1: 0.6}, {0: 0.5, 1: 0.6})
    assert equal.mean == 0 and equal.p_value == 1.0
    single = paired_difference({0: 0.5, 1: 0.6}, {1: 0.4})
    assert single.n == 1 and single.p_value is None and single.low is None and "no interval" in single.note
    none = paired_difference({0: 0.5}, {1: 0.4})
    assert none.n == 0 and none.mean is None


# ---------------------------------------------------------------------------------------------------------------
# Per-run metrics


def _steps(n=10, heldout=None, entropy=None, zero_adv=None, step_s=None):
    frame = pd.DataFrame({"step": range(1, n + 1)})
    frame["heldout_accuracy"] = [(heldout or {}).get(s, math.nan) for s in frame["step"]]
    frame["entropy"] = entropy if entropy is not None else [1.0] * n
    frame["frac_zero_adv"] = zero_adv if zero_adv is not None else [0.8] * n
    frame["step_s"] = step_s if step_s is not None else [1.0] * n
    return frame


def test_run_metrics_by_hand():
    steps = _steps(
        heldout={5: 0.5, 10: 0.4},
        entropy=[2 - 0.1 * s for s in range(1, 11)],
        zero_adv=[0.8] * 8 + [0.9, 0.9],
        step_s=list(range(1, 11)),
    )
    steps = pd.concat([pd.DataFrame({"step": [0], "heldout_accuracy": [0.1]}), steps], ignore_index=True)
    m = run_metrics(steps)
    assert set(m) == set(RUN_METRICS)
    assert m["final_heldout"] == 0.4 and m["best_heldout"] == 0.5
    # trapezoids 0-5 and 5-10: (5 * 0.3 + 5 * 0.45) / 10
    assert m["auc_heldout"] == pytest.approx(0.375)
    # last 20% of the 10 entropy rows: steps 9 and 10 (1.1 and 1.0)
    assert m["entropy_last"] == pytest.approx(1.05) and m["entropy_slope"] == pytest.approx(-0.1)
    assert m["entropy_range"] == pytest.approx(1.9 - 1.0)  # every step's entropy, 1.9 at step 1 to 1.0 at step 10
    assert m["zero_adv"] == pytest.approx(0.82) and m["zero_adv_last"] == pytest.approx(0.9)
    assert m["step_s"] == pytest.approx(5.5)
    assert math.isnan(m["dH_easy"]) and math.isnan(m["dH_hard"])  # not measured in this run


def test_entropy_change_per_regime_is_averaged_over_the_steps_that_have_it():
    steps = _steps().assign(dH_easy=[0.02, None, 0.04] + [None] * 7, dH_hard=[-0.01] * 10)
    m = run_metrics(steps)
    assert m["dH_easy"] == pytest.approx(0.03) and m["dH_hard"] == pytest.approx(-0.01)
    assert math.isnan(m["dH_from_easy"])  # (no --log-entropy-attribution)


def test_entropy_attribution_is_averaged_over_the_steps_that_have_it():
    """A step without both regimes leaves a regime's column NULL: the mean is over the steps that measured it."""
    steps = _steps().assign(
        dH_from_easy=[0.03, None, 0.05] + [None] * 7,
        dH_from_hard=[-0.02] * 10,
        dH_from_none=[0.001, 0.003] + [None] * 8,
    )
    m = run_metrics(steps)
    assert m["dH_from_easy"] == pytest.approx(0.04) and m["dH_from_hard"] == pytest.approx(-0.02)
    assert m["dH_from_none"] == pytest.approx(0.002)


def test_run_metrics_without_evaluations_are_nan():
    m = run_metrics(_steps())
    assert math.isnan(m["final_heldout"]) and math.isnan(m["auc_heldout"])
    assert m["entropy_slope"] == pytest.approx(0.0)


def test_curve_helpers():
    assert area_under_curve([3], [0.7]) == 0.7
    assert area_under_curve([0, 10, 30], [0.0, 1.0, 1.0]) == pytest.approx((5 + 20) / 30)
    assert least_squares_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert math.isnan(least_squares_slope([1], [1]))


# ---------------------------------------------------------------------------------------------------------------
# Groups


def _config(**changes):
    return {**TrainConfig().to_dict(), **changes}


def test_group_key_ignores_the_seed_and_bookkeeping_and_k_for_mean_baselines():
    base = group_key(_config())
    assert group_key(_config(seed=3, run_name="x", checkpoint_every=5, eval_every=10)) == base
    # --vllm-sleep moves memory, not samples or updates; runs from before the option have no such key
    assert group_key(_config(vllm_sleep=True)) == group_key(_config(vllm_sleep=False)) == base
    assert group_key(_config(vllm_gpu_memory=0.5)) == base  # nor does vLLM's share of the GPU
    assert group_key(_config(k="0.3")) != base
    assert group_key(_config(lr=1e-4)) != base
    assert group_key(_config(estimator="grpo", k="0.3")) == group_key(_config(estimator="grpo", k="0.5"))


def _record(run_id, seed, final, **config):
    return RunRecord(
        run_id, _config(seed=seed, run_name=run_id, **config), seed, _steps(heldout={5: final - 0.1, 10: final})
    )


def test_groups_labels_and_paired_comparison_by_hand():
    runs = [_record(f"qae-{s}", s, f, estimator="qae") for s, f in [(0, 0.6), (1, 0.7), (2, 0.8)]]
    runs += [_record(f"grpo-{s}", s, f, estimator="grpo", k="0.3") for s, f in [(0, 0.5), (1, 0.5), (2, 0.7)]]
    groups = group_runs(runs)
    assert [g.label for g in groups] == ["estimator=qae", "estimator=grpo"]
    qae, grpo = groups
    assert qae.seeds == [0, 1, 2] and [r.run_id for r in grpo.runs] == ["grpo-0", "grpo-1", "grpo-2"]
    assert qae.metrics["final_heldout"].mean == pytest.approx(0.7)
    assert qae.metrics["final_heldout"].sd == pytest.approx(0.1)
    assert find_group(groups, "grpo") is grpo and find_group(groups, "estimator=qae") is qae
    diffs = compare_to_baseline(groups, grpo)
    assert list(diffs) == ["estimator=qae"]
    d = diffs["estimator=qae"]["final_heldout"]
    assert d.mean == pytest.approx(2 / 15) and d.p_value == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-9)
    assert qae.to_dict()["n"] == 3 and "wide" in qae.to_dict()["note"]


def test_labels_name_k_only_for_qae_groups():
    groups = group_runs(
        [
            _record("a", 0, 0.5, k="0.3"),
            _record("b", 0, 0.5, k="0.5"),
            _record("c", 0, 0.5, estimator="grpo", k="0.3"),
            _record("d", 1, 0.5, estimator="grpo"),
        ]
    )
    assert [g.label for g in groups] == ["estimator=qae, k=0.3", "estimator=qae, k=0.5", "estimator=grpo"]
    assert [len(g.runs) for g in groups] == [1, 1, 2]
    with pytest.raises(QAEUserError, match="matches several groups"):
        find_group(groups, "qae")


def test_find_group_names_the_choices():
    groups = group_runs([_record("a", 0, 0.5, k="0.3"), _record("b", 0, 0.5, k="0.5")])
    assert [g.label for g in groups] == ["k=0.3", "k=0.5"]
    with pytest.raises(QAEUserError, match="matches no group.*k=0.3; k=0.5"):
        find_group(groups, "grpo")


def test_a_seed_run_twice_counts_once_and_is_said():
    """Two runs of one config and seed are one draw: n is the distinct seeds, the first run given is counted."""
    groups = group_runs([_record("a", 0, 0.5), _record("b", 0, 0.7), _record("c", 1, 0.9)])
    assert len(groups) == 1 and groups[0].label == "all"
    assert groups[0].metrics["final_heldout"].n == 2 and groups[0].metrics["final_heldout"].mean == pytest.approx(0.7)
    assert [r.run_id for r in groups[0].runs] == ["a", "c"] and groups[0].excluded == {
        "b": "seed 0 again: a is counted for it"
    }
    assert "not counted: b (seed 0 again: a is counted for it)" in groups[0].note()
    assert groups[0].per_run["final_heldout"] == {0: 0.5, 1: 0.9}


def test_a_copy_counts_as_its_original_and_a_copy_picked_alone_counts():
    copy = _record("a-backup", 0, 0.5)
    copy.stored_run_id = "a"  # `cp -r a a-backup`: the database still holds the id "a"
    original = _record("a", 0, 0.5)
    original.stored_run_id = "a"
    [group] = group_runs([copy, original, _record("b", 1, 0.7)])  # the copy sorts first by name: still not counted
    assert [r.run_id for r in group.runs] == ["a", "b"] and group.to_dict()["n"] == 2
    assert group.excluded == {"a-backup": "a copy of a, seed 0: counted once"}
    [alone] = group_runs([copy, _record("b", 1, 0.7)])  # picked on purpose, without its original
    assert [r.run_id for r in alone.runs] == ["a-backup", "b"] and not alone.excluded


def test_a_run_without_a_training_step_is_left_out_and_said(tmp_path):
    """A run killed before its first step has at most its step-0 evaluation: counted as a seed, it would pull the
    group's final accuracy towards the untrained model's."""
    from qae_app.analysis.run_comparison import compare_runs
    from qae_app.cli.views import compare_view

    untrained = RunRecord(
        "nosteps",
        _config(seed=1, run_name="nosteps"),
        1,
        pd.DataFrame({"step": [0], "heldout_accuracy": [0.371]}),
        status="stopped",
    )
    comparison = compare_runs([_record("a", 0, 0.5), untrained])
    assert [[r.run_id for r in g.runs] for g in comparison.groups] == [["a"]]
    assert comparison.groups[0].metrics["final_heldout"].mean == pytest.approx(0.5)
    assert comparison.left_out == {"nosteps": "no training step yet"}
    assert comparison.to_dict()["left_out"] == {"nosteps": "no training step yet"}
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(compare_view(comparison, 120))
    assert "left out: nosteps (no training step yet)" in console.export_text()


def test_a_run_named_more_than_once_is_refused(tmp_path):
    from qae_app.analysis.run_comparison import load_runs

    with pytest.raises(QAEUserError, match="runs: 'a' is named more than once"):
        load_runs(tmp_path, ["a", "b", "a"])


def test_runs_read_back_from_duckdb(tmp_path):
    """Stored runs with known values give the hand-computed interval: the store's frames are what compare reads."""
    import json

    from qae_app.store.reader import read_run, read_steps
    from qae_app.store.schema import STEP_METRICS
    from qae_app.store.writer import RunWriter

    finals = {0: 0.6, 1: 0.7, 2: 0.8}
    records = []
    for seed, final in finals.items():
        run_id = f"qae-{seed}"
        writer = RunWriter(tmp_path / run_id / "qae.duckdb", run_id)
        config = _config(seed=seed, run_name=run_id)
        writer.create_run(run_id, config, "qae", 0.4, "builtin:tiny", "arith", seed)
        for step in (1, 2):
            row = {name: 0.5 for name in STEP_METRICS}
            row["heldout_accuracy"] = final if step == 2 else None
            writer.add_step(step, steps=[row])
        assert writer.flush()
        info = read_run(writer.path)
        records.append(RunRecord(run_id, json.loads(info["config"]), int(info["seed"]), read_steps(writer.path)))
    [group] = group_runs(records)
    e = group.metrics["final_heldout"]
    half = 4.3026527 * 0.1 / math.sqrt(3)
    assert e.mean == pytest.approx(0.7) and e.low == pytest.approx(0.7 - half, abs=1e-6)
    assert group.metrics["auc_heldout"].mean == pytest.approx(0.7)  # one evaluated step: its value
    assert group.metrics["entropy_slope"].mean == pytest.approx(0.0)


def test_intervals_are_cut_at_what_the_metric_can_take():
    """zero_adv_last at 0.98, 0.99, 0.60 over 3 seeds: mean 0.857, sd 0.222, t(2) half-width 0.552 -> [0.305, 1.409]
    by the formula; a fraction's interval stops at 1."""
    from qae_app.analysis.run_comparison import FRACTION, RUN_METRIC_BOUNDS, interval_missing, mean_interval

    values = [0.98, 0.99, 0.60]
    raw, cut = mean_interval(values), mean_interval(values, FRACTION)
    assert raw.high == pytest.approx(1.409, abs=1e-3) and raw.low == pytest.approx(0.305, abs=1e-3)
    assert cut.high == 1.0 and cut.low == raw.low and cut.mean == raw.mean
    assert RUN_METRIC_BOUNDS["zero_adv_last"] == FRACTION and RUN_METRIC_BOUNDS["entropy_slope"] == (None, None)
    assert mean_interval([0.1, 0.9, 0.1], (0.0, None)).low == 0.0  # entropy-like: no upper bound, none below 0
    assert interval_missing(cut) is None
    assert interval_missing(mean_interval([0.4, 0.6])) == "n=2: no interval"
    assert interval_missing(mean_interval([0.5, 0.5, 0.5])) == "all 3 seeds tied: no spread to measure"
    assert interval_missing(mean_interval([0.5])) == "n=1: no interval"
    d = paired_difference({0: 1.0, 1: 0.9, 2: 0.2}, {0: 0.0, 1: 0.0, 2: 0.0}, FRACTION)
    assert d.high == 1.0 and d.low < 0  # a difference of fractions lies in [-1, 1]


def test_the_cli_says_plainly_when_there_is_no_interval():
    from rich.console import Console

    from qae_app.analysis.run_comparison import compare_runs
    from qae_app.cli.views import compare_view

    runs = [_record("two-0", 0, 0.5), _record("two-1", 1, 0.7)]
    runs += [_record(f"tie-{s}", s, 0.6, lr=1e-4) for s in range(3)]
    console = Console(width=120, record=True)
    console.print(compare_view(compare_runs(runs), 120))
    text = console.export_text()
    assert "n=2: no interval" in text and "all 3 seeds tied: no spread to measure" in text
    assert "[0.600, 0.600]" not in text and "12.71" not in text
