"""The dashboard pages, run with Streamlit's AppTest on the real tiny training run and on a crafted run whose model
text contains HTML and markdown; they assert what each page shows against the database."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qae_app import store

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
sys.path.insert(0, str(APP.parent))  # `charts` is imported by the app as a sibling module

import charts  # noqa: E402

streamlit_testing = pytest.importorskip("streamlit.testing.v1")

EVIL_RESPONSE = "<script>alert('x')</script> **bold** [link](http://example.com) # not a heading"
EVIL_PROMPT = "<b>What</b> is **2+2**?"
MOVING_PROMPT = "p-move"


# ---------------------------------------------------------------------------------------------------------------
# fixtures


def _crafted_rows(step: int) -> dict[str, list[dict]]:
    """Two groups of 4: `p-move` goes hard (1/4), hard (1/4), easy (3/4); the other prompt is new each step."""
    moving_correct = {1: 1, 2: 1, 3: 3}[step]
    other_correct = {1: 0, 2: 4, 3: 2}[step]
    groups, rollouts = [], []
    for g, (prompt_id, prompt, n_correct) in enumerate([(MOVING_PROMPT, EVIL_PROMPT, moving_correct),
                                                        (f"p-other-{step}", f"1+{step}=", other_correct)]):
        regime = {0: "all_wrong", 4: "all_correct"}.get(n_correct, "hard" if n_correct <= 2 else "easy")
        baseline = {"hard": 0.0, "easy": 1.0, "all_wrong": 0.0, "all_correct": 1.0}[regime]
        groups.append(dict(group_idx=g, prompt_id=prompt_id, prompt=prompt, answer="4", n_correct=n_correct,
                           group_size=4, baseline=baseline, regime=regime))
        for s in range(4):
            reward = 1.0 if s < n_correct else 0.0
            advantage = 0.0 if regime.startswith("all") else round(reward - baseline, 6)
            response = EVIL_RESPONSE if (step, g, s) == (3, 0, 3) else ("4" if reward else "5")
            rollouts.append(dict(group_idx=g, sample_idx=s, prompt_id=prompt_id, response=response, reward=reward,
                                 verified=True, advantage=advantage, gated=advantage == 0, regime=regime,
                                 n_tokens=len(response), truncated=False, entropy=0.4, logprob=-1.0))
    fractions = pd.Series([g["regime"] for g in groups]).value_counts(normalize=True)
    metrics = dict(reward_mean=sum(r["reward"] for r in rollouts) / 8, accuracy=sum(r["reward"] for r in rollouts) / 8,
                   entropy=0.9 - 0.2 * step, entropy_pos=0.8, entropy_neg=0.6,
                   frac_zero_adv=sum(r["gated"] for r in rollouts) / 8, cov_logp_adv=0.1 * step, response_len=1.5,
                   clip_frac_low=0.0, clip_frac_high=0.01, rollout_s=0.2, reward_s=0.01, update_s=0.3, step_s=0.51,
                   loss=0.1, grad_norm=1.0, adv_abs_mean=0.5,
                   **{f"frac_{regime}": float(fractions.get(regime, 0.0)) for regime in charts.REGIME_COLORS})
    tables = dict(steps=[metrics], groups=groups, rollouts=rollouts)
    if step == 2:
        tables["warnings"] = [dict(kind="entropy_low", message="entropy (smoothed) 0.48 fell below 0.5")]
    if step in (1, 3):
        tables["evals"] = [dict(benchmark="mini", subset=subset, metric=metric, k=4, value=value, n_problems=10,
                                   source="eval")
                           for subset, value in [("all", 0.1 * step), ("level=1", 0.2 * step)]
                           for metric in ("avg@k", "pass@k", "maj@k")]
    return tables


@pytest.fixture(scope="module")
def runs_dir(tiny_run, tmp_path_factory) -> Path:
    """A runs dir with a copy of the real tiny run, a crafted finished run and a crafted empty running run."""
    tiny_dir, tiny_id = tiny_run
    out = tmp_path_factory.mktemp("dash_runs")
    (out / tiny_id).mkdir()
    shutil.copy(store.db_path(tiny_dir, tiny_id), store.db_path(out, tiny_id))  # the database only, not checkpoints
    writer = store.RunWriter(store.db_path(out, "crafted"), "crafted")
    writer.create_run("crafted", {"steps": 3, "group_size": 4, "entropy_low": 0.5, "entropy_high": 3.0}, "qae", 0.5,
                      "builtin:tiny", "arith", 0)
    for step in (1, 2, 3):
        writer.add_step(step, **_crafted_rows(step))
    assert writer.flush()
    writer.update_run(status="finished")
    empty = store.RunWriter(store.db_path(out, "empty"), "empty")
    empty.create_run("empty", {"steps": 10}, "grpo", None, "builtin:tiny", "arith", 0)
    return out


@pytest.fixture
def app(runs_dir, monkeypatch):
    """Run the app on a page with query params: app(page, run=[...], step=...) -> AppTest after the run."""
    monkeypatch.setenv("QAE_RUNS_DIR", str(runs_dir))

    def run(page: str | None = None, **params):
        at = streamlit_testing.AppTest.from_file(str(APP), default_timeout=60)
        for name, value in params.items():
            at.query_params[name] = value
        at.run()
        if page is not None:
            at.switch_page(f"views/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    return run


def _unpack(value):
    """Plotly 6+ sends numeric arrays as {'dtype', 'bdata' (base64), 'shape'?}; turn them back into lists."""
    if isinstance(value, dict) and "bdata" in value:
        array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        if "shape" in value:
            array = array.reshape([int(n) for n in str(value["shape"]).split(",")])
        return array.tolist()
    if isinstance(value, dict):
        return {key: _unpack(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unpack(item) for item in value]
    return value


def plotly_specs(at) -> dict[str, dict]:
    """key -> the figure sent to the browser, as plain JSON."""
    return {chart.key: _unpack(json.loads(chart.proto.spec)) for chart in at.get("plotly_chart")}


def texts(at) -> str:
    """Every text, caption, markdown, code and info string on the page, joined."""
    parts = [e.value for kind in ("text", "caption", "markdown", "code", "info") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def frames(at) -> list[pd.DataFrame]:
    return [df.value for df in at.dataframe]


def frame_with(at, *columns: str) -> pd.DataFrame:
    """The first dataframe on the page that has all `columns`."""
    return next(frame for frame in frames(at) if set(columns) <= set(frame.columns))


# ---------------------------------------------------------------------------------------------------------------
# pages


def test_runs_page_lists_every_run_with_progress(app, runs_dir):
    at = app(run="tiny")
    table = frames(at)[0]
    assert set(table["run_id"]) == {"tiny", "crafted", "empty"}
    tiny = table.set_index("run_id").loc["tiny"]
    steps = store.read_steps(store.db_path(runs_dir, "tiny"))
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
    assert {"entropy", "accuracy", "frac_zero_adv", "regimes", "cov_logp_adv", "entropy_split", "response_len",
            "clip_frac", "step_time"} <= set(specs)
    tiny_steps = store.read_steps(store.db_path(runs_dir, "tiny"))
    entropy = {trace["name"]: trace for trace in specs["entropy"]["data"]}
    assert list(entropy["tiny"]["x"]) == tiny_steps["step"].tolist()
    assert list(entropy["crafted"]["x"]) == [1, 2, 3]
    # each run's warning band: the crafted run's from its config, the tiny run's relative to its first step's entropy
    start = tiny_steps["entropy"].iloc[0]
    assert sorted({shape["y0"] for shape in specs["entropy"]["layout"]["shapes"]}) == pytest.approx(
        sorted({0.5, 3.0, start / 3, start * 3}))
    warning = entropy["crafted · warnings (1)"]
    assert list(warning["x"]) == [2] and "fell below 0.5" in warning["text"][0]
    names = {trace["name"] for trace in specs["accuracy"]["data"]}
    assert {"tiny · accuracy", "tiny · reward_mean", "crafted · accuracy", "tiny · heldout_accuracy"} <= names
    regimes = {trace["name"] for trace in specs["regimes"]["data"]}
    assert {"hard", "easy", "all_correct", "all_wrong"} <= regimes
    assert "tiny · finished · step 6 / 6" in texts(at) and "crafted · finished · step 3 / 3" in texts(at)
    assert "mean per-token entropy" in texts(at)  # the definition from STEP_METRICS


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
    path = store.db_path(runs_dir, "tiny")
    latest = store.read_rollout_steps(path)[-1]
    expected = store.read_rollouts(path, latest)
    tables = frames(at)
    assert sum(len(t) for t in tables) == len(expected)
    shown = pd.concat(tables, ignore_index=True)
    assert (shown["status"] == "⊘ gated").sum() == expected["gated"].sum() > 0
    assert shown.loc[shown["status"] == "⊘ gated", "advantage"].eq(0).all()
    assert f"{int(expected['gated'].sum())} / {len(expected)}" in [m.value for m in at.metric]
    groups = store.read_groups(path, latest)
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert len(headers) == len(groups)
    first = groups.iloc[0]
    assert f"**{first['n_correct']}/{first['group_size']}** correct" in headers[0]


@pytest.mark.parametrize("filters, reader_args", [
    ({"gated": "gated"}, {"gated": True}),
    ({"gated": "kept"}, {"gated": False}),
    ({"regime": "easy"}, {"regime": "easy"}),
    ({"reward": 1.0}, {"reward": 1.0}),
    ({"search": "1"}, {"search": "1"}),
])
def test_rollouts_filters_match_the_database(app, runs_dir, filters, reader_args):
    at = app("rollouts", run="tiny", step="3")
    for key, value in filters.items():
        at.session_state[key] = value
    at.run()
    expected = store.read_rollouts(store.db_path(runs_dir, "tiny"), 3, **reader_args)
    shown = frames(at)
    assert sum(len(t) for t in shown) == len(expected)
    total = len(store.read_rollouts(store.db_path(runs_dir, "tiny"), 3))
    assert at.metric[0].value == f"{len(expected)} / {total}"


def test_model_text_is_shown_literally(app):
    at = app("rollouts", run="crafted", step="3")
    assert EVIL_PROMPT in [c.value for c in at.code]
    cells = pd.concat(frames(at))["response"].tolist()
    assert EVIL_RESPONSE in cells
    assert not any("<script>" in m.value or "**2+2**" in m.value for m in at.markdown)
    at.selectbox(key="open_3_0").set_value(3).run()
    assert EVIL_RESPONSE in [c.value for c in at.code]


def test_step_slider_follows_the_url_and_lists_steps_with_rollouts(app):
    at = app("rollouts", run="crafted", step="2")
    slider = at.select_slider(key="step")
    assert slider.value == 2 and list(slider.options) == ["1", "2", "3"]
    assert len(pd.concat(frames(at))) == 8


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
    evals = store.read_evals(store.db_path(runs_dir, "tiny"))
    spec = plotly_specs(at)["evals_chart"]
    avg = [t for t in spec["data"] if t["xaxis"] in (None, "x")]
    assert avg and list(avg[0]["x"]) == evals.query("metric == 'avg@k' and subset == 'all'")["step"].tolist()
    latest = frame_with(at, "run", "metric", "value")
    last = evals[evals["step"] == evals["step"].max()].set_index("metric")["value"]
    assert latest.set_index("metric")["value"].to_dict() == pytest.approx(last.to_dict())

    at = app("evals", run="crafted", subset="level=1")
    spec = plotly_specs(at)["evals_chart"]
    assert [list(t["y"]) for t in spec["data"]][0] == pytest.approx([0.2, 0.6])
    assert at.selectbox(key="subset").options == ["all", "level=1"]


def test_evals_page_says_when_there_are_none(app):
    at = app("evals", run="empty")
    assert any("No evaluations recorded" in i.value for i in at.info)


def test_pages_of_a_run_without_steps_say_so(app):
    assert "No step written yet" in texts(app("curves", run="empty"))
    assert "No rollouts written yet" in texts(app("rollouts", run="empty"))
    assert "No groups written yet" in texts(app("prompts", run="empty"))


# ---------------------------------------------------------------------------------------------------------------
# store readers and chart helpers


def test_dashboard_readers_on_the_crafted_run(runs_dir):
    path = store.db_path(runs_dir, "crafted")
    view = store.read_run_view(path)
    assert view.run["status"] == "finished" and view.steps["step"].tolist() == [1, 2, 3]
    assert view.warnings["step"].tolist() == [2] and set(view.evals["subset"]) == {"all", "level=1"}
    assert store.read_rollout_steps(path) == [1, 2, 3]
    prompts = store.read_prompts(path).set_index("prompt_id")
    moving = prompts.loc[MOVING_PROMPT]
    assert (moving["times_sampled"], moving["first_regime"], moving["last_regime"]) == (3, "hard", "easy")
    assert (moving["first_success"], moving["last_success"]) == (0.25, 0.75)
    counts = store.read_regime_counts(path)
    assert counts.groupby("step")["n_groups"].sum().tolist() == [2, 2, 2]
    history = store.read_prompt_histories(path, [MOVING_PROMPT, "p-other-1"])
    assert sorted(history["prompt_id"].unique()) == [MOVING_PROMPT, "p-other-1"] and len(history) == 4


def test_smoothing_by_hand():
    values = pd.Series([1.0, None, 3.0, 5.0])
    assert charts.smooth(values, "none").equals(values)
    # EMA with weight 0.5 on the past, debiased: 1, (0.5*1 + 3)/(1.5) ... as pandas ewm(adjust=True)
    ema = charts.smooth(values, "ema", 0.5)
    assert ema.tolist()[0] == 1.0 and pd.isna(ema[1])
    assert ema[2] == pytest.approx((3 + 0.5 * 1) / 1.5) and ema[3] == pytest.approx((5 + 0.5 * 3 + 0.25) / 1.75)
    rolling = charts.smooth(values, "rolling", 2)
    assert rolling.tolist()[2:] == [2.0, 4.0] and pd.isna(rolling[1])
    with pytest.raises(ValueError, match="EMA weight"):
        charts.smooth(values, "ema", 1.0)


# ---------------------------------------------------------------------------------------------------------------
# the real server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"dashboard exited with {process.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"dashboard not healthy on port {port} after {timeout_s} s")


def listening_addresses(port: int) -> set[str]:
    """Local addresses of sockets listening on `port`, from /proc/net/tcp and tcp6 (state 0A = LISTEN)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            if len(address) == 8:  # IPv4, little-endian
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
            else:
                words = bytes.fromhex(address)
                found.add(socket.inet_ntop(socket.AF_INET6, b"".join(words[i:i + 4][::-1] for i in range(0, 16, 4))))
    return found


def test_qae_dashboard_stops_cleanly_on_ctrl_c(runs_dir):
    port = free_port()
    qae = Path(sys.executable).parent / "qae"
    process = subprocess.Popen([str(qae), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        wait_healthy(port, process)
        assert listening_addresses(port) == {"127.0.0.1"}  # nobody else on the network can reach the runs
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole foreground group
        output, _ = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, output
    assert "dashboard stopped" in output and "Traceback" not in output
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
