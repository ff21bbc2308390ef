"""Every policy loss trains through `qae train` (the built-in model, 2 steps) under every advantage estimator, and with
every other part of the update: --rollout-correction tis, PPO epochs and mini-batches, token budgets, the chunked head,
the entropy controls, LoRA with a KL reference. (DDP and FSDP2: tests/e2e/test_policy_loss_processes.py.)"""

import json
import math

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.policy_losses import POLICY_LOSSES
from qae_app.store.reader import read_steps
from qae_app.store.run_folder import db_path

runner = CliRunner()
TINY = [
    "--steps",
    "2",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--seed",
    "2",
]
# options that make each loss's selection pick tokens in a run this small
PICKING = {"clip_cov": ["--clip-cov-ratio", "0.1", "--clip-cov-lb", "0"], "kl_cov": ["--kl-cov-ratio", "0.1"]}


def train(runs_dir, name: str, *options: str):
    result = runner.invoke(
        app, ["train", "--run-name", name, "--runs-dir", str(runs_dir), *TINY, *options], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    steps = read_steps(db_path(runs_dir, name)).set_index("step")
    assert steps.index.tolist() == [1, 2]
    assert all(math.isfinite(v) for v in steps["loss"]) and (steps["grad_norm"] > 0).any()  # it trained
    return steps, json.loads((runs_dir / name / "config.json").read_text()), result.output


@pytest.mark.slow
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_every_loss_trains_under_every_estimator(tmp_path, loss, estimator):
    steps, config, _ = train(
        tmp_path, f"{loss}-{estimator}", "--policy-loss", loss, "--estimator", estimator, *PICKING.get(loss, [])
    )
    assert (config["policy_loss"], config["estimator"]) == (loss, estimator)
    if loss in PICKING:
        assert (steps["cov_selected_frac"] > 0).all()


COMPOSED = [
    "--ppo-epochs",
    "2",
    "--num-mini-batches",
    "2",
    "--max-tokens-per-micro-batch",
    "40",
    "--top-entropy-quantile",
    "0.5",
    "--entropy-coef",
    "0.01",
    "--entropy-target",
    "9",
]
# the chunked head in chunks of 3 tokens (its entropy's gradient, for the bonus) and a bfloat16 sampler (so the
# correction is tis): minutes on a CPU, so in the slow set only
SLOW_PARTS = ["--logprob-chunk-tokens", "3", "--rollout-dtype", "bfloat16"]


def test_kl_cov_trains_with_epochs_token_budgets_and_the_entropy_controls(tmp_path):
    """PPO epochs and mini-batches, token-budget micro-batches, the top-entropy quantile and the adaptive entropy
    bonus at once (the bonus's coefficient: +0.005 per update, the entropy staying below the target 9)."""
    steps, _, _ = train(tmp_path, "kl_cov", "--policy-loss", "kl_cov", *COMPOSED, *PICKING["kl_cov"])
    assert steps["n_updates"].tolist() == [4, 4]
    assert steps["entropy_coef"].tolist() == pytest.approx([0.03, 0.05])


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_every_loss_trains_with_every_other_part_of_the_update(tmp_path, loss):
    """The above, with the chunked head and the bfloat16 sampler's correction (tis), for every loss."""
    steps, config, output = train(tmp_path, loss, "--policy-loss", loss, *COMPOSED, *SLOW_PARTS, *PICKING.get(loss, []))
    assert config["rollout_correction"] == "tis" and config["logprob_chunk_tokens"] == 3
    assert "log-probs from the full logits" not in output  # (the chunked head ran)
    assert steps["n_updates"].tolist() == [4, 4] and steps["entropy_coef"].tolist() == pytest.approx([0.03, 0.05])
    assert steps["mismatch_logp_abs"].notna().all()  # (the sampler's log-probs reached the correction)


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
def test_every_loss_trains_lora_adapters_with_a_kl_reference(tmp_path, loss):
    steps, config, _ = train(
        tmp_path,
        loss,
        "--policy-loss",
        loss,
        "--lora-rank",
        "4",
        "--kl-beta",
        "0.05",
        "--lr",
        "1e-3",
        *PICKING.get(loss, []),
    )
    assert config["lora_rank"] == 4 and (steps["kl"] >= 0).all()
