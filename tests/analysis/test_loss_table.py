"""The paper's layout of a bake-off (analysis/loss_table.py) on a planted grid whose every cell is computed by hand:
two policy losses x (grpo, qae) x seeds, one row per loss, base / + QAE / paired difference per metric."""

import math

import pytest

from qae_app.analysis.loss_table import TABLE_METRICS, loss_table
from qae_app.analysis.run_comparison import RunRecord, group_runs, shown
from qae_app.config import TrainConfig
from tests.analysis.test_compare import _steps

T_975_2 = 4.302652729911275  # t(0.975, 2 degrees of freedom)


def _run(
    loss: str, estimator: str, seed: int, final: float, entropy: list[float], zero_adv: float, k: str = "0.4"
) -> RunRecord:
    config = {**TrainConfig(policy_loss=loss, estimator=estimator, k=k).to_dict(), "seed": seed}
    steps = _steps(n=4, heldout={2: final - 0.2, 4: final}, entropy=entropy, zero_adv=[zero_adv] * 4)
    return RunRecord(f"{loss}-{estimator}-s{seed}", config, seed, steps)


def _grid() -> list[RunRecord]:
    runs = []
    for seed, (base, qae) in enumerate([(0.5, 0.6), (0.5, 0.7), (0.7, 0.8)]):
        for loss in ("kl_cov", "clip"):  # (kl_cov first: the rows still follow the registry, clip first)
            runs.append(_run(loss, "grpo", seed, base, [1.0, 0.8, 0.6, 0.4], 0.3))
            if loss == "clip" or seed < 2:  # kl_cov + QAE: two seeds only
                runs.append(_run(loss, "qae", seed, qae, [1.0, 1.0, 0.9, 0.9 + 0.1 * seed], 0.8))
    return runs


def test_each_loss_row_gives_base_qae_and_their_paired_difference_by_hand():
    table = loss_table(group_runs(_grid()))
    assert table is not None and table.base_estimator == "grpo"
    assert [row.policy_loss for row in table.rows] == ["clip", "kl_cov"]
    clip = table.rows[0]
    assert clip.base.label.startswith("estimator=grpo") and clip.qae.label.startswith("estimator=qae")
    assert list(clip.cells) == list(TABLE_METRICS)
    base, qae, difference = clip.cells["final_heldout"]
    assert base.mean == pytest.approx(17 / 30) and qae.mean == pytest.approx(0.7)
    # paired differences 0.1, 0.2, 0.1: mean 2/15, sd 1/sqrt(300), t = 4 on 2 degrees of freedom
    half = T_975_2 * (1 / math.sqrt(300)) / math.sqrt(3)
    assert difference.mean == pytest.approx(2 / 15) and difference.seeds == [0, 1, 2]
    assert shown(difference).interval == pytest.approx((2 / 15 - half, 2 / 15 + half))
    assert difference.p_value == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-9)
    assert clip.cells["best_heldout"][1].mean == pytest.approx(0.7)  # the last evaluation is each run's best
    # entropy at the end: the last 2 of 4 steps; grpo (0.6 + 0.4) / 2, qae 0.9, 0.95, 1.0 by seed
    assert clip.cells["entropy_last"][0].mean == pytest.approx(0.5)
    assert clip.cells["entropy_last"][1].mean == pytest.approx(0.95)
    # entropy range over the run: grpo 1.0 - 0.4 on every seed; qae 0.1, 0.1 and 1.1 - 0.9
    base, qae, difference = clip.cells["entropy_range"]
    assert base.mean == pytest.approx(0.6) and qae.mean == pytest.approx(0.4 / 3)
    assert difference.mean == pytest.approx((-0.5 - 0.5 - 0.4) / 3)
    # the zero-advantage share: 0.8 - 0.3 on every seed, tied: a mean without an interval
    difference = clip.cells["zero_adv"][2]
    assert difference.mean == pytest.approx(0.5)
    assert shown(difference).interval is None
    assert shown(difference).no_interval == "all 3 seeds tied: no spread to measure"


def test_below_three_paired_seeds_a_row_has_no_interval():
    kl_cov = loss_table(group_runs(_grid())).rows[1]
    base, qae, difference = kl_cov.cells["final_heldout"]
    assert shown(base).interval is not None  # grpo: 3 seeds
    assert qae.n == 2 and shown(qae).interval is None and shown(qae).no_interval == "n=2: no interval"
    assert difference.seeds == [0, 1] and difference.mean == pytest.approx(0.15)
    assert shown(difference).interval is None and shown(difference).p_value is None


def test_groups_that_are_not_the_grid_have_no_table():
    grid = _grid()
    assert loss_table(group_runs([run for run in grid if not run.run_id.startswith("kl_cov-qae")])) is None
    another_k = [*grid, _run("clip", "qae", 0, 0.6, [1.0] * 4, 0.8, k="0.3")]
    assert loss_table(group_runs(another_k)) is None  # two QAE groups for clip: which is the row's?
    clip = [run for run in grid if run.run_id.startswith("clip")]
    assert loss_table(group_runs(clip)) is None  # one loss: the usual tables are its row
    third = [*grid, *(_run(loss, "rloo", 0, 0.6, [1.0] * 4, 0.3) for loss in ("clip", "kl_cov"))]
    assert loss_table(group_runs(third)) is None  # two base estimators


def test_a_groups_label_names_the_default_loss_and_a_loss_without_an_option_says_dash():
    """A clip run stores policy_loss 'clip' (counted as the key's absence, so runs from before --policy-loss group
    with it); its label still says clip. A kl_cov run has no clip_low: its label says '-', as for any absent key,
    not Python's None."""
    groups = group_runs(_grid())
    labels = {g.label for g in groups}
    assert "estimator=grpo, clip_high=0.28, clip_low=0.2, kl_cov_coef=-, kl_cov_ratio=-, policy_loss=clip" in labels
    assert "estimator=grpo, clip_high=-, clip_low=-, kl_cov_coef=1.0, kl_cov_ratio=0.002, policy_loss=kl_cov" in labels
    assert not any("None" in label for label in labels)
