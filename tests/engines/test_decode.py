"""The HF engine's own decode loop (qae_app/engines/decode.py) samples what `model.generate` samples: for a fixed seed
the same tokens, the log-prob each token was sampled with equal to the model's own forward over prompt + response,
finished rows dropped from the batch without changing anyone's tokens, and the models it cannot run left to
generate."""

from __future__ import annotations

import pytest
import torch

from qae_app.algo.losses import token_logprobs_and_entropy
from qae_app.config import build_config
from qae_app.engines import decode, decode_kernels
from qae_app.engines.decode_kernels import Kernels
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.lora import apply_lora
from qae_app.models.policy import BUILTIN_MODEL, BUILTIN_SCRATCH, load_policy
from qae_app.train.trainer import Trainer
from tests.engines.test_rollout import reference_generate


def engine_samples(
    engine: HFGenerateEngine, use_decode_loop: bool, prompts, n, max_new_tokens, seed, temperature: float = 1.0
):
    engine.use_decode_loop = use_decode_loop
    return engine.generate(prompts, n, temperature, max_new_tokens, seed)


def recomputed_logprobs(model, samples, temperature: float = 1.0) -> list[list[float]]:
    """Each response's token log-probs and entropies from one plain forward over its prompt + response."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(input_ids=ids).logits[:, len(s.prompt_ids) - 1 : -1]  # (1, response, vocab)
            logp, entropy = token_logprobs_and_entropy(logits, ids[:, len(s.prompt_ids) :], temperature)
            out.append((logp[0].tolist(), entropy[0].tolist()))
    return out


def assert_close(got: list[float], expected: list[float], tolerance: float) -> None:
    assert len(got) == len(expected)
    assert max((abs(a - b) for a, b in zip(got, expected, strict=True)), default=0.0) < tolerance


def test_decode_loop_samples_the_tokens_generate_samples_for_a_fixed_seed():
    model, codec = load_policy(BUILTIN_MODEL)
    model.eval()
    assert decode.supports_decode_loop(model)
    prompts = ["3+4=", "12*11=", "20-7=", "0*0="]  # different lengths: left padding differs per row
    engine = HFGenerateEngine(model, codec, batch_size=5)  # 3 chunks, one of them splitting a group
    prompt_rows = []  # (rows, tokens) of every embedding lookup: the loop's forwards (it never calls model.forward)
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: prompt_rows.append(out.shape[:2]))
    try:
        got = engine_samples(engine, True, prompts, 3, 6, seed=7)
    finally:
        hook.remove()
    # chunk 1 is prompts 0, 0, 0, 1, 1: one forward over the two distinct prompts (left-padded), then 5 rows a step
    assert prompt_rows[:2] == [(2, len(codec.encode("12*11="))), (5, 1)]
    expected = reference_generate(model, codec, prompts, 3, 1.0, 6, seed=7, batch_size=5)
    assert [(s.prompt_index, s.prompt_ids, s.response_ids, s.text, s.truncated) for s in got] == expected
    through_generate = engine_samples(engine, False, prompts, 3, 6, seed=7)
    for loop, gen, (logp, entropy) in zip(got, through_generate, recomputed_logprobs(model, got), strict=True):
        assert_close(loop.token_logprobs, gen.token_logprobs, 1e-5)
        assert_close(loop.token_entropies, gen.token_entropies, 1e-5)
        assert_close(loop.token_logprobs, logp, 1e-5)
        assert_close(loop.token_entropies, entropy, 1e-4)


def test_the_prompts_common_opening_runs_once_and_the_samples_stay_generates():
    """Prompts that open alike (a chat template's system message) share that opening: it goes through the model once
    for the whole batch, each prompt's rest after it (left-padded between the two), and the tokens and log-probs are
    still generate's for the seed, rows of different prompt lengths included."""
    model, codec = load_policy(BUILTIN_MODEL)
    model.eval()
    prompts = ["1234567+1=", "1234567*23=", "1234567-333="]  # <bos> + 7 shared tokens, then 3 to 5 of their own
    common = len(codec.encode("1234567"))
    assert common >= decode.COMMON_PREFIX_MIN
    engine = HFGenerateEngine(model, codec)
    forwards = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: forwards.append(out.shape[:2]))
    try:
        got = engine_samples(engine, True, prompts, 4, 8, seed=9)
    finally:
        hook.remove()
    assert forwards[:3] == [(1, common), (3, len(codec.encode("1234567-333=")) - common), (12, 1)]
    expected = engine_samples(engine, False, prompts, 4, 8, seed=9)
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    for loop, gen in zip(got, expected, strict=True):
        assert_close(loop.token_logprobs, gen.token_logprobs, 1e-5)


def test_finished_rows_leave_the_batch_and_the_rest_sample_as_before():
    """A random model stops at random lengths: the loop drops rows that emitted eos (the batch shrinks), and every
    row's tokens, stop and truncation still equal generate's, which keeps all rows to the end."""
    model, codec = load_policy(BUILTIN_SCRATCH)
    model.eval()
    engine = HFGenerateEngine(model, codec)
    rows_per_step = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: rows_per_step.append(out.shape[0]))
    try:
        got = engine_samples(engine, True, ["1+1=", "9*9="], 12, 40, seed=3)
    finally:
        hook.remove()
    expected = engine_samples(engine, False, ["1+1=", "9*9="], 12, 40, seed=3)
    lengths = sorted(len(s.response_ids) for s in got)
    assert lengths[0] < 20 and lengths[-1] == 40  # rows finish early and late: the case that shrinks the batch
    decode_rows = rows_per_step[1:]  # after the prompt pass
    assert decode_rows[0] == 24 and min(decode_rows) < 24 and decode_rows == sorted(decode_rows, reverse=True)
    assert [(s.response_ids, s.text, s.truncated) for s in got] == [
        (s.response_ids, s.text, s.truncated) for s in expected
    ]
    for loop, gen in zip(got, expected, strict=True):
        assert_close(loop.token_logprobs, gen.token_logprobs, 1e-5)
        assert loop.truncated == (codec.eos_id not in loop.response_ids)


def test_the_noise_is_exponentials_and_the_draw_in_chunks_is_torch_multinomials_for_the_whole_batch():
    """The loop draws generate's noise vectorised, DRAW_ROWS rows at a time or the whole batch at once (whichever
    decode_kernels measured faster): either way the tokens of the active rows are what torch.multinomial draws for the
    whole batch from the same seed, the generator ends where it ends, and the log-probs and entropies are the full
    log-softmax's."""
    torch.manual_seed(5)
    expected_noise, expected_after = torch.empty(9, 700).exponential_(1), torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(decode._exponential_noise(9, 700, "cpu"), expected_noise)
    assert torch.equal(torch.rand(3), expected_after)  # the same share of the generator's stream

    batch, vocab = 11, 3000  # DRAW_ROWS (4) splits it as 4 + 4 + 3
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(batch, vocab, generator=generator) * 4).to(dtype)
        rows = torch.tensor([0, 2, 3, 4, 9, 10])  # finished rows 1, 5-8: chunk 2 has none left, chunk 1 one
        for temperature, chunk_rows in ((1.0, decode_kernels.DRAW_ROWS), (0.7, decode_kernels.DRAW_ROWS), (0.7, None)):
            scores = logits.float() / temperature
            torch.manual_seed(21)
            expected = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)[rows]
            after = torch.rand(2)
            torch.manual_seed(21)
            tokens, logp, entropy = decode.draw(logits[rows], temperature, rows, batch, chunk_rows)
            assert torch.equal(tokens, expected) and torch.equal(torch.rand(2), after)
            log_softmax = torch.log_softmax(scores[rows], dim=-1)
            assert torch.allclose(logp, log_softmax.gather(-1, tokens[:, None]).squeeze(1), atol=1e-5)
            assert torch.allclose(entropy, -(log_softmax.exp() * log_softmax).sum(-1), atol=1e-4)


def test_packed_bfloat16_weights_give_f_linears_products_to_the_bit():
    """On a CPU in bfloat16 the loop's linears read weights packed once for oneDNN; wherever this torch packs them
    (asserted where oneDNN has bf16 kernels, as here, so a torch without the ops shows, not as a slower loop), each
    product is F.linear's, for any number of rows and with a bias; elsewhere the loop keeps F.linear."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(160, 96, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(160, generator=generator).bfloat16()
    linear = decode._Linear(weight, bias, rows=32)
    assert (linear.packed is not None) == decode_kernels.packing_matches()
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert linear.packed is not None
    for shape in [(1, 96), (5, 96), (32, 96), (33, 96), (4, 17, 96)]:
        x = torch.randn(*shape, generator=generator).bfloat16()
        assert torch.equal(linear(x), torch.nn.functional.linear(x, weight, bias))
    assert decode._Linear(weight.float(), None, rows=32).packed is None  # float32 stays with F.linear
    assert decode._Linear(weight, bias, rows=32, pack=False).packed is None  # where packing measured slower


def test_the_bfloat16_loop_samples_what_generate_samples_to_bfloat16s_rounding():
    """From a bfloat16 copy (--rollout-dtype bfloat16) the loop's kernels (packed weights, SDPA for each new token)
    round otherwise than generate's: the built-in model's tokens equal generate's for the seed (all 12 rows here; a
    near-tie may part one on other hardware), and the log-probs agree with generate's where the tokens do, and with
    the bfloat16 model's own forward everywhere, to bfloat16's rounding."""
    model, codec = load_policy(BUILTIN_MODEL)
    model.eval()
    engine = HFGenerateEngine(model, codec, rollout_dtype=torch.bfloat16)
    prompts = ["3+4=", "12*11=", "20-7=", "0*0="]
    got = engine_samples(engine, True, prompts, 3, 6, seed=7)
    expected = engine_samples(engine, False, prompts, 3, 6, seed=7)
    same = [loop.response_ids == gen.response_ids for loop, gen in zip(got, expected, strict=True)]
    assert sum(same) >= 11
    for loop, gen, agree, (logp, _) in zip(got, expected, same, recomputed_logprobs(engine.model, got), strict=True):
        if agree:
            assert_close(loop.token_logprobs, gen.token_logprobs, 0.05)
        assert_close(loop.token_logprobs, logp, 0.05)


@pytest.mark.parametrize(
    "kernels",
    [
        Kernels(pack=False, sdpa_per_token=False, draw_rows=None),
        Kernels(pack=True, sdpa_per_token=True, draw_rows=decode_kernels.DRAW_ROWS),
        Kernels(pack=True, sdpa_per_token=False, draw_rows=decode_kernels.DRAW_ROWS),
        Kernels(pack=False, sdpa_per_token=True, draw_rows=None),
    ],
    ids=["plain", "packed-sdpa-chunked", "packed-matmul-chunked", "sdpa-whole-batch"],
)
def test_every_kernel_choice_samples_what_generate_samples(kernels, monkeypatch):
    """Whichever options decode_kernels measures faster on a CPU, the loop samples what generate samples: each
    combination forced here, in float32 (the same tokens, log-probs to float32 rounding) and from a bfloat16 copy (the
    tokens of all but a near-tie, log-probs as close to the bfloat16 model's own forward as generate's)."""
    monkeypatch.setattr(decode_kernels, "for_model", lambda model, draw: kernels)
    model, codec = load_policy(BUILTIN_MODEL)
    model.eval()
    prompts = ["3+4=", "12*11=", "20-7=", "0*0="]
    engine = HFGenerateEngine(model, codec)
    got, expected = (engine_samples(engine, loop, prompts, 3, 6, seed=7) for loop in (True, False))
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    for loop, gen in zip(got, expected, strict=True):
        assert_close(loop.token_logprobs, gen.token_logprobs, 1e-5)
        assert_close(loop.token_entropies, gen.token_entropies, 1e-4)
    bf16 = HFGenerateEngine(model, codec, rollout_dtype=torch.bfloat16)
    got, expected = (engine_samples(bf16, loop, prompts, 3, 6, seed=7) for loop in (True, False))
    assert sum(a.response_ids == b.response_ids for a, b in zip(got, expected, strict=True)) >= 11
    assert mean_logprob_error(bf16.model, got) <= 1.5 * mean_logprob_error(bf16.model, expected) + 1e-3


def test_the_faster_option_is_chosen_and_a_near_tie_keeps_the_default():
    """decode_kernels.fastest on a clock the options advance by known amounts: the other option is chosen only when
    its best run takes less than SWITCH_MARGIN of the default's, whatever a single slow run of either says."""

    def timeline(costs: dict[str, list[float]]):
        now = [0.0]
        runs = {name: iter(values) for name, values in costs.items()}

        def option(name):
            return lambda: now.__setitem__(0, now[0] + next(runs[name]))

        return option, (lambda: now[0])

    for default_s, other_s, chosen in (
        ([5, 4, 9, 4, 4, 4], [9, 2, 2, 9, 2, 2], True),  # 2 < 0.9 x 4
        ([5, 4, 4, 4, 4, 4], [9, 3.8, 3.8, 3.8, 3.8, 3.8], False),  # 3.8 > 0.9 x 4
        ([5, 1, 9, 9, 9, 9], [5, 2, 2, 2, 2, 2], False),
    ):  # the default's best: 1
        option, clock = timeline({"default": default_s, "other": other_s})
        assert decode_kernels.fastest(option("default"), option("other"), rounds=5, clock=clock) is chosen


def test_choosing_the_kernels_draws_nothing_from_the_seeded_generator():
    """The engine seeds torch's generator and then samples; choosing the kernels on the way (once per process) runs
    the draw, which must not move the generator, or the first call's samples would depend on whether the choice was
    cached."""
    torch.manual_seed(13)
    expected = torch.rand(4)
    torch.manual_seed(13)
    chosen = decode_kernels.choose.__wrapped__("cpu", torch.float32, 32, 64, 300, decode.draw)
    assert isinstance(chosen, Kernels) and torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_kernel_follows_the_cpu_never_the_clock(monkeypatch, dtype):
    """SDPA and the grouped matmuls differ in their last float32 bits, so a timed choice let two processes of one
    launch (or a run and its resume) sample other tokens from the same seed: a 2-process run's cov_logp_adv was
    0.15237 against the 1-process 0.15173. Whatever the timings say, the attention is the CPU's."""
    for faster in (True, False):
        monkeypatch.setattr(decode_kernels, "fastest", lambda *args, faster=faster, **kwargs: faster)
        chosen = decode_kernels.choose.__wrapped__("cpu", dtype, 32, 64, 300, decode.draw)
        assert chosen.draw_rows == (None if faster else decode_kernels.DRAW_ROWS)  # the timed choices follow it
        assert chosen.sdpa_per_token == (dtype == torch.bfloat16 and decode_kernels.onednn_has_bf16_kernels())


def test_models_the_loop_cannot_run_are_left_to_generate():
    model, _ = load_policy(BUILTIN_SCRATCH)
    lora = apply_lora(model, rank=2)
    assert not decode.supports_decode_loop(lora.get_base_model())  # peft's adapted linears: generate samples them


@pytest.mark.slow
def test_decode_loop_samples_what_generate_samples_on_smollm2(smollm2_gguf):
    model, codec = load_policy(str(smollm2_gguf))
    model.eval()
    assert decode.supports_decode_loop(model)
    prompts = ["What is 7 + 8? Reply with just the number.", "Name a colour."]  # chat template, different lengths
    engine = HFGenerateEngine(model, codec)
    got = engine_samples(engine, True, prompts, 3, 16, seed=11)
    expected = engine_samples(engine, False, prompts, 3, 16, seed=11)
    assert [(s.response_ids, s.text, s.truncated) for s in got] == [
        (s.response_ids, s.text, s.truncated) for s in expected
    ]
    assert any(not s.truncated for s in got)  # some rows end their turn (<|im_end|>) before the limit
    for loop, gen, (logp, _) in zip(got, expected, recomputed_logprobs(model, got), strict=True):
        assert_close(loop.token_logprobs, gen.token_logprobs, 1e-4)
        assert_close(loop.token_entropies, gen.token_entropies, 1e-3)
        assert_close(loop.token_logprobs, logp, 1e-4)

    # from a bfloat16 copy the two round differently, so tokens part ways: each is judged by the bfloat16 model's own
    # forward over its samples, the loop no further from it on average than generate (measured: 0.042 and 0.044)
    bf16 = HFGenerateEngine(model, codec, rollout_dtype=torch.bfloat16)
    loop_error, generate_error = (
        mean_logprob_error(bf16.model, engine_samples(bf16, use_loop, prompts, 3, 24, 11)) for use_loop in (True, False)
    )
    assert loop_error < 1.5 * generate_error and loop_error < 0.1


def logprob_errors(model, samples, temperature: float = 1.0) -> list[float]:
    return [
        abs(a - b)
        for s, (logp, _) in zip(samples, recomputed_logprobs(model, samples, temperature), strict=True)
        for a, b in zip(s.token_logprobs, logp, strict=True)
    ]


def mean_logprob_error(model, samples) -> float:
    errors = logprob_errors(model, samples)
    return sum(errors) / len(errors)


@pytest.mark.slow
def test_the_bfloat16_loop_follows_a_sharp_policy_late_in_training_as_closely_as_generate(tmp_path):
    """15 RL steps of 4 prompts x 8 on arith at temperature 0.5 sharpen the built-in model (its sampled tokens' mean
    log-prob near 0, where a bfloat16 rounding weighs most on the few unlikely tokens still sampled, and the temperature
    scales every logit's rounding by 2): from a bfloat16 copy of the trained weights, the loop's log-probs are no
    further from the bfloat16 model's own forward than generate's, on average and at the worst token, and no further
    from the float32 trainer's. (The built-in model's 4 layers of width 128 round less than SmolLM2's 30 of 576;
    decode.py's docstring gives SmolLM2's figures.)"""
    cfg = build_config(
        run_name="sharp",
        steps=15,
        prompts_per_step=4,
        group_size=8,
        eval_every=0,
        checkpoint_every=0,
        seed=2,
        lr=2e-4,
        temperature=0.5,
    )
    trainer = Trainer(cfg, tmp_path, cpu=True)
    trainer.fit()
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    prompts = [trainer.task.prompt(p) for p in trainer.task.train[:8]]
    bf16 = HFGenerateEngine(model, trainer.codec, rollout_dtype=torch.bfloat16)
    loop, gen = (engine_samples(bf16, use_loop, prompts, 4, 8, seed=5, temperature=0.5) for use_loop in (True, False))
    sampled = [lp for s, (logp, _) in zip(loop, recomputed_logprobs(model, loop, 0.5), strict=True) for lp in logp]
    assert sum(sampled) / len(sampled) > -0.25  # sharp (measured: -0.08): most sampled tokens nearly certain
    for reference in (bf16.model, model):  # the bf16 forward, and the float32 trainer
        loop_errors, gen_errors = logprob_errors(reference, loop, 0.5), logprob_errors(reference, gen, 0.5)
        assert sum(loop_errors) / len(loop_errors) <= 1.5 * sum(gen_errors) / len(gen_errors) + 1e-3
        assert max(loop_errors) <= 1.5 * max(gen_errors) + 1e-2
