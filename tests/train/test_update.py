"""The update step exactly as claimed: the gated skip changes nothing (to float64 rounding, all-gated mini-batches
included), the mini-batch count is the one asked for, and the new per-step metrics mean what they say. The last tests
call `update.policy_update` on tensors with a 2-layer model: no run folder, no trainer."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.store.rows import step_metrics
from qae_app.train import update
from qae_app.train.entropy_change import entropy_change
from qae_app.train.trainer import Trainer


def _two_steps(tmp_path, monkeypatch, skip: bool, **opts):
    """Parameters, per-step metrics and how many mini-batches took a forward/backward, after 2 real RL steps of a
    float64 copy of the built-in model."""
    cfg = build_config(run_name=f"skip-{skip}", steps=2, eval_every=0, checkpoint_every=0, seed=3, **opts)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.model.double()
    trainer.skip_gated = skip
    backward_passes = []
    accumulate = update.accumulate_gradients
    monkeypatch.setattr(
        update, "accumulate_gradients", lambda *a, **kw: (backward_passes.append(1), accumulate(*a, **kw))[1]
    )
    try:
        metrics = [trainer.train_step(step).metrics for step in (1, 2)]
    finally:
        trainer.close()
    return [p.detach().clone() for p in trainer.model.parameters()], metrics, len(backward_passes)


def test_skipping_gated_sequences_gives_the_dense_update(tmp_path, monkeypatch):
    """16 mini-batches of 8 responses: with ~80% gated, several mini-batches have only zero advantages. The dense
    update still steps AdamW on them (its moments move the weights), so the skip must too.

    Equal to float64 rounding, not bit for bit: the dense matmuls sum the gated rows' exact zeros too, and where the
    BLAS splits a sum depends on the matrix shapes and the CPU (on an AVX2 machine the parameters differed by 1.4e-17
    after 2 steps). A real difference (a mini-batch's gradient missed or normalized by the wrong count) is 1e-6 or
    more."""
    skip_params, skip_metrics, skip_passes = _two_steps(tmp_path, monkeypatch, True, num_mini_batches=16)
    dense_params, dense_metrics, dense_passes = _two_steps(tmp_path, monkeypatch, False, num_mini_batches=16)
    assert dense_passes == 32 and skip_passes < dense_passes  # all-gated mini-batches happened and were skipped
    for skip, dense in zip(skip_params, dense_params, strict=True):
        torch.testing.assert_close(skip, dense, rtol=1e-12, atol=1e-15)
    for skip, dense in zip(skip_metrics, dense_metrics, strict=True):
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
        trainer.close()


def test_more_mini_batches_than_responses_is_refused():
    with pytest.raises(QAEUserError, match="num-mini-batches: 129 is more than the 128 responses"):
        build_config(num_mini_batches=129)


def test_zero_advantage_fraction_over_informative_groups():
    """frac_zero_adv counts the no-signal groups too; the paper's ~80% is over informative groups only."""

    def rollouts(regime, advantages):
        return [
            {
                "regime": regime,
                "advantage": a,
                "reward": float(a > 0),
                "correct": a > 0,
                "verified": True,
                "n_tokens": 2,
                "entropy": 0.5,
                "logprob": -1.0,
                "truncated": False,
                "filtered": False,
            }
            for a in advantages
        ]

    rows = (
        rollouts("all_correct", [0.0] * 4)
        + rollouts("hard", [1.5, 0.0, 0.0, 0.0])
        + rollouts("easy", [0.0, 0.0, -1.5, 0.0])
    )
    groups = [{"regime": r, "filtered": False} for r in ("all_correct", "hard", "easy")]
    metrics = step_metrics(groups, rows)
    assert metrics["frac_zero_adv"] == 10 / 12
    assert metrics["frac_zero_adv_informative"] == 6 / 8
    assert math.isnan(
        step_metrics([{"regime": "all_wrong", "filtered": False}], rollouts("all_wrong", [0.0] * 4))[
            "frac_zero_adv_informative"
        ]
    )


def test_entropy_change_per_regime_against_a_hand_computation(tmp_path):
    """dH, dH_hard, dH_easy on a fixed batch of 2 prompts x 2 responses, against the entropies computed by hand from
    the model's logits before and after a change of the weights."""
    from qae_app.engines.base import Sample

    cfg = build_config(
        run_name="dh", steps=1, prompts_per_step=2, group_size=4, eval_every=0, k="0.4", log_entropy_delta=True
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        codec = trainer.codec
        texts = [("3+4=", ["7", "8", "1", "12"]), ("2*9=", ["18", "18", "18", "81"])]
        samples = [
            Sample(b, codec.encode(prompt), codec.encode(r)[1:] + [codec.eos_id], r, False)
            for b, (prompt, responses) in enumerate(texts)
            for r in responses
        ]
        batch = update.pack(samples, codec.pad_id, "cpu")
        rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
        n = len(samples)
        rows = torch.arange(n)
        options = trainer.update_options()
        _, before = update.logprobs_in_chunks(trainer.model, batch, rows, options, with_entropy=True)
        with torch.no_grad():  # a visible change of the weights, as an update would make
            for p in trainer.model.parameters():
                p.mul_(1.05)
        change = entropy_change(trainer.model, batch, before, rewards, 0.4, 4, options)

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
        trainer.close()


def test_log_probs_from_the_logits_of_response_positions_only_equal_the_full_forward(tmp_path):
    """The vocabulary projection runs from the earliest response position on (`logits_to_keep`): every response
    token's log-prob and entropy is the full forward's, bit for bit in float64, and the prompt positions are 0."""
    cfg = build_config(run_name="keep", steps=1, eval_every=0, checkpoint_every=0, seed=3)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.model.double()
    try:
        prompts = [trainer.task.prompt(p) for p in trainer.task.train[:3]]
        batch = update.pack(trainer.engine.generate(prompts, 4, 1.0, 8, seed=0), trainer.codec.pad_id, "cpu")
        rows = torch.arange(batch["input_ids"].shape[0])
        options = trainer.update_options()
        assert options.logits_keyword in ("logits_to_keep", "num_logits_to_keep")  # (by transformers version)
        kept_logp, kept_entropy = update.forward_logprobs(trainer.model, batch, rows, options)
        full = dataclasses.replace(options, logits_keyword=None)  # the full forward
        full_logp, full_entropy = update.forward_logprobs(trainer.model, batch, rows, full)
    finally:
        trainer.close()
    response = batch["response_mask"].bool()
    first = int(response.float().argmax(-1).min())
    assert first > 0  # the prompts' positions were left out
    assert torch.equal(kept_logp[response], full_logp[response])
    assert torch.equal(kept_entropy[response], full_entropy[response])
    assert not kept_logp[:, :first].any() and not kept_entropy[:, :first].any()


# ---------------------------------------------------------------------------------------------------------------
# update.policy_update on tensors: no run folder, no trainer


class TwoLayerLM(torch.nn.Module):
    """A 2-layer causal LM in float64 (embedding, tanh, vocabulary projection), called as the update calls a
    transformers model: input_ids, attention_mask, use_cache, logits_to_keep -> .logits. Counts the rows it runs."""

    def __init__(self, vocab: int = 6, width: int = 4):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        self.double()
        self.rows_run = 0

    def forward(self, input_ids, attention_mask=None, use_cache=False, logits_to_keep=0):
        self.rows_run += input_ids.shape[0]
        logits = self.head(torch.tanh(self.embed(input_ids)))  # (N, T, vocab)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


# (prompt ids, response ids) of six responses of different lengths; token 0 is also the padding
SEQUENCES = [
    ([1, 2], [3, 4, 0]),
    ([1, 3], [5]),
    ([2], [4, 4, 2, 0]),
    ([1, 2], [5, 0]),
    ([3, 3, 1], [2, 0]),
    ([2, 5], [1, 1, 0]),
]
ADVANTAGES = torch.tensor([1.2, 0.0, -0.8, 0.0, 0.5, 0.0], dtype=torch.float64)  # half gated, as QAE leaves them


def _batch():
    samples = [SimpleNamespace(prompt_ids=p, response_ids=r) for p, r in SEQUENCES]
    return update.pack(samples, pad_id=0, device="cpu", float_dtype=torch.float64)


def _options(**changes):
    options = update.UpdateOptions(
        num_mini_batches=1,
        ppo_epochs=1,
        micro_batch_size=2,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token",
        kl_beta=0.0,
        max_grad_norm=1e9,
        max_new_tokens=4,
        temperature=1.0,
        logits_keyword="logits_to_keep",
    )
    return dataclasses.replace(options, **changes)


def test_the_update_on_tensors_is_a_hand_written_clipped_policy_gradient_step():
    """Two epochs of one mini-batch with plain SGD, against the clipped policy gradient written out by hand: epoch 1
    at the sampling weights (ratio 1), epoch 2 after a step large enough that the clip binds on some tokens. The
    update forwards only the non-gated responses, in micro-batches of 2, with logits for the response positions
    only; the hand version forwards everything at once, and normalizes by every response token."""
    lr = 1.0
    model, reference = TwoLayerLM(), TwoLayerLM()
    batch = _batch()
    mask = batch["response_mask"]
    targets = batch["input_ids"][:, 1:]
    result = update.policy_update(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        batch,
        ADVANTAGES,
        _options(ppo_epochs=2),
        accelerator=None,
        seed=0,
    )

    def logprobs(net):  # (N, T-1)
        return (
            torch.log_softmax(net(input_ids=batch["input_ids"]).logits[:, :-1], -1)
            .gather(-1, targets[..., None])
            .squeeze(-1)
        )

    with torch.no_grad():
        sampling_logp = logprobs(reference)
    clipped_tokens = 0
    for _ in range(2):
        ratio = torch.exp(logprobs(reference) - sampling_logp)  # (N, T-1)
        A = ADVANTAGES[:, None]
        per_token = torch.maximum(-A * ratio, -A * ratio.clamp(1 - 0.2, 1 + 0.28))
        loss = (per_token * mask).sum() / mask.sum()
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads, strict=True):
                p -= lr * g
            clipped_tokens += int((((ratio < 0.8) & (A < 0)) | ((ratio > 1.28) & (A > 0)))[mask.bool()].sum())

    assert clipped_tokens > 0  # the clip bound in epoch 2: the test checks the clipped branch too
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert result.stats["n_updates"] == 2
    assert result.stats["clip_frac"] == pytest.approx(clipped_tokens / (2 * mask.sum().item()))
    assert result.old_logp is None and result.entropy is None  # no full pass was asked for


def test_the_gated_skip_on_tensors_gives_the_dense_update_and_forwards_fewer_rows():
    """Three mini-batches of two, two epochs, AdamW, two of the six mini-batches all gated: the update that leaves
    the gated responses out (and computes no gradient at all for an all-gated mini-batch, yet steps AdamW) equals the
    dense one, and runs fewer rows through the model."""
    options = _options(num_mini_batches=3, ppo_epochs=2)
    plan = update.mini_batch_plan(len(ADVANTAGES), 1, options, update.OneProcess("cpu"), "cpu")
    assert [bool((ADVANTAGES[ix] == 0).all()) for _, mine in plan for ix in mine].count(True) == 2  # (seed 1)
    runs = {}
    for skip in (True, False):
        model = TwoLayerLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        result = update.policy_update(
            model, optimizer, _batch(), ADVANTAGES, dataclasses.replace(options, skip_gated=skip), seed=1
        )
        runs[skip] = ([p.detach().clone() for p in model.parameters()], result.stats, model.rows_run)
    (skip_params, skip_stats, skip_rows), (dense_params, dense_stats, dense_rows) = runs[True], runs[False]
    assert skip_rows < dense_rows
    for got, want in zip(skip_params, dense_params, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    assert skip_stats == pytest.approx(dense_stats, rel=1e-12, abs=1e-15)
    assert skip_stats["n_updates"] == 6


def test_grad_norm_under_deepspeed_is_read_from_its_engine_after_the_step():
    """accelerate's clip_grad_norm_ returns None under DeepSpeed (DeepSpeed clips inside its step); float(None)
    crashed the update. DeepSpeed is not installed here (it needs a GPU to run the project's configs), so its engine
    wrapper is stood in for by an object with the one method accelerate's wrapper has."""
    import math

    from accelerate import Accelerator

    from qae_app.train.update import grad_norm_value

    class EngineAfterStep:
        def get_global_grad_norm(self):
            return 2.5

    class DeepSpeedAccelerator:
        deepspeed_engine_wrapped = EngineAfterStep()

    assert grad_norm_value(None, DeepSpeedAccelerator()) == 2.5
    assert math.isnan(grad_norm_value(None, Accelerator(cpu=True)))  # no engine: not measured, not a crash
    assert grad_norm_value(torch.tensor(0.75), Accelerator(cpu=True)) == 0.75
