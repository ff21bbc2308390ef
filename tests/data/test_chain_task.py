"""The built-in `chain` task: fixed problems and held-out split, a final-answer-only reward on literal responses, the
names `builtin:chain` / `builtin:arith`, the defaults a built-in task gives `qae train`, the shipped warm-started
checkpoint, a deterministic `qae warmstart --task chain`, and a short real training run."""

import json

import pytest
import torch
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.data.tasks import (
    BUILTIN_TASKS,
    CHAIN_N_HELDOUT,
    CHAIN_N_PROBLEMS,
    arith_task,
    chain_question,
    chain_response,
    chain_task,
    load_task,
)
from qae_app.models.policy import BUILTIN_CHECKPOINTS, PACKAGED_GGUF, CharTokenizer, load_policy, tiny_llama_config
from qae_app.rewards.builtin_verifiers import REWARD_FUNCTIONS, chain_final_reward

runner = CliRunner()


# ---------------------------------------------------------------------------------------------------------------
# problems and split


def test_question_and_scratchpad_by_hand():
    assert chain_question([7, 5, 3, 4], ["+", "*", "-"]) == "((7+5)*3)-4="
    assert chain_response([7, 5, 3, 4], ["+", "*", "-"]) == ("7+5=12,12*3=36,36-4=32 so 32", 32)
    assert chain_question([3, 1, 8], ["-", "-"]) == "(3-1)-8="
    assert chain_response([2, 9, 6, 7], ["-", "*", "*"]) == ("2-9=-7,-7*6=-42,-42*7=-294 so -294", -294)


def test_split_sizes_determinism_and_disjointness():
    task = chain_task()
    again = chain_task()
    assert (len(task.train), len(task.heldout)) == (CHAIN_N_PROBLEMS - CHAIN_N_HELDOUT, CHAIN_N_HELDOUT)
    assert [p.prompt_id for p in task.heldout] == [p.prompt_id for p in again.heldout]
    assert [p.prompt_id for p in task.train] == [p.prompt_id for p in again.train]
    ids = [p.prompt_id for p in task.train + task.heldout]
    assert len(set(ids)) == CHAIN_N_PROBLEMS  # every problem once: held-out ones never train
    # pinned: the seeded draw and split must never change, or held-out numbers stop being comparable
    assert [p.prompt_id for p in task.heldout[:3]] == ["(7-9)*7=", "(1+4)-4=", "(5*8)-1="]
    assert [p.prompt_id for p in task.train[:2]] == ["((1*7)-2)+3=", "(3-1)-8="]
    assert task.reward == "chain_final" and task.prompt(task.heldout[0]) == "(7-9)*7="


def test_every_problem_fits_the_tiny_model():
    """Characters in the built-in vocabulary, gold responses of 16-34 characters that fit the task's response
    length, and prompt plus response inside the model's 128 positions."""
    task = chain_task()
    tokenizer = CharTokenizer()
    max_new_tokens = BUILTIN_TASKS["chain"].max_new_tokens
    positions = tiny_llama_config().max_position_embeddings
    lengths = []
    for p in task.train + task.heldout:
        response = p.meta["gold_response"]
        assert response.endswith(" so " + p.answer)
        prompt_ids, target_ids = tokenizer.encode(p.question), tokenizer.encode_target(response)
        assert tokenizer.unk_id not in prompt_ids + target_ids, p.question
        lengths.append(len(target_ids))
        assert len(prompt_ids) + len(target_ids) <= positions
    gold = [p.meta["gold_response"] for p in task.train + task.heldout]
    assert chain_final_reward(gold, [p.answer for p in task.train + task.heldout]) == [1.0] * len(gold)
    assert 17 <= min(lengths) and max(lengths) <= 35 <= max_new_tokens  # characters + eos


def test_builtin_names():
    assert load_task("builtin:chain").name == "chain" and load_task("chain").name == "chain"
    assert [p.prompt_id for p in load_task("builtin:arith").heldout] == [p.prompt_id for p in arith_task().heldout]
    assert load_task("arith").name == "arith"
    with pytest.raises(QAEUserError, match="'builtin:nope' is not a built-in task.*builtin:arith, builtin:chain"):
        load_task("builtin:nope")
    for name, builtin in BUILTIN_TASKS.items():  # a shipped checkpoint, or a pip package's GGUF file (add: SmolLM2)
        assert builtin.model in BUILTIN_CHECKPOINTS or builtin.model in PACKAGED_GGUF, name
        assert builtin.build().reward in REWARD_FUNCTIONS, name


# ---------------------------------------------------------------------------------------------------------------
# reward: the final answer only


@pytest.mark.parametrize(
    "response, score",
    [
        ("7+5=12,12*3=36,36-4=32 so 32", 1.0),  # the gold response
        ("7+5=13,13*3=38,38-4=31 so 32", 1.0),  # wrong scratchpad, right final answer: final answer only
        (" so 32", 1.0),  # no scratchpad at all: still only the final answer counts
        ("1 so 5 so 32", 1.0),  # the last marker holds the answer
        ("7+5=12,12*3=36,36-4=32 so 32 ", 1.0),  # surrounding whitespace is not part of the answer
        ("7+5=12,12*3=36,36-4=32 so 31", 0.0),  # wrong final answer, right scratchpad
        ("7+5=12,12*3=36,36-4=32", 0.0),  # malformed: no marker
        ("32", 0.0),  # malformed: no marker
        ("7+5=12 so ", 0.0),  # malformed: nothing after the marker
        ("7+5=12 so 32x", 0.0),  # malformed: not an integer
        ("7+5=12 so 032", 0.0),  # not the gold integer as written
        ("7+5=12 so 3 2", 0.0),
        ("", 0.0),
    ],
)
def test_chain_final_reward_on_literal_responses(response, score):
    assert chain_final_reward([response], ["32"]) == [score]


def test_chain_final_reward_negative_answers_and_registry():
    assert chain_final_reward(["3-1=2,2-8=-6 so -6", "3-1=2,2-8=6 so 6"], ["-6", "-6"]) == [1.0, 0.0]
    assert REWARD_FUNCTIONS["chain_final"] is chain_final_reward
    with pytest.raises(ValueError):
        chain_final_reward(["a so 1"], [])


# ---------------------------------------------------------------------------------------------------------------
# what `qae train --data builtin:chain` starts from


def test_a_builtin_task_picks_its_model_and_response_length(tmp_path):
    default = build_config()
    assert (default.data, default.model, default.max_new_tokens) == ("arith", "builtin:tiny", 8)
    assert (build_config(data="builtin:arith").model, build_config(data="builtin:arith").max_new_tokens) == (
        "builtin:tiny",
        8,
    )
    chain = build_config(data="builtin:chain")
    assert (chain.model, chain.max_new_tokens) == ("builtin:tiny-chain", 48)
    explicit = build_config(data="builtin:chain", model="builtin:tiny", max_new_tokens=20)
    assert (explicit.model, explicit.max_new_tokens) == ("builtin:tiny", 20)
    toml = tmp_path / "run.toml"
    toml.write_text('data = "builtin:chain"\nmax_new_tokens = 40\n')
    from_file = build_config(toml)
    assert (from_file.model, from_file.max_new_tokens) == ("builtin:tiny-chain", 40)
    file_data = build_config(data=str(toml))  # a data file keeps the plain defaults
    assert (file_data.model, file_data.max_new_tokens) == ("builtin:tiny", 8)


# ---------------------------------------------------------------------------------------------------------------
# the shipped checkpoint and the warm start


@pytest.mark.slow
def test_shipped_checkpoint_writes_scratchpads_of_the_promised_length():
    from qae_app.engines.hf import HFGenerateEngine

    torch.set_num_threads(2)
    model, codec = load_policy("builtin:tiny-chain")
    assert isinstance(codec, CharTokenizer)
    task = chain_task()
    problems = task.heldout[:64]
    samples = HFGenerateEngine(model, codec).generate(
        [task.prompt(p) for p in problems], 1, 1.0, BUILTIN_TASKS["chain"].max_new_tokens, seed=0
    )
    lengths = [len(s.response_ids) for s in samples]
    assert 10 <= sum(lengths) / len(lengths) <= 40
    assert sum(s.truncated for s in samples) <= 2  # it stops by itself
    assert sum(" so " in s.text for s in samples) >= 60  # it has learned the format
    rewards = chain_final_reward([s.text for s in samples], [p.answer for p in problems])
    assert 0 < sum(rewards) < len(rewards)  # sometimes right, sometimes wrong: RL has signal and room


@pytest.mark.slow
def test_warmstart_chain_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    for name in ("a", "b"):
        result = runner.invoke(app, ["warmstart", "--task", "chain", "--steps", "2", "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    scratch = load_policy("builtin:tiny-scratch")[0].state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], scratch["model.embed_tokens.weight"])  # it trained
    assert json.loads((tmp_path / "a" / "qae_char_tokenizer.json").read_text())["chars"] == CharTokenizer().chars


def test_warmstart_refuses_an_unknown_task(tmp_path):
    result = runner.invoke(app, ["warmstart", "--task", "chains", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown built-in task 'chains'" in result.output and "arith, chain" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_train_on_chain_end_to_end(tmp_path):
    from qae_app.store.reader import query, read_run, read_steps
    from qae_app.store.run_folder import db_path

    result = runner.invoke(
        app,
        [
            "train",
            "--data",
            "builtin:chain",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--eval-limit",
            "8",
            "--run-name",
            "c",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    path = db_path(tmp_path, "c")
    run = read_run(path)
    config = json.loads(run["config"])
    assert (run["model"], run["task"], config["max_new_tokens"]) == ("builtin:tiny-chain", "builtin:chain", 48)
    assert read_steps(path)["step"].tolist() == [1, 2]
    rows = query(
        path,
        "SELECT r.response, r.reward, g.answer, g.prompt FROM rollouts r JOIN groups g USING (run_id, step, group_idx)",
    )
    assert len(rows) == 2 * 2 * 4
    assert rows["reward"].tolist() == chain_final_reward(rows["response"].tolist(), rows["answer"].tolist())
    assert rows["response"].str.contains(" so ").mean() > 0.8  # the warm-started scratchpad format
    assert rows["prompt"].str.endswith("=").all()
