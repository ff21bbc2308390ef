"""Precision is part of correctness: bfloat16 weights updated in place at a learning rate bfloat16 cannot represent are
refused before any work, and float32 master weights with bfloat16 compute (--mixed-precision bf16) move every weight
at the paper's learning rate."""

import json

import pytest
import torch
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.models.policy import load_policy
from qae_app.train.precision import fraction_moved_by_a_step
from tests.launching import ONE_MACHINE

runner = CliRunner()
SMALL = [
    "--steps",
    "3",
    "--prompts-per-step",
    "4",
    "--group-size",
    "8",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--cpu",
    "--seed",
    "4",
]


def test_a_step_of_1e_6_moves_almost_no_bfloat16_weight_and_every_float32_one():
    model, _ = load_policy("builtin:tiny", "bfloat16")
    assert fraction_moved_by_a_step(model.parameters(), 1e-6) < 0.05
    assert fraction_moved_by_a_step(model.parameters(), 1e-2) > 0.99
    model, _ = load_policy("builtin:tiny", "float32")
    assert fraction_moved_by_a_step(model.parameters(), 1e-6) == 1.0
    # by hand: bfloat16 steps 1.0 by 2^-7 and 1e-3 by 2^-17 (7.6e-6), so a change of 1e-6 rounds back to each; 1e-4
    # steps by 2^-21 (4.8e-7), so 1e-6 moves it
    weights = torch.tensor([1.0, 1e-3, 1e-4, 1e-4], dtype=torch.bfloat16)
    assert fraction_moved_by_a_step([weights], 1e-6) == 0.5


def test_bfloat16_weights_at_an_unrepresentable_lr_are_refused_before_any_work(tmp_path):
    runs = tmp_path / "runs"
    result = runner.invoke(
        app, ["train", "--dtype", "bfloat16", "--lr", "1e-6", "--weight-decay", "0.1", *SMALL, "--runs-dir", str(runs)]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "lr: with --dtype bfloat16 the optimizer updates bfloat16 weights in place" in output
    assert "--dtype float32 --mixed-precision bf16" in output and "Traceback" not in output
    assert not runs.exists() or not any(runs.rglob("*"))  # nothing left: no run folder, no lock


def test_mixed_precision_moves_every_weight_at_the_papers_learning_rate(tmp_path):
    from accelerate.state import AcceleratorState

    from qae_app.train.trainer import Trainer

    # accelerate keeps one mixed-precision setting per process: let this test's differ, and give the next test the
    # default back
    AcceleratorState._reset_state()
    cfg = build_config(
        run_name="mp",
        mixed_precision="bf16",
        lr=1e-6,
        weight_decay=0.1,
        steps=3,
        prompts_per_step=4,
        group_size=8,
        eval_every=0,
        checkpoint_every=0,
        seed=4,
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        assert trainer.accelerator.mixed_precision == "bf16"
        assert all(p.dtype == torch.float32 for p in before.values())  # the masters are float32
        trainer.fit()
        after = dict(trainer.model.named_parameters())
        moved = sum(int((after[name] != weight).sum()) for name, weight in before.items())
        total = sum(weight.numel() for weight in before.values())
    finally:
        trainer.close()
        AcceleratorState._reset_state()
    assert moved / total >= 0.99, moved / total


@pytest.fixture
def gloo_group():
    """A gloo process group of this process alone, for FSDP2."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mixed_precision, compute", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_fsdp2_applied_by_qae_computes_in_bf16_on_float32_masters(gloo_group, mixed_precision, compute):
    """On CPU qae applies fully_shard itself (accelerate falls back to DDP and never autocasts the model): with bf16
    mixed precision FSDP2's own policy gathers and computes in bfloat16, while the shards the optimizer holds, and the
    gradients reduced into them, stay float32."""
    from torch.distributed.device_mesh import init_device_mesh

    from qae_app.models.sharding import shard_model

    model, _ = load_policy("builtin:tiny", "float32")
    model = shard_model(model, init_device_mesh("cpu", (1,)), mixed_precision)
    logits = model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits
    assert logits.dtype == compute
    logits.float().sum().backward()
    assert {(p.dtype, p.grad.dtype) for p in model.parameters()} == {(torch.float32, torch.float32)}


@pytest.mark.slow
def test_mixed_precision_under_fsdp2_x2_moves_every_weight(tmp_path):
    """The same under `accelerate launch` with the FSDP2 config and 2 processes (gloo): the float32 master shards move
    at lr 1e-6, and the run records how it ran."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from qae_app.models.policy import BUILTIN_CHECKPOINTS
    from qae_app.store.reader import read_run
    from qae_app.store.run_folder import db_path

    root = Path(__file__).resolve().parents[2]
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    result = subprocess.run(
        [
            accelerate,
            "launch",
            "--config_file",
            str(root / "configs/accelerate/fsdp2.yaml"),
            "--num_processes",
            "2",
            *ONE_MACHINE,
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "qae_app.cli",
            "train",
            "--run-name",
            "mp",
            "--runs-dir",
            str(tmp_path),
            "--mixed-precision",
            "bf16",
            "--lr",
            "1e-6",
            "--weight-decay",
            "0.1",
            "--steps",
            "3",
            "--prompts-per-step",
            "4",
            "--group-size",
            "8",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "3",
            "--seed",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    start = load_file(BUILTIN_CHECKPOINTS["builtin:tiny"] / "model.safetensors")
    end = load_file(tmp_path / "mp" / "checkpoints" / "step-3" / "model" / "model.safetensors")
    assert set(start) == set(end) and {w.dtype for w in end.values()} == {torch.float32}
    moved = sum(int((start[name] != end[name]).sum()) for name in end)
    assert moved / sum(w.numel() for w in end.values()) >= 0.99
    setup = json.loads(read_run(db_path(tmp_path, "mp"))["config"])["distributed"]
    assert (setup["sharding"], setup["processes"], setup["mixed_precision"]) == ("fsdp2", 2, "bf16")
