"""Sharded policies (FSDP, DeepSpeed ZeRO-3): which path the engines take for each accelerate distributed type, and the
two sharded paths themselves on CPU.

The FSDP runs below wrap the model by hand (torch FSDP1 and FSDP2 both run on CPU over gloo, 2 processes);
tests/e2e/test_fsdp2.py trains with FSDP2 through `qae train` under `accelerate launch`. ZeRO-3 and GPUs are not
available here: bench/gpu_check.py runs those paths on a GPU machine.
"""

import os
import socket

import pytest
import torch
from accelerate.utils import DistributedType

from qae_app.core.errors import QAEUserError
from qae_app.models.sharding import UNSHARDED, ShardingPlan, sharding_plan, sharding_plan_for

# (zero_stage, fsdp_version) -> plan, with 2 processes
SHARDED_FSDP1 = ShardingPlan("fsdp1", synced_generate=True, gather_full_weights=True)
SHARDED_FSDP2 = ShardingPlan("fsdp2", synced_generate=True, gather_full_weights=True)
SHARDED_ZERO3 = ShardingPlan("zero3", synced_generate=True, gather_full_weights=True)


def expected_plan(kind: DistributedType, zero_stage, fsdp_version) -> ShardingPlan:
    if kind == DistributedType.FSDP:
        return SHARDED_FSDP2 if fsdp_version == 2 else SHARDED_FSDP1
    if kind == DistributedType.DEEPSPEED and zero_stage == 3:
        return SHARDED_ZERO3
    return UNSHARDED  # DDP-style (every weight whole on every process), ZeRO-1/2, XLA, one process


@pytest.mark.parametrize(
    "kind", [k for k in DistributedType if k != DistributedType.MEGATRON_LM], ids=lambda k: k.value
)
def test_plan_for_each_distributed_type(kind):
    for zero_stage in (None, 0, 1, 2, 3):
        for fsdp_version in (None, 1, 2):
            assert sharding_plan(kind, zero_stage, fsdp_version, num_processes=2) == expected_plan(
                kind, zero_stage, fsdp_version
            ), (zero_stage, fsdp_version)
    assert sharding_plan(kind.value, 3, 2, 2) == sharding_plan(kind, 3, 2, 2)  # the name works as well as the enum


def test_one_process_never_syncs_generate_but_still_gathers():
    # synced_gpus all-reduces a flag at every token: with one process there is nobody to wait for
    assert sharding_plan(DistributedType.FSDP, None, 2, num_processes=1) == ShardingPlan(
        "fsdp2", synced_generate=False, gather_full_weights=True
    )
    assert sharding_plan(DistributedType.DEEPSPEED, 3, None, num_processes=1).synced_generate is False


def test_megatron_is_refused_clearly():
    with pytest.raises(QAEUserError, match="Megatron-LM"):
        sharding_plan(DistributedType.MEGATRON_LM)


def test_plan_of_a_live_single_process_accelerator():
    from accelerate import Accelerator

    assert sharding_plan_for(Accelerator(cpu=True)) == UNSHARDED


def test_engines_pass_synced_gpus_as_planned():
    from qae_app.engines.hf import HFGenerateEngine
    from qae_app.engines.sharded_policy import ShardedPolicy
    from qae_app.models.policy import build_tiny_model

    model, codec = build_tiny_model()
    seen = []
    real_generate = model.generate

    def recording_generate(*args, **kwargs):  # a spy: records the call, runs the real generate
        seen.append(kwargs["synced_gpus"])
        return real_generate(*args, **{**kwargs, "synced_gpus": False})  # one process: nobody to sync with

    model.generate = recording_generate
    unsharded = HFGenerateEngine(model, codec)
    unsharded.use_decode_loop = False  # (unsharded, it samples with qae_app/engines/decode.py's loop, not generate)
    unsharded.generate(["1+1="], 2, 1.0, 3, seed=0)
    # sharded weights always take generate: the loop reads whole weights, which a sharded process does not hold
    HFGenerateEngine(model, codec, sharded=ShardedPolicy(SHARDED_ZERO3)).generate(["1+1="], 2, 1.0, 3, seed=0)
    assert seen == [False, True]


# ---------------------------------------------------------------------------------------------------------------
# FSDP on CPU, 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, version: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from qae_app.engines.hf import HFGenerateEngine
    from qae_app.engines.sharded_policy import ShardedPolicy
    from qae_app.models.policy import build_tiny_model

    model, codec = build_tiny_model(seed=0)
    # what the unsharded engines load: state_dict's names, a tied weight under each (the head beside the embeddings)
    reference = {name: p.detach().clone() for name, p in model.state_dict().items()}
    if version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = unwrapped = fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        unwrapped = wrapped.module
    sharded = ShardedPolicy(sharding_plan("FSDP", None, version, world), wrapped)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in unwrapped.parameters())  # DTensor
    # process 0 stops sampling after 3 tokens, process 1 goes on to 12: without synced_gpus process 1's forward
    # waits for shards that process 0 never sends
    samples = HFGenerateEngine(unwrapped, codec, sharded=sharded).generate(
        ["1+1=" if rank == 0 else "17*3="], n=2, temperature=1.0, max_new_tokens=3 if rank == 0 else 12, seed=rank
    )
    full = dict(sharded.full_weights(unwrapped))
    torch.save(
        {
            "lengths": [len(s.response_ids) for s in samples],
            "local_params": local,
            "reference": reference,
            "full": full,
        },
        f"{out_dir}/rank{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2], ids=["fsdp1", "fsdp2"])
def test_fsdp_generates_when_processes_stop_at_different_steps_and_gathers_full_weights(tmp_path, version):
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _fsdp_worker, args=(2, _free_port(), version, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    finished = False
    for _ in range(60):  # a deadlock shows up as no progress: give up after 60 x 5 s instead of hanging the suite
        if context.join(timeout=5):
            finished = True
            break
    if not finished:
        for process in context.processes:
            process.kill()
        pytest.fail("FSDP generate deadlocked (a process waited for shards its peer never sent)")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    total = sum(p.numel() for p in results[0]["reference"].values())
    for result in results:
        assert result["local_params"] < total  # the weights really were sharded
        assert set(result["full"]) == set(result["reference"])
        for name, tensor in result["full"].items():
            assert torch.equal(tensor, result["reference"][name]), name
    assert max(results[0]["lengths"]) <= 3 and max(results[1]["lengths"]) > 3
