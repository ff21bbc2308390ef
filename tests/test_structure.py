"""The package's shape stays livable: no import cycles but the optional vLLM engine's, no module importing a layer
above its own, the terminal commands and the dashboard free of torch, a training step that writes nothing, and rows
that are exactly the store's columns."""

import ast
import dataclasses
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qae_app import store, store_write
from qae_app.config import TrainConfig, build_config

PACKAGE = Path(__file__).resolve().parents[1] / "qae_app"
# lower layers never import higher ones; a module in no layer fails the test, so a new module gets placed on purpose
LAYERS = [
    {"errors", "names", "faults"},
    {"rundir", "metrics", "datasets", "rows", "formatting", "answers", "sampling"},
    {"store", "run_file", "store_write", "store_read", "tasks", "config", "compare"},
    {"advantages", "losses", "chunked_head", "models", "lora", "rewards", "verifier_pool", "verifier_preload",
     "checkpoint_state", "session"},
    {"rollout", "vllm_engine", "evaluate", "warmstart", "update"},
    {"trainer", "sweep"},
    {"terminal"},  # what the reading commands print (torch-free, like everything the dashboard and `qae runs` use)
    {"cli"},
]
ALLOWED_CYCLES = [{"rollout", "vllm_engine"}]  # rollout imports the vLLM engine lazily, only for --engine vllm


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.glob("*.py"):
        if path.name == "__init__.py":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qae_app"):
                parts = node.module.split(".")
                if len(parts) > 1:
                    imported.add(parts[1])
                else:
                    imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qae_app."))
        graph[path.stem] = imported - {path.stem}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components with more than one module are the import cycles."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            out.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return [c for c in out if len(c) > 1]


def test_the_only_import_cycle_is_the_optional_vllm_engine():
    cycles = strongly_connected(import_graph())
    assert all(cycle in ALLOWED_CYCLES for cycle in cycles), cycles


def test_no_module_imports_a_higher_layer():
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph = import_graph()
    unplaced = set(graph) - set(layer_of)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    upward = [(module, other) for module, imports in graph.items() for other in imports
              if layer_of[other] > layer_of[module] and {module, other} not in ALLOWED_CYCLES]
    assert upward == []


def modules_imported_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    return set(out.stdout.split())


def test_reading_commands_and_the_dashboard_modules_do_not_import_torch(tiny_run):
    runs_dir, run_id = tiny_run
    for args in (["--help"], ["runs"], ["show", run_id], ["rollouts", run_id, "--step", "2"], ["train", "--help"],
                 ["compare", run_id], ["sweep", "--help"]):
        if "--help" not in args:
            args = args + ["--runs-dir", str(runs_dir)]
        code = ("from typer.testing import CliRunner; from qae_app.cli import app\n"
                f"result = CliRunner().invoke(app, {args!r})\n"
                "assert result.exit_code == 0, result.output")
        loaded = modules_imported_by(code)
        assert not {"torch", "transformers", "accelerate"} & loaded, args
    dashboard = PACKAGE.parent / "dashboard"
    loaded = modules_imported_by(f"import sys; sys.path.insert(0, {str(dashboard)!r}); import board, charts")
    assert not {"torch", "transformers"} & loaded


def test_train_config_is_frozen_and_resumable_fields_are_marked():
    cfg = build_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3
    resumable = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata["resumable"]}
    assert {"steps", "checkpoint_every", "eval_every"} <= resumable
    assert not {"seed", "lr", "group_size", "estimator", "k", "data", "model"} & resumable


def test_a_training_step_writes_nothing_and_its_rows_are_the_store_columns(tmp_path):
    from qae_app.store_read import read_steps
    from qae_app.trainer import Trainer

    trainer = Trainer(build_config(run_name="pure", steps=2, prompts_per_step=2, group_size=4, eval_every=0,
                                   k="auto"), tmp_path, cpu=True)
    try:
        before = (tmp_path / "pure" / "qae.duckdb").read_bytes()
        out = trainer.train_step(1)
        assert (tmp_path / "pure" / "qae.duckdb").read_bytes() == before and trainer.session.writer.pending == []
    finally:
        trainer.close()
    assert out.chosen_k in (0.3, 0.4, 0.5) and out.warnings[0]["kind"] == "auto_k"
    # what only the loop knows (evaluation, write, checkpoint and store times) is added by fit
    assert set(out.metrics) == set(store.STEP_METRICS) - {"heldout_accuracy", "eval_s", "write_s", "checkpoint_s",
                                                          "store_s"}
    assert all(set(row) == set(store.row_columns("groups")) for row in out.groups)
    assert all(set(row) == set(store.row_columns("rollouts")) for row in out.rollouts)
    assert all(set(row) == set(store.row_columns("warnings")) for row in out.warnings)
    assert read_steps(tmp_path / "pure" / "qae.duckdb").empty


def test_the_writer_refuses_rows_that_are_not_the_table_columns(tmp_path):
    writer = store_write.RunWriter(tmp_path / "x" / "qae.duckdb", "x")
    with pytest.raises(ValueError, match="groups rows have columns"):
        writer.add_step(1, groups=[{"group_idx": 0, "promt": "1+1="}])


@pytest.mark.slow
def test_a_wheel_install_serves_the_dashboard(tmp_path):
    """`pip install .` (a wheel, not an editable install) must give a working `qae dashboard`."""
    root = PACKAGE.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "wheel"), str(root)], check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("qae_app-*.whl"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    assert (target / "qae_app" / "dashboard" / "app.py").exists()
    assert (target / "qae_app" / "dashboard" / "views" / "rollouts.py").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = "from qae_app.cli import dashboard_app; import qae_app; print(qae_app.__file__, dashboard_app())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env=env)
    package_file, app_path = out.stdout.split()
    assert package_file.startswith(str(target)) and app_path.startswith(str(target))
    # the installed app renders (AppTest in a process that sees only the wheel's qae_app)
    code = ("from streamlit.testing.v1 import AppTest; from qae_app.cli import dashboard_app\n"
            "app = AppTest.from_file(str(dashboard_app()), default_timeout=60).run()\n"
            "assert not app.exception, app.exception; print('rendered', len(app.main))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(env, QAE_RUNS_DIR=str(tmp_path / "runs")))
    assert out.returncode == 0 and "rendered" in out.stdout, out.stdout + out.stderr
    # and `qae dashboard` serves it
    port = 8611
    server = subprocess.Popen([sys.executable, "-m", "qae_app.cli", "dashboard", "--port", str(port), "--runs-dir",
                               str(tmp_path / "runs")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        health = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
                    health = response.read().decode()
                    break
            except OSError:
                time.sleep(0.5)
        assert health == "ok", server.stdout.read() if server.poll() is not None else "no answer"
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
