"""End to end with tiny settings: the stored rows mean what they say, resume replays nothing twice, bad input fails
cleanly. Real model, real DuckDB file, real checkpoints."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from qae_app.algo.advantages import REGIMES, EstimatorConfig, compute_advantages
from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.core.names import entropy_band
from qae_app.data.tasks import prompts_at
from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.rows import step_metrics
from qae_app.store.run_folder import db_path
from qae_app.store.schema import STEP_METRICS
from qae_app.train.session import resume_config
from qae_app.train.trainer import Trainer
from tests.conftest import TINY_RUN_OPTIONS
from tests.same_steps import assert_same_metrics

runner = CliRunner()


def test_every_step_is_stored_with_every_metric(tiny_run):
    runs_dir, run_id = tiny_run
    path = db_path(runs_dir, run_id)
    steps = read_steps(path)
    assert steps["step"].tolist() == list(range(1, TINY_RUN_OPTIONS["steps"] + 1))
    assert set(STEP_METRICS) <= set(steps.columns)
    for name in ("reward_mean", "accuracy", "entropy", "frac_zero_adv", "loss", "response_len", "step_s"):
        assert steps[name].notna().all(), name
    # held-out accuracy on eval steps only
    assert steps.loc[steps["step"].isin([3, 6]), "heldout_accuracy"].notna().all()
    assert steps.loc[~steps["step"].isin([3, 6]), "heldout_accuracy"].isna().all()
    n = TINY_RUN_OPTIONS["prompts_per_step"] * TINY_RUN_OPTIONS["group_size"]
    counts = query(path, "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step")
    assert counts["n"].tolist() == [n] * TINY_RUN_OPTIONS["steps"]
    assert read_run(path)["status"] == "finished"


def test_stored_advantages_are_what_the_estimator_gives_for_the_stored_rewards(tiny_run):
    runs_dir, run_id = tiny_run
    path = db_path(runs_dir, run_id)
    rollouts = query(path, "SELECT * FROM rollouts ORDER BY step, group_idx, sample_idx")
    groups = query(path, "SELECT * FROM groups ORDER BY step, group_idx")
    assert (rollouts["gated"] == (rollouts["advantage"] == 0)).all()
    G = TINY_RUN_OPTIONS["group_size"]
    rewards = torch.tensor(rollouts["reward"].to_numpy(), dtype=torch.float32).view(-1, G)
    expected = compute_advantages("qae", rewards, EstimatorConfig(k=0.4))
    assert torch.allclose(
        torch.tensor(rollouts["advantage"].to_numpy(), dtype=torch.float32).view(-1, G), expected.advantages, atol=1e-6
    )
    assert groups["regime"].tolist() == [REGIMES[r] for r in expected.regime.tolist()]
    assert groups["baseline"].tolist() == expected.baseline.tolist()
    assert (groups["n_correct"].to_numpy() == (rewards == 1).sum(1).numpy()).all()


def test_step_metrics_recompute_from_stored_rows(tiny_run):
    runs_dir, run_id = tiny_run
    path = db_path(runs_dir, run_id)
    steps = read_steps(path).set_index("step")
    for step in (1, 4):
        groups = query(path, "SELECT * FROM groups WHERE step = ?", [step]).to_dict("records")
        rollouts = query(path, "SELECT * FROM rollouts WHERE step = ?", [step]).to_dict("records")
        for name, value in step_metrics(groups, rollouts).items():
            stored = steps.loc[step, name]
            assert (pd.isna(stored) and pd.isna(value)) or stored == pytest.approx(value, abs=1e-9), name


def test_the_data_stream_is_a_pure_function_of_the_position():
    from qae_app.data.tasks import arith_task

    task = arith_task()
    first = [prompts_at(task, 0, (s - 1) * 8, 8) for s in range(1, 300)]
    again = [prompts_at(task, 0, (s - 1) * 8, 8) for s in range(1, 300)]
    assert first == again
    epoch = [i for s in range(1, 134) for i in prompts_at(task, 0, (s - 1) * 8, 8)][: len(task.train)]
    assert sorted(epoch) == list(range(len(task.train)))  # one epoch visits every training prompt once


def test_resume_continues_and_matches_an_uninterrupted_run(tmp_path):
    """Stop after 4 of 6 steps (checkpoint at 2, rows 3-4 written after it), resume: steps 1..6 stored once each,
    and every per-step metric equals the uninterrupted run's."""
    opts = dict(TINY_RUN_OPTIONS, eval_every=0, checkpoint_every=2, steps=6)
    Trainer(build_config(run_name="full", **opts), tmp_path, cpu=True).fit()

    partial = Trainer(build_config(run_name="cut", **dict(opts, steps=4, checkpoint_every=2)), tmp_path, cpu=True)
    partial.fit()
    # simulate a crash after step 3's rows but before its checkpoint: drop checkpoint 4, keep rows of 3 and 4
    import shutil

    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-4")
    resumed = Trainer(resume_config(tmp_path, "cut", steps=6), tmp_path, resume=True, cpu=True)
    assert resumed.state.step == 2
    resumed.fit()
    full = read_steps(db_path(tmp_path, "full")).set_index("step")
    cut = read_steps(db_path(tmp_path, "cut")).set_index("step")
    assert cut.index.tolist() == [1, 2, 3, 4, 5, 6]
    assert_same_metrics(full, cut)
    rows = query(db_path(tmp_path, "cut"), "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step")
    assert rows["n"].tolist() == [32] * 6


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_mean_baseline_estimators_run_the_same_loop(tmp_path, estimator):
    result = runner.invoke(
        app,
        [
            "train",
            "--estimator",
            estimator,
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--run-name",
            estimator,
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    path = db_path(tmp_path, estimator)
    assert read_run(path)["estimator"] == estimator
    assert pd.isna(read_run(path)["k"])  # K is QAE's; a mean-baseline run records none
    groups = query(path, "SELECT regime FROM groups")
    assert set(groups["regime"]) <= {"mixed", "all_correct", "all_wrong"}
    # the banner is true of a mean baseline (it said `grpo (K=0.4, paper)`), and a log (not a terminal) gets one
    # plain progress line a step with reward, entropy, gated fraction, pace and ETA
    text = " ".join(result.output.split())
    assert f"run {estimator}: {estimator} on arith" in text and "K=" not in text
    lines = [line for line in result.output.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    stored = read_steps(path).set_index("step")
    for step, line in enumerate(lines, 1):
        assert f"reward {stored.loc[step, 'reward_mean']:.3f}" in line
        assert f"H {stored.loc[step, 'entropy']:.3f}" in line
        assert f"gated {stored.loc[step, 'frac_zero_adv']:.3f}" in line and "steps/min" in line and "ETA" in line
    assert "ETA 0 s" in lines[1]  # after the last step, none left


def test_a_qae_banner_names_k_and_the_quantile_and_the_pace_is_the_median():
    from types import SimpleNamespace

    from qae_app.cli.progress import StepPace, banner

    cfg = SimpleNamespace(
        estimator="qae",
        k="0.4",
        quantile="paper",
        data="arith",
        model="builtin:tiny",
        steps=10,
        prompts_per_step=2,
        group_size=4,
    )
    assert "qae (K=0.4, quantile paper) on arith" in banner(cfg, "r")
    clock = iter([0.0, 30.0, 60.0, 150.0]).__next__  # steps 1-3 at 2 steps/min, then one step in 90 s
    pace = StepPace(10, clock)
    assert pace.steps_per_min() is None and pace.eta_s() is None
    for step in (1, 2, 3, 4):
        pace.record(step)
    assert pace.steps_per_min() == pytest.approx(2.0)  # median of 2, 2, 2/3
    assert pace.eta_s() == pytest.approx(6 / 2 * 60)


def test_config_file_and_command_line_precedence(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 2\ngroup_size = 4\nprompts_per_step = 2\neval_every = 0\n[estimator]\nk = 0.3\n")
    result = runner.invoke(
        app, ["train", "--config", str(toml), "--steps", "1", "--run-name", "cfg", "--runs-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    config = json.loads(read_run(db_path(tmp_path, "cfg"))["config"])
    assert config["steps"] == 1 and config["group_size"] == 4 and config["k"] == "0.3"
    assert read_steps(db_path(tmp_path, "cfg"))["k"].tolist() == [0.3]


BAD_INPUT = [
    (["--k", "1.5"], "k: 1.5 is outside (0, 1)"),
    (["--k", "abc"], "k: 'abc' is not a number"),
    (["--group-size", "1"], "group-size: 1 is less than 2, the least it may be. Group baselines need at least 2"),
    (["--estimator", "ppo"], "estimator: unknown value 'ppo'. Choose one of: qae, grpo, dr_grpo, rloo"),
    (["--quantile", "median"], "quantile: unknown value 'median'"),
    (["--data", "nope.jsonl"], "data: 'nope.jsonl' is neither a built-in task"),
    (["--model", "/nonexistent/model"], "model: '/nonexistent/model' is not a folder or file on this machine"),
    (["--run-name", "../x"], "run-name: '../x' is not a plain name"),
    (["--config", "missing.toml"], "config: file missing.toml does not exist"),
    (["--resume", "ghost"], "resume: no run 'ghost'"),
    (["--temperature", "0"], "temperature: 0.0"),
    (["--steps", "0"], "steps: 0 is less than 1, the least it may be. Use a positive integer"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[a[0] for a, _ in BAD_INPUT])
def test_bad_input_is_one_clear_message_and_exit_code_2(tmp_path, args, message):
    result = runner.invoke(app, ["train", "--runs-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.glob("*/qae.duckdb"))  # nothing left marked running


def test_malformed_toml_key_suggests_the_nearest(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("grup_size = 8\n")
    result = runner.invoke(app, ["train", "--config", str(toml), "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "Did you mean 'group_size'?" in " ".join(result.output.split())
    toml.write_text('group_size = "eight"\n')
    result = runner.invoke(app, ["train", "--config", str(toml), "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "expected int" in " ".join(result.output.split())


def _bad_files(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": \n')
    (tmp_path / "noanswer.jsonl").write_text('{"problem": "1+1?", "solution": "it is 2"}\n')
    (tmp_path / "types.toml").write_text("steps = 2.5\n")
    (tmp_path / "k.toml").write_text("k = true\n")
    return tmp_path


BAD_FILES = [
    (["--data", "{d}/broken.jsonl"], "broken.jsonl' line 2 is not valid JSON"),
    (["--data", "{d}/noanswer.jsonl"], "noanswer.jsonl"),
    (["--config", "{d}/types.toml"], "'steps' = 2.5 is a float, expected int"),
    (["--config", "{d}/k.toml"], "'k' = True is a bool"),
    (["--steps", "abc"], "Invalid value for '--steps'"),
    (["--lr", "fast"], "Invalid value for '--lr'"),
    (["--eval-bench", "{d}/missing.jsonl", "--steps", "1"], "missing.jsonl"),
]


@pytest.mark.parametrize("args, message", BAD_FILES, ids=[a[1] if len(a) > 1 else a[0] for a, _ in BAD_FILES])
def test_bad_files_and_types_are_one_clear_message(tmp_path, args, message):
    d = _bad_files(tmp_path)
    args = [a.format(d=d) for a in args]
    result = runner.invoke(app, ["train", "--runs-dir", str(tmp_path / "runs"), *args])
    assert result.exit_code == 2, result.output
    # compared without whitespace: the message is wrapped at 80 columns, inside a long temporary path too
    assert "".join(message.split()) in "".join(result.output.split()), result.output
    assert not list((tmp_path / "runs").glob("*/qae.duckdb"))  # refused before anything was written


def test_skipping_gated_sequences_in_the_trainer_gives_the_same_update(tmp_path):
    """One real RL step with and without the skip, from the same weights and rollouts: the same parameters after."""
    params = {}
    for skip in (True, False):
        cfg = build_config(run_name=f"skip-{skip}", steps=1, eval_every=0, checkpoint_every=0, seed=3)
        trainer = Trainer(cfg, tmp_path, cpu=True)
        trainer.skip_gated = skip
        metrics = trainer.train_step(1).metrics
        assert 0 < metrics["frac_zero_adv"] < 1 and metrics["n_updates"] >= 1
        params[skip] = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.close()
    moved = builtin_params = None
    from qae_app.models.policy import load_policy

    builtin_params = [p.detach() for p in load_policy("builtin:tiny")[0].parameters()]
    moved = sum((a - b).abs().sum().item() for a, b in zip(params[True], builtin_params, strict=True))
    assert moved > 0  # the update did something
    for a, b in zip(params[True], params[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_k_auto_and_entropy_warnings_are_recorded(tmp_path):
    # entropy_low above any entropy the tiny model has: one warning at the crossing, not one per step
    cfg = build_config(
        run_name="auto",
        k="auto",
        steps=4,
        prompts_per_step=4,
        group_size=8,
        eval_every=0,
        entropy_low=2.9,
        entropy_high=3.0,
    )
    Trainer(cfg, tmp_path, cpu=True).fit()
    path = db_path(tmp_path, "auto")
    warnings = query(path, "SELECT * FROM warnings ORDER BY step")
    assert warnings["kind"].tolist() == ["auto_k", "entropy_low"]
    assert "Raise --k" in warnings["message"].iloc[1]
    k = read_run(path)["k"]
    assert k in (0.3, 0.4, 0.5) and f"K = {k}" in warnings["message"].iloc[0]
    assert read_steps(path)["k"].tolist() == [k] * 4


def test_the_entropy_band_is_the_options_else_the_start_divided_and_multiplied_by_3():
    assert entropy_band(None, None, 0.6) == pytest.approx((0.2, 1.8))  # the built-in model starts near 0.46-0.6 nats
    assert entropy_band(0.5, None, 0.6) == pytest.approx((0.5, 1.8))
    assert entropy_band(0.5, 4.0, None) == (0.5, 4.0)  # both given: no need to wait for the start
    assert entropy_band(0.5, None, None) is None  # one bound waits for the starting entropy


def test_warmstart_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    for name in ("a", "b"):
        result = runner.invoke(app, ["warmstart", "--steps", "3", "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(folder.iterdir())}


def test_warmstart_writes_under_the_working_folder_and_leaves_the_package_alone(tmp_path, monkeypatch):
    """`qae warmstart` without --out overwrote the shipped checkpoint inside the installed package (what every
    `qae train --data arith` loads); now it writes ./warmstart/<task> and says how to train from it."""
    from qae_app.train.warmstart import shipped_dir

    shipped = shipped_dir("arith")
    before = _files(shipped)
    assert "model.safetensors" in before
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["warmstart", "--steps", "2"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = tmp_path / "warmstart" / "arith"
    assert (out / "model.safetensors").is_file() and (out / "qae_char_tokenizer.json").is_file()
    assert _files(shipped) == before  # the same bytes, not even touched
    assert f"  qae train --model {out} --data arith" in result.output.splitlines(), result.output


def test_warmstart_writes_the_package_only_when_asked(tmp_path, monkeypatch):
    from qae_app.models.policy import BUILTIN_CHECKPOINTS

    package = tmp_path / "package" / "tiny"  # (a stand-in: the real assets stay as shipped)
    monkeypatch.setitem(BUILTIN_CHECKPOINTS, "builtin:tiny", package)
    both = runner.invoke(app, ["warmstart", "--steps", "1", "--into-package", "--out", str(tmp_path / "x")])
    assert both.exit_code == 2 and "--into-packagenametwofolders" in "".join(both.output.split()), both.output
    assert not package.exists() and not (tmp_path / "x").exists()
    result = runner.invoke(app, ["warmstart", "--steps", "1", "--into-package"])
    assert result.exit_code == 0, result.output
    assert (package / "model.safetensors").is_file()


def test_kl_to_a_frozen_reference_grows_once_the_policy_moves(tmp_path):
    cfg = build_config(
        run_name="kl", kl_beta=0.1, steps=3, prompts_per_step=4, group_size=8, eval_every=0, num_mini_batches=1
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.fit()
    kl = read_steps(db_path(tmp_path, "kl"))["kl"].tolist()
    assert kl[0] < 1e-6 < kl[2]  # step 1's single update starts at the reference; later steps have moved away


def test_micro_batches_accumulate_to_the_same_update(tmp_path):
    """Gradient accumulation over micro-batches of 2 sequences equals one forward/backward per mini-batch."""
    params = {}
    for size in (64, 2):
        cfg = build_config(
            run_name=f"micro-{size}", steps=1, eval_every=0, checkpoint_every=0, seed=3, micro_batch_size=size
        )
        trainer = Trainer(cfg, tmp_path, cpu=True)
        metrics = trainer.train_step(1).metrics
        params[size] = ([p.detach().clone() for p in trainer.model.parameters()], metrics)
        trainer.close()
    (big, m_big), (small, m_small) = params[64], params[2]
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    assert m_small["entropy"] == pytest.approx(m_big["entropy"], abs=1e-6)
    for a, b in zip(big, small, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_resuming_a_run_that_did_all_its_steps_says_so_and_gives_its_stored_heldout_accuracy(tiny_run, tmp_path):
    import shutil

    shared_runs_dir, run_id = tiny_run
    runs_dir = tmp_path / "runs"
    shutil.copytree(shared_runs_dir / run_id, runs_dir / run_id)
    stored = read_steps(db_path(runs_dir, run_id)).dropna(subset=["heldout_accuracy"])["heldout_accuracy"].iloc[-1]
    result = runner.invoke(app, ["train", "--resume", run_id, "--runs-dir", str(runs_dir)])
    said = " ".join(result.output.split())
    assert result.exit_code == 0, said
    assert f"run {run_id} had already done its {TINY_RUN_OPTIONS['steps']} steps: nothing to train" in said
    assert f"Held-out accuracy {stored:.3f}" in said  # the run's last evaluation, not "-"
    assert read_steps(db_path(runs_dir, run_id))["step"].tolist() == list(range(1, TINY_RUN_OPTIONS["steps"] + 1))


def test_store_responses_keeps_one_text_a_group_and_every_row(tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--store-responses",
            "1",
            "--run-name",
            "one",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    path = db_path(tmp_path, "one")
    per_group = query(
        path,
        "SELECT step, group_idx, count(*) AS n, count(response) AS texts, sum(gated::INT) AS "
        "gated FROM rollouts GROUP BY ALL ORDER BY ALL",
    )
    assert per_group["n"].tolist() == [4] * 4 and per_group["texts"].tolist() == [1] * 4
    steps = read_steps(path).set_index("step")
    for step, rows in per_group.groupby("step"):  # the gated fraction counts every response, texts kept or not
        assert steps.loc[step, "frac_zero_adv"] == pytest.approx(rows["gated"].sum() / 8)
    refused = runner.invoke(app, ["train", "--store-responses", "0", "--runs-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "store-responses: '0' is not all, none or a whole number" in " ".join(
        refused.output.split()
    )


def test_a_missing_builtin_checkpoint_names_the_warm_start_that_builds_it(tmp_path, monkeypatch):
    from qae_app.core.errors import QAEUserError
    from qae_app.data.tasks import BUILTIN_TASKS
    from qae_app.models import policy

    built_by = {task.model: name for name, task in BUILTIN_TASKS.items() if task.model in policy.BUILTIN_CHECKPOINTS}
    assert policy.WARMSTART_TASK_OF == built_by
    monkeypatch.setitem(policy.BUILTIN_CHECKPOINTS, "builtin:tiny-chain", tmp_path / "gone")
    with pytest.raises(QAEUserError, match="qae warmstart --task chain"):
        policy.load_policy("builtin:tiny-chain")


def test_the_weight_sync_is_timed_on_its_own(tmp_path):
    """sync_s is the weight sync into the engine alone, out of update_s: the step's parts (sampling, scoring, update,
    sync) never add up to more than the whole step. Here the hf engine's bfloat16 sampling copy is synced, made 0.3 s
    slower by a sleep so that counting it twice (in update_s too, as before sync_s) would exceed step_s."""
    import time

    cfg = build_config(
        run_name="sync",
        steps=2,
        prompts_per_step=2,
        group_size=4,
        eval_every=0,
        checkpoint_every=0,
        rollout_dtype="bfloat16",
        seed=1,
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    sync = trainer.engine.sync_weights
    calls = []

    def slow_sync(model):
        calls.append(model)
        time.sleep(0.3)
        sync(model)

    trainer.engine.sync_weights = slow_sync
    trainer.fit()
    steps = read_steps(db_path(tmp_path, "sync"))
    trained = steps[steps["n_updates"] > 0]
    assert len(calls) == len(trained) > 0
    assert (trained["sync_s"] >= 0.3).all()
    parts = steps[["rollout_s", "reward_s", "update_s", "sync_s"]].sum(axis=1)
    assert (parts <= steps["step_s"]).all(), steps[["rollout_s", "reward_s", "update_s", "sync_s", "step_s"]]
