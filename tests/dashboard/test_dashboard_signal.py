"""Finding reward hacking on the dashboard (issue 49), on a real run of the hacked task (tests/hacking_rewards.py: a
correctness reward that never fires and a format reward of weight 0.2): the Training curves draw each component's
share of the advantage with the reward_signal alert marked; the Rollouts page filters by component values, orders by
entropy or by the sampler/trainer gap, and shows an opened response's tokens coloured, escaped, a value on hover."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from qae_app.config import build_config
from qae_app.evaluation.task_preview import PreviewOptions, run_preview
from qae_app.store.reader import query, read_components, read_preview, read_rollouts
from qae_app.store.run_folder import db_path
from qae_app.store.signal_reader import read_response_mismatch, read_token_values
from qae_app.train.trainer import Trainer
from tests.dashboard.helpers import EVIL_RESPONSE, crafted_tokens, make_app, plotly_specs, response_tables, texts

REWARDS = Path(__file__).resolve().parents[1] / "hacking_rewards.py"


def token_views(at) -> list[str]:
    """The HTML of each token view on the page."""
    return [element.proto.body for element in at.get("html") if 'class="qae-tokens"' in element.proto.body]


@pytest.fixture(scope="module")
def hacked_dir(tmp_path_factory, runs_dir) -> Path:
    """runs_dir (the crafted runs, the tiny run) and a real 4-step run of the hacked task."""
    cfg = build_config(
        run_name="hacked",
        steps=4,
        eval_every=0,
        checkpoint_every=0,
        reward_weights="1,0.2",
        reward=[f"{REWARDS}:exact_with_unit", f"{REWARDS}:one_char"],
    )
    assert Trainer(cfg, runs_dir, cpu=True).fit().status == "finished"
    return runs_dir


@pytest.fixture(scope="module")
def hacked_preview(hacked_dir) -> Path:
    """hacked_dir with a preview of the hacked task, 16 prompts x 16."""
    cfg = build_config(
        run_name="hacked-preview", reward_weights="1,0.2", reward=[f"{REWARDS}:exact_with_unit", f"{REWARDS}:one_char"]
    )
    run_preview(cfg, hacked_dir, PreviewOptions(prompts=16), device="cpu")
    return hacked_dir


@pytest.fixture
def hacked_app(hacked_dir, monkeypatch):
    return make_app(hacked_dir, monkeypatch)


@pytest.mark.slow  # a real 4-step run of 8 x 16 responses: 20-60 s
def test_curves_draw_which_reward_carries_the_signal_with_the_alert_marked(hacked_app, hacked_dir):
    specs = plotly_specs(hacked_app("curves", run="hacked"))
    lines = {trace["name"]: trace for trace in specs["reward_signal"]["data"]}
    signal = query(
        db_path(hacked_dir, "hacked"),
        "SELECT step, adv_share FROM component_signal WHERE name = 'one_char' ORDER BY step",
    )
    drawn = lines["hacked · signal:one_char"]
    assert [y for y in drawn["y"] if y == y] == [v for v in signal["adv_share"] if v == v]  # (NaN: a step w/o signal)
    marks = [trace for name, trace in lines.items() if name.startswith("hacked · warnings")]
    assert len(marks) == 1 and marks[0]["text"][0].startswith("reward_signal: one_char (weight 0.2)")
    assert {"hacked · reward:one_char", "hacked · reward:exact_with_unit"} <= {
        t["name"] for t in specs["reward_components"]["data"]
    }


@pytest.mark.slow
def test_rollouts_filter_by_component_values_and_order_by_entropy_or_mismatch(hacked_app, hacked_dir):
    path = db_path(hacked_dir, "hacked")
    at = hacked_app("rollouts", run="hacked", step="2")
    labels = [s.label.replace("\\", "") for s in at.selectbox if s.key in ("comp0", "comp1")]  # (escaped markdown)
    assert labels == ["exact_with_unit", "one_char"]
    at.selectbox(key="comp1").set_value("1").run()
    at.selectbox(key="comp0").set_value("0").run()
    components = read_components(path, 2)
    wide = components.pivot(index=["group_idx", "sample_idx"], columns="name", values="value")
    want = wide[(wide["one_char"] == 1) & (wide["exact_with_unit"] == 0)]
    shown = pd.concat(response_tables(at))
    assert len(shown) == len(want) > 0 and (shown["one_char"] == 1).all()
    assert at.metric[0].value.startswith(f"{len(want)} / ")
    # ordered by entropy: the groups in the order of their highest, responses highest first
    at = hacked_app("rollouts", run="hacked", step="2", order="entropy")
    rows = read_rollouts(path, 2).sort_values("entropy", ascending=False, kind="stable")
    groups = list(dict.fromkeys(rows["group_idx"]))[:10]
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert [int(h.split()[1].strip("*")) for h in headers] == groups
    first = response_tables(at)[0]["entropy"].tolist()
    assert first == sorted(first, reverse=True)
    at = hacked_app("rollouts", run="hacked", step="2", order="mismatch")
    gaps = read_response_mismatch(path, 2).dropna().sort_values("mismatch", ascending=False, kind="stable")
    headers = [m.value for m in at.markdown if m.value.startswith("**Group")]
    assert int(headers[0].split()[1].strip("*")) == int(gaps.iloc[0]["group_idx"])


@pytest.mark.slow
def test_an_opened_response_shows_its_tokens_coloured_with_every_number(hacked_app, hacked_dir):
    at = hacked_app("rollouts", run="hacked", step="1", color="entropy")
    at.selectbox(key="open_1_0").set_value(0).run()
    stored = read_token_values(db_path(hacked_dir, "hacked"), 1, [(0, 0)]).iloc[0]
    html = token_views(at)
    assert len(html) == 1 and html[0].count('class="qae-token"') == len(stored["tokens"])
    assert f'data-value="{stored["entropy"][0]:.4g}"' in html[0]
    assert "background: the sampling distribution's entropy at the token, nats" in " ".join(c.value for c in at.caption)


def test_token_texts_are_escaped_in_the_token_view(app):
    at = app("rollouts", run="crafted", step="3")
    at.selectbox(key="open_3_0").set_value(3).run()
    [body] = token_views(at)
    assert "<script>" not in body and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in body
    assert body.count('class="qae-token"') == len(crafted_tokens(EVIL_RESPONSE))
    assert 'data-tip="#0 &quot;\\u003cscript\\u003ealert(&#x27;x&#x27;)' in body  # (the hover's token, no tag)


@pytest.mark.slow
def test_the_preview_page_agrees_with_its_verdict_on_a_hacked_task(hacked_preview, monkeypatch):
    view = read_preview(db_path(hacked_preview, "hacked-preview"))
    at = make_app(hacked_preview, monkeypatch)("preview", run="hacked-preview")
    assert at.success[0].value == view.summary["verdict"]
    assert "all signal comes from one_char (weight 0.2)" in view.summary["verdict"]
    without, with_signal = plotly_specs(at)["preview_success"]["data"]
    n_signal = int(view.summary["verdict"].split("learnable: ")[1].split(" of ")[0])
    assert with_signal["y"][0] == n_signal > 0 and sum(with_signal["y"]) == n_signal  # all of it at 0 correct
    assert without["y"][0] == 16 - n_signal
    table = next(frame for frame in (f.value for f in at.dataframe) if "adv_share" in frame.columns)
    assert table.set_index("name")["adv_share"].to_dict() == {"exact_with_unit": 0.0, "one_char": 1.0}
    assert "Which reward carries the signal" in texts(at)
