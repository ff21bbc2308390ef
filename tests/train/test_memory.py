"""The memory options change how the update is computed, never what it computes: the chunked vocabulary projection
(--logprob-chunk-tokens), gradient checkpointing (--gradient-checkpointing) and token-budget micro-batches
(--max-tokens-per-micro-batch) each give the plain update's parameters to float64 rounding, on a real (tiny)
transformers Llama, and the trainer's rows with each are those without."""

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
import torch

from qae_app.algo.chunked_head import logprob_chunk_tokens
from qae_app.config import build_config
from qae_app.core.errors import QAEUserError
from qae_app.models.policy import enable_gradient_checkpointing
from qae_app.train import update
from qae_app.train.trainer import Trainer


def tiny_llama(seed: int = 0):
    """A 2-layer float64 transformers Llama with an untied head, small enough to run many updates."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).double()


def varied_batch(n: int = 10, seed: int = 0):
    """n sequences whose lengths vary wildly (prompts of 1-12 tokens, responses of 1-24), right-padded by `pack`,
    and their advantages, half of them 0 (gated)."""
    rng = random.Random(seed)
    samples = [
        SimpleNamespace(
            prompt_ids=[rng.randrange(1, 32) for _ in range(rng.choice([1, 2, 5, 12]))],
            response_ids=[rng.randrange(1, 32) for _ in range(rng.choice([1, 3, 9, 24]))],
        )
        for _ in range(n)
    ]
    advantages = torch.tensor([rng.choice([-1.0, 0.7]) if i % 2 else 0.0 for i in range(n)], dtype=torch.float64)
    return update.pack(samples, pad_id=0, device="cpu", float_dtype=torch.float64), advantages


def options(**changes):
    base = update.UpdateOptions(
        num_mini_batches=2,
        ppo_epochs=2,
        micro_batch_size=2,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token",
        kl_beta=0.0,
        max_grad_norm=1e9,
        max_new_tokens=24,
        temperature=0.9,
        logits_keyword="logits_to_keep",
    )
    return dataclasses.replace(base, **changes)


def updated_parameters(opts, checkpointing: bool = False, full_pass: bool = True, layer_runs: list | None = None):
    """Parameters and stats after policy_update (2 mini-batches x 2 epochs, AdamW) of a fresh tiny Llama;
    `layer_runs` gets one entry per run of a decoder layer's MLP (forward, or recomputed in the backward)."""
    model = tiny_llama()
    if checkpointing:
        enable_gradient_checkpointing(model)
    if layer_runs is not None:
        for layer in model.model.layers:
            # (a pre-hook: the recomputation stops once it has what the backward needs, before the MLP returns)
            layer.mlp.register_forward_pre_hook(lambda *_: layer_runs.append(1))
    batch, advantages = varied_batch()
    result = update.policy_update(
        model, torch.optim.AdamW(model.parameters(), lr=0.05), batch, advantages, opts, seed=4, full_pass=full_pass
    )
    return [p.detach().clone() for p in model.parameters()], result


def assert_same_update(got, want):
    (got_params, got_result), (want_params, want_result) = got, want
    for g, w in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    assert got_result.stats == pytest.approx(want_result.stats, rel=1e-9, abs=1e-12)
    if want_result.old_logp is not None:  # at the response tokens (positions predicting padding: whatever)
        response = varied_batch()[0]["response_mask"].bool()  # (N, T-1)
        torch.testing.assert_close(got_result.old_logp[response], want_result.old_logp[response], rtol=0, atol=1e-10)
        torch.testing.assert_close(got_result.entropy[response], want_result.entropy[response], rtol=0, atol=1e-10)


def test_the_update_through_the_chunked_head_is_the_full_logits_update():
    """Chunks of 7 tokens (the forward and backward never hold more than 7 x vocab logits): the same parameters."""
    plain = updated_parameters(options())
    chunked = updated_parameters(options(logprob_chunk_tokens=7))
    assert plain[1].stats["pg_loss"] != 0  # (a real update)
    assert_same_update(chunked, plain)


def test_gradient_checkpointing_gives_the_same_update_and_recomputes_the_layers():
    """The layers run again in the backward (the checkpointing is real), and the parameters are the same."""
    plain_runs, checkpointed_runs = [], []
    plain = updated_parameters(options(), layer_runs=plain_runs)
    checkpointed = updated_parameters(options(), checkpointing=True, layer_runs=checkpointed_runs)
    assert len(checkpointed_runs) > len(plain_runs)
    assert_same_update(checkpointed, plain)
    both = updated_parameters(options(logprob_chunk_tokens=5), checkpointing=True)
    assert_same_update(both, plain)


def test_token_budget_micro_batches_give_the_fixed_micro_batch_update():
    """Budgets that pack 1 to all of a mini-batch's sequences, cut to their longest: the same parameters, old
    log-probs and entropies (in the batch's order) as fixed micro-batches of 2 at the full width."""
    plain = updated_parameters(options())
    batch, _ = varied_batch()
    longest = int(batch["attention_mask"].sum(-1).max())
    for budget in (longest, 2 * longest, 50, 10_000):
        assert_same_update(updated_parameters(options(max_tokens_per_micro_batch=budget)), plain)
    assert_same_update(
        updated_parameters(options(max_tokens_per_micro_batch=50, logprob_chunk_tokens=3), checkpointing=True), plain
    )


def test_micro_batch_plan_sorts_by_length_and_packs_to_the_budget():
    """Lengths 3, 9, 4, 9, 1 (prompt + response tokens), budget 18: longest first, sequences x longest <= 18."""
    samples = [
        SimpleNamespace(prompt_ids=[1] * p, response_ids=[2] * r) for p, r in ((1, 2), (4, 5), (2, 2), (8, 1), (1, 0))
    ]
    batch = update.pack(samples, pad_id=0, device="cpu")
    rows = torch.tensor([4, 0, 1, 2, 3])  # (the plan's positions are into these rows)
    plan = update.micro_batch_plan(batch, rows, options(max_tokens_per_micro_batch=18))
    assert [(rows[positions].tolist(), width) for positions, width in plan] == [([1, 3], 9), ([2, 0, 4], 4)]
    fixed = update.micro_batch_plan(batch, rows, options(micro_batch_size=2))
    assert [(rows[positions].tolist(), width) for positions, width in fixed] == [
        ([4, 0], None),
        ([1, 2], None),
        ([3], None),
    ]
    # a sequence longer than the budget is a micro-batch of its own
    plan = update.micro_batch_plan(batch, rows, options(max_tokens_per_micro_batch=5))
    assert [rows[positions].tolist() for positions, _ in plan] == [[1], [3], [2], [0], [4]]


def test_token_budget_lockstep_runs_as_many_forwards_as_the_busiest_process(monkeypatch):
    """With sharded weights every process runs as many forwards as the busiest: the token-budget plan's count is what
    lockstep_forwards is asked about, for the training and for the no-grad passes."""
    asked = []
    monkeypatch.setattr(update, "lockstep_forwards", lambda count, opts, acc: (asked.append(count), count + 1)[1])
    batch, advantages = varied_batch()
    model = tiny_llama()
    rows = torch.arange(len(advantages))
    update.logprobs_in_chunks(model, batch, rows, options(max_tokens_per_micro_batch=50, lockstep=True))
    assert asked == [len(update.micro_batch_plan(batch, rows, options(max_tokens_per_micro_batch=50)))]


# ---------------------------------------------------------------------------------------------------------------
# the options, in the trainer


def _rows_after_two_steps(tmp_path, name, float64: bool = False, **opts):
    cfg = build_config(run_name=name, steps=2, eval_every=0, checkpoint_every=0, seed=3, num_mini_batches=4, **opts)
    trainer = Trainer(cfg, tmp_path, cpu=True)
    if float64:
        trainer.model.double()
    try:
        outs = [trainer.train_step(step) for step in (1, 2)]
        params = [p.detach().clone() for p in trainer.model.parameters()]
        chunk_tokens = trainer.logprob_chunk_tokens
    finally:
        trainer.close()
    return params, outs, chunk_tokens


def _assert_same_rows(got, want, atol):
    (got_params, got_outs, _), (want_params, want_outs, _) = got, want
    for g, w in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=atol)
    for g, w in zip(got_outs, want_outs, strict=True):
        assert [r["response"] for r in g.rollouts] == [r["response"] for r in w.rollouts]
        for name in ("loss", "pg_loss", "grad_norm", "clip_frac", "entropy", "reward_mean"):
            assert g.metrics[name] == pytest.approx(w.metrics[name], rel=1e-5, abs=1e-7), name
        for key in ("entropy", "logprob", "advantage"):
            assert [r[key] for r in g.rollouts] == pytest.approx([r[key] for r in w.rollouts], rel=1e-5, abs=1e-6)


def test_a_run_through_the_chunked_head_stores_the_rows_of_a_run_through_the_full_logits(tmp_path):
    """The default (chunks of 256 MiB: the whole built-in vocabulary's 64 columns at once is still one chunk) and a
    chunk of 3 tokens against --logprob-chunk-tokens 0, float32: the same responses, metrics and weights."""
    plain = _rows_after_two_steps(tmp_path, "plain", logprob_chunk_tokens=0)
    assert plain[2] == 0
    for chunk in (None, 3):
        chunked = _rows_after_two_steps(tmp_path, f"chunk{chunk}", logprob_chunk_tokens=chunk)
        assert chunked[2] == (chunk or 2**28 // (64 * 4))
        _assert_same_rows(chunked, plain, atol=1e-5)


def test_checkpointing_and_token_budget_with_the_gated_skip_keep_the_built_in_models_update(tmp_path):
    """Float64 built-in model, the gated skip on: the same weights after 2 RL steps (to float64 rounding) and the same
    rows, with gradient checkpointing and token-budget micro-batches."""
    plain = _rows_after_two_steps(tmp_path, "plain", float64=True)
    both = _rows_after_two_steps(
        tmp_path, "both", float64=True, gradient_checkpointing=True, max_tokens_per_micro_batch=60
    )
    _assert_same_rows(both, plain, atol=1e-10)


def test_a_model_the_chunked_head_refuses_uses_the_full_logits_and_says_so_once(tmp_path):
    messages = []
    cfg = build_config(run_name="capped", steps=1, eval_every=0, checkpoint_every=0)
    trainer = Trainer(cfg, tmp_path, cpu=True, console=SimpleNamespace(print=messages.append))
    try:
        messages.clear()
        trainer.accelerator.unwrap_model(trainer.model).config.final_logit_softcapping = 30.0
        assert logprob_chunk_tokens(trainer.model, None, trainer._say) == 0
        assert len(messages) == 1 and "full logits" in messages[0] and "final_logit_softcapping" in messages[0]
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "value, message",
    [
        (0, "max-tokens-per-micro-batch: 0 is less than 1, the least it may be"),
        (-3, "max-tokens-per-micro-batch: -3 is less than 1"),
        (8, "max-tokens-per-micro-batch: 8 tokens cannot hold one sequence of a prompt and max-new-tokens 8"),
    ],
)
def test_bad_token_budgets_are_refused_naming_the_option(value, message):
    with pytest.raises(QAEUserError, match=message):
        build_config(max_tokens_per_micro_batch=value)


def test_a_token_budget_below_the_longest_prompt_plus_the_response_is_refused_before_the_run(tmp_path):
    """builtin:arith prompts are up to ~15 tokens: with --max-new-tokens 8 a budget of 12 fits none of them."""
    with pytest.raises(
        QAEUserError,
        match=r"max-tokens-per-micro-batch: 12 tokens cannot hold the data's prompt .* "
        r"Use at least \d+",
    ):
        Trainer(build_config(run_name="tight", max_tokens_per_micro_batch=12), tmp_path, cpu=True)
    assert not (tmp_path / "tight").exists()


def test_a_negative_chunk_size_is_refused():
    with pytest.raises(QAEUserError, match="logprob-chunk-tokens: -1 is less than 0"):
        build_config(logprob_chunk_tokens=-1)


@pytest.mark.slow  # (three short runs: over a minute here)
def test_mixed_precision_no_is_todays_run_and_bf16_trains_float32_weights_on_cpu(tmp_path):
    """--mixed-precision no gives exactly the run without the option; bf16 (accelerate's autocast, float32 master
    weights) runs on a CPU, keeps the weights float32, moves them, and the run's stored config says what ran."""
    import json

    from qae_app.store.reader import read_run
    from qae_app.store.run_folder import db_path

    today = _rows_after_two_steps(tmp_path, "today")
    plain = _rows_after_two_steps(tmp_path, "no", mixed_precision="no")
    _assert_same_rows(plain, today, atol=0)
    from accelerate.state import AcceleratorState

    # accelerate keeps one mixed-precision setting per process (a run is one process): let this test's differ, and
    # give the next test the default back
    AcceleratorState._reset_state()
    cfg = build_config(run_name="bf16", steps=1, eval_every=0, checkpoint_every=0, seed=3, mixed_precision="bf16")
    trainer = Trainer(cfg, tmp_path, cpu=True)
    try:
        before = [p.detach().clone() for p in trainer.model.parameters()]
        assert trainer.accelerator.mixed_precision == "bf16"
        out = trainer.train_step(1)
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))
        assert all(math.isfinite(out.metrics[name]) for name in ("loss", "grad_norm", "entropy"))
    finally:
        trainer.close()
        AcceleratorState._reset_state()
    assert json.loads(read_run(db_path(tmp_path, "bf16"))["config"])["mixed_precision"] == "bf16"


def test_bf16_mixed_precision_on_bf16_weights_is_refused():
    with pytest.raises(QAEUserError, match="mixed-precision: bf16 keeps float32 master weights, but --dtype bfloat16"):
        build_config(mixed_precision="bf16", dtype="bfloat16")


def test_a_launch_in_mixed_precision_is_not_silently_overridden(monkeypatch):
    """accelerate launch --mixed_precision bf16 sets ACCELERATE_MIXED_PRECISION; qae train's own default ("no") would
    win at the Accelerator, so the run is refused with both values named instead of training in float32 unasked."""
    from qae_app.config import check_launch_mixed_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(
        QAEUserError, match="accelerate launch asked for 'bf16' but qae train's --mixed-precision is 'no'"
    ):
        check_launch_mixed_precision("no")
    check_launch_mixed_precision("bf16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # the launcher's default: qae's option decides
    check_launch_mixed_precision("bf16")
    check_launch_mixed_precision("no")
