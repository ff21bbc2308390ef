"""Estimators: hand-computed QAE cases, and a per-group reference loop against the vectorized code."""

import math
import random

import pytest
import torch

from qae_app.algo.advantages import (
    ESTIMATOR_FUNCTIONS,
    REGIMES,
    EstimatorConfig,
    compute_advantages,
    quantile_rank,
    step_advantages,
)
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS, EstimatorRecord, add_record


def group(n_correct: int, size: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n_correct + [0.0] * (size - n_correct)])


def qae(rewards, **kw):
    return compute_advantages("qae", rewards, EstimatorConfig(**kw))


def test_hard_prompt_only_successes_get_advantage():
    # G=16, K=0.4, 3 correct: p = 3/16 <= 0.6 -> baseline 0; std (unbiased) = sqrt(0.1625) = 0.40311
    adv, baseline, regime = qae(group(3, 16), k=0.4)
    assert baseline.item() == 0.0
    assert REGIMES[regime.item()] == "hard"
    assert adv[0, :3].tolist() == pytest.approx([2.4807] * 3, abs=1e-4)
    assert adv[0, 3:].tolist() == [0.0] * 13


def test_easy_prompt_only_failures_get_advantage():
    # 10 of 16 correct: p = 0.625 > 0.6 -> baseline 1; std = 0.5 exactly
    adv, baseline, regime = qae(group(10, 16), k=0.4)
    assert baseline.item() == 1.0
    assert REGIMES[regime.item()] == "easy"
    assert adv[0, :10].tolist() == [0.0] * 10
    assert adv[0, 10:].tolist() == pytest.approx([-2.0] * 6, abs=1e-4)


@pytest.mark.parametrize("n_correct, name", [(16, "all_correct"), (0, "all_wrong")])
def test_uniform_groups_have_no_signal(n_correct, name):
    adv, _, regime = qae(group(n_correct, 16), k=0.4)
    assert adv.abs().sum().item() == 0.0
    assert REGIMES[regime.item()] == name


def test_paper_and_linear_quantiles_differ_when_position_is_fractional():
    # G=8, K=0.4, 5 correct. Paper: m = ceil(3.2) = 4 > 3 failures -> baseline 1.
    adv, baseline, regime = qae(group(5, 8), k=0.4)
    assert baseline.item() == 1.0 and REGIMES[regime.item()] == "easy"
    assert adv[0, :5].tolist() == [0.0] * 5
    assert adv[0, 5:].tolist() == pytest.approx([-1.932] * 3, abs=1e-3)
    # Linear (torch.quantile): position 0.4 * 7 = 2.8 between a 0 and a 1 -> baseline 0.8
    adv, baseline, regime = qae(group(5, 8), k=0.4, quantile="linear")
    assert baseline.item() == pytest.approx(0.8)
    assert REGIMES[regime.item()] == "mixed"
    assert adv[0, :5].tolist() == pytest.approx([0.3864] * 5, abs=1e-4)
    assert adv[0, 5:].tolist() == pytest.approx([-1.5457] * 3, abs=1e-4)


@pytest.mark.parametrize("size, k", [(26, 0.6), (46, 0.6), (51, 0.3), (51, 0.54), (51, 0.6), (11, 0.4), (6, 0.2)])
def test_linear_quantile_is_exact_where_its_position_is_an_integer(size, k):
    """K * (G - 1) an integer: the linear quantile is a reward itself, never 1e-6 away from it (torch.quantile's float
    position 0.6 * 25 = 15.000000000000002 gave a baseline of 2e-16-ish weight times 1, and the regime `mixed`)."""
    for n_correct in range(1, size):
        _, baseline, regime = qae(group(n_correct, size), k=k, quantile="linear")
        position = round(k * (size - 1))  # exactly an integer for these (G, K)
        expected = 1.0 if position >= size - n_correct else 0.0  # the sorted rewards: failures first
        assert baseline.item() == expected, (n_correct, baseline.item())
        assert REGIMES[regime.item()] == ("easy" if expected == 1.0 else "hard")


def test_linear_quantile_matches_torch_quantile_everywhere_else():
    generator = torch.Generator().manual_seed(0)
    for size in (2, 3, 5, 8, 16, 33):
        for k in (0.1, 0.25, 0.4, 0.5, 0.77, 0.9):
            rewards = torch.rand(20, size, generator=generator)
            _, baseline, _ = qae(rewards, k=k, quantile="linear")
            reference = torch.quantile(rewards, k, dim=1, interpolation="linear")
            assert torch.allclose(baseline, reference, rtol=0, atol=1e-6), (size, k)


def test_quantile_rank_is_exact_on_decimal_k():
    # 0.3 * 10 == 3.0000000000000004 in floats; a float ceil would give 4.
    assert quantile_rank(0.3, 10) == 3
    assert quantile_rank(0.4, 16) == 7
    assert quantile_rank(0.4, 8) == 4
    assert quantile_rank(0.5, 2) == 1


def test_regime_boundary_is_p_equal_one_minus_k():
    # K=0.5, G=10: 5 correct is p = 0.5 <= 1-K -> hard; 6 correct -> easy.
    assert REGIMES[qae(group(5, 10), k=0.5).regime.item()] == "hard"
    assert REGIMES[qae(group(6, 10), k=0.5).regime.item()] == "easy"
    # K=0.3, G=10: hard while p <= 0.7 (7 correct), easy at 8.
    assert REGIMES[qae(group(7, 10), k=0.3).regime.item()] == "hard"
    assert REGIMES[qae(group(8, 10), k=0.3).regime.item()] == "easy"


def reference_advantages(name: str, rewards: list[float], cfg: EstimatorConfig):
    """Slow, obvious per-group version of each estimator."""
    G = len(rewards)
    mean = sum(rewards) / G
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (G - 1))
    std_scaled = ESTIMATORS[name].scale(cfg.scale) == "std"
    if name == "qae":
        ordered = sorted(rewards)
        if cfg.quantile == "paper":
            baseline = ordered[quantile_rank(cfg.k, G) - 1]
        else:
            pos = cfg.k * (G - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, G - 1)
            baseline = ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])
        adv = [(r - baseline) / (std + cfg.eps) if std_scaled else r - baseline for r in rewards]
    elif name == "grpo":
        baseline = mean
        adv = [(r - mean) / (std + cfg.eps) if std_scaled else r - mean for r in rewards]
    elif name == "dr_grpo":
        baseline = mean
        adv = [r - mean for r in rewards]
    elif name == "rloo":
        baseline = mean
        adv = [r - (sum(rewards) - r) / (G - 1) for r in rewards]
        adv = [a / (std + cfg.eps) for a in adv] if std_scaled else adv
    return adv, baseline, reference_regime(rewards, baseline, [r > 0 for r in rewards])


def reference_regime(rewards: list[float], baseline: float, correct: list[bool]) -> str:
    """names.REGIME_RULE, spelled out."""
    if min(rewards) == max(rewards):
        return "all_correct" if all(correct) else "all_wrong" if not any(correct) else "mixed"
    return "hard" if baseline == min(rewards) else "easy" if baseline == max(rewards) else "mixed"


@pytest.mark.parametrize("name", sorted(ESTIMATOR_FUNCTIONS))
@pytest.mark.parametrize("quantile", ["paper", "linear"])
@pytest.mark.parametrize("scale", [None, "std", "none"])
def test_vectorized_equals_reference_loop(name, quantile, scale):
    if ESTIMATORS[name].scale_fixed and scale not in (None, ESTIMATORS[name].default_scale):
        pytest.skip(f"{name} refuses --scale {scale} (test_an_estimator_refuses_a_scale_that_contradicts_it)")
    rng = random.Random(0)
    for G in (2, 3, 5, 8, 16, 17):
        for k in (0.1, 0.25, 0.3, 0.4, 0.5, 0.7, 0.9):
            cfg = EstimatorConfig(k=k, quantile=quantile, scale=scale)
            groups = []
            for _ in range(40):  # binary groups of every success rate, plus some graded rewards
                p = rng.random()
                groups.append([float(rng.random() < p) for _ in range(G)])
            groups += [[round(rng.random(), 2) for _ in range(G)] for _ in range(5)]
            out = compute_advantages(name, torch.tensor(groups), cfg)
            assert out.advantages.shape == (len(groups), G)
            assert out.baseline.shape == out.regime.shape == (len(groups),)
            for i, rewards in enumerate(groups):
                adv, baseline, regime = reference_advantages(name, rewards, cfg)
                assert out.advantages[i].tolist() == pytest.approx(adv, abs=1e-4), (name, G, k, rewards)
                assert out.baseline[i].item() == pytest.approx(baseline, abs=1e-6)
                assert REGIMES[out.regime[i].item()] == regime


def test_qae_gates_most_responses_at_typical_success_rates():
    # Binary groups with success rates spread over [0, 1]: QAE zeroes far more advantages than GRPO.
    torch.manual_seed(0)
    p = torch.rand(2000, 1)
    rewards = (torch.rand(2000, 16) < p).float()
    qae_zero = (compute_advantages("qae", rewards).advantages == 0).float().mean().item()
    grpo_zero = (compute_advantages("grpo", rewards).advantages == 0).float().mean().item()
    assert qae_zero > 0.6 and grpo_zero < 0.2


@pytest.mark.parametrize("k", [0.0, 1.0, -0.1, 1.5])
def test_k_outside_unit_interval_is_a_user_error(k):
    with pytest.raises(QAEUserError, match="k: .* outside"):
        qae(group(3, 8), k=k)


def test_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(QAEUserError, match="qae, grpo, dr_grpo, rloo"):
        compute_advantages("ppo", group(3, 8))


def test_the_registry_and_the_records_agree():
    """Every record has an implementation and every implementation a record; the CLI's choices are the records'."""
    from qae_app.config import FIELDS

    assert set(ESTIMATOR_FUNCTIONS) == set(ESTIMATORS)
    assert all(name == record.name for name, record in ESTIMATORS.items())
    assert FIELDS["estimator"].metadata["choices"] == {name: record.help for name, record in ESTIMATORS.items()}


def test_a_second_record_of_a_name_raises():
    with pytest.raises(ValueError, match="'qae' has a record already"):
        add_record(EstimatorRecord("qae", "another qae", reads_k=True, default_scale="std", reference="none"))
    assert ESTIMATORS["qae"].reference.startswith("Quantile Advantage Estimation")


def test_registering_a_name_twice_or_without_a_record_raises():
    from qae_app.algo.advantages import register_estimator

    qae = ESTIMATOR_FUNCTIONS["qae"]
    with pytest.raises(ValueError, match="'qae' is registered already"):
        register_estimator("qae")(lambda rewards, cfg: (rewards, rewards))
    assert ESTIMATOR_FUNCTIONS["qae"] is qae
    with pytest.raises(ValueError, match="no record in qae_app.core.estimators.ESTIMATORS"):
        register_estimator("ppo")


def test_k_applies_to_exactly_the_estimators_that_use_it():
    """A record's reads_k decides where K applies (the stored k, the sweep's grid, compare's groups): exactly the
    estimators whose advantages change with K. 2 of 5 correct: K=0.2 makes QAE's baseline 0 (hard), K=0.8 makes it 1
    (easy)."""
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0]])
    for name in ESTIMATOR_FUNCTIONS:
        low = compute_advantages(name, rewards, EstimatorConfig(k=0.2)).advantages
        high = compute_advantages(name, rewards, EstimatorConfig(k=0.8)).advantages
        assert ESTIMATORS[name].reads_k == (not torch.equal(low, high)), name
    assert [name for name, record in ESTIMATORS.items() if record.reads_k] == ["qae"]


def test_a_mean_baseline_estimator_cannot_silently_read_k(monkeypatch):
    """An estimator whose record says it reads no K is handed none: one that reads K anyway fails at its first call,
    instead of quietly training on whatever --k says."""
    from qae_app.algo.advantages import register_estimator

    monkeypatch.setitem(
        ESTIMATORS,
        "leaky_mean",
        EstimatorRecord(
            "leaky_mean",
            "a mean baseline that reads K by mistake",
            reads_k=False,
            default_scale="none",
            reference="this test",
        ),
    )

    def leaky(rewards, cfg):
        baseline = rewards.mean(dim=1) * (cfg.k / cfg.k)
        return rewards - baseline[:, None], baseline

    register_estimator("leaky_mean")(leaky)
    try:
        with pytest.raises(TypeError):
            compute_advantages("leaky_mean", group(2, 5), EstimatorConfig(k=0.3))
    finally:
        del ESTIMATOR_FUNCTIONS["leaky_mean"]


def test_an_estimator_refuses_a_scale_that_contradicts_it():
    """dr_grpo is GRPO without the std division: --scale std is refused, by its record, for the config and for the
    estimator called directly alike."""
    from qae_app.config import build_config

    with pytest.raises(QAEUserError, match="scale: dr_grpo is GRPO without the std normalization"):
        compute_advantages("dr_grpo", group(2, 5), EstimatorConfig(scale="std"))
    with pytest.raises(QAEUserError, match="scale: dr_grpo is GRPO without the std normalization"):
        build_config(estimator="dr_grpo", scale="std")
    assert compute_advantages("dr_grpo", group(2, 5), EstimatorConfig(scale="none")).advantages.shape == (1, 5)


def test_scale_none_is_honoured_by_the_mean_baselines():
    """`--scale` is each estimator's to honour: grpo divides by the std unless --scale none, rloo only with --scale
    std."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # mean 0.25, unbiased std 0.5
    grpo_raw = compute_advantages("grpo", rewards, EstimatorConfig(scale="none")).advantages
    assert grpo_raw.tolist() == [[0.75, -0.25, -0.25, -0.25]]
    assert torch.equal(grpo_raw, compute_advantages("dr_grpo", rewards).advantages)
    grpo_std = compute_advantages("grpo", rewards).advantages
    assert grpo_std[0, 0].item() == pytest.approx(0.75 / (0.5 + 1e-6))
    rloo_std = compute_advantages("rloo", rewards, EstimatorConfig(scale="std")).advantages
    assert rloo_std[0, 0].item() == pytest.approx((1.0 - 0.0) / (0.5 + 1e-6))
    assert compute_advantages("rloo", rewards).advantages[0, 0].item() == pytest.approx(1.0)  # its own default


def test_train_config_passes_scale_to_the_estimator_and_refuses_dr_grpo_with_std():
    from qae_app.config import build_config

    assert build_config(estimator="grpo", scale="none").advantage_scale == "none"
    assert build_config(estimator="grpo").advantage_scale == "std"
    assert build_config(estimator="rloo").advantage_scale == "none"
    with pytest.raises(QAEUserError, match="scale: dr_grpo is GRPO without the std"):
        build_config(estimator="dr_grpo", scale="std")


# ---------------------------------------------------------------------------------------------------------------
# -1/1 rewards (DAPO) and rewards shaped by the overlong penalty: regimes follow the baseline


def signed(n_correct: int, size: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n_correct + [-1.0] * (size - n_correct)])


def test_plus_minus_one_groups_get_hard_easy_and_no_signal_labels():
    # G=4, K=0.4: m = ceil(1.6) = 2. One correct: sorted [-1, -1, -1, 1], baseline -1 = the lowest reward -> hard.
    # std: mean -0.5, squared deviations 2.25 + 3 * 0.25 = 3, / (G - 1) = 1 -> std 1; advantage (1 - -1) / 1 = 2.
    adv, baseline, regime = qae(signed(1, 4), k=0.4)
    assert baseline.item() == -1.0 and REGIMES[regime.item()] == "hard"
    assert adv[0].tolist() == pytest.approx([2.0, 0.0, 0.0, 0.0], abs=1e-5)
    # three correct: sorted [-1, 1, 1, 1], baseline 1 = the highest reward -> easy; the failure gets (-1 - 1) / 1 = -2
    adv, baseline, regime = qae(signed(3, 4), k=0.4)
    assert baseline.item() == 1.0 and REGIMES[regime.item()] == "easy"
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -2.0], abs=1e-5)
    for n_correct, name in ((4, "all_correct"), (0, "all_wrong")):
        adv, _, regime = qae(signed(n_correct, 4), k=0.4)
        assert REGIMES[regime.item()] == name and adv.abs().sum().item() == 0.0


def test_plus_minus_one_advantages_by_hand():
    """The std-normalized estimators give -1/1 groups the advantages of the 0/1 groups (an affine change of rewards
    cancels); the unscaled ones double them. Mean-baseline groups are `mixed`, as with 0/1 rewards."""
    rewards = signed(1, 4)  # [1, -1, -1, -1]: mean -0.5, std 1
    grpo = compute_advantages("grpo", rewards)
    assert grpo.advantages[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert REGIMES[grpo.regime.item()] == "mixed" and grpo.baseline.item() == -0.5
    assert torch.allclose(grpo.advantages, compute_advantages("grpo", group(1, 4)).advantages, atol=1e-5)
    assert compute_advantages("dr_grpo", rewards).advantages[0].tolist() == [1.5, -0.5, -0.5, -0.5]
    assert compute_advantages("dr_grpo", group(1, 4)).advantages[0].tolist() == [0.75, -0.25, -0.25, -0.25]
    # rloo: 1 - mean(-1, -1, -1) = 2; -1 - mean(1, -1, -1) = -2/3
    assert compute_advantages("rloo", rewards).advantages[0].tolist() == pytest.approx([2, -2 / 3, -2 / 3, -2 / 3])
    assert torch.allclose(qae(signed(1, 4)).advantages, qae(group(1, 4)).advantages, atol=1e-5)


def test_shaped_rewards_quantile_and_regime_by_hand():
    # correct at 1 and 0.75 (overlong penalty 0.25), wrong at -1 and -1.25: G=4, K=0.4, m=2 -> the 2nd smallest, -1:
    # neither the lowest nor the highest reward -> mixed. std: mean -0.125, squares 2 * 1.125^2 + 2 * 0.875^2 =
    # 4.0625, / 3 -> std = sqrt(1.3541667)
    rewards = torch.tensor([[1.0, 0.75, -1.0, -1.25]])
    correct = torch.tensor([[True, True, False, False]])
    adv, baseline, regime = compute_advantages("qae", rewards, EstimatorConfig(k=0.4), correct)
    std = math.sqrt(4.0625 / 3)
    assert baseline.item() == -1.0 and REGIMES[regime.item()] == "mixed"
    assert adv[0].tolist() == pytest.approx([2 / std, 1.75 / std, 0.0, -0.25 / std], abs=1e-5)
    # every response correct, one penalized for length: baseline 1 (sorted [0.5, 1, 1, 1], m = 2) = the highest
    # reward -> easy: only the long response is pushed down
    adv, baseline, regime = compute_advantages(
        "qae", torch.tensor([[1.0, 0.5, 1.0, 1.0]]), EstimatorConfig(k=0.4), torch.tensor([[True] * 4])
    )
    assert baseline.item() == 1.0 and REGIMES[regime.item()] == "easy"
    assert adv[0, 1].item() < 0 and adv[0, [0, 2, 3]].tolist() == [0.0, 0.0, 0.0]
    # equal rewards from a correct-but-long and a wrong response (penalty 2 at max length): no signal, mixed verdicts
    _, _, regime = compute_advantages(
        "qae", torch.tensor([[-1.0, -1.0]]), EstimatorConfig(k=0.4), torch.tensor([[True, False]])
    )
    assert REGIMES[regime.item()] == "mixed"


def test_continuous_and_weighted_rewards_quantile_and_regime_by_hand():
    """A user's continuous reward (docs/rewards.md): the K-quantile of the rewards as they are, as for shaped ones.

    G=5, K=0.4: m = ceil(2) = 2, the 2nd smallest of [0.1, 0.3, 0.3, 0.7, 1.0] is 0.3, strictly between the lowest and
    the highest -> mixed; both responses at 0.3 are gated (reward at the baseline). std: mean 0.48, squared deviations
    0.1444 + 0.0484 + 0.0324 + 0.2704 + 0.0324 = 0.528, / 4 -> sqrt(0.132)."""
    rewards = torch.tensor([[0.1, 0.7, 0.3, 1.0, 0.3]])
    correct = torch.tensor([[False, False, False, True, False]])  # full marks: only the 1.0
    adv, baseline, regime = compute_advantages("qae", rewards, EstimatorConfig(k=0.4), correct)
    std = math.sqrt(0.132)
    assert baseline.item() == pytest.approx(0.3) and REGIMES[regime.item()] == "mixed"
    assert adv[0].tolist() == pytest.approx([-0.2 / std, 0.4 / std, 0.0, 0.7 / std, 0.0], abs=1e-5)
    # a weighted sum (1 x correct + 0.5 x format): [0, 0, 0.5, 1.5], G=4, m=2 -> baseline 0, the lowest -> hard: only
    # the responses above it are pushed up. mean 0.5, squares 0.25 + 0.25 + 0 + 1 = 1.5, / 3 -> std sqrt(0.5)
    adv, baseline, regime = compute_advantages(
        "qae", torch.tensor([[0.0, 0.0, 0.5, 1.5]]), EstimatorConfig(k=0.4), torch.tensor([[False, False, False, True]])
    )
    assert baseline.item() == 0.0 and REGIMES[regime.item()] == "hard"
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, 0.5 / math.sqrt(0.5), 1.5 / math.sqrt(0.5)], abs=1e-5)


def test_every_estimator_labels_regimes_by_the_same_rule():
    from qae_app.core import names

    rewards = torch.tensor([[1.0, 0.75, -1.0, -1.25], [1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 1.0]])
    correct = rewards > 0
    for name in ESTIMATOR_FUNCTIONS:
        out = compute_advantages(name, rewards, EstimatorConfig(k=0.4), correct)
        expected = [
            reference_regime(r.tolist(), b, c.tolist())
            for r, b, c in zip(rewards, out.baseline.tolist(), correct, strict=True)
        ]
        assert [REGIMES[i] for i in out.regime.tolist()] == expected, name
    assert "lowest reward" in names.REGIME_RULE and "highest" in names.REGIME_RULE


# the README's worked example: G=8, K=0.4, -1/1 rewards, 2 wrong, 6 right of which 2 overlong (penalties -0.5, -0.25)
SHAPED = torch.tensor([[-1.0, -1.0, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
VERDICTS = torch.tensor([[False, False, True, True, True, True, True, True]])


def test_shaping_before_the_baseline_takes_the_quantile_of_the_shaped_rewards():
    """The official code: the 4th smallest shaped reward (m = ceil(0.4 * 8)) is 0.75, between the group's lowest
    and highest, so the group is mixed; only the -0.25 response is gated, and the four clean successes are pushed up
    by 0.25 / std, std = 0.8858 (the shaped rewards' unbiased std)."""
    adv = step_advantages("qae", SHAPED, VERDICTS, (-1.0, 1.0), EstimatorConfig(k=0.4), "before-baseline")
    std = math.sqrt(sum((r - 0.40625) ** 2 for r in SHAPED[0].tolist()) / 7)  # mean 3.25 / 8
    assert adv.baseline.item() == 0.75 and REGIMES[adv.regime.item()] == "mixed"
    want = [(r - 0.75) / (std + 1e-6) for r in SHAPED[0].tolist()]
    assert adv.advantages[0].tolist() == pytest.approx(want, rel=1e-6)
    assert adv.advantages[0, 4:].tolist() == pytest.approx([0.2822] * 4, abs=1e-4)
    assert int((adv.advantages == 0).sum()) == 1
    assert torch.equal(adv.advantages, compute_advantages("qae", SHAPED, EstimatorConfig(k=0.4), VERDICTS).advantages)


def test_shaping_after_the_baseline_keeps_the_two_regimes_and_adds_the_penalty():
    """On the verdicts (-1 x2, +1 x6) the 4th smallest is +1: easy, baseline 1; the failures get -2 / std with
    std = sqrt(6/7) (the verdicts' unbiased std), the clean successes exactly 0 (gated), and the two overlong successes
    0 plus their penalty, unscaled: -0.5 and -0.25."""
    adv = step_advantages("qae", SHAPED, VERDICTS, (-1.0, 1.0), EstimatorConfig(k=0.4), "after-baseline")
    assert adv.baseline.item() == 1.0 and REGIMES[adv.regime.item()] == "easy"
    failure = -2.0 / (math.sqrt(6 / 7) + 1e-6)
    assert adv.advantages[0].tolist() == pytest.approx([failure, failure, -0.5, -0.25, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    assert int((adv.advantages == 0).sum()) == 4
    # a hard group: 2 of 8 right, one overlong (-0.5): baseline -1, that success gets 2 / std - 0.5, the other 2 / std
    shaped = torch.tensor([[0.5, 1.0] + [-1.0] * 6], dtype=torch.float64)
    verdicts = torch.tensor([[True, True] + [False] * 6])
    adv = step_advantages("qae", shaped, verdicts, (-1.0, 1.0), EstimatorConfig(k=0.4), "after-baseline")
    success = 2.0 / (math.sqrt(6 / 7) + 1e-6)
    assert REGIMES[adv.regime.item()] == "hard"
    assert adv.advantages[0].tolist() == pytest.approx([success - 0.5, success] + [0.0] * 6, rel=1e-6)
    with pytest.raises(QAEUserError, match="shaping: unknown value 'late'"):
        step_advantages("qae", shaped, verdicts, (-1.0, 1.0), EstimatorConfig(k=0.4), "late")


def test_the_quantile_rule_splits_groups_as_qae_labels_them_on_the_verdicts():
    """quantile_regimes (dH's and the attribution's hard and easy, for every estimator) is the quantile rule itself:
    on 0/1 verdicts it labels each group as QAE at that K does, hard while the success rate is <= 1 - K."""
    from qae_app.algo.advantages import quantile_regimes

    rng = random.Random(1)
    for G in (2, 4, 5, 8, 16):
        correct = torch.tensor([[rng.random() < p for _ in range(G)] for p in [rng.random() for _ in range(64)]])
        for split_k in (0.2, 0.3, 0.4, 0.5, 0.8):
            by_qae = compute_advantages("qae", correct.float(), EstimatorConfig(k=split_k), correct).regime
            assert torch.equal(quantile_regimes(correct, split_k), by_qae), (G, split_k)
            rates = correct.float().mean(dim=1)
            signal = (rates > 0) & (rates < 1)
            hard = quantile_regimes(correct, split_k) == REGIMES.index("hard")
            assert torch.equal(hard[signal], rates[signal] <= 1 - split_k + 1e-9), (G, split_k)
