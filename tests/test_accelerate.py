"""The same entry point under a real `accelerate launch` with 2 processes (gloo on CPU): each process samples half
of the prompts, the main process gathers and writes every row once, and gradients are all-reduced."""

import shutil
import subprocess
import sys

import pytest

from qae_app.store import db_path, query, read_run


@pytest.mark.slow
def test_two_process_accelerate_launch(tmp_path):
    accelerate = shutil.which("accelerate", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert accelerate, "accelerate's launcher is installed with the package"
    command = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "qae_app.cli", "train",
               "--steps", "3", "--prompts-per-step", "4", "--group-size", "8", "--eval-every", "3",
               "--eval-limit", "20", "--checkpoint-every", "2", "--micro-batch-size", "2",  # exercises no_sync
               "--run-name", "ddp", "--runs-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path = db_path(tmp_path, "ddp")
    assert read_run(path)["status"] == "finished"
    groups = query(path, "SELECT step, group_idx FROM groups ORDER BY step, group_idx")
    assert groups.groupby("step")["group_idx"].apply(list).tolist() == [[0, 1, 2, 3]] * 3
    rollouts = query(path, "SELECT step, count(*) AS n FROM rollouts GROUP BY step ORDER BY step")
    assert rollouts["n"].tolist() == [32, 32, 32]
    evals = query(path, "SELECT * FROM evals WHERE metric = 'avg@k' AND subset = 'all' ORDER BY step")
    assert evals["step"].tolist() == [0, 3] and evals["n_problems"].tolist() == [20, 20]
    assert (tmp_path / "ddp" / "checkpoints" / "step-3" / "model" / "config.json").exists()
