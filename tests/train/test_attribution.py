"""`--log-entropy-attribution`: each column against an update made by hand from that regime's loss alone (float64),
the policy, optimizer and RNG state left exactly as they were, a run's rows unchanged by it, and under
`accelerate launch --num_processes 2` the one-process numbers."""

import copy
import math

import pandas as pd
import pytest
import torch

from qae_app.config import build_config
from qae_app.engines.base import Sample
from qae_app.store.reader import query, read_steps
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS, TIMING_METRICS
from qae_app.train import update
from qae_app.train.entropy_attribution import ATTRIBUTION_METRICS, entropy_attribution
from qae_app.train.optimizer import optimizer_and_schedule
from qae_app.train.trainer import Trainer

# 2 prompts x 4 responses; group 0 (1 of 4 correct, p = 0.25 <= 1 - K): hard; group 1 (3 of 4, p = 0.75): easy
TEXTS = [("3+4=", ["7", "8", "1", "12"]), ("2*9=", ["18", "18", "18", "81"])]
CORRECT = torch.tensor([[True, False, False, False], [True, True, True, False]])
ADVANTAGES = torch.tensor([1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.5], dtype=torch.float64)  # QAE's: 1 push each
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.1, 1.0
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # AdamW's defaults, which optimizer_and_schedule keeps


def test_attribution_names_are_step_columns():
    assert set(ATTRIBUTION_METRICS) <= set(STEP_METRICS)
    assert {
        "dH_from_hard",
        "dH_from_easy",
        "dH_hard_from_hard",
        "dH_easy_from_hard",
        "dH_hard_from_easy",
        "dH_easy_from_easy",
    } <= set(ATTRIBUTION_METRICS)


def _entropies(model, batch, temperature: float) -> torch.Tensor:
    """(N, T-1) token entropy of softmax(logits / T), from the full logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _by_hand(model, optimizer, batch, advantages, temperature):
    """One optimizer step from the loss of the responses with a non-zero `advantages` entry (the others 0, the
    normalizer all tokens): -sum(A * log p) / tokens (the ratio is 1 at the first mini-batch, so the clip is inactive
    and its gradient is A * grad log p), the gradient clipped to MAX_GRAD_NORM, then AdamW written out from the
    optimizer's moments. Returns the stepped copy of the model."""
    trial = copy.deepcopy(model)
    params = list(trial.parameters())
    logits = trial(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"]
    loss = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    grads = [g * min(1.0, MAX_GRAD_NORM / (norm.item() + 1e-6)) for g in grads]
    with torch.no_grad():
        for p, original, g in zip(params, model.parameters(), grads, strict=True):
            state = optimizer.state[original]
            step = float(state["step"]) + 1
            m = BETA1 * state["exp_avg"] + (1 - BETA1) * g
            v = BETA2 * state["exp_avg_sq"] + (1 - BETA2) * g * g
            p.mul_(1 - LR * WEIGHT_DECAY)
            p.sub_(LR * (m / (1 - BETA1**step)) / ((v / (1 - BETA2**step)).sqrt() + EPS))
    return trial


def test_each_attribution_is_the_update_made_by_hand_from_its_regime_alone(tmp_path):
    """float64 built-in model, one mini-batch, AdamW with moments from an earlier step and weight decay (so `none`,
    the drift, is not 0): every column equals the entropy change after the hand-made update from that regime's loss,
    and the weights, optimizer state, gradients and RNG are exactly as before."""
    cfg = build_config(
        run_name="attr",
        steps=1,
        prompts_per_step=2,
        group_size=4,
        eval_every=0,
        k="0.4",
        num_mini_batches=1,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        model = trainer.model.double()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)  # (float64 moments)
        codec = trainer.codec
        samples = [
            Sample(b, codec.encode(prompt), codec.encode(r)[1:] + [codec.eos_id], r, False)
            for b, (prompt, responses) in enumerate(TEXTS)
            for r in responses
        ]
        batch = update.pack(samples, codec.pad_id, "cpu", torch.float64)
        for p in model.parameters():  # an earlier step: moments that move the weights on a zero gradient too
            p.grad = torch.randn_like(p) * 1e-2
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights = [p.detach().clone() for p in model.parameters()]
        moments = {k: v.clone() for k, v in optimizer.state[next(iter(model.parameters()))].items()}
        rng = torch.random.get_rng_state()

        got = entropy_attribution(
            model, optimizer, batch, ADVANTAGES, CORRECT, 0.4, 4, trainer.update_options(), seed=11
        )

        before = _entropies(model, batch, cfg.temperature).double()
        mask = batch["response_mask"]
        parts = {"": slice(0, 8), "hard_": slice(0, 4), "easy_": slice(4, 8)}
        keep = {"hard": torch.arange(8) < 4, "easy": torch.arange(8) >= 4, "none": torch.zeros(8, dtype=torch.bool)}
        for source, kept in keep.items():
            trial = _by_hand(model, optimizer, batch, torch.where(kept, ADVANTAGES, 0.0), cfg.temperature)
            change = ((_entropies(trial, batch, cfg.temperature) - before) * mask).sum(-1)  # (N,)
            for part, rows in parts.items():
                want = (change[rows].sum() / mask[rows].sum()).item()
                assert got[f"dH_{part}from_{source}"] == pytest.approx(want, rel=1e-7, abs=1e-12), (part, source)
        assert got["dH_from_hard"] != got["dH_from_easy"] and got["dH_from_none"] != 0.0
        # restored exactly, and nothing left behind
        for p, w in zip(model.parameters(), weights, strict=True):
            assert torch.equal(p, w) and p.grad is None
        state = optimizer.state[next(iter(model.parameters()))]
        assert all(torch.equal(state[k], v) for k, v in moments.items())
        assert torch.equal(torch.random.get_rng_state(), rng)
    finally:
        trainer.close()


def test_a_regime_with_no_response_gets_null():
    """Only an easy group: nothing to attribute to the hard regime (its columns NULL), the easy ones measured."""
    from qae_app.models.policy import load_policy

    policy, codec = load_policy("builtin:tiny", "float32")
    optimizer, _ = optimizer_and_schedule(list(policy.parameters()), 1e-3, 0.0, 0)
    samples = [
        Sample(0, codec.encode("2*9="), codec.encode(r)[1:] + [codec.eos_id], r, False)
        for r in ("18", "18", "18", "81")
    ]
    batch = update.pack(samples, codec.pad_id, "cpu")
    options = update.UpdateOptions(
        num_mini_batches=1,
        ppo_epochs=1,
        micro_batch_size=64,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token",
        kl_beta=0.0,
        max_grad_norm=1.0,
        max_new_tokens=8,
        temperature=1.0,
    )
    got = entropy_attribution(
        policy, optimizer, batch, torch.tensor([0.0, 0.0, 0.0, -1.5]), CORRECT[1:], 0.4, 4, options, seed=3
    )
    assert all(math.isnan(got[name]) for name in ("dH_from_hard", "dH_hard_from_hard", "dH_easy_from_hard"))
    assert got["dH_from_easy"] != 0.0 and got["dH_easy_from_easy"] == got["dH_from_easy"]  # (all of them easy)
    assert math.isnan(got["dH_hard_from_easy"])  # (no hard response to measure)


def _train(tmp_path, name: str, **options) -> Trainer:
    cfg = build_config(run_name=name, steps=3, eval_every=0, checkpoint_every=0, **options)
    trainer = Trainer(cfg, tmp_path)
    trainer.fit()
    return trainer


@pytest.mark.slow
def test_the_default_run_is_unchanged_by_the_attribution(tmp_path):
    """The default run (QAE K=0.4, 4 mini-batches) for 3 steps with and without the option: the same steps rows
    (timings aside, the attribution's own columns aside), the same rollouts and the same final weights, bit for bit;
    with it, every step with both regimes has both columns."""
    plain, attributed = _train(tmp_path, "plain"), _train(tmp_path, "attributed", log_entropy_attribution=True)
    want, got = (read_steps(db_path(tmp_path, name)).set_index("step") for name in ("plain", "attributed"))
    for name in sorted(set(STEP_METRICS) - set(TIMING_METRICS) - set(ATTRIBUTION_METRICS)):
        pd.testing.assert_series_equal(want[name], got[name], check_names=False, check_exact=True, obj=name)
    assert want[list(ATTRIBUTION_METRICS)].isna().all().all()
    both = (got["frac_hard"] > 0) & (got["frac_easy"] > 0)
    assert both.any()
    assert got.loc[both, ["dH_from_hard", "dH_from_easy", "dH_hard_from_hard", "dH_easy_from_easy"]].notna().all().all()
    rows = [
        query(db_path(tmp_path, name), "SELECT * EXCLUDE (run_id) FROM rollouts ORDER BY step, group_idx, sample_idx")
        for name in ("plain", "attributed")
    ]
    pd.testing.assert_frame_equal(rows[0], rows[1], check_exact=True)
    for p, q in zip(plain.model.parameters(), attributed.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_two_processes_give_the_one_process_attribution(tmp_path):
    """Under a real `accelerate launch --num_processes 2`, on the same samples: the attribution columns (and every
    other) are the one-process ones."""
    from tests.e2e.test_accelerate import SCRIPT, launch
    from tests.same_steps import assert_same_metrics

    for n in (1, 2):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}", "attribution")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (read_steps(db_path(tmp_path, f"p{n}")).set_index("step") for n in (1, 2))
    assert one["dH_from_none"].notna().all()
    for regime in ("hard", "easy"):  # measured on every step that has the regime, NULL on the others
        assert (one[f"dH_from_{regime}"].notna() == (one[f"frac_{regime}"] > 0)).all()
    assert one["dH_from_hard"].notna().any() and one["dH_from_easy"].notna().any()
    assert_same_metrics(one, two)
