"""A folder someone sends you, or the folder you start from, never runs code: every file a run folder holds is read
as data (JSON, Arrow, safetensors, DuckDB), and `qae dashboard` does not import modules from the working folder.

Each test plants a payload that would write a marker file if it ever ran, runs the real command on it, and checks
the marker is absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dashboard import free_port, wait_healthy

# a module that leaves a trace when imported: `python -m streamlit` used to put the working folder first on sys.path,
# so these names, imported by Streamlit itself, ran from whatever folder `qae dashboard` was started in
PLANTED_MODULES = ("streamlit.py", "click.py", "tornado.py", "pandas.py")


def plant_modules(folder: Path, marker: Path) -> None:
    for name in PLANTED_MODULES:
        (folder / name).write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")


@pytest.mark.slow
def test_qae_dashboard_imports_no_module_from_the_working_folder(tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    start = tmp_path / "downloads"
    start.mkdir()
    marker = tmp_path / "ran.txt"
    plant_modules(start, marker)
    port = free_port()
    qae = Path(sys.executable).parent / "qae"
    process = subprocess.Popen([str(qae), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)], cwd=start,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_healthy(port, process)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert not marker.exists(), f"planted modules ran: {marker.read_text()!r}\n{output}"
