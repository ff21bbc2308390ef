"""`qae eval` as a user runs it: stored samples, metrics recomputed from them, runs and checkpoints, real math files."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.core.errors import QAEUserError
from qae_app.evaluation.metrics import pass_at_k
from qae_app.store.reader import query, read_run
from qae_app.store.run_folder import db_path

runner = CliRunner()


def _eval(tmp_path, *args):
    result = runner.invoke(app, ["eval", "--runs-dir", str(tmp_path), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_builtin_model_on_the_heldout_split(tmp_path):
    out = _eval(tmp_path, "--limit", "12", "--samples", "4", "--run-name", "ev")
    metrics = {(m["metric"], m["k"]): m["value"] for m in out["metrics"] if m["subset"] == "all"}
    assert set(metrics) == {("avg@k", 4), ("pass@k", 1), ("pass@k", 2), ("pass@k", 4), ("maj@k", 4)}
    path = db_path(tmp_path, "ev")
    samples = query(path, "SELECT * FROM eval_samples ORDER BY problem_id, sample_idx")
    assert len(samples) == 12 * 4
    assert sorted(samples.groupby("problem_id")["sample_idx"].apply(list).iloc[0]) == [0, 1, 2, 3]
    # the stored metrics are what the stored samples give
    per_problem = samples.groupby("problem_id")["correct"].agg(["sum", "count"])
    assert metrics[("avg@k", 4)] == pytest.approx(samples["correct"].mean())
    for k in (1, 2, 4):
        expected = sum(pass_at_k(n, c, k) for c, n in per_problem.itertuples(index=False)) / len(per_problem)
        assert metrics[("pass@k", k)] == pytest.approx(expected)
    assert metrics[("pass@k", 1)] == pytest.approx(metrics[("avg@k", 4)])
    assert query(path, "SELECT count(*) AS n FROM evals")["n"].item() == 5
    assert read_run(path)["status"] == "finished"
    # each sample keeps the gold answer it was checked against: "extracted 11, correct: no" can be checked
    from qae_app.data.tasks import load_benchmark

    gold = {p.prompt_id: p.answer for p in load_benchmark("arith")[1]}
    assert samples["answer"].tolist() == [gold[problem] for problem in samples["problem_id"]]
    right = samples[samples["correct"]]
    assert (right["extracted"] == right["answer"]).all()
    assert "gold" in result_text(tmp_path, "--limit", "2", "--samples", "2", "--run-name", "ev2")


def result_text(tmp_path, *args) -> str:
    result = runner.invoke(app, ["eval", "--runs-dir", str(tmp_path), *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_eval_takes_the_same_reward_options_and_counts_full_marks_as_correct(tmp_path):
    """`qae eval --reward exact_int --reward FILE:short`: a sample is correct when it has full marks on both (the
    exact integer, at most 2 characters), and avg@k is their share; maj@k still votes on exact_int's answer."""
    (tmp_path / "mine.py").write_text(
        "def short(completions, **kwargs):\n    return [1.0 if len(c.strip()) <= 2 else 0.0 for c in completions]\n"
    )
    out = _eval(
        tmp_path,
        "--limit",
        "6",
        "--samples",
        "2",
        "--run-name",
        "rw",
        "--reward",
        "exact_int",
        "--reward",
        f"{tmp_path / 'mine.py'}:short",
        "--reward-weights",
        "1,0.5",
    )
    samples = query(db_path(tmp_path, "rw"), "SELECT * FROM eval_samples")
    full = (samples["extracted"] == samples["answer"]) & samples["response"].str.strip().str.len().le(2)
    assert samples["correct"].tolist() == full.tolist()
    avg = next(m["value"] for m in out["metrics"] if m["metric"] == "avg@k" and m["subset"] == "all")
    assert avg == pytest.approx(full.mean())
    assert out["options"]["reward"] == ["exact_int", f"{tmp_path / 'mine.py'}:short"]


def test_samples_stored_before_the_gold_answer_are_read_once_migrated(tmp_path):
    """A file from before the `answer` column: readers and writers refuse it naming `qae migrate`, which adds the
    column (empty for the samples stored without it); then it is read and written as any other."""
    import duckdb

    from qae_app.store.reader import read_eval_samples
    from qae_app.store.run_file import OldRunFormat
    from qae_app.store.writer import RunWriter

    path = db_path(tmp_path, "old")
    writer = RunWriter(path, "old")
    writer.create_run("old", {}, "eval", None, "builtin:tiny", "arith", 0)
    with duckdb.connect(str(path)) as con:  # the table as qae wrote it before
        con.execute("ALTER TABLE eval_samples DROP COLUMN answer")
        con.execute(
            "INSERT INTO eval_samples (run_id, step, benchmark, problem_id, sample_idx, response, extracted, "
            "correct, verified, n_tokens, source) VALUES ('old', 0, 'b', 'q', 0, 'r 11', '11', false, true, "
            "2, 'eval')"
        )
    for refused in (lambda: read_eval_samples(path, "b", "eval", 0), lambda: RunWriter(path, "old")):
        with pytest.raises(OldRunFormat, match=r"has no eval_samples.answer column.*`qae migrate old --runs-dir"):
            refused()
    result = runner.invoke(app, ["migrate", "old", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0 and "added eval_samples.answer" in result.output, result.output
    old = read_eval_samples(path, "b", "eval", 0)
    assert old["extracted"].tolist() == ["11"] and old["answer"].isna().all()
    writer = RunWriter(path, "old")
    writer.add_step(
        1,
        eval_samples=[
            dict(
                benchmark="b",
                problem_id="q",
                sample_idx=0,
                response="12",
                extracted="12",
                answer="12",
                correct=True,
                verified=True,
                n_tokens=1,
                source="eval",
            )
        ],
    )
    assert writer.flush()
    assert read_eval_samples(path, "b", "eval", 1)["answer"].tolist() == ["12"]


def test_a_run_checkpoint_stores_results_in_the_run_at_its_step(tiny_run, tmp_path):
    import shutil

    shared_runs_dir, run_id = tiny_run
    runs_dir = tmp_path / "runs"  # a copy: other tests read the shared run as training left it
    shutil.copytree(shared_runs_dir / run_id, runs_dir / run_id)
    out = _eval(runs_dir, "--model", run_id, "--limit", "8", "--samples", "2")
    assert out["run_id"] == run_id
    rows = query(
        db_path(runs_dir, run_id),
        "SELECT DISTINCT step, source FROM eval_samples WHERE benchmark = ?",
        ["arith-heldout"],
    )
    pairs = set(zip(rows["step"], rows["source"], strict=True))
    assert (6, "eval") in pairs  # the run's last checkpoint is step-6
    assert (6, "train") in pairs  # and the trainer's own evaluation at step 6 is still there


def test_unknown_checkpoint_and_bad_k_are_clear_errors(tiny_run, tmp_path):  # reads tiny_run, writes nothing
    runs_dir, run_id = tiny_run
    result = runner.invoke(app, ["eval", "--model", run_id, "--checkpoint", "99", "--runs-dir", str(runs_dir)])
    assert result.exit_code == 2 and "has no checkpoint 99" in " ".join(result.output.split())
    result = runner.invoke(app, ["eval", "--samples", "0", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "samples: 0" in result.output
    result = runner.invoke(app, ["eval", "--bench", "missing.jsonl", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "missing.jsonl" in result.output


def shortest_problems(math_data, name: str, n: int, folder) -> str:
    """The `n` shortest problems of a real data file, as a file of the same name in `folder`: the built-in model's
    context (128 positions) holds only those with the math prompt template (`qae eval` refuses longer ones)."""
    rows = [json.loads(line) for line in (math_data / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: len(row["problem"]))
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:n]))
    return str(path)


def test_real_math_file_is_scored_with_math_verify(tmp_path, math_data):
    out = _eval(
        tmp_path,
        "--bench",
        shortest_problems(math_data, "math500", 3, tmp_path),
        "--samples",
        "2",
        "--max-new-tokens",
        "4",
        "--run-name",
        "m500",
    )
    assert out["benchmark"] == "math500"
    subsets = {m["subset"] for m in out["metrics"]}
    assert "all" in subsets and any(s.startswith("subject=") for s in subsets)
    assert any(s.startswith("level=") for s in subsets)
    samples = query(db_path(tmp_path, "m500"), "SELECT * FROM eval_samples")
    assert len(samples) == 6 and samples["verified"].all()


def test_train_with_eval_bench_logs_results_with_the_step(tmp_path, math_data):
    result = runner.invoke(
        app,
        [
            "train",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--eval-bench",
            shortest_problems(math_data, "math500", 3, tmp_path),
            "--eval-k",
            "2",
            "--run-name",
            "tb",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
    )
    assert result.exit_code == 0, result.output
    evals = query(db_path(tmp_path / "runs", "tb"), "SELECT * FROM evals WHERE subset = 'all' ORDER BY step")
    assert set(evals["step"]) == {0, 2}
    assert set(evals["benchmark"]) == {"math500"}
    assert evals[evals["metric"] == "pass@k"]["k"].max() == 2


def test_a_run_without_checkpoints_and_a_missing_folder_are_clear_errors_with_no_network(
    tiny_run, tmp_path, monkeypatch
):
    """A run killed before its first checkpoint has no checkpoints/ folder at all, and a path that does not exist is
    not a Hugging Face id: neither may reach the network (HF_HUB_OFFLINE would turn a lookup into another error)."""
    import shutil

    from qae_app.models.policy import load_policy

    def no_network(*args, **kwargs):
        raise AssertionError("asked Hugging Face")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_network)
    shared_runs_dir, run_id = tiny_run
    early = tmp_path / "runs" / "early"
    early.mkdir(parents=True)
    shutil.copy(db_path(shared_runs_dir, run_id), early / "qae.duckdb")  # a run's database, no checkpoints/
    result = runner.invoke(app, ["eval", "--model", "early", "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert "run 'early' has no checkpoint yet" in " ".join(result.output.split())
    for missing in ("/nonexistent/dir", "./not-here", "a/b/c"):
        with pytest.raises(QAEUserError, match=f"model: '{missing}' is not a folder"):
            load_policy(missing)


@pytest.mark.slow
def test_eval_of_a_training_run_takes_the_newest_checkpoint_again_when_training_prunes_the_one_it_chose(
    tiny_run, tmp_path, monkeypatch
):
    """`qae eval --model RUN` while RUN trains: the trainer may delete the checkpoint eval chose (--keep-checkpoints)
    before eval has loaded it. Here the first load finds its checkpoint deleted, as the trainer would."""
    import shutil

    from qae_app.models.policy import load_policy

    shared_runs_dir, run_id = tiny_run
    runs_dir = tmp_path / "runs"
    shutil.copytree(shared_runs_dir / run_id, runs_dir / run_id)
    loads = []

    def pruned_first(spec, *args, **kwargs):
        loads.append(spec)
        if len(loads) == 1:
            shutil.rmtree(runs_dir / run_id / "checkpoints" / "step-6")
        return load_policy(spec, *args, **kwargs)

    monkeypatch.setattr("qae_app.models.policy.load_policy", pruned_first)
    out = _eval(runs_dir, "--model", run_id, "--limit", "4", "--samples", "1")
    assert [p.split("/")[-2] for p in loads] == ["step-6", "step-3"]
    steps = query(db_path(runs_dir, run_id), "SELECT DISTINCT step FROM eval_samples WHERE source = 'eval'")["step"]
    assert steps.tolist() == [3] and out["run_id"] == run_id


@pytest.mark.parametrize(
    "command, option",
    [
        (["eval", "--max-new-tokens", "16", "--bench"], "bench"),
        (["train", "--steps", "1", "--eval-every", "1", "--eval-bench"], "eval-bench"),
    ],
)
def test_a_benchmark_prompt_longer_than_the_context_is_refused_before_anything_runs(tmp_path, command, option):
    """As `qae train --data` refuses it: past the context a RoPE model degrades (the built-in model, 128 positions,
    answered every such prompt with an empty response, stored as a real evaluation scored 0)."""
    bench = tmp_path / "long.jsonl"
    bench.write_text(
        json.dumps({"problem": "1+" * 100 + "1", "answer": "101"})
        + "\n"
        + json.dumps({"problem": "1+1", "answer": "2"})
        + "\n"
    )
    runs = tmp_path / "runs"
    result = runner.invoke(app, [*command, str(bench), "--runs-dir", str(runs)])
    message = " ".join(result.output.split())
    assert result.exit_code == 2, message
    assert f"{option}: prompt 'long-1' is" in message and "but the model's context is 128" in message
    assert not runs.exists() or not any(runs.rglob("*.duckdb"))


class ScriptedEngine:
    """Returns the given responses in order: the texts a policy might sample, so maj@k's vote can be worked out by
    hand (a stand-in for the model's randomness only; the verifier and the metrics are the real ones)."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def generate(self, prompts, n, temperature, max_new_tokens, seed=0):
        from qae_app.engines.base import Sample

        return [
            Sample(prompt_index=0, prompt_ids=[1], response_ids=[1] * len(text), text=text, truncated=False)
            for text in self.texts[:n]
        ]


def test_maj_at_k_on_the_chain_task_votes_on_the_final_answer_the_reward_reads():
    """The chain task's reward reads the integer after the last ' so '; maj@k voted on whole responses, so three
    different scratchpads reaching 2 lost to two copies of one wrong response (review: 'x so 2' x3 vs 'w so 5' x2)."""
    from qae_app.data.datasets import Problem
    from qae_app.evaluation.evaluate import evaluate
    from qae_app.rewards.builtin_verifiers import BuiltinVerifier

    texts = ["1+1=2 so 2", "2+0=2 so 2", "3-1=2 so 2", "4+1=5 so 5", "4+1=5 so 5"]
    with BuiltinVerifier("chain_final") as verifier:
        result = evaluate(
            ScriptedEngine(texts),
            "chain",
            [Problem("p", "q", "2")],
            ["q"],
            verifier,
            k=5,
            temperature=1.0,
            max_new_tokens=8,
            seed=0,
        )
    metrics = {row["metric"]: row["value"] for row in result.metrics if row["subset"] == "all"}
    assert metrics["avg@k"] == pytest.approx(3 / 5)
    assert metrics["maj@k"] == 1.0  # the answer 2 has three votes, 5 has two
    assert [s["extracted"] for s in result.samples] == ["2", "2", "2", "5", "5"]


@pytest.mark.parametrize(
    "name, plant",
    [
        ("model/model.safetensors", "garbage"),
        ("model/config.json", "deep"),
        ("model/qae_char_tokenizer.json", "link-zero"),
    ],
)
def test_eval_of_a_run_passes_over_a_checkpoint_whose_model_is_damaged(tiny_run, tmp_path, name, plant):
    """A file of the newest checkpoint's model/ damaged (its manifest rewritten to match) or a link planted there:
    `qae eval --model RUN` evaluates the newest checkpoint that checks out and says which it passed over (a
    transformers traceback before, and a read of /dev/zero that never ended); `--checkpoint 6` names the file."""
    import shutil

    from tests.plants import Plant, plant_file

    shared_runs_dir, run_id = tiny_run
    runs_dir = tmp_path / "runs"
    shutil.copytree(shared_runs_dir / run_id, runs_dir / run_id)
    (tmp_path / "outside").mkdir()
    plant_file(runs_dir / run_id, Plant(f"checkpoints/step-6/{name}", plant), tmp_path / "ran", tmp_path / "outside")
    result = runner.invoke(
        app,
        ["eval", "--model", run_id, "--limit", "2", "--samples", "1", "--runs-dir", str(runs_dir)],
        env={"COLUMNS": "300"},
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "passing over checkpoint step-6: " in output and Path(name).name in output, output
    assert "(run tiny)" in output and "step 3" in output
    refused = runner.invoke(
        app, ["eval", "--model", run_id, "--checkpoint", "6", "--runs-dir", str(runs_dir)], env={"COLUMNS": "300"}
    )
    assert refused.exit_code == 2 and Path(name).name in refused.output, refused.output
