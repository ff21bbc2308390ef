"""Run every command of tests/plants.py's COMMANDS on each case folder named on the command line, in this one process
(torch and the model load once, not once per command), and print one JSON line per command:
{"case", "command", "exit", "exception", "ran_payload", "output", "seconds"}. A line {"case", "command", "start":
true} comes before each, so a command that hangs (the watchdog ends this process after HANG_S, printing every
thread's stack) is known by its start line without an end.

    python tests/scripts/plant_commands.py CASE_DIR...
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from typer.testing import CliRunner  # noqa: E402

from qae_app.cli.main import app  # noqa: E402
from tests.plants import COMMANDS, MARKER  # noqa: E402

HANG_S = 120  # far above any command's time on a case; only a hang reaches it


def run_case(case: Path) -> None:
    runner = CliRunner()
    for name, args in COMMANDS:
        print(json.dumps({"case": str(case), "command": name, "start": True}), flush=True)
        argv = [arg.format(case=case) for arg in args] + ["--runs-dir", str(case / "runs")]
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        started = time.perf_counter()
        try:
            result = runner.invoke(app, argv, env={"COLUMNS": "300"})
        finally:
            faulthandler.cancel_dump_traceback_later()
        exception = result.exception if not isinstance(result.exception, SystemExit) else None
        ran = (case / MARKER).exists()
        if ran:
            (case / MARKER).unlink()
        print(
            json.dumps(
                {
                    "case": str(case),
                    "command": name,
                    "exit": result.exit_code,
                    "exception": None if exception is None else "".join(traceback.format_exception(exception))[-3000:],
                    "ran_payload": ran,
                    "output": result.output[-20000:],
                    "seconds": round(time.perf_counter() - started, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        run_case(Path(folder))
