"""`qae dashboard`: start the Streamlit dashboard on this machine, with or without its controls."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qae_app.cli.console import console, err_console, fail
from qae_app.cli.options import DEFAULT_RUNS_DIR, RunsDir
from qae_app.core import names
from qae_app.core.errors import QAEUserError

# `python -m streamlit` puts the working folder first on sys.path, so a `click.py` or `streamlit.py` in the folder the
# dashboard is started from (a download folder, a shared run folder) would run as the user: start Streamlit's CLI with
# that entry dropped (it is '' under `python -c`, and absent where PYTHONSAFEPATH is set)
STREAMLIT_WITHOUT_WORKING_FOLDER = (
    "import sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n"
    "from streamlit.web.cli import main\n"
    "sys.exit(main(prog_name='streamlit'))"
)


def dashboard_app() -> Path:
    """The Streamlit entry point, installed with the package as qae_app.dashboard (the repo's dashboard/ folder)."""
    from importlib.resources import files

    return Path(str(files("qae_app.dashboard") / "app.py"))


def dashboard(
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8501,
    host: Annotated[
        str,
        typer.Option(
            help="Address to bind. The default keeps it on this machine; 0.0.0.0 exposes every run to your network."
        ),
    ] = "127.0.0.1",
    refresh: Annotated[
        str,
        typer.Option(
            help="Seconds between the pages' checks for new steps and runs: "
            + ", ".join(names.DASHBOARD_REFRESH_S)
            + ". The sidebar changes it in that browser tab; off suits reading finished runs.",
        ),
    ] = names.DASHBOARD_REFRESH_DEFAULT,
    controls: Annotated[
        bool | None,
        typer.Option(
            "--controls/--read-only",
            help="Show the controls that change runs (stop a live run, edit tags and notes) or none. Default: controls "
            "on a loopback --host (this machine only), none on any other (anyone who reaches the page could use "
            "them).",
        ),
    ] = None,
) -> None:
    """Start the Streamlit dashboard (live curves, rollouts browser) on 127.0.0.1; Ctrl-C or SIGTERM stops it."""
    import os

    _check_options(port, host, refresh)
    app_path = dashboard_app()
    command = [
        sys.executable,
        "-c",
        STREAMLIT_WITHOUT_WORKING_FOLDER,
        "run",
        str(app_path),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
        "--client.toolbarMode",
        "minimal",
    ]
    controls = dashboard_controls(host, controls)
    env = dict(
        os.environ,
        QAE_RUNS_DIR=str(Path(runs_dir).resolve()),
        **{names.DASHBOARD_REFRESH_ENV: refresh, names.DASHBOARD_CONTROLS_ENV: str(int(controls))},
    )
    console.print(
        f"qae dashboard for [cyan]{Path(runs_dir).resolve()}[/] at [bold]http://{host}:{port}[/] "
        f"({'' if controls else 'read-only; '}Ctrl-C to stop)"
    )
    _serve(command, env)


def _check_options(port: int, host: str, refresh: str) -> None:
    """Refuse a port, host or refresh interval the server could not use, naming the option."""
    if not 0 < port < 65536:
        fail(QAEUserError(f"port: {port} is not a TCP port. Use 1-65535 (default 8501)."))
    if refresh not in names.DASHBOARD_REFRESH_S:
        *most, last = names.DASHBOARD_REFRESH_S
        fail(
            QAEUserError(
                f"refresh: {refresh} is not offered. Use {', '.join(most)} or {last} (seconds between "
                f"checks for new steps; default {names.DASHBOARD_REFRESH_DEFAULT})."
            )
        )
    _check_host(host)


def _serve(command: list[str], env: dict[str, str]) -> None:
    """Run the Streamlit server until it exits, Ctrl-C or SIGTERM; a server that fails exits 1."""
    import signal
    import subprocess

    process = subprocess.Popen(command, env=env)

    def stop(signum, frame):  # SIGTERM (systemd, kill) stops the server too, as Ctrl-C does
        raise KeyboardInterrupt

    # SIGINT too: a process started with SIGINT ignored (from a script's `&`, a test runner's worker) has no Python
    # handler for it, and Ctrl-C would stop the server but leave this process to report a clean exit
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
    except KeyboardInterrupt:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        console.print("dashboard stopped")
        return
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if code != 0:  # e.g. the port is taken: Streamlit said why above
        err_console.print(f"[bold red]error:[/] the dashboard server exited with code {code}.")
        raise typer.Exit(code=1)


def dashboard_controls(host: str, asked: bool | None) -> bool:
    """Whether the dashboard shows its controls: as --controls / --read-only say, else only where --host keeps the
    server on this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if asked is not None:
        return asked
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"


def _check_host(host: str) -> None:
    """Refuse a --host the server could not listen on (Streamlit would fail with a traceback): one that names no
    address, or an address this machine does not have. Whether the port is free is for the server to say."""
    import socket

    advice = (
        "Use 127.0.0.1 (this machine only, the default), 0.0.0.0 (every network interface) or an address of "
        "this machine."
    )
    try:
        family, _, _, _, address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        fail(QAEUserError(f"host: '{host}' is not an address ({getattr(err, 'strerror', None) or err}). {advice}"))
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))  # any free port: only the address is in question here
        except OSError as err:
            fail(QAEUserError(f"host: '{host}' is not an address of this machine ({err.strerror}). {advice}"))
