"""The advantage estimators of `qae train --estimator`, one record each: name, help, whether it reads K, its advantage
scaling without --scale, its reference, and its own option rules (`validate`).

Torch-free, so the CLI help, the config's checks, `qae sweep`, `qae compare` and the dashboard read the records
without loading torch. The implementations register against them: `algo.advantages.register_estimator("qae")` refuses
a name with no record here, and a second registration of a name. Whatever reads K or a default scale asks the record
(`ESTIMATORS[name].reads_k`), so a new estimator is described here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from qae_app.core.errors import QAEUserError
from qae_app.core.names import DEFAULT_K, QUANTILE_METHODS, SCALE_METHODS


@dataclass(frozen=True)
class EstimatorRecord:
    """One advantage estimator, as `--estimator` names it."""

    name: str
    help: str  # one line: what its baseline and scaling are (the CLI's choices)
    reads_k: bool  # its baseline depends on K and --quantile; a mean baseline reads neither, and is never given them
    default_scale: str  # the advantage scaling without --scale (names.SCALE_METHODS)
    reference: str  # where its formula comes from
    scale_fixed: str = ""  # why --scale cannot change its scaling, and what to use instead ("": --scale may)

    def validate(self, k: float | None, quantile: str, scale: str | None) -> None:
        """This estimator's option rules, each broken one a QAEUserError naming the option: K a quantile level in
        (0, 1) (`k` None: not chosen yet, --k auto), a known --quantile and --scale, and a --scale that does not
        contradict its definition."""
        if k is not None and not 0.0 < k < 1.0:  # (nan too: it compares False)
            raise QAEUserError(
                f"k: {k} is outside (0, 1). QAE's K is a quantile level; the paper uses {DEFAULT_K} "
                "(lower K pushes entropy up, higher K pushes it down)."
            )
        if quantile not in QUANTILE_METHODS:
            raise QAEUserError(f"quantile: unknown value '{quantile}'. Choose one of: {', '.join(QUANTILE_METHODS)}.")
        if scale is not None and scale not in SCALE_METHODS:
            raise QAEUserError(f"scale: unknown value '{scale}'. Choose one of: {', '.join(SCALE_METHODS)}.")
        if scale is not None and scale != self.default_scale and self.scale_fixed:
            raise QAEUserError(f"scale: {self.scale_fixed}")

    def scale(self, scale: str | None) -> str:
        """The advantage scaling a run uses: `--scale` when given, else this estimator's own."""
        return scale or self.default_scale

    def k_in_use(self, k: float | None) -> float | None:
        """The K a run trains with, given the run's K (`k`: its --k, or what --k auto chose at step 1; None before
        then): that K for an estimator that reads K, None for a mean baseline (K means nothing to it, whatever --k
        says). What the run's row and each step's row store, and what `qae compare` groups by."""
        return k if self.reads_k else None

    def split_k(self, k: float | None) -> float:
        """The K that splits groups into hard and easy (dH's regimes, the entropy attribution's): the K in use for
        an estimator that reads K, DEFAULT_K for a mean baseline, so runs of every estimator split their groups
        alike and compare."""
        return k if self.reads_k and k is not None else DEFAULT_K


ESTIMATORS: dict[str, EstimatorRecord] = {}


def add_record(record: EstimatorRecord) -> EstimatorRecord:
    """Put `record` in ESTIMATORS; a second record of a name would silently replace the first, so it raises."""
    if record.name in ESTIMATORS:
        raise ValueError(f"estimator '{record.name}' has a record already: {ESTIMATORS[record.name].help}")
    if record.default_scale not in SCALE_METHODS:
        raise ValueError(
            f"estimator '{record.name}': default scale '{record.default_scale}' is not one of "
            f"{', '.join(SCALE_METHODS)}"
        )
    ESTIMATORS[record.name] = record
    return record


for _record in (
    EstimatorRecord(
        "qae",
        "group K-quantile baseline (paper rule by default), std-normalized; gates ~80% of responses to zero",
        reads_k=True,
        default_scale="std",
        reference="Quantile Advantage Estimation, arXiv 2509.22611 (the paper's lower quantile; its official code's "
        "linear one as --quantile linear)",
    ),
    EstimatorRecord(
        "grpo",
        "group mean baseline, std-normalized (DeepSeekMath GRPO, DAPO)",
        reads_k=False,
        default_scale="std",
        reference="Shao et al. 2024, DeepSeekMath, arXiv 2402.03300; verl's compute_grpo_outcome_advantage",
    ),
    EstimatorRecord(
        "dr_grpo",
        "group mean baseline, no std normalization (Dr. GRPO)",
        reads_k=False,
        default_scale="none",
        reference="Liu et al. 2025, Understanding R1-Zero-Like Training, arXiv 2503.20783 (verl: grpo with "
        "norm_adv_by_std_in_grpo=False)",
        scale_fixed="dr_grpo is GRPO without the std normalization, so --scale std contradicts it. Use --estimator "
        "grpo for the std-normalized mean baseline.",
    ),
    EstimatorRecord(
        "rloo",
        "leave-one-out mean of the other G-1 rewards (RLOO); the baseline column shows the group mean",
        reads_k=False,
        default_scale="none",
        reference="Ahmadian et al. 2024, Back to Basics, arXiv 2402.14740; verl's compute_rloo_outcome_advantage",
    ),
):
    add_record(_record)


def estimator_help() -> dict[str, str]:
    """name -> help of every estimator: the CLI's choices and help text."""
    return {name: record.help for name, record in ESTIMATORS.items()}
