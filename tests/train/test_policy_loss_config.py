"""--policy-loss and the entropy controls as a user meets them: one clear message for each bad input (exit 2, nothing
written), the same options from a TOML file, the stored config (a loss's options stored only for its own loss), the
help, `qae show`, and a run stored before the option existed resuming as the clip run it was."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.core.policy_losses import AS_BEFORE_THE_OPTIONS, OPTIONS, POLICY_LOSSES
from qae_app.store.reader import read_steps
from qae_app.store.run_folder import db_path
from qae_app.train.session import resume_config
from qae_app.train.trainer import Trainer
from tests.bad_input import assert_one_message_exit_2_and_nothing_written
from tests.conftest import TINY_RUN_OPTIONS
from tests.same_steps import assert_same_metrics

runner = CliRunner()

BAD_VALUES = [
    # an unknown loss, listing the known ones
    (
        ["train", "--policy-loss", "vanilla"],
        "policy-loss: unknown value 'vanilla'. Choose one of: clip, clip_cov, kl_cov, gspo, cispo.",
    ),
    # a loss option without its loss
    (
        ["train", "--clip-cov-ratio", "0.01"],
        "clip-cov-ratio: 0.01 is an option of --policy-loss clip_cov, and this "
        "run's loss is clip, so it would change nothing",
    ),
    (
        ["train", "--policy-loss", "gspo", "--kl-cov-coef", "2"],
        "kl-cov-coef: 2.0 is an option of --policy-loss kl_cov, and this run's loss is gspo",
    ),
    (
        ["train", "--policy-loss", "kl_cov", "--clip-high", "0.3"],
        "clip-high: 0.3 is an option of --policy-loss clip and clip_cov, and this run's loss is kl_cov",
    ),
    (["train", "--gspo-clip-low", "0.001"], "gspo-clip-low: 0.001 is an option of --policy-loss gspo"),
    (["train", "--cispo-weight-cap", "3"], "cispo-weight-cap: 3.0 is an option of --policy-loss cispo"),
    (
        ["train", "--entropy-coef-delta", "0.01"],
        "entropy-coef-delta: 0.01 acts only with --entropy-target, which is unset",
    ),
    # a ratio outside (0, 1]
    (
        ["train", "--policy-loss", "clip_cov", "--clip-cov-ratio", "0"],
        "clip-cov-ratio: 0.0 must be more than 0.0. Use a share of tokens in (0, 1]",
    ),
    (["train", "--policy-loss", "clip_cov", "--clip-cov-ratio", "1.5"], "clip-cov-ratio: 1.5 is more than 1.0"),
    (["train", "--policy-loss", "kl_cov", "--kl-cov-ratio", "-0.1"], "kl-cov-ratio: -0.1 must be more than 0.0"),
    (["train", "--policy-loss", "kl_cov", "--kl-cov-ratio", "nan"], "kl-cov-ratio: nan is not a finite number"),
    (
        ["train", "--top-entropy-quantile", "0"],
        "top-entropy-quantile: 0.0 must be more than 0.0. Use a share of tokens in (0, 1], e.g. 0.2",
    ),
    (["train", "--top-entropy-quantile", "2"], "top-entropy-quantile: 2.0 is more than 1.0"),
    # GSPO with an aggregation it does not define
    (
        ["train", "--policy-loss", "gspo", "--loss-agg", "token"],
        "loss-agg: token is not defined for --policy-loss gspo, which defines only seq_mean_token_mean",
    ),
    # the rules that tie a loss's options together
    (
        ["train", "--policy-loss", "clip_cov", "--clip-cov-lb", "5", "--clip-cov-ub", "1"],
        "clip-cov-lb / clip-cov-ub: 5.0 / 1.0. Clip-Cov picks tokens whose covariance lies between them",
    ),
    (
        ["train", "--entropy-target", "1", "--entropy-coef", "0.5", "--entropy-coef-max", "0.1"],
        "entropy-coef: 0.5 must start inside [entropy-coef-min, entropy-coef-max] = [0.0, 0.1]",
    ),
    (["train", "--entropy-coef", "-0.1"], "entropy-coef: -0.1 is less than 0.0"),
    (["train", "--entropy-target", "0"], "entropy-target: 0.0 must be more than 0.0"),
    # from a TOML file: the same messages, naming the file
    (["train", "--config", "{d}/stray.toml"], "clip-cov-ratio: 0.1 is an option of --policy-loss clip_cov"),
    (["train", "--config", "{d}/gspo_token.toml"], "loss-agg: token is not defined for --policy-loss gspo"),
    (["train", "--config", "{d}/unknown_loss.toml"], "policy-loss: unknown value 'ppo'. Choose one of: clip"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES)
def test_a_bad_policy_loss_input_is_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    (tmp_path / "stray.toml").write_text("clip_cov_ratio = 0.1\n")
    (tmp_path / "gspo_token.toml").write_text('[loss]\npolicy_loss = "gspo"\nloss_agg = "token"\n')
    (tmp_path / "unknown_loss.toml").write_text('policy_loss = "ppo"\n')
    assert_one_message_exit_2_and_nothing_written(tmp_path, args, message)


def test_a_loss_s_options_come_from_toml_and_are_stored_for_its_own_loss_only(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[policy]\npolicy-loss = "kl_cov"\nkl_cov_ratio = 0.01\ntop_entropy_quantile = 0.2\nentropy_target = 0.9\n'
    )
    cfg = build_config(toml)
    stored = cfg.to_dict()
    assert (stored["policy_loss"], stored["kl_cov_ratio"], stored["kl_cov_coef"]) == ("kl_cov", 0.01, 1.0)
    assert (stored["top_entropy_quantile"], stored["entropy_target"], stored["entropy_coef_delta"]) == (0.2, 0.9, 0.005)
    assert stored["loss_agg"] == "token"
    others = [o.name for name, r in POLICY_LOSSES.items() if name != "kl_cov" for o in r.options]
    assert all(stored[name] is None for name in others)  # (clip_low and clip_high too: kl_cov clips nothing)
    gspo = build_config(policy_loss="gspo").to_dict()
    assert (gspo["loss_agg"], gspo["gspo_clip_low"], gspo["gspo_clip_high"]) == ("seq_mean_token_mean", 3e-4, 4e-4)
    clip = build_config().to_dict()
    assert {key: clip[key] for key in AS_BEFORE_THE_OPTIONS} == AS_BEFORE_THE_OPTIONS
    assert (clip["clip_low"], clip["clip_high"], clip["loss_agg"]) == (0.2, 0.28, "token")


def test_the_help_names_each_loss_and_option_with_its_source():
    result = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    for name in POLICY_LOSSES:
        assert f"{name}:" in text
    for name in OPTIONS:
        assert f"--{name.replace('_', '-')}" in text
    assert "Qwen2.5-7B" in text and "Zheng et al. 2025" in text and "Beyond the 80/20 Rule" in text


def test_a_run_stored_before_the_option_resumes_as_the_clip_run_it_was(tmp_path):
    """A run whose config.json has none of the keys (an earlier qae wrote it) resumes with the clip loss: the same
    rows and the same weights as the uninterrupted run, and `qae show` says `loss clip`."""
    opts = dict(TINY_RUN_OPTIONS, eval_every=0, checkpoint_every=2, steps=4)
    Trainer(build_config(run_name="full", **opts), tmp_path, cpu=True).fit()
    Trainer(build_config(run_name="old", **dict(opts, steps=2)), tmp_path, cpu=True).fit()
    config_file = tmp_path / "old" / "config.json"
    stored = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({k: v for k, v in stored.items() if k not in AS_BEFORE_THE_OPTIONS}))
    cfg = resume_config(tmp_path, "old", steps=4)
    assert (cfg.policy_loss, cfg.clip_low, cfg.clip_high, cfg.loss_agg) == ("clip", 0.2, 0.28, "token")
    Trainer(cfg, tmp_path, resume=True, cpu=True).fit()
    full, old = (read_steps(db_path(tmp_path, name)).set_index("step") for name in ("full", "old"))
    assert old.index.tolist() == [1, 2, 3, 4]
    assert_same_metrics(full, old)
    weights = [
        load_file(tmp_path / name / "checkpoints" / "step-4" / "model" / "model.safetensors")
        for name in ("full", "old")
    ]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    shown = runner.invoke(app, ["show", "old", "--runs-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert "qae K=0.4 · loss clip · model" in shown.output


def test_show_names_the_run_s_loss_and_its_options(tmp_path):
    Trainer(
        build_config(run_name="gspo", **dict(TINY_RUN_OPTIONS, eval_every=0, steps=1, policy_loss="gspo")),
        tmp_path,
        cpu=True,
    ).fit()
    shown = " ".join(
        runner.invoke(app, ["show", "gspo", "--runs-dir", str(tmp_path)], env={"COLUMNS": "200"}).output.split()
    )
    assert "· loss gspo ·" in shown and "gspo_clip_low = 0.0003" in shown
    assert 'loss_agg = "seq_mean_token_mean"' in shown


def test_compare_groups_a_run_from_before_the_option_with_today_s_clip_runs():
    from qae_app.analysis.run_comparison import group_key

    today = json.loads(json.dumps(build_config().to_dict()))  # (as config.json stores it)
    before = {key: value for key, value in today.items() if key not in AS_BEFORE_THE_OPTIONS}
    assert group_key(before) == group_key(today)
    assert group_key(json.loads(json.dumps(build_config(policy_loss="kl_cov").to_dict()))) != group_key(today)
    assert group_key({**today, "entropy_coef": 0.001}) != group_key(today)


def test_the_adapted_entropy_coefficient_resumes_where_the_run_left_it(tmp_path):
    """--entropy-target moves the coefficient after each optimizer step (2 a step here, +0.005 each: the entropy stays
    below 9); the checkpoint's trainer_state.json keeps it, as JSON, so a resumed run goes on from there."""
    opts = dict(
        prompts_per_step=2,
        group_size=4,
        num_mini_batches=2,
        eval_every=0,
        checkpoint_every=1,
        seed=1,
        entropy_coef=0.01,
        entropy_target=9.0,
    )
    Trainer(build_config(run_name="full", steps=3, **opts), tmp_path, cpu=True).fit()
    Trainer(build_config(run_name="cut", steps=2, **opts), tmp_path, cpu=True).fit()
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.03) and 0 < state["entropy_measured"] <= 9
    Trainer(resume_config(tmp_path, "cut", steps=3), tmp_path, resume=True, cpu=True).fit()
    full, cut = (read_steps(db_path(tmp_path, name)).set_index("step") for name in ("full", "cut"))
    assert full["entropy_coef"].tolist() == pytest.approx([0.02, 0.03, 0.04])
    assert cut["entropy_coef"].tolist() == pytest.approx([0.02, 0.03, 0.04])
    assert_same_metrics(full, cut)
