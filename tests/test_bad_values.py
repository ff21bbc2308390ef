"""Every bad value of issue 10, from the command line, a TOML file or a data file: one message that names the option
(or file) and the value, exit code 2, and nothing written in the runs folder. Run in-process with typer's CliRunner.

The cases that are not refusals (a lone surrogate in a data file loads and trains; a damaged run file is listed as
unreadable) have their own tests below the table; a full disk is tested in test_store.py.
"""

import json
import re

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.sweep import MAX_SWEEP_RUNS
from qae_app.store.reader import query, read_run
from qae_app.store.run_folder import db_path
from qae_app.store.writer import RunWriter

runner = CliRunner()
HUGE = "1" + "0" * 30  # an integer no 32-bit column, seed or tensor size can hold


def _files(d):
    """The bad files the table refers to as {d}/name."""
    toml = {"seed_big": "seed = 2147483648", "seed_negative": "seed = -1", "kl_nan": "kl_beta = nan",
            "lr_inf": "lr = inf", "lr_huge_int": "lr = " + "9" * 400, "wd_inf": "weight_decay = inf",
            "temperature_tiny": "temperature = 1e-300", "timeout_nan": "verify_timeout_s = nan",
            "timeout_inf": "verify_timeout_s = inf", "mini_batches_huge": f"num_mini_batches = {10 ** 18}",
            "micro_float": "micro_batch_size = 1e30", "deep": "a = " + "[" * 100_000 + "]" * 100_000}
    for name, body in toml.items():
        (d / f"{name}.toml").write_text(body + "\n")
    (d / "number_question.jsonl").write_text('{"question": 5, "answer": 3}\n')
    (d / "zero_steps.toml").write_text("[run]\nsteps = 0\n")
    (d / "twice.toml").write_text("[run]\nsteps = 2\n[optim]\nsteps = 0\n")  # sections are for reading only
    (d / "utf16.toml").write_text("steps = 2\n", encoding="utf-16")
    (d / "binary.toml").write_bytes(bytes(range(256)))
    (d / "folder.toml").mkdir()
    (d / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (d / "utf16.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n', encoding="utf-16")
    (d / "deep.jsonl").write_text('{"problem": "x", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    (d / "bigint.jsonl").write_text('{"problem": "What is 7 repeated?", "answer": ' + "7" * 5000 + "}\n")
    (d / "bigint_text.jsonl").write_text('{"problem": "What is 7 repeated?", "answer": "' + "7" * 5000 + '"}\n')
    (d / "big_prompt.jsonl").write_text(json.dumps({"problem": "1" * 1_000_000, "answer": "2"}) + "\n")
    (d / "folder.jsonl").mkdir()
    # issue 28
    (d / "both_spellings.toml").write_text("group-size = 4\ngroup_size = 8\n")
    (d / "bom.toml").write_bytes("\ufeffsteps = 0\n".encode())  # the BOM is read past: the next error is the value's
    (d / "nan_answer.jsonl").write_text('{"problem": "1+1?", "answer": 2}\n{"problem": "0/0?", "answer": NaN}\n')
    (d / "inf_answer.jsonl").write_text('{"problem": "1/0?", "answer": Infinity}\n')
    (d / "no_heldout.jsonl").write_text('{"problem": "1+1?", "answer": 2}\n')
    return d


# (command line, what the message must contain: the option or file, and the value)
BAD_VALUES = [
    # numbers on the command line: finite, and in a sane range
    (["train", "--seed", "2147483648"], "seed: 2147483648 is more than 2,147,483,647"),
    (["train", "--seed", "-1"], "seed: -1 is less than 0"),
    # typer refuses a non-integer before our checks; its message names the option but does not repeat the value
    (["train", "--num-mini-batches", "1e30"], "Invalid value for '--num-mini-batches': Input should be a valid"),
    (["train", "--num-mini-batches", HUGE], f"num-mini-batches: {HUGE} is more than the 128 responses of a step"),
    (["train", "--micro-batch-size", "1e30"], "Invalid value for '--micro-batch-size': Input should be a valid"),
    (["train", "--micro-batch-size", HUGE], f"micro-batch-size: {HUGE} is more than 2,147,483,647"),
    (["train", "--steps", HUGE], f"steps: {HUGE} is more than 2,147,483,647"),
    (["train", "--clip-high", "1e308"], "clip-high: 1e+308 is more than 10.0"),
    (["train", "--clip-low", "nan"], "clip-low: nan is not a finite number"),
    (["train", "--clip-low", "1"], "clip-low: 1.0 must be less than 1.0. Use 0 <= clip-low < 1"),  # the bound excluded
    (["train", "--kl-beta", "inf"], "kl-beta: inf is not a finite number"),
    (["train", "--kl-beta", "nan"], "kl-beta: nan is not a finite number"),
    (["train", "--kl-beta", "1e6"], "kl-beta: 1000000.0 is more than 10.0"),
    (["train", "--lr", "inf"], "lr: inf is not a finite number"),
    (["train", "--lr", "nan"], "lr: nan is not a finite number"),
    (["train", "--lr", "10"], "lr: 10.0 is more than 1.0"),
    (["train", "--weight-decay", "inf"], "weight-decay: inf is not a finite number"),
    (["train", "--weight-decay", "nan"], "weight-decay: nan is not a finite number"),
    (["train", "--max-grad-norm", "inf"], "max-grad-norm: inf is not a finite number"),
    (["train", "--temperature", "1e-300"], "temperature: 1e-300 is less than 0.01"),
    (["train", "--temperature", "inf"], "temperature: inf is not a finite number"),
    (["train", "--verify-timeout-s", "nan"], "verify-timeout-s: nan is not a finite number"),
    (["train", "--verify-timeout-s", "inf"], "verify-timeout-s: inf is not a finite number"),
    (["train", "--verify-timeout-s", "1e9"], "verify-timeout-s: 1000000000.0 is more than 3,600.0"),
    (["train", "--entropy-low", "nan"], "entropy-low: nan is not a finite number"),
    (["train", "--heldout-fraction", "nan"], "heldout-fraction: nan is not a finite number"),
    (["train", "--heldout-fraction", "1"], "heldout-fraction: 1.0 must be less than 1.0. Use a fraction in [0, 1)"),
    (["train", "--k", "nan"], "k: nan is outside (0, 1)"),
    (["train", "--eval-limit", "0"], "eval-limit: 0"),
    # the same from a TOML file, and TOML files that are not TOML
    (["train", "--config", "{d}/seed_big.toml"], "seed: 2147483648 is more than 2,147,483,647"),
    (["train", "--config", "{d}/seed_negative.toml"], "seed: -1 is less than 0"),
    (["train", "--config", "{d}/kl_nan.toml"], "kl-beta: nan is not a finite number"),
    (["train", "--config", "{d}/lr_inf.toml"], "lr: inf is not a finite number"),
    (["train", "--config", "{d}/lr_huge_int.toml"], "'lr' = 999"),
    (["train", "--config", "{d}/wd_inf.toml"], "weight-decay: inf is not a finite number"),
    (["train", "--config", "{d}/temperature_tiny.toml"], "temperature: 1e-300 is less than 0.01"),
    (["train", "--config", "{d}/timeout_nan.toml"], "verify-timeout-s: nan is not a finite number"),
    (["train", "--config", "{d}/timeout_inf.toml"], "verify-timeout-s: inf is not a finite number"),
    (["train", "--config", "{d}/mini_batches_huge.toml"], f"num-mini-batches: {10 ** 18} is more than the 128"),
    (["train", "--config", "{d}/micro_float.toml"], "'micro_batch_size' = 1e+30 is a float, expected int"),
    (["train", "--config", "{d}/utf16.toml"], "utf16.toml is UTF-16 (or UTF-32) text; TOML must be UTF-8"),
    (["train", "--config", "{d}/binary.toml"], "binary.toml is not UTF-8 text (byte 0x80 at offset 128)"),
    (["train", "--config", "{d}/folder.toml"], "folder.toml is a directory, not a file"),
    (["train", "--config", "{d}/deep.toml"], "deep.toml nests arrays or tables too deeply to parse"),
    # data files
    (["train", "--data", "{d}/binary.jsonl"], "binary.jsonl' is not UTF-8 text (byte 0x80 at line 2, offset 128)"),
    (["train", "--data", "{d}/utf16.jsonl"], "utf16.jsonl' is UTF-16 text; JSONL must be UTF-8"),
    (["train", "--data", "{d}/deep.jsonl"], "deep.jsonl' line 1 nests JSON arrays or objects too deeply"),
    (["train", "--data", "{d}/bigint.jsonl"], "bigint.jsonl' line 1 has a 5,000-character answer (7777"),
    (["train", "--data", "{d}/bigint_text.jsonl"], "bigint_text.jsonl' line 1 has a 5,000-character answer (7777"),
    (["train", "--data", "{d}/folder.jsonl"], "folder.jsonl' is a directory"),
    (["train", "--data", "{d}/big_prompt.jsonl"], "data: prompt 'big_prompt-1' is 1,000,073 tokens, and with "
                                                  "--max-new-tokens 8 it needs 1,000,081 positions, but the model's "
                                                  "context is 128"),
    # issue 28: sizes bounded before any work
    (["sweep", "--seeds", "1000000"], f"seeds: 1000000 makes 1,000,000 runs, more than the {MAX_SWEEP_RUNS}"),
    (["sweep", "--seeds", HUGE], f"seeds: {HUGE} makes"),
    (["sweep", "--estimator", "qae,grpo", "--k", "0.1,0.2,0.3", "--seeds", "200"], "seeds: 200 makes 800 runs"),
    (["train", "--group-size", "1000000"], "group-size x prompts-per-step: 1,000,000 x 8 = 8,000,000 responses"),
    (["train", "--prompts-per-step", "1000000"], "group-size x prompts-per-step: 16 x 1,000,000 = 16,000,000"),
    (["sweep", "--group-size", "1000000"], "group-size x prompts-per-step: 1,000,000 x 8"),
    # issue 28: nonsense that was accepted silently
    (["sweep", "--k", "0.4,0.40"], "k: '0.4,0.40' gives the same K twice (0.4 and 0.40)"),
    (["sweep", "--name", ""], "name: '' is not a plain name"),
    (["train", "--filter-metric", "correct"], "filter-metric: correct acts only with --dynamic-sampling"),
    (["train", "--max-gen-batches", "3"], "max-gen-batches: 3 acts only with --dynamic-sampling"),
    (["train", "--overlong-penalty", "2"], "overlong-penalty: 2.0 acts only with --overlong-buffer"),
    (["sweep", "--max-gen-batches", "3"], "max-gen-batches: 3 acts only with --dynamic-sampling"),
    (["train", "--entropy-high", "0"], "entropy-high: 0.0 must be more than 0.0"),
    (["train", "--entropy-low", "1e308"], "entropy-low: 1e+308 is more than 20.0"),
    (["train", "--entropy-low", "-1"], "entropy-low: -1.0 is less than 0.0"),
    (["train", "--entropy-low", "2", "--entropy-high", "2"], "entropy-low / entropy-high: 2.0 / 2.0"),
    (["train", "--data", "{d}/no_heldout.jsonl", "--eval-every", "1"], "eval-every: 1, but"),
    (["train", "--config", "{d}/both_spellings.toml"], "config: 'group_size' is set twice in {d}/both_spellings.toml "
                                                       "(group-size = 4, group_size = 8)"),
    (["train", "--config", "{d}/bom.toml"], "steps: 0 is less than 1"),
    (["train", "--data", "{d}/nan_answer.jsonl"], "nan_answer.jsonl' line 2 gives its answer as NaN"),
    (["train", "--data", "{d}/inf_answer.jsonl"], "inf_answer.jsonl' line 1 gives its answer as Infinity"),
    (["train", "--config", "/dev/zero"], "config: /dev/zero is not a regular file"),
    (["train", "--data", "{d}/" + "x" * 300 + ".jsonl"], "a name over 255 bytes, longer than the file system"),
    (["train", "--config", "{d}/" + "c" * 300 + ".toml"], "a name over 255 bytes, longer than the file system"),
    # the inspecting commands
    (["show", "some-run", "--every", "1e30"], "Invalid value for '--every': Input should be a valid integer"),
    (["show", "some-run", "--every", "-1"], "every: -1 is negative. Use 0"),
    (["rollouts", "some-run", "--limit", "-1"], "limit: -1 shows nothing. Use a positive number of responses"),
    (["rollouts", "some-run", "--limit", "0"], "limit: 0 shows nothing. Use a positive number of responses"),
    # qae eval shares the training options' ranges
    (["eval", "--temperature", "1e-300"], "temperature: 1e-300 is less than 0.01"),
    (["eval", "--verify-timeout-s", "nan"], "verify-timeout-s: nan is not a finite number"),
    (["eval", "--verify-timeout-s", "inf"], "verify-timeout-s: inf is not a finite number"),
    (["eval", "--seed", "-1"], "seed: -1 is less than 0"),
    (["eval", "--samples", HUGE], f"samples: {HUGE} is more than 2,147,483,647"),
    # each message names the option the user gave, with an example of its own kind
    (["train", "--eval-bench", "nofile.jsonl"], "eval-bench: 'nofile.jsonl' is neither a built-in task"),
    (["eval", "--bench", "nofile.jsonl"], "bench: 'nofile.jsonl' is neither a built-in task"),
    (["train", "--data", "nofile.jsonl"], "data: 'nofile.jsonl' is neither a built-in task"),
    (["sweep", "--name", "a/b"], "error: name: 'a/b' is not a plain name"),
    (["sweep", "--k", ","], "k: ',' names nothing. Give a comma-separated list, e.g. 0.3,0.4"),
    (["sweep", "--estimator", ","], "estimator: ',' names nothing. Give a comma-separated list, e.g. qae,grpo"),
    (["sweep", "--parallel", "0"], "parallel: 0. Use 1 to"),
    (["train", "--config", "{d}/zero_steps.toml"], "steps: 0 is less than 1, the least it may be. Use a positive "
                                                   "integer (set in {d}/zero_steps.toml)."),
    (["train", "--data", "{d}/number_question.jsonl"], "line 1 gives its question as a number (question = 5), not text"),
    (["train", "--config", "{d}/twice.toml"], "config: 'steps' is set twice in {d}/twice.toml ([run] steps = 2, "
                                              "[optim] steps = 0)"),
    (["eval", "--bench", "{d}/binary.jsonl"], "bench: '{d}/binary.jsonl' is not UTF-8 text"),  # the file's error too
    (["train", "--eval-bench", "{d}/binary.jsonl"], "eval-bench: '{d}/binary.jsonl' is not UTF-8 text"),
    # a RUN argument is named as such, not as --run-name
    (["show", "../base"], "error: run: '../base' is not a plain name"),
    (["rollouts", "../base"], "error: run: '../base' is not a plain name"),
    (["compare", "../base"], "error: run: '../base' is not a plain name"),
]


@pytest.mark.parametrize("args, message", BAD_VALUES, ids=[" ".join(a)[:60] for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    d = _files(tmp_path)
    runs = tmp_path / "runs"
    result = runner.invoke(app, [*[a.format(d=d) for a in args], "--runs-dir", str(runs)])
    output = "".join(result.output.split())  # the console wraps long paths anywhere, so compare without spaces
    assert result.exit_code == 2, result.output
    assert "".join(message.format(d=d).split()) in output, result.output
    assert "Traceback" not in output and not isinstance(result.exception, (ValueError, RuntimeError, OSError))
    assert "qaesweep" not in output  # a sweep refused says so before announcing its runs
    assert not runs.exists() or not any(runs.rglob("*"))  # refused before anything was written


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
    result = runner.invoke(app, ["train", "--config", str(tmp_path / "huge.toml"), "--runs-dir",
                                 str(tmp_path / "runs")])
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


@pytest.mark.parametrize("options", [{}, {"dynamic_sampling": True, "filter_metric": "correct", "max_gen_batches": 3},
                                     {"overlong_buffer": 2, "overlong_penalty": 0.5, "max_new_tokens": 8},
                                     {"dynamic_sampling": False}, {"overlong_buffer": 0}])
def test_options_that_need_a_switch_are_taken_with_it_and_their_defaults_never_trigger(options):
    from qae_app.config import build_config

    cfg = build_config(**options)
    assert all(getattr(cfg, name) == value for name, value in options.items())


@pytest.mark.slow
def test_a_lone_surrogate_in_a_data_file_is_stored_as_a_replacement_character(tmp_path):
    data = tmp_path / "surrogate.jsonl"
    data.write_text('{"problem": "What is 1+1? \\ud800", "answer": "2", "id": "p\\udfff"}\n')
    result = runner.invoke(app, ["train", "--data", str(data), "--steps", "1", "--prompts-per-step", "1",
                                 "--group-size", "2", "--num-mini-batches", "1", "--eval-every", "0",
                                 "--max-new-tokens", "4",
                                 "--run-name", "s", "--runs-dir", str(tmp_path / "runs")])
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
    result = runner.invoke(app, ["train", "--data", str(data), "--steps", "2", "--prompts-per-step", "1",
                                 "--group-size", "2", "--num-mini-batches", "1", "--max-new-tokens", "4",
                                 "--run-name", "n", "--runs-dir", str(tmp_path / "runs")])
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


@pytest.mark.parametrize("command", [["runs"], ["show", "r"], ["rollouts", "r"], ["compare", "r"], ["train"],
                                     ["eval"], ["dashboard"]])
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
    result = runner.invoke(app, ["train", "--steps", "2", "--eval-every", "0", "--checkpoint-every", "1",
                                 "--run-name", "base", "--runs-dir", str(runs)])
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


@pytest.mark.parametrize("command", [["train", "--resume", "{run}", "--steps", "3"],
                                     ["eval", "--model", "{run}", "--limit", "2", "--samples", "1"],
                                     ["show", "{run}"], ["rollouts", "{run}"], ["compare", "{run}"]])
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
    result = runner.invoke(app, ["eval", "--run-name", "nodb", "--limit", "2", "--samples", "1",
                                 "--runs-dir", str(runs)])
    assert result.exit_code == 2, result.output
    assert "run-name: 'nodb' already exists" in " ".join(result.output.split())
    assert not db_path(runs, "nodb").exists()


TRAIN_RESUME = ["train", "--resume", "cfg", "--steps", "3"]
SWEEP_RESUME = ["sweep", "--name", "cfg"]  # its first point is the damaged run (a sweep reads only its sweep id)


@pytest.mark.parametrize("content, reason, command", [
    ("{oops", "isnotvalidJSON", TRAIN_RESUME), ("", "isnotvalidJSON", TRAIN_RESUME),
    ("[1, 2]", "isnotaJSONobject", TRAIN_RESUME), ('{"group_size": "x"}', "'group_size'='x'isastr", TRAIN_RESUME),
    ('{"steps": -4}', "holdsabadvalue:steps:-4", TRAIN_RESUME), ('{"steps": null}', "'steps'=null", TRAIN_RESUME),
    ("{oops", "isnotvalidJSON", SWEEP_RESUME), ("[1, 2]", "isnotaJSONobject", SWEEP_RESUME),
])
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
    assert config.read_text() == content and db_path(runs, config.parent.name).read_bytes() == before


@pytest.mark.parametrize("args, message", [
    (["--seed", HUGE], f"seed: {HUGE}"), (["--seed", "-1"], "seed: -1"),
    (["--out", "{file}"], "out: {file} is a file, not a folder"),
])
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
    result = runner.invoke(app, ["eval", "--run-name", "ev", "--limit", "2", "--samples", "1", "--runs-dir",
                                 str(runs)])
    assert result.exit_code == 0, result.output
    return runs


@pytest.mark.parametrize("command, message", [
    (["train", "--run-name", "ev", "--steps", "1"], "run-name: 'ev' is an eval run (qae eval)"),
    (["train", "--resume", "ev", "--steps", "1"], "resume: 'ev' is an eval run (qae eval)"),
    (["eval", "--model", "ev", "--limit", "1", "--samples", "1"], "model: 'ev' is an eval run (qae eval)"),
])
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
    result = runner.invoke(app, ["train", "--resume", "base", "--run-name", "other", "--steps", "3",
                                 "--runs-dir", str(runs)])
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
