"""What the hardware allows a decode step of a Llama-family model, in the dtype it computes in: a roofline.

    limit = measure_roofline(model_in_dtype, rows=32)["cpu"]  # tokens per CPU second a step at 32 rows can reach
    limit.tokens_per_s, limit.bound, limit.describe()

A decode step multiplies `rows` hidden vectors by every weight matrix once. The limit is the sum, over the step's
matmuls, of the larger of two times:
- compute: the matmul itself at the loop's own shape (rows x in @ in x out), through the same kernel the decode loop
  calls (`qae_app.engines.decode._Linear`: oneDNN's packed bf16 weights where this CPU packs them, F.linear
  elsewhere), timed with its weight warm in cache;
- memory: the weight's bytes read at the machine's memory bandwidth (measured here: a sum over a tensor far larger
  than the caches), since in a real step each weight comes from memory once.
Attention over the cache, norms, rotary embeddings and sampling are left out: they are what the loop does beyond the
roofline, so the share of the limit it reaches says how much of a step they (and Python) cost.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from qae_app.engines import decode, decode_kernels

BANDWIDTH_BYTES = 256 * 2**20  # read per bandwidth sample: far beyond any CPU's last-level cache


CLOCKS = ("cpu", "wall")  # this process's CPU seconds (what a busy machine's load leaves alone), and wall seconds


def seconds_per_call(fn, seconds: float = 0.2, warmup: int = 3) -> dict[str, float]:
    """The median seconds of one `fn()` on each clock (CLOCKS), over batches of calls lasting about `seconds`."""
    for _ in range(warmup):
        fn()
    samples: dict[str, list[float]] = {clock: [] for clock in CLOCKS}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples["wall"]) < 3:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(5):
            fn()
        samples["cpu"].append((time.process_time() - cpu) / 5)
        samples["wall"].append((time.perf_counter() - wall) / 5)
    return {clock: statistics.median(values) for clock, values in samples.items()}


def read_bandwidth(seconds: float = 0.3) -> dict[str, float]:
    """Bytes per second this process reads from memory (one thread per torch thread), on each clock: a sum over
    256 MB."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    return {clock: BANDWIDTH_BYTES / s for clock, s in seconds_per_call(lambda: data.sum(), seconds, 1).items()}


@dataclass(frozen=True)
class Matmul:
    name: str  # which of the layer's linears ("qkv", "o", "gate_up", "down", "lm_head")
    count: int  # how many a decode step runs (one per layer, the head once)
    shape: tuple[int, int, int]  # (rows, in, out)
    weight_bytes: int
    compute_s: float  # one call, weight in cache


@dataclass(frozen=True)
class Roofline:
    dtype: str
    rows: int
    clock: str  # which seconds (CLOCKS)
    bandwidth: float  # bytes per second
    matmuls: tuple[Matmul, ...]

    def kernel_s(self, matmul: Matmul) -> float:
        return max(matmul.compute_s, matmul.weight_bytes / self.bandwidth)

    @property
    def step_s(self) -> float:
        """The least time a decode step's matmuls take: each at its compute or its memory limit, whichever is lower."""
        return sum(m.count * self.kernel_s(m) for m in self.matmuls)

    @property
    def tokens_per_s(self) -> float:
        return self.rows / self.step_s

    @property
    def bound(self) -> str:
        """'compute' or 'memory': which of the two limits the step's time mostly is."""
        memory = sum(
            m.count * m.weight_bytes / self.bandwidth
            for m in self.matmuls
            if m.weight_bytes / self.bandwidth >= m.compute_s
        )
        return "memory" if memory > self.step_s / 2 else "compute"

    def describe(self) -> str:
        flops = sum(m.count * 2 * m.shape[0] * m.shape[1] * m.shape[2] for m in self.matmuls)
        weights = sum(m.count * m.weight_bytes for m in self.matmuls)
        parts = ", ".join(f"{m.name} {m.shape[1]}x{m.shape[2]} {m.compute_s * 1e6:.0f} us" for m in self.matmuls)
        return (
            f"{self.dtype} roofline at {self.rows} rows: {self.tokens_per_s:,.0f} tokens per {self.clock} second "
            f"({self.bound}-bound); "
            f"matmuls {flops / sum(m.count * m.compute_s for m in self.matmuls) / 1e9:.1f} GFLOP/s at the loop's "
            f"shapes ({parts}); memory {self.bandwidth / 1e9:.1f} GB/s for {weights / 1e6:.0f} MB of weights a "
            f"step"
        )


def measure_roofline(model: torch.nn.Module, rows: int, seconds: float = 0.2) -> dict[str, Roofline]:
    """The roofline of a decode step of `model` (in the dtype it holds, as the decode loop would run it) at `rows`, on
    each clock (CLOCKS)."""
    # the loop's own fused linears, packed where decode_kernels chose to pack them on this CPU
    layers = decode._Layers(model, rows, decode_kernels.for_model(model, decode.draw))
    dtype = next(model.parameters()).dtype
    count = len(model.model.layers)
    matmuls = []
    with torch.no_grad():
        for name, linear, times in (
            ("qkv", layers.qkv[0], count),
            ("o", layers.o[0], count),
            ("gate_up", layers.gate_up[0], count),
            ("down", layers.down[0], count),
            ("lm_head", layers.lm_head, 1),
        ):
            out_features, in_features = linear.weight.shape
            x = torch.randn(rows, in_features).to(dtype)
            matmuls.append(
                (
                    name,
                    times,
                    (rows, in_features, out_features),
                    linear.weight.numel() * linear.weight.element_size(),
                    seconds_per_call(lambda linear=linear, x=x: linear(x), seconds),
                )
            )
    bandwidth = read_bandwidth()
    return {
        clock: Roofline(
            str(dtype).removeprefix("torch."),
            rows,
            clock,
            bandwidth[clock],
            tuple(Matmul(*fields, compute_s=times[clock]) for *fields, times in matmuls),
        )
        for clock in CLOCKS
    }
