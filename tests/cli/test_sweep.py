"""`qae sweep`, `qae runs --sweep` and `qae compare`: the grid, its tags, resuming a killed sweep, runs side by side,
and the comparison printed from stored runs with known values (hand-computed intervals and paired differences)."""

import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.sweep import plan_sweep
from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter

runner = CliRunner()
QAE = [sys.executable, "-m", "qae_app.cli"]
TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--checkpoint-every",
        "1"]


def test_the_grid_repeats_k_for_qae_only_and_tags_every_point(tmp_path):
    sweep = plan_sweep(tmp_path, "qae,grpo", "0.3,0.4,0.5", 3, {"steps": 5, "seed": 7}, name="study")
    names = [p.run_name for p in sweep.points]
    assert len(names) == 3 * 3 + 3  # qae: 3 K x 3 seeds; grpo: 3 seeds, no K
    assert names[:3] == ["study-qae-k0.3-s7", "study-qae-k0.3-s8", "study-qae-k0.3-s9"]
    assert names[-3:] == ["study-grpo-s7", "study-grpo-s8", "study-grpo-s9"]
    for point in sweep.points:
        assert point.options["sweep_id"] == sweep.sweep_id and point.options["sweep_name"] == "study"
        assert point.options["steps"] == 5 and point.options["run_name"] == point.run_name
        assert ("k" in point.options) == (point.options["estimator"] == "qae")
        assert point.options["log_entropy_delta"] is True  # on in sweeps unless turned off
    assert not plan_sweep(tmp_path, "qae", None, 1, {"log_entropy_delta": False}).points[0].options["log_entropy_delta"]
    # the id hashes the shared options, not the grid: more seeds extend the same sweep
    assert plan_sweep(tmp_path, "qae", None, 5, {"steps": 5, "seed": 7}, name="study").sweep_id == sweep.sweep_id
    assert plan_sweep(tmp_path, "qae", None, 1, {"steps": 6}, name="study").sweep_id != sweep.sweep_id


def test_a_sweep_checks_its_data_files_before_any_run_starts(tmp_path):
    """A bad --data was found by each run in turn (three failed runs, exit 1) and the closing line still advised a
    `qae compare` that then found no run of the sweep."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')  # no answer
    for option in ("--data", "--eval-bench"):
        result = runner.invoke(app, ["sweep", option, str(bad), "--seeds", "3", *TINY[:2],
                                     "--runs-dir", str(tmp_path / "runs")])
        output = "".join(result.output.split())  # the console wraps long paths anywhere
        assert result.exit_code == 2, result.output
        assert "".join(f"{option[2:]}: '{bad}' line 1 has no answer".split()) in output, result.output
        assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_sweep_point_named_like_an_eval_run_is_refused(tmp_path):
    """An eval run took the name of the sweep's first point: the sweep tried to resume it and failed with 'no run'."""
    runs = tmp_path / "runs"
    result = runner.invoke(app, ["eval", "--run-name", "foo-qae-k0.4-s0", "--limit", "2", "--samples", "1",
                                 "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["sweep", "--name", "foo", *TINY, "--runs-dir", str(runs)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "name: run 'foo-qae-k0.4-s0' already exists" in output and "is not a training run" in output


def test_a_sweep_point_whose_database_is_gone_is_refused_up_front(tmp_path):
    """A point's folder kept its config.json but lost qae.duckdb: the sweep started it as new, the trainer said the
    run exists and to --resume it, and the resume said the rows were lost."""
    plan = plan_sweep(tmp_path, "qae", None, 1, {"steps": 2}, name="gone")
    folder = tmp_path / plan.points[0].run_name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"sweep_id": plan.sweep_id}))
    with pytest.raises(QAEUserError, match=f"run '{plan.points[0].run_name}' of this sweep has lost its database"):
        plan_sweep(tmp_path, "qae", None, 1, {"steps": 2}, name="gone")


def test_parallel_beyond_the_cores_is_refused(tmp_path):
    cores = os.cpu_count() or 1
    result = runner.invoke(app, ["sweep", "--parallel", str(cores + 1), *TINY, "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"parallel: {cores + 1}" in result.output and f"{cores} cores" in " ".join(result.output.split())


def test_sweep_help_gives_the_sweeps_own_defaults():
    # a sweep measures the entropy change by default (unlike qae train): its help must say so, not train's default
    result = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "--log-entropy-delta" in line)
    assert "(default: True)" in line and "(default: False)" not in line, line
    train_help = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"}).output
    assert "(default: False)" in next(line for line in train_help.splitlines() if "--log-entropy-delta" in line)


@pytest.mark.parametrize("args, message", [
    (["--estimator", "grpo", "--k", "0.3"], "k: 0.3 is QAE's quantile level, and the sweep has no qae run"),
    (["--estimator", "qae,ppo"], "estimator: unknown 'ppo'"),
    (["--estimator", "qae,qae"], "estimator: 'qae,qae' repeats a value"),
    (["--seeds", "0"], "seeds: 0. Use 1 or more seeds"),
    (["--lr", "-1"], "lr: -1.0"),
    (["--k", "0.3,1.5"], "(in sweep point"),
    (["--parallel", "0"], "parallel: 0"),
])
def test_a_bad_sweep_is_refused_before_any_run_starts(tmp_path, args, message):
    result = runner.invoke(app, ["sweep", *args, "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not list((tmp_path / "runs").glob("*/qae.duckdb"))


@pytest.mark.slow
def test_a_sweep_runs_its_points_lists_them_and_keeps_them_when_run_again(tmp_path):
    runs = tmp_path / "runs"
    command = [*QAE, "sweep", "--estimator", "qae,grpo", "--name", "s", "--runs-dir", str(runs), *TINY]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "sweep 2 done" in first.stdout
    ids = ["s-grpo-s0", "s-qae-k0.4-s0"]
    for run_id in ids:
        info = read_run(db_path(runs, run_id))
        config = json.loads(info["config"])
        assert info["status"] == "finished" and read_steps(db_path(runs, run_id))["step"].tolist() == [1, 2]
        assert config["sweep_name"] == "s" and config["estimator"] == run_id.split("-")[1]
    created = {run_id: read_run(db_path(runs, run_id))["created_at"] for run_id in ids}

    listed = runner.invoke(app, ["runs", "--sweep", "s", "--runs-dir", str(runs)], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and all(run_id in listed.output for run_id in ids)
    assert "no run of sweep 'other'" in runner.invoke(app, ["runs", "--sweep", "other", "--runs-dir",
                                                            str(runs)]).output

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "sweep 2 kept" in again.stdout, again.stdout + again.stderr
    assert {run_id: read_run(db_path(runs, run_id))["created_at"] for run_id in ids} == created
    other = subprocess.run([*command[:-len(TINY)], "--steps", "3"], capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "belongs to sweep" in " ".join(other.stderr.split())


def _pids_of(pattern: str) -> list[int]:
    """Processes whose command line contains `pattern` (read from /proc: no pgrep needed)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if pattern.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return [pid for pid in pids if pid != os.getpid()]


@pytest.mark.slow
def test_a_killed_sweep_resumes_keeping_finished_runs_and_losing_none(tmp_path):
    runs = tmp_path / "runs"
    options = ["--steps", "4", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0",
               "--checkpoint-every", "1"]
    command = [*QAE, "sweep", "--estimator", "qae", "--seeds", "3", "--name", "k", "--runs-dir", str(runs),
               *options]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first, second = db_path(runs, "k-qae-k0.4-s0"), db_path(runs, "k-qae-k0.4-s1")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait for: first run finished, second run past its first checkpoint
        time.sleep(0.5)
        try:
            if (first.exists() and read_run(first)["status"] == "finished" and second.exists()
                    and len(query(second, "SELECT step FROM steps")) >= 2):
                break
        except Exception:  # noqa: BLE001 - a file being written may be unreadable for a moment
            continue
    else:
        sweep.kill()
        pytest.fail("the sweep did not reach its second run in time")
    sweep.kill()  # kill -9: the sweep has no chance to stop its child; the kernel sends the child SIGTERM
    sweep.wait()
    deadline = time.monotonic() + 120
    while _pids_of("k-qae-k0.4-s1") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _pids_of("k-qae-k0.4-s1"), "the trainer outlived its killed sweep"
    created = read_run(first)["created_at"]
    assert read_run(second)["status"] in ("interrupted", "stopped", "finished")
    assert not db_path(runs, "k-qae-k0.4-s2").exists()

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert read_run(first)["created_at"] == created  # kept, not trained again
    for seed in range(3):
        path = db_path(runs, f"k-qae-k0.4-s{seed}")
        assert read_run(path)["status"] == "finished"
        assert read_steps(path)["step"].tolist() == [1, 2, 3, 4]  # every step once: none lost, none duplicated


@pytest.mark.slow
def test_parallel_2_trains_two_runs_at_once(tmp_path):
    runs = tmp_path / "runs"
    result = subprocess.run([*QAE, "sweep", "--estimator", "qae", "--seeds", "2", "--parallel", "2", "--name", "p",
                             "--runs-dir", str(runs), *TINY, "--steps", "4"], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # the two trainer processes lived at the same time: each was started before the other exited (one at a time,
    # the second starts after the first exited). The sweep's log of each point says when its process started and
    # exited; the database's timestamps cannot say it (a trainer goes on after its last write: the final checkpoint,
    # the exit, and on a loaded machine one may take its 4 steps while the other is still importing torch)
    (a_start, a_exit), (b_start, b_exit) = (process_lifetime(runs / ".sweeps" / "p" / f"p-qae-k0.4-s{seed}.log")
                                            for seed in (0, 1))
    assert a_start < b_exit and b_start < a_exit


def process_lifetime(log: Path) -> tuple[datetime, datetime]:
    """(start, exit) of the one trainer process a sweep's point log records."""
    text = log.read_text()
    starts = re.findall(r"^# qae sweep \S+: start \S+ at (\S+)$", text, re.M)
    exits = re.findall(r"^# qae sweep \S+: \S+ exited with code 0 at (\S+) after [\d.]+ s$", text, re.M)
    assert len(starts) == 1 and len(exits) == 1, text
    return datetime.fromisoformat(starts[0]), datetime.fromisoformat(exits[0])


# ---------------------------------------------------------------------------------------------------------------
# qae compare on stored runs with known values


def _store_run(runs: Path, run_id: str, seed: int, estimator: str, heldout: dict[int, float], entropy: float,
               sweep: str = "cmp") -> None:
    writer = RunWriter(runs / run_id / "qae.duckdb", run_id)
    config = {**TrainConfig().to_dict(), "seed": seed, "run_name": run_id, "estimator": estimator,
              "sweep_id": "id-" + sweep, "sweep_name": sweep}
    writer.create_run(run_id, config, estimator, 0.4, "builtin:tiny", "arith", seed)
    for step in (1, 2, 3, 4):
        row = {name: 0.5 for name in STEP_METRICS}
        row.update(heldout_accuracy=heldout.get(step), entropy=entropy, frac_zero_adv=0.8, step_s=1.0)
        writer.add_step(step, steps=[row])
    assert writer.flush()
    assert writer.update_run(status="finished")
    (runs / run_id / "config.json").write_text(json.dumps(config))


@pytest.fixture
def known_runs(tmp_path) -> Path:
    runs = tmp_path / "runs"
    for seed, (q, g) in enumerate([(0.6, 0.5), (0.7, 0.5), (0.8, 0.7)]):
        _store_run(runs, f"cmp-qae-s{seed}", seed, "qae", {2: q - 0.2, 4: q}, entropy=1.0 + seed)
        _store_run(runs, f"cmp-grpo-s{seed}", seed, "grpo", {2: g - 0.2, 4: g}, entropy=2.0)
    _store_run(runs, "elsewhere", 0, "qae", {4: 0.1}, entropy=1.0, sweep="other")
    return runs


def test_copied_run_folders_do_not_count_as_seeds(known_runs):
    """`cp -r` backups of a sweep's runs carry the sweep's tag: each group's n stays its distinct seeds, the copies are
    named as not counted, the interval is the one without them, and the pairing names the runs it used."""
    import shutil

    before = json.loads(runner.invoke(app, ["compare", "--sweep", "cmp", "--json", "--runs-dir",
                                            str(known_runs)]).output)
    for seed in (0, 1):
        shutil.copytree(known_runs / f"cmp-grpo-s{seed}", known_runs / f"cmp-grpo-s{seed}.bak")
    result = runner.invoke(app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--json", "--runs-dir",
                                 str(known_runs)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    grpo = {g["label"]: g for g in out["groups"]}["estimator=grpo"]
    assert grpo["n"] == 3 and grpo["seeds"] == [0, 1, 2]
    assert grpo["runs"] == ["cmp-grpo-s0", "cmp-grpo-s1", "cmp-grpo-s2"]
    assert grpo["excluded"] == {f"cmp-grpo-s{s}.bak": f"a copy of cmp-grpo-s{s}, seed {s}: counted once"
                                for s in (0, 1)}
    assert grpo["metrics"] == {g["label"]: g for g in before["groups"]}["estimator=grpo"]["metrics"]
    pairs = out["differences"]["estimator=qae"]["final_heldout"]["pairs"]
    assert pairs == [[s, f"cmp-qae-s{s}", f"cmp-grpo-s{s}"] for s in range(3)]
    text = runner.invoke(app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--runs-dir", str(known_runs)],
                         env={"COLUMNS": "200"}).output
    assert "n=3 (seeds 0, 1, 2)" in text and "cmp-grpo-s0.bak (a copy of cmp-grpo-s0, seed 0: counted once)" in text
    assert "seed 0 cmp-qae-s0 - cmp-grpo-s0" in text


@pytest.mark.slow
def test_a_real_sweep_copied_on_disk_keeps_its_seed_count(tmp_path):
    """A real `qae sweep` (2 estimators x 2 seeds), every run folder then copied with `cp -r`: compare still sees 2
    seeds a group and the same numbers."""
    runs = tmp_path / "runs"
    done = subprocess.run([*QAE, "sweep", "--estimator", "qae,grpo", "--seeds", "2", "--name", "cp",
                           "--runs-dir", str(runs), *TINY], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    compare = [*QAE, "compare", "--sweep", "cp", "--baseline", "grpo", "--json", "--runs-dir", str(runs)]
    before = json.loads(subprocess.run(compare, capture_output=True, text=True, timeout=300).stdout)
    for folder in [p for p in runs.iterdir() if p.name.startswith("cp-")]:
        subprocess.run(["cp", "-r", str(folder), str(folder) + "-backup"], check=True)
    after = json.loads(subprocess.run(compare, capture_output=True, text=True, timeout=300).stdout)
    for group, old in zip(after["groups"], before["groups"]):
        assert group["n"] == old["n"] == 2 and group["seeds"] == [0, 1] and group["metrics"] == old["metrics"]
        assert sorted(group["excluded"]) == sorted(run + "-backup" for run in group["runs"])
    assert after["differences"] == before["differences"]


def test_compare_json_gives_the_hand_computed_intervals_and_paired_differences(known_runs):
    result = runner.invoke(app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--json", "--runs-dir",
                                 str(known_runs)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    groups = {g["label"]: g for g in out["groups"]}
    assert set(groups) == {"estimator=qae", "estimator=grpo"}  # "elsewhere" is another sweep
    qae = groups["estimator=qae"]
    assert qae["n"] == 3 and qae["seeds"] == [0, 1, 2] and "wide" in qae["note"]
    final = qae["metrics"]["final_heldout"]
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert final["mean"] == pytest.approx(0.7) and final["low"] == pytest.approx(0.7 - half)
    assert qae["metrics"]["entropy_last"]["mean"] == pytest.approx(2.0)  # seeds at 1, 2, 3 nats
    assert qae["metrics"]["auc_heldout"]["mean"] == pytest.approx(0.6)  # (q - 0.2 + q) / 2 over steps 2..4
    assert out["baseline"] == "estimator=grpo"
    diff = out["differences"]["estimator=qae"]["final_heldout"]
    # paired differences 0.1, 0.2, 0.1: mean 2/15, sd 1/sqrt(300), t = (2/15) / (sd / sqrt 3) = 4
    assert diff["mean"] == pytest.approx(2 / 15) and diff["seeds"] == [0, 1, 2]
    assert diff["p_value"] == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-9)  # two-sided t(2) tail at t = 4


def test_compare_prints_groups_intervals_baseline_and_small_n_notes(known_runs):
    result = runner.invoke(app, ["compare", "cmp-qae-s0", "cmp-qae-s1", "cmp-grpo-s0", "--baseline", "grpo",
                                 "--runs-dir", str(known_runs)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert "G1 estimator=qae: n=2 (seeds 0, 1)" in text and "G2 estimator=grpo: n=1 (seeds 0)" in text
    assert "minus the baseline G2 (estimator=grpo), paired by seed" in text
    assert "G1: 1 seed(s) shared with the baseline are paired (0)" in text
    assert "G2: n=1: one seed, no interval" in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("args, message", [
    (["compare"], "compare: pass run ids or --sweep ID"),
    (["compare", "--sweep", "nope"], "sweep: no run in"),
    (["compare", "missing-run"], "run: no run 'missing-run'"),
    (["compare", "--sweep", "cmp", "--baseline", "ppo"], "baseline: 'ppo' matches no group"),
])
def test_compare_refuses_clearly(known_runs, args, message):
    result = runner.invoke(app, [*args, "--runs-dir", str(known_runs)])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.slow
def test_a_point_whose_name_another_run_took_meanwhile_is_skipped_not_trained(tmp_path):
    """A plain `qae train --run-name X` that took the name of a sweep's next point after the sweep planned it: the
    sweep resumed (trained!) the foreign run, or failed the point advising `--resume X`. Now the point is skipped,
    said to be taken by another run, and the foreign run is left alone."""
    from qae_app.cli.sweep import run_sweep

    options = {"steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_every": 0, "checkpoint_every": 1}
    sweep = plan_sweep(tmp_path, "qae", None, 1, dict(options), name="race")
    taken = sweep.points[0].run_name
    result = runner.invoke(app, ["train", *TINY[:-2], "--steps", "1", "--run-name", taken, "--runs-dir",
                                 str(tmp_path)])  # another user's run, started between planning and training
    assert result.exit_code == 0, result.output
    before = db_path(tmp_path, taken).read_bytes()
    states = run_sweep(sweep, tmp_path)
    assert states == {taken: "taken"}
    assert db_path(tmp_path, taken).read_bytes() == before and read_run(db_path(tmp_path, taken))["last_step"] == 1


def test_the_cli_says_a_taken_point_was_taken_by_another_run(tmp_path, monkeypatch):
    import qae_app.cli.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "run_sweep", lambda plan, *a, **k: {p.run_name: "taken" for p in plan.points})
    result = runner.invoke(app, ["sweep", *TINY, "--name", "race", "--runs-dir", str(tmp_path)])
    output = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "skipped: race-qae-k0.4-s0 was taken by another run (not of this sweep)" in output, output
    assert "--resume" not in output and "Pass another --name" in output, output
