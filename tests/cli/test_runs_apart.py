"""`qae runs` tells runs apart by what differs (issue 39): a run made with `--dynamic-sampling` and one made with
`--log-entropy-attribution` listed identically (`qae K=0.4 20/20`). Now each run's options that vary across the
listing are printed under its id, and the options every run shares (not their defaults) once above the table; at 60,
80 and 160 columns (snapshots in snapshots/runs-apart-*.txt, runs written through the real store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli_views import check_fits, check_snapshot, invoke, normalized
from tests.synthetic import write_run

DYNAMIC, ATTRIBUTION = "20261130-113105-qae", "20261130-113512-qae"
SWEEP = {"sweep_id": "3f9a1c77aa", "sweep_name": "sweep-3f9a1c"}
SEEDS = {f"sweep-3f9a1c-qae-k0.4-s{seed}": seed for seed in (0, 1)}


@pytest.fixture(scope="module")
def apart_cwd(tmp_path_factory) -> Path:
    """Two runs of default-style ids that differ only in a switch each, and two seeds of a sweep."""
    cwd = tmp_path_factory.mktemp("apart")
    runs = cwd / "runs"
    write_run(runs, DYNAMIC, steps=20, prompts_per_step=2, group_size=4, config={"dynamic_sampling": True})
    write_run(runs, ATTRIBUTION, steps=20, prompts_per_step=2, group_size=4, config={"log_entropy_attribution": True})
    for run_id, seed in SEEDS.items():
        write_run(runs, run_id, steps=4, prompts_per_step=2, group_size=4, seed=seed, config=SWEEP)
    return cwd


def under(text: str, run_id: str, others: list[str]) -> str:
    """What the listing prints from `run_id` up to the next run's id (its row and the lines under it)."""
    start = text.index(run_id) + len(run_id)
    ends = [text.index(other, start) for other in others if other != run_id and other in text[start:]]
    block = text[start : min(ends, default=len(text))]
    return " ".join(block.split())


@pytest.mark.parametrize("width", (60, 80, 160))
def test_runs_says_what_tells_each_run_apart(apart_cwd, width):
    text = normalized(invoke(apart_cwd, width, "runs"))
    check_fits(text, width)
    check_snapshot(f"runs-apart-{width}", text)
    ids = [DYNAMIC, ATTRIBUTION, *SEEDS]
    assert "dynamic_sampling" in under(text, DYNAMIC, ids) and "log_entropy" not in under(text, DYNAMIC, ids)
    assert "log_entropy_attribution" in under(text, ATTRIBUTION, ids)
    assert "dynamic_sampling" not in under(text, ATTRIBUTION, ids)
    for run_id, seed in SEEDS.items():  # the sweep's seeds, seed 0 too; its id and name only label the runs
        assert f"seed={seed}" in under(text, run_id, ids)
    assert "sweep_" not in text
    # what every run shares and is not the default, once: write_run's sizes, lr, entropy band and evaluations
    flat = " ".join(text.split())
    assert (
        "every run below: group_size=4, prompts_per_step=2, lr=1e-05, entropy_low=0.5, entropy_high=3, "
        "eval_every=0 (not the defaults)"
    ) in flat
    assert flat.count("lr=1e-05") == 1
    assert "…" not in text
