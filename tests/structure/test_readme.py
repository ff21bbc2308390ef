"""The README stays true: CI runs its test command, its metrics table is STEP_METRICS, its CLI table names every
command."""

import re
from pathlib import Path

from qae_app.cli.main import app
from qae_app.store.schema import STEP_METRICS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_install_and_train_then_install_and_test():
    train, test = readme_commands()[:2]
    assert train.endswith("&& qae train")
    assert "pip install torch==2.13.0 && pip install -e ." in train
    assert test.endswith("python -m pytest") and "'.[dev]'" in test


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_metrics_table_defines_every_step_metric():
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|$", README, re.M))
    assert {name: rows.get(name) for name in STEP_METRICS} == STEP_METRICS


def test_cli_table_names_every_command():
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        assert f"`qae {name}" in README, name
