"""Advantage estimators: one signature, registered by name.

Every estimator is a pure, no-grad function

    estimator(rewards: Tensor [B, G], cfg: EstimatorConfig) -> (advantages [B, G], baseline [B])

where B is the number of prompts (groups) and G the number of sampled responses per prompt. The trainer calls
`compute_advantages(name, rewards, cfg, correct)`, which adds each group's regime (integer codes into `REGIMES`) by
one rule for every estimator, `label_regimes` (names.REGIME_RULE): what the baseline does relative to the group's
rewards, so 0/1, -1/1 and overlong-shaped rewards are all labelled the same way. It never special-cases an estimator.

QAE (arXiv 2509.22611) replaces GRPO's group mean with the group's K-quantile. With binary rewards and c successes
out of G, the paper's (lower, inverted-CDF) quantile is the m-th smallest reward with m = ceil(K * G):

- hard prompt, G - c >= m (success rate p <= 1 - K): baseline 0, successes get a positive advantage, failures 0;
- easy prompt, G - c <  m (p > 1 - K):               baseline 1, failures get a negative advantage, successes 0;

then, as in GRPO, the advantage is divided by the group's (unbiased) reward std + eps. `m` is computed exactly from
the decimal value of K (0.3 * 10 is 3.0000000000000004 in floats, ceil of which would be 4), so the regime is decided on
integer counts. `quantile="linear"` reproduces the official code, which used `torch.quantile` (linear
interpolation at position K * (G - 1), computed here exactly, so an integer position gives a reward itself); it differs
from the paper when K * (G - 1) is not an integer, e.g. G=8, K=0.4, 5 correct:
paper baseline 1, linear baseline 0.8. With more than two reward values (the overlong penalty) the quantile works on
them as they are, as in the paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import NamedTuple

import torch

from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS

# Regime codes: indices into names.REGIMES (the store keeps the names).
REGIMES = tuple(names.REGIMES)
HARD, EASY, ALL_CORRECT, ALL_WRONG, MIXED = (
    REGIMES.index(r) for r in ("hard", "easy", "all_correct", "all_wrong", "mixed")
)


@dataclass(frozen=True)
class EstimatorConfig:
    k: float | None = names.DEFAULT_K  # QAE quantile level K, in (0, 1); an estimator that reads no K gets None
    quantile: str | None = "paper"  # "paper" (lower, inverted-CDF) or "linear" (torch.quantile, as the official
    # code); an estimator that reads no K gets None
    scale: str | None = None  # "std" / "none" (names.SCALE_METHODS); None: the estimator's own default
    eps: float = 1e-6


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [B, G] float32
    baseline: torch.Tensor  # [B] float32
    regime: torch.Tensor  # [B] int64, index into REGIMES


Estimator = Callable[[torch.Tensor, EstimatorConfig], tuple[torch.Tensor, torch.Tensor]]  # advantages, baseline
# name -> implementation; what an estimator is (help, K, default scale, option rules) is its record,
# core.estimators.ESTIMATORS, which every reader asks
ESTIMATOR_FUNCTIONS: dict[str, Estimator] = {}


def register_estimator(name: str):
    """Register the estimator `name`: it needs a record in core.estimators, and a second registration of a name
    raises (it would silently replace the first; verl raises too)."""
    if name not in ESTIMATORS:
        raise ValueError(
            f"estimator '{name}' has no record in qae_app.core.estimators.ESTIMATORS: add its record "
            "(help, reads_k, default scale, reference) there"
        )

    def decorator(fn: Estimator) -> Estimator:
        if name in ESTIMATOR_FUNCTIONS:
            raise ValueError(f"estimator '{name}' is registered already, by {ESTIMATOR_FUNCTIONS[name].__qualname__}")
        ESTIMATOR_FUNCTIONS[name] = fn
        return fn

    return decorator


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATOR_FUNCTIONS:
        raise QAEUserError(f"estimator: unknown value '{name}'. Choose one of: {', '.join(ESTIMATOR_FUNCTIONS)}.")
    return ESTIMATOR_FUNCTIONS[name]


@torch.no_grad()
def compute_advantages(
    name: str, rewards: torch.Tensor, cfg: EstimatorConfig | None = None, correct: torch.Tensor | None = None
) -> Advantages:
    """`rewards` [B, G]; `correct` [B, G] bool, the verifier's verdicts (default: reward > 0, which is right for 0/1
    and -1/1 rewards without the overlong penalty). The options are checked by the estimator's record; an estimator
    whose record says it reads no K is given none (K None, quantile None), so it cannot read them by mistake."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must have shape [B, G] with G >= 2, got {tuple(rewards.shape)}")
    estimator = get_estimator(name)
    cfg = cfg or EstimatorConfig()
    ESTIMATORS[name].validate(cfg.k, cfg.quantile, cfg.scale)
    if not ESTIMATORS[name].reads_k:
        cfg = replace(cfg, k=None, quantile=None)
    rewards = rewards.float()
    advantages, baseline = estimator(rewards, cfg)
    correct = rewards > 0 if correct is None else correct.bool()
    return Advantages(advantages, baseline, label_regimes(rewards, baseline, correct))


@torch.no_grad()
def step_advantages(
    name: str,
    rewards: torch.Tensor,
    correct: torch.Tensor,
    values: tuple[float, float],
    cfg: EstimatorConfig,
    shaping: str = "before-baseline",
) -> Advantages:
    """A step's advantages by names.SHAPING. `rewards` [B, G] shaped (the reward values plus the overlong penalty),
    `correct` [B, G] bool, `values` (wrong, correct) the reward values.

    before-baseline: `compute_advantages` of the shaped rewards (the official QAE code; verl's DAPO).
    after-baseline: `compute_advantages` of the verdicts' reward values (so QAE's baseline, std and regime are those
    of the 0/1 or -1/1 rewards), then each response's penalty (shaped minus verdict reward, <= 0) added to its
    advantage unscaled: divided by the verdicts' std it would be a penalty / 1e-6 in a group of equal verdicts."""
    if shaping == "before-baseline":
        return compute_advantages(name, rewards, cfg, correct)
    if shaping != "after-baseline":
        raise QAEUserError(f"shaping: unknown value '{shaping}'. Choose one of: {', '.join(names.SHAPING)}.")
    wrong_value, correct_value = values
    verdicts = torch.where(correct.bool(), correct_value, wrong_value).to(torch.float64)  # [B, G]
    adv = compute_advantages(name, verdicts, cfg, correct)
    penalty = (rewards.to(torch.float64) - verdicts).float()  # [B, G], 0 for a response within the budget
    return adv._replace(advantages=adv.advantages + penalty)


def label_regimes(rewards: torch.Tensor, baseline: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """[B] regime codes by names.REGIME_RULE: a group whose rewards differ is hard when its baseline is its lowest
    reward, easy when it is its highest, else mixed; a group of equal rewards (no signal) is all_correct or all_wrong
    by the verifier's verdicts, mixed when they disagree.

    rewards [B, G] float, baseline [B] float, correct [B, G] bool."""
    low, high = rewards.min(dim=1).values, rewards.max(dim=1).values  # [B]
    regime = torch.full((rewards.shape[0],), MIXED, dtype=torch.long)
    uniform = low == high
    regime[~uniform & (baseline == low)] = HARD
    regime[~uniform & (baseline == high)] = EASY
    regime[uniform & correct.all(dim=1)] = ALL_CORRECT
    regime[uniform & ~correct.any(dim=1)] = ALL_WRONG
    return regime


# ---------------------------------------------------------------------------------------------------------------
# helpers shared by the estimators


def _scale(centered: torch.Tensor, rewards: torch.Tensor, cfg: EstimatorConfig, estimator: str) -> torch.Tensor:
    if ESTIMATORS[estimator].scale(cfg.scale) == "none":
        return centered
    std = rewards.std(dim=1, keepdim=True)  # [B, 1], unbiased (G - 1), as GRPO
    return centered / (std + cfg.eps)


def quantile_rank(k: float, group_size: int) -> int:
    """m = ceil(K * G), computed exactly on K's decimal value: the paper quantile is the m-th smallest reward."""
    m = math.ceil(Fraction(repr(float(k))) * group_size)
    return min(max(m, 1), group_size)


def linear_quantile(rewards: torch.Tensor, k: float) -> torch.Tensor:
    """torch.quantile's linear interpolation along dim 1, [B, G] -> [B], with the position K * (G - 1) and its
    interpolation weight computed exactly on K's decimal value: where the position is an integer the quantile is that
    reward itself (torch's float position, e.g. 0.6 * 25 = 15.000000000000002, put a 1e-6 share of the next reward in
    the baseline and turned a hard group into a mixed one); elsewhere the weight is the correctly rounded one."""
    position = Fraction(repr(float(k))) * (rewards.shape[1] - 1)
    below = math.floor(position)
    ordered = rewards.sort(dim=1).values  # [B, G]
    weight = position - below
    if weight == 0:
        return ordered[:, below]
    return ordered[:, below] + float(weight) * (ordered[:, below + 1] - ordered[:, below])


def quantile_baseline(rewards: torch.Tensor, k: float, quantile: str = "paper") -> torch.Tensor:
    """Each group's K-quantile reward, [B, G] -> [B]: the paper's (the m-th smallest, m = ceil(K * G)) or the
    linear one (names.QUANTILE_METHODS)."""
    if quantile == "paper":
        return rewards.sort(dim=1).values[:, quantile_rank(k, rewards.shape[1]) - 1]
    return linear_quantile(rewards, k)


def quantile_regimes(correct: torch.Tensor, split_k: float) -> torch.Tensor:
    """[B] each group's regime by the quantile rule on its verdicts `correct` [B, G] bool: `label_regimes` of the 0/1
    verdicts against their paper `split_k`-quantile, hard while the success rate is <= 1 - K. Whatever the estimator
    and the rewards, groups split this way into hard and easy (dH's regimes, the entropy attribution's)."""
    verdicts = correct.float()  # [B, G]
    return label_regimes(verdicts, quantile_baseline(verdicts, split_k), correct.bool())


# ---------------------------------------------------------------------------------------------------------------
# estimators


@register_estimator("qae")
def qae_advantages(rewards: torch.Tensor, cfg: EstimatorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    baseline = quantile_baseline(rewards, cfg.k, cfg.quantile)  # [B]
    return _scale(rewards - baseline[:, None], rewards, cfg, "qae"), baseline  # [B, G], [B]


@register_estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, cfg: EstimatorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    baseline = rewards.mean(dim=1)  # [B]
    return _scale(rewards - baseline[:, None], rewards, cfg, "grpo"), baseline


@register_estimator("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, cfg: EstimatorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's mean baseline without the std division: that is what defines Dr. GRPO (its record refuses --scale
    std)."""
    baseline = rewards.mean(dim=1)  # [B]
    return rewards - baseline[:, None], baseline


@register_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, cfg: EstimatorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    B, G = rewards.shape
    leave_one_out = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)  # [B, G]
    return _scale(rewards - leave_one_out, rewards, cfg, "rloo"), rewards.mean(dim=1)
