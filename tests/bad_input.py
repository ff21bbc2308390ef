"""The check each folder's bad-value table runs (tests/<folder>/test_bad_input.py, one table per package): every bad
value of issues 10 and 28, from the command line, a TOML file or a data file, is one message that names the option (or
file) and the value, exit code 2, and nothing written in the runs folder. Run in-process with typer's CliRunner.

A row of a table is (command line, what the message must contain: the option or file, and the value); `{d}` in either
is the folder of bad files `bad_files` writes.
"""

import json

from typer.testing import CliRunner

from qae_app.cli.main import app

runner = CliRunner()
HUGE = "1" + "0" * 30  # an integer no 32-bit column, seed or tensor size can hold


def bad_files(d):
    """The bad files the tables refer to as {d}/name."""
    toml = {
        "seed_big": "seed = 2147483648",
        "seed_negative": "seed = -1",
        "kl_nan": "kl_beta = nan",
        "lr_inf": "lr = inf",
        "lr_huge_int": "lr = " + "9" * 400,
        "wd_inf": "weight_decay = inf",
        "temperature_tiny": "temperature = 1e-300",
        "timeout_nan": "verify_timeout_s = nan",
        "timeout_inf": "verify_timeout_s = inf",
        "mini_batches_huge": f"num_mini_batches = {10**18}",
        "micro_float": "micro_batch_size = 1e30",
        "deep": "a = " + "[" * 100_000 + "]" * 100_000,
    }
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
    # issue 37: data and prompts as the user writes them
    (d / "ragged.csv").write_text("question,answer\n1+1?,2\n2+2?,4,5\n")
    (d / "headless.csv").write_text("1+1?,2\n2+2?,4\n")
    (d / "hint.jsonl").write_text(
        '{"question": "1+1?", "answer": 2, "hint": "add"}\n{"question": "2+2?", "answer": 4}\n'
    )  # the second row has no hint
    (d / "hints.jsonl").write_text('{"question": "1+1?", "answer": 2, "hint": "add"}\n')
    chat = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "1+1?"}]
    (d / "chat_system.jsonl").write_text(json.dumps({"prompt": chat, "answer": 2}) + "\n")
    return d


def assert_one_message_exit_2_and_nothing_written(tmp_path, args, message):
    d = bad_files(tmp_path)
    runs = tmp_path / "runs"
    result = runner.invoke(app, [*[a.format(d=d) for a in args], "--runs-dir", str(runs)])
    output = "".join(result.output.split())  # the console wraps long paths anywhere, so compare without spaces
    assert result.exit_code == 2, result.output
    assert "".join(message.format(d=d).split()) in output, result.output
    assert "Traceback" not in output and not isinstance(result.exception, (ValueError, RuntimeError, OSError))
    assert "qaesweep" not in output  # a sweep refused says so before announcing its runs
    assert not runs.exists() or not any(runs.rglob("*"))  # refused before anything was written
