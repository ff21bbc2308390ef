"""What tells runs apart (issue 39): each run's options that differ from the default or from the other runs shown,
as `qae runs`, the Runs table and the dashboard's sidebar show them. Configs as `qae train` stores them
(`TrainConfig.to_dict()`), each case worked out by hand."""

from __future__ import annotations

from qae_app.analysis.differences import Differences, options_text, what_differs
from qae_app.config import TrainConfig, build_config


def stored(**options) -> dict:
    """A run's config as `qae train` stores it: every option, the given ones set (built-in task defaults applied)."""
    return build_config(**options).to_dict()


def test_two_runs_with_different_switches_are_told_apart():
    """The issue's case: `--log-entropy-attribution` and `--dynamic-sampling` listed identically."""
    apart = what_differs([stored(dynamic_sampling=True), stored(log_entropy_attribution=True)])
    assert apart == Differences(shared=[], per_run=[[("dynamic_sampling", True)], [("log_entropy_attribution", True)]])
    assert [options_text(options) for options in apart.per_run] == ["dynamic_sampling", "log_entropy_attribution"]


def test_a_sweep_shares_its_options_once_and_each_run_names_its_seed_and_estimator():
    """A sweep: QAE K=0.4 and GRPO, seeds 0 and 1, all at --lr 1e-5 and --steps 20. Shared and not the default: lr
    and steps (once, not per run); what varies: estimator and seed (the default seed 0 too: it tells the runs apart);
    GRPO does not use K, so its K is never named; the sweep's id and name only label the runs."""
    common = dict(lr=1e-5, steps=20, sweep_id="0123456789", sweep_name="grid")
    configs = [
        stored(estimator="qae", k="0.4", seed=0, run_name="grid-qae-s0", **common),
        stored(estimator="qae", k="0.4", seed=1, run_name="grid-qae-s1", **common),
        stored(estimator="grpo", seed=0, run_name="grid-grpo-s0", **common),
        stored(estimator="grpo", seed=1, run_name="grid-grpo-s1", **common),
    ]
    apart = what_differs(configs)
    assert apart.shared == [("steps", 20), ("lr", 1e-5)]
    assert apart.per_run == [
        [("estimator", "qae"), ("seed", 0)],
        [("estimator", "qae"), ("seed", 1)],
        [("estimator", "grpo"), ("seed", 0)],
        [("estimator", "grpo"), ("seed", 1)],
    ]
    assert options_text(apart.shared) == "steps=20, lr=1e-05"
    # a view that shows the estimator in a column of its own leaves it out
    assert what_differs(configs, leave_out={"estimator", "steps"}).per_run[2] == [("seed", 0)]


def test_k_varies_only_among_runs_that_use_it():
    apart = what_differs([stored(k="0.3"), stored(k="0.5"), stored(estimator="grpo")])
    assert apart.per_run == [
        [("estimator", "qae"), ("k", "0.3")],
        [("estimator", "qae"), ("k", "0.5")],
        [("estimator", "grpo")],
    ]


def test_one_run_shows_what_differs_from_the_default():
    apart = what_differs([stored(dynamic_sampling=True, group_size=8, temperature=0.7)])
    assert apart == Differences(
        shared=[], per_run=[[("group_size", 8), ("temperature", 0.7), ("dynamic_sampling", True)]]
    )
    assert options_text(apart.per_run[0]) == "group_size=8, temperature=0.7, dynamic_sampling"
    assert what_differs([stored()]).per_run == [[]]  # `qae train` with no option: nothing to say


def test_a_task_s_own_model_and_length_and_resolved_defaults_are_not_differences():
    """`--data builtin:chain` picks its own model and response length, and the sampler's dtype and correction are
    resolved from other options: none of them is an option the user set."""
    apart = what_differs([stored(data="builtin:chain"), stored(data="builtin:chain", dtype="bfloat16", lr=1e-3)])
    assert apart.shared == [("data", "builtin:chain")]
    # (rollout_dtype follows dtype: it varies too, but each run's is its own default, so it is not named)
    assert apart.per_run == [[("dtype", "float32"), ("lr", 5e-5)], [("dtype", "bfloat16"), ("lr", 1e-3)]]
    assert [TrainConfig(**config).rollout_dtype for config in ({"dtype": "float32"}, {"dtype": "bfloat16"})] == [
        "float32",
        "bfloat16",
    ]


def test_an_option_an_older_run_lacks_counts_as_its_default_and_unreadable_runs_count_for_nothing():
    """A config without newer keys trained with their defaults; a run without a training config (None: unreadable, or
    a `qae eval` run) says nothing and does not make the others' options vary."""
    old = {"steps": 20, "group_size": 4, "k": 0.4, "seed": 0, "estimator": "qae"}  # as an early version stored it
    new = stored(steps=20, group_size=4, seed=0)
    apart = what_differs([old, None, new])
    assert apart == Differences(shared=[("steps", 20), ("group_size", 4)], per_run=[[], [], []])
    # values compare as numbers: a K stored as 0.4 is the default "0.4"; 1 and 1.0 are the same
    assert what_differs([{"k": 0.4, "temperature": 1}, {"k": "0.4", "temperature": 1.0}]).per_run == [[], []]


def test_options_text_says_each_value_compactly():
    assert (
        options_text(
            [
                ("dynamic_sampling", True),
                ("vllm_sleep", False),
                ("eval_limit", None),
                ("lr", 0.0001),
                ("reward", ["math", "r.py:fmt"]),
                ("system_prompt", "Be brief."),
            ]
        )
        == "dynamic_sampling, vllm_sleep=false, eval_limit=none, lr=0.0001, reward=math+r.py:fmt, "
        'system_prompt="Be brief."'
    )
    long = "Solve: {question}" * 10
    assert options_text([("prompt_template", long)]) == f'prompt_template="{long[:60]}… (170 characters)"'
