"""The mini-batch selections split over 2 real processes (torch.distributed, gloo: the collectives accelerate runs on a
CPU) pick the very tokens one process picks from the whole mini-batch: Clip-Cov's draw, KL-Cov's top share (with ties
at its boundary) and the entropy quantile. Each process holds a contiguous block of the responses, as the update's
global numbering gives it, of a different size. (The whole update under `accelerate launch`:
tests/e2e/test_policy_loss_processes.py.)"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qae_app.algo.token_selection import SelectionTokens, clip_cov_selection, kl_cov_selection, top_entropy_mask
from qae_app.train.update import OneProcess

N, T = 9, 7
SPLIT = 4  # process 0 holds responses 0-3, process 1 responses 4-8
PARAMS = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "clip_cov_ratio": 0.2,
    "clip_cov_lb": -0.3,
    "clip_cov_ub": 2.0,
    "kl_cov_ratio": 0.67,
}  # k = 20 of 30 tokens: the 20th and 21st largest tie, on the two processes


def mini_batch() -> SelectionTokens:
    g = torch.Generator().manual_seed(11)
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (N, 1), generator=g)).double()  # (N, T)
    logp = -torch.rand(N, T, generator=g, dtype=torch.float64) * 2
    logp[5] = logp[2]  # equal covariances (same advantage and log-probs): ties across the two processes' blocks
    advantages = torch.tensor([1.0, 0.0, -0.5, 0.0, 2.0, -0.5, 0.0, 0.7, -1.2], dtype=torch.float64)
    mask[5] = mask[2]
    old = logp + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(N, T, generator=g, dtype=torch.float64)
    return SelectionTokens(logp, old, advantages, mask, entropy)


class Collectives:
    """What the selections call on an accelerate.Accelerator, over torch.distributed."""

    def __init__(self):
        self.num_processes, self.process_index, self.device = dist.get_world_size(), dist.get_rank(), "cpu"

    def gather(self, tensor):
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def reduce(self, tensor, reduction="sum"):
        dist.all_reduce(tensor)
        return tensor


def selections(t: SelectionTokens, acc) -> list[torch.Tensor]:
    return [
        clip_cov_selection(t, PARAMS, acc, torch.Generator().manual_seed(3))[0],
        kl_cov_selection(t, PARAMS, acc)[0],
        top_entropy_mask(t, 0.3, acc)[0],
    ]


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, N)
    t = mini_batch()
    mine = SelectionTokens(*(x[rows] for x in t))
    torch.save(selections(mine, Collectives()), f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_processes_select_the_tokens_one_process_selects(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(tmp_path / "picked")), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"picked.{rank}") for rank in (0, 1)]
    whole = selections(mini_batch(), OneProcess("cpu"))
    for name, one, first, second in zip(("clip_cov", "kl_cov", "entropy"), whole, *parts, strict=True):
        assert one.any() and not one.all(), name  # (a selection, not all or nothing)
        assert torch.equal(torch.cat([first, second]), one), name
