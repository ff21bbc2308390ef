"""The update step exactly as claimed: the gated skip changes nothing (to float64 rounding, all-gated mini-batches
included), the mini-batch count is the one asked for, and the new per-step metrics mean what they say."""

import math

import pytest
import torch

from qae_app.config import build_config
from qae_app.errors import QAEUserError
from qae_app.rows import step_metrics
from qae_app.trainer import Trainer


def _two_steps(tmp_path, skip: bool, **opts):
    """Parameters, per-step metrics and how many mini-batches took a forward/backward, after 2 real RL steps of a
    float64 copy of the built-in model."""
    cfg = build_config(run_name=f"skip-{skip}", steps=2, eval_every=0, checkpoint_every=0, seed=3, **opts)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.model.double()
    trainer.skip_gated = skip
    backward_passes = []
    accumulate = trainer._accumulate_gradients
    trainer._accumulate_gradients = lambda *a, **kw: (backward_passes.append(1), accumulate(*a, **kw))[1]
    try:
        metrics = [trainer.train_step(step).metrics for step in (1, 2)]
    finally:
        trainer._close_scorers()
        trainer._lock.release()
    return [p.detach().clone() for p in trainer.model.parameters()], metrics, len(backward_passes)


def test_skipping_gated_sequences_gives_the_dense_update(tmp_path):
    """16 mini-batches of 8 responses: with ~80% gated, several mini-batches have only zero advantages. The dense
    update still steps AdamW on them (its moments move the weights), so the skip must too.

    Equal to float64 rounding, not bit for bit: the dense matmuls sum the gated rows' exact zeros too, and where the
    BLAS splits a sum depends on the matrix shapes and the CPU (on an AVX2 machine the parameters differed by 1.4e-17
    after 2 steps). A real difference (a mini-batch's gradient missed or normalized by the wrong count) is 1e-6 or
    more."""
    skip_params, skip_metrics, skip_passes = _two_steps(tmp_path, True, num_mini_batches=16)
    dense_params, dense_metrics, dense_passes = _two_steps(tmp_path, False, num_mini_batches=16)
    assert dense_passes == 32 and skip_passes < dense_passes  # all-gated mini-batches happened and were skipped
    for skip, dense in zip(skip_params, dense_params):
        torch.testing.assert_close(skip, dense, rtol=1e-12, atol=1e-15)
    for skip, dense in zip(skip_metrics, dense_metrics):
        assert skip["n_updates"] == dense["n_updates"] == 16
        for name in ("loss", "pg_loss", "grad_norm", "clip_frac", "clip_frac_low", "clip_frac_high"):
            assert skip[name] == pytest.approx(dense[name], rel=1e-12, abs=1e-15), name


def test_the_step_makes_exactly_the_mini_batches_asked_for(tmp_path):
    """torch.chunk made 43 mini-batches of 128 responses when 48 were asked."""
    cfg = build_config(run_name="mb", steps=1, eval_every=0, checkpoint_every=0, num_mini_batches=48)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        assert trainer.train_step(1).metrics["n_updates"] == 48
    finally:
        trainer._close_scorers()
        trainer._lock.release()


def test_more_mini_batches_than_responses_is_refused():
    with pytest.raises(QAEUserError, match="num-mini-batches: 129 is more than the 128 responses"):
        build_config(num_mini_batches=129)


def test_zero_advantage_fraction_over_informative_groups():
    """frac_zero_adv counts the no-signal groups too; the paper's ~80% is over informative groups only."""
    def rollouts(regime, advantages):
        return [{"regime": regime, "advantage": a, "reward": float(a > 0), "correct": a > 0, "verified": True,
                 "n_tokens": 2, "entropy": 0.5, "logprob": -1.0, "truncated": False, "filtered": False}
                for a in advantages]

    rows = (rollouts("all_correct", [0.0] * 4) + rollouts("hard", [1.5, 0.0, 0.0, 0.0])
            + rollouts("easy", [0.0, 0.0, -1.5, 0.0]))
    groups = [{"regime": r, "filtered": False} for r in ("all_correct", "hard", "easy")]
    metrics = step_metrics(groups, rows)
    assert metrics["frac_zero_adv"] == 10 / 12
    assert metrics["frac_zero_adv_informative"] == 6 / 8
    assert math.isnan(step_metrics([{"regime": "all_wrong", "filtered": False}], rollouts("all_wrong", [0.0] * 4))[
        "frac_zero_adv_informative"])


def test_entropy_change_per_regime_against_a_hand_computation(tmp_path):
    """dH, dH_hard, dH_easy on a fixed batch of 2 prompts x 2 responses, against the entropies computed by hand from
    the model's logits before and after a change of the weights."""
    from qae_app.rollout import Sample

    cfg = build_config(run_name="dh", steps=1, prompts_per_step=2, group_size=4, eval_every=0, k="0.4",
                       log_entropy_delta=True)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        codec = trainer.codec
        texts = [("3+4=", ["7", "8", "1", "12"]), ("2*9=", ["18", "18", "18", "81"])]
        samples = [Sample(b, codec.encode(prompt), codec.encode(r)[1:] + [codec.eos_id], r, False)
                   for b, (prompt, responses) in enumerate(texts) for r in responses]
        batch = trainer._pack(samples)
        rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
        n = len(samples)
        rows = torch.arange(n)
        _, before = trainer._logprobs_in_chunks(trainer.model, batch, rows, True)
        with torch.no_grad():  # a visible change of the weights, as an update would make
            for p in trainer.model.parameters():
                p.mul_(1.05)
        change = trainer._entropy_change(batch, before, rewards)

        with torch.no_grad():  # the same by hand: softmax(logits / T) entropy at each response position
            logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            probs = torch.softmax(logits[:, :-1].double() / cfg.temperature, dim=-1)
            after = -(probs * probs.log()).sum(-1)
        mask = batch["response_mask"].double()
        per_seq = ((after - before.double()) * mask).sum(-1)
        tokens = mask.sum(-1)
        # group 0 (1 of 4 correct, p = 0.25 <= 1 - 0.4): hard; group 1 (3 of 4, p = 0.75 > 0.6): easy
        assert change["dH"] == pytest.approx((per_seq.sum() / tokens.sum()).item(), rel=1e-5)
        assert change["dH_hard"] == pytest.approx((per_seq[:4].sum() / tokens[:4].sum()).item(), rel=1e-5)
        assert change["dH_easy"] == pytest.approx((per_seq[4:].sum() / tokens[4:].sum()).item(), rel=1e-5)
        assert change["dH"] != 0.0 and change["dH_hard"] != change["dH_easy"]
    finally:
        trainer._close_scorers()
        trainer._lock.release()


def test_log_probs_from_the_logits_of_response_positions_only_equal_the_full_forward(tmp_path):
    """The vocabulary projection runs from the earliest response position on (`logits_to_keep`): every response
    token's log-prob and entropy is the full forward's, bit for bit in float64, and the prompt positions are 0."""
    cfg = build_config(run_name="keep", steps=1, eval_every=0, checkpoint_every=0, seed=3)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.model.double()
    try:
        prompts = [trainer.task.prompt(p) for p in trainer.task.train[:3]]
        batch = trainer._pack(trainer.engine.generate(prompts, 4, 1.0, 8, seed=0))
        rows = torch.arange(batch["input_ids"].shape[0])
        assert trainer._logits_keyword in ("logits_to_keep", "num_logits_to_keep")  # (by transformers version)
        kept_logp, kept_entropy = trainer._forward_logprobs(trainer.model, batch, rows)
        trainer._logits_keyword = None  # the full forward
        full_logp, full_entropy = trainer._forward_logprobs(trainer.model, batch, rows)
    finally:
        trainer._close_scorers()
        trainer._lock.release()
    response = batch["response_mask"].bool()
    first = int(response.float().argmax(-1).min())
    assert first > 0  # the prompts' positions were left out
    assert torch.equal(kept_logp[response], full_logp[response])
    assert torch.equal(kept_entropy[response], full_entropy[response])
    assert not kept_logp[:, :first].any() and not kept_entropy[:, :first].any()
