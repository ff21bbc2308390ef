"""A folder someone sends you, or the folder you start from, never runs code: every file a run folder holds is read
as data (JSON, Arrow, safetensors, DuckDB), and `qae dashboard` does not import modules from the working folder.

Each test plants a payload that would write a marker file if it ever ran, runs the real command on it, and checks
the marker is absent."""

from __future__ import annotations

import math
import pickle
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from qae_app.core.errors import QAEUserError
from qae_app.store.reader import last_logged_step
from qae_app.store.run_folder import pending_writes
from qae_app.store.schema import PendingWrite, pending_write_from_json, pending_write_json
from qae_app.store.writer import RunWriter
from qae_app.train.run_migration import migrate_run
from tests.dashboard.helpers import free_port, wait_healthy
from tests.launching import ONE_MACHINE

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
    process = subprocess.Popen(
        [str(qae), "dashboard", "--runs-dir", str(runs_dir), "--port", str(port)],
        cwd=start,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_healthy(port, process)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert not marker.exists(), f"planted modules ran: {marker.read_text()!r}\n{output}"


# ---------------------------------------------------------------------------------------------------------------
# pending/: the writes a trainer could not make yet


class Payload:
    """Pickled, it opens MARKER for writing when unpickled: the proof that a reader ran code from the folder."""

    marker: Path

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def planted_pickle(marker: Path) -> bytes:
    payload = Payload()
    payload.marker = marker
    return pickle.dumps(payload)


def test_a_pending_write_round_trips_through_json_exactly():
    write = PendingWrite(
        "step",
        step=3,
        logged_at=datetime(2026, 12, 2, 7, 15, 20, 123456),
        tables={
            "rollouts": [
                {
                    "response": "é\n\\boxed{1}\x00",
                    "reward": float("nan"),
                    "advantage": -0.0,
                    "n_tokens": 7,
                    "correct": True,
                    "regime": None,
                    "sample_idx": 2**31 - 1,
                    "entropy": float("inf"),
                    "logprob": 0.1 + 0.2,
                }
            ],
            "groups": [{"baseline": 0.4, "filtered": False, "answer": "1"}],
        },
    )
    back = pending_write_from_json(pending_write_json(write))
    assert back.kind == "step" and back.step == 3 and back.logged_at == write.logged_at
    row, again = write.tables["rollouts"][0], back.tables["rollouts"][0]
    assert math.isnan(again.pop("reward")) and math.copysign(1, again["advantage"]) == -1
    assert again == {k: v for k, v in row.items() if k != "reward"}
    assert type(again["n_tokens"]) is int and type(again["logprob"]) is float and again["logprob"] == 0.1 + 0.2
    assert back.tables["groups"] == write.tables["groups"]


@pytest.fixture
def run_with_planted_pending(tmp_path):
    """A finished run folder (its database and a checkpoint-less run) with a pickle payload in pending/, as an older
    qae would have named a saved write."""
    runs_dir = tmp_path / "runs"
    RunWriter(runs_dir / "r" / "qae.duckdb", "r")
    marker = tmp_path / "ran"
    pending = runs_dir / "r" / "pending"
    pending.mkdir(exist_ok=True)
    (pending / "00000001-step.pkl").write_bytes(planted_pickle(marker))
    return runs_dir, marker


def test_an_older_pickled_pending_write_is_refused_by_the_writer_and_never_runs(run_with_planted_pending):
    """The writer refuses the folder naming `qae migrate`, which refuses the pickle without --trust-pickles and
    changes nothing; readers never read it."""
    runs_dir, marker = run_with_planted_pending
    with pytest.raises(QAEUserError, match=r"pickles .*`qae migrate r --runs-dir .*--trust-pickles.*delete those"):
        RunWriter(runs_dir / "r" / "qae.duckdb", "r")
    with pytest.raises(QAEUserError, match=r"trust-pickles: .*pending/00000001-step.pkl.*Nothing was changed"):
        migrate_run(runs_dir, "r")
    assert (runs_dir / "r" / "pending" / "00000001-step.pkl").exists()
    assert last_logged_step(runs_dir / "r") == 0 and pending_writes(runs_dir / "r") == 0  # (JSON writes only)
    assert not marker.exists()


def test_a_trusted_folder_converts_its_pickled_writes_to_json_once(tmp_path):
    """`qae migrate --trust-pickles`: the user's own folder from an older qae; its saved writes are kept, as JSON."""
    run_dir = tmp_path / "runs" / "r"
    RunWriter(run_dir / "qae.duckdb", "r")
    pending = run_dir / "pending"
    pending.mkdir(exist_ok=True)
    old = PendingWrite(
        "step", step=1, tables={"steps": [{"reward_mean": 0.25}]}, logged_at=datetime(2026, 12, 1, 12, 0)
    )
    # as an older qae pickled it: the class named where it lived then, the flat module qae_app.store (protocol 0
    # spells the names out, so they can be written as they were)
    pickled = pickle.dumps(old, protocol=0).replace(b"qae_app.store.schema\n", b"qae_app.store\n")
    assert b"cqae_app.store\nPendingWrite" in pickled
    (pending / "00000001-step.pkl").write_bytes(pickled)
    assert migrate_run(run_dir.parent, "r", trust_pickles=True) == ["converted pending/00000001-step.pkl to JSON"]
    assert [p.name for p in pending.iterdir()] == ["00000001-step.json"]
    assert migrate_run(run_dir.parent, "r") == []  # current now: nothing more to do
    resumed = RunWriter(run_dir / "qae.duckdb", "r")
    assert [(w.kind, w.step, w.tables, w.logged_at) for w in resumed.pending] == [
        ("step", 1, {"steps": [{"reward_mean": 0.25}]}, datetime(2026, 12, 1, 12, 0))
    ]
    assert last_logged_step(run_dir) == 1


def test_a_planted_json_pending_file_is_named_not_executed(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    RunWriter(run_dir / "qae.duckdb", "r")
    (run_dir / "pending").mkdir(exist_ok=True)
    (run_dir / "pending" / "00000001-step.json").write_text('{"kind": "exec", "code": "import os"}')
    with pytest.raises(QAEUserError, match=r"00000001-step.json is not a write qae saved"):
        RunWriter(run_dir / "qae.duckdb", "r")


# ---------------------------------------------------------------------------------------------------------------
# every file of a run folder, under every command


@pytest.fixture(scope="module")
def sent_run(tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint, as someone would send it: (runs dir holding run 'r')."""
    from qae_app.config import build_config
    from qae_app.train.trainer import Trainer

    runs_dir = tmp_path_factory.mktemp("sent")
    cfg = build_config(run_name="r", steps=2, prompts_per_step=2, group_size=4, eval_every=0, checkpoint_every=2)
    with Trainer(cfg, runs_dir, cpu=True) as trainer:
        assert trainer.fit().status == "finished"
    return runs_dir


def run_folder_files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file() and p.name != "trainer.lock")


COMMANDS = (
    ["runs"],
    ["show", "r"],
    ["rollouts", "r", "--step", "2"],
    ["compare", "r"],
    ["train", "--resume", "r", "--steps", "3"],
    ["eval", "--model", "r", "--limit", "2", "--samples", "2"],
)


@pytest.mark.slow
def test_a_payload_planted_in_any_file_of_a_run_folder_runs_under_no_command(sent_run, tmp_path):
    """Each file of a real run folder in turn is replaced by a pickle that leaves a marker when unpickled, the
    checkpoint's manifest rewritten to match (as whoever planted it would), and every command that reads run
    folders is run on it, in this process. Any command may refuse the folder; none may run the payload. A
    pytorch_model.bin beside the model folder's weights (which transformers reads with torch.load) is tried too."""
    from typer.testing import CliRunner

    from qae_app.cli.main import app
    from qae_app.store.run_folder import list_checkpoints, write_manifest

    files = run_folder_files(sent_run / "r")
    assert "qae.duckdb" in files and any(f.endswith("policy.safetensors") for f in files)
    plants = [(name, None) for name in files] + [
        ("checkpoints/step-2/model/pytorch_model.bin", "checkpoints/step-2/model/model.safetensors")
    ]
    runner = CliRunner()
    control = tmp_path / "control"  # the untouched folder: every command works on it, so a refusal below is the plant's
    shutil.copytree(sent_run, control)
    for args in COMMANDS:
        result = runner.invoke(app, [*args, "--runs-dir", str(control)])
        assert result.exit_code == 0, (args, result.output)
    ran = []
    for i, (planted, removed) in enumerate(plants):
        runs_dir = tmp_path / f"case-{i}"
        shutil.copytree(sent_run, runs_dir)
        marker = tmp_path / f"ran-{i}"
        (runs_dir / "r" / planted).write_bytes(planted_pickle(marker))
        if removed:
            (runs_dir / "r" / removed).unlink()
        for checkpoint in list_checkpoints(runs_dir / "r"):
            write_manifest(checkpoint)
        for args in COMMANDS:
            runner.invoke(app, [*args, "--runs-dir", str(runs_dir)])
            if marker.exists():
                ran.append((planted, args))
                marker.unlink()
    assert ran == []


def test_a_run_file_cannot_make_duckdb_fetch_or_load_an_extension():
    """A view in a crafted qae.duckdb runs as SQL when qae reads the table it replaces; a view reading a URL would
    make DuckDB download and load httpfs (native code, network access; its default). On the connections qae attaches
    run files to, such SQL fails at once naming the missing extension, and nothing is fetched. (Tried here on the
    connection itself: a view naming a URL cannot be created on a machine without httpfs.)"""
    import duckdb

    from qae_app.store.run_file import run_file_database

    with run_file_database() as con:
        assert con.execute(
            "SELECT current_setting('autoinstall_known_extensions'), "
            "current_setting('autoload_known_extensions'), "
            "current_setting('allow_community_extensions')"
        ).fetchone() == (False, False, False)
        with pytest.raises(duckdb.Error, match="requires the extension httpfs to be loaded"):
            con.execute("SELECT * FROM read_csv('https://127.0.0.1:9/steps.csv')")
        assert not con.execute(
            "SELECT count(*) FROM duckdb_extensions() WHERE loaded AND extension_name = 'httpfs'"
        ).fetchone()[0]


def make_pre_release_folder(runs_dir: Path) -> dict:
    """Run 'r' of `runs_dir` as a pre-release left it: its checkpoint's training state as accelerate's pickled
    save_state (the scheduler registered as a custom object: custom_checkpoint_0.pkl) of the very state it held, its
    trainer state without the process count, its database without columns and a table added since, a setting this
    version has no option for. Returns what the checkpoint held, as this version reads it."""
    import json

    import duckdb
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from qae_app.models.lora import trainable_parameters
    from qae_app.models.policy import load_policy
    from qae_app.store.run_folder import write_manifest
    from qae_app.train.checkpoint_state import (
        OPTIMIZER_FILE,
        OPTIMIZER_TENSORS_FILE,
        POLICY_FILE,
        RNG_FILE,
        SCHEDULER_FILE,
        load_training_state,
    )
    from qae_app.train.optimizer import optimizer_and_schedule
    from qae_app.train.session import stored_config

    run_dir = runs_dir / "r"
    checkpoint = run_dir / "checkpoints" / "step-2"
    held = {
        "policy": load_file(str(checkpoint / POLICY_FILE)),
        "optimizer": load_file(str(checkpoint / OPTIMIZER_TENSORS_FILE)),
        **{
            name: json.loads((checkpoint / name).read_text())
            for name in (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE.format(process=0))
        },
    }
    cfg = stored_config(run_dir)
    model, _ = load_policy(str(checkpoint / "model"))
    optimizer, scheduler = optimizer_and_schedule(
        trainable_parameters(model), cfg.lr, cfg.weight_decay, cfg.warmup_steps
    )
    load_training_state(checkpoint, model, optimizer, scheduler, 0)  # (its random states too: what save_state saves)
    for name in (POLICY_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE.format(process=0)):
        (checkpoint / name).unlink()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.save_state(str(checkpoint))
    assert (checkpoint / "custom_checkpoint_0.pkl").exists() and (checkpoint / "random_states_0.pkl").exists()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["num_processes"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)
    with duckdb.connect(str(run_dir / "qae.duckdb")) as con:
        for table, column in (("rollouts", "correct"), ("groups", "model_prompt"), ("eval_samples", "answer")):
            con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        con.execute("DROP TABLE preview_k")
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "an_older_option": 1}))
    return held


@pytest.mark.slow
def test_a_folder_an_older_qae_wrote_is_refused_then_migrated_then_read_and_resumed(sent_run, tmp_path):
    """Readers and writers know one format: a pre-release's folder is refused by each, naming `qae migrate`;
    migrate refuses its pickles without --trust-pickles, changing nothing; with it, the folder is rewritten (the
    checkpoint's state exactly what it held), then read and resumed, and a second migrate finds nothing to do."""
    import json

    import torch
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from qae_app.cli.main import app
    from qae_app.store.reader import query
    from qae_app.store.run_folder import checkpoint_problem
    from qae_app.train.checkpoint_state import (
        OPTIMIZER_FILE,
        OPTIMIZER_TENSORS_FILE,
        POLICY_FILE,
        RNG_FILE,
        SCHEDULER_FILE,
        pickled_files,
    )

    runs_dir = tmp_path / "runs"
    shutil.copytree(sent_run, runs_dir)
    held = make_pre_release_folder(runs_dir)
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, [*args, "--runs-dir", str(runs_dir)])
        return result.exit_code, " ".join(result.output.split())

    for args in (["show", "r"], ["rollouts", "r", "--step", "2"], ["train", "--resume", "r", "--steps", "3"]):
        code, output = run(*args)
        assert code == 2 and "written by an older qae" in output and "qae migrate r" in output, (args, output)
    code, output = run("runs")
    assert code == 0 and "qae migrate r" in output, output  # listed, with what to do
    code, output = run("migrate", "r")
    assert code == 2 and "trust-pickles: run 'r' holds Python pickles" in output and "Nothing was changed" in output
    assert run("show", "r")[0] == 2 and (runs_dir / "r" / "checkpoints" / "step-2" / "custom_checkpoint_0.pkl").exists()

    code, output = run("migrate", "r", "--trust-pickles")
    assert code == 0, output
    for change in (
        "added the preview_k table",
        "added rollouts.correct (earlier rows: reward = 1)",
        "added groups.model_prompt",
        "dropped the setting an_older_option",
        "checkpoints/step-2: training state of 1 process(es) rewritten",
        "checkpoints/step-2: trainer_state.json says the run was trained by 1 process(es)",
    ):
        assert change in output, (change, output)
    checkpoint = runs_dir / "r" / "checkpoints" / "step-2"
    assert pickled_files(checkpoint) == [] and checkpoint_problem(checkpoint) is None
    for name, tensors in (
        ("policy", load_file(str(checkpoint / POLICY_FILE))),
        ("optimizer", load_file(str(checkpoint / OPTIMIZER_TENSORS_FILE))),
    ):
        assert tensors.keys() == held[name].keys()
        assert all(torch.equal(tensors[key], held[name][key]) for key in tensors), name
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE.format(process=0)):
        assert json.loads((checkpoint / name).read_text()) == held[name], name
    assert (
        query(
            runs_dir / "r" / "qae.duckdb",
            "SELECT count(*) AS n FROM rollouts WHERE correct IS DISTINCT FROM (reward = 1)",
        )["n"].item()
        == 0
    )

    assert run("show", "r")[0] == 0
    code, output = run("train", "--resume", "r", "--steps", "3")
    assert code == 0, output
    assert last_logged_step(runs_dir / "r") == 3
    assert (runs_dir / "r" / "checkpoints" / "step-3" / POLICY_FILE).exists()
    assert run("migrate", "r") == (0, "run r is in this version's format already: nothing to do")


# every call that can run code from a file it reads, and the only functions allowed to make one: both behind
# `qae migrate --trust-pickles`, for a folder an older qae wrote
UNPICKLING_CALLS = (
    "pickle.load",
    "Unpickler(",
    "torch.load",
    ".load_state(",
    "weights_only=False",
    "joblib.load",
    "dill.load",
)
TRUSTED_ONLY = {("format_migration.py", "convert_pickled_pending"), ("run_migration.py", "_convert_pickled_state")}


def test_nothing_unpickles_outside_the_trusted_legacy_path():
    """Whatever a command or a dashboard page reads goes through code that cannot run what it reads: the project's
    only unpickling calls sit in the two functions `qae migrate --trust-pickles` runs (checked by the tests above)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    found = set()
    for path in [*(root / "qae_app").rglob("*.py"), *(root / "dashboard").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    call = ast.unparse(node)
                    if any(pattern in call for pattern in UNPICKLING_CALLS):
                        found.add((path.name, function.name))
        for statement in tree.body:  # calls at import time
            if not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                calls = [ast.unparse(n) for n in ast.walk(statement) if isinstance(n, ast.Call)]
                assert not [c for c in calls if any(p in c for p in UNPICKLING_CALLS)], path
    assert found == TRUSTED_ONLY


def test_every_dashboard_page_on_a_folder_of_payloads_runs_none(sent_run, tmp_path, monkeypatch):
    """Every file of a run folder replaced by a payload at once (the database too): each page shows what it can and
    runs nothing."""
    from tests.dashboard.helpers import make_app

    runs_dir = tmp_path / "runs"
    shutil.copytree(sent_run, runs_dir)
    marker = tmp_path / "ran"
    for name in run_folder_files(runs_dir / "r"):
        (runs_dir / "r" / name).write_bytes(planted_pickle(marker))
    run_page = make_app(runs_dir, monkeypatch)
    for view in (None, "curves", "distributions", "rollouts", "prompts", "evals", "eval_samples", "compare"):
        page = run_page(view, run="r")
        assert not page.exception, (view, page.exception)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# sharded checkpoints (FSDP2): each process's slices, as safetensors and JSON


def test_no_module_uses_torch_distributed_checkpoint():
    """torch.distributed.checkpoint writes its plan as a pickle (`.metadata`, torch.save) and unpickles it on load:
    sharded checkpoints are each process's safetensors and a JSON layout instead (checkpoint_state)."""
    import ast

    root = Path(__file__).resolve().parents[2]
    for path in [*(root / "qae_app").rglob("*.py"), *(root / "dashboard").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not [n for n in names if n.startswith("torch.distributed.checkpoint")], path


@pytest.mark.slow
def test_a_payload_planted_in_a_sharded_checkpoint_never_runs(tmp_path):
    """A 2-process FSDP2 run (accelerate launch, gloo): its checkpoint holds no pickle (nothing DCP's `.metadata`
    would be); each of its per-process files replaced by a pickle payload (the manifest rewritten to match), a
    sharded resume passes over the checkpoint naming the file, once, is left with none, says so once, and runs
    nothing."""
    import os

    from qae_app.store.run_folder import write_manifest
    from qae_app.train.checkpoint_state import pickled_files

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    config = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "fsdp2.yaml"

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                accelerate,
                "launch",
                "--config_file",
                str(config),
                "--num_processes",
                "2",
                *ONE_MACHINE,
                "-m",
                "qae_app.cli",
                "train",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, COLUMNS="300"),
        )

    runs_dir = tmp_path / "runs"
    made = launch(
        "--run-name",
        "r",
        "--runs-dir",
        str(runs_dir),
        "--steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--eval-every",
        "0",
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    checkpoint = runs_dir / "r" / "checkpoints" / "step-1"
    assert (checkpoint / "rank-1.safetensors").exists()
    assert pickled_files(checkpoint) == [] and not list(checkpoint.rglob("*.distcp"))
    assert not list(checkpoint.rglob(".metadata"))
    for i, planted in enumerate(("rank-0.json", "rank-1.safetensors", "optimizer.json")):
        case = tmp_path / f"case-{i}"
        shutil.copytree(runs_dir, case)
        marker = tmp_path / f"ran-{i}"
        (case / "r" / "checkpoints" / "step-1" / planted).write_bytes(planted_pickle(marker))
        write_manifest(case / "r" / "checkpoints" / "step-1")
        resumed = launch("--resume", "r", "--runs-dir", str(case), "--steps", "2")
        output = " ".join((resumed.stdout + resumed.stderr).split())
        assert not marker.exists(), planted
        assert resumed.returncode != 0
        assert output.count(f"skipping checkpoint step-1: {planted} is not") == 1, output[-3000:]
        assert output.count("error:") == 1 and "no checkpoint of run 'r' checks out" in output, output[-3000:]
