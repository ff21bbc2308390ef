"""The training state of a checkpoint is data: saved as safetensors and JSON, restored exactly (the steps after a
restore equal the steps of an uninterrupted run, bit for bit), and a file planted in place of any of them is refused
by name without running."""

from __future__ import annotations

import pickle
import random

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


@pytest.mark.parametrize("name", [POLICY_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE,
                                  RNG_FILE.format(process=0)])
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
