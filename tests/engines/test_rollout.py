"""The HF rollout engine against a reference written out by hand: same samples for a fixed seed, with each group's
shared prompt computed once."""

from __future__ import annotations

import torch

from qae_app.engines.base import cut_at_stop
from qae_app.engines.hf import HFGenerateEngine
from qae_app.models.policy import BUILTIN_MODEL, load_policy


def reference_generate(
    model, codec, prompts: list[str], n: int, temperature: float, max_new_tokens: int, seed: int, batch_size: int
) -> list[tuple[int, list[int], list[int], str, bool]]:
    """The engine's contract, one row at a time: left-pad each prompt, sample, cut each row at its first eos."""
    torch.manual_seed(seed)
    flat = [(i, codec.encode(p)) for i, p in enumerate(prompts) for _ in range(n)]
    samples = []
    with torch.no_grad():
        for start in range(0, len(flat), batch_size):
            chunk = flat[start : start + batch_size]
            width = max(len(ids) for _, ids in chunk)
            input_ids = torch.full((len(chunk), width), codec.pad_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, (_, ids) in enumerate(chunk):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention_mask[row, width - len(ids) :] = 1
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=codec.pad_id,
                eos_token_id=codec.eos_id,
            )
            for row, (i, ids) in enumerate(chunk):
                response, truncated = cut_at_stop(out[row, width:].tolist(), [codec.eos_id])
                samples.append((i, ids, response, codec.decode(response), truncated))
    return samples


def test_hf_engine_samples_equal_the_row_by_row_reference_for_a_fixed_seed():
    model, codec = load_policy(BUILTIN_MODEL)
    model.eval()
    # prompts of different lengths (left padding differs per row) and a batch size that splits the work in 3 calls
    prompts = ["3+4=", "12*11=", "20-7=", "0*0="]
    engine = HFGenerateEngine(model, codec, batch_size=5)
    engine.use_decode_loop = False  # the generate path (tests/engines/test_decode.py checks the loop against it)
    batch_sizes = []  # of every forward: a chunk's distinct prompts go through the model once, then its rows
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        got = [
            (s.prompt_index, s.prompt_ids, s.response_ids, s.text, s.truncated)
            for s in engine.generate(prompts, 3, 1.0, 6, seed=7)
        ]
    finally:
        hook.remove()
    assert batch_sizes[0] == 2 and batch_sizes[1] == 5  # chunk 1 is prompts 0, 0, 0, 1, 1: two prompt prefixes
    expected = reference_generate(model, codec, prompts, 3, 1.0, 6, seed=7, batch_size=5)
    assert got == expected
    assert [i for i, *_ in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({tuple(r) for _, _, r, _, _ in got}) > 1  # sampled, not one repeated answer
    for _, _, response, _, truncated in got:  # a response ends at its eos, or is cut at max_new_tokens
        assert truncated == (codec.eos_id not in response) and (truncated or response[-1] == codec.eos_id)
