"""FSDP2 sharding where accelerate will not set it up, and what every sharded run needs: clipping over the shards,
the full weights gathered once, and the run's description of how it ran.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 -m qae_app.cli train ...

On GPUs accelerate prepares an FSDP2 config itself (`fully_shard` per decoder layer and the root). On CPUs its launcher
sets ACCELERATE_USE_FSDP=true and FSDP_VERSION=2 but the Accelerator silently becomes plain multi-CPU DDP (measured
with accelerate 1.15). torch's FSDP2 runs on CPU over gloo, so in that case `shard_models` applies it here, from the
same config file: each decoder layer (the classes in the model's `_no_split_modules`, what accelerate's
TRANSFORMER_BASED_WRAP wraps) and then the root (embeddings, final norm, head), for the policy and the KL reference.
The model is then not handed to accelerate (it would wrap it in DDP): `prepare` returns it with its optimizer, built
on the sharded parameters (DTensors), so the optimizer state is sharded too.

What stays the same as under DDP: every process's loss is multiplied by the process count and FSDP2's reduce-scatter
averages the gradients, as DDP's all-reduce does, so the update is DDP's on the same samples.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from qae_app.core.errors import QAEUserError


@dataclass(frozen=True)
class ShardingPlan:
    sharding: str  # "none", "fsdp1", "fsdp2" or "zero3": how the policy's weights are split over processes
    synced_generate: bool  # HF generate: every process runs forward until all are done (synced_gpus=True)
    gather_full_weights: bool  # vLLM sync: gather each full weight from the shards before loading it


UNSHARDED = ShardingPlan("none", synced_generate=False, gather_full_weights=False)


def sharding_plan(
    distributed_type, zero_stage: int | None = None, fsdp_version: int | None = None, num_processes: int = 1
) -> ShardingPlan:
    """What the engines must do for accelerate's `distributed_type` (DistributedType or its name).

    Sharded weights (FSDP, ZeRO-3) are gathered layer by layer inside forward, a collective call: a process that
    stopped sampling must keep calling forward while another still samples, or both wait forever (TRL passes
    synced_gpus=True there for the same reason). vLLM keeps a full copy of the weights, so a sync must gather them
    first. Data parallel (DDP, multi-CPU), ZeRO-1/2 and one process keep full weights everywhere: nothing to do.
    """
    kind = str(getattr(distributed_type, "value", distributed_type)).upper()
    if kind == "MEGATRON_LM":
        raise QAEUserError(
            "accelerate: Megatron-LM splits layers across processes, which the rollout engines do not "
            "support. Use DDP, FSDP or DeepSpeed in your `accelerate config`."
        )
    if kind == "FSDP":
        sharding = "fsdp2" if fsdp_version == 2 else "fsdp1"
    elif kind == "DEEPSPEED" and (zero_stage or 0) >= 3:
        sharding = "zero3"
    else:
        return UNSHARDED
    return ShardingPlan(sharding, synced_generate=num_processes > 1, gather_full_weights=True)


def sharding_plan_for(accelerator) -> ShardingPlan:
    """sharding_plan for a live accelerate.Accelerator (FSDP2 that qae applies itself on CPU included)."""
    if shards_itself(accelerator):
        return sharding_plan("FSDP", None, 2, accelerator.num_processes)
    state = accelerator.state
    deepspeed = getattr(state, "deepspeed_plugin", None)
    fsdp = getattr(state, "fsdp_plugin", None)
    return sharding_plan(
        accelerator.distributed_type,
        getattr(deepspeed, "zero_stage", None),
        getattr(fsdp, "fsdp_version", None),
        accelerator.num_processes,
    )


def requested_fsdp_version() -> int | None:
    """The FSDP version the accelerate config asked for (its launcher's environment), None when it asked for none."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    return int(os.environ.get("FSDP_VERSION", "1"))


def shards_itself(accelerator) -> bool:
    """Whether qae applies FSDP2 itself: the config asked for FSDP2, several processes run, and accelerate fell back
    to data parallel (a CPU run). FSDP1 on CPU is refused: accelerate would silently train unsharded."""
    if accelerator.num_processes < 2 or str(accelerator.distributed_type.value).upper() == "FSDP":
        return False
    version = requested_fsdp_version()
    if version == 1:
        raise QAEUserError(
            "accelerate: the config asks for FSDP version 1, which accelerate does not set up on CPU "
            "(it trains unsharded). Use fsdp_version: 2 (configs/accelerate/fsdp2.yaml), which qae "
            "applies itself on CPU."
        )
    return version == 2


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: modules of the classes its `_no_split_modules` names (Hugging Face models list
    their decoder layer there)."""
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    if not layers:
        raise QAEUserError(
            f"model: {type(model).__name__} names no decoder layer class (_no_split_modules), so FSDP2 "
            "cannot shard it per layer. Launch with DDP (configs/accelerate/ddp.yaml)."
        )
    return layers


def shard_model(model: torch.nn.Module, mesh, mixed_precision: str = "no") -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (the same module, now an FSDPModule). With `mixed_precision`
    "bf16", FSDP2's own policy: the float32 shards are the master weights (the optimizer and its moments hold them),
    each layer is gathered and computed in bfloat16, and gradients are reduced in float32, as verl's FSDP workers do
    (the model never reaches accelerate's autocast here: accelerate does not prepare it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def shard_models(accelerator, model: torch.nn.Module, ref_model: torch.nn.Module | None):
    """(policy, reference) sharded with FSDP2 when `shards_itself`, else as given. Call before building the
    optimizer: it must hold the sharded parameters."""
    if not shards_itself(accelerator):
        return model, ref_model
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    precision = str(accelerator.mixed_precision)
    model = shard_model(model.to(accelerator.device), mesh, precision)
    if ref_model is not None:
        ref_model = shard_model(ref_model.to(accelerator.device), mesh, precision)
    return model, ref_model


def prepare(accelerator, model: torch.nn.Module, optimizer):
    """accelerator.prepare(model, optimizer), except for a model sharded here: accelerate would wrap it in DDP."""
    if is_sharded(model) and str(accelerator.distributed_type.value).upper() != "FSDP":
        return model, optimizer
    return accelerator.prepare(model, optimizer)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2, whoever applied it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: torch.nn.Module) -> None:
    """Put an FSDP2 model's parameters back to their shards. FSDP2 keeps the root's weights gathered after a forward
    that no backward follows (a no-grad pass): until resharded, `model.parameters()` gives those gathered copies,
    which the optimizer does not hold, so a gradient set on them would be lost."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over sharded gradients: each process's shards' norms are combined into the
    norm of the whole gradient (a DTensor reduction), which every process then clips with. Returns it, a plain
    tensor, the same on every process."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict with every sharded tensor gathered whole (a collective: every process calls it); plain
    tensors on the CPU. A tied weight (the head sharing the embeddings) comes once, under its first name, as
    save_pretrained writes it for an unsharded model."""
    from torch.distributed.tensor import DTensor

    reshard(model)
    full, seen = {}, set()
    for name, value in model.state_dict(keep_vars=True).items():  # (keep_vars: a tied weight is the same object)
        if id(value) in seen:
            continue
        seen.add(id(value))
        full[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
    return full


# ---------------------------------------------------------------------------------------------------------------
# how the run ran


@dataclass(frozen=True)
class DistributedSetup:
    """How a run was launched, stored in its config (key `distributed`) and shown by `qae show`
    (formatting.setup_label: "fsdp2 x 2 processes")."""

    sharding: str  # "none" (one process), "ddp", "fsdp1", "fsdp2" or "zero3"
    processes: int
    machines: int
    mixed_precision: str  # accelerate's: "no", "fp16", "bf16"
    sharded_by: str | None  # "qae" (FSDP2 on CPU, here) or "accelerate"; None when unsharded

    def to_dict(self) -> dict:
        return asdict(self)


def describe(accelerator, sharding: str) -> DistributedSetup:
    """The setup of this launch; `sharding` is sharding_plan_for(accelerator).sharding."""
    n = accelerator.num_processes
    kind = sharding if sharding != "none" else ("ddp" if n > 1 else "none")
    by = None if sharding == "none" else ("qae" if shards_itself(accelerator) else "accelerate")
    machines = int(os.environ.get("ACCELERATE_NUM_MACHINES", "0") or 0) or _machines(n)
    return DistributedSetup(kind, n, machines, str(accelerator.mixed_precision), by)


def _machines(processes: int) -> int:
    """Machines from torchrun's environment: processes / processes per machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", processes) or processes)
    return max(1, processes // max(local, 1))
