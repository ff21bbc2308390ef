"""`qae sweep`, `qae runs --sweep` and `qae compare`: the grid, its tags, what a sweep refuses before any run starts,
and the comparison printed from stored runs with known values (hand-computed intervals and paired differences). The
sweeps that run their points (resuming a killed sweep, runs side by side) are tests/e2e/test_sweep_runs.py's."""

import json
import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.sweep import plan_sweep
from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.store.schema import STEP_METRICS
from qae_app.store.writer import RunWriter

runner = CliRunner()
TINY = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-every", "0", "--checkpoint-every", "1"]


def test_a_point_file_gives_each_run_the_prompt_as_written(tmp_path):
    """Each point's options reach its run through a TOML file: a template with LaTeX, quotes, newlines and a system
    prompt with an emoji (a surrogate pair in JSON's ASCII escapes, which TOML refuses) and DEL read back the same."""
    from qae_app.cli.sweep import write_point_file
    from qae_app.config import load_toml

    options = {
        "prompt_template": 'Say "hi".\n\n{question}\tput it in \\boxed{}',
        "system_prompt": "Be kind \U0001f600\x7f",
        "steps": 3,
        "lr": 1e-05,
        "dynamic_sampling": True,
    }
    assert load_toml(write_point_file(tmp_path / "p.toml", options)) == options


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


def test_the_grid_over_policy_losses_names_each_point_by_loss_and_gives_it_its_own_options(tmp_path):
    """The bake-off: losses x estimators x seeds, a loss's option going to its points alone; an option of a loss
    outside the sweep is refused, and the same command with another loss extends the same sweep."""
    sweep = plan_sweep(
        tmp_path,
        "grpo,qae",
        None,
        3,
        {"steps": 5, "seed": 1, "clip_cov_ratio": 0.001},
        name="bake",
        losses="clip,clip_cov,kl_cov,gspo",
    )
    names = [p.run_name for p in sweep.points]
    assert len(names) == 4 * 2 * 3
    assert names[:4] == ["bake-clip-grpo-s1", "bake-clip-grpo-s2", "bake-clip-grpo-s3", "bake-clip-qae-k0.4-s1"]
    assert names[-1] == "bake-gspo-qae-k0.4-s3"
    for point in sweep.points:
        loss = point.run_name.split("-")[1]
        assert point.options["policy_loss"] == loss
        assert ("clip_cov_ratio" in point.options) == (loss == "clip_cov")
    assert {p.options["clip_cov_ratio"] for p in sweep.points if "clip_cov_ratio" in p.options} == {0.001}
    more = plan_sweep(
        tmp_path,
        "grpo,qae",
        None,
        3,
        {"steps": 5, "seed": 1, "clip_cov_ratio": 0.001},
        name="bake",
        losses="clip,clip_cov,kl_cov,gspo,cispo",
    )
    assert more.sweep_id == sweep.sweep_id and len(more.points) == 5 * 2 * 3
    # without --policy-loss the names and the id are a plain sweep's, as before the option
    plain = plan_sweep(tmp_path, "qae", None, 1, {"steps": 5}, name="plain")
    assert [p.run_name for p in plain.points] == ["plain-qae-k0.4-s0"] and "policy_loss" not in plain.points[0].options
    with pytest.raises(QAEUserError, match="clip-cov-ratio: 0.001 is an option of --policy-loss clip_cov"):
        plan_sweep(tmp_path, "qae", None, 1, {"clip_cov_ratio": 0.001}, name="x", losses="clip,gspo")


def test_a_sweep_checks_its_data_files_before_any_run_starts(tmp_path):
    """A bad --data was found by each run in turn (three failed runs, exit 1) and the closing line still advised a
    `qae compare` that then found no run of the sweep."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?"}\n')  # no answer
    for option in ("--data", "--eval-bench"):
        result = runner.invoke(
            app, ["sweep", option, str(bad), "--seeds", "3", *TINY[:2], "--runs-dir", str(tmp_path / "runs")]
        )
        output = "".join(result.output.split())  # the console wraps long paths anywhere
        assert result.exit_code == 2, result.output
        assert "".join(f"{option[2:]}: '{bad}' line 1 has no answer".split()) in output, result.output
        assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_sweep_takes_the_reward_options_and_names_the_reward_code_again_on_resume(tmp_path):
    """Each point's file is what `qae train --config` reads (reward as a TOML list); a point resumed gets --reward
    again (a resumed run imports reward code only when named); a missing reward file is refused before any run."""
    import tomllib

    from qae_app.cli.sweep import _command, write_point_file
    from qae_app.config import build_config

    (tmp_path / "r.py").write_text("def score(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    spec = f"{tmp_path / 'r.py'}:score"
    given = {"steps": 2, "reward": ["exact_int", spec], "reward_weights": "1,0.5"}
    sweep = plan_sweep(tmp_path, "qae", None, 1, dict(given), name="rw")
    point = sweep.points[0]
    written = tomllib.loads(write_point_file(tmp_path / "p.toml", point.options).read_text())
    assert written["reward"] == ["exact_int", spec] and written["reward_weights"] == "1,0.5"
    assert build_config(tmp_path / "p.toml").reward == ["exact_int", spec]
    resume = _command(sweep, point, "resume", tmp_path, cpu=False)
    assert resume[-4:] == ["--reward", "exact_int", "--reward", spec]
    missing = runner.invoke(
        app, ["sweep", "--reward", str(tmp_path / "none.py:score"), *TINY[:2], "--runs-dir", str(tmp_path / "runs")]
    )
    assert missing.exit_code == 2 and "none.pydoesnotexist" in "".join(missing.output.split())
    assert not (tmp_path / "runs").exists()


def test_a_sweep_point_named_like_an_eval_run_is_refused(tmp_path):
    """An eval run took the name of the sweep's first point: the sweep tried to resume it and failed with 'no run'."""
    runs = tmp_path / "runs"
    result = runner.invoke(
        app, ["eval", "--run-name", "foo-qae-k0.4-s0", "--limit", "2", "--samples", "1", "--runs-dir", str(runs)]
    )
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
    # (COLUMNS only: typer reads TERMINAL_WIDTH once, when the first help is drawn, and it kept 400 columns for every
    # later help of the process, which broke the 100-column snapshots run after this test in the same worker)
    result = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "--log-entropy-delta" in line)
    assert "(default: True)" in line and "(default: False)" not in line, line
    train_help = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output
    assert "(default: False)" in next(line for line in train_help.splitlines() if "--log-entropy-delta" in line)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--estimator", "grpo", "--k", "0.3"], "k: 0.3 is QAE's quantile level, and the sweep has no qae run"),
        (["--estimator", "qae,ppo"], "estimator: unknown 'ppo'"),
        (["--estimator", "qae,qae"], "estimator: 'qae,qae' repeats a value"),
        (["--policy-loss", "clip,vanilla"], "policy-loss: unknown 'vanilla'. Choose from: clip, clip_cov, kl_cov"),
        (["--policy-loss", "gspo", "--loss-agg", "token"], "loss-agg: token is not defined for --policy-loss gspo"),
        (["--seeds", "0"], "seeds: 0. Use 1 or more seeds"),
        (["--lr", "-1"], "lr: -1.0"),
        (["--k", "0.3,1.5"], "(in sweep point"),
        (["--parallel", "0"], "parallel: 0"),
    ],
)
def test_a_bad_sweep_is_refused_before_any_run_starts(tmp_path, args, message):
    result = runner.invoke(app, ["sweep", *args, "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not list((tmp_path / "runs").glob("*/qae.duckdb"))


# ---------------------------------------------------------------------------------------------------------------
# qae compare on stored runs with known values


def _store_run(
    runs: Path,
    run_id: str,
    seed: int,
    estimator: str,
    heldout: dict[int, float],
    entropy: float,
    sweep: str = "cmp",
    policy_loss: str = "clip",
) -> None:
    writer = RunWriter(runs / run_id / "qae.duckdb", run_id)
    config = {
        **TrainConfig(policy_loss=policy_loss).to_dict(),
        "seed": seed,
        "run_name": run_id,
        "estimator": estimator,
        "sweep_id": "id-" + sweep,
        "sweep_name": sweep,
    }
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

    before = json.loads(
        runner.invoke(app, ["compare", "--sweep", "cmp", "--json", "--runs-dir", str(known_runs)]).output
    )
    for seed in (0, 1):
        shutil.copytree(known_runs / f"cmp-grpo-s{seed}", known_runs / f"cmp-grpo-s{seed}.bak")
    result = runner.invoke(
        app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--json", "--runs-dir", str(known_runs)]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    grpo = {g["label"]: g for g in out["groups"]}["estimator=grpo"]
    assert grpo["n"] == 3 and grpo["seeds"] == [0, 1, 2]
    assert grpo["runs"] == ["cmp-grpo-s0", "cmp-grpo-s1", "cmp-grpo-s2"]
    assert grpo["excluded"] == {
        f"cmp-grpo-s{s}.bak": f"a copy of cmp-grpo-s{s}, seed {s}: counted once" for s in (0, 1)
    }
    assert grpo["metrics"] == {g["label"]: g for g in before["groups"]}["estimator=grpo"]["metrics"]
    pairs = out["differences"]["estimator=qae"]["final_heldout"]["pairs"]
    assert pairs == [[s, f"cmp-qae-s{s}", f"cmp-grpo-s{s}"] for s in range(3)]
    text = runner.invoke(
        app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--runs-dir", str(known_runs)], env={"COLUMNS": "200"}
    ).output
    assert "n=3 (seeds 0, 1, 2)" in text and "cmp-grpo-s0.bak (a copy of cmp-grpo-s0, seed 0: counted once)" in text
    assert "seed 0 cmp-qae-s0 - cmp-grpo-s0" in text


def test_compare_json_gives_the_hand_computed_intervals_and_paired_differences(known_runs):
    result = runner.invoke(
        app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--json", "--runs-dir", str(known_runs)]
    )
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


def test_compare_json_follows_the_one_statistics_rule_below_three_seeds(known_runs):
    """`--json` is read by scripts that quote it: below 3 paired seeds it gives no interval and no p-value (null,
    with the reason), as the tables and the Compare page do; the mean and sd stay."""
    result = runner.invoke(
        app,
        [
            "compare",
            "cmp-qae-s0",
            "cmp-qae-s1",
            "cmp-grpo-s0",
            "cmp-grpo-s1",
            "--baseline",
            "grpo",
            "--json",
            "--runs-dir",
            str(known_runs),
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    final = {g["label"]: g for g in out["groups"]}["estimator=qae"]["metrics"]["final_heldout"]
    assert final["mean"] == pytest.approx(0.65) and final["sd"] == pytest.approx(math.sqrt(0.005))
    assert (final["low"], final["high"], final["no_interval"]) == (None, None, "n=2: no interval")
    diff = out["differences"]["estimator=qae"]["final_heldout"]
    assert diff["mean"] == pytest.approx(0.15) and diff["seeds"] == [0, 1]
    assert (diff["low"], diff["high"], diff["p_value"]) == (None, None, None)
    assert diff["no_interval"] == "n=2: no interval"
    three = json.loads(
        runner.invoke(
            app, ["compare", "--sweep", "cmp", "--baseline", "grpo", "--json", "--runs-dir", str(known_runs)]
        ).output
    )
    diff = three["differences"]["estimator=qae"]["final_heldout"]
    assert diff["low"] is not None and diff["p_value"] is not None and diff["no_interval"] is None


def test_compare_prints_groups_intervals_baseline_and_small_n_notes(known_runs):
    result = runner.invoke(
        app,
        ["compare", "cmp-qae-s0", "cmp-qae-s1", "cmp-grpo-s0", "--baseline", "grpo", "--runs-dir", str(known_runs)],
        env={"COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "G1 estimator=qae: n=2 (seeds 0, 1)" in text and "G2 estimator=grpo: n=1 (seeds 0)" in text
    assert "minus the baseline G2 (estimator=grpo), paired by seed" in text
    assert "G1: 1 seed(s) shared with the baseline are paired (0)" in text
    assert "G2: n=1: one seed, no interval" in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= 80


def test_compare_lays_a_grid_of_policy_losses_out_as_the_paper_s_table(known_runs):
    """Clip from the known runs plus GSPO, grpo and qae over 3 seeds: `--json` gives a row per loss with base, + QAE
    and the paired difference (clip's by hand, as above), and the text prints a table per metric in 80 columns."""
    for seed, (q, g) in enumerate([(0.5, 0.5), (0.6, 0.5), (0.9, 0.6)]):
        _store_run(known_runs, f"cmp-gspo-qae-s{seed}", seed, "qae", {4: q}, 1.0, policy_loss="gspo")
        _store_run(known_runs, f"cmp-gspo-grpo-s{seed}", seed, "grpo", {4: g}, 2.0, policy_loss="gspo")
    out = json.loads(runner.invoke(app, ["compare", "--sweep", "cmp", "--json", "--runs-dir", str(known_runs)]).output)
    table = out["by_policy_loss"]
    assert table["base_estimator"] == "grpo" and [row["policy_loss"] for row in table["rows"]] == ["clip", "gspo"]
    clip = table["rows"][0]["metrics"]["final_heldout"]
    assert clip["base"]["mean"] == pytest.approx(17 / 30) and clip["qae"]["mean"] == pytest.approx(0.7)
    assert clip["difference"]["mean"] == pytest.approx(2 / 15)
    assert clip["difference"]["p_value"] == pytest.approx(1 - 4 / math.sqrt(18), abs=1e-9)
    gspo = table["rows"][1]["metrics"]["final_heldout"]["difference"]  # 0, 0.1, 0.3
    assert gspo["mean"] == pytest.approx(0.4 / 3) and gspo["seeds"] == [0, 1, 2]
    assert table["rows"][1]["metrics"]["entropy_last"]["difference"]["mean"] == pytest.approx(-1.0)
    text = runner.invoke(
        app, ["compare", "--sweep", "cmp", "--runs-dir", str(known_runs)], env={"COLUMNS": "80"}
    ).output
    assert "by policy loss, as the paper's Table 2" in " ".join(text.split())
    assert "qae - grpo" in text and "entropy_range" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    alone = json.loads(
        runner.invoke(app, ["compare", "cmp-qae-s0", "cmp-qae-s1", "--json", "--runs-dir", str(known_runs)]).output
    )
    assert alone["by_policy_loss"] is None  # one estimator: no such table


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare"], "compare: pass run ids or --sweep ID"),
        (["compare", "--sweep", "nope"], "sweep: no run in"),
        (["compare", "missing-run"], "run: no run 'missing-run'"),
        (["compare", "--sweep", "cmp", "--baseline", "ppo"], "baseline: 'ppo' matches no group"),
    ],
)
def test_compare_refuses_clearly(known_runs, args, message):
    result = runner.invoke(app, [*args, "--runs-dir", str(known_runs)])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_the_cli_says_a_taken_point_was_taken_by_another_run(tmp_path, monkeypatch):
    monkeypatch.setattr("qae_app.cli.sweep.run_sweep", lambda plan, *a, **k: {p.run_name: "taken" for p in plan.points})
    result = runner.invoke(app, ["sweep", *TINY, "--name", "race", "--runs-dir", str(tmp_path)])
    output = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "skipped: race-qae-k0.4-s0 was taken by another run (not of this sweep)" in output, output
    assert "--resume" not in output and "Pass another --name" in output, output
