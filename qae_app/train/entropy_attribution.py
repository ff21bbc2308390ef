"""Which regime's update moves entropy (`--log-entropy-attribution`): the paper's Prop. 4.2, measured causally.

`--log-entropy-delta`'s dH_hard is how the whole step's update changed the entropy of the hard groups' responses:
the easy groups' gradient moves them too, so it cannot say which regime's update did it. Here, before the real
update, from a copy of the policy and the optimizer state:

    for source in (hard, easy, none):
        advantages of every response outside `source` set to 0 (none: every advantage 0)
        policy_update(...)                 the real step's update code, same mini-batches (seed), same normalizer
        entropy of the step's responses    all, hard, easy: change from before, token-weighted
        restore the policy and optimizer state exactly

    dH_from_hard        dH_hard_from_hard    dH_easy_from_hard
    dH_from_easy        dH_hard_from_easy    dH_easy_from_easy
    dH_from_none        dH_hard_from_none    dH_easy_from_none

The normalizer: zeroing advantages leaves each mini-batch's loss normalizer (its tokens, or sequences, over every
process) as the real step's, so a regime's update is its own term of the real loss, not a loss re-normalized over that
regime's responses alone. The KL term belongs to neither regime and is left out of all three.

Why `none`: AdamW moves the weights on a zero gradient too (its first moment from earlier steps, weight decay), so
a regime's update is that drift plus the regime's gradient; dH_*_from_hard - dH_*_from_none is the part the hard
regime's gradient caused (up to AdamW's second moment, which the gradient also changes). At step 1 (no moments yet)
the drift is exactly 0 without weight decay.

Regimes are those of dH_hard/dH_easy: the quantile rule on the verifier's verdicts at the K that splits groups
(`split_k`: the run's K, DEFAULT_K for mean-baseline runs), so a GRPO run is attributed over the same split of its
groups. A regime with no response in the
step gets NULL. Many processes: each zeroes its own responses' advantages, and policy_update and the entropy sums run
over all processes, so the numbers are the one-process numbers.

Cost, per step: one no-grad pass over the step's responses, then per source its update (forward/backward of that
regime's responses only: gated ones are skipped) and one no-grad pass; a copy of the trainable weights and the
optimizer state (about 3x the trainable weights, on their device). Training is unchanged: the real update then runs
from the restored state, and the RNG state is put back.
"""

from __future__ import annotations

import copy
import math

import torch

from qae_app.algo.advantages import EASY, HARD
from qae_app.algo.policy_loss_registry import EntropyCoefficient
from qae_app.train.entropy_change import response_regimes
from qae_app.train.update import OneProcess, UpdateOptions, logprobs_in_chunks, policy_update

SOURCES = ("hard", "easy", "none")  # whose loss the update is made from
ATTRIBUTION_METRICS = tuple(
    name for source in SOURCES for name in (f"dH_from_{source}", f"dH_hard_from_{source}", f"dH_easy_from_{source}")
)


class PolicySnapshot:
    """An exact copy of the trainable weights and the optimizer's state, to put back after a trial update."""

    def __init__(self, model, optimizer):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # (accelerate's wrapper holds the real one)
        with torch.no_grad():
            self.weights = [p.detach().clone() for p in self.parameters]
        self.state = {p: _cloned(s) for p, s in self.optimizer.state.items()}
        self.rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in zip(self.parameters, self.weights, strict=True):
                p.copy_(saved)
                p.grad = None
        # (a parameter without state before the trial, as at step 1, gets none after it)
        self.optimizer.state.clear()
        for p, saved in self.state.items():
            self.optimizer.state[p] = _cloned(saved)
        torch.random.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _cloned(state: dict) -> dict:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def entropy_attribution(
    model,
    optimizer,
    batch,
    advantages: torch.Tensor,
    correct: torch.Tensor,
    split_k: float,
    group_size: int,
    options: UpdateOptions,
    accelerator=None,
    *,
    seed: int,
    n_local: int | None = None,
    entropy_control: EntropyCoefficient | None = None,
) -> dict:
    """ATTRIBUTION_METRICS of one step, measured from the current policy and optimizer state, which are left exactly
    as they were.

    batch: `update.pack` of this process's trained responses (the first `n_local` rows; a process with none packs one
    placeholder); advantages (n_rows,) the real step's; correct (B, G) bool, the verdicts of the n_local responses'
    groups; seed: the real update's (the same mini-batches); entropy_control: the real update's entropy coefficient
    (each trial adapts a copy of it)."""
    n_rows = advantages.shape[0]
    acc = accelerator or OneProcess(advantages.device)
    n_local = n_rows if n_local is None else n_local
    rows = torch.arange(n_rows, device=advantages.device)
    regime = torch.full((n_rows,), -1, dtype=torch.long, device=advantages.device)  # (n_rows,) placeholder: none
    regime[:n_local] = response_regimes(correct, split_k, group_size).to(advantages.device)
    mask = batch["response_mask"].clone()
    mask[n_local:] = 0  # (a placeholder row counts nowhere)
    tokens = mask.sum(-1)  # (n_rows,)
    parts = (torch.ones(n_rows, dtype=torch.bool, device=advantages.device), regime == HARD, regime == EASY)
    keeps = {"hard": regime == HARD, "easy": regime == EASY, "none": torch.zeros_like(regime, dtype=torch.bool)}
    # which sources have a response on some process (a regime with none has no update to attribute)
    present = torch.tensor([float(keeps[s].any()) for s in SOURCES], dtype=torch.float64, device=acc.device)
    if acc.num_processes > 1:
        present = acc.reduce(present, reduction="sum")

    snapshot = PolicySnapshot(model, optimizer)
    _, before = logprobs_in_chunks(model, batch, rows, options, acc, with_entropy=True)  # (n_rows, T-1)
    out = {}
    try:
        for source, has_source in zip(SOURCES, present.tolist(), strict=True):
            names = (f"dH_from_{source}", f"dH_hard_from_{source}", f"dH_easy_from_{source}")
            if source != "none" and not has_source:
                out.update(dict.fromkeys(names, math.nan))
                continue
            trial = torch.where(keeps[source], advantages, torch.zeros_like(advantages))  # (n_rows,)
            policy_update(
                model,
                optimizer,
                batch,
                trial,
                options,
                acc,
                seed=seed,
                n_local=n_local,
                entropy_control=copy.copy(entropy_control),
            )
            _, after = logprobs_in_chunks(model, batch, rows, options, acc, with_entropy=True)
            change = ((after - before) * mask).sum(-1)  # (n_rows,) summed over each response's tokens
            sums = torch.tensor(
                [[change[m].sum().item(), tokens[m].sum().item()] for m in parts],
                dtype=torch.float64,
                device=acc.device,
            )  # (3, 2): change, tokens
            if acc.num_processes > 1:
                sums = acc.reduce(sums, reduction="sum")
            out.update({name: (c / t if t else math.nan) for name, (c, t) in zip(names, sums.tolist(), strict=True)})
            snapshot.restore()
    finally:
        snapshot.restore()
    return out
