"""What the dashboard's tests import: a crafted run whose model text holds HTML and markdown, the AppTest runner for
the pages, readers of what a page drew, and a real server's port and health. The fixtures built on them (the real
tiny training run and the crafted run as run folders, AppTest runners on them) are in conftest.py."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
sys.path.insert(0, str(APP.parent))  # `charts` is imported by the app as a sibling module

import charts  # noqa: E402

streamlit_testing = pytest.importorskip("streamlit.testing.v1")

EVIL_RESPONSE = "<script>alert('x')</script> **bold** [link](http://example.com) # not a heading"
EVIL_PROMPT = "<b>What</b> is **2+2**?"
MOVING_PROMPT = "p-move"


# a process that holds a run's lock as a trainer does (its pid in the lock file, an exclusive flock) and says when
# SIGTERM reaches it
HOLDER = """import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, str(os.getpid()).encode())
signal.signal(signal.SIGTERM, lambda *args: (print("SIGTERM", flush=True), os._exit(0)))
print("held", flush=True)
time.sleep(300)
"""


# ---------------------------------------------------------------------------------------------------------------
# the crafted run and the AppTest runner (conftest.py's fixtures are built on them)


def _crafted_rows(step: int) -> dict[str, list[dict]]:
    """Two groups of 4: `p-move` goes hard (1/4), hard (1/4), easy (3/4); the other prompt is new each step."""
    moving_correct = {1: 1, 2: 1, 3: 3}[step]
    other_correct = {1: 0, 2: 4, 3: 2}[step]
    groups, rollouts = [], []
    for g, (prompt_id, prompt, n_correct) in enumerate(
        [(MOVING_PROMPT, EVIL_PROMPT, moving_correct), (f"p-other-{step}", f"1+{step}=", other_correct)]
    ):
        regime = {0: "all_wrong", 4: "all_correct"}.get(n_correct, "hard" if n_correct <= 2 else "easy")
        baseline = {"hard": 0.0, "easy": 1.0, "all_wrong": 0.0, "all_correct": 1.0}[regime]
        groups.append(
            dict(
                group_idx=g,
                prompt_id=prompt_id,
                prompt=prompt,
                answer="4",
                n_correct=n_correct,
                group_size=4,
                baseline=baseline,
                regime=regime,
                filtered=False,
            )
        )
        for s in range(4):
            reward = 1.0 if s < n_correct else 0.0
            advantage = 0.0 if regime.startswith("all") else round(reward - baseline, 6)
            response = EVIL_RESPONSE if (step, g, s) == (3, 0, 3) else ("4" if reward else "5")
            rollouts.append(
                dict(
                    group_idx=g,
                    sample_idx=s,
                    prompt_id=prompt_id,
                    response=response,
                    reward=reward,
                    correct=reward == 1.0,
                    verified=True,
                    advantage=advantage,
                    gated=advantage == 0,
                    regime=regime,
                    n_tokens=len(response),
                    truncated=False,
                    entropy=0.4,
                    logprob=-1.0,
                    filtered=False,
                )
            )
    fractions = pd.Series([g["regime"] for g in groups]).value_counts(normalize=True)
    metrics = {name: None for name in STEP_METRICS}
    metrics.update(
        reward_mean=sum(r["reward"] for r in rollouts) / 8,
        accuracy=sum(r["reward"] for r in rollouts) / 8,
        entropy=0.9 - 0.2 * step,
        entropy_pos=0.8,
        entropy_neg=0.6,
        frac_zero_adv=sum(r["gated"] for r in rollouts) / 8,
        cov_logp_adv=0.1 * step,
        response_len=1.5,
        clip_frac_low=0.0,
        clip_frac_high=0.01,
        rollout_s=0.2,
        reward_s=0.01,
        update_s=0.3,
        step_s=0.51,
        loss=0.1,
        grad_norm=1.0,
        adv_abs_mean=0.5,
        dH=0.01 * step,
        dH_easy=0.02,
        dH_hard=-0.03,
        dH_from_hard=-0.04,
        dH_from_easy=0.01 * step,
        dH_from_none=0.001,
        dH_hard_from_hard=-0.05,
        dH_easy_from_hard=-0.02,
        dH_hard_from_easy=0.005,
        dH_easy_from_easy=0.03,
        **{f"frac_{regime}": float(fractions.get(regime, 0.0)) for regime in charts.REGIME_COLORS},
    )
    metrics.update(n_updates=1.0)
    tables = dict(steps=[metrics], groups=groups, rollouts=rollouts)
    if step == 3:  # group 0's tokens, the model text full of markup and a terminal escape among them
        tables["token_values"] = [
            dict(
                group_idx=0,
                sample_idx=r["sample_idx"],
                tokens=crafted_tokens(r["response"]),
                logprob=[-0.5 * (i + 1) for i in range(len(crafted_tokens(r["response"])))],
                entropy=[0.25] * len(crafted_tokens(r["response"])),
                old_logprob=None,
            )
            for r in rollouts
            if r["group_idx"] == 0
        ]
    if step == 2:
        tables["warnings"] = [dict(kind="entropy_low", message="entropy (smoothed) 0.48 fell below 0.5")]
    if step in (1, 3):
        tables["evals"] = [
            dict(benchmark="mini", subset=subset, metric=metric, k=4, value=value, n_problems=10, source="eval")
            for subset, value in [("all", 0.1 * step), ("level=1", 0.2 * step)]
            for metric in ("avg@k", "pass@k", "maj@k")
        ]
        # problem q1 is solved at step 3 only; q2's second sample is model text full of markup
        tables["eval_samples"] = [
            dict(
                benchmark="mini",
                problem_id=problem,
                sample_idx=s,
                source="eval",
                verified=True,
                n_tokens=3,
                response=EVIL_RESPONSE if (problem, s) == ("q2", 1) else f"answer {problem}-{s}",
                extracted="**7**" if (problem, s) == ("q2", 1) else str(s),
                correct=correct,
                answer={"q1": "1", "q2": "0"}[problem],
            )
            for problem, s, correct in [("q1", 0, step == 3), ("q1", 1, False), ("q2", 0, True), ("q2", 1, False)]
        ]
    return tables


def crafted_tokens(response: str) -> list[str]:
    """A crafted response's tokens: its words (a leading space each), a terminal escape in the markup one, <eos>."""
    words = response.split(" ")
    pieces = [words[0] + ("\x1b[2J" if len(words) > 1 else "")] + [" " + word for word in words[1:]]
    return [*pieces, "<eos>"]


def _write_crafted(out: Path, run_id: str = "crafted") -> None:
    writer = RunWriter(db_path(out, run_id), run_id)
    writer.create_run(
        run_id,
        {"steps": 3, "group_size": 4, "entropy_low": 0.5, "entropy_high": 3.0},
        "qae",
        0.5,
        "builtin:tiny",
        "arith",
        0,
    )
    for step in (1, 2, 3):
        writer.add_step(step, **_crafted_rows(step))
    assert writer.flush()
    writer.update_run(status="finished")


def make_app(runs_dir: Path, monkeypatch):
    """app(page, run=[...], step=...) -> AppTest of the dashboard on `runs_dir` after the page's run."""
    monkeypatch.setenv("QAE_RUNS_DIR", str(runs_dir))

    def run(view: str | None = None, **params):
        at = streamlit_testing.AppTest.from_file(str(APP), default_timeout=60)
        for name, value in params.items():
            at.query_params[name] = value
        at.run()
        if view is not None:
            at.switch_page(f"views/{view}.py").run()
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
    """key -> the figure sent to the browser (through board.plot's component), as plain JSON."""
    specs = {}
    for element in at.get("bidi_component"):
        if element.proto.component_name == "qae_plot":
            key = element.proto.id.split("-", 2)[-1]  # "$$ID-<hash>-<key>"
            specs[key] = _unpack(json.loads(json.loads(element.proto.json)["figure"]))
    return specs


def plot_places(at) -> dict[str, tuple[int, ...]]:
    """key -> where the chart sits among the page's blocks (the index of each block on the way down, then its own).
    Streamlit's browser side keeps a chart's plot, and the zoom in it, only while its place stays the same."""
    places = {}

    def walk(node, place: tuple[int, ...]) -> None:
        proto = getattr(node, "proto", None)
        if getattr(proto, "component_name", None) == "qae_plot":
            places[proto.id.split("-", 2)[-1]] = place
        for index, child in getattr(node, "children", {}).items():
            walk(child, (*place, index))

    walk(at._tree, ())
    return places


def texts(at) -> str:
    """Every text, caption, markdown, code and info string on the page, joined."""
    parts = [e.value for kind in ("text", "caption", "markdown", "code", "info") for e in getattr(at, kind)]
    return "\n".join(str(p) for p in parts)


def frames(at) -> list[pd.DataFrame]:
    return [df.value for df in at.dataframe]


def response_tables(at) -> list[pd.DataFrame]:
    """The tables of responses on the rollouts page (one per group shown)."""
    return [frame for frame in frames(at) if "response" in frame.columns]


def frame_with(at, *columns: str) -> pd.DataFrame:
    """The first dataframe on the page that has all `columns`."""
    return next(frame for frame in frames(at) if set(columns) <= set(frame.columns))


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
