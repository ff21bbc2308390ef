"""Rollouts sample from exactly softmax(logits / T), the distribution the loss assumes, whatever the checkpoint's own
generation_config says; they stop at any of the model's stop tokens; `qae eval` may truncate the distribution on
request and records that it did."""

import json

import pytest
import torch
from typer.testing import CliRunner

from qae_app.algo.losses import token_logprobs_and_entropy
from qae_app.cli.main import app
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import build_tiny_model, load_policy
from qae_app.store.reader import read_run
from qae_app.store.run_folder import db_path

runner = CliRunner()

# what instruct checkpoints ship in generation_config.json (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20,
# top_p 0.8; others add min_p, no_repeat_ngram_size, ...), all of which change the sampled distribution
CHECKPOINT_SAMPLING = dict(
    do_sample=True,
    temperature=0.3,
    top_k=5,
    top_p=0.5,
    min_p=0.2,
    typical_p=0.6,
    repetition_penalty=1.3,
    no_repeat_ngram_size=1,
    min_new_tokens=12,
    suppress_tokens=[10, 11],
)


@pytest.fixture(scope="module")
def opinionated_checkpoint(tmp_path_factory):
    """The built-in architecture (random weights, char tokenizer) saved with an instruct-style generation_config."""
    from transformers import GenerationConfig

    folder = tmp_path_factory.mktemp("opinionated")
    model, codec = build_tiny_model(seed=3)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, **CHECKPOINT_SAMPLING)
    model.save_pretrained(folder)
    codec.save(folder)
    loaded, _ = load_policy(str(folder))
    assert loaded.generation_config.repetition_penalty == 1.3  # the checkpoint really carries these settings
    return folder


def test_sampled_token_logprobs_equal_the_trainers_recomputed_ones(opinionated_checkpoint):
    from qae_app.engines.base import cut_at_stop

    model, codec = load_policy(str(opinionated_checkpoint))
    model.eval()
    engine = HFGenerateEngine(model, codec)
    temperature, new = 0.8, 16
    prompts = [codec.encode("12+7="), codec.encode("3*4="), codec.encode("20-13=")]  # different lengths
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), codec.pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):  # left padding, as the engine does
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    torch.manual_seed(0)
    with torch.no_grad():
        out = engine.sample_batch(
            input_ids,
            attention_mask,
            engine.generation_config(temperature, new),
            output_scores=True,
            return_dict_in_generate=True,
        )
    scores = torch.stack(out.scores, dim=1)  # (N, new, vocab): the distribution each token was drawn from
    sampled = out.sequences[:, width:]  # (N, new)
    engine_logp = torch.log_softmax(scores.float(), -1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)

    max_diff, compared = 0.0, 0
    for row, ids in enumerate(prompts):
        response, _ = cut_at_stop(sampled[row].tolist(), codec.stop_ids)
        full = torch.tensor([ids + response])
        with torch.no_grad():
            logits = model(input_ids=full).logits[:, :-1]  # (1, T-1, vocab), the trainer's unpadded view
        trainer_logp, _ = token_logprobs_and_entropy(logits, full[:, 1:], temperature)
        recomputed = trainer_logp[0, len(ids) - 1 :]  # positions that predict the response tokens
        assert torch.isfinite(engine_logp[row, : len(response)]).all()  # nothing was masked out (top-k, min-p...)
        max_diff = max(max_diff, (recomputed - engine_logp[row, : len(response)]).abs().max().item())
        compared += len(response)
    assert compared >= 10
    print(f"sampled vs recomputed token log-prob, max |diff| over {compared} tokens: {max_diff:.2e}")
    assert max_diff < 1e-5


def test_the_engines_per_token_stats_are_the_trainers_recomputed_ones(opinionated_checkpoint):
    """The log-prob and entropy the HF engine measures while sampling (so the trainer needs no pass over gated
    responses to report them) equal what the trainer's forward gives for the same tokens."""
    model, codec = load_policy(str(opinionated_checkpoint))
    engine = HFGenerateEngine(model, codec)
    temperature = 0.8
    samples = engine.generate(["12+7=", "3*4=", "20-13="], 3, temperature, 16, seed=0)
    compared = 0
    for sample in samples:
        assert len(sample.token_logprobs) == len(sample.token_entropies) == len(sample.response_ids) > 0
        full = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[:, :-1]
        logp, entropy = token_logprobs_and_entropy(logits, full[:, 1:], temperature)
        start = len(sample.prompt_ids) - 1  # positions that predict the response tokens
        torch.testing.assert_close(torch.tensor(sample.token_logprobs), logp[0, start:], atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(sample.token_entropies), entropy[0, start:], atol=1e-5, rtol=0)
        compared += len(sample.response_ids)
    assert compared >= 20


def test_the_checkpoints_generation_config_does_not_shape_the_rollouts(opinionated_checkpoint):
    # no_repeat_ngram_size=1 (from the checkpoint) would forbid any token twice in a response; min_new_tokens would
    # forbid stopping early; softmax sampling over a 64-token vocabulary repeats tokens within 24 draws
    model, codec = load_policy(str(opinionated_checkpoint))
    samples = HFGenerateEngine(model, codec).generate(["1+1=", "9*9="], n=4, temperature=1.0, max_new_tokens=24, seed=5)
    responses = [s.response_ids for s in samples]
    assert any(len(set(r)) < len(r) for r in responses), responses
    assert model.generation_config.repetition_penalty == 1.3  # set aside during generate, then given back


def test_generation_config_spells_out_plain_sampling():
    from qae_app.engines.sampling import SamplingOptions

    model, codec = build_tiny_model()
    config = HFGenerateEngine(model, codec).generation_config(0.7, 9)
    assert (
        config.do_sample,
        config.temperature,
        config.top_k,
        config.top_p,
        config.repetition_penalty,
        config.no_repeat_ngram_size,
        config.min_new_tokens,
        config.max_new_tokens,
    ) == (True, 0.7, 0, 1.0, 1.0, 0, 0, 9)
    assert config.min_p is None and config.eos_token_id == [codec.eos_id]
    eval_config = HFGenerateEngine(
        model, codec, sampling=SamplingOptions(top_p=0.9, top_k=20, min_p=0.05)
    ).generation_config(0.7, 9)
    assert (eval_config.top_p, eval_config.top_k, eval_config.min_p) == (0.9, 20, 0.05)


# ---------------------------------------------------------------------------------------------------------------
# stop tokens


def test_cut_at_stop_keeps_the_first_stop_token():
    from qae_app.engines.base import cut_at_stop

    assert cut_at_stop([5, 6, 9, 7, 2, 0], [2, 9]) == ([5, 6, 9], False)
    assert cut_at_stop([5, 2, 9], [2, 9]) == ([5, 2], False)
    # a row that ran out of tokens was never padded (generate pads only rows that stopped): a pad-id token at its end
    # was sampled, and belongs to the response
    assert cut_at_stop([5, 6, 0, 0], [2, 9]) == ([5, 6, 0, 0], True)
    assert cut_at_stop([2, 2, 2], [2]) == ([2], False)  # pad == eos (SmolLM2, Llama-3)


@pytest.mark.parametrize("decode_loop", [True, False], ids=["decode-loop", "generate"])
def test_a_truncated_response_keeps_the_pad_id_tokens_it_sampled(decode_loop):
    """A model that emits its pad id (not a stop id): every response runs out of tokens, all of them pad ids, and keeps
    them with one log-prob and one entropy per token (the decode loop's lists were longer than the response)."""
    model, codec = build_tiny_model(seed=1)
    assert codec.pad_id not in codec.stop_ids

    def pad_wins(module, inputs, logits):  # (..., vocab): the pad id's logit far above every other's
        return logits.index_fill(-1, torch.tensor([codec.pad_id]), 100.0)

    model.lm_head.register_forward_hook(pad_wins)
    engine = HFGenerateEngine(model, codec)
    engine.use_decode_loop = decode_loop
    samples = engine.generate(["1+2=", "33+4="], n=2, temperature=1.0, max_new_tokens=5, seed=0)
    for sample in samples:
        assert sample.truncated and sample.response_ids == [codec.pad_id] * 5
        assert len(sample.token_logprobs) == len(sample.token_entropies) == 5


def test_generation_stops_at_any_stop_id():
    model, codec = build_tiny_model(seed=1)
    engine = HFGenerateEngine(model, codec)
    free = engine.generate(["2+2="], n=6, temperature=1.0, max_new_tokens=20, seed=2)
    # a token the model samples somewhere mid-response becomes a second end-of-turn token
    row = next(s for s in free if len(s.response_ids) >= 6 and codec.eos_id not in s.response_ids[:5])
    end_of_turn = row.response_ids[4]
    codec.stop_ids = [codec.eos_id, end_of_turn]
    stopped = engine.generate(["2+2="], n=6, temperature=1.0, max_new_tokens=20, seed=2)
    for before, after in zip(free, stopped, strict=True):
        first = next((i for i, t in enumerate(before.response_ids) if t in codec.stop_ids), None)
        if first is None:
            assert after.response_ids == before.response_ids and after.truncated == before.truncated
        else:  # same draws up to the first stop token, which closes the response
            assert after.response_ids == before.response_ids[: first + 1] and not after.truncated
    assert stopped[free.index(row)].response_ids[-1] == end_of_turn


# ---------------------------------------------------------------------------------------------------------------
# qae eval's sampling options


def test_eval_top_k_is_applied_and_recorded(tmp_path):
    result = runner.invoke(
        app,
        [
            "eval",
            "--limit",
            "6",
            "--samples",
            "3",
            "--top-k",
            "1",
            "--temperature",
            "1.0",
            "--run-name",
            "greedy",
            "--runs-dir",
            str(tmp_path),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert {key: out["options"][key] for key in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 1,
        "min_p": 0.0,
    }
    from qae_app.store.reader import query

    samples = query(db_path(tmp_path, "greedy"), "SELECT problem_id, response FROM eval_samples")
    # top-k 1 is greedy: the 3 samples of each problem are the same response
    assert (samples.groupby("problem_id")["response"].nunique() == 1).all()
    config = json.loads(read_run(db_path(tmp_path, "greedy"))["config"])
    assert (config["top_k"], config["top_p"], config["min_p"]) == (1, 1.0, 0.0)


@pytest.mark.parametrize(
    "option,value,message",
    [("--top-p", "0", "top-p: 0.0"), ("--top-k", "-1", "top-k: -1"), ("--min-p", "1", "min-p: 1.0")],
)
def test_eval_sampling_options_out_of_range_are_clear_errors(tmp_path, option, value, message):
    result = runner.invoke(app, ["eval", option, value, "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output
    assert not any(tmp_path.iterdir())  # refused before anything was written
