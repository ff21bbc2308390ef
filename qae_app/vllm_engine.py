"""vLLM rollout engine (GPU): colocated with the trainer, weights pushed in after every RL step.

Install with `pip install -e '.[vllm]'` on a CUDA machine and pass `--engine vllm`. The engine keeps its own copy of
the weights in vLLM's paged format; `sync_weights` loads the trainer's current parameters into it (the approach TRL's
colocate mode uses), so sampling always follows the policy being trained. Log-probs for the loss are recomputed by
the trainer, so vLLM's numerics never enter the gradient.
"""

from __future__ import annotations

import os

import torch

from qae_app.errors import QAEUserError
from qae_app.models import TextCodec
from qae_app.rollout import Sample


class VLLMEngine:
    def __init__(self, model_path: str | None, codec: TextCodec, gpu_memory_utilization: float = 0.35,
                 dtype: str = "bfloat16", max_model_len: int | None = None):
        if model_path is None or model_path.startswith("builtin:"):
            raise QAEUserError("engine: vllm needs --model to be a Hugging Face id or folder (the built-in tiny model "
                               "has a character tokenizer vLLM cannot load). Use --engine hf for it.")
        # in-process engine, so the trainer can reach the model to load new weights
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise QAEUserError("engine: vllm is not installed. Install it on a CUDA machine with "
                               "`pip install -e '.[vllm]'`, or use --engine hf.") from err
        self._sampling_params = SamplingParams
        self.codec = codec
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_prefix_caching=True)

    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[Sample]:
        params = self._sampling_params(n=n, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens,
                                       seed=seed)
        encoded = [self.codec.encode(p) for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
        samples = []
        for i, output in enumerate(outputs):  # vLLM keeps the order of the prompts
            for completion in output.outputs:
                response = list(completion.token_ids)
                truncated = completion.finish_reason == "length"
                samples.append(Sample(i, encoded[i], response, self.codec.decode(response), truncated))
        return samples

    def _vllm_model(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # vLLM v1 wraps the worker
        return worker.model_runner.model

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's parameters (names as in the HF checkpoint) into vLLM's model."""
        self._vllm_model().load_weights(((name, p.detach()) for name, p in model.state_dict().items()))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
