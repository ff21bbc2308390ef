"""The policy losses of `qae train --policy-loss`, one record each, and the entropy controls that compose with any of
them: names, help, options with their defaults and ranges, whether the gated skip is exact, the loss aggregations a
loss defines, its reference.

Torch-free, so the CLI help, the config's checks and `qae show` read the records without loading torch. The
implementations register against them: `algo.policy_loss_registry.register_policy_loss("clip_cov")` refuses a name
with no record here, and a second registration of a name.

A loss option is named after its loss (`clip_cov_ratio`, `gspo_clip_low`, ...) and acts only with that loss: the
config leaves it None for any other loss, fills in its default for the run's own (so the stored config says what the
run used), and refuses a value given without its loss. The PPO clip (`clip_low`, `clip_high`) is the option of the two
losses that clip the token ratio, `clip` and `clip_cov`.
"""

from __future__ import annotations

from dataclasses import dataclass

from qae_app.core.errors import QAEUserError
from qae_app.core.names import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class LossOption:
    """One numeric option: its name (the TrainConfig field), default, help, and the range every value must lie in
    (the config's check_range says `advice` for a value outside it)."""

    name: str
    default: float | None
    help: str
    low: float
    high: float
    low_allowed: bool
    advice: str
    high_allowed: bool = True


@dataclass(frozen=True)
class PolicyLossRecord:
    """One policy loss, as `--policy-loss` names it."""

    name: str
    help: str  # one line: what it does (the CLI's choices)
    options: tuple[LossOption, ...]  # its own options, with their defaults
    gated_skip_exact: bool  # a response of advantage 0 has no gradient under it, so the update may leave it out
    aggregations: tuple[str, ...]  # the --loss-agg values it defines; the first is its default
    reference: str  # where its formula and its default values come from
    selects: str = ""  # what it selects over the whole mini-batch ("": nothing; algo/token_selection.py)


POLICY_LOSSES: dict[str, PolicyLossRecord] = {}


def add_record(record: PolicyLossRecord) -> PolicyLossRecord:
    """Put `record` in POLICY_LOSSES; a second record of a name would silently replace the first, so it raises."""
    if record.name in POLICY_LOSSES:
        raise ValueError(f"policy loss '{record.name}' has a record already: {POLICY_LOSSES[record.name].help}")
    unknown = set(record.aggregations) - set(LOSS_AGGREGATIONS)
    if unknown or not record.aggregations:
        raise ValueError(
            f"policy loss '{record.name}': aggregations {record.aggregations} are not {', '.join(LOSS_AGGREGATIONS)}"
        )
    POLICY_LOSSES[record.name] = record
    return record


def _share(name: str, default: float, help: str, example: str) -> LossOption:
    """An option that is a share of tokens: in (0, 1]."""
    return LossOption(name, default, help, 0.0, 1.0, False, f"Use a share of tokens in (0, 1], e.g. {example}")


ALL_AGGREGATIONS = tuple(LOSS_AGGREGATIONS)  # "token" first: the default
CUI_2025 = (
    "Cui et al. 2025, The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models, "
    "arXiv 2505.22617; verl's compute_policy_loss_clip_cov / _kl_cov"
)


def _cui_7b(script: str) -> str:
    """Where a Clip-Cov or KL-Cov default comes from: Cui et al.'s own recipe for Qwen2.5-7B."""
    return f"Cui et al. 2025's Qwen2.5-7B recipe, PRIME-RL/Entropy-Mechanism-of-RL recipe/dapo/{script}"


CLIP_LOW = LossOption(
    "clip_low",
    0.2,
    "the token ratio's clip below: 1 - clip_low.",
    0.0,
    1.0,
    True,
    "Use 0 <= clip-low < 1 (default 0.2)",
    high_allowed=False,
)
CLIP_HIGH = LossOption(
    "clip_high",
    0.28,
    "the token ratio's clip above: 1 + clip_high (clip-higher; DAPO's 0.28).",
    0.0,
    10.0,
    True,
    "Use a clip-high from 0 to 10 (default 0.28)",
)

for _record in (
    PolicyLossRecord(
        "clip",
        "PPO's clipped token ratio, clipped below at 1 - clip_low and above at 1 + clip_high (Clip-Higher, "
        "DAPO with the default 0.28)",
        (CLIP_LOW, CLIP_HIGH),
        True,
        ALL_AGGREGATIONS,
        "Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO, arXiv 2503.14476) for the separate clip-high",
    ),
    PolicyLossRecord(
        "clip_cov",
        "the clip loss, with the gradient of a random clip_cov_ratio share of the mini-batch's tokens "
        "whose covariance of centred log-prob and centred advantage lies in (clip_cov_lb, clip_cov_ub) cut (Clip-Cov)",
        (
            CLIP_LOW,
            CLIP_HIGH,
            _share(
                "clip_cov_ratio",
                2e-4,
                "the share of the mini-batch's response tokens whose gradient Clip-Cov cuts "
                f"(default 2e-4: {_cui_7b('7b_clip_cov.sh')}).",
                "0.0002",
            ),
            LossOption(
                "clip_cov_lb",
                1.0,
                f"Clip-Cov picks only tokens whose covariance is above this (default 1: {_cui_7b('7b_clip_cov.sh')}).",
                -1e6,
                1e6,
                True,
                "Use a finite bound below clip-cov-ub, e.g. 1",
            ),
            LossOption(
                "clip_cov_ub",
                5.0,
                f"Clip-Cov picks only tokens whose covariance is below this (default 5: {_cui_7b('7b_clip_cov.sh')}).",
                -1e6,
                1e6,
                True,
                "Use a finite bound above clip-cov-lb, e.g. 5",
            ),
        ),
        True,
        ALL_AGGREGATIONS,
        CUI_2025,
        selects="covariance centring over every response token of the mini-batch, then a random draw of the cut tokens",
    ),
    PolicyLossRecord(
        "kl_cov",
        "the unclipped token ratio, plus kl_cov_coef x |logp - old logp| on the kl_cov_ratio share of the "
        "mini-batch's tokens with the largest covariance of centred log-prob and centred advantage (KL-Cov)",
        (
            _share(
                "kl_cov_ratio",
                2e-3,
                "the share of the mini-batch's response tokens KL-Cov penalises, those of "
                f"largest covariance (default 2e-3, k_percent 0.2 in {_cui_7b('7b_kl_cov.sh')}; its 32B recipe "
                "uses 2e-4).",
                "0.002",
            ),
            LossOption(
                "kl_cov_coef",
                1.0,
                f"KL-Cov's penalty weight on |logp - old logp| (default 1, ppo_kl_coef in {_cui_7b('7b_kl_cov.sh')}).",
                0.0,
                100.0,
                False,
                "Use a weight in (0, 100], e.g. 1",
            ),
        ),
        False,
        ALL_AGGREGATIONS,
        CUI_2025,
        selects="covariance centring and the top kl_cov_ratio share over every response token of the mini-batch",
    ),
    PolicyLossRecord(
        "gspo",
        "the sequence's importance ratio, the geometric mean of its token ratios, clipped at "
        "1 - gspo_clip_low and 1 + gspo_clip_high, its gradient spread over the tokens (GSPO)",
        (
            LossOption(
                "gspo_clip_low",
                3e-4,
                "GSPO's sequence ratio clip below: 1 - gspo_clip_low (default 3e-4, Zheng et al. 2025).",
                0.0,
                1.0,
                True,
                "Use 0 <= gspo-clip-low < 1, e.g. 0.0003",
                high_allowed=False,
            ),
            LossOption(
                "gspo_clip_high",
                4e-4,
                "GSPO's sequence ratio clip above: 1 + gspo_clip_high (default 4e-4, Zheng et al. 2025).",
                0.0,
                10.0,
                True,
                "Use a gspo-clip-high from 0 to 10, e.g. 0.0004",
            ),
        ),
        True,
        ("seq_mean_token_mean",),
        "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv 2507.18071 (its per-token form GSPO-token "
        "with equal token advantages); verl's compute_policy_loss_gspo; TRL's importance_sampling_level='sequence'",
    ),
    PolicyLossRecord(
        "cispo",
        "the token's importance weight min(ratio, cispo_weight_cap), detached, times its log-prob and the "
        "advantage: no token loses its gradient (CISPO)",
        (
            LossOption(
                "cispo_weight_cap",
                5.0,
                "CISPO's cap on the detached importance weight (default 5, ScaleRL's "
                "epsilon_max, TRL's recommended epsilon_high for loss_type='cispo').",
                1.0,
                1e6,
                True,
                "Use a cap of 1 or more, e.g. 5",
            ),
        ),
        True,
        ALL_AGGREGATIONS,
        "MiniMax 2025, MiniMax-M1, arXiv 2506.13585 (CISPO); TRL's loss_type='cispo'; verl's compute_policy_loss_cispo",
    ),
):
    add_record(_record)

DEFAULT_POLICY_LOSS = "clip"
LOSS_CHOICES: dict[str, str] = {name: record.help for name, record in POLICY_LOSSES.items()}

# --- the entropy controls, which compose with any loss
WANG_2025 = "Wang et al. 2025, Beyond the 80/20 Rule, arXiv 2506.01939; TRL's top_entropy_quantile"
TOP_ENTROPY_QUANTILE = _share(
    "top_entropy_quantile",
    1.0,
    "Train only this share of the mini-batch's response tokens, those of highest "
    f"entropy under the current policy (1: every token; the paper uses 0.2; {WANG_2025}). Composes with any loss.",
    "0.2",
)
ENTROPY_COEF = LossOption(
    "entropy_coef",
    0.0,
    "Entropy bonus: the loss minus this x the mean token entropy of the trained tokens (the "
    "same for every --loss-agg, as TRL's entropy_coef). With --entropy-target, the starting coefficient. 0: no "
    "bonus.",
    0.0,
    1.0,
    True,
    "Use a coefficient from 0 (no bonus) to 1, e.g. 0.001",
)
ENTROPY_TARGET = LossOption(
    "entropy_target",
    None,
    "Adapt the entropy coefficient toward this mean token entropy (nats), as TRL's "
    "use_adaptive_entropy (Skywork-OR1, arXiv 2505.22312): after each optimizer step the coefficient rises by "
    "--entropy-coef-delta when that step's entropy was at or below the target, else falls by it, within "
    "[--entropy-coef-min, --entropy-coef-max]; the bonus applies only while the last measured entropy is at or "
    "below the target. The coefficient is saved with each checkpoint. Default: a fixed coefficient.",
    0.0,
    20.0,
    False,
    "Use a number of nats, e.g. the entropy of the run's first steps",
)
ADAPTIVE_OPTIONS = (
    LossOption(
        "entropy_coef_delta",
        0.005,
        "With --entropy-target: the coefficient's change per optimizer step (default 0.005, TRL's).",
        0.0,
        1.0,
        False,
        "Use a step in (0, 1], e.g. 0.005",
    ),
    LossOption(
        "entropy_coef_min",
        0.0,
        "With --entropy-target: the coefficient's lower bound (default 0, TRL's).",
        0.0,
        1.0,
        True,
        "Use a bound from 0 to 1 below entropy-coef-max",
    ),
    LossOption(
        "entropy_coef_max",
        1.0,
        "With --entropy-target: the coefficient's upper bound (default 1, TRL's).",
        0.0,
        1.0,
        True,
        "Use a bound from 0 to 1 above entropy-coef-min",
    ),
)
ENTROPY_OPTIONS = (TOP_ENTROPY_QUANTILE, ENTROPY_COEF, ENTROPY_TARGET, *ADAPTIVE_OPTIONS)

# every option a loss owns, once, and the losses that own it
LOSS_OPTIONS: dict[str, LossOption] = {o.name: o for record in POLICY_LOSSES.values() for o in record.options}
OWNERS: dict[str, tuple[str, ...]] = {
    name: tuple(r.name for r in POLICY_LOSSES.values() if any(o.name == name for o in r.options))
    for name in LOSS_OPTIONS
}
OPTIONS: dict[str, LossOption] = {**LOSS_OPTIONS, **{o.name: o for o in ENTROPY_OPTIONS}}
# the config of a run stored before --policy-loss existed, as it trained: the clip loss, no entropy control
# (`qae compare` counts these values as the key's absence, so such a run groups with today's clip runs)
AS_BEFORE_THE_OPTIONS: dict[str, object] = {
    "policy_loss": DEFAULT_POLICY_LOSS,
    **{name: None for name in OPTIONS if name not in (CLIP_LOW.name, CLIP_HIGH.name)},
    TOP_ENTROPY_QUANTILE.name: TOP_ENTROPY_QUANTILE.default,
    ENTROPY_COEF.name: ENTROPY_COEF.default,
}


def option_help(name: str) -> str:
    """The CLI help of a loss option or an entropy control: who reads it, then what it does."""
    if name in OWNERS:
        return f"--policy-loss {' / '.join(OWNERS[name])}: {OPTIONS[name].help[0].upper()}{OPTIONS[name].help[1:]}"
    return OPTIONS[name].help


def resolved(values: dict) -> dict:
    """The defaults that depend on the loss, for a config's `values` (field -> value): each option of the run's loss
    that is None gets its default, loss_agg None gets the loss's first aggregation, the adaptive options None their
    defaults when entropy_target is set. Only the changed fields are returned."""
    record = POLICY_LOSSES.get(values.get("policy_loss"))
    changes = {}
    if record is not None:
        changes.update({o.name: o.default for o in record.options if values.get(o.name) is None})
    if values.get("loss_agg") is None:
        changes["loss_agg"] = record.aggregations[0] if record is not None else ALL_AGGREGATIONS[0]
    if values.get("entropy_target") is not None:
        changes.update({o.name: o.default for o in ADAPTIVE_OPTIONS if values.get(o.name) is None})
    return changes


def _flag(name: str) -> str:
    return name.replace("_", "-")


def check_owned(values: dict) -> None:
    """QAEUserError for a loss option given without its loss (or an adaptive entropy option without
    --entropy-target): it would change nothing, yet be stored and split `qae compare`'s groups."""
    loss = values.get("policy_loss")
    for name, owners in OWNERS.items():
        value = values.get(name)
        if value is not None and loss not in owners:
            raise QAEUserError(
                f"{_flag(name)}: {value} is an option of --policy-loss {' and '.join(owners)}, and this run's loss is "
                f"{loss}, so it would change nothing (yet split `qae compare`'s groups). Add --policy-loss "
                f"{owners[0]}, or drop --{_flag(name)}."
            )
    if values.get("entropy_target") is None:
        for option in ADAPTIVE_OPTIONS:
            if values.get(option.name) is not None:
                raise QAEUserError(
                    f"{_flag(option.name)}: {values[option.name]} acts only with --entropy-target, "
                    "which is unset, so it would change nothing. Add --entropy-target NATS, or drop "
                    f"--{_flag(option.name)}."
                )


def check_rules(values: dict) -> None:
    """The rules that tie a loss's options together, and the loss to --loss-agg (after each value's own range)."""
    record = POLICY_LOSSES[values["policy_loss"]]
    if values["loss_agg"] not in record.aggregations:
        raise QAEUserError(
            f"loss-agg: {values['loss_agg']} is not defined for --policy-loss {record.name}, which defines only "
            f"{', '.join(record.aggregations)} (its ratio is one per sequence: each sequence's tokens are averaged, "
            f"then the sequences). Use --loss-agg {record.aggregations[0]}, or leave --loss-agg out."
        )
    if record.name == "clip_cov" and not values["clip_cov_lb"] < values["clip_cov_ub"]:
        raise QAEUserError(
            f"clip-cov-lb / clip-cov-ub: {values['clip_cov_lb']} / {values['clip_cov_ub']}. Clip-Cov "
            "picks tokens whose covariance lies between them: the lower bound must be below the upper "
            "(the paper's 1 and 5)."
        )
    if values.get("entropy_target") is not None:
        low, high, coef = values["entropy_coef_min"], values["entropy_coef_max"], values["entropy_coef"]
        if not low <= coef <= high or not low < high:
            raise QAEUserError(
                f"entropy-coef: {coef} must start inside [entropy-coef-min, entropy-coef-max] = "
                f"[{low}, {high}], a range that is not empty. Use a starting coefficient in it, e.g. "
                f"{low}."
            )


def gated_skip_exact(policy_loss: str, entropy_coef: float, entropy_target: float | None) -> bool:
    """Whether leaving advantage-0 responses out of the forward/backward gives the dense update: the loss's record
    says so, and no entropy bonus can be on (it gives every token a gradient)."""
    return POLICY_LOSSES[policy_loss].gated_skip_exact and entropy_coef == 0.0 and entropy_target is None
