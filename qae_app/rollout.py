"""Rollout engines: sample G responses per prompt from the current policy.

The trainer only sees `RolloutEngine.generate(...) -> list[Sample]` and `sync_weights(model)`, so a vLLM engine (GPU)
and the transformers `generate` engine (anywhere) are interchangeable. Log-probs used by the loss are always
recomputed by the trainer's own forward pass, never taken from the engine, so engines may differ numerically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qae_app.errors import QAEUserError
from qae_app.models import TextCodec
from qae_app.names import ENGINES


@dataclass
class Sample:
    prompt_index: int  # index into the prompts passed to generate
    prompt_ids: list[int]
    response_ids: list[int]  # includes the closing eos when the model stopped by itself
    text: str  # decoded response, special tokens removed
    truncated: bool  # hit max_new_tokens before eos
    # the sampling distribution's log-prob of each response token and its entropy at each position, when the engine
    # measured them while sampling (the trainer then skips a no-grad pass over the responses to report them)
    token_logprobs: list[float] | None = None
    token_entropies: list[float] | None = None


class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[Sample]: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def _cut_at_eos(ids: list[int], eos_id: int, pad_id: int) -> tuple[list[int], bool]:
    if eos_id in ids:
        return ids[: ids.index(eos_id) + 1], False
    while ids and ids[-1] == pad_id and pad_id != eos_id:
        ids = ids[:-1]
    return ids, True


class HFGenerateEngine:
    """transformers `generate` on the training model itself (no copy, so there are no weights to sync)."""

    def __init__(self, model: torch.nn.Module, codec: TextCodec, batch_size: int = 256):
        self.model = model
        self.codec = codec
        self.batch_size = batch_size  # sequences per generate call

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[Sample]:
        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        torch.manual_seed(seed)
        encoded = [self.codec.encode(p) for p in prompts]
        # every prompt repeated n times, in order: sample j of prompt i sits at i * n + j
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]
        samples: list[Sample] = []
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            width = max(len(ids) for _, ids in chunk)
            # left padding, built as lists and converted once: a tensor write per row costs more than the rest of
            # the engine's bookkeeping together (bench/bench_generate.py)
            input_ids = torch.tensor([[self.codec.pad_id] * (width - len(ids)) + ids for _, ids in chunk])
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in chunk])
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.codec.pad_id,
                eos_token_id=self.codec.eos_id,
            )  # (chunk, width + new)
            for (i, ids), generated in zip(chunk, out[:, width:].tolist()):
                response, truncated = _cut_at_eos(generated, self.codec.eos_id, self.codec.pad_id)
                samples.append(Sample(i, ids, response, self.codec.decode(response), truncated))
        model.train(was_training)
        return samples


def make_engine(name: str, model: torch.nn.Module, codec: TextCodec, model_path: str | None = None,
                **kwargs) -> RolloutEngine:
    if name == "hf":
        return HFGenerateEngine(model, codec)
    if name == "vllm":
        from qae_app.vllm_engine import VLLMEngine  # imported only here: vllm needs a GPU

        return VLLMEngine(model_path=model_path, codec=codec, **kwargs)
    raise QAEUserError(f"engine: unknown value '{name}'. Choose one of: {', '.join(ENGINES)}.")
