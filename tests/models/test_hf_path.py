"""The path a real model takes: a Hugging Face folder with a real (fast) tokenizer, a math data file in the GSM8K
format, the `\\boxed{}` prompt and math-verify rewards, a KL reference, `qae eval` on it. The model is a small Llama
and the tokenizer a word-level one trained here with the `tokenizers` library, since nothing can be downloaded."""

import json

import pytest
from typer.testing import CliRunner

from qae_app.cli.main import app
from qae_app.store.reader import query, read_run, read_steps
from qae_app.store.run_folder import db_path

runner = CliRunner()


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("hf_model")
    corpus = [
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "What is 2 plus 3? The answer is \\boxed{5}.",
        "Natalia sold clips to 48 of her friends in April",
    ]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus * 10, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    # 1024 positions: the first AIME problems with the math prompt do not fit 256 with this word-level tokenizer, and
    # qae refuses a prompt that does not fit the model's context
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_train_a_hf_model_on_gsm8k_with_math_verify_and_kl(tmp_path, hf_model_dir, math_data):
    data = tmp_path / "gsm8k_head.jsonl"
    data.write_text("".join((math_data / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[:20]))
    result = runner.invoke(
        app,
        [
            "train",
            "--model",
            str(hf_model_dir),
            "--data",
            str(data),
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "6",
            "--kl-beta",
            "0.1",
            "--eval-every",
            "0",
            "--lr",
            "1e-3",
            "--run-name",
            "hf",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    path = db_path(tmp_path, "hf")
    info = read_run(path)
    assert info["status"] == "finished" and info["task"] == str(data)
    groups = query(path, "SELECT * FROM groups ORDER BY step, group_idx")
    assert groups["prompt"].str.endswith("put your final answer within \\boxed{}.").all()
    assert set(groups["prompt_id"]) <= {f"gsm8k_head-{i}" for i in range(1, 21)}
    rollouts = query(path, "SELECT * FROM rollouts")
    assert rollouts["verified"].all() and (rollouts["n_tokens"] <= 6).all()
    steps = read_steps(path)
    # an untrained model gets every answer wrong: no advantage, so the policy stays at its reference (KL 0)
    assert steps["kl"].tolist() == [0.0, 0.0] and steps["frac_all_wrong"].tolist() == [1.0, 1.0]
    config = json.loads(info["config"])
    assert config["kl_beta"] == 0.1


def test_eval_a_hf_model_folder_on_a_math_file(tmp_path, hf_model_dir, math_data):
    result = runner.invoke(
        app,
        [
            "eval",
            "--model",
            str(hf_model_dir),
            "--bench",
            str(math_data / "aime25.jsonl"),
            "--limit",
            "2",
            "--samples",
            "2",
            "--max-new-tokens",
            "5",
            "--json",
            "--run-name",
            "e",
            "--runs-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["benchmark"] == "aime25" and {m["metric"] for m in out["metrics"]} == {"avg@k", "pass@k", "maj@k"}
    assert len(query(db_path(tmp_path, "e"), "SELECT * FROM eval_samples")) == 4
