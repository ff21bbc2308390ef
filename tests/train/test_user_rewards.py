"""A user's reward file used as is by `qae train`: its components stored and shown, its failures one message with the
run stopped failed and resumable once the file is fixed, and a run folder made with it never running its code when read.

Real training runs (the built-in model), real processes for the commands, the real DuckDB file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qae_app.config import build_config
from qae_app.store.reader import query, read_run, read_steps, read_warnings
from qae_app.store.run_folder import db_path
from qae_app.train.trainer import Trainer

pytestmark = pytest.mark.slow  # (training runs and processes: about a minute each on the shared 2-core machine)

REWARDS = """
import time
from pathlib import Path

Path(MARKER).write_text("imported")  # a file that runs code when imported: reading a run must never do it

def short(completions, **kwargs):
    return [1.0 if len(c.strip()) <= 2 else 0.0 for c in completions]

def slow(completions, step, **kwargs):
    if step == 1 and len(completions[0]) % 2:  # odd-length responses of step 1 run past --verify-timeout-s
        time.sleep(30)
    return [1.0]
"""
RUN = dict(steps=2, prompts_per_step=2, group_size=4, eval_every=0, checkpoint_every=2, seed=1, verify_timeout_s=0.5)


def qae(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qae_app.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(runs_dir, reward file, marker): a 2-step run scored by exact_int (w 1), short (w 0.5) and slow (w 0.25)."""
    folder = tmp_path_factory.mktemp("reward_run")
    marker = folder / "imported"
    path = folder / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS).replace("MARKER", repr(str(marker))))
    cfg = build_config(
        run_name="mine", reward=["exact_int", f"{path}:short", f"{path}:slow"], reward_weights="1,0.5,0.25", **RUN
    )
    assert Trainer(cfg, folder / "runs", cpu=True).fit().status == "finished"
    return folder / "runs", path, marker


def test_each_component_is_stored_and_the_reward_is_their_weighted_sum(reward_run):
    runs_dir, path, _ = reward_run
    db = db_path(runs_dir, "mine")
    rollouts = query(db, "SELECT * FROM rollouts ORDER BY step, group_idx, sample_idx")
    wide = query(db, "PIVOT reward_components ON name USING first(value) ORDER BY step, group_idx, sample_idx")
    assert len(wide) == len(rollouts) == 2 * 2 * 4
    assert set(wide.columns) >= {"exact_int", "short", "slow"}
    short = rollouts["response"].str.strip().str.len().le(2).astype(float)
    assert wide["short"].tolist() == short.tolist()  # the function's own rule, recomputed from the stored text
    expected = wide["exact_int"] + 0.5 * wide["short"] + 0.25 * wide["slow"].fillna(0.0)  # None counts 0
    assert rollouts["reward"].tolist() == pytest.approx(expected.tolist())
    # correct: full marks on every component; verified: no component None
    full = (wide["exact_int"] >= 1) & (wide["short"] >= 1) & (wide["slow"].fillna(0) >= 1)
    assert rollouts["correct"].tolist() == full.tolist()
    assert rollouts["verified"].tolist() == wide["slow"].notna().tolist()
    steps = read_steps(db)
    assert steps["accuracy"].tolist() == pytest.approx(full.groupby(rollouts["step"]).mean().tolist())
    config = json.loads((runs_dir / "mine" / "config.json").read_text())
    assert config["reward_files"][f"{path}:short"]["path"] == str(path)
    assert len(config["reward_files"][f"{path}:short"]["sha256"]) == 64


def test_a_response_past_the_deadline_is_none_and_counted_in_the_steps_warning(reward_run):
    runs_dir, _, _ = reward_run
    db = db_path(runs_dir, "mine")
    late = query(
        db, "SELECT step, count(*) AS n FROM reward_components WHERE name = 'slow' AND value IS NULL GROUP BY step"
    )
    odd = query(db, "SELECT count(*) AS n FROM rollouts WHERE step = 1 AND length(response) % 2 = 1")
    assert late["step"].tolist() == [1] and late["n"].tolist() == odd["n"].tolist() and 0 < odd["n"].iloc[0] < 8
    warnings = read_warnings(db)
    timeouts = warnings[warnings["kind"] == "reward_timeout"]
    assert timeouts["step"].tolist() == [1]
    assert f":slow: {odd['n'].iloc[0]} of 8" in timeouts["message"].iloc[0]
    assert read_steps(db)["frac_unverified"].iloc[0] == pytest.approx(odd["n"].iloc[0] / 8)


def test_reading_the_run_never_imports_its_reward_code_and_shows_each_component(reward_run, tmp_path, monkeypatch):
    runs_dir, path, marker = reward_run
    marker.unlink(missing_ok=True)
    shown = qae("show", "mine", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "reward components (mean per step)" in shown.stdout and "short" in shown.stdout
    assert f"reward {path}:short: {path} sha256" in shown.stdout
    rolled = qae("rollouts", "mine", "--step", "1", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert rolled.returncode == 0, rolled.stderr
    header = next(line for line in rolled.stdout.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[:5] == ["#", "reward", "exact_int", "short", "slow"]
    compared = qae("compare", "mine", "--json", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert compared.returncode == 0, compared.stderr
    metrics = json.loads(compared.stdout)["groups"][0]["metrics"]
    assert {"reward:exact_int", "reward:short", "reward:slow"} <= set(metrics)
    for command in (["runs"], ["export", "mine", "--out", str(tmp_path / "exported")]):
        done = qae(*command, "--runs-dir", str(runs_dir), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    refused = qae("train", "--resume", "mine", "--steps", "3", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert refused.returncode == 2 and "name the rewards again" in refused.stdout + refused.stderr
    # the dashboard's pages on it: a chart of each component's mean, a column of each on the Rollouts page
    from tests.dashboard.helpers import make_app, plotly_specs, response_tables

    app = make_app(runs_dir, monkeypatch)
    curves = plotly_specs(app("curves", run="mine"))
    lines = {trace["name"].removesuffix(" (raw)") for trace in curves["reward_components"]["data"]}
    assert lines == {"mine · reward:exact_int", "mine · reward:short", "mine · reward:slow"}
    tables = response_tables(app("rollouts", run="mine", step=1))
    assert {"exact_int", "short", "slow"} <= set(tables[0].columns)
    # qae eval of the run, not given the rewards: scored with the task's own, and it says so
    evaluated = qae(
        "eval", "--model", "mine", "--limit", "2", "--samples", "1", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    assert evaluated.returncode == 0, evaluated.stderr
    said = "".join(evaluated.stdout.split())  # (the console wraps a long path anywhere)
    assert (
        "".join(
            f"run mine trained with --reward exact_int --reward {path}:short --reward {path}:slow; this "
            "evaluation scores with the bench's own reward (exact_int)".split()
        )
        in said
    ), evaluated.stdout
    assert not marker.exists()  # none of the above imported the reward file (qae eval included)


FAILING = """
def score(completions, step, **kwargs):
    if step == 3:
        raise RuntimeError("scorer bug at step 3")
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
"""


def test_a_reward_that_raises_stops_the_run_failed_and_it_resumes_after_the_fix(tmp_path):
    """Steps 1-2 and checkpoint 2 kept; the user's traceback once; resumed with the fixed file (the change
    accepted explicitly), the run has steps 1-4 once each."""
    (tmp_path / "bad.py").write_text(textwrap.dedent(FAILING))
    runs = str(tmp_path / "runs")
    train = [
        "train",
        "--run-name",
        "r",
        "--runs-dir",
        runs,
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
    ]
    rewards = ["--reward", "bad.py:score", "--reward", "exact_int", "--reward-weights", "1,0.5"]
    failed = qae(*train, *rewards, cwd=tmp_path)
    out = failed.stdout + failed.stderr
    assert failed.returncode == 2, out
    assert "reward: bad.py:score failed at step 3 on response 1 of 8" in out
    # the command it offers names every reward and their weights (the run folder names no code to run)
    assert " ".join(
        f"Once the function is fixed, continue it with: qae train --resume r {' '.join(rewards)} "
        f"--runs-dir {runs}".split()
    ) in " ".join(out.split())
    assert out.count("Traceback (most recent call last)") == 1 and "RuntimeError: scorer bug at step 3" in out
    assert f'File "{tmp_path / "bad.py"}", line 4, in score' in out
    db = db_path(tmp_path / "runs", "r")
    run = read_run(db)
    assert run["status"] == "failed" and "scorer bug at step 3" in run["error"]
    assert read_steps(db)["step"].tolist() == [1, 2]
    assert (tmp_path / "runs" / "r" / "checkpoints" / "step-2").is_dir()

    (tmp_path / "bad.py").write_text(textwrap.dedent(FAILING).replace("step == 3", "step == -1"))
    resume = ["train", "--resume", "r", "--runs-dir", runs]
    unnamed = qae(*resume, cwd=tmp_path)
    assert unnamed.returncode == 2 and "name the rewards again" in unnamed.stdout + unnamed.stderr
    changed = qae(*resume, *rewards, cwd=tmp_path)
    assert changed.returncode == 2 and "bad.py changed since this run scored with it" in changed.stdout + changed.stderr
    resumed = qae(*resume, *rewards, "--accept-changed-reward", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_run(db)["status"] == "finished"
    assert read_steps(db)["step"].tolist() == [1, 2, 3, 4]
    record = json.loads((tmp_path / "runs" / "r" / "config.json").read_text())["reward_files"]["bad.py:score"]
    assert record["earlier"][0]["until_step"] == 2 and record["earlier"][0]["sha256"] != record["sha256"]


MODES = """
import math
import time
from pathlib import Path

MODE = Path(__file__).with_name("mode.txt")  # data the test writes: how (and at which step) score fails


def score(completions, step, **kwargs):
    how, at = MODE.read_text().split()
    if step == int(at):
        if how == "length":
            return [1.0, 0.0]
        if how == "nan":
            return [math.nan]
        if how == "word":
            return ["yes"]
        if how == "hang":
            while True:
                time.sleep(1)
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]
"""


def test_every_failure_of_a_user_reward_is_one_message_keeps_the_steps_and_resumes(tmp_path):
    """A wrong-length list (step 2), NaN (3), a string (4), a hang (5): each stops the run `failed` with one message
    that says how to resume; the steps before it and the checkpoint stay; the resume (the file unchanged: only the
    data it reads) goes on to the next failure, and the last one finishes with steps 1-6 once each."""
    (tmp_path / "modes.py").write_text(MODES)
    runs = str(tmp_path / "runs")
    db = db_path(tmp_path / "runs", "m")
    start = [
        "train",
        "--run-name",
        "m",
        "--steps",
        "6",
        "--checkpoint-every",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--verify-timeout-s",
        "1",
    ]
    resume = ["train", "--resume", "m"]
    said = {
        "length": "it returned 2 scores for 1 completion",
        "nan": "it returned nan as a score",
        "word": "it returned 'yes' (a str) as a score",
        "hang": "scored none of the 8 responses of step 5",
    }
    for at, (how, message) in enumerate(said.items(), start=2):
        (tmp_path / "mode.txt").write_text(f"{how} {at}")
        done = qae(*(start if at == 2 else resume), "--reward", "modes.py:score", "--runs-dir", runs, cwd=tmp_path)
        out = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 2, out
        assert out.count("error:") == 1 and message in out, out
        assert f"reward: modes.py:score failed at step {at}" in out or how == "hang"
        assert "Traceback" not in out  # (only an exception has one: the function's own)
        assert "qae train --resume m --reward modes.py:score" in out  # how to go on, once it is fixed
        run = read_run(db)
        assert run["status"] == "failed" and message in run["error"]
        assert read_steps(db)["step"].tolist() == list(range(1, at))
        assert (tmp_path / "runs" / "m" / "checkpoints" / f"step-{at - 1}").is_dir()
    (tmp_path / "mode.txt").write_text("none 0")
    done = qae(*resume, "--reward", "modes.py:score", "--runs-dir", runs, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert read_run(db)["status"] == "finished"
    assert read_steps(db)["step"].tolist() == [1, 2, 3, 4, 5, 6]
    rows = query(db, "SELECT step, count(*) AS n FROM reward_components GROUP BY step ORDER BY step")
    assert rows["n"].tolist() == [8] * 6  # each step's responses scored once, none twice


# issue 48 L4: a reward file whose import, or whose function, ends its worker process or never returns
ENDS = """
import os
import signal
import time
from pathlib import Path

HOW = Path(__file__).with_name("how.txt").read_text().strip()  # data the test writes: what the file does
if HOW == "import-exits":
    os._exit(0)
if HOW == "import-killed":
    os.kill(os.getpid(), signal.SIGKILL)
if HOW == "import-sleeps":
    time.sleep(3600)


def score(completions, **kwargs):
    if HOW == "call-exits":
        os._exit(3)
    if HOW == "call-killed":
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0]
"""


@pytest.mark.parametrize(
    "how, message",
    [
        (
            "import-exits",
            "the worker process importing it ended before it was ready, 3 times in a row (exit codes 0, "
            "0, 0): does the module end the process when it is imported",
        ),
        ("import-killed", "ended before it was ready, 3 times in a row (exit codes -9, -9, -9)"),
        (
            "import-sleeps",
            "importing it did not finish within 20 s (the worker that imports it never said it was "
            "ready): does the module sleep",
        ),
        ("call-exits", "failed at step 1 on response 1 of 8 ('"),
        ("call-killed", "the worker process running it ended (exit code -9). Does the function end the process"),
    ],
)
def test_a_reward_file_that_ends_its_worker_or_never_imports_is_said_as_such(tmp_path, monkeypatch, how, message):
    """L4: a file calling os._exit on import was reported as math-verify's workers dying ("check that `python -c
    'import math_verify'` works"), in a traceback; one sleeping on import as a RuntimeError traceback after 120 s;
    one calling os._exit when called as a function that "hangs, or is far slower". Each is said as what it is,
    naming the file: exit 2, one message, no traceback."""
    from typer.testing import CliRunner

    from qae_app.cli.main import app
    from qae_app.rewards import registry

    monkeypatch.setattr(registry, "START_TIMEOUT_S", 20.0, raising=False)  # (the sleeping import: not its limit)
    (tmp_path / "ends.py").write_text(ENDS)
    (tmp_path / "how.txt").write_text(how)
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--run-name",
            "r",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--cpu",
            "--reward",
            f"{tmp_path / 'ends.py'}:score",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        env={"COLUMNS": "300"},
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and said.count("error:") == 1, said
    assert result.exception is None or isinstance(result.exception, SystemExit), said  # no traceback
    assert f"reward: {tmp_path / 'ends.py'}:score" in said and message in said and "math_verify" not in said, said
