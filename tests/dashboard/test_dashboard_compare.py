"""The dashboard's Compare page (AppTest) on real DuckDB run files written through `RunWriter` with known
values: a sweep of 2 estimators x 3 seeds and runs outside it. The table's intervals and paired differences, the
curves' bands and the URL's choices are checked against hand computations; the curve aggregation on its own too."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from qae_app.analysis import run_comparison
from qae_app.cli.main import app
from qae_app.config import TrainConfig
from qae_app.store.run_folder import CONFIG_FILE, db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter
from tests.dashboard.helpers import charts, make_app, plotly_specs, texts
from tests.synthetic import write_run

T_975_2 = 4.3026527  # Student t, 97.5% quantile, 2 degrees of freedom (table value)
SWEEP_ID, SWEEP_NAME = "a1b2c3d4e5", "study"
# held-out accuracy at steps 0 (the evaluation before training, in `evals` only), 2 and 4, per estimator and seed
HELDOUT = {
    "qae": {0: {0: 0.2, 2: 0.5, 4: 0.6}, 1: {0: 0.2, 2: 0.5, 4: 0.7}, 2: {0: 0.2, 2: 0.6, 4: 0.8}},
    "grpo": {0: {0: 0.2, 2: 0.4, 4: 0.5}, 1: {0: 0.2, 2: 0.5, 4: 0.5}, 2: {0: 0.2, 2: 0.5, 4: 0.7}},
}
STEPS = (1, 2, 3, 4)


def entropy(estimator: str, seed: int, step: int) -> float:
    return {"qae": 1.0 - 0.1 * step + 0.1 * (seed - 1), "grpo": 1.0 - 0.2 * step + 0.05 * seed}[estimator]


def frac_zero_adv(estimator: str, seed: int, step: int) -> float:
    return {"qae": 0.5 + 0.1 * seed, "grpo": 0.3 + 0.05 * step}[estimator]


def write_compare_run(runs_dir: Path, run_id: str, heldout: dict[int, float] | None, values, **config) -> None:
    """A finished run as the trainer stores it: config.json and the runs row with the full TrainConfig, one steps row
    per step (`values(step)` -> entropy, frac_zero_adv), held-out evaluations (`heldout`: step -> avg@k) in `evals` and,
    after step 0, in the steps' heldout_accuracy."""
    cfg = {**TrainConfig().to_dict(), "run_name": run_id, **config}
    writer = RunWriter(db_path(runs_dir, run_id), run_id)
    writer.create_run(run_id, cfg, cfg["estimator"], None, cfg["model"], cfg["data"], cfg["seed"])
    (runs_dir / run_id / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))

    def evals(step: int) -> list[dict]:
        return (
            [
                dict(
                    benchmark="heldout",
                    subset="all",
                    metric="avg@k",
                    k=4,
                    value=heldout[step],
                    n_problems=10,
                    source="train",
                )
            ]
            if heldout and step in heldout
            else []
        )

    if heldout and 0 in heldout:
        writer.add_step(0, evals=evals(0))
    for step in STEPS:
        row = {name: None for name in STEP_METRICS}
        row.update(step_s=1.0, heldout_accuracy=(heldout or {}).get(step))
        row["entropy"], row["frac_zero_adv"] = values(step)
        writer.add_step(step, steps=[row], evals=evals(step))
    assert writer.flush()
    writer.update_run(status="finished")


def write_compare_runs(runs_dir: Path) -> Path:
    """The sweep `study` (qae and grpo, seeds 0-2, held-out at 0, 2, 4) and `solo`, the one run of the sweep `other`,
    with another lr and no held-out evaluation."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    for estimator, by_seed in HELDOUT.items():
        for seed, heldout in by_seed.items():
            write_compare_run(
                runs_dir,
                f"study-{estimator}-s{seed}",
                heldout,
                lambda step, e=estimator, s=seed: (entropy(e, s, step), frac_zero_adv(e, s, step)),
                estimator=estimator,
                seed=seed,
                eval_every=2,
                sweep_id=SWEEP_ID,
                sweep_name=SWEEP_NAME,
            )
    write_compare_run(
        runs_dir, "solo", None, lambda step: (1.0 - 0.1 * step, 0.4), lr=1e-4, sweep_id="ffffffffff", sweep_name="other"
    )
    return runs_dir


@pytest.fixture(scope="module")
def compare_dir(tmp_path_factory) -> Path:
    return write_compare_runs(tmp_path_factory.mktemp("compare_runs"))


@pytest.fixture
def compare_app(compare_dir, monkeypatch):
    return make_app(compare_dir, monkeypatch)


def interval_text(values: list[float]) -> str:
    """'mean [low, high]' of three values, by hand: t_{0.975, 2} * sd / sqrt(3) either side."""
    mean = sum(values) / 3
    half = T_975_2 * math.sqrt(sum((v - mean) ** 2 for v in values) / 2) / math.sqrt(3)
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def by_metric(at, first_row: str = "n") -> pd.DataFrame | None:
    """The page's table as shown (a row per metric, a column per group) whose first row is `first_row`: n for the
    groups, paired seeds for the differences from the baseline; None if there is none."""
    return next(
        (
            frame.value
            for frame in at.dataframe
            if list(frame.value.columns)[:1] == ["metric"] and frame.value["metric"].iloc[0] == first_row
        ),
        None,
    )


def by_group(at, first_row: str = "n") -> pd.DataFrame:
    """The page's table back as a row per group, `n` as a number."""
    shown = by_metric(at, first_row)
    table = shown.set_index("metric").T.rename_axis("group").reset_index()
    return table.assign(n=table["n"].astype(int)) if "n" in table else table


def finals(estimator: str) -> list[float]:
    return [HELDOUT[estimator][seed][4] for seed in range(3)]


# ---------------------------------------------------------------------------------------------------------------
# the curve aggregation


def test_across_seeds_by_hand():
    curves = [
        pd.DataFrame({"step": [0, 1, 2], "value": [0.2, 0.8, 1.0]}),
        pd.DataFrame({"step": [0, 1, 2], "value": [0.2, 0.9, None]}),  # no value at step 2
        pd.DataFrame({"step": [0, 1], "value": [0.2, 1.0]}),
    ]
    out = charts.across_seeds(curves).set_index("step")
    assert out["n"].tolist() == [3, 3, 1]
    assert out["mean"].tolist() == pytest.approx([0.2, 0.9, 1.0])
    # step 1: 0.8, 0.9, 1.0 -> sd 0.1, half-width t_{0.975,2} * 0.1 / sqrt(3); step 0: no spread; step 2: one run
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert out.loc[1, "low"] == pytest.approx(0.9 - half, abs=1e-6)
    assert out.loc[1, "high"] == pytest.approx(0.9 + half, abs=1e-6)
    assert out.loc[0, "low"] == pytest.approx(0.2) and out.loc[0, "high"] == pytest.approx(0.2)
    assert math.isnan(out.loc[2, "low"]) and math.isnan(out.loc[2, "high"])
    spread = charts.across_seeds(curves, "min-max").set_index("step")
    assert spread.loc[1, ["low", "high"]].tolist() == pytest.approx([0.8, 1.0])
    assert math.isnan(spread.loc[2, "low"])
    # two runs: t_{0.975,1} = 12.706: values 1 and 2 give 1.5 +- 12.706 * 0.7071 / 1.4142
    two = charts.across_seeds(
        [pd.DataFrame({"step": [5], "value": [1.0]}), pd.DataFrame({"step": [5], "value": [2.0]})]
    )
    assert two["low"].iloc[0] == pytest.approx(1.5 - 12.7062047 * 0.5, abs=1e-6)
    assert charts.across_seeds([]).empty
    with pytest.raises(ValueError, match="band"):
        charts.across_seeds(curves, "sd")


def test_a_band_stays_within_the_values_the_metric_can_take():
    """A fraction's mean lies in [0, 1] whatever its interval says: with 3 seeds the t quantile is 4.3 and the
    interval of a gated fraction reached -0.5 on the study's chain sweep. The band is cut at the bounds; the mean
    and the rows without a band are unchanged."""
    curves = [
        pd.DataFrame({"step": [0, 1, 2], "value": [0.2, 0.8, 1.0]}),
        pd.DataFrame({"step": [0, 1, 2], "value": [0.0, 0.9, None]}),
        pd.DataFrame({"step": [0, 1], "value": [0.1, 1.0]}),
    ]
    free = charts.across_seeds(curves).set_index("step")
    bounded = charts.across_seeds(curves, bounds=(0.0, 1.0)).set_index("step")
    assert free.loc[1, "high"] > 1 and free.loc[0, "low"] < 0  # the case: both ends leave [0, 1]
    assert bounded.loc[1, "high"] == 1.0 and bounded.loc[1, "low"] == pytest.approx(free.loc[1, "low"])
    assert bounded.loc[0, "low"] == 0.0 and bounded.loc[0, "high"] == pytest.approx(free.loc[0, "high"])
    assert bounded["mean"].tolist() == pytest.approx(free["mean"].tolist())
    assert math.isnan(bounded.loc[2, "low"]) and math.isnan(bounded.loc[2, "high"])
    lower_only = charts.across_seeds(curves, bounds=(0.0, None)).set_index("step")
    assert lower_only.loc[0, "low"] == 0.0 and lower_only.loc[1, "high"] == pytest.approx(free.loc[1, "high"])


# ---------------------------------------------------------------------------------------------------------------
# the page


def test_sweep_table_matches_the_hand_computed_intervals(compare_app):
    at = compare_app("compare", sweep=SWEEP_NAME)
    # a row per metric and a column per group: every metric stays in view at 1400 px (ten columns of intervals ran
    # off the page), whatever the number of metrics
    shown = by_metric(at)
    assert list(shown.columns) == ["metric", "estimator=grpo", "estimator=qae"]
    assert {"zero_adv", "dH_easy", "dH_hard", "step_s"} <= set(shown["metric"])
    table = by_group(at).set_index("group")
    assert list(table.index) == ["estimator=grpo", "estimator=qae"]  # by run name, as `qae compare --sweep`
    assert table["n"].tolist() == [3, 3] and table.loc["estimator=qae", "seeds"] == "0, 1, 2"
    assert table.loc["estimator=qae", "final_heldout"] == interval_text(finals("qae")) == "0.700 [0.452, 0.948]"
    assert table.loc["estimator=grpo", "final_heldout"] == interval_text(finals("grpo"))
    # area under 0.2 -> 0.5 -> 0.6 over steps 0, 2, 4 (seed 0): (2 * 0.35 + 2 * 0.55) / 4 = 0.45
    aucs = [(HELDOUT["qae"][s][0] + 2 * HELDOUT["qae"][s][2] + HELDOUT["qae"][s][4]) / 4 for s in range(3)]
    assert aucs[0] == pytest.approx(0.45)
    assert table.loc["estimator=qae", "auc_heldout"] == interval_text(aucs)
    # zero-advantage fraction: qae seeds 0.5, 0.6, 0.7 at every step
    assert table.loc["estimator=qae", "zero_adv"] == interval_text([0.5, 0.6, 0.7])
    assert "n=3: few seeds" in table.loc["estimator=qae", "note"]
    assert "the 95% interval is wide" in texts(at)
    assert at.selectbox(key="sweep").value == SWEEP_NAME
    assert at.selectbox(key="sweep").options == ["other", "study"]  # newest first
    assert not at.warning


def test_baseline_adds_the_paired_difference_and_p_value(compare_app):
    at = compare_app("compare", sweep=SWEEP_NAME)
    assert by_metric(at, "paired seeds") is None
    at.selectbox(key="baseline").set_value("estimator=grpo").run()
    differences = by_group(at, "paired seeds")
    assert differences["group"].tolist() == ["estimator=qae"] and differences["paired seeds"].tolist() == ["0, 1, 2"]
    # qae - grpo by seed: 0.1, 0.2, 0.1 -> mean 2/15, sd 1/sqrt(300), t = 4 on 2 df: p = 1 - 4 / sqrt(18)
    half = T_975_2 / math.sqrt(300) / math.sqrt(3)
    p = 1 - 4 / math.sqrt(18)
    expected = f"+{2 / 15:.3f} [{2 / 15 - half:.3f}, {2 / 15 + half:.3f}] p={p:.3g}"
    assert differences["final_heldout"].iloc[0] == expected == "+0.133 [-0.010, 0.277] p=0.0572"
    assert "Minus the baseline estimator=grpo" in texts(at)


def test_a_link_with_the_sweep_id_and_a_short_baseline(compare_app):
    # a sweep's id where the picker lists names, and a baseline given as a value only one group has: resolved as
    # `qae compare --sweep ID --baseline grpo` resolves them, and kept in the URL as the link gave them
    at = compare_app("compare", sweep=SWEEP_ID, baseline="grpo")
    assert at.selectbox(key="sweep").value == SWEEP_ID and at.selectbox(key="baseline").value == "grpo"
    assert f"sweep id {SWEEP_ID}: 6 run(s)" in texts(at)
    assert by_group(at)["n"].tolist() == [3, 3]
    assert by_group(at, "paired seeds")["group"].tolist() == ["estimator=qae"]
    assert "Minus the baseline estimator=grpo" in texts(at)
    assert (at.query_params["sweep"], at.query_params["baseline"]) in [(SWEEP_ID, "grpo"), ([SWEEP_ID], ["grpo"])]
    assert not at.warning


def test_a_link_names_the_runs(compare_app):
    # the a,b,c form: two groups of two seeds and one
    at = compare_app("compare", runs="study-qae-s0,study-qae-s1,study-grpo-s2")
    assert at.selectbox(key="sweep").value is None
    table = by_group(at).set_index("group")
    assert table["n"].to_dict() == {"estimator=qae": 2, "estimator=grpo": 1}
    assert table.loc["estimator=grpo", "final_heldout"] == "0.700"  # one seed: its value, no interval
    assert "n=1: one seed, no interval" in table.loc["estimator=grpo", "note"]
    # repeated parameters, as the page writes them; groups of other setups are labelled by what differs
    at = compare_app("compare", runs=["study-qae-s2", "solo"])
    assert at.multiselect(key="run").value == ["study-qae-s2", "solo"]  # (an older link: read as ?run=)
    assert by_group(at)["group"].tolist() == ["lr=5e-05", "lr=0.0001"]
    # one name on every page: ?run= names the runs Compare compares, as it names those the other pages show
    at = compare_app("compare", run=["study-qae-s2", "solo"])
    assert at.multiselect(key="run").value == ["study-qae-s2", "solo"] and "runs" not in at.query_params
    assert by_group(at)["group"].tolist() == ["lr=5e-05", "lr=0.0001"]


def test_curves_are_the_mean_with_a_band_across_seeds(compare_app):
    at = compare_app("compare", sweep=SWEEP_NAME, band="t-interval")
    specs = plotly_specs(at)
    assert {"compare_heldout_accuracy", "compare_entropy", "compare_frac_zero_adv"} <= set(specs)
    entropy_traces = {t["uid"]: t for t in specs["compare_entropy"]["data"]}
    qae = entropy_traces["estimator=qae"]
    assert list(qae["x"]) == list(STEPS)
    assert qae["y"] == pytest.approx([entropy("qae", 1, step) for step in STEPS])  # seeds -0.1, 0, +0.1 around s=1
    band = entropy_traces["estimator=qae · band"]
    half = T_975_2 * 0.1 / math.sqrt(3)  # sd of the three seeds is 0.1 at every step
    assert list(band["x"]) == list(STEPS) + list(reversed(STEPS))
    assert band["y"] == pytest.approx(
        [entropy("qae", 1, s) + half for s in STEPS] + [entropy("qae", 1, s) - half for s in reversed(STEPS)], abs=1e-6
    )
    assert band["fill"] == "toself" and band["fillcolor"].startswith("rgba(")
    assert band["fillcolor"][5:].split(",")[:3] != ["0", "0", "0"]
    # held-out: the step-0 evaluation (from the evals table) starts each curve; grpo at step 2: 0.4, 0.5, 0.5
    heldout = {t["uid"]: t for t in specs["compare_heldout_accuracy"]["data"]}
    assert list(heldout["estimator=grpo"]["x"]) == [0, 2, 4]
    assert heldout["estimator=grpo"]["y"] == pytest.approx([0.2, 1.4 / 3, 1.7 / 3])
    zero = {t["uid"]: t for t in specs["compare_frac_zero_adv"]["data"]}
    assert zero["estimator=grpo"]["y"] == pytest.approx([0.3 + 0.05 * s for s in STEPS])
    assert "95% Student-t interval of the mean over seeds" in texts(at)
    # the min-max band, from its control
    at.segmented_control(key="band").set_value("min-max").run()
    band = {t["uid"]: t for t in plotly_specs(at)["compare_entropy"]["data"]}["estimator=qae · band"]
    assert band["y"][:4] == pytest.approx([entropy("qae", 2, s) for s in STEPS])
    assert "lowest to highest seed" in texts(at)


def test_one_run_without_heldout_evaluations(compare_app):
    at = compare_app("compare", runs="solo")
    table = by_group(at)
    assert table["group"].tolist() == ["all"] and table["final_heldout"].tolist() == ["-"]
    assert table["entropy_last"].tolist() == ["0.650"]  # the last 20% of 4 steps is 2 steps: 0.7 and 0.6
    assert "one seed, no interval; run more seeds" in texts(at)
    assert any("No held-out evaluation in these runs" in info.value for info in at.info)
    specs = plotly_specs(at)
    assert "compare_heldout_accuracy" not in specs and "compare_entropy" in specs
    assert not [t for t in specs["compare_entropy"]["data"] if t["uid"].endswith("band")]  # one seed: no band
    assert not [box for box in at.selectbox if box.key == "baseline"]  # one group: nothing to be a baseline for


def test_a_link_to_a_missing_sweep_run_or_baseline_says_so(compare_app):
    at = compare_app("compare", sweep="ghost")
    assert any("no run belongs to sweep ghost" in w.value for w in at.warning)
    assert "Pick a sweep, or runs to compare." in texts(at)
    at = compare_app("compare", runs="study-qae-s0,gone", baseline="ppo")
    assert any("run gone" in w.value for w in at.warning)
    assert by_group(at)["runs"].tolist() == ["study-qae-s0"]
    for link in (dict(runs="study-qae-s0,x`**b**[l](http://e)"), dict(sweep="y`**b**")):  # the link's text, as text
        warnings = [w.value for w in compare_app("compare", **link).warning]
        assert warnings and not [w for w in warnings if "**b**" in w or "[l](http://e)" in w], warnings
    at = compare_app("compare", sweep=SWEEP_NAME, baseline="ppo")
    assert any("baseline: 'ppo' matches no group" in w.value for w in at.warning)
    assert by_metric(at, "paired seeds") is None


def test_nothing_picked_and_no_runs(compare_app, tmp_path, monkeypatch):
    at = compare_app("compare", sweep="")  # the sweep cleared, no runs picked
    assert "Pick a sweep, or runs to compare." in texts(at)
    (tmp_path / "none").mkdir()
    at = make_app(tmp_path / "none", monkeypatch)("compare")
    assert "No runs in" in texts(at)


def test_a_run_without_a_training_step_is_left_out_and_said(tmp_path, monkeypatch):
    """A run killed before its first step holds at most its step-0 evaluation: counted as a seed it would pull the
    group's final accuracy to the untrained model's (0.2 here)."""
    write_compare_run(tmp_path, "trained", {0: 0.2, 2: 0.5, 4: 0.6}, lambda step: (1.0, 0.5), seed=0)
    cfg = {**TrainConfig().to_dict(), "run_name": "untrained", "seed": 1}
    writer = RunWriter(db_path(tmp_path, "untrained"), "untrained")
    writer.create_run("untrained", cfg, cfg["estimator"], None, cfg["model"], cfg["data"], cfg["seed"])
    writer.add_step(
        0,
        evals=[dict(benchmark="heldout", subset="all", metric="avg@k", k=4, value=0.2, n_problems=10, source="train")],
    )
    assert writer.flush()
    at = make_app(tmp_path, monkeypatch)("compare", runs="trained,untrained")
    table = by_group(at)
    assert table["n"].tolist() == [1] and table["final_heldout"].tolist() == ["0.600"]
    assert "left out: untrained (no training step yet)" in texts(at).replace("\\", "")  # markdown escapes
    at = make_app(tmp_path, monkeypatch)("compare", runs="untrained")
    assert any("No picked run has a training step yet" in info.value for info in at.info)


def test_the_default_band_of_three_seeds_is_their_range_and_says_why(compare_app):
    """With 2 or 3 seeds the 95% t-interval is the mean +- 12.71 or 4.30 standard errors: on a 2-seed sweep the band
    sent the entropy axis to 2.5 nats and flattened curves near 0.45. The default band (auto) draws the seeds' range
    there and says why; from 4 seeds on it is the t-interval."""
    at = compare_app("compare", sweep=SWEEP_NAME)
    assert at.segmented_control(key="band").value == "auto"
    band = {t["uid"]: t for t in plotly_specs(at)["compare_entropy"]["data"]}["estimator=qae · band"]
    assert band["y"] == pytest.approx(
        [entropy("qae", 2, s) for s in STEPS] + [entropy("qae", 0, s) for s in reversed(STEPS)]
    )
    assert "no group has more than 3 seeds" in texts(at) and "4.30 standard errors" in texts(at)
    assert charts.resolve_band("auto", 4) == ("t-interval", None)
    assert charts.resolve_band("auto", 2)[0] == "min-max" and "12.71" in charts.resolve_band("auto", 2)[1]
    assert charts.resolve_band("t-interval", 2) == ("t-interval", None)


def test_a_copied_run_folder_is_shown_and_not_counted_as_a_seed(tmp_path, monkeypatch):
    """`cp -r` of a sweep's run (its database still carries the sweep's tag) made GRPO n=4 with a narrower interval
    on identical data; the copy is now named in the note, not counted, and the pairing names the runs it used."""
    import shutil

    runs_dir = write_compare_runs(tmp_path / "runs")
    shutil.copytree(runs_dir / "study-grpo-s0", runs_dir / "study-grpo-s0 (copy)")
    at = make_app(runs_dir, monkeypatch)("compare", sweep=SWEEP_NAME, baseline="grpo")
    table = by_group(at).set_index("group")
    assert table["n"].to_dict() == {"estimator=grpo": 3, "estimator=qae": 3}
    assert table.loc["estimator=grpo", "final_heldout"] == interval_text(finals("grpo"))  # as without the copy
    assert (
        "not counted: study-grpo-s0 (copy) (a copy of study-grpo-s0, seed 0: counted once)"
        in table.loc["estimator=grpo", "note"]
    )
    differences = by_group(at, "paired seeds")
    assert differences["paired runs"].tolist() == [
        "study-qae-s0 - study-grpo-s0; study-qae-s1 - study-grpo-s1; study-qae-s2 - study-grpo-s2"
    ]


# ---------------------------------------------------------------------------------------------------------------
# `qae compare` and the page print the same numbers


def cli_cells(output: str, table_header: str) -> dict[str, list[str]]:
    """metric -> its cells, one per group column, of the `qae compare` table whose header line starts with
    `table_header`, each cell's lines joined as the page writes them: '0.433 [0.415, 0.451] p=0.428',
    '0.656 (n=2: no interval)'."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(table_header))
    header = lines[start]
    ends = [match.end() for match in re.finditer(r"\S+(?: - \S+)?", header)][1:]  # right-justified columns
    cells: dict[str, list[list[str]]] = {}
    for line in lines[start + 2 :]:
        name = line.split(" ", 1)[0]
        if name in run_comparison.RUN_METRICS:
            cells[name] = [[] for _ in ends]
        elif line[:1] != " " or not cells:
            break
        for column, (begin, end) in enumerate(zip([len(name)] + ends[:-1], ends, strict=True)):
            if text := line[begin:end].strip():
                cells[next(reversed(cells))][column].append(text)
    return {
        name: [
            " ".join(f"({part})" if part[0].isalpha() and not part.startswith("p=") else part for part in parts)
            for parts in by_column
        ]
        for name, by_column in cells.items()
    }


def page_cells(at, first_row: str) -> dict[str, list[str]]:
    table = by_metric(at, first_row).set_index("metric")
    return {name: table.loc[name].tolist() for name in run_comparison.RUN_METRICS}


@pytest.mark.parametrize("seeds", [2, 3])
def test_the_cli_and_the_page_print_the_same_intervals_and_p_values(tmp_path, monkeypatch, seeds):
    """One statistics rule for both: below `run_comparison.MIN_SEEDS` paired seeds no interval and no p-value (the page
    printed t-intervals and both printed p at n=2), from it on the same interval and p. Two setups (group size 8 and
    6), the same seeds, synthetic runs with held-out evaluations (which tie across seeds) and entropies (which do
    not)."""
    runs_dir = tmp_path / "runs"
    ids = [f"g{size}-s{seed}" for size in (8, 6) for seed in range(seeds)]
    for run_id in ids:
        size, seed = (int(part[1:]) for part in run_id.split("-"))
        write_run(runs_dir, run_id, steps=6, group_size=size, seed=seed, eval_every=3)
    result = CliRunner().invoke(
        app, ["compare", *ids, "--baseline", "group_size=6", "--runs-dir", str(runs_dir)], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    at = make_app(runs_dir, monkeypatch)("compare", runs=",".join(ids), baseline="group_size=6")
    cli = {
        **cli_cells(result.output, "metric "),
        **{
            f"diff {name}": cells
            for name, cells in cli_cells(result.output.split("minus the baseline")[1], "metric ").items()
        },
    }
    page = {**page_cells(at, "n"), **{f"diff {name}": cells for name, cells in page_cells(at, "paired seeds").items()}}
    assert cli == page
    shown = " ".join(cell for cells in cli.values() for cell in cells)
    if seeds < run_comparison.MIN_SEEDS:
        assert "[" not in shown and "p=" not in shown and "(n=2: no interval)" in shown
    else:
        assert "[" in shown and "p=" in shown and "no interval" not in shown
    assert "all 3 seeds tied" in shown if seeds == 3 else "tied" not in shown  # held-out accuracy is seed-free
