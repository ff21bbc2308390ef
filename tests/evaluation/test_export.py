"""`qae export RUN --out X` writes exactly the checkpoint's model, as the manifest lists it, to a new or empty folder;
every --out that cannot be one is a one-line message, exit 2, with the run unchanged."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.run_folder import latest_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("runs")
    result = runner.invoke(
        app,
        [
            "train",
            "--run-name",
            "r",
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--cpu",
            "--runs-dir",
            str(runs_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    return runs_dir


@pytest.fixture
def runs(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "runs")
    return tmp_path / "runs"


def export(runs, out) -> tuple[int, str]:
    result = runner.invoke(app, ["export", "r", "--out", str(out), "--runs-dir", str(runs)], env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


BAD_OUT = {
    "an existing file": (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file, not a folder"),
    "a path under a file": (lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "sub", "is a file, so"),
    "/dev/null": (lambda tmp: "/dev/null", "is a file, not a folder"),
    "a folder inside the checkpoint": (
        lambda tmp: latest_checkpoint(tmp / "runs" / "r") / "model" / "again",
        "is inside the run's own folder",
    ),
    "a name over 255 bytes": (lambda tmp: tmp / ("x" * 300), "has a name over 255 bytes"),
}


@pytest.mark.parametrize("make_out, message", BAD_OUT.values(), ids=BAD_OUT.keys())
def test_an_out_that_cannot_be_a_new_folder_is_one_message(runs, tmp_path, make_out, message):
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    code, output = export(runs, make_out(tmp_path))
    assert code == 2 and message in output and "Traceback" not in output, output
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before


def test_an_export_past_the_file_size_limit_says_so_and_leaves_the_run(runs, tmp_path):
    """A real fault of the machine (`ulimit -f`: the copy of the weights fails with EFBIG), not a mock."""
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    result = subprocess.run(
        [sys.executable, "-m", "qae_app.cli", "export", "r", "--out", str(tmp_path / "out"), "--runs-dir", str(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
        env=dict(os.environ, COLUMNS="300"),
    )
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2 and "cannot write the export" in output and "Traceback" not in output, output
    assert "The run is unchanged" in output


def test_only_the_files_the_manifest_lists_are_exported(runs, tmp_path):
    model = latest_checkpoint(runs / "r") / "model"
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (model / "planted.txt").symlink_to(secret)  # not in the manifest: the checksum check never sees it
    code, output = export(runs, tmp_path / "out")
    assert code == 0, output
    exported = {p.name for p in (tmp_path / "out").iterdir()}
    assert "planted.txt" not in exported and {"config.json", "model.safetensors"} <= exported


def test_a_run_without_a_sound_checkpoint_is_said_in_exports_words(runs, tmp_path):
    """Every checkpoint damaged: one message, exit 2, naming what `qae export` takes (not `qae eval`'s model folder),
    with no export written; so with --checkpoint N naming the damaged one."""
    model = latest_checkpoint(runs / "r") / "model" / "model.safetensors"
    model.write_bytes(b"cut")
    code, said = export(runs, tmp_path / "out")
    assert code == 2 and "run: no checkpoint of run 'r' checks out" in said, said
    assert "Evaluate" not in said and "model folder" not in said and not (tmp_path / "out").exists()
    step = int(latest_checkpoint(runs / "r").name.split("-")[1])
    result = runner.invoke(
        app,
        ["export", "r", "--out", str(tmp_path / "out"), "--checkpoint", str(step), "--runs-dir", str(runs)],
        env={"COLUMNS": "300"},
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "does not check out" in said and "Export another one" in said, said
    assert "Evaluate" not in said
