"""Tags as a grouping key (issue 38): `qae compare --group-by tags` groups runs by their `qae tag` tags instead of by
their config, `--baseline` names a tag, and `--group-by` takes config keys too; a key no run has is one clear error.
Runs written through the real store, tagged through the real CLI; the expected means read from their DuckDB files."""

from __future__ import annotations

import json

import duckdb
import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from tests.synthetic import write_run

runner = CliRunner()
# four runs of two configs (K 0.4 and K 0.6, seeds 0 and 1); the tags cut across the configs
TAGGED = {
    "a-s0": (0.4, 0, ["baseline"]),
    "a-s1": (0.4, 1, ["baseline"]),
    "b-s0": (0.6, 0, ["idea", "lr-high"]),
    "b-s1": (0.4, 1, ["idea", "lr-high"]),
}


def qae(*args, runs_dir):
    result = runner.invoke(app, [*args, "--runs-dir", str(runs_dir)], env={"COLUMNS": "200"})
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("tagged") / "runs"
    for run_id, (k, seed, tags) in TAGGED.items():
        write_run(runs_dir, run_id, steps=5, prompts_per_step=2, group_size=4, k=k, seed=seed + 10 * (k == 0.6))
        assert qae("tag", run_id, *tags, runs_dir=runs_dir)[0] == 0
    write_run(runs_dir, "untagged", steps=5, prompts_per_step=2, group_size=4, seed=0)
    return runs_dir


def mean_gated_fraction(runs_dir, run_ids) -> float:
    """The `zero_adv` run metric by hand: each run's mean frac_zero_adv over its steps, averaged over the runs."""
    per_run = []
    for run_id in run_ids:
        with duckdb.connect(str(runs_dir / run_id / "qae.duckdb"), read_only=True) as con:
            per_run.append(con.execute("SELECT avg(frac_zero_adv) FROM steps").fetchone()[0])
    return sum(per_run) / len(per_run)


def test_compare_groups_by_tags_and_takes_a_tag_as_the_baseline(runs):
    code, out = qae(
        "compare", *TAGGED, "untagged", "--group-by", "tags", "--baseline", "baseline", "--json", runs_dir=runs
    )
    assert code == 0, out
    result = json.loads(out)
    groups = {group["label"]: group for group in result["groups"]}
    assert {label: sorted(group["runs"]) for label, group in groups.items()} == {
        "tags=baseline": ["a-s0", "a-s1"],
        "tags=idea+lr-high": ["b-s0", "b-s1"],
        "tags=(none)": ["untagged"],
    }
    for label, run_ids in (("tags=baseline", ["a-s0", "a-s1"]), ("tags=idea+lr-high", ["b-s0", "b-s1"])):
        assert groups[label]["metrics"]["zero_adv"]["mean"] == pytest.approx(mean_gated_fraction(runs, run_ids))
    assert result["baseline"] == "tags=baseline"
    # paired by seed: b-s1 (seed 1) against a-s1, b-s0 (seed 10) has no partner
    difference = result["differences"]["tags=idea+lr-high"]["zero_adv"]
    assert difference["seeds"] == [1]


def test_group_by_takes_config_keys_and_tags_together(runs):
    code, out = qae("compare", *TAGGED, "--group-by", "k,tags", "--json", runs_dir=runs)
    assert code == 0, out
    labels = sorted(group["label"] for group in json.loads(out)["groups"])
    assert labels == ["k=0.4, tags=baseline", "k=0.4, tags=idea+lr-high", "k=0.6, tags=idea+lr-high"]


def test_without_group_by_tags_do_not_split_a_config(runs):
    code, out = qae("compare", "a-s0", "a-s1", "b-s1", "--json", runs_dir=runs)
    assert code == 0, out
    assert [sorted(group["runs"]) for group in json.loads(out)["groups"]] == [["a-s0", "a-s1"]]
    assert json.loads(out)["groups"][0]["excluded"] == {"b-s1": "seed 1 again: a-s1 is counted for it"}


def test_a_group_by_key_no_run_has_is_one_clear_error(runs):
    code, out = qae("compare", *TAGGED, "--group-by", "tag", runs_dir=runs)
    assert code == 2
    said = " ".join(out.split())
    assert "group-by: 'tag' is neither tags nor a config key of these runs" in said and "Use tags" in said
