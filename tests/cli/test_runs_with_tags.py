"""`qae runs` at 80 columns keeps each run's numbers when runs have tags: the tags column is less important than
reward, held-out accuracy and entropy, so it gives way first (and is named under the table). Checked to fail before:
the tags column came before the numbers, and at 80 columns eight tagged sweep runs were listed with no number at all
(reward_mean, heldout_accuracy and entropy named as not shown)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from tests.cli.test_cli_views import check_fits, invoke
from tests.synthetic import write_run

SWEEP = {"sweep_id": "3f9a1c77aa", "sweep_name": "sweep-3f9a1c"}


@pytest.fixture(scope="module")
def tagged_cwd(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("tagged")
    runs = cwd / "runs"
    for seed in range(8):
        run_id = f"sweep-3f9a1c-qae-k0.4-s{seed}"
        write_run(runs, run_id, steps=4, prompts_per_step=2, group_size=4, seed=seed, eval_every=2, config=SWEEP)
        tagged = CliRunner().invoke(app, ["tag", run_id, "baseline", "lr-sweep-2026-12", "--runs-dir", str(runs)])
        assert tagged.exit_code == 0, tagged.output
    return cwd


@pytest.mark.parametrize("width", (80, 100))
def test_tagged_runs_keep_their_numbers(tagged_cwd, width):
    text = invoke(tagged_cwd, width, "runs")
    check_fits(text, width)
    header = "\n".join(text.splitlines()[:8])
    for name in ("reward_", "heldout_", "entropy"):
        assert name in header, text
    assert "not shown at" not in text or "reward_mean" not in text.split("not shown at")[1].split("\n")[0]
    assert len(text.splitlines()) < 40, text  # one or two lines a run, not a column of wrapped options
