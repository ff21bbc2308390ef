"""vLLM rollout engine (GPU): colocated with the trainer, weights pushed in after every RL step.

Install with `pip install -e '.[vllm]'` on a CUDA machine and pass `--engine vllm`. The engine keeps its own copy of
the weights in vLLM's paged format; `sync_weights` loads the trainer's current parameters into it (the approach TRL's
colocate mode uses), so sampling always follows the policy being trained. Log-probs for the loss are recomputed by
the trainer; the distribution it samples from is set explicitly (as for the HF engine): softmax(logits / T), no
penalties, stopping at the codec's stop ids. vLLM samples in its own kernels and dtype (bfloat16 unless
--rollout-dtype says otherwise), so it is not quite the policy the trainer computes: each Sample carries vLLM's
log-prob of each of its tokens (`logprobs=0`: the sampled token's only; `logprobs_mode="processed_logprobs"`, after
the temperature, where vLLM has it: 0.10.2 on; a V1 engine before that returns them before the temperature, right
only at temperature 1), from which the trainer measures the mismatch and --rollout-correction tis corrects for it.

Sleep mode (`--vllm-sleep`, on by default): colocated, vLLM's share of the GPU (its weights and its KV cache,
`gpu_memory_utilization`) would sit idle through the update while the trainer needs the memory most. The engine is
built with `enable_sleep_mode=True`; `release_memory()` (the trainer calls it after the step's rollouts, before the
update) puts it to sleep at level 1 (`LLM.sleep(level=1)`: its weights copied to CPU memory, its KV cache freed);
the next `sync_weights` or `generate` wakes it first (`LLM.wake_up()`): the weights before loading the new ones into
them, the KV cache after, so the gathered full weights the sync streams and the KV cache are never on the GPU together
where vLLM can wake them apart (`wake_up(tags=...)`, vLLM >= 0.8.5). Level 1, not 2: the weights vLLM wakes with are
overwritten by the sync at once, but level 1 also keeps the engine right when a wake-up comes without a sync (an
evaluation after a step that trained nothing). Sleep mode needs vLLM >= 0.7.3 on CUDA or ROCm.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import torch

from qae_app.core.errors import QAEUserError
from qae_app.data.prompts import Prompt
from qae_app.engines.base import Sample, cut_at_stop
from qae_app.engines.sampling import PLAIN_SAMPLING, SamplingOptions
from qae_app.engines.sharded_policy import ShardedPolicy
from qae_app.models.lora import is_lora, merged_weights
from qae_app.models.policy import TextCodec, local_model_folder, templated_prompt


class VLLMEngine:
    def __init__(self, model_path: str | None, codec: TextCodec, gpu_memory_utilization: float = 0.35,
                 dtype: str = "bfloat16", max_model_len: int | None = None,
                 sampling: SamplingOptions = PLAIN_SAMPLING, sharded: ShardedPolicy | None = None,
                 sleep: bool = True):
        if model_path is None or model_path.startswith("builtin:"):
            raise QAEUserError("engine: vllm needs --model to be a Hugging Face id or folder (the built-in tiny model "
                               "has a character tokenizer vLLM cannot load). Use --engine hf for it.")
        model_path = local_model_folder(model_path)  # a .gguf file: the de-quantized folder the trainer also loads
        self.sampling = sampling.validate()
        self.sharded = sharded or ShardedPolicy()
        # in-process engine, so the trainer can reach the model to load new weights
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise QAEUserError("engine: vllm is not installed. Install it on a CUDA machine with "
                               "`pip install -e '.[vllm]'`, or use --engine hf.") from err
        self._sampling_params = SamplingParams
        self.codec = codec
        if sleep and not hasattr(LLM, "sleep"):
            raise QAEUserError("vllm_sleep: the installed vllm has no sleep mode (it came in vLLM 0.7.3). Upgrade vllm "
                               "(`pip install -U vllm`), or pass --no-vllm-sleep to keep the engine's memory through "
                               "the update.")
        self.sleeps = sleep
        self.sleeping: set[str] = set()  # what of the engine's GPU memory is released: "weights", "kv_cache"
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_prefix_caching=True,
                       **({"enable_sleep_mode": True} if sleep else {}),
                       # the log-probs of the distribution sampled from (after the temperature), as the trainer's
                       **({"logprobs_mode": "processed_logprobs"} if _has_logprobs_mode() else {}))
        # waking the weights and the KV cache separately came after sleep mode itself
        self._wakes_by_tag = sleep and "tags" in inspect.signature(self.llm.wake_up).parameters

    def release_memory(self) -> None:
        """Free the engine's GPU memory until it is needed again (sleep mode, level 1); a no-op without it."""
        if self.sleeps and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def _wake(self, part: str | None = None) -> bool:
        """Wake `part` ("weights" or "kv_cache") of a sleeping engine, or all of it (None; also where this vLLM
        cannot wake parts). A part already awake is not woken twice (vLLM would map its memory again). Whether it woke
        the KV cache, whose cached prefixes it then forgets (their blocks were freed asleep)."""
        if not self.sleeping or (part is not None and part not in self.sleeping):
            return False
        if part is not None and self._wakes_by_tag:
            self.llm.wake_up(tags=[part])
            self.sleeping.discard(part)
        elif self._wakes_by_tag:
            self.llm.wake_up(tags=sorted(self.sleeping))
            self.sleeping = set()
        else:
            self.llm.wake_up()
            self.sleeping = set()
        if "kv_cache" in self.sleeping:
            return False
        self.llm.reset_prefix_cache()
        return True

    def sampling_params(self, n: int, temperature: float, max_new_tokens: int, seed: int):
        """Every setting that shapes the distribution or the stopping, spelled out (vLLM would otherwise take some
        from the checkpoint's generation_config)."""
        s = self.sampling
        return self._sampling_params(
            n=n, temperature=temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1, min_p=s.min_p,
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
            max_tokens=max_new_tokens, seed=seed, stop_token_ids=list(self.codec.stop_ids), ignore_eos=False,
            logprobs=0,  # the log-prob of each sampled token (and no other): Sample.token_logprobs
        )

    def generate(self, prompts: list[Prompt], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[Sample]:
        self._wake()
        params = self.sampling_params(n, temperature, max_new_tokens, seed)
        encoded = [self.codec.encode(p) for p in prompts]
        shown = [templated_prompt(self.codec, ids) for ids in encoded]  # what the model saw (chat template)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in encoded], params, use_tqdm=False)
        samples = []
        for i, output in enumerate(outputs):  # vLLM keeps the order of the prompts
            for completion in output.outputs:
                # vLLM keeps the stop token in token_ids; cut as the HF engine does, so both give the same Sample
                response, _ = cut_at_stop(list(completion.token_ids), self.codec.stop_ids)
                truncated = completion.finish_reason == "length"
                samples.append(Sample(i, encoded[i], response, self.codec.decode(response), truncated,
                                      token_logprobs=sampled_logprobs(completion, response), model_prompt=shown[i]))
        return samples

    def _vllm_model(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # vLLM v1 wraps the worker
        return worker.model_runner.model

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's parameters (names as in the HF checkpoint) into vLLM's model; sharded weights (FSDP,
        ZeRO-3) are gathered to full tensors first, one unit at a time; a LoRA model's adapters are merged into
        their layers' weights (W + B @ A * alpha / rank), one layer at a time. A sleeping engine wakes its weights
        first (to load into them) and its KV cache after."""
        self._wake("weights")
        if is_lora(model):  # (LoRA is refused with sharded weights: see Trainer._load_models)
            weights = merged_weights(model)
        else:
            weights = (self.sharded.full_weights(model) if self.sharded.plan.gather_full_weights
                       else model.state_dict().items())
        self._vllm_model().load_weights(((name, p.detach()) for name, p in weights))
        if not self._wake():  # (waking the KV cache resets the prefix cache)
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights


def sampled_logprobs(completion, response: list[int]) -> list[float] | None:
    """vLLM's log-prob of each token of `response` (a prefix of completion.token_ids), from completion.logprobs (one
    {token id: Logprob} per generated token); None where vLLM returned none."""
    steps = getattr(completion, "logprobs", None)
    if steps is None:
        return None
    return [step[token].logprob for step, token in zip(steps, response)]


def _has_logprobs_mode() -> bool:
    """Whether this vLLM takes logprobs_mode (0.10.2 on)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    return any(f.name == "logprobs_mode" for f in dataclasses.fields(EngineArgs))
