"""`qae dashboard` as a real server: it serves, stops on Ctrl-C and SIGTERM, keeps to its host and port, and
neither it nor the reading commands load torch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.dashboard.helpers import APP, free_port, wait_healthy

# ---------------------------------------------------------------------------------------------------------------
# the real server


def listening_addresses(port: int) -> set[str]:
    """Local addresses of sockets listening on `port`, from /proc/net/tcp and tcp6 (state 0A = LISTEN)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            if len(address) == 8:  # IPv4, little-endian
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
            else:
                words = bytes.fromhex(address)
                found.add(socket.inet_ntop(socket.AF_INET6, b"".join(words[i : i + 4][::-1] for i in range(0, 16, 4))))
    return found


def kill_group_if_running(process: subprocess.Popen) -> None:
    """A test's cleanup: a dashboard that did not stop as asked takes its streamlit child down with it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_qae_dashboard_stops_cleanly_on_ctrl_c(runs_dir):
    port = free_port()
    qae = Path(sys.executable).parent / "qae"
    # started with SIGINT ignored, as from a script's `&` or a test runner's worker: Ctrl-C must still stop it whole
    process = subprocess.Popen(
        [str(qae), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        wait_healthy(port, process)
        assert listening_addresses(port) == {"127.0.0.1"}  # nobody else on the network can reach the runs
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole foreground group
        output, _ = process.communicate(timeout=20)
    finally:
        kill_group_if_running(process)
    assert process.returncode == 0, output
    assert "dashboard stopped" in output and "Traceback" not in output
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)


def _start_dashboard(runs_dir: Path, port: int) -> subprocess.Popen:
    qae = Path(sys.executable).parent / "qae"
    return subprocess.Popen(
        [str(qae), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _children(pid: int) -> list[int]:
    """Pids of the direct children of `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_qae_dashboard_stops_the_server_on_sigterm(small_dir):
    port = free_port()
    process = _start_dashboard(small_dir, port)
    try:
        wait_healthy(port, process)
        servers = _children(process.pid)
        assert servers, "qae dashboard runs streamlit as a child process"
        process.send_signal(signal.SIGTERM)  # to qae alone, as systemd or `kill PID` would
        output, _ = process.communicate(timeout=30)
    finally:
        kill_group_if_running(process)
    assert process.returncode == 0, output
    assert "dashboard stopped" in output and "Traceback" not in output
    assert not [
        pid
        for pid in servers
        if Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    ]
    assert not listening_addresses(port)


@pytest.mark.slow
def test_qae_dashboard_fails_when_the_port_is_taken(small_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = _start_dashboard(small_dir, port)
        try:
            output, _ = process.communicate(timeout=120)
        finally:
            kill_group_if_running(process)
    assert process.returncode == 1, output
    assert f"Port {port} is not available" in output and "the dashboard server exited with code 1" in output


@pytest.mark.slow
def test_the_dashboard_and_terminal_views_do_not_import_torch(small_dir):
    """Every page (AppTest) and `qae runs/show/rollouts` in a fresh interpreter: torch is never loaded."""
    script = f"""
import os, sys
os.environ["QAE_RUNS_DIR"] = {str(small_dir)!r}
from streamlit.testing.v1 import AppTest
for page in ["runs", "curves", "distributions", "rollouts", "prompts", "evals", "eval_samples", "compare"]:
    at = AppTest.from_file({str(APP)!r}, default_timeout=60)
    at.query_params["run"] = ["crafted"]
    at.run()
    at.switch_page(f"views/{{page}}.py").run()
    assert not at.exception, (page, [e.value for e in at.exception])
from typer.testing import CliRunner
from qae_app.cli.main import app
for args in (["runs"], ["show", "crafted"], ["rollouts", "crafted"]):
    assert CliRunner().invoke(app, [*args, "--runs-dir", {str(small_dir)!r}]).exit_code == 0, args
print("torch loaded:", "torch" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch loaded: False" in result.stdout
