"""Per-process training-state memory under DDP and FSDP2 with 2 processes: the bytes of the parameters, gradients and
optimizer state each process holds, counted from its actual local tensors (a DTensor's local shard) after one RL
step of `qae train`'s trainer, launched for real with `accelerate launch --config_file configs/accelerate/<c>.yaml`.

    python bench/bench_sharded_memory.py                       # builtin:tiny
    python bench/bench_sharded_memory.py --model PATH_OR_HF_ID  # any model qae trains

Activations, the batch and the rollout engine are not counted: this is the state FSDP2 shards. Each launch's total
(the larger of its two processes) goes to the results log (bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import report

ROOT = Path(__file__).resolve().parents[1]


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(model: str, out: str) -> None:
    """Run under accelerate launch: one RL step, then count this process's state."""
    import torch

    from qae_app.config import build_config
    from qae_app.models.sharding import reshard
    from qae_app.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as runs:
        cfg = build_config(
            run_name="mem",
            model=model,
            steps=1,
            prompts_per_step=2,
            group_size=2,
            eval_every=0,
            checkpoint_every=0,
            max_new_tokens=8,
        )
        with Trainer(cfg, Path(runs), cpu=not torch.cuda.is_available()) as trainer:
            trainer.skip_gated = False  # every response through the backward: every parameter gets a gradient
            trainer.train_step(1)
            model_ = trainer.accelerator.unwrap_model(trainer.model)
            reshard(model_)
            params = list(model_.parameters())
            counts = {
                "params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(
                    local_bytes(v)
                    for state in trainer.optimizer.state.values()
                    for v in state.values()
                    if isinstance(v, torch.Tensor)
                ),
                "setup": trainer.session.distributed.to_dict(),
            }
            rank = trainer.accelerator.process_index
    Path(f"{out}.{rank}.json").write_text(json.dumps(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.worker)
        return
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    with tempfile.TemporaryDirectory() as tmp:
        for config in ("ddp", "fsdp2"):
            out = f"{tmp}/{config}"
            result = subprocess.run(
                [
                    accelerate,
                    "launch",
                    "--config_file",
                    str(ROOT / "configs" / "accelerate" / f"{config}.yaml"),
                    "--num_processes",
                    "2",
                    __file__,
                    "--model",
                    args.model,
                    "--worker",
                    out,
                ],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                sys.exit(result.stdout[-2000:] + result.stderr[-3000:])
            totals = []
            for rank in (0, 1):
                c = json.loads(Path(f"{out}.{rank}.json").read_text())
                total = c["params"] + c["grads"] + c["optimizer"]
                totals.append((total, c))
                print(
                    f"{config:5s} x 2, process {rank}: params {c['params'] / 2**20:7.2f} MiB  grads "
                    f"{c['grads'] / 2**20:7.2f} MiB  optimizer {c['optimizer'] / 2**20:7.2f} MiB  "
                    f"total {total / 2**20:7.2f} MiB  ({c['setup']['sharding']})"
                )
            total, c = max(totals, key=lambda pair: pair[0])
            report(
                f"bench_sharded_memory: training state per process, {config.upper()} x 2, {args.model}",
                round(total / 2**20, 3),
                None,
                unit="MiB",
                note=f"params {c['params'] / 2**20:.2f}, grads {c['grads'] / 2**20:.2f}, optimizer "
                f"{c['optimizer'] / 2**20:.2f} MiB (the larger process); one RL step under accelerate launch",
            )


if __name__ == "__main__":
    main()
