"""The package's shape stays livable: `ls qae_app` shows the architecture (the layer table below), no import goes up
or sideways between packages, no module circle, the terminal commands and the dashboard free of torch, a training step
that writes nothing, and rows that are exactly the store's columns."""

import ast
import dataclasses
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qae_app.config import TrainConfig, build_config
from qae_app.store.schema import STEP_METRICS, row_columns
from qae_app.store.writer import RunWriter

PACKAGE = Path(__file__).resolve().parents[2] / "qae_app"
# The layer table. A package imports only from packages in lower layers, never from one beside it or above it; inside
# a package its modules import each other, never in a circle. `config` is a module of its own; the dashboard sits on
# top. docs/architecture.md describes each package and module.
LAYERS = [
    {"core"},  # errors, the shared names, host faults, fault injection, formatting
    {"store", "data", "rewards", "algo"},  # the run store; tasks and data files; verifiable rewards; estimators, losses
    {"models"},  # loading policies, packaged models, LoRA, FSDP2 sharding
    {"engines"},  # rollout engines: the protocol, transformers + the decode loop, vLLM, sampling options
    {"config"},  # the options of `qae train` and `qae eval`
    {"scoring"},  # the training reward path: a run's task and rewards, a generation batch scored into rewards
    {"evaluation", "analysis"},  # `qae eval` and its metrics; comparing runs and the memory plan
    {"train"},  # the RL loop: trainer, update, session, checkpoints, attribution, entropy band, warm start
    {"cli"},  # the commands, their terminal views, training progress, sweeps
    {"dashboard"},
]
DASHBOARD = PACKAGE.parent / "dashboard"
# the app's own modules, imported by bare name (Streamlit runs it as a script)
DASHBOARD_LOCAL = {"attribution", "board", "charts", "grouping"}
# what the dashboard may import from qae_app: the torch-free packages, and nothing of the terminal views (their text
# belongs to the CLI)
DASHBOARD_MAY_IMPORT = {"core", "store", "data", "config", "analysis"}


def package_of(module: str) -> str:
    """`store.schema` -> `store`; `config` -> `config`; `dashboard.views.runs` -> `dashboard`."""
    return module.split(".")[0]


def _imports_of(path: Path, local: set[str] = frozenset()) -> set[str]:
    """The qae_app modules (as `package.module`, or `config`) and `local` bare names (as dashboard.<name>) that `path`
    imports anywhere: at the top or inside a function (a lazy import is an arrow all the same)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qae_app"):
            parts = node.module.split(".")[1:]
            if len(parts) >= 2:  # from qae_app.store.schema import X
                imported.add(".".join(parts[:2]))
            elif len(parts) == 1 and (PACKAGE / parts[0]).is_dir():  # from qae_app.store import schema
                imported.update(f"{parts[0]}.{alias.name}" for alias in node.names)
            elif len(parts) == 1:  # from qae_app.config import X
                imported.add(parts[0])
            else:  # from qae_app import config
                imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(".".join(a.name.split(".")[1:3]) for a in node.names if a.name.startswith("qae_app."))
            imported.update(f"dashboard.{a.name}" for a in node.names if a.name in local)
        if isinstance(node, ast.ImportFrom) and node.module in local:
            imported.add(f"dashboard.{node.module}")
    return imported


def package_modules() -> dict[str, Path]:
    """`package.module` (or `config`) -> its file, for every module of qae_app."""
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
        for path in PACKAGE.rglob("*.py")
        if path.stem not in ("__init__", "__main__")
    }


def import_graph() -> dict[str, set[str]]:
    """module -> the modules it imports: qae_app's as `package.module`, the dashboard's as dashboard.<name>."""
    graph = {name: _imports_of(path) - {name} for name, path in package_modules().items()}
    for path in [*DASHBOARD.glob("*.py"), *(DASHBOARD / "views").glob("*.py")]:
        if path.stem != "__init__":
            name = "dashboard." + ".".join(path.relative_to(DASHBOARD).with_suffix("").parts)
            graph[name] = _imports_of(path, DASHBOARD_LOCAL) - {name}
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


def test_there_is_no_import_cycle():
    assert strongly_connected(import_graph()) == []


def test_ls_shows_the_layer_table():
    """Every package of qae_app is in the table and every package in the table exists: a new package gets placed on
    purpose."""
    on_disk = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()} | {"config"}
    assert on_disk | {"dashboard"} == set().union(*LAYERS)
    assert set(map(package_of, package_modules())) <= on_disk


def test_no_package_imports_one_beside_or_above_it():
    layer_of = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    arrows = [
        (module, other)
        for module, imports in import_graph().items()
        for other in imports
        if not other.startswith("dashboard.") or not module.startswith("dashboard.")
    ]
    bad = [
        (module, other)
        for module, other in arrows
        if package_of(module) != package_of(other) and layer_of[package_of(other)] >= layer_of[package_of(module)]
    ]
    assert bad == []


def test_lazy_imports_are_arrows_too():
    """The factory imports the vLLM engine inside a function only: the graph must see it, or a lazy import could hide
    any upward arrow."""
    assert "engines.vllm_engine" in import_graph()["engines.factory"]


def test_the_dashboard_imports_only_torch_free_readers():
    graph = import_graph()
    dashboard = {name: imports for name, imports in graph.items() if name.startswith("dashboard.")}
    assert {"dashboard.app", "dashboard.board", "dashboard.charts", "dashboard.views.compare"} <= set(dashboard)
    reaching = {
        name: sorted(
            other
            for other in imports
            if not other.startswith("dashboard.") and package_of(other) not in DASHBOARD_MAY_IMPORT
        )
        for name, imports in dashboard.items()
    }
    assert {name: bad for name, bad in reaching.items() if bad} == {}


# each was broken once; named here so the layers cannot drift back into allowing it
NEVERS = [
    (
        "config",
        {"store.schema", "store.reader", "store.writer", "store.run_file", "train.session"},
        "config is plain options and parsing",
    ),
    (
        "dashboard.views.compare",
        {"cli.views"},
        "the dashboard formats through qae_app.core.formatting, not the CLI's text",
    ),
    (
        "rewards.builtin_verifiers",
        {"data.tasks"},
        "a task names its reward; the reward knows no task (the chain marker lives in names)",
    ),
    (
        "engines.hf",
        {"config"},
        "the engines take SamplingOptions from qae_app.engines.sampling, not the training config",
    ),
]


@pytest.mark.parametrize("module, never, why", NEVERS, ids=[n[0] for n in NEVERS])
def test_the_four_nevers(module, never, why):
    assert not import_graph()[module] & never, why


def test_no_module_basename_is_used_twice():
    """A module's name says its job: two modules named preview.py (the command, the library, the page) leave a
    traceback or an import that says `preview` unsure of which one it means."""
    files = [*PACKAGE.rglob("*.py"), *DASHBOARD.rglob("*.py")]
    seen: dict[str, list[str]] = {}
    for path in files:
        if path.stem not in ("__init__", "__main__"):
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def _is_qae_module(dotted: str) -> bool:
    path = PACKAGE.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def module_aliases(path: Path) -> list[str]:
    """`import qae_app.x.y as z` and `from qae_app.x import y as z` (y a module, z not y) in `path`: a module read
    under another name than its own, which grep for the module does not find."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [
                f"{a.name} as {a.asname}"
                for a in node.names
                if a.name.startswith("qae_app.") and a.asname and a.asname != a.name.rsplit(".", 1)[-1]
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qae_app"):
            found += [
                f"{node.module}.{a.name} as {a.asname}"
                for a in node.names
                if a.asname and a.asname != a.name and _is_qae_module(f"{node.module}.{a.name}")
            ]
    return found


def test_no_import_reads_a_qae_module_under_another_name():
    """Product code, tests, benchmarks and scripts import a qae_app module by its own name (or import the names they
    use from it): `reader as store_read` kept a name from before the store was a package."""
    root = PACKAGE.parent
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout
    aliased = {
        name: found for name in listed.split() if (root / name).exists() and (found := module_aliases(root / name))
    }
    assert aliased == {}


# A function longer than this does more than one thing a reader can hold at once: split it along its steps. Counted
# from the first statement after the docstring to the end, so a docstring or a long signature costs nothing and
# packing lines buys nothing (ruff holds lines to 120 characters).
MAX_FUNCTION_LINES = 60


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return node.end_lineno - body[0].lineno + 1 if body else 0


def qualified_functions(tree: ast.AST, prefix: str = "") -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function under `tree` by its qualified name, as Python's __qualname__ without `<locals>`: `f`,
    `Class.method`, `outer.inner`, `Class.method.inner`; so two methods of one name in two classes are two entries."""
    found = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                found[name] = node
            found.update(qualified_functions(node, f"{name}."))
        else:  # a function defined inside an `if` or a `with` at this level
            found.update(qualified_functions(node, prefix))
    return found


def function_lengths() -> dict[str, int]:
    """`package.module.qualified.name` -> the lines of its body, without its docstring."""
    lengths = {}
    files = {
        **package_modules(),
        **{
            "dashboard." + ".".join(path.relative_to(DASHBOARD).with_suffix("").parts): path
            for path in DASHBOARD.rglob("*.py")
        },
    }
    for module, path in files.items():
        for name, node in qualified_functions(ast.parse(path.read_text())).items():
            lengths[f"{module}.{name}"] = _body_lines(node)
    return lengths


def test_function_lengths_see_every_method_by_its_class():
    """Two methods of one name (EvalConfig.validate, TrainConfig.validate) are two functions: keyed by the bare name,
    the shorter hid the longer."""
    tree = ast.parse(
        "class A:\n    def f(self):\n        x = 1\n\n\nclass B:\n    def f(self):\n        x = 1\n"
        "        y = 2\n\n        def g():\n            pass\n"
    )
    assert {name: _body_lines(node) for name, node in qualified_functions(tree).items()} == {
        "A.f": 1,
        "B.f": 5,
        "B.f.g": 1,
    }
    assert {"config.TrainConfig.validate", "config.EvalConfig.validate"} <= set(function_lengths())


def test_no_function_is_over_the_line_limit():
    over = {name: lines for name, lines in function_lengths().items() if lines > MAX_FUNCTION_LINES}
    assert over == {}, f"over {MAX_FUNCTION_LINES} lines: split each along its steps"


def modules_imported_by(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=PACKAGE.parent,
    )
    return set(out.stdout.split())


def test_reading_commands_and_the_dashboard_modules_do_not_import_torch(tiny_run):
    runs_dir, run_id = tiny_run
    for args in (
        ["--help"],
        ["runs"],
        ["show", run_id],
        ["rollouts", run_id, "--step", "2"],
        ["train", "--help"],
        ["compare", run_id],
        ["sweep", "--help"],
    ):
        if "--help" not in args:
            args = args + ["--runs-dir", str(runs_dir)]
        code = (
            "from typer.testing import CliRunner; from qae_app.cli.main import app\n"
            f"result = CliRunner().invoke(app, {args!r})\n"
            "assert result.exit_code == 0, result.output"
        )
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
    from qae_app.store.reader import read_steps
    from qae_app.train.trainer import Trainer

    trainer = Trainer(
        build_config(run_name="pure", steps=2, prompts_per_step=2, group_size=4, eval_every=0, k="auto"),
        tmp_path,
        cpu=True,
    )
    try:
        before = (tmp_path / "pure" / "qae.duckdb").read_bytes()
        out = trainer.train_step(1)
        assert (tmp_path / "pure" / "qae.duckdb").read_bytes() == before and trainer.session.writer.pending == []
    finally:
        trainer.close()
    assert out.chosen_k in (0.3, 0.4, 0.5) and out.warnings[0]["kind"] == "auto_k"
    # what only the loop knows (evaluation, write, checkpoint and store times) is added by fit
    assert set(out.metrics) == set(STEP_METRICS) - {"heldout_accuracy", "eval_s", "write_s", "checkpoint_s", "store_s"}
    assert all(set(row) == set(row_columns("groups")) for row in out.groups)
    assert all(set(row) == set(row_columns("rollouts")) for row in out.rollouts)
    assert all(set(row) == set(row_columns("warnings")) for row in out.warnings)
    assert read_steps(tmp_path / "pure" / "qae.duckdb").empty


def test_the_writer_refuses_rows_that_are_not_the_table_columns(tmp_path):
    writer = RunWriter(tmp_path / "x" / "qae.duckdb", "x")
    with pytest.raises(ValueError, match="groups rows have columns"):
        writer.add_step(1, groups=[{"group_idx": 0, "promt": "1+1="}])


@pytest.mark.slow
def test_a_wheel_install_serves_the_dashboard(tmp_path):
    """`pip install .` (a wheel, not an editable install) must give a working `qae dashboard`."""
    root = PACKAGE.parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(root),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp_path / "wheel").glob("qae_app-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "qae_app" / "dashboard" / "app.py").exists()
    assert (target / "qae_app" / "dashboard" / "views" / "rollouts.py").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = (
        "from qae_app.cli.dashboard_command import dashboard_app; import qae_app; "
        "print(qae_app.__file__, dashboard_app())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    )
    package_file, app_path = out.stdout.split()
    assert package_file.startswith(str(target)) and app_path.startswith(str(target))
    # the installed app renders (AppTest in a process that sees only the wheel's qae_app)
    code = (
        "from streamlit.testing.v1 import AppTest; from qae_app.cli.dashboard_command import dashboard_app\n"
        "app = AppTest.from_file(str(dashboard_app()), default_timeout=60).run()\n"
        "assert not app.exception, app.exception; print('rendered', len(app.main))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(env, QAE_RUNS_DIR=str(tmp_path / "runs")),
    )
    assert out.returncode == 0 and "rendered" in out.stdout, out.stdout + out.stderr
    # and `qae dashboard` serves it
    port = 8611
    server = subprocess.Popen(
        [sys.executable, "-m", "qae_app.cli", "dashboard", "--port", str(port), "--runs-dir", str(tmp_path / "runs")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
