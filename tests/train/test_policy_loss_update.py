"""Every policy loss and entropy control through `update.policy_update`, on tensors with a 2-layer float64 model: the
update equals one written out here from the published formulas (selections included), whatever the micro-batch plan;
and per loss, the gated skip either gives the dense update (forwarding fewer rows) or is off, because under that loss
a gated response has a gradient (shown by forcing the skip: the update then differs)."""

import dataclasses

import pytest
import torch

from qae_app.algo.policy_loss_registry import EntropyCoefficient, LossSettings
from qae_app.core.policy_losses import POLICY_LOSSES
from qae_app.train import update
from tests.train.test_update import ADVANTAGES, TwoLayerLM, _batch, _options

# each loss with options that make its selection pick several tokens here, and the entropy controls on two losses
SETTINGS = {
    "clip": LossSettings("clip"),
    "clip_cov": LossSettings("clip_cov", (("clip_cov_ratio", 0.15), ("clip_cov_lb", 0.0), ("clip_cov_ub", 1.0))),
    "kl_cov": LossSettings("kl_cov", (("kl_cov_ratio", 0.25), ("kl_cov_coef", 0.5))),
    "gspo": LossSettings("gspo", (("gspo_clip_low", 0.05), ("gspo_clip_high", 0.08))),
    "cispo": LossSettings("cispo", (("cispo_weight_cap", 1.1),)),
    "gspo+top_entropy": LossSettings(
        "gspo", (("gspo_clip_low", 0.05), ("gspo_clip_high", 0.08)), top_entropy_quantile=0.4
    ),
    "clip+entropy_bonus": LossSettings("clip", top_entropy_quantile=0.5, entropy_coef=0.05),
    "cispo+adaptive_entropy": LossSettings(
        "cispo", (("cispo_weight_cap", 1.1),), entropy_coef=0.02, entropy_target=5.0, entropy_coef_delta=0.01
    ),
}
AGGREGATION = {"gspo": "seq_mean_token_mean"}


def options_for(name: str, **changes):
    settings = SETTINGS[name]
    return _options(loss=settings, loss_agg=AGGREGATION.get(settings.name, "token"), **changes)


def run(name: str, seed: int = 1, control: EntropyCoefficient | None = None, **changes):
    """(parameters after the update, its stats, rows the model ran) with AdamW, 2 mini-batches, 2 epochs."""
    model = TwoLayerLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    options = options_for(name, num_mini_batches=2, ppo_epochs=2, **changes)
    result = update.policy_update(model, optimizer, _batch(), ADVANTAGES, options, seed=seed, entropy_control=control)
    return [p.detach().clone() for p in model.parameters()], result.stats, model.rows_run


def assert_same_update(a, b):
    for got, want in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert a[1] == pytest.approx(b[1], rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_micro_batch_plan_changes_no_loss_s_update(name):
    """Selections are over the whole mini-batch, so one sequence per forward, the whole mini-batch in one, and
    token-budget micro-batches give one update."""
    whole = run(name, micro_batch_size=6)
    assert_same_update(run(name, micro_batch_size=1), whole)
    assert_same_update(run(name, micro_batch_size=6, max_tokens_per_micro_batch=7), whole)
    if SETTINGS[name].name in ("clip_cov", "kl_cov"):
        assert whole[1]["cov_selected_frac"] > 0


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_gated_skip_gives_the_dense_update_or_is_off_for_the_loss(name, monkeypatch):
    settings = SETTINGS[name]
    skip, dense = run(name), run(name, skip_gated=False)
    assert_same_update(skip, dense)
    if settings.gated_skip_exact:
        assert skip[2] < dense[2]  # the gated responses were left out of the training forwards
        return
    assert skip[2] == dense[2]  # every response forwarded: a gated one has a gradient under this loss
    monkeypatch.setattr(LossSettings, "gated_skip_exact", property(lambda self: True))
    forced = run(name)
    assert forced[2] < dense[2]
    assert not all(torch.allclose(a, b, rtol=0, atol=1e-9) for a, b in zip(forced[0], dense[0], strict=True))


def test_the_skip_is_off_exactly_for_kl_cov_and_the_entropy_bonus():
    assert {name for name, record in POLICY_LOSSES.items() if not record.gated_skip_exact} == {"kl_cov"}
    exact = {name: settings.gated_skip_exact for name, settings in SETTINGS.items()}
    assert exact == {
        "clip": True,
        "clip_cov": True,
        "kl_cov": False,
        "gspo": True,
        "cispo": True,
        "gspo+top_entropy": True,
        "clip+entropy_bonus": False,
        "cispo+adaptive_entropy": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# the update against its formulas, written out


def covariance(logp, mask):
    """(A - mean A)(logp - mean logp) per token, means over every response token."""
    A = ADVANTAGES[:, None].expand_as(logp)
    on = mask.bool()
    return (A - A[on].mean()) * (logp - logp[on].mean())


def hand_written_loss(settings: LossSettings, logp, entropy, sampling_logp, mask, coef):
    """The loss of every response at once, from the formulas: Clip-Cov's band (share 1 here: every candidate, no
    draw), KL-Cov's top k by covariance, GSPO-token (Zheng et al. 2025: s_i,t = sg(s_i) pi_t / sg(pi_t)), CISPO, TRL's
    entropy quantile and bonus (coefficient `coef`). Returns the loss and the kept tokens' mean entropy."""
    p = dict(settings.params)
    A = ADVANTAGES[:, None]
    r = torch.exp(logp - sampling_logp)
    on = mask.bool()
    kept = torch.ones_like(on)
    if settings.top_entropy_quantile < 1:
        kept = entropy.detach() >= torch.quantile(entropy.detach()[on], 1 - settings.top_entropy_quantile)
    if settings.name == "clip_cov":
        clipped = ((r < 0.8) & (A < 0)) | ((r > 1.28) & (A > 0))
        cov = covariance(logp.detach(), mask)
        cut = (cov > p["clip_cov_lb"]) & (cov < p["clip_cov_ub"]) & ~clipped & on
        per_token = torch.max(-A * r, -A * r.clamp(0.8, 1.28)) * ~cut
    elif settings.name == "kl_cov":
        cov = covariance(logp.detach(), mask)[on]
        top = torch.zeros_like(cov, dtype=torch.bool)
        top[torch.sort(cov, descending=True, stable=True).indices[: max(1, int(len(cov) * p["kl_cov_ratio"]))]] = True
        penalised = torch.zeros_like(on)
        penalised[on] = top
        per_token = -A * r + p["kl_cov_coef"] * (logp - sampling_logp).abs() * penalised
    elif settings.name == "gspo":
        s = torch.exp(((logp - sampling_logp) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).detach()
        s_t = s * torch.exp(logp - logp.detach())
        per_token = torch.max(-A * s_t, -A * s_t.clamp(1 - p["gspo_clip_low"], 1 + p["gspo_clip_high"]))
    elif settings.name == "cispo":
        per_token = -r.clamp(max=p["cispo_weight_cap"]).detach() * A * logp
    else:
        per_token = torch.max(-A * r, -A * r.clamp(0.8, 1.28))
    if settings.name == "gspo":  # seq_mean_token_mean
        loss = ((per_token * kept * mask).sum(-1) / mask.sum(-1)).mean()
    else:  # token
        loss = (per_token * kept * mask).sum() / mask.sum()
    trained = kept * mask
    mean_entropy = (entropy * trained).sum() / trained.sum()
    return loss - coef * mean_entropy, mean_entropy.item()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_update_is_the_one_written_from_the_formulas(name):
    """Two epochs of one mini-batch with plain SGD: epoch 1 at the sampling weights, epoch 2 after a step large
    enough that the clips bind. The update forwards in micro-batches of 2 (and leaves gated responses out where its
    loss allows); the hand version runs every response at once."""
    lr = 1.0
    settings = SETTINGS[name]
    if settings.name == "clip_cov":  # every candidate (no random draw to replicate)
        settings = dataclasses.replace(settings, params=(("clip_cov_ratio", 1.0), *settings.params[1:]))
    model, reference = TwoLayerLM(), TwoLayerLM()
    batch = _batch()
    mask, targets = batch["response_mask"], batch["input_ids"][:, 1:]
    control = EntropyCoefficient(settings.entropy_coef)
    options = _options(ppo_epochs=2, loss=settings, loss_agg=AGGREGATION.get(settings.name, "token"))
    update.policy_update(
        model, torch.optim.SGD(model.parameters(), lr=lr), batch, ADVANTAGES, options, seed=0, entropy_control=control
    )

    def logprobs_and_entropy(net):  # (N, T-1) each
        logp_all = torch.log_softmax(net(input_ids=batch["input_ids"]).logits[:, :-1], -1)
        return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)

    with torch.no_grad():
        sampling_logp = logprobs_and_entropy(reference)[0]
    coef, measured = settings.entropy_coef, None
    for _ in range(2):
        applied = (
            coef
            if settings.entropy_target is None or (measured is not None and measured <= settings.entropy_target)
            else 0.0
        )
        logp, entropy = logprobs_and_entropy(reference)
        loss, measured_now = hand_written_loss(settings, logp, entropy, sampling_logp, mask, applied)
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads, strict=True):
                p -= lr * g
        if settings.entropy_target is not None:  # TRL's adaptive rule
            coef = (
                min(coef + settings.entropy_coef_delta, settings.entropy_coef_max)
                if measured_now <= settings.entropy_target
                else max(coef - settings.entropy_coef_delta, settings.entropy_coef_min)
            )
            measured = measured_now
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert control.coef == pytest.approx(coef) and (control.measured is None) == (measured is None)
    if measured is not None:
        assert control.measured == pytest.approx(measured, rel=1e-10)


def test_the_adaptive_entropy_coefficient_moves_as_trl_s_and_applies_only_at_or_below_the_target():
    settings = LossSettings(
        entropy_coef=0.01, entropy_target=1.0, entropy_coef_delta=0.004, entropy_coef_min=0.002, entropy_coef_max=0.02
    )
    control = EntropyCoefficient(0.01)
    applied = []
    for measured in (0.5, 0.9, *[1.5] * 5, *[0.2] * 6):
        applied.append(control.applied(settings))
        control.adapt(measured, settings)
    # nothing measured before the first step: no bonus; after it +0.004 per step measured at or below 1.0, -0.004
    # above, within [0.002, 0.02]; applied only while the last step's entropy was at or below 1.0
    assert applied == pytest.approx([0.0, 0.014, 0.018, 0.0, 0.0, 0.0, 0.0, 0.0, 0.006, 0.01, 0.014, 0.018, 0.02])
    assert control.coef == pytest.approx(0.02) and control.measured == 0.2
    fixed = EntropyCoefficient(0.03)
    fixed.adapt(0.1, LossSettings(entropy_coef=0.03))
    assert fixed.applied(LossSettings(entropy_coef=0.03)) == 0.03 and fixed.measured is None
