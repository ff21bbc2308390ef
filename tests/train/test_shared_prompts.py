"""The training forward with each group's prompt computed once (qae_app/train/shared_prompts.py) gives the full
forward's log-probs, entropies and gradient to float32 rounding, on prompts of different lengths, responses of
different lengths and rows left out of a micro-batch, through the full logits and the chunked head; it declines
where sharing saves nothing; and the trainer's steps with it are the steps without it."""

from __future__ import annotations

import pytest
import torch

from qae_app.config import build_config
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import BUILTIN_MODEL, load_policy
from qae_app.store.reader import read_steps
from qae_app.store.run_folder import db_path
from qae_app.train import shared_prompts
from qae_app.train.trainer import Trainer
from qae_app.train.update import UpdateOptions, forward_logprobs, pack
from tests.same_steps import assert_same_metrics


def test_prompt_groups_the_common_opening_and_the_tokens_spared_by_hand(monkeypatch):
    ids = torch.tensor([[5, 6, 7, 1, 0], [5, 6, 7, 2, 2], [5, 6, 9, 3, 0], [5, 6, 7, 4, 0]])
    assert shared_prompts.prompt_groups(ids, torch.tensor([3, 3, 3, 3])) == ([[5, 6, 7], [5, 6, 9]], [0, 0, 1, 0])
    assert shared_prompts.prompt_groups(ids, torch.tensor([2, 2, 2, 2])) == ([[5, 6]], [0, 0, 0, 0])
    monkeypatch.setattr(shared_prompts, "COMMON_OPENING_MIN", 2)
    assert shared_prompts.common_opening([[5, 6, 7], [5, 6, 9]]) == 2
    assert shared_prompts.common_opening([[5, 6, 7], [5, 6]]) == 0  # at most the shortest's length - 1: under 2
    assert shared_prompts.common_opening([[5, 6, 7]]) == 0  # one prompt: its group shares it already
    monkeypatch.setattr(shared_prompts, "COMMON_OPENING_MIN", 3)
    assert shared_prompts.common_opening([[5, 6, 7, 1], [5, 6, 9, 1]]) == 0
    # rows' prompts but their last token: 3 x 2 + 2 = 8; computed: the opening 2 once, the rests 0 and 0
    assert shared_prompts.spared_tokens([[5, 6, 7], [5, 6, 9]], [0, 0, 1, 0], 2) == 8 - 2
    assert shared_prompts.spared_tokens([[5, 6, 7], [5, 6, 9]], [0, 0, 1, 0], 0) == 8 - 4


def options(share: bool, chunk: int) -> UpdateOptions:
    return UpdateOptions(
        num_mini_batches=1,
        ppo_epochs=1,
        micro_batch_size=64,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token",
        kl_beta=0.0,
        max_grad_norm=1.0,
        max_new_tokens=12,
        temperature=0.7,
        logits_keyword="logits_to_keep",
        logprob_chunk_tokens=chunk,
        share_prompts=share,
    )


@pytest.mark.parametrize(
    "chunk, opening", [(0, 99), (7, 99), (0, 3)], ids=["full-logits", "chunked-head", "common-opening"]
)
def test_the_shared_forward_is_the_full_forward_to_float32_rounding(chunk, opening, monkeypatch):
    monkeypatch.setattr(shared_prompts, "MIN_SPARED_WORK", 0)  # the built-in model: sharing 9 rows spares too little
    monkeypatch.setattr(shared_prompts, "COMMON_OPENING_MIN", opening)  # 3: "<bos>13" opens every prompt below
    model, codec = load_policy(BUILTIN_MODEL)
    samples = HFGenerateEngine(model, codec).generate(["13+4=", "13*11=", "130-27="], 4, 1.0, 12, seed=3)
    batch = pack(samples, codec.pad_id, "cpu")
    assert len({len(s.prompt_ids) for s in samples}) == 3 and len({len(s.response_ids) for s in samples}) > 2
    rows = torch.tensor([0, 1, 3, 4, 5, 6, 7, 9, 11])  # some rows of each group left out, as the gated skip does
    model.train()
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logp, entropy = forward_logprobs(model, batch, rows, options(share, chunk))  # (9, T-1) each
        mask = batch["response_mask"][rows]
        ((logp * mask).sum() + (entropy * mask).sum() / 10).backward()
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logp * mask, entropy * mask, gradient))
        if share:  # only response positions hold values
            assert torch.equal(logp * mask, logp) and torch.equal(entropy * mask, entropy)
    (logp, entropy, gradient), (shared_logp, shared_entropy, shared_gradient) = results
    assert shared_logp.shape == logp.shape == batch["response_mask"][rows].shape
    torch.testing.assert_close(shared_logp, logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(shared_entropy, entropy, atol=2e-5, rtol=0)
    torch.testing.assert_close(shared_gradient, gradient, atol=1e-5 * float(gradient.abs().max()), rtol=0)
    assert float(gradient.abs().max()) > 0


def test_sharing_declines_where_it_saves_nothing_or_too_little(monkeypatch):
    model, codec = load_policy(BUILTIN_MODEL)
    samples = HFGenerateEngine(model, codec).generate(["3+4=", "12*11="], 2, 1.0, 6, seed=1)
    batch = pack(samples, codec.pad_id, "cpu")
    # rows 0, 1 share "3+4=" (5 tokens with <bos>): the 4 before its last computed once, not twice
    spared = 4 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(shared_prompts, "MIN_SPARED_WORK", spared + 1)
    assert shared_prompts.shared_prompt_logprobs(model, batch, torch.tensor([0, 1]), 1.0, True) is None
    monkeypatch.setattr(shared_prompts, "MIN_SPARED_WORK", spared)
    assert shared_prompts.shared_prompt_logprobs(model, batch, torch.tensor([0, 1]), 1.0, True) is not None
    # distinct prompts without a common opening, and one row: nothing spared
    assert shared_prompts.shared_prompt_logprobs(model, batch, torch.tensor([0, 2]), 1.0, True) is None
    assert shared_prompts.shared_prompt_logprobs(model, batch, torch.tensor([0]), 1.0, True) is None


def test_the_trainers_steps_with_shared_prompts_are_its_steps_without(tmp_path, monkeypatch):
    """Three RL steps of the default run (8 prompts x 16, QAE, 4 mini-batches: the gated skip leaves some of each
    group out) with the prompts shared wherever two rows share one and without: the same samples, losses, gradients
    and metrics, to the rtol the project holds resumed runs to (tests/same_steps.py)."""
    monkeypatch.setattr(shared_prompts, "MIN_SPARED_WORK", 0)
    shared_forwards = []
    share_forward = shared_prompts.shared_prompt_logprobs
    monkeypatch.setattr(
        "qae_app.train.update.shared_prompt_logprobs",
        lambda *a, **kw: (out := share_forward(*a, **kw), shared_forwards.append(out is not None))[0],
    )
    steps = []
    for share in (True, False):
        cfg = build_config(run_name=f"share-{share}", steps=3, eval_every=0, checkpoint_every=0, seed=4)
        trainer = Trainer(cfg, tmp_path, cpu=True)
        assert trainer.share_prompts and trainer.update_options().share_prompts
        trainer.share_prompts = share
        trainer.fit()
        steps.append(read_steps(db_path(tmp_path, f"share-{share}")).set_index("step"))
        if share:
            assert sum(shared_forwards) >= 12  # (3 steps x 4 mini-batches, and the old log-probs' passes)
    assert_same_metrics(steps[1], steps[0])
