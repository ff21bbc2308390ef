"""tests/timeout_report.py: a test that runs past pytest-timeout's limit under pytest-xdist is named in the run's
report with where it was, not only as a worker that "crashed"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_test_past_the_timeout_under_xdist_is_reported_with_its_stack(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.timeout_report"]\n')
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_waits_forever():\n    time.sleep(60)\n\ndef test_quick():\n    pass\n"
    )
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "2"]
        + ["--max-worker-restart=0", "-o", "timeout=3", "-o", "timeout_method=thread", str(tmp_path / "test_slow.py")]
        + ["--basetemp", str(tmp_path / "basetemp")],  # not a numbered folder beside this run's own
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = process.stdout
    assert process.returncode == 1, out + process.stderr
    assert "crashed while running 'test_slow.py::test_waits_forever'" in out, out
    assert "test_slow.py::test_waits_forever ran past pytest-timeout's 3 s" in out, out
    assert 'test_slow.py", line 4, in test_waits_forever' in out and "1 passed" in out, out
