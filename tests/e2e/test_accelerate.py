"""Several processes are the real case: under a real `accelerate launch --num_processes 2` (gloo on CPU) the update,
the learning-rate schedule, the stored rows and the checkpoints are those of one process."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.run_folder import db_path
from tests.launching import ONE_MACHINE
from tests.same_steps import assert_same_metrics, kept_steps

ACCELERATE = shutil.which("accelerate", path=str(Path(sys.executable).parent))
SCRIPT = Path(__file__).parents[1] / "scripts" / "same_samples.py"


def launch(n: int, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [
        ACCELERATE,
        "launch",
        "--num_processes",
        str(n),
        *ONE_MACHINE,
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        *(["--multi_gpu"] if n > 1 else ["--cpu"]),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ, **(env or {})))


def train(n: int, runs_dir: Path, name: str, *options: str, env: dict | None = None):
    return launch(n, "-m", "qae_app.cli", "train", "--run-name", name, "--runs-dir", str(runs_dir), *options, env=env)


@pytest.mark.slow
def test_two_processes_give_the_one_process_update_on_the_same_samples(tmp_path):
    """Token-level loss normalized over both processes' tokens (not a mean of per-process means), mini-batches drawn
    over all responses, the warmup stepped once per RL step (not once per process)."""
    for n in (1, 2):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (torch.load(tmp_path / f"p{n}.params.pt") for n in (1, 2))
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-6, rtol=0, msg=name)
    steps1, steps2 = (read_steps(db_path(tmp_path, f"p{n}")).set_index("step") for n in (1, 2))
    assert steps2["lr"].tolist() == pytest.approx([1.25e-5, 2.5e-5, 3.75e-5])  # --warmup-steps 4, lr 5e-5
    assert_same_metrics(steps1, steps2)
    rows = [
        query(
            db_path(tmp_path, f"p{n}"),
            "SELECT step, group_idx, sample_idx, response, reward, advantage FROM rollouts ORDER BY ALL",
        )
        for n in (1, 2)
    ]
    pd.testing.assert_frame_equal(rows[0], rows[1])


TOKEN_SQL = (
    "SELECT step, group_idx, sample_idx, tokens, logprob, entropy, old_logprob FROM token_values "
    "ORDER BY step, group_idx, sample_idx"
)


@pytest.mark.slow
def test_two_processes_store_the_one_process_token_values_signal_shares_and_alerts(tmp_path):
    """Issue 49: per-token numbers (the trainer's old log-probs computed in each process's micro-batches), each reward
    component's signal share (from the groups of both processes) and the alerts are one process's."""
    for n in (1, 2):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}", "rewards")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two = (db_path(tmp_path, f"p{n}") for n in (1, 2))
    tokens = [query(path, TOKEN_SQL) for path in (one, two)]
    assert len(tokens[0]) == len(tokens[1]) == 3 * 4 * 8  # every response, as many values as tokens
    for want, got in zip(tokens[0].to_dict("records"), tokens[1].to_dict("records"), strict=True):
        assert list(want["tokens"]) == list(got["tokens"]) and want["step"] == got["step"]
        for column in ("logprob", "entropy", "old_logprob"):
            if want[column] is None or got[column] is None or not hasattr(want[column], "__len__"):
                assert not hasattr(got[column], "__len__") and not hasattr(want[column], "__len__"), column
                continue
            assert list(got[column]) == pytest.approx(list(want[column]), rel=1e-4, abs=1e-5), column
    assert tokens[0]["old_logprob"].map(lambda v: hasattr(v, "__len__")).any()  # the trainer's numbers are there
    signal_sql = "SELECT step, name, weight, value_mean, frac_differs, frac_signal, adv_share FROM component_signal"
    signal = [query(path, signal_sql + " ORDER BY step, name") for path in (one, two)]
    pd.testing.assert_frame_equal(signal[0], signal[1], rtol=1e-6)
    assert (signal[0].loc[signal[0]["name"] == "exact_with_unit", "frac_differs"] == 0).all()
    warnings = [query(path, "SELECT step, kind, message FROM warnings ORDER BY step, kind") for path in (one, two)]
    pd.testing.assert_frame_equal(warnings[0], warnings[1])


@pytest.mark.slow
def test_two_processes_sharing_prompts_in_the_training_forward_give_the_one_process_update(tmp_path):
    """The shared-prompt forward (train/shared_prompts.py) runs each group's prompt through the unwrapped model and
    the responses through the DDP wrapper: one backward still reduces every gradient once, so two processes make
    the one-process update, and both make the update without sharing (to float32 rounding)."""
    for n, mode in ((1, "shared"), (2, "shared"), (1, "")):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}{mode}", mode)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, two, plain = (torch.load(tmp_path / f"p{name}.params.pt") for name in ("1shared", "2shared", "1"))
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(one[name], plain[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_lockstep_forwards_for_sharded_weights_keep_the_update_and_match_in_number(tmp_path):
    """FSDP and ZeRO-3 gather the shards in every forward, so processes that run different numbers of forwards (gated
    responses skip theirs) would hang: in lockstep, every process runs as many as the busiest, the extra ones on a
    placeholder weighted 0. Shown under DDP (accelerate cannot shard on CPU): the counts match, the update is that of
    one process."""
    for n, mode in ((1, ""), (2, "lockstep")):
        result = launch(n, str(SCRIPT), str(tmp_path), f"p{n}", mode)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = [int((tmp_path / f"p2.forwards.{rank}").read_text()) for rank in (0, 1)]
    assert counts[0] == counts[1] > 0
    one, two = (torch.load(tmp_path / f"p{n}.params.pt") for n in (1, 2))
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_two_processes_with_the_memory_options_give_the_one_process_update(tmp_path):
    """Gradient checkpointing under DDP (its recomputation under no_sync, the last micro-batch's all-reduce) and
    token-budget micro-batches in lockstep (each process's plan has its own count of forwards): the same steps and
    weights as one process without either, and in lockstep as many forwards on each process."""
    runs = {"p1": (1, ""), "p2-ckpt": (2, "checkpointing"), "p2-all": (2, "lockstep+budget+checkpointing")}
    for name, (n, mode) in runs.items():
        result = launch(n, str(SCRIPT), str(tmp_path), name, mode)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one = torch.load(tmp_path / "p1.params.pt")
    steps1 = read_steps(db_path(tmp_path, "p1")).set_index("step")
    for name in ("p2-ckpt", "p2-all"):
        two = torch.load(tmp_path / f"{name}.params.pt")
        for param in one:
            torch.testing.assert_close(one[param], two[param], atol=1e-6, rtol=0, msg=f"{name}: {param}")
        assert_same_metrics(steps1, read_steps(db_path(tmp_path, name)).set_index("step"))
    counts = [int((tmp_path / f"p2-all.forwards.{rank}").read_text()) for rank in (0, 1)]
    assert counts[0] == counts[1] > 0


@pytest.mark.slow
def test_two_process_run_checkpoints_whole_and_resumes_after_kill_9(tmp_path):
    options = [
        "--steps",
        "4",
        "--prompts-per-step",
        "4",
        "--group-size",
        "8",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "4",
        "--eval-limit",
        "20",
        "--micro-batch-size",
        "2",
        "--seed",
        "2",
    ]
    reference = train(2, tmp_path, "ref", *options)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    ref = db_path(tmp_path, "ref")
    assert read_run(ref)["status"] == "finished"
    groups = query(ref, "SELECT step, group_idx FROM groups ORDER BY step, group_idx")
    assert groups.groupby("step")["group_idx"].apply(list).tolist() == [[0, 1, 2, 3]] * 4
    evals = query(ref, "SELECT * FROM evals WHERE metric = 'avg@k' AND subset = 'all' ORDER BY step")
    assert evals["step"].tolist() == [0, 4] and evals["n_problems"].tolist() == [20, 20]
    for step in (2, 4):  # every process's RNG state is in the checkpoint, none left in a stray .tmp folder
        checkpoint = tmp_path / "ref" / "checkpoints" / f"step-{step}"
        assert (checkpoint / "rng-0.json").exists() and (checkpoint / "rng-1.json").exists()
        assert not list(checkpoint.rglob("*.pkl")) and not list(checkpoint.rglob("*.bin"))  # nothing to unpickle
    assert not list((tmp_path / "ref" / "checkpoints").glob("*.tmp"))

    killed = train(2, tmp_path, "cut", *options, env={"QAE_FAULT": "after_step_rows@3"})
    killed_output = killed.stdout[-3000:] + killed.stderr[-3000:]
    assert killed.returncode != 0, killed_output
    assert db_path(tmp_path, "cut").exists(), killed_output  # it died at step 3, not before its run existed
    # in the database or saved under pending/: all but the step in flight
    assert kept_steps(tmp_path / "cut") == [1, 2], killed_output
    resumed = launch(2, "-m", "qae_app.cli", "train", "--resume", "cut", "--runs-dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want, got = (read_steps(db_path(tmp_path, name)).set_index("step") for name in ("ref", "cut"))
    assert got.index.tolist() == [1, 2, 3, 4]
    assert_same_metrics(want, got)


def test_report_to_tensorboard_under_two_processes_logs_once_what_the_rows_hold(tmp_path):
    """--report-to on the main process only (issue 38): under a 2-process launch one process writes TensorBoard's
    event files (the scalars', and the hparams' that accelerate puts in a sub-folder), and every stored step metric
    and evaluation there equals the DuckDB rows, each step once."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qae_app.train.trackers import TENSORBOARD_DIR
    from tests.train.test_trackers import stored

    runs = tmp_path / "runs"
    result = train(
        2,
        runs,
        "tb",
        "--steps",
        "2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--eval-every",
        "2",
        "--checkpoint-every",
        "0",
        "--report-to",
        "tensorboard",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    logdir = runs / "tb" / TENSORBOARD_DIR
    event_files = list(logdir.rglob("events.out.tfevents.*"))  # events.out.tfevents.<time>.<host>.<pid>.<n>
    assert len({path.name.rsplit(".", 2)[1] for path in event_files}) == 1, event_files  # one writer process
    rows, eval_rows = stored(runs / "tb" / "qae.duckdb")
    assert set(eval_rows) and {"entropy", "accuracy", "step_s"} <= set(rows)
    events = EventAccumulator(str(logdir)).Reload()  # (the scalars' file: the folder's own, not the sub-folder's)
    for metric, values in {**rows, **eval_rows}.items():
        scalars = events.Scalars(metric)
        assert [event.step for event in scalars] == sorted(values), metric  # each step once
        assert {event.step: event.value for event in scalars} == pytest.approx(values, rel=1e-6), metric
