"""Bad input that is not a row of a bad-value table (those are each folder's test_bad_input.py, with their check in
tests/bad_input.py): a runs dir no command can use, a huge string in a TOML file, damaged run files, databases and
configs that every command names, an eval run called one, and the bad values `qae warmstart` refuses before training.
Run in-process with typer's CliRunner.

The cases that are not refusals (a lone surrogate in a data file loads and trains; a damaged run file is listed as
unreadable) have their own tests below; a full disk is tested in test_store.py.
"""

import re

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import query, read_run
from qae_app.store.run_folder import db_path
from qae_app.store.writer import RunWriter
from tests.bad_input import HUGE

runner = CliRunner()


@pytest.mark.parametrize("command", [["train"], ["sweep"], ["eval"], ["runs"], ["show", "r"]])
def test_a_runs_dir_with_a_name_over_255_bytes_is_refused(tmp_path, command):
    """`Errno 36` tracebacks: a path component longer than the file system allows."""
    runs = tmp_path / ("r" * 300)
    result = runner.invoke(app, [*command, "--runs-dir", str(runs)])
    output = "".join(result.output.replace("│", "").split())
    assert result.exit_code == 2, result.output
    assert "hasanameover255bytes" in output and "r" * 80 + "…(300characters)" in output, result.output
    assert "Traceback" not in output and not isinstance(result.exception, OSError)


@pytest.mark.parametrize("key", ["estimator", "run_name", "k", "data", "model", "quantile"])
def test_a_huge_string_in_a_toml_file_is_echoed_capped(tmp_path, key):
    """A 10 MB string in a TOML file was echoed whole to stderr."""
    (tmp_path / "huge.toml").write_text(f'{key} = "{"x" * 10_000_000}"\n')
    result = runner.invoke(
        app, ["train", "--config", str(tmp_path / "huge.toml"), "--runs-dir", str(tmp_path / "runs")]
    )
    assert result.exit_code == 2, result.output[:2000]
    assert len(result.output) < 3000, result.output[:2000]
    assert re.search(r"x…\(10,000,00\dcharacters\)", "".join(result.output.split())), result.output  # (quotes too)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*"))


# ---------------------------------------------------------------------------------------------------------------
# inputs that are not refusals


def test_a_toml_file_with_a_utf8_bom_is_read(tmp_path):
    """A BOM (Windows editors write one) was a bare syntax error at line 1."""
    (tmp_path / "bom.toml").write_bytes("\ufeff# a comment\nsteps = 3\ngroup-size = 4\n".encode())
    from qae_app.config import build_config

    cfg = build_config(tmp_path / "bom.toml")
    assert (cfg.steps, cfg.group_size) == (3, 4)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"dynamic_sampling": True, "filter_metric": "correct", "max_gen_batches": 3},
        {"overlong_buffer": 2, "overlong_penalty": 0.5, "max_new_tokens": 8},
        {"dynamic_sampling": False},
        {"overlong_buffer": 0},
    ],
)
def test_options_that_need_a_switch_are_taken_with_it_and_their_defaults_never_trigger(options):
    from qae_app.config import build_config

    cfg = build_config(**options)
    assert all(getattr(cfg, name) == value for name, value in options.items())


@pytest.mark.slow
def test_a_lone_surrogate_in_a_data_file_is_stored_as_a_replacement_character(tmp_path):
    data = tmp_path / "surrogate.jsonl"
    data.write_text('{"problem": "What is 1+1? \\ud800", "answer": "2", "id": "p\\udfff"}\n')
    result = runner.invoke(
        app,
        [
            "train",
            "--data",
            str(data),
            "--steps",
            "1",
            "--prompts-per-step",
            "1",
            "--group-size",
            "2",
            "--num-mini-batches",
            "1",
            "--eval-every",
            "0",
            "--max-new-tokens",
            "4",
            "--run-name",
            "s",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
    )
    assert result.exit_code == 0, result.output
    groups = query(db_path(tmp_path / "runs", "s"), "SELECT prompt_id, prompt FROM groups")
    assert groups["prompt_id"].tolist() == ["p\ufffd"]
    assert groups["prompt"].iloc[0].startswith("What is 1+1? \ufffd")
    assert read_run(db_path(tmp_path / "runs", "s"))["status"] == "finished"


@pytest.mark.slow
def test_the_default_eval_every_on_data_without_a_held_out_split_says_so_once(tmp_path):
    """--eval-every 25 (the default) on a data file with nothing held out evaluated nothing and said nothing; given
    explicitly it is refused (the table above)."""
    data = tmp_path / "one.jsonl"
    data.write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    result = runner.invoke(
        app,
        [
            "train",
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts-per-step",
            "1",
            "--group-size",
            "2",
            "--num-mini-batches",
            "1",
            "--max-new-tokens",
            "4",
            "--run-name",
            "n",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert output.count("note: nothing to evaluate every 25 steps: ") == 1, output
    assert "--heldout-fraction 0.1 or --eval-bench FILE" in output


def test_a_damaged_run_file_is_named_by_every_command(tmp_path):
    runs = tmp_path / "runs"
    writer = RunWriter(db_path(runs, "broken"), "broken")
    writer.create_run("broken", {}, "qae", 0.4, "builtin:tiny", "arith", 0)
    path = db_path(runs, "broken")
    path.write_bytes(b"\0" * 4096 + path.read_bytes()[4096:])  # the header gone
    for args in (["show", "broken"], ["rollouts", "broken"]):
        result = runner.invoke(app, [*args, "--runs-dir", str(runs)])
        output = "".join(result.output.split())  # the console wraps the long path anywhere
        assert result.exit_code == 2, result.output
        assert f"cannotread{path}:IOError" in output and "notavalidDuckDBdatabasefile" in output
        assert "Therunhasnocheckpointtorecoveramodelfrom" in output
    result = runner.invoke(app, ["runs", "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    output = "".join(result.output.split())
    assert f"unreadable:broken:run:cannotread{path}" in output  # listed, with the reason under the table


@pytest.mark.parametrize(
    "command", [["runs"], ["show", "r"], ["rollouts", "r"], ["compare", "r"], ["train"], ["eval"], ["dashboard"]]
)
def test_a_runs_dir_that_is_a_file_is_refused_by_every_command(tmp_path, command):
    (tmp_path / "f").write_text("x")
    result = runner.invoke(app, [*command, "--runs-dir", str(tmp_path / "f")])
    assert result.exit_code == 2, result.output
    assert "isafile,notafolder" in "".join(result.output.replace("│", "").split())  # typer boxes and wraps it
    assert (tmp_path / "f").read_text() == "x"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real two-step run with a checkpoint per step (its database spans several blocks)."""
    runs = tmp_path_factory.mktemp("damaged") / "runs"
    result = runner.invoke(
        app,
        [
            "train",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--checkpoint-every",
            "1",
            "--run-name",
            "base",
            "--runs-dir",
            str(runs),
        ],
    )
    assert result.exit_code == 0, result.output
    return runs


def _damaged_copies(runs, tmp_path):
    """runs/base copied twice under tmp_path: `trunc` with its database cut in half, `notables` whose database is a
    valid DuckDB file without qae's tables (another program's, or one emptied)."""
    import shutil

    import duckdb

    copies = tmp_path / "runs"
    for name in ("trunc", "notables"):
        shutil.copytree(runs / "base", copies / name)
    path = db_path(copies, "trunc")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    db_path(copies, "notables").unlink()
    duckdb.connect(str(db_path(copies, "notables"))).close()
    return copies


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--resume", "{run}", "--steps", "3"],
        ["eval", "--model", "{run}", "--limit", "2", "--samples", "1"],
        ["show", "{run}"],
        ["rollouts", "{run}"],
        ["compare", "{run}"],
    ],
)
@pytest.mark.parametrize("run", ["trunc", "notables"])
def test_a_damaged_database_in_a_copied_run_is_named_by_every_command(trained_run, tmp_path, command, run):
    """A truncated file in a copied folder failed while the writer renamed the stored run id, and the aborted
    transaction's error hid the cause (a traceback); a DuckDB file without qae's tables gave a CatalogException
    traceback and was listed as held by another process."""
    runs = _damaged_copies(trained_run, tmp_path)
    path = db_path(runs, run)
    before = path.read_bytes()
    result = runner.invoke(app, [*(part.format(run=run) for part in command), "--runs-dir", str(runs)])
    output = "".join(result.output.replace("│", "").split())
    assert result.exit_code == 2, result.output
    assert f"cannotread{path}:" in output, result.output
    reasons = ("Couldnotreadenoughbytes", "shorterthanthe") if run == "trunc" else ("isnotaqaerundatabase(ithasno",)
    assert any(reason in output for reason in reasons), result.output
    assert "eval" not in command or "evalarith" not in output  # refused before evaluating, not after
    assert "checkpoints(step-1,step-2)" in output
    assert path.read_bytes() == before  # refused, not repaired or overwritten


def test_runs_lists_a_database_without_tables_as_unreadable_not_busy(trained_run, tmp_path):
    runs = _damaged_copies(trained_run, tmp_path)
    result = runner.invoke(app, ["runs", "--runs-dir", str(runs)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "notables unreadable" in output and "trunc unreadable" in output and "held by another process" not in output
    assert "is not a qae run database" in output


def test_eval_run_name_refuses_what_is_left_of_a_training_run(trained_run, tmp_path):
    """A run folder whose database was moved aside (as the unreadable-file message advises) still holds the run's
    checkpoints and config: `qae eval --run-name` used to make an eval database there, which a resume then continued
    as if it were the run's own."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(trained_run / "base", runs / "nodb")
    db_path(runs, "nodb").rename(tmp_path / "aside.duckdb")
    result = runner.invoke(
        app, ["eval", "--run-name", "nodb", "--limit", "2", "--samples", "1", "--runs-dir", str(runs)]
    )
    assert result.exit_code == 2, result.output
    assert "run-name: 'nodb' already exists" in " ".join(result.output.split())
    assert not db_path(runs, "nodb").exists()


TRAIN_RESUME = ["train", "--resume", "cfg", "--steps", "3"]
SWEEP_RESUME = ["sweep", "--name", "cfg"]  # its first point is the damaged run (a sweep reads only its sweep id)


@pytest.mark.parametrize(
    "content, reason, command",
    [
        ("{oops", "isnotvalidJSON", TRAIN_RESUME),
        ("", "isnotvalidJSON", TRAIN_RESUME),
        ("[1, 2]", "isnotaJSONobject", TRAIN_RESUME),
        ('{"group_size": "x"}', "'group_size'='x'isastr", TRAIN_RESUME),
        ('{"steps": -4}', "holdsabadvalue:steps:-4", TRAIN_RESUME),
        ('{"steps": null}', "'steps'=null", TRAIN_RESUME),
        ("{oops", "isnotvalidJSON", SWEEP_RESUME),
        ("[1, 2]", "isnotaJSONobject", SWEEP_RESUME),
    ],
)
def test_a_damaged_config_json_is_named_on_resume(trained_run, tmp_path, content, reason, command):
    """A run's config.json edited by hand or damaged: a traceback (JSONDecodeError, TypeError, AttributeError) on
    resume; now the file, what is wrong with it and what to do."""
    import shutil

    runs = tmp_path / "runs"
    if command[0] == "sweep":  # the sweep's first point is the damaged run
        shutil.copytree(trained_run / "base", runs / "cfg-qae-k0.4-s0")
        config = runs / "cfg-qae-k0.4-s0" / "config.json"
    else:
        shutil.copytree(trained_run / "base", runs / "cfg")
        config = runs / "cfg" / "config.json"
    before = db_path(runs, config.parent.name).read_bytes()
    config.write_text(content)
    result = runner.invoke(app, [*command, "--runs-dir", str(runs)])
    output = "".join(result.output.replace("│", "").split())
    assert result.exit_code == 2, result.output
    assert f"{config}" in output and reason in output, result.output
    assert "Restoreitfromabackup" in output and "qaeshow" in output, result.output
    assert output.count("Restoreitfromabackup") == 1, result.output  # said once, not once per layer it passed
    assert config.read_text() == content and db_path(runs, config.parent.name).read_bytes() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", HUGE], f"seed: {HUGE}"),
        (["--seed", "-1"], "seed: -1"),
        (["--out", "{file}"], "out: {file} is a file, not a folder"),
    ],
)
def test_warmstart_refuses_bad_values_before_training(tmp_path, args, message):
    """A bad --out was found only when saving, after the training (a FileExistsError traceback); a seed too large
    for torch gave a traceback; a negative one was taken although `qae train` refuses it."""
    (tmp_path / "afile").write_text("x")
    args = [arg.format(file=tmp_path / "afile") for arg in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    result = runner.invoke(app, ["warmstart", "--steps", "1", *args, *out])
    assert result.exit_code == 2, result.output
    assert "".join(message.format(file=tmp_path / "afile").split()) in "".join(result.output.split()), result.output
    assert "warm start" not in result.output and "loss" not in result.output  # refused before any training step
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("evalrun") / "runs"
    result = runner.invoke(app, ["eval", "--run-name", "ev", "--limit", "2", "--samples", "1", "--runs-dir", str(runs)])
    assert result.exit_code == 0, result.output
    return runs


@pytest.mark.parametrize(
    "command, message",
    [
        (["train", "--run-name", "ev", "--steps", "1"], "run-name: 'ev' is an eval run (qae eval)"),
        (["train", "--resume", "ev", "--steps", "1"], "resume: 'ev' is an eval run (qae eval)"),
        (["eval", "--model", "ev", "--limit", "1", "--samples", "1"], "model: 'ev' is an eval run (qae eval)"),
    ],
)
def test_an_eval_run_is_called_one(eval_run, command, message):
    """An eval run's folder holds results, not a model or a training config: `train --run-name` advised --resume,
    which then said 'no run ev (runs there: ev)'; `eval --model` advised waiting for checkpoints."""
    before = db_path(eval_run, "ev").read_bytes()
    result = runner.invoke(app, [*command, "--runs-dir", str(eval_run)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert message in output and "--resume ev" not in output and "checkpoint-every" not in output, result.output
    assert db_path(eval_run, "ev").read_bytes() == before


def test_resume_refuses_another_run_name(trained_run, tmp_path):
    """`--resume base --run-name other` trained base and ignored the name the user gave."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(trained_run / "base", runs / "base")
    result = runner.invoke(
        app, ["train", "--resume", "base", "--run-name", "other", "--steps", "3", "--runs-dir", str(runs)]
    )
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "run-name: 'other' is not the run --resume continues ('base')" in output, result.output
    assert read_run(db_path(runs, "base"))["last_step"] == 2 and not (runs / "other").exists()


def test_a_run_whose_database_is_missing_is_listed_and_named(trained_run, tmp_path):
    """A training run's folder whose qae.duckdb was deleted or moved aside (as the unreadable-file message advises):
    `qae runs` left it out and `qae show` said there was no such run, while `qae train --run-name` said it existed."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(trained_run / "base", runs / "nodb")
    shutil.copytree(trained_run / "base", runs / "fine")
    db_path(runs, "nodb").unlink()
    result = runner.invoke(app, ["runs", "--runs-dir", str(runs)], env={"COLUMNS": "200"})
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "nodb unreadable" in output and "fine " in output, result.output
    assert f"cannotread{db_path(runs, 'nodb')}:thefileismissing" in "".join(result.output.split())
    for command in (["show", "nodb"], ["rollouts", "nodb"]):
        result = runner.invoke(app, [*command, "--runs-dir", str(runs)])
        output = "".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert f"cannotread{db_path(runs, 'nodb')}:thefileismissing" in output, result.output
        assert "checkpoints(step-1,step-2)" in output and "Movethefileaside" not in output
