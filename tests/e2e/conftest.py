"""End to end, with real processes: `accelerate launch` of 2 processes (DDP and FSDP2 on CPU), training processes
killed and resumed (crash safety), `qae sweep` running its points, and a real pretrained model (SmolLM2) trained and
evaluated. Every test collected in this folder is marked slow here, so the quick set (`-m "not slow"`) leaves the
whole folder out; a quick test belongs in the folder of the package it tests. The fixtures are tests/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark (pytest's own hook); it sees every folder's items
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
