"""Rollouts from a sharded policy (FSDP, DeepSpeed ZeRO-3): every process holds a slice of each weight.
`models.sharding.sharding_plan` decides what the engines must do about it, and `ShardedPolicy` does it."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from qae_app.models.sharding import UNSHARDED, ShardingPlan, sharding_plan_for


class ShardedPolicy:
    """The policy as accelerate prepared it, with what generation and weight sync need when it is sharded.

    `wrapped` is the prepared model (FSDP / DeepSpeed wrapper); the engines generate with the unwrapped one.
    FSDP1 and FSDP2 run on CPU (tests/engines/test_sharding.py, tests/e2e/test_fsdp2.py); ZeRO-3 needs GPUs
    (bench/gpu_check.py).
    """

    def __init__(self, plan: ShardingPlan = UNSHARDED, wrapped: torch.nn.Module | None = None):
        self.plan = plan
        self.wrapped = wrapped

    @classmethod
    def of(cls, accelerator, wrapped: torch.nn.Module) -> "ShardedPolicy":
        return cls(sharding_plan_for(accelerator), wrapped)

    def generation_context(self):
        """FSDP1 keeps the root module's own weights (embeddings, final norm, lm_head) sharded outside any nested
        unit's forward: gather them for the whole generate call (TRL does the same)."""
        if self.plan.sharding == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            return FSDP.summon_full_params(self.wrapped, recurse=False, writeback=False)
        return contextlib.nullcontext()

    def full_weights(self, unwrapped: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every weight, names as in the Hugging Face checkpoint (as the unsharded
        state_dict names them: a tied weight under each of its names, so `lm_head.weight` beside the embeddings it
        shares); gathered one unit at a time so no process holds more than one full unit beyond its shard (unless the
        caller keeps them all). (named_parameters() names a tied weight once: a vLLM on a CPU, which repacks its
        head apart from the embeddings, kept the first head it loaded, 5e-3 off the trainer's log-probs.)"""
        if self.plan.sharding == "none":
            yield from unwrapped.state_dict().items()
        elif self.plan.sharding == "fsdp2":  # parameters are DTensors: full_tensor() all-gathers one
            for name, param in unwrapped.named_parameters(remove_duplicate=False):
                yield name, param.full_tensor() if hasattr(param, "full_tensor") else param
        elif self.plan.sharding == "zero3":
            import deepspeed

            for name, param in unwrapped.named_parameters(remove_duplicate=False):
                with deepspeed.zero.GatheredParameters([param]):
                    yield name, param.data.clone()  # the gathered storage is released when the block ends
        else:  # fsdp1
            yield from _fsdp1_full_weights(self.wrapped)


def _fsdp1_full_weights(root):
    """Each FSDP unit's own weights, gathered one unit at a time (the nested units first, as TRL does)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(root, recurse=False, writeback=False):
        pass  # FSDP1 initialises lazily, taking the first unit gathered as its root: make that the real root
    seen: set[str] = set()

    def visit(module, prefix: str):
        for child_name, child in module.named_children():
            yield from visit(child, f"{prefix}.{child_name}" if prefix else child_name)
        if isinstance(module, FSDP):
            with FSDP.summon_full_params(module, recurse=False, writeback=False):
                for name, param in module.named_parameters(remove_duplicate=False):  # (tied: each name)
                    full = f"{prefix}.{name}" if prefix else name
                    full = full.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
                    if full not in seen:  # nested units' weights were yielded (gathered) by the units themselves
                        seen.add(full)
                        yield full, param.data.clone()  # the gathered storage is freed when the block ends

    yield from visit(root, "")
