"""The paper's main table (QAE, arXiv 2509.22611, Table 2) from a comparison: one row per policy loss; per metric the
base estimator's mean over seeds, the same loss with QAE, and QAE minus the base paired by seed, each with its
interval under the one statistics rule (`run_comparison.shown`: none below `MIN_SEEDS` seeds).

It applies to groups that form the bake-off grid (`qae sweep --policy-loss clip,clip_cov,kl_cov,gspo --estimator
grpo,qae`): two or more policy losses, for each exactly one QAE group and one group of the base estimator, the same
base estimator for every loss. Any other set of groups (one loss among them: the usual tables already are its row)
has no such table (`loss_table` gives None) and `qae compare` prints only its usual ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qae_app.analysis.run_comparison import (
    RUN_METRIC_BOUNDS,
    RUN_METRICS,
    Estimate,
    PairedDifference,
    RunGroup,
    estimate_json,
    paired_difference,
)
from qae_app.core.policy_losses import DEFAULT_POLICY_LOSS, POLICY_LOSSES

QAE = "qae"
# the table's metrics, in the order the paper's reader asks them: accuracy, then what happened to entropy
TABLE_METRICS = ("final_heldout", "best_heldout", "entropy_last", "entropy_range", "zero_adv")


@dataclass
class LossRow:
    """One policy loss: its base group, its QAE group, and per metric (base, + QAE, QAE - base)."""

    policy_loss: str
    base: RunGroup
    qae: RunGroup
    cells: dict[str, tuple[Estimate, Estimate, PairedDifference]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "policy_loss": self.policy_loss,
            "base": self.base.label,
            "qae": self.qae.label,
            "metrics": {
                name: {"base": estimate_json(base), "qae": estimate_json(qae), "difference": estimate_json(difference)}
                for name, (base, qae, difference) in self.cells.items()
            },
        }


@dataclass
class LossTable:
    base_estimator: str  # the estimator QAE is compared with (grpo in the paper's DAPO runs)
    rows: list[LossRow]

    def to_dict(self) -> dict:
        return {
            "base_estimator": self.base_estimator,
            "metrics": {name: RUN_METRICS[name] for name in TABLE_METRICS},
            "rows": [row.to_dict() for row in self.rows],
        }


def group_loss(group: RunGroup) -> str:
    """The group's policy loss (a config stored before --policy-loss trained with clip, and the group key leaves the
    default out)."""
    return str(group.config.get("policy_loss", DEFAULT_POLICY_LOSS))


def loss_table(groups: list[RunGroup]) -> LossTable | None:
    """The table, or None where the groups are not the grid (one loss, a loss without both estimators, two groups of
    one loss and estimator, or two base estimators). Rows follow the losses' registry order (clip first)."""
    by_loss: dict[str, dict[str, RunGroup]] = {}
    for group in groups:
        cell = by_loss.setdefault(group_loss(group), {})
        estimator = str(group.config.get("estimator"))
        if estimator in cell:
            return None  # two groups of one loss and estimator (two Ks, or another option apart): no single row
        cell[estimator] = group
    bases = {estimator for cell in by_loss.values() for estimator in cell if estimator != QAE}
    if len(by_loss) < 2 or len(bases) != 1 or any(set(cell) != {QAE, *bases} for cell in by_loss.values()):
        return None
    base = bases.pop()
    order = [name for name in POLICY_LOSSES if name in by_loss] + sorted(set(by_loss) - set(POLICY_LOSSES))
    rows = []
    for loss in order:
        row = LossRow(loss, by_loss[loss][base], by_loss[loss][QAE])
        for name in TABLE_METRICS:
            row.cells[name] = (
                row.base.metrics[name],
                row.qae.metrics[name],
                paired_difference(row.qae.per_run[name], row.base.per_run[name], RUN_METRIC_BOUNDS[name]),
            )
        rows.append(row)
    return LossTable(base, rows)
