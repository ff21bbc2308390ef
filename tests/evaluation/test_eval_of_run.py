"""`qae eval --model RUN` agrees with the run's own evaluations unless told otherwise: it samples at the run's
temperature and length with the run's prompt options, says so in its header with every sampling setting, stores them
with its rows; it evaluates a run trained on a data file only on what the user names (`--bench`, or `--split heldout`:
the run's own held-out split, the problems its --eval-every evaluations sampled), never on `arith`; and reward code
runs only when named again.

Checked to fail before: the header named no temperature (0.7 was used where the run trained at 1.0), `qae eval
--model RUN` of a data-file run evaluated `arith`, and --split did not exist."""

import dataclasses
import json
import shutil

import pandas as pd
import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.cli.trained_defaults import eval_config_for
from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.store.reader import query
from qae_app.store.run_folder import db_path

runner = CliRunner()
ROWS = [{"id": f"p{i}", "question": f"What is {i} plus 3?", "answer": str(i + 3)} for i in range(8)]


def said(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def arith_run(tiny_run, tmp_path):
    shared, run_id = tiny_run
    runs = tmp_path / "runs"  # a copy: other tests read the shared run as training left it
    shutil.copytree(shared / run_id, runs / run_id)
    return runs, run_id


def test_its_defaults_are_the_runs_and_its_header_and_rows_say_how_it_sampled(arith_run):
    runs, run_id = arith_run
    code, out = said("eval", "--model", run_id, "--limit", "8", "--samples", "2", "--runs-dir", runs)
    assert code == 0, out
    assert (
        "eval arith-heldout: 8 problems (--limit 8 of 264), 2 samples each at temperature 1, top-p 1, "
        f"max-new-tokens 8; temperature, max-new-tokens as run {run_id} trained"
    ) in out
    assert sampled(runs, run_id) == [
        ("eval", 1.0, 1.0, 2, 8),
        ("train", 1.0, 1.0, 1, None),
    ]  # the run's own: eval_k 1, every problem
    code, out = said(
        "eval",
        "--model",
        run_id,
        "--limit",
        "4",
        "--samples",
        "1",
        "--temperature",
        "0.5",
        "--top-p",
        "0.9",
        "--runs-dir",
        runs,
    )
    assert code == 0, out
    assert (
        "eval arith-heldout: 4 problems (--limit 4 of 264), 1 samples each at temperature 0.5, top-p 0.9, "
        f"max-new-tokens 8; max-new-tokens as run {run_id} trained"
    ) in out
    assert sampled(runs, run_id)[0] == ("eval", 0.5, 0.9, 1, 4)  # (an evaluation of the same step replaces it)


def sampled(runs, run_id) -> list[tuple]:
    rows = query(
        db_path(runs, run_id),
        "SELECT DISTINCT source, temperature, top_p, samples, problem_limit FROM evals ORDER BY source",
    )
    return [tuple(None if pd.isna(value) else value for value in row) for row in rows.itertuples(index=False)]


@pytest.mark.slow
def test_a_run_on_a_data_file_is_evaluated_on_what_the_user_names(chat_folder, tmp_path):
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    runs = tmp_path / "runs"
    code, out = said(
        "train",
        "--model",
        chat_folder,
        "--data",
        data,
        "--heldout-fraction",
        "0.5",
        "--eval-every",
        "1",
        "--steps",
        "1",
        "--prompts-per-step",
        "1",
        "--group-size",
        "2",
        "--num-mini-batches",
        "1",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0.8",
        "--checkpoint-every",
        "1",
        "--run-name",
        "r",
        "--runs-dir",
        runs,
    )
    assert code == 0, out
    code, out = said("eval", "--model", "r", "--runs-dir", runs)
    assert code == 2 and out.startswith("error: bench: run 'r' trained on the data file"), out
    assert "--split heldout (the run's own held-out split), or --bench FILE" in out
    code, out = said("eval", "--model", "r", "--split", "heldout", "--samples", "1", "--runs-dir", runs)
    assert code == 0, out
    assert "eval plus-heldout: 4 problems, 1 samples each at temperature 0.8, top-p 1, max-new-tokens 2" in out
    samples = query(db_path(runs, "r"), "SELECT source, benchmark, problem_id FROM eval_samples")
    by_source = {source: sorted(set(rows["problem_id"])) for source, rows in samples.groupby("source")}
    assert len(by_source["train"]) == 4 and by_source["eval"] == by_source["train"]  # the run's own held-out split
    assert set(samples["benchmark"]) == {"plus-heldout"}
    code, out = said("eval", "--model", "r", "--split", "heldout", "--bench", data, "--runs-dir", runs)
    assert code == 2 and "split: --split heldout and --bench" in out and "name two things to evaluate" in out


def write_run(runs, name: str, **options) -> None:
    """A run folder with only its config.json: all `eval_config_for` reads."""
    (runs / name).mkdir(parents=True)
    (runs / name / "config.json").write_text(json.dumps(dataclasses.asdict(TrainConfig(**options))))


@pytest.mark.parametrize(
    "options, args, message",
    [
        (
            {"data": "DATA"},
            {},
            "bench: run 'r' trained on the data file DATA, so its evaluation is yours to name: --split "
            "heldout (the run's own held-out split, which this run does not have: it held nothing "
            "out), or --bench FILE (a whole file; --bench DATA is the data it trained on).",
        ),
        (
            {"data": "DATA"},
            {"split": "heldout"},
            "split: run 'r' held nothing out of DATA (--heldout-fraction 0). "
            "Evaluate it on another file with --bench FILE.",
        ),
        (
            {"data": "DATA", "heldout_fraction": 0.5, "reward": ["math", "r.py:score"], "reward_weights": "1,0.5"},
            {"split": "heldout"},
            "reward: run 'r' scored with reward code (r.py:score), which a run folder never runs by "
            "itself. Name the rewards again to evaluate its held-out split as it trained: qae eval "
            "--model r --split heldout --reward math --reward r.py:score --reward-weights 1,0.5",
        ),
        ({}, {"split": "test"}, "split: unknown value 'test'. Choose one of: heldout (the run's own held-out split)."),
    ],
)
def test_each_bad_choice_is_one_message(tmp_path, options, args, message):
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    options = {key: str(data) if value == "DATA" else value for key, value in options.items()}
    write_run(tmp_path, "r", **options)
    with pytest.raises(QAEUserError) as err:
        eval_config_for(tmp_path, model="r", **args)
    assert str(err.value) == message.replace("DATA", str(data))


def test_split_needs_a_run(tmp_path):
    with pytest.raises(
        QAEUserError,
        match="split: --split heldout evaluates a training run's own held-out split, "
        "and --model 'builtin:tiny' is no training run here",
    ):
        eval_config_for(tmp_path, model="builtin:tiny", split="heldout")


def test_a_runs_built_in_rewards_are_its_held_out_evaluations(tmp_path):
    data = tmp_path / "plus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    write_run(
        tmp_path,
        "r",
        data=str(data),
        heldout_fraction=0.5,
        reward=["math"],
        temperature=0.6,
        max_new_tokens=32,
        system_prompt="Be terse.",
    )
    cfg, trained, taken = eval_config_for(tmp_path, model="r", split="heldout", max_new_tokens=16)
    assert (cfg.bench, cfg.reward, cfg.temperature, cfg.max_new_tokens, cfg.system_prompt) == (
        str(data),
        ["math"],
        0.6,
        16,
        "Be terse.",
    )
    assert taken == ("temperature", "system_prompt") and trained.heldout_fraction == 0.5
