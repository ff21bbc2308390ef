"""The training state of a checkpoint is data: saved as safetensors and JSON, restored exactly (the steps after a
restore equal the steps of an uninterrupted run, bit for bit), and a file planted in place of any of them is refused
by name without running."""

from __future__ import annotations

import pickle
import random
import struct

import numpy as np
import pytest
import torch

from qae_app.core.errors import QAEUserError
from qae_app.models.policy import build_tiny_model
from qae_app.train.checkpoint_state import (
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    POLICY_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    load_training_state,
    save_training_state,
    training_state_problem,
)

WARMUP = 3


def training_objects(seed: int):
    model, _ = build_tiny_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 12))  # draws from the global RNG, so a restored RNG state shows in the weights
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def test_a_restored_state_continues_exactly_as_the_uninterrupted_run(tmp_path):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model, optimizer, scheduler = training_objects(seed=0)
    train(model, optimizer, scheduler, 2)
    save_training_state(tmp_path, model, optimizer, scheduler, process_index=0, is_main=True)
    python_draw, numpy_draw = random.random(), np.random.rand()
    train(model, optimizer, scheduler, 2)
    uninterrupted = {name: p.detach().clone() for name, p in model.named_parameters()}

    torch.manual_seed(123)  # everything else differs: other weights, other random states, a fresh optimizer
    random.seed(123)
    np.random.seed(123)
    restored, optimizer2, scheduler2 = training_objects(seed=7)
    load_training_state(tmp_path, restored, optimizer2, scheduler2, process_index=0)
    assert scheduler2.last_epoch == 2 and optimizer2.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert optimizer2.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]  # a tuple again
    assert (random.random(), np.random.rand()) == (python_draw, numpy_draw)
    train(restored, optimizer2, scheduler2, 2)
    for name, param in restored.named_parameters():
        assert torch.equal(param, uninterrupted[name]), name
    # tied weights are stored once and still tied after the restore
    if restored.config.tie_word_embeddings:
        assert restored.lm_head.weight.data_ptr() == restored.model.embed_tokens.weight.data_ptr()


class Payload:
    def __reduce__(self):
        return (open, (str(MARKER), "w"))


MARKER = None


@pytest.mark.parametrize(
    "name", [POLICY_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE.format(process=0)]
)
def test_a_pickle_planted_in_place_of_a_state_file_is_refused_by_name_and_never_runs(tmp_path, name):
    global MARKER
    MARKER = tmp_path / "ran"
    folder = tmp_path / "step-2"
    folder.mkdir()
    model, optimizer, scheduler = training_objects(seed=0)
    train(model, optimizer, scheduler, 1)
    save_training_state(folder, model, optimizer, scheduler, process_index=0, is_main=True)
    (folder / name).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(QAEUserError, match=f"{name} cannot be read"):
        load_training_state(folder, *training_objects(seed=0), process_index=0)
    assert not MARKER.exists()


def test_a_sharded_checkpoint_resumed_unsharded_is_refused_with_the_way_out(tmp_path):
    """A sharded (FSDP2) run's checkpoint holds per-process slices only: an unsharded launch cannot take them and
    says to resume with the config the run was trained with (the sharded resume is tests/e2e/test_fsdp2.py's)."""
    model, optimizer, scheduler = training_objects(seed=0)
    save_training_state(tmp_path, model, optimizer, scheduler, process_index=0, is_main=True)
    (tmp_path / POLICY_FILE).unlink()  # what a sharded checkpoint lacks, and has instead:
    (tmp_path / "rank-0.json").write_text('{"processes": 2, "tensors": {}}')
    with pytest.raises(QAEUserError, match=r"written sharded \(FSDP2\) and this launch trains unsharded.*fsdp2.yaml"):
        load_training_state(tmp_path, model, optimizer, scheduler, process_index=0)


# ---------------------------------------------------------------------------------------------------------------
# a damaged state file is found before anything is loaded, so a resume passes over its checkpoint


DAMAGES = {
    "cut": lambda data: data[: len(data) // 2],
    "deep": lambda data: b"[" * 100_000 + b"]" * 100_000,
    "list": lambda data: b"[1, 2, 3]",
    "pickle": lambda data: pickle.dumps(Payload()),
    "wrong types": lambda data: (
        b'{"python": "x", "numpy": [1], "torch": {"a": 1}, "param_groups": 3, '
        b'"scalars": [], "tuple_keys": {}, "last_epoch": "x", "step": "two"}'
    ),
}
STATE_FILES = [POLICY_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE.format(process=0)]


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("name", STATE_FILES)
def test_a_damaged_state_file_is_named_before_loading(tmp_path, name, damage):
    """Each file of the training state, damaged as a full disk, an editor or a planter would, is named by
    training_state_problem without loading anything: a resume then skips the checkpoint as it skips one whose
    checksums fail (manifests rewritten to match pass those)."""
    global MARKER
    MARKER = tmp_path / "ran"
    model, optimizer, scheduler = training_objects(seed=0)
    train(model, optimizer, scheduler, 1)
    save_training_state(tmp_path, model, optimizer, scheduler, process_index=0, is_main=True)
    assert training_state_problem(tmp_path) is None
    if name.endswith(".safetensors") and damage in ("deep", "list", "wrong types"):  # a header that parses as JSON
        header = DAMAGES[damage](b"")
        (tmp_path / name).write_bytes(struct.pack("<Q", len(header)) + header)
    else:
        (tmp_path / name).write_bytes(DAMAGES[damage]((tmp_path / name).read_bytes()))
    problem = training_state_problem(tmp_path)
    assert problem is not None and problem.startswith(name), problem
    assert not MARKER.exists()


def test_every_process_state_file_is_checked_and_a_missing_one_named(tmp_path):
    model, optimizer, scheduler = training_objects(seed=0)
    save_training_state(tmp_path, model, optimizer, scheduler, process_index=0, is_main=True)
    (tmp_path / "rng-1.json").write_text('{"python": 7}')  # a second process's, damaged
    assert training_state_problem(tmp_path).startswith("rng-1.json")
    (tmp_path / "rng-1.json").unlink()
    (tmp_path / "rng-0.json").unlink()
    assert training_state_problem(tmp_path) == "rng-0.json is missing"


@pytest.mark.parametrize(
    "name, content",
    [
        ("trainer_state.json", b"\x80\x04K\x01."),
        ("optimizer.json", b'{"param_groups": 3}'),
        ("rng-0.json", b"[" * 100_000 + b"]" * 100_000),
    ],
)
def test_a_resume_passes_over_a_checkpoint_whose_state_is_damaged(tiny_run, tmp_path, name, content):
    """A file of the newest checkpoint damaged and its manifest rewritten to match (checksums pass): the resume
    names it and resumes from the older checkpoint, as it does past one whose checksums fail; the run ends whole."""
    import shutil

    from typer.testing import CliRunner

    from qae_app.cli.main import app
    from qae_app.store.reader import logged_steps
    from tests.plants import rewrite_manifest

    runs_dir, run = tiny_run
    shutil.copytree(runs_dir / run, tmp_path / run)
    newest = tmp_path / run / "checkpoints" / "step-6"
    (newest / name).write_bytes(content)
    rewrite_manifest(newest)
    result = CliRunner().invoke(
        app, ["train", "--resume", run, "--steps", "7", "--runs-dir", str(tmp_path)], env={"COLUMNS": "300"}
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert f"skipping checkpoint step-6: {name} " in output and "from checkpoint step-3" in output, output
    assert logged_steps(tmp_path / run) == set(range(1, 8))
