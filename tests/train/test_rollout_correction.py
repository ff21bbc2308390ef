"""The sampler-trainer mismatch and --rollout-correction: with the same numbers on both sides the tis weights are
exactly 1 and the update is the uncorrected one bit for bit; a bfloat16 hf sampler beside a float32 trainer stores a
mismatch above 0; the defaults resolve once, into the stored config."""

import dataclasses
import math

import pytest
import torch

from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.train import update
from qae_app.train.trainer import Trainer
from tests.train.test_update import ADVANTAGES, TwoLayerLM, _batch, _options


def _update_with_sampler_logp(correction: str, sampler_logp: torch.Tensor):
    model = TwoLayerLM()
    batch = {**_batch(), "sampler_logp": sampler_logp}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    result = update.policy_update(
        model,
        optimizer,
        batch,
        ADVANTAGES,
        _options(num_mini_batches=2, ppo_epochs=2, rollout_correction=correction),
        seed=1,
        full_pass=True,
    )
    return [p.detach().clone() for p in model.parameters()], result.stats


def _trainer_logp() -> torch.Tensor:
    """(N, T-1) the old log-probs the update's full pass computes: the same function, rows and weights."""
    options = _options(num_mini_batches=2, ppo_epochs=2)
    return update.logprobs_in_chunks(TwoLayerLM(), _batch(), torch.arange(len(ADVANTAGES)), options, with_entropy=True)[
        0
    ]


def test_tis_with_the_trainers_own_numbers_is_the_uncorrected_update_bit_for_bit():
    sampler = _trainer_logp() * _batch()["response_mask"]  # (as pack lays them out: 0 off the response)
    none_params, none_stats = _update_with_sampler_logp("none", sampler)
    tis_params, tis_stats = _update_with_sampler_logp("tis", sampler)
    assert all(torch.equal(a, b) for a, b in zip(none_params, tis_params, strict=True))
    assert none_stats == tis_stats
    assert (tis_stats["mismatch_logp_abs"], tis_stats["mismatch_k3_kl"], tis_stats["mismatch_ratio_max"]) == (
        0.0,
        0.0,
        1.0,
    )


def test_tis_reweights_the_update_when_the_sampler_differs():
    """A sampler 0.1 nats less sure of every token: every weight is e^0.1 (under the cap), so the update differs; the
    stored mismatch is |d| = 0.1, k3 = e^0.1 - 1.1, max ratio e^0.1, over the non-gated responses' tokens."""
    mask = _batch()["response_mask"]
    sampler = (_trainer_logp() - 0.1) * mask
    none_params, none_stats = _update_with_sampler_logp("none", sampler)
    tis_params, tis_stats = _update_with_sampler_logp("tis", sampler)
    assert not all(torch.equal(a, b) for a, b in zip(none_params, tis_params, strict=True))
    for stats in (none_stats, tis_stats):  # measured whether corrected or not
        assert stats["mismatch_logp_abs"] == pytest.approx(0.1, abs=1e-12)
        assert stats["mismatch_k3_kl"] == pytest.approx(math.exp(0.1) - 1.1, abs=1e-12)
        assert stats["mismatch_ratio_max"] == pytest.approx(math.exp(0.1), abs=1e-12)


def test_under_a_kl_term_the_mismatch_covers_every_response_even_when_all_are_gated():
    """A step whose every advantage is 0 (each group all right or all wrong): without a KL term no token is weighed and
    the mismatch is NaN (stored NULL); with one, every response's tokens carry the penalty and the mismatch is
    measured over all of them: |d| = 0.1 for a sampler 0.1 nats less sure of every token."""
    mask = _batch()["response_mask"]
    sampler = (_trainer_logp() - 0.1) * mask
    gated = torch.zeros_like(ADVANTAGES)
    for kl_beta, ref_model, expected in ((0.0, None, None), (0.01, TwoLayerLM(), 0.1)):
        model = TwoLayerLM()
        result = update.policy_update(
            model,
            torch.optim.AdamW(model.parameters(), lr=0.05),
            {**_batch(), "sampler_logp": sampler},
            gated,
            _options(kl_beta=kl_beta),
            seed=1,
            ref_model=ref_model,
        )
        measured = result.stats["mismatch_logp_abs"]
        if expected is None:
            assert math.isnan(measured)
        else:
            assert measured == pytest.approx(expected, abs=1e-12)


def test_tis_without_the_samplers_log_probs_is_refused():
    with pytest.raises(QAEUserError, match="rollout-correction: tis"):
        update.policy_update(
            TwoLayerLM(),
            torch.optim.SGD(TwoLayerLM().parameters(), lr=0.1),
            _batch(),
            ADVANTAGES,
            _options(rollout_correction="tis"),
            seed=0,
        )


def test_the_defaults_resolve_once_by_whether_the_sampler_is_the_trainer():
    same = build_config()
    assert (same.rollout_dtype, same.rollout_correction, same.rollout_correction_cap) == ("float32", "none", 2.0)
    assert build_config(rollout_dtype="bfloat16").rollout_correction == "tis"
    assert build_config(mixed_precision="bf16").rollout_correction == "tis"
    vllm = build_config(engine="vllm")
    assert (vllm.rollout_dtype, vllm.rollout_correction) == ("bfloat16", "tis")
    assert build_config(rollout_dtype="bfloat16", rollout_correction="none").rollout_correction == "none"
    stored = dataclasses.replace(build_config(rollout_dtype="bfloat16"))  # (what a resume rebuilds)
    assert stored.to_dict()["rollout_correction"] == "tis"


def test_a_cap_without_the_correction_or_below_1_is_refused():
    with pytest.raises(QAEUserError, match="rollout-correction-cap: 3.0 acts only with --rollout-correction tis"):
        build_config(rollout_correction_cap=3.0)
    with pytest.raises(QAEUserError, match="rollout-correction-cap: 0.5 is less than 1"):
        build_config(rollout_correction="tis", rollout_correction_cap=0.5)


def test_a_bfloat16_hf_sampler_beside_a_float32_trainer_stores_a_mismatch(tmp_path):
    cfg = build_config(
        run_name="bf16",
        steps=1,
        eval_every=0,
        checkpoint_every=0,
        group_size=4,
        prompts_per_step=4,
        seed=1,
        rollout_dtype="bfloat16",
    )
    assert cfg.rollout_correction == "tis"
    with Trainer(cfg, tmp_path, cpu=True) as trainer:
        sampler = trainer.engine.model
        assert next(sampler.parameters()).dtype == torch.bfloat16
        assert next(trainer.model.parameters()).dtype == torch.float32
        metrics = trainer.train_step(1).metrics
        # the sampling copy took the updated weights (rounded to bfloat16)
        for copy, trained in zip(sampler.parameters(), trainer.model.parameters(), strict=True):
            assert torch.equal(copy, trained.detach().to(torch.bfloat16))
    assert metrics["mismatch_logp_abs"] > 0 and metrics["mismatch_k3_kl"] > 0
    assert metrics["mismatch_ratio_max"] > 1


@pytest.mark.slow
def test_two_processes_measure_and_correct_the_one_process_mismatch(tmp_path):
    """Under a real `accelerate launch --num_processes 2`, on the same samples from a bfloat16 sampler: the mismatch
    columns are sums over both processes' tokens (not a mean of per-process means) and the largest ratio of either,
    so they are the one-process numbers, and so is the tis-corrected update."""
    from qae_app.store.reader import read_steps
    from qae_app.store.run_folder import db_path
    from tests.e2e.test_accelerate import SCRIPT, launch
    from tests.same_steps import assert_same_metrics

    for n in (1, 2):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}", "bf16rollout")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (read_steps(db_path(tmp_path, f"p{n}")).set_index("step") for n in (1, 2))
    assert (one["mismatch_logp_abs"] > 0).all() and (one["mismatch_ratio_max"] > 1).all()
    assert_same_metrics(one, two)
    params = [torch.load(tmp_path / f"p{n}.params.pt") for n in (1, 2)]
    for name in params[0]:
        torch.testing.assert_close(params[0][name], params[1][name], atol=1e-6, rtol=0, msg=name)
