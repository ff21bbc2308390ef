"""Each policy loss against its published formula, written out here in float64 (not by calling qae's code): value and
gradient, under every loss aggregation the loss defines; the registry's refusals; and the mini-batch selections
(covariance centring, Clip-Cov's band and draw, KL-Cov's top share, the entropy quantile) on hand-made tokens."""

import math

import pytest
import torch

from qae_app.algo import policy_loss_registry
from qae_app.algo.losses import policy_loss
from qae_app.algo.token_selection import (
    SelectionTokens,
    clip_cov_selection,
    covariance,
    kl_cov_selection,
    linear_quantile,
    top_entropy_mask,
)
from qae_app.core import policy_losses
from qae_app.core.errors import QAEUserError
from qae_app.train.update import OneProcess

ONE = OneProcess("cpu")
N, T = 5, 6
LENGTHS = [6, 3, 1, 4, 5]  # response tokens of each sequence (the rest is padding)
ADV = torch.tensor([1.3, 0.0, -0.7, 2.1, -1.6], dtype=torch.float64)
PARAMS = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "clip_cov_ratio": 0.3,
    "clip_cov_lb": -0.5,
    "clip_cov_ub": 3.0,
    "kl_cov_ratio": 0.25,
    "kl_cov_coef": 0.7,
    "gspo_clip_low": 0.05,
    "gspo_clip_high": 0.08,
    "cispo_weight_cap": 1.15,
}
MAX_LEN = 8


def tokens(seed: int = 0):
    """Current log-probs (a leaf to differentiate), old ones 0.3 nats around them and the first and last sequences'
    0.2 nats further out, so every clip binds somewhere (GSPO's on the sequences' mean log-ratio)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(N, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    logp = (-torch.rand(N, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    shift = torch.tensor([[-0.2], [0.0], [0.0], [0.0], [0.2]], dtype=torch.float64)  # (N, 1)
    old = logp.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64) + shift
    selected = (torch.rand(N, T, generator=g) < 0.3) & mask.bool()
    return logp, old, mask, selected


def normalizer(mask):
    return {"tokens": mask.sum().item(), "sequences": N, "max_len": MAX_LEN}


def aggregated(per_token, mask, how):
    """The three aggregations, written out: token mean over the mini-batch, mean of sequence means, sequence sums
    over max_len averaged over sequences."""
    if how == "token":
        return (per_token * mask).sum() / mask.sum()
    if how == "seq_mean_token_mean":
        return sum((per_token[i] * mask[i]).sum() / mask[i].sum() for i in range(N)) / N
    return sum((per_token[i] * mask[i]).sum() / MAX_LEN for i in range(N)) / N


def reference(loss: str, logp, old, mask, selected, how):
    """The published formulas, token by token (A_i the sequence's advantage, r = pi / pi_old)."""
    A = ADV[:, None]
    r = torch.exp(logp - old)
    p = PARAMS
    if loss in ("clip", "clip_cov"):  # PPO with Clip-Higher; Clip-Cov: the selected tokens' terms removed
        per_token = torch.max(-A * r, -A * torch.clamp(r, 1 - p["clip_low"], 1 + p["clip_high"]))
        if loss == "clip_cov":
            per_token = per_token * (~selected)
        return aggregated(per_token, mask, how)
    if loss == "kl_cov":  # -A r everywhere, + coef |log r| on the selected tokens
        return aggregated(-A * r + p["kl_cov_coef"] * (logp - old).abs() * selected, mask, how)
    if loss == "cispo":  # MiniMax-M1: -sg(clip(r, -, 1 + eps_high)) A log pi
        return aggregated(-torch.clamp(r, max=p["cispo_weight_cap"]).detach() * A * logp, mask, how)
    # GSPO (Zheng et al. 2025, eq. 5): mean over sequences of the clipped sequence objective, s_i the geometric mean
    s = torch.stack([torch.exp(((logp[i] - old[i]) * mask[i]).sum() / mask[i].sum()) for i in range(N)])
    per_seq = torch.max(-ADV * s, -ADV * torch.clamp(s, 1 - p["gspo_clip_low"], 1 + p["gspo_clip_high"]))
    return per_seq.mean()


CASES = [(name, how) for name, record in policy_losses.POLICY_LOSSES.items() for how in record.aggregations]


@pytest.mark.parametrize("loss, how", CASES)
def test_each_loss_has_the_value_and_gradient_of_its_published_formula(loss, how):
    logp, old, mask, selected = tokens()
    out = policy_loss(
        logp,
        old,
        ADV,
        mask,
        PARAMS["clip_low"],
        PARAMS["clip_high"],
        how,
        normalizer(mask),
        loss=loss,
        params=PARAMS,
        selected=selected,
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    want = reference(loss, logp, old, mask, selected, how)
    (want_grad,) = torch.autograd.grad(want, logp)
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert grad.abs().sum() > 0
    if loss in ("clip", "clip_cov", "gspo"):  # (the clipped branch was taken somewhere: it is checked too)
        assert out.clip_low_count + out.clip_high_count > 0


def test_the_clip_loss_computes_bit_for_bit_what_qae_computed_before_the_registry():
    """An existing run resumes as `clip` with the very numbers: the clip path against the code it replaced, verbatim
    (ratio, unclipped and clipped terms, their maximum, the weights, the aggregation, the k3 KL), equal bit for bit."""
    from qae_app.algo.losses import aggregate

    logp, old, mask, _ = tokens(6)
    ref = old - 0.1
    weights = torch.rand(N, T, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for how in policy_losses.POLICY_LOSSES["clip"].aggregations:
        out = policy_loss(logp, old, ADV, mask, 0.2, 0.28, how, normalizer(mask), ref, 0.05, weights)
        adv = ADV[:, None]
        ratio = torch.exp(logp - old)
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - 0.2, 1.0 + 0.28)) * weights
        delta = ref - logp
        before = aggregate(per_token, mask, how, normalizer(mask)) + 0.05 * aggregate(
            torch.exp(delta) - delta - 1.0, mask, how, normalizer(mask)
        )
        assert torch.equal(out.loss, before)
        assert torch.equal(torch.autograd.grad(out.loss, logp)[0], torch.autograd.grad(before, logp)[0])


def test_a_gated_response_has_no_gradient_under_every_loss_whose_record_says_so():
    """The records' gated_skip_exact: advantage 0 gives a sequence no gradient under clip, clip_cov, gspo and cispo;
    under kl_cov the penalty reaches it wherever a selected token lies in it."""
    logp, old, mask, selected = tokens()
    for name, record in policy_losses.POLICY_LOSSES.items():
        out = policy_loss(
            logp,
            old,
            ADV,
            mask,
            0.2,
            0.28,
            record.aggregations[0],
            normalizer(mask),
            loss=name,
            params=PARAMS,
            selected=selected,
        )
        (grad,) = torch.autograd.grad(out.loss, logp)
        gated_grad = grad[1].abs().sum().item()  # (sequence 1 has advantage 0, and a selected token)
        assert selected[1].any()
        assert (gated_grad == 0) == record.gated_skip_exact, name


def test_the_entropy_controls_compose_with_a_loss_by_their_formulas():
    """TRL's formulas: the top-entropy mask multiplies each token's loss (the normalizer unchanged), the bonus is
    minus the coefficient x the mean entropy of the kept tokens, whatever the aggregation."""
    logp, old, mask, _ = tokens(1)
    entropy = (torch.rand(N, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2).requires_grad_()
    kept = torch.rand(N, T, generator=torch.Generator().manual_seed(3)) < 0.5
    norm = {**normalizer(mask), "trained_tokens": (kept * mask).sum().item()}
    out = policy_loss(
        logp,
        old,
        ADV,
        mask,
        0.2,
        0.28,
        "seq_mean_token_mean",
        norm,
        loss="cispo",
        params=PARAMS,
        trained=kept,
        entropy=entropy,
        entropy_coef=0.05,
    )
    r = torch.exp(logp - old)
    per_token = -torch.clamp(r, max=PARAMS["cispo_weight_cap"]).detach() * ADV[:, None] * logp * kept
    want = (
        aggregated(per_token, mask, "seq_mean_token_mean") - 0.05 * (entropy * mask * kept).sum() / (mask * kept).sum()
    )
    got_grads = torch.autograd.grad(out.loss, (logp, entropy))
    want_grads = torch.autograd.grad(want, (logp, entropy))
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)
    assert out.entropy_sum.item() == pytest.approx((entropy * mask * kept).sum().item())


# ---------------------------------------------------------------------------------------------------------------
# the registry


def test_a_loss_registers_once_and_only_against_a_record():
    with pytest.raises(ValueError, match="registered already"):
        policy_loss_registry.register_policy_loss("clip")(lambda t, p: None)
    with pytest.raises(ValueError, match="no record"):
        policy_loss_registry.register_policy_loss("ppo_dual_clip")
    with pytest.raises(ValueError, match="has a record already"):
        policy_losses.add_record(policy_losses.POLICY_LOSSES["gspo"])
    # every record has its function
    assert set(policy_loss_registry.POLICY_LOSS_FUNCTIONS) == set(policy_losses.POLICY_LOSSES)
    with pytest.raises(
        QAEUserError, match="policy-loss: unknown value 'vanilla'. Choose one of: clip, clip_cov, kl_cov, gspo, cispo."
    ):
        policy_loss_registry.get_policy_loss("vanilla")


def test_the_records_say_which_losses_select_over_the_mini_batch():
    selecting = {name for name, fn in policy_loss_registry.POLICY_LOSS_FUNCTIONS.items() if fn.select is not None}
    assert selecting == {name for name, record in policy_losses.POLICY_LOSSES.items() if record.selects}
    assert selecting == {"clip_cov", "kl_cov"}


# ---------------------------------------------------------------------------------------------------------------
# the selections, on one process (tests/e2e/test_policy_loss_processes.py: on two)


def selection_tokens(entropy: bool = False):
    logp, old, mask, _ = tokens(4)
    ent = torch.rand(N, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64) if entropy else None
    return SelectionTokens(logp.detach(), old, ADV, mask, ent)


def test_covariance_is_centred_on_every_response_token_of_the_mini_batch():
    t = selection_tokens()
    cov, count = covariance(t, ONE)
    on = t.mask.bool()
    A = ADV[:, None].expand(N, T)[on]
    logp = t.logp[on]
    assert count == sum(LENGTHS)
    torch.testing.assert_close(cov, (A - A.mean()) * (logp - logp.mean()), rtol=1e-12, atol=0)


def test_clip_cov_cuts_a_random_share_of_the_unclipped_tokens_in_its_covariance_band():
    t = selection_tokens()
    cov, _ = covariance(t, ONE)
    on = t.mask.bool()
    r = torch.exp(t.logp - t.old_logp)[on]
    A = ADV[:, None].expand(N, T)[on]
    clipped = ((r < 0.8) & (A < 0)) | ((r > 1.28) & (A > 0))
    band = (cov > -0.5) & (cov < 3.0) & ~clipped
    picked, count = clip_cov_selection(t, PARAMS, ONE, torch.Generator().manual_seed(0))
    share = max(int(0.3 * sum(LENGTHS)), 1)
    assert band.sum() > share  # (a draw, not all of them)
    assert count == share == picked.sum().item()
    assert not (picked & ~on).any() and (picked[on] <= band).all()  # only band tokens
    again, _ = clip_cov_selection(t, PARAMS, ONE, torch.Generator().manual_seed(0))
    other, _ = clip_cov_selection(t, PARAMS, ONE, torch.Generator().manual_seed(1))
    assert torch.equal(picked, again) and not torch.equal(picked, other)  # seeded: the same draw for the same seed
    everything, count = clip_cov_selection(t, {**PARAMS, "clip_cov_ratio": 1.0}, ONE, torch.Generator())
    assert torch.equal(everything[on], band) and count == band.sum()


def test_kl_cov_penalises_the_top_share_by_covariance_ties_in_token_order():
    t = selection_tokens()
    cov, _ = covariance(t, ONE)
    picked, count = kl_cov_selection(t, PARAMS, ONE)
    k = max(1, int(sum(LENGTHS) * 0.25))
    assert count == k == picked.sum().item()
    assert cov[picked[t.mask.bool()]].min() > cov[~picked[t.mask.bool()]].max()
    # equal covariances: two sequences with the same advantage and log-probs tie token for token
    # (A - 1/3)(logp + 4/3): the second tokens of sequences 0 and 1 tie at 2/9, the largest; k = 1 of 6 takes the first
    same = SelectionTokens(
        torch.tensor([[-2.0, -1.0], [-2.0, -1.0], [-1.0, -1.0]], dtype=torch.float64),
        torch.zeros(3, 2, dtype=torch.float64),
        torch.tensor([1.0, 1.0, -1.0]),
        torch.ones(3, 2, dtype=torch.float64),
        None,
    )
    picked, _ = kl_cov_selection(same, {"kl_cov_ratio": 0.2}, ONE)
    assert picked.tolist() == [[False, True], [False, False], [False, False]]


def test_the_entropy_quantile_is_torch_quantile_over_every_response_token():
    t = selection_tokens(entropy=True)
    kept, count = top_entropy_mask(t, 0.2, ONE)
    on = t.mask.bool()
    threshold = torch.quantile(t.entropy[on], 0.8)  # TRL: torch.quantile(entropies, 1 - top_entropy_quantile)
    assert torch.equal(kept, on & (t.entropy >= threshold))
    assert count == kept.sum().item() == math.ceil(0.2 * on.sum().item())
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for p in (0.0, 0.25, 0.8, 0.999, 1.0):
        assert linear_quantile(values, p).item() == torch.quantile(values, p).item()
