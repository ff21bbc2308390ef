"""Chunked log-probs through the LM head: equal to the plain path (full logits, then losses.token_logprobs_and_entropy)
in values and gradients, for any chunk size, and through real Hugging Face models."""

import math

import pytest
import torch
import torch.nn.functional as F

from qae_app.algo.chunked_head import default_chunk_tokens, head_logprobs_and_entropy
from qae_app.algo.losses import token_logprobs_and_entropy


def plain_head_logprobs(hidden, weight, bias, targets, temperature, with_entropy=True):
    """The reference: the full logits (N, T, vocab), then the plain path."""
    return token_logprobs_and_entropy(F.linear(hidden, weight, bias), targets, temperature, with_entropy)


def head_inputs(n=3, t=5, width=8, vocab=50, dtype=torch.float64, seed=0, scale=1.0):
    """(hidden (n, t, width), weight (vocab, width), bias (vocab,), targets (n, t)), the first three leaves that
    require grad."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, t, width, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n, t), generator=gen)
    return hidden, weight, bias, targets


def values_and_grads(compute, leaves, upstream_logp, upstream_entropy=None):
    """(logp, entropy, grads of sum(upstream_logp * logp + upstream_entropy * entropy) w.r.t. leaves)."""
    logp, entropy = compute()
    loss = (upstream_logp * logp).sum()
    if upstream_entropy is not None:
        loss = loss + (upstream_entropy * entropy).sum()
    return logp.detach(), entropy.detach() if entropy is not None else None, torch.autograd.grad(loss, leaves)


def max_relative_gap(ours, reference):
    return ((ours.double() - reference.double()).abs().max() / reference.double().abs().max().clamp(min=1e-300)).item()


# ---- the head alone --------------------------------------------------------------------------------------------------


def test_zero_weights_give_the_uniform_distribution():
    """Hand-computed: all logits 0 -> every token has log-prob -log V, every position entropy log V."""
    vocab = 64
    hidden = torch.randn(2, 3, 4)
    logp, entropy = head_logprobs_and_entropy(
        hidden, torch.zeros(vocab, 4), None, torch.zeros(2, 3, dtype=torch.long), temperature=0.5, chunk_tokens=4
    )
    assert logp.shape == entropy.shape == (2, 3)
    assert torch.allclose(logp, torch.full((2, 3), -math.log(vocab)))
    assert torch.allclose(entropy, torch.full((2, 3), math.log(vocab)))


# chunk sizes: 1, one that divides none of the 15 rows' splits evenly, the default, exactly all rows, more than all
@pytest.mark.parametrize("chunk_tokens", [1, 4, None, 15, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_values_and_gradients_equal_the_plain_path(chunk_tokens, temperature):
    hidden, weight, bias, targets = head_inputs()
    leaves = (hidden, weight, bias)
    gen = torch.Generator().manual_seed(1)
    up_logp, up_entropy = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    ref = values_and_grads(
        lambda: plain_head_logprobs(hidden, weight, bias, targets, temperature), leaves, up_logp, up_entropy
    )
    ours = values_and_grads(
        lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, temperature, chunk_tokens=chunk_tokens),
        leaves,
        up_logp,
        up_entropy,
    )
    assert ours[0].dtype == ours[1].dtype == torch.float64
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-10)
    for mine, theirs in zip(ours[2], ref[2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_log_probs_alone_and_no_bias_equal_the_plain_path():
    """The trainer's grad pass: log-probs only (no entropy computed), a head without bias."""
    hidden, weight, _, targets = head_inputs(vocab=37)
    up_logp = torch.randn(3, 5, dtype=torch.float64)
    ref = values_and_grads(
        lambda: plain_head_logprobs(hidden, weight, None, targets, 1.3, False), (hidden, weight), up_logp
    )
    ours = values_and_grads(
        lambda: head_logprobs_and_entropy(hidden, weight, None, targets, 1.3, False, 6), (hidden, weight), up_logp
    )
    assert ours[1] is None
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    for mine, theirs in zip(ours[2], ref[2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_entropy_alone_has_the_plain_gradient():
    """A loss of the entropy only (the log-probs' gradient is None in the backward)."""
    hidden, weight, bias, targets = head_inputs(vocab=20)
    leaves = (hidden, weight, bias)
    ref = torch.autograd.grad(plain_head_logprobs(hidden, weight, bias, targets, 0.9)[1].sum(), leaves)
    ours = torch.autograd.grad(
        head_logprobs_and_entropy(hidden, weight, bias, targets, 0.9, chunk_tokens=2)[1].sum(), leaves
    )
    for mine, theirs in zip(ours, ref, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_masked_padding_positions_give_the_plain_gradient():
    """Padded positions (pad id targets, mask 0) as the loss sees them: the masked loss's gradient is the plain one."""
    hidden, weight, bias, targets = head_inputs(n=4, t=6, vocab=30)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 3:] = 0  # a short response
    mask[3] = 0  # a placeholder row
    targets = torch.where(mask.bool(), targets, torch.zeros_like(targets))  # pad id 0 after the end
    leaves = (hidden, weight, bias)
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, bias, targets, 1.0, False), leaves, mask)
    ours = values_and_grads(
        lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, False, 5), leaves, mask
    )
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    assert ours[2][0][3].abs().max() == 0  # no gradient reaches a fully masked row
    for mine, theirs in zip(ours[2], ref[2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)


def test_float32_equals_the_plain_path_to_float32_rounding():
    """Values within 1e-6 (relative to the largest) of the plain path's; gradients within 2e-6: on these sizes each
    path's gradients are ~1e-6 from the float64 ones (float32's own rounding over sums of 1000 terms, in another
    order)."""
    hidden, weight, bias, targets = head_inputs(n=4, t=33, width=32, vocab=1000, dtype=torch.float32, scale=0.5)
    leaves = (hidden, weight, bias)
    up_logp, up_entropy = torch.randn(2, 4, 33, generator=torch.Generator().manual_seed(2))
    ref = values_and_grads(lambda: plain_head_logprobs(hidden, weight, bias, targets, 0.8), leaves, up_logp, up_entropy)
    ours = values_and_grads(
        lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 0.8, chunk_tokens=10),
        leaves,
        up_logp,
        up_entropy,
    )
    bounds = [1e-6] * 2 + [2e-6] * 3
    for mine, theirs, bound in zip([ours[0], ours[1], *ours[2]], [ref[0], ref[1], *ref[2]], bounds, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32
        assert max_relative_gap(mine, theirs) < bound


def test_bf16_weights_give_bf16_gradients_close_to_float32():
    """bf16 head: logits from the bf16 matmul (as the model's head), softmax in float32, gradients in bf16; compared
    with the float32 computation on the same (bf16-representable) numbers, to bf16's precision."""
    hidden, weight, bias, targets = head_inputs(n=2, t=40, width=32, vocab=500, dtype=torch.bfloat16, scale=0.3)
    leaves = (hidden, weight, bias)
    up_logp, up_entropy = torch.randn(2, 2, 40, generator=torch.Generator().manual_seed(3))
    ours = values_and_grads(
        lambda: head_logprobs_and_entropy(hidden, weight, bias, targets, 0.9, chunk_tokens=7),
        leaves,
        up_logp,
        up_entropy,
    )
    as_float32 = [x.detach().float().requires_grad_() for x in leaves]
    ref = values_and_grads(lambda: plain_head_logprobs(*as_float32, targets, 0.9), as_float32, up_logp, up_entropy)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    assert [g.dtype for g in ours[2]] == [torch.bfloat16] * 3
    assert (ours[0] - ref[0]).abs().max() < 0.05  # log-probs ~ -6: bf16 logits (8 bits) are off by ~1e-2
    assert (ours[1] - ref[1]).abs().max() < 0.05
    for mine, theirs in zip(ours[2], ref[2], strict=True):
        assert max_relative_gap(mine, theirs) < 2e-2
    # and the same numbers as the plain path on the bf16 head (its logits upcast to float32)
    plain_bf16 = plain_head_logprobs(*leaves, targets, 0.9)
    torch.testing.assert_close(ours[0], plain_bf16[0].detach(), rtol=0, atol=1e-5)


def test_gradcheck_in_float64():
    hidden, weight, bias, targets = head_inputs(n=2, t=3, width=4, vocab=6)

    def both_outputs(h, w, b):
        return head_logprobs_and_entropy(h, w, b, targets, 0.7, chunk_tokens=4)

    assert torch.autograd.gradcheck(both_outputs, (hidden, weight, bias))


def test_without_grad_it_keeps_nothing_for_a_backward():
    hidden, weight, bias, targets = head_inputs()
    with torch.inference_mode():
        logp, entropy = head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, chunk_tokens=4)
    ref = plain_head_logprobs(hidden, weight, bias, targets, 1.0)
    assert not logp.requires_grad and logp.grad_fn is None
    torch.testing.assert_close(logp, ref[0].detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(entropy, ref[1].detach(), rtol=0, atol=1e-10)


def test_default_chunk_is_256_mib_of_float32_logits():
    assert default_chunk_tokens(151936) == 441  # 441 x 151936 x 4 bytes = 255.6 MiB
    assert default_chunk_tokens(64) == 2**20
    assert default_chunk_tokens(10**9) == 1


def test_bad_inputs_name_the_argument():
    hidden, weight, bias, targets = head_inputs(vocab=10)
    with pytest.raises(ValueError, match="chunk_tokens: 0"):
        head_logprobs_and_entropy(hidden, weight, bias, targets, 1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match="token id 10 is outside"):
        head_logprobs_and_entropy(hidden, weight, bias, torch.full_like(targets, 10), 1.0)
    with pytest.raises(ValueError, match="targets: shape"):
        head_logprobs_and_entropy(hidden, weight, bias, targets[:, :2], 1.0)
    with pytest.raises(ValueError, match="head_weight: shape"):
        head_logprobs_and_entropy(hidden, weight.reshape(-1), bias, targets, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        head_logprobs_and_entropy(hidden.float(), weight, bias, targets, 1.0)


# ---- through Hugging Face causal LMs ---------------------------------------------------------------------------------


def trainer_plain_logprobs(model, input_ids, attention_mask, first, temperature, with_entropy):
    """What Trainer._forward_logprobs computes today: the logits from `first` on, then the plain path, padded."""
    width = input_ids.shape[1]
    keep = {"logits_to_keep": width - first} if first else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep).logits[:, :-1]
    logp, entropy = token_logprobs_and_entropy(logits, input_ids[:, first + 1 :], temperature, with_entropy)
    if first:
        logp = F.pad(logp, (first, 0))
        entropy = F.pad(entropy, (first, 0)) if entropy is not None else None
    return logp, entropy


def tiny_builtin():
    from qae_app.models.policy import build_tiny_model

    return build_tiny_model()[0]  # Llama, 4 layers, tied embeddings


def tiny_llama_untied():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    )


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=120,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )


def left_padded_batch(vocab, n=3, width=14, seed=0):
    """(input_ids, attention_mask (n, width)) with left padding (pad id 0) as the trainer's batches have."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (n, width), generator=gen)
    attention_mask = torch.ones(n, width, dtype=torch.long)
    attention_mask[0, :3] = 0
    attention_mask[2, :1] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


@pytest.mark.parametrize("build", [tiny_builtin, tiny_llama_untied, tiny_qwen3])
@pytest.mark.parametrize("first", [0, 5])
def test_causal_lm_log_probs_and_parameter_gradients_equal_the_trainers_path(build, first):
    """float64: the no-grad pass (log-probs and entropies) and the grad pass (log-probs; gradients of every parameter,
    tied embeddings included) equal the full-logits path to 1e-10."""
    from qae_app.algo.chunked_head import causal_lm_logprobs

    model = build().double()
    model.eval()  # as the trainer's forwards (and no dropout either way)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    with torch.inference_mode():
        ref = trainer_plain_logprobs(model, input_ids, attention_mask, first, 0.8, True)
        ours = causal_lm_logprobs(model, input_ids, attention_mask, first, 0.8, True, chunk_tokens=7)
    assert ours[0].shape == ours[1].shape == (3, 13)
    assert (ours[0][:, :first] == 0).all() and (ours[1][:, :first] == 0).all()
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=1e-10)

    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(3, 13, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    weights[:, :first] = 0
    ref_grads = torch.autograd.grad(
        (weights * trainer_plain_logprobs(model, input_ids, attention_mask, first, 0.8, False)[0]).sum(), params
    )
    logp, entropy = causal_lm_logprobs(model, input_ids, attention_mask, first, 0.8, False, chunk_tokens=7)
    assert entropy is None
    grads = torch.autograd.grad((weights * logp).sum(), params)
    for (name, _), mine, theirs in zip(model.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10, msg=name)


@pytest.fixture
def one_process_group():  # (tests using it carry a short timeout: one run hung once in gloo, unexplained)
    """A gloo process group of this process alone, for wrapping a model in DDP or FSDP."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_causal_lm_through_a_ddp_wrapper(one_process_group):
    """The trainer's model is DDP-wrapped with several processes: the forward goes through the wrapper (so DDP's
    gradient hooks run) and the head is found on the module inside."""
    from torch.nn.parallel import DistributedDataParallel

    from qae_app.algo.chunked_head import causal_lm_logprobs

    model = tiny_llama_untied().double()
    input_ids, attention_mask = left_padded_batch(90, seed=1)
    params = list(model.parameters())
    ref_grads = torch.autograd.grad(
        trainer_plain_logprobs(model, input_ids, attention_mask, 4, 1.0, False)[0].sum(), params
    )
    wrapped = DistributedDataParallel(model)
    causal_lm_logprobs(wrapped, input_ids, attention_mask, 4, 1.0, False)[0].sum().backward()
    for p, theirs in zip(params, ref_grads, strict=True):
        torch.testing.assert_close(p.grad, theirs, rtol=0, atol=1e-10)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # (one process: nothing to shard)
def test_an_fsdp1_model_is_refused(one_process_group):
    """FSDP1 wrapped as accelerate does (each layer, then the root): its flat parameters are not reached here, so the
    chunked path says to use FSDP2 or the full logits. (ZeRO-3 is refused the same way, by its ds_id; no DeepSpeed
    here to test it.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from qae_app.algo.chunked_head import causal_lm_logprobs
    from qae_app.core.errors import QAEUserError

    model = FullyShardedDataParallel(
        tiny_builtin(),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )
    input_ids, attention_mask = left_padded_batch(64)
    with pytest.raises(QAEUserError, match="sharded by FSDP1.*--logprob-chunk-tokens 0"):
        causal_lm_logprobs(model, input_ids, attention_mask, 2, 1.0)


def fsdp2_sharded(model, root_reshards: bool):
    """fully_shard per decoder layer, then the root, as qae_app/models/sharding.py does (the root keeps its weights
    gathered after the forward), or with the root resharded after the forward too (accelerate's
    fsdp_reshard_after_forward: true on GPUs); one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qae_app.models.sharding import decoder_layers, shard_model

    mesh = init_device_mesh("cpu", (1,))
    if not root_reshards:
        return shard_model(model, mesh)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh, reshard_after_forward=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("root_reshards", [False, True], ids=["root-kept", "root-resharded"])
@pytest.mark.parametrize("build", [tiny_builtin, tiny_llama_untied], ids=["tied", "untied"])
def test_fsdp2_chunked_head_gradients_reach_the_shards_as_the_full_logits_do(one_process_group, build, root_reshards):
    """FSDP2 (one process here; two in tests/e2e/test_fsdp2.py): the chunked path reads the gathered head weight after
    the forward, and the gradient it gives it is reduce-scattered into the sharded parameters (DTensors), equal to the
    full logits' through the same sharded model, for every parameter (tied embeddings: both uses summed); float64,
    1e-10. Had the head's gradient gone around FSDP2, the sharded head (or embedding) would have no gradient or a wrong
    one.
    With the root resharded after the forward, the explicit unshard gathers it again (the final norm's backward reads
    its weight too)."""
    import copy

    from torch.distributed.tensor import DTensor

    from qae_app.algo.chunked_head import causal_lm_logprobs, check_chunked_head

    plain = fsdp2_sharded(build().double(), root_reshards)
    chunked = fsdp2_sharded(copy.deepcopy(build().double()), root_reshards)
    vocab = chunked.config.vocab_size
    assert check_chunked_head(chunked) == vocab  # (the probe forward leaves the head resharded)
    assert isinstance(chunked.get_output_embeddings().weight, DTensor)
    input_ids, attention_mask = left_padded_batch(vocab, seed=2)
    logp, entropy = trainer_plain_logprobs(plain, input_ids, attention_mask, 3, 0.7, True)
    (logp.sum() + 0.3 * entropy.sum()).backward()
    got_logp, got_entropy = causal_lm_logprobs(chunked, input_ids, attention_mask, 3, 0.7, True, chunk_tokens=5)
    (got_logp.sum() + 0.3 * got_entropy.sum()).backward()
    torch.testing.assert_close(got_logp, logp, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_entropy, entropy, rtol=0, atol=1e-10)
    mine, theirs = dict(chunked.named_parameters()), dict(plain.named_parameters())
    assert mine.keys() == theirs.keys() and any("lm_head" in n or "embed" in n for n in mine)
    for name, param in mine.items():
        assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), name  # (resharded after the backward)
        torch.testing.assert_close(
            param.grad.full_tensor(), theirs[name].grad.full_tensor(), rtol=0, atol=1e-10, msg=name
        )


def test_a_model_with_soft_capped_logits_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from qae_app.algo.chunked_head import causal_lm_logprobs
    from qae_app.core.errors import QAEUserError

    model = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    input_ids, attention_mask = left_padded_batch(50)
    with pytest.raises(QAEUserError, match="final_logit_softcapping=30.0"):
        causal_lm_logprobs(model, input_ids, attention_mask, 2, 1.0)


def test_a_model_that_scales_its_logits_without_saying_so_is_refused():
    """No config field names the change; the model's own last-position logits give it away."""
    from transformers import LlamaForCausalLM

    from qae_app.algo.chunked_head import causal_lm_logprobs
    from qae_app.core.errors import QAEUserError

    class ScaledLogits(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, attention_mask, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 2
            return out

    model = ScaledLogits(tiny_llama_untied().config)
    input_ids, attention_mask = left_padded_batch(90)
    with pytest.raises(QAEUserError, match="differ from its LM head"):
        causal_lm_logprobs(model, input_ids, attention_mask, 2, 1.0)


# ---- memory, measured from outside the process -------------------------------------------------------------------


@pytest.mark.slow
def test_chunked_head_peak_memory_at_4096_tokens_of_a_151936_vocabulary_is_under_one_logits_tensor():
    """bench/bench_head_memory.py runs the no-grad pass, the grad pass and its backward in a child process and reads
    the child's peak RSS from the kernel. The plain path peaks at ~4 float32 (tokens, vocab) tensors (10.4 GB here);
    the chunked one must stay under one (2.49 GB), torch and the head's weight included (0.4 GB)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    tokens, vocab = 4096, 151936
    one_logits_tensor = tokens * vocab * 4
    script = Path(__file__).resolve().parents[2] / "bench" / "bench_head_memory.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--tokens",
            str(tokens),
            "--vocab",
            str(vocab),
            "--hidden",
            "256",
            "--path",
            "chunked",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    peak_gb = float(re.fullmatch(r"peak_rss ([\d.]+) GB", out.stdout.strip().splitlines()[-1]).group(1))
    assert peak_gb * 1e9 < one_logits_tensor, out.stdout
