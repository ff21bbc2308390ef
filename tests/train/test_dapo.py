"""DAPO's additions in real runs on the built-in task: dynamic sampling trains exactly prompts_per_step groups with
signal, stores the filtered ones, keeps them out of the loss (a gradient against a batch built by hand), replays
exactly after kill -9, and works when a process has no group to train; -1/1 rewards and overlong shaping are stored
next to the verdict."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from qae_app.algo.advantages import REGIMES, EstimatorConfig, compute_advantages
from qae_app.algo.losses import token_logprobs_and_entropy
from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.models.policy import load_policy
from qae_app.store.reader import query, read_steps
from qae_app.store.rows import step_metrics
from qae_app.store.run_folder import db_path
from qae_app.train.trainer import Trainer
from qae_app.train.trainer_state import data_position_problem
from qae_app.train.update import pack
from tests.same_steps import assert_same_metrics, assert_same_rollouts

runner = CliRunner()
QAE = str(Path(sys.executable).parent / "qae")
P, G = 4, 8
DYNAMIC = dict(
    prompts_per_step=P,
    group_size=G,
    eval_every=0,
    dynamic_sampling=True,
    max_gen_batches=10,
    reward_values="-1,1",
    seed=1,
)


def steps_of(path: Path) -> pd.DataFrame:
    return read_steps(path).set_index("step")


def first_with_signal(groups: pd.DataFrame, rollouts: pd.DataFrame, n: int) -> list[int]:
    """group_idx of the first n groups whose rewards are not all equal, in group order."""
    spread = rollouts.groupby("group_idx")["reward"].agg(lambda r: r.max() != r.min())
    return [int(g) for g in groups["group_idx"] if spread[g]][:n]


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory) -> tuple[Path, Trainer]:
    runs_dir = tmp_path_factory.mktemp("dynamic")
    trainer = Trainer(build_config(run_name="ds", steps=4, checkpoint_every=0, **DYNAMIC), runs_dir, cpu=True)
    assert trainer.fit().status == "finished"
    return db_path(runs_dir, "ds"), trainer


def test_dynamic_sampling_trains_exactly_the_first_groups_with_signal(dynamic_run):
    path, trainer = dynamic_run
    steps = read_steps(path).set_index("step")
    assert query(path, "SELECT count(*) AS n FROM warnings")["n"].item() == 0  # the cap was never hit
    for step in steps.index:
        groups = query(path, "SELECT * FROM groups WHERE step = ? ORDER BY group_idx", [step])
        rollouts = query(path, "SELECT * FROM rollouts WHERE step = ? ORDER BY group_idx, sample_idx", [step])
        batches = int(steps.loc[step, "gen_batches"])
        assert groups["group_idx"].tolist() == list(range(batches * P))  # every generated group is stored
        trained = groups.loc[~groups["filtered"], "group_idx"].tolist()
        assert trained == first_with_signal(groups, rollouts, P)  # exactly P, the first ones with signal
        kept = rollouts[~rollouts["filtered"]]
        assert (kept.groupby("group_idx")["reward"].agg(lambda r: r.max() != r.min())).all()
        assert steps.loc[step, "frac_filtered"] == groups["filtered"].mean()
        # the batch before the last did not have P groups with signal yet: no batch was sampled for nothing
        assert len(first_with_signal(groups[groups["group_idx"] < (batches - 1) * P], rollouts, P)) < P
        # the hf engine measured every response's entropy and log-prob while sampling, filtered ones included
        assert rollouts[["entropy", "logprob"]].notna().all().all()
        assert (rollouts.groupby("group_idx")["filtered"].first() == groups.set_index("group_idx")["filtered"]).all()
    assert steps["gen_batches"].sum() > len(steps)  # extra generation happened, and is counted
    # the data stream advanced by every prompt sampled, and the checkpoint says so
    state = json.loads((path.parent / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["data_position"] == trainer.state.data_position == P * steps["gen_batches"].sum()


def test_dynamic_run_rows_recompute_their_advantages_regimes_and_metrics(dynamic_run):
    path, _ = dynamic_run
    steps = read_steps(path).set_index("step")
    for step in steps.index:
        groups = query(path, "SELECT * FROM groups WHERE step = ? ORDER BY group_idx", [step])
        rollouts = query(path, "SELECT * FROM rollouts WHERE step = ? ORDER BY group_idx, sample_idx", [step])
        assert set(rollouts["reward"]) <= {-1.0, 1.0}  # --reward-values -1,1, no overlong shaping
        assert (rollouts["reward"] == rollouts["correct"].map({True: 1.0, False: -1.0})).all()
        assert (groups["n_correct"] == rollouts.groupby("group_idx")["correct"].sum().to_numpy()).all()
        rewards = torch.tensor(rollouts["reward"].to_numpy(), dtype=torch.float32).view(-1, G)
        correct = torch.tensor(rollouts["correct"].to_numpy()).view(-1, G)
        expected = compute_advantages("qae", rewards, EstimatorConfig(k=0.4), correct)
        assert torch.allclose(
            torch.tensor(rollouts["advantage"].to_numpy(), dtype=torch.float32).view(-1, G),
            expected.advantages,
            atol=1e-6,
        )
        assert groups["regime"].tolist() == [REGIMES[r] for r in expected.regime.tolist()]
        assert "mixed" not in set(groups["regime"])  # -1/1 groups are hard / easy / all_correct / all_wrong
        metrics = step_metrics(groups.to_dict("records"), rollouts.to_dict("records"))
        for name, value in metrics.items():
            stored = steps.loc[step, name]
            assert (pd.isna(stored) and pd.isna(value)) or stored == pytest.approx(value, abs=1e-9), name


def test_qae_rollouts_shows_the_filtered_groups(dynamic_run):
    path, _ = dynamic_run
    step = int(query(path, "SELECT step FROM steps ORDER BY frac_filtered DESC LIMIT 1")["step"].item())
    n_filtered = query(path, "SELECT count(*) AS n FROM rollouts WHERE step = ? AND filtered", [step])["n"].item()
    assert n_filtered > 0
    args = ["rollouts", "ds", "--step", str(step), "--runs-dir", str(path.parent.parent), "--limit", "1000"]
    filtered_row = re.compile(r"^\s*\d+\s+\S+\s+[+-]\d+\.\d{4}\s+filtered\s", re.M)  # #, reward, advantage, why
    shown = runner.invoke(app, [*args, "--filtered"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    assert f"{n_filtered} of {P * G * int(steps_of(path).loc[step, 'gen_batches'])} responses match" in shown.output
    assert len(filtered_row.findall(shown.output)) == n_filtered
    header = " ".join(shown.output.split())
    n_total = P * G * int(steps_of(path).loc[step, "gen_batches"])
    n_gated = query(path, "SELECT count(*) AS n FROM rollouts WHERE step = ? AND gated AND NOT filtered", [step])[
        "n"
    ].item()
    # gated counts are of the trained responses, as frac_zero_adv
    assert (
        f"{n_filtered // G} groups ({n_filtered} responses) filtered out of the update by dynamic sampling, "
        f"{n_gated} of the {n_total - n_filtered} trained gated (advantage 0)"
    ) in header
    assert n_gated / (n_total - n_filtered) == pytest.approx(steps_of(path).loc[step, "frac_zero_adv"])
    kept = runner.invoke(app, [*args, "--kept"], env={"COLUMNS": "250"})
    assert kept.exit_code == 0 and not filtered_row.findall(kept.output) and "kept" in kept.output


def test_without_dynamic_sampling_nothing_is_filtered(tiny_run):
    runs_dir, run_id = tiny_run
    path = db_path(runs_dir, run_id)
    steps = read_steps(path)
    assert (steps["gen_batches"] == 1).all() and (steps["frac_filtered"] == 0).all()
    assert not query(path, "SELECT count(*) AS n FROM rollouts WHERE filtered OR correct IS NULL")["n"].item()


def test_filtered_groups_are_absent_from_the_loss(tmp_path):
    """One real step with dynamic sampling (float64): the gradient of its single update equals the token-mean policy
    gradient of a batch built by hand from the trained groups only; counting the filtered responses in the
    normalizer, as a step without dynamic sampling would, gives another gradient."""
    cfg = build_config(run_name="grad", steps=1, checkpoint_every=0, num_mini_batches=1, max_grad_norm=1e9, **DYNAMIC)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.model.double()
    generated, grads = [], []
    generate, optimizer_step = trainer.engine.generate, trainer.optimizer.step
    trainer.engine.generate = lambda *a, **kw: generated.append(generate(*a, **kw)) or generated[-1]
    trainer.optimizer.step = lambda *a, **kw: (
        grads.append([p.grad.clone() for p in trainer.model.parameters()]),
        optimizer_step(*a, **kw),
    )[1]
    try:
        out = trainer.train_step(1)
    finally:
        trainer.close()
    assert len(grads) == 1 and out.metrics["n_updates"] == 1
    samples = [s for batch in generated for s in batch]  # group g's responses at g * G .. (one process)
    trained = [g["group_idx"] for g in out.groups if not g["filtered"]]
    filtered = [g["group_idx"] for g in out.groups if g["filtered"]]
    assert len(trained) == P and filtered and len(generated) > 1

    def rows(group_idx, column):
        return [r[column] for r in out.rollouts if r["group_idx"] == group_idx]

    rewards = torch.tensor([rows(g, "reward") for g in trained])  # (P, G)
    correct = torch.tensor([rows(g, "correct") for g in trained])
    advantages = compute_advantages("qae", rewards, EstimatorConfig(k=0.4), correct).advantages.reshape(-1)

    policy = load_policy("builtin:tiny")[0].double()  # the weights the trainer started from

    def gradient(sequences, sequence_advantages, normalizer_sequences):
        policy.zero_grad()
        batch = pack(sequences, trainer.codec.pad_id, "cpu", torch.float64)
        logits = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        logp, _ = token_logprobs_and_entropy(logits, batch["input_ids"][:, 1:], cfg.temperature)  # (N, T-1)
        tokens = pack(normalizer_sequences, trainer.codec.pad_id, "cpu", torch.float64)["response_mask"].sum()
        # at the sampling policy the ratio is 1 and inside the clip range: the gradient is -A grad(log p) / tokens
        loss = -(sequence_advantages.double()[:, None] * logp * batch["response_mask"]).sum() / tokens
        loss.backward()
        return [p.grad.clone() for p in policy.parameters()]

    chosen = [s for g in trained for s in samples[g * G : (g + 1) * G]]
    by_hand = gradient(chosen, advantages, chosen)
    for got, want in zip(grads[0], by_hand, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-7)
    diluted = gradient(chosen, advantages, samples)  # normalized over every sampled response
    assert any(
        not torch.allclose(got, want, atol=1e-10, rtol=1e-7) for got, want in zip(grads[0], diluted, strict=True)
    )


def test_the_cap_trains_on_what_it_found_and_says_so(tmp_path):
    """One generation batch of 2 groups of 2: steps with fewer than 2 groups with signal train on those, with a warning
    row; a step with none makes no update at all (the other steps make their 2 mini-batches)."""
    cfg = build_config(
        run_name="cap",
        steps=6,
        prompts_per_step=2,
        group_size=2,
        num_mini_batches=2,
        eval_every=0,
        checkpoint_every=0,
        dynamic_sampling=True,
        max_gen_batches=1,
        seed=0,
    )
    Trainer(cfg, tmp_path, cpu=True).fit()
    path = db_path(tmp_path, "cap")
    steps = read_steps(path).set_index("step")
    trained = query(path, "SELECT step, count(*) FILTER (WHERE NOT filtered) AS n FROM groups GROUP BY step")
    trained = trained.set_index("step")["n"]
    warned = query(path, "SELECT step, message FROM warnings WHERE kind = 'dynamic_sampling_cap'")
    assert (steps["gen_batches"] == 1).all()
    assert warned["step"].tolist() == [s for s in steps.index if trained[s] < 2]
    assert set(trained) == {0, 1, 2}, trained.to_dict()  # (seed 0 meets every case)
    for step, n in trained.items():
        assert steps.loc[step, "n_updates"] == (0 if n == 0 else 2)
        assert pd.isna(steps.loc[step, "loss"]) == (n == 0)
    assert "found 0 of the 2 groups with signal" in " ".join(warned["message"])


def test_resume_position_check_follows_dynamic_sampling():
    plain = build_config(prompts_per_step=4)
    assert data_position_problem(8, 2, plain) is None
    assert data_position_problem(5, 2, plain) == "2 steps of 4 prompts end at 8"
    dynamic = build_config(prompts_per_step=4, dynamic_sampling=True, max_gen_batches=3)
    assert all(data_position_problem(p, 2, dynamic) is None for p in (8, 12, 24))
    for position in (4, 10, 28):
        assert data_position_problem(position, 2, dynamic) == (
            "2 steps of 1 to 3 generation batches of 4 prompts end at a multiple of 4 from 8 to 24"
        )
    assert (
        data_position_problem(400, 2, build_config(prompts_per_step=4, dynamic_sampling=True, max_gen_batches=0))
        is None
    )


BAD_DAPO_INPUT = [
    (["--overlong-buffer", "8"], "overlong-buffer: 8 is not below max-new-tokens 8"),
    (["--overlong-buffer", "-1"], "overlong-buffer: -1 is less than 0, the least it may be"),
    (["--overlong-penalty", "-0.5"], "overlong-penalty: -0.5 is less than 0.0, the least it may be"),
    (["--overlong-penalty", "nan"], "overlong-penalty: nan is not a finite number"),
    (["--reward-values", "0,2"], "reward-values: unknown value '0,2'. Choose one of: 0,1, -1,1"),
    (["--filter-metric", "acc"], "filter-metric: unknown value 'acc'. Choose one of: reward, correct"),
    (["--max-gen-batches", "-1"], "max-gen-batches: -1 is less than 0, the least it may be"),
    (
        ["--shaping", "late", "--overlong-buffer", "4"],
        "shaping: unknown value 'late'. Choose one of: before-baseline, after-baseline",
    ),
    (["--shaping", "after-baseline"], "shaping: after-baseline acts only with --overlong-buffer, which is off"),
    (["--on-gen-cap", "halt", "--dynamic-sampling"], "on-gen-cap: unknown value 'halt'. Choose one of: train, stop"),
    (["--on-gen-cap", "stop"], "on-gen-cap: stop acts only with --dynamic-sampling, which is off"),
    # issue 48 L11: options of the vLLM engine given with another engine change nothing, yet were stored
    (["--vllm-gpu-memory", "0.5"], "vllm-gpu-memory: 0.5 acts only with --engine vllm, and this run's engine is hf"),
    (["--no-vllm-sleep"], "vllm-sleep: False acts only with --engine vllm, and this run's engine is hf"),
    (["--vllm-sleep"], "vllm-sleep: True acts only with --engine vllm"),
]


@pytest.mark.parametrize("args, message", BAD_DAPO_INPUT, ids=[a[0] for a, _ in BAD_DAPO_INPUT])
def test_bad_dapo_options_are_one_clear_message(tmp_path, args, message):
    result = runner.invoke(app, ["train", "--runs-dir", str(tmp_path), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not list(tmp_path.glob("*/qae.duckdb"))


def test_an_option_given_at_its_default_is_never_refused_for_its_switch(tmp_path):
    """Issue 48 L11: `--shaping before-baseline` (its default) was refused without --overlong-buffer, though a
    default changes nothing and docs/training.md says defaults never are; so is every switch's option and the vLLM
    engine's, given at their defaults."""
    from qae_app.config import FIELDS, NEEDS_SWITCH, VLLM_ONLY, build_config

    for name in [*NEEDS_SWITCH, *VLLM_ONLY]:
        default = FIELDS[name].default
        assert getattr(build_config(**{name: default}), name) == default
    result = runner.invoke(
        app,
        [
            "train",
            "--shaping",
            "before-baseline",
            "--vllm-gpu-memory",
            "0.35",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output


def test_switches_from_the_command_line_and_toml(tmp_path):
    from qae_app.config import given_options

    toml = tmp_path / "run.toml"
    toml.write_text("dynamic_sampling = true\n")
    assert build_config(toml).dynamic_sampling is True
    assert given_options(toml, dynamic_sampling=False)["dynamic_sampling"] is False  # the command line wins
    toml.write_text('dynamic_sampling = "yes"\n')
    result = runner.invoke(app, ["train", "--config", str(toml), "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "'dynamic_sampling' = 'yes' is a str, expected bool" in " ".join(
        result.output.split()
    )


# ---------------------------------------------------------------------------------------------------------------
# slow: kill -9 and resume; two processes


@pytest.mark.slow
def test_kill_9_then_resume_replays_dynamic_sampling_exactly(tmp_path):
    opts = dict(DYNAMIC, steps=5, checkpoint_every=2)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in opts.items() if k != "dynamic_sampling"]
    flags += ["--dynamic-sampling"]

    def train(name, *extra, env=None):
        return subprocess.run(
            [QAE, "train", "--run-name", name, "--runs-dir", str(tmp_path), *flags, *extra],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, **(env or {})),
        )

    assert train("ref").returncode == 0
    killed = train("cut", env={"QAE_FAULT": "after_step_rows@4"})  # checkpoint at 2, rows of 3 stored, 4 lost
    assert killed.returncode == -9
    resumed = subprocess.run(
        [QAE, "train", "--resume", "cut", "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ref, cut = db_path(tmp_path, "ref"), db_path(tmp_path, "cut")
    want, got = read_steps(ref).set_index("step"), read_steps(cut).set_index("step")
    assert got.index.tolist() == [1, 2, 3, 4, 5] and want["gen_batches"].sum() > 5
    assert_same_metrics(want, got)
    assert_same_rollouts(ref, cut)


@pytest.mark.slow
def test_a_process_without_groups_to_train_takes_part_and_adds_nothing(tmp_path):
    """Two processes against one, on the same samples (tests/scripts/same_samples.py): the second process's prompts get
    G identical responses, so all its groups are filtered and only the first process trains; the update, the rows
    and the metrics equal the one-process run's."""
    from tests.e2e.test_accelerate import SCRIPT, launch

    for n in (1, 2):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}", "dynamic")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (torch.load(tmp_path / f"p{n}.params.pt") for n in (1, 2))
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-6, rtol=0, msg=name)
    paths = [db_path(tmp_path, f"p{n}") for n in (1, 2)]
    trained = query(paths[1], "SELECT step, group_idx FROM groups WHERE NOT filtered ORDER BY ALL")
    assert ((trained["group_idx"] % 4) < 2).all()  # only the first process's share of each batch trained
    assert (read_steps(paths[1])["n_updates"] > 0).all()
    steps1, steps2 = (read_steps(p).set_index("step") for p in paths)
    assert_same_metrics(steps1, steps2)
    rows = [
        query(p, "SELECT step, group_idx, sample_idx, response, reward, advantage, filtered FROM rollouts ORDER BY ALL")
        for p in paths
    ]
    pd.testing.assert_frame_equal(rows[0], rows[1])


def test_dynamic_sampling_drops_all_wrong_groups_by_default_even_when_shaping_spreads_their_rewards():
    """DAPO's filter (verl's filter_groups.metric=acc, the default of its recipe) keeps a group by the verifier's
    verdicts. Filtering on shaped rewards kept an all-wrong group whose lengths differed, and QAE then pushed up its
    short wrong answers: G=8, rewards [-1 x4, -1.5, -1.75, -2, -2] gave four wrong answers A = +1.083."""
    from qae_app.train.trainer import groups_with_signal

    cfg = build_config()
    assert cfg.filter_metric == "correct"
    shaped_all_wrong = torch.tensor([[-1.0] * 4 + [-1.5, -1.75, -2.0, -2.0]])
    verdicts = torch.zeros(1, 8, dtype=torch.bool)
    assert groups_with_signal(shaped_all_wrong, verdicts, cfg.filter_metric).tolist() == [False]
    assert groups_with_signal(shaped_all_wrong, verdicts, "reward").tolist() == [True]  # what the old default kept
    adv = compute_advantages("qae", shaped_all_wrong, EstimatorConfig(k=0.4), verdicts).advantages
    assert adv[0, :4].tolist() == pytest.approx([1.083] * 4, abs=1e-3)  # the update that default let through


def test_a_step_with_no_update_does_not_advance_the_learning_rate_schedule(tmp_path):
    """At the dynamic-sampling cap a step may find no group with signal: it updates nothing, so the warmup must not
    move either (it counted such steps, reaching full LR after fewer updates than --warmup-steps)."""
    cfg = build_config(
        run_name="cap",
        steps=6,
        prompts_per_step=2,
        group_size=2,
        num_mini_batches=2,
        eval_every=0,
        checkpoint_every=0,
        dynamic_sampling=True,
        max_gen_batches=1,
        seed=0,
        warmup_steps=4,
        lr=1e-3,
    )
    Trainer(cfg, tmp_path, cpu=True).fit()
    steps = read_steps(db_path(tmp_path, "cap")).set_index("step")
    assert (steps["n_updates"] == 0).any() and (steps["n_updates"] > 0).any()  # (seed 0 has both)
    updates_before = 0
    for step, row in steps.iterrows():
        assert row["lr"] == pytest.approx(1e-3 * min(1.0, (updates_before + 1) / 4)), step
        updates_before += row["n_updates"] > 0


def test_shaping_after_the_baseline_in_a_run_decides_on_the_verdicts(tmp_path):
    """A real step with overlong shaping that reaches the built-in task's responses (buffer 6 of 8 tokens): with
    --shaping after-baseline every stored advantage is QAE's on the verdicts plus the stored penalty (reward minus
    the verdict's value), no group is mixed, and some response was penalized."""
    G = 8
    cfg = build_config(
        run_name="after",
        steps=1,
        prompts_per_step=8,
        group_size=G,
        eval_every=0,
        checkpoint_every=0,
        reward_values="-1,1",
        overlong_buffer=6,
        shaping="after-baseline",
        seed=2,
    )
    Trainer(cfg, tmp_path, cpu=True).fit()
    path = db_path(tmp_path, "after")
    groups = query(path, "SELECT * FROM groups ORDER BY group_idx")
    rollouts = query(path, "SELECT * FROM rollouts ORDER BY group_idx, sample_idx")
    verdicts = torch.tensor(rollouts["correct"].map({True: 1.0, False: -1.0}).to_numpy()).view(-1, G)
    penalty = torch.tensor(rollouts["reward"].to_numpy()).view(-1, G) - verdicts
    assert (penalty < 0).any()
    correct = torch.tensor(rollouts["correct"].to_numpy()).view(-1, G)
    expected = compute_advantages("qae", verdicts, EstimatorConfig(k=0.4), correct)
    stored = torch.tensor(rollouts["advantage"].to_numpy(), dtype=torch.float64).view(-1, G)
    torch.testing.assert_close(stored, (expected.advantages + penalty).double(), atol=1e-6, rtol=0)
    assert groups["regime"].tolist() == [REGIMES[r] for r in expected.regime.tolist()]
    assert "mixed" not in set(groups["regime"])


@pytest.mark.slow
def test_on_gen_cap_stop_ends_the_run_at_the_first_short_step_with_the_reason(tmp_path):
    """The cap test's run (seed 2: some steps find fewer than 2 groups with signal in their one batch), with
    --on-gen-cap train (today's: every step trains, the short ones with a warning) and with stop: the run ends failed
    before the first short step trains, the reason printed and stored as the run's error, the steps before it kept."""
    common = [
        "--steps",
        "6",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--num-mini-batches",
        "2",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "0",
        "--dynamic-sampling",
        "--max-gen-batches",
        "1",
        "--seed",
        "2",
        "--runs-dir",
        str(tmp_path),
    ]
    runner = CliRunner()
    trained = runner.invoke(app, ["train", "--run-name", "train", "--on-gen-cap", "train", *common])
    assert trained.exit_code == 0, trained.output
    short = query(db_path(tmp_path, "train"), "SELECT min(step) AS s FROM warnings WHERE kind = 'dynamic_sampling_cap'")
    first_short = int(short["s"].item())
    assert first_short > 1 and len(read_steps(db_path(tmp_path, "train"))) == 6  # (seed 2: step 1 is not short)

    stopped = runner.invoke(app, ["train", "--run-name", "stop", "--on-gen-cap", "stop", *common])
    assert stopped.exit_code != 0
    assert f"on-gen-cap: stop: at step {first_short}" in " ".join(stopped.output.split())
    run = query(db_path(tmp_path, "stop"), "SELECT status, error FROM runs")
    assert run["status"].item() == "failed"
    assert f"at step {first_short}, dynamic sampling found" in run["error"].item()
    assert read_steps(db_path(tmp_path, "stop"))["step"].tolist() == list(range(1, first_short))
    want = read_steps(db_path(tmp_path, "train")).set_index("step").loc[: first_short - 1].reset_index(drop=True)
    assert_same_metrics(want, read_steps(db_path(tmp_path, "stop")).reset_index(drop=True))
