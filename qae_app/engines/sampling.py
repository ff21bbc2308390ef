"""How the rollout engines sample: the truncations of the distribution `qae eval` may ask for (`SamplingOptions`),
and the seed of each generation batch of a training step (`step_seed`, which `qae preview` shares to sample step 1's).

Training always samples from softmax(logits / T), the distribution its loss assumes (`PLAIN_SAMPLING`); only `qae eval`
may truncate it, on request. Torch-free, so the config checks these options without loading an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from qae_app.core.errors import QAEUserError


@dataclass(frozen=True)
class SamplingOptions:
    """Truncations of the sampling distribution, for `qae eval` only. The defaults switch each one off: training
    always samples from softmax(logits / T), the distribution its loss assumes."""

    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p (1: off)
    top_k: int = 0  # keep the k most likely tokens (0: off)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: off)

    def validate(self) -> SamplingOptions:
        if not 0 < self.top_p <= 1:
            raise QAEUserError(f"top-p: {self.top_p}. Use a value in (0, 1]; 1 keeps the whole distribution.")
        if self.top_k < 0:
            raise QAEUserError(f"top-k: {self.top_k}. Use 0 (off) or a positive number of tokens.")
        if not 0 <= self.min_p < 1:
            raise QAEUserError(f"min-p: {self.min_p}. Use a value in [0, 1); 0 keeps the whole distribution.")
        return self


PLAIN_SAMPLING = SamplingOptions()  # nothing truncated: what training samples from


def step_seed(seed: int, step: int, process: int, gen_batch: int = 0) -> int:
    """The sampling seed of one process's share of a step's generation batch: a pure function of the four, so a
    resumed run samples exactly what the uninterrupted run did (gen_batch 0 keeps the seed runs had before dynamic
    sampling), and `qae preview` samples the responses a run's first step would."""
    return (seed * 1_000_003 + step * 7_919 + process * 104_729 + gen_batch * 15_485_863) % (2**31 - 1)
