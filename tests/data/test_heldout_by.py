"""--heldout-by COLUMN: rows that share the column's value are held out together, a --heldout-fraction of the
column's distinct values chosen by the seed; a row without the column is refused with one message. Checked to fail
before the option existed: `heldout_fraction` alone split rows, so a word held out in one phrasing was trained on in
another (the first test's `assert not trained & held` failed for every seed tried, 0-4)."""

import json

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.core.errors import QAEUserError
from qae_app.data.tasks import load_task

WORDS = [f"word{i}" for i in range(10)]
PHRASINGS = ["Spell {w} backwards.", "Write {w} in reverse.", "What is {w} read right to left?"]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def phrased(tmp_path) -> str:
    return write_rows(
        tmp_path / "words.jsonl",
        [{"question": p.format(w=w), "answer": w[::-1], "word": w} for p in PHRASINGS for w in WORDS],
    )


def words(problems) -> set[str]:
    return {p.columns["word"] for p in problems}


@pytest.mark.parametrize("seed", range(5))
def test_every_phrasing_of_a_held_out_word_is_held_out(phrased, seed):
    task = load_task(phrased, 0.3, seed, heldout_by="word")
    held, trained = words(task.heldout), words(task.train)
    assert len(held) == 3 and len(task.heldout) == 3 * len(PHRASINGS)  # 30% of the 10 words, every phrasing of each
    assert not trained & held and trained | held == set(WORDS)
    assert words(load_task(phrased, 0.3, seed, heldout_by="word").heldout) == held  # the seed decides


def test_the_seed_chooses_which_words(phrased):
    assert len({frozenset(words(load_task(phrased, 0.3, seed, heldout_by="word").heldout)) for seed in range(5)}) > 1


def test_without_it_rows_are_split_as_they_always_were(phrased):
    """The same rows held out as the row split's seeded shuffle gives (int(0.3 * 30) = 9 rows)."""
    import random

    order = list(range(30))
    random.Random(7).shuffle(order)
    task = load_task(phrased, 0.3, 7)
    rows = [json.loads(line) for line in open(phrased)]
    assert [p.question for p in task.heldout] == [rows[i]["question"] for i in sorted(order[:9])]


def test_a_row_without_the_column_is_named(tmp_path):
    data = write_rows(
        tmp_path / "some.jsonl", [{"question": "a?", "answer": "1", "word": "a"}, {"question": "b?", "answer": "2"}]
    )
    with pytest.raises(
        QAEUserError,
        match="heldout-by: '.*some.jsonl' line 2 has no column 'word' "
        "\\(its columns: question, answer\\). Name a column every row has.",
    ):
        load_task(data, 0.5, 0, heldout_by="word")


@pytest.mark.parametrize(
    "args, said",
    [
        (["--heldout-by", "word"], "heldout-by: 'word' groups the held-out rows, and --heldout-fraction is 0"),
        (
            ["--heldout-by", "word", "--heldout-fraction", "0.2", "--data", "arith"],
            "heldout-by: the built-in task 'arith' has a fixed held-out split of its own",
        ),
        (["--heldout-by", "wrd", "--heldout-fraction", "0.2"], "words.jsonl' line 1 has no column 'wrd'"),
    ],
)
def test_train_refuses_each_with_one_message(phrased, tmp_path, args, said):
    data = [] if "--data" in args else ["--data", phrased]
    result = CliRunner().invoke(app, ["train", *data, *args, "--steps", "1", "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
