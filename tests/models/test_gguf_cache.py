"""The cache a GGUF model is converted into (qae_app/models/policy.py): processes converting the same file at once
publish one complete folder, a failed conversion leaves nothing behind, and a missing file is named. The conversion of
the real SmolLM2 file is tests/e2e/test_real_model.py's."""

import multiprocessing
import time
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.models.policy import local_model_folder, publish_folder


def _build_slowly(tmp: Path, marker: str) -> None:
    for i in range(5):
        (tmp / f"part-{i}").write_text(marker)
        time.sleep(0.05)
    (tmp / "done").write_text(marker)


def _race(final: str, marker: str, barrier) -> None:
    barrier.wait()
    publish_folder(Path(final), lambda tmp: _build_slowly(tmp, marker))


def test_concurrent_first_uses_publish_one_complete_folder(tmp_path):
    final = tmp_path / "gguf" / "abc"
    context = multiprocessing.get_context("fork")  # the racers only write files: no re-import of torch
    barrier = context.Barrier(3)
    racers = [context.Process(target=_race, args=(str(final), f"racer-{i}", barrier)) for i in range(3)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=120)
        assert racer.exitcode == 0
    contents = {p.name: p.read_text() for p in final.iterdir()}
    assert set(contents) == {"part-0", "part-1", "part-2", "part-3", "part-4", "done"}
    assert len(set(contents.values())) == 1  # every file from the one build that won, none mixed in
    assert [p.name for p in final.parent.iterdir()] == ["abc"]  # the losers' temporary folders are gone


def test_a_failed_conversion_leaves_nothing_behind(tmp_path):
    def broken(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_folder(tmp_path / "gguf" / "abc", broken)
    assert not any((tmp_path / "gguf").iterdir())


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(QAEUserError, match="model: GGUF file '.*nope.gguf' does not exist"):
        local_model_folder(str(tmp_path / "nope.gguf"))
