"""The plant matrix (tests/plant_matrix.py) on the files of a run's checkpoint: every variant of each (manifest,
trainer state, policy and optimizer tensors, scheduler, RNG, the saved model's files, and the folders as links) x
every command that reads run folders, in real subprocesses. The run's own files are test_planted_run_folders.py's;
apart, the matrix spreads over two of xdist's workers."""

from __future__ import annotations

import pytest

from tests.plant_matrix import matrix_problems, planted_targets, plants_of


@pytest.mark.slow
@pytest.mark.parametrize("target", [t for t in planted_targets() if t.startswith("checkpoints")])
def test_every_plant_of_a_checkpoint_file_under_every_command(base, tmp_path, target):
    assert matrix_problems(base, tmp_path, plants_of(target)) == []
