"""What every rollout engine is: `generate(...) -> list[Sample]`, `sync_weights(model)`, `release_memory()` and
`close()`.

The trainer only sees this protocol, so the vLLM engine (GPU) and the transformers engine (anywhere) are
interchangeable (engines/factory.py picks one). The loss's ratio is of the trainer's own log-probs (new and old, both
from its forward passes); an engine's log-probs (`Sample.token_logprobs`) enter only as the sampler's side of
`--rollout-correction tis`'s weight min(pi_old / pi_sampler, cap) and the step's mismatch metrics, so engines may
differ numerically; the distribution they sample from may not: it is exactly softmax(logits / T), the one the loss
assumes. Every sampling setting is given explicitly, so
nothing comes from a checkpoint's own generation_config (instruct checkpoints ship repetition_penalty, top_k, top_p,
...). Only `qae eval` may truncate the distribution, on request (`SamplingOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qae_app.data.prompt_format import Prompt


@dataclass
class Sample:
    prompt_index: int  # index into the prompts passed to generate
    prompt_ids: list[int]
    response_ids: list[int]  # includes the closing stop token when the model stopped by itself
    text: str  # decoded response, special tokens removed
    truncated: bool  # hit max_new_tokens before a stop token
    # the sampling distribution's log-prob of each response token and its entropy at each position, when the engine
    # measured them while sampling (the trainer then skips a no-grad pass over the responses to report them)
    token_logprobs: list[float] | None = None
    token_entropies: list[float] | None = None
    # the prompt as the model saw it, chat template included (policy.templated_prompt); None without a template
    model_prompt: str | None = None


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[Prompt], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[Sample]: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def release_memory(self) -> None:
        """Free what the engine holds on the accelerator until its next generate or sync (vLLM's sleep mode); the
        trainer calls it before the update."""

    def close(self) -> None:
        """Shut down what the engine started (vLLM: its engine and the process group it made); the run ends it."""


def cut_at_stop(ids: list[int], stop_ids: list[int]) -> tuple[list[int], bool]:
    """(response up to and including its first stop token, truncated). Without a stop token the response ran out of
    tokens and is kept whole: generate pads only the rows that stopped, so a pad-id token in a row that never stopped
    was sampled (a model may emit its pad id), and its log-prob is the response's."""
    stops = set(stop_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return ids[: position + 1], False
    return ids, True
