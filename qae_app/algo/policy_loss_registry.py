"""The policy losses, registered by name against their records (core/policy_losses.py), with one signature:

    loss(tokens: LossTokens, params: dict[str, float]) -> TokenLoss        # per-token loss (n, T), to aggregate

`tokens` are one micro-batch's: the current log-probs (with grad), the old ones, each response's advantage, the
response mask, and the tokens the loss's mini-batch selection picked; `params` its record's options by name (the PPO
clip's clip_low and clip_high included). `losses.policy_loss` does what every loss shares: the top-entropy mask, the
rollout correction's weights, the aggregation, the KL term and the entropy bonus, so the update calls every loss the
same way and never special-cases one.

A loss that selects tokens over the whole mini-batch (clip_cov, kl_cov) registers its selection with it:

    select(tokens: SelectionTokens, params, accelerator, generator) -> ((n, T) bool, count over every process)

run on one no-grad pass over the mini-batch before its forward/backward passes (token_selection.py says how a
selection comes out the same for any micro-batch plan and process count).

Shapes: n sequences, T positions; `mask` is 1 on response tokens; advantages are per sequence, broadcast over its
tokens. Every formula below is the published one; docs/algorithm.md writes each out with its reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qae_app.algo.token_selection import SelectionTokens, clip_cov_selection, kl_cov_selection, top_entropy_mask
from qae_app.core.errors import QAEUserError
from qae_app.core.policy_losses import ADAPTIVE_OPTIONS, POLICY_LOSSES, gated_skip_exact

PPO_CLIP = ("clip_low", "clip_high")  # the update's own fields (UpdateOptions), not a loss's params


class LossTokens(NamedTuple):
    logp: torch.Tensor  # (n, T) current policy, with grad
    old_logp: torch.Tensor  # (n, T) the sampling policy's, no grad
    advantages: torch.Tensor  # (n,)
    mask: torch.Tensor  # (n, T) float, 1 on response tokens
    selected: torch.Tensor | None  # (n, T) bool: the tokens the loss's mini-batch selection picked; None: none


class TokenLoss(NamedTuple):
    loss: torch.Tensor  # (n, T) each token's loss term, before aggregation
    clipped_low: torch.Tensor  # (n, T) bool: tokens the loss clipped from below (A < 0)
    clipped_high: torch.Tensor  # (n, T) bool: tokens the loss clipped from above (A > 0)


Loss = Callable[[LossTokens, dict], TokenLoss]
Select = Callable[..., tuple[torch.Tensor, int]]


class RegisteredLoss(NamedTuple):
    loss: Loss
    select: Select | None  # its selection over the whole mini-batch, if it makes one


POLICY_LOSS_FUNCTIONS: dict[str, RegisteredLoss] = {}


def register_policy_loss(name: str, select: Select | None = None):
    """Register the loss `name` (and its mini-batch selection): it needs a record in core.policy_losses, and a
    second registration of a name raises (it would silently replace the first; verl raises too)."""
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"policy loss '{name}' has no record in qae_app.core.policy_losses.POLICY_LOSSES: add its "
            "record (help, options, references) there"
        )

    def decorator(fn: Loss) -> Loss:
        if name in POLICY_LOSS_FUNCTIONS:
            raise ValueError(
                f"policy loss '{name}' is registered already, by {POLICY_LOSS_FUNCTIONS[name].loss.__qualname__}"
            )
        POLICY_LOSS_FUNCTIONS[name] = RegisteredLoss(fn, select)
        return fn

    return decorator


def get_policy_loss(name: str) -> RegisteredLoss:
    if name not in POLICY_LOSS_FUNCTIONS:
        raise QAEUserError(f"policy-loss: unknown value '{name}'. Choose one of: {', '.join(POLICY_LOSS_FUNCTIONS)}.")
    return POLICY_LOSS_FUNCTIONS[name]


# ---------------------------------------------------------------------------------------------------------------
# what the update reads of the config, and the adaptive entropy coefficient


@dataclass(frozen=True)
class LossSettings:
    """The policy loss and the entropy controls of a run (TrainConfig's options of the same names); the PPO clip is
    UpdateOptions' clip_low and clip_high."""

    name: str = "clip"
    params: tuple[tuple[str, float], ...] = ()  # the loss's own options beyond the PPO clip, by name
    top_entropy_quantile: float = 1.0  # train only this share of tokens, the highest-entropy ones (1: every one)
    entropy_coef: float = 0.0  # the entropy bonus's (starting) coefficient
    entropy_target: float | None = None  # adapt the coefficient toward this entropy; None: a fixed coefficient
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> LossSettings:
        record = POLICY_LOSSES[cfg.policy_loss]
        adaptive = {o.name: getattr(cfg, o.name) for o in ADAPTIVE_OPTIONS} if cfg.entropy_target is not None else {}
        return cls(
            cfg.policy_loss,
            tuple((o.name, getattr(cfg, o.name)) for o in record.options if o.name not in PPO_CLIP),
            cfg.top_entropy_quantile,
            cfg.entropy_coef,
            cfg.entropy_target,
            **adaptive,
        )

    def parameters(self, clip_low: float | None, clip_high: float | None) -> dict[str, float]:
        """The loss's `params`: its own options and the PPO clip."""
        return {**dict(self.params), "clip_low": clip_low, "clip_high": clip_high}

    @property
    def gated_skip_exact(self) -> bool:
        return gated_skip_exact(self.name, self.entropy_coef, self.entropy_target)

    @property
    def with_entropy_bonus(self) -> bool:
        return self.entropy_coef != 0.0 or self.entropy_target is not None

    @property
    def selects_tokens(self) -> bool:
        """Whether each mini-batch needs the selection pass: a loss's selection, or the top-entropy quantile."""
        return get_policy_loss(self.name).select is not None or self.top_entropy_quantile < 1.0


@dataclass
class EntropyCoefficient:
    """The entropy bonus's coefficient as TRL's adaptive entropy control moves it (use_adaptive_entropy), and the
    entropy it last measured; resumable state (the checkpoint's trainer_state.json)."""

    coef: float
    measured: float | None = None  # the last optimizer step's mean token entropy of the trained tokens; None: none

    def applied(self, settings: LossSettings) -> float:
        """The coefficient this optimizer step applies: with a target, only while the last measured entropy is at
        or below it (the first step, having measured nothing, applies none), as TRL does."""
        if settings.entropy_target is None:
            return self.coef
        return self.coef if self.measured is not None and self.measured <= settings.entropy_target else 0.0

    def adapt(self, measured: float, settings: LossSettings) -> None:
        """After an optimizer step whose trained tokens' mean entropy was `measured`: up by the delta when it was at
        or below the target, else down, within [min, max]."""
        if settings.entropy_target is None:
            return
        if measured <= settings.entropy_target:
            self.coef = min(self.coef + settings.entropy_coef_delta, settings.entropy_coef_max)
        else:
            self.coef = max(self.coef - settings.entropy_coef_delta, settings.entropy_coef_min)
        self.measured = measured


class TokenSelection(NamedTuple):
    """One mini-batch's token selections, as (N, T) masks over this process's rows (None: none made)."""

    selected: torch.Tensor | None = None  # the tokens the loss's selection picked (clip_cov: cut; kl_cov: penalised)
    selected_count: int = 0  # over every process
    trained: torch.Tensor | None = None  # the tokens the top-entropy quantile kept
    trained_count: int = 0  # over every process


def select_mini_batch(
    tokens: SelectionTokens,
    rows: torch.Tensor,
    like: torch.Tensor,
    settings: LossSettings,
    params: dict,
    accelerator,
    seed: int,
) -> TokenSelection:
    """The loss's selection and the top-entropy quantile over one mini-batch, from its selection pass (`tokens`, of
    this process's rows `rows` (n,), in global order; token_selection.py says how every process agrees), as masks
    shaped like `like` (N, T). `seed`: Clip-Cov's draw (selection_seed)."""
    out = TokenSelection()
    select = get_policy_loss(settings.name).select
    if select is not None:
        picked, count = select(tokens, params, accelerator, torch.Generator().manual_seed(seed))
        out = out._replace(selected=_on_rows(picked, rows, like), selected_count=count)
    if settings.top_entropy_quantile < 1.0:
        kept, count = top_entropy_mask(tokens, settings.top_entropy_quantile, accelerator)
        out = out._replace(trained=_on_rows(kept, rows, like), trained_count=count)
    return out


def _on_rows(mask: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(n, T) bool of the rows `rows` -> shaped like `like` (N, T), False on every other row."""
    full = torch.zeros_like(like, dtype=torch.bool)
    full[rows] = mask
    return full


def selection_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one mini-batch's random selection: from the update's seed, the epoch and the mini-batch's index,
    so it is the same on every process and whether or not an all-gated mini-batch before it was skipped."""
    return (seed * 1_000_003 + epoch * 10_007 + index) % 2**63


# ---------------------------------------------------------------------------------------------------------------
# the losses


def _ppo_clip(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> TokenLoss:
    """max(-A r, -A clip(r, 1 - low, 1 + high)): PPO's pessimistic bound, per token."""
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high))
    with torch.no_grad():
        return TokenLoss(per_token, (ratio < 1.0 - low) & (adv < 0), (ratio > 1.0 + high) & (adv > 0))


@register_policy_loss("clip")
def clip_loss(t: LossTokens, params: dict) -> TokenLoss:
    """PPO's clipped ratio r = exp(logp - old) with separate clips (Clip-Higher)."""
    return _ppo_clip(torch.exp(t.logp - t.old_logp), t.advantages[:, None], params["clip_low"], params["clip_high"])


@register_policy_loss("clip_cov", select=clip_cov_selection)
def clip_cov_loss(t: LossTokens, params: dict) -> TokenLoss:
    """The clip loss with the selected tokens' terms cut: 0, and no gradient (verl's `* corr`)."""
    out = clip_loss(t, params)
    return out._replace(loss=out.loss.masked_fill(t.selected, 0.0)) if t.selected is not None else out


@register_policy_loss("kl_cov", select=kl_cov_selection)
def kl_cov_loss(t: LossTokens, params: dict) -> TokenLoss:
    """-A r, unclipped, plus kl_cov_coef |logp - old| on the selected tokens."""
    per_token = -t.advantages[:, None] * torch.exp(t.logp - t.old_logp)
    if t.selected is not None:
        per_token = per_token + torch.where(t.selected, params["kl_cov_coef"] * (t.logp - t.old_logp).abs(), 0.0)
    none = torch.zeros_like(t.mask, dtype=torch.bool)
    return TokenLoss(per_token, none, none)


@register_policy_loss("gspo")
def gspo_loss(t: LossTokens, params: dict) -> TokenLoss:
    """GSPO-token: s_i,t = sg(s_i) exp(logp_t - sg(logp_t)) with s_i = exp(mean_t (logp - old)) the sequence's
    geometric-mean ratio, clipped as PPO's at GSPO's own epsilons. Its value is s_i at every token, and its gradient
    through token t is s_i's share grad logp_t, so the seq_mean_token_mean aggregation gives GSPO's gradient."""
    seq_log_ratio = ((t.logp - t.old_logp) * t.mask).sum(-1) / t.mask.sum(-1).clamp(min=1)  # (n,)
    ratio = torch.exp(t.logp - t.logp.detach() + seq_log_ratio.detach()[:, None])  # (n, T)
    return _ppo_clip(ratio, t.advantages[:, None], params["gspo_clip_low"], params["gspo_clip_high"])


@register_policy_loss("cispo")
def cispo_loss(t: LossTokens, params: dict) -> TokenLoss:
    """-sg(min(r, cap)) A logp: the importance weight is capped and detached, every token keeps its gradient."""
    ratio = torch.exp(t.logp - t.old_logp)
    adv = t.advantages[:, None]
    weight = ratio.clamp(max=params["cispo_weight_cap"]).detach()
    with torch.no_grad():
        capped = (ratio > params["cispo_weight_cap"]) & (adv > 0)  # (TRL's cispo_clip_ratio)
    return TokenLoss(-weight * adv * t.logp, torch.zeros_like(capped), capped)
