"""qae_app/cli: the commands as a user runs them (in-process with typer's CliRunner, or as processes), their
terminal views against the snapshots in snapshots/, and `qae sweep` / `qae compare`. The fixtures are
tests/conftest.py's, but for the plant tests' `base`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.plants import make_base_run


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The one small real run every plant case copies (two steps of the built-in model, a checkpoint, labels,
    pending/): built once per test file (tests/cli/test_planted_*.py)."""
    return make_base_run(tmp_path_factory.mktemp("base"))
