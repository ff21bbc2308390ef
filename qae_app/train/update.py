"""The policy update: policy-gradient optimizer steps over one RL step's responses with the run's policy loss (by name:
algo/policy_loss_registry.py), the same update on one process or on many. Plain functions on tensors; no run folder, no
trainer:

    batch  = pack(samples, pad_id, device)              # input_ids, attention_mask, response_mask: (N, T)
    result = policy_update(model, optimizer, batch, advantages, UpdateOptions.from_config(cfg), accelerator,
                           seed=...)                    # advantages (N,) -> result.stats: the step's update columns

One update, and the seam where each later change plugs in:
    mini_batch_plan       which responses each optimizer step takes: a MiniBatchPlan per PPO epoch
    micro_batch_plan      how a mini-batch's forwarded responses split into forwards (a MicroBatch each):
                          micro_batch_size sequences, or sorted by length into token budgets
                          (max_tokens_per_micro_batch), trimmed to their longest
    old_logprobs          the sampling policy's log-probs, only where the loss needs them
    rollout_mismatch      by how much the engine's log-probs (pack's sampler_logp) differ from the trainer's old ones;
                          --rollout-correction tis reweights each token's policy-loss term by min(their ratio, cap)
    logprobs_in_chunks    no-grad log-probs, one micro-batch at a time
    select_tokens         the loss's selections over a whole mini-batch (Clip-Cov, KL-Cov, the entropy quantile):
                          one no-grad pass over its responses first (algo/token_selection.py: the same for any
                          micro-batch plan and process count)
    accumulate_gradients  one mini-batch's backward, in micro-batches (gradient checkpointing: the model's own)
    forward_logprobs      one forward of the model (LoRA: the model passed in), through the chunked vocabulary
                          projection (chunked_head) when logprob_chunk_tokens says so

The gated skip (`UpdateOptions.skip_gated`): with QAE about 80% of responses get advantage exactly 0; their policy
gradient is exactly 0, so when nothing else needs them (no KL term; a policy loss whose record says the skip is exact,
so not kl_cov; no entropy bonus) they are left out of the forward/backward, with the loss normalizer of the full
mini-batch, so the update is the one the dense computation gives (a mini-batch whose advantages are all 0 still steps
the optimizer, as the dense one does: AdamW's moments move the weights on a zero gradient too).

Many processes (`accelerator`, an accelerate.Accelerator; None: one process without accelerate): mini-batches are
drawn over the responses of every process (the same seeded permutation on each), and each process takes its members
of each: the loss normalizer (tokens or sequences of the whole mini-batch) is summed over processes, and each
process's loss is multiplied by the process count because DDP averages gradients. So the update equals the
one-process update on the same responses. A process with nothing to contribute still runs its forward/backward
passes, weighted 0, because the others wait for it; with sharded weights (`lockstep`) it runs as many forwards as the
busiest process.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from qae_app.algo.chunked_head import causal_lm_logprobs
from qae_app.algo.losses import mismatch_sums, policy_loss, tis_weights, token_logprobs_and_entropy
from qae_app.algo.policy_loss_registry import (
    EntropyCoefficient,
    LossSettings,
    TokenSelection,
    select_mini_batch,
    selection_seed,
)
from qae_app.algo.token_selection import SelectionTokens
from qae_app.core.errors import QAEUserError
from qae_app.models import sharding
from qae_app.train.shared_prompts import shared_prompt_logprobs

# the options TrainConfig gives the update, by the same names
CONFIG_OPTIONS = (
    "num_mini_batches",
    "ppo_epochs",
    "micro_batch_size",
    "clip_low",
    "clip_high",
    "loss_agg",
    "kl_beta",
    "max_grad_norm",
    "max_new_tokens",
    "temperature",
    "max_tokens_per_micro_batch",
    "rollout_correction",
    "rollout_correction_cap",
)


@dataclass(frozen=True)
class UpdateOptions:
    """What the update needs besides the tensors: TrainConfig's update options (see its help), and how to run."""

    num_mini_batches: int  # optimizer steps per pass over the responses
    ppo_epochs: int  # passes over the responses
    micro_batch_size: int  # sequences per forward/backward
    clip_low: float | None  # ratio clip below: 1 - clip_low (clip, clip_cov; None for the other losses)
    clip_high: float | None  # ratio clip above: 1 + clip_high
    loss_agg: str  # names.LOSS_AGGREGATIONS
    kl_beta: float  # weight of the k3 KL to the reference model (policy_update's ref_model)
    max_grad_norm: float
    max_new_tokens: int  # the seq_mean_token_sum_norm normalizer
    temperature: float  # the sampling temperature: log-probs and entropies are of the distribution sampled from
    max_tokens_per_micro_batch: int | None = None  # token-budget micro-batches (micro_batch_plan); None: fixed size
    rollout_correction: str = "none"  # names.ROLLOUT_CORRECTIONS: tis reweights by the sampler's log-probs
    rollout_correction_cap: float = 2.0  # tis: the weight's cap C
    skip_gated: bool = True  # leave zero-advantage responses out (the same update); False: the dense reference
    lockstep: bool = False  # sharded weights (FSDP, ZeRO-3): every process runs as many forwards as the busiest
    logits_keyword: str | None = None  # the model's keyword for the last positions' logits (see logits_keyword)
    logprob_chunk_tokens: int = 0  # tokens per chunk of the chunked vocabulary projection; 0: the full logits
    loss: LossSettings = LossSettings()  # the policy loss by name, its options, the entropy controls
    share_prompts: bool = False  # each distinct prompt once per forward (shared_prompts): unsharded, no checkpointing

    @classmethod
    def from_config(cls, cfg, **how) -> UpdateOptions:
        """The update options of a TrainConfig; `how`: skip_gated, lockstep, logits_keyword, logprob_chunk_tokens
        (the trainer decides it once per run: the config's request, if the model allows the chunked head)."""
        return cls(**{name: getattr(cfg, name) for name in CONFIG_OPTIONS}, loss=LossSettings.from_config(cfg), **how)


@dataclass
class UpdateResult:
    stats: dict  # loss, pg_loss, kl, grad_norm, clip_frac(_low, _high), n_updates, cov_selected_frac, entropy_coef,
    #              MISMATCH_METRICS
    old_logp: torch.Tensor | None  # (N, T-1) the sampling policy's token log-probs, when full_pass ran
    entropy: torch.Tensor | None  # (N, T-1) its token entropies, when full_pass ran
    # (N, T-1) the trainer's old log-probs wherever the update computed them, and (N,) bool the rows it computed them
    # for (the forwarded responses; every one when full_pass ran): the per-token values the store keeps
    computed_logp: torch.Tensor | None = None
    have_old: torch.Tensor | None = None


class MiniBatchPlan(NamedTuple):
    """One PPO epoch's mini-batches (mini_batch_plan): which responses each of its optimizer steps takes."""

    mini_batches: tuple[torch.Tensor, ...]  # each one's global response indices, over every process's responses
    mine: list[torch.Tensor]  # this process's members of each, as local indices


class MicroBatch(NamedTuple):
    """One forward of a micro_batch_plan: which of its sequences go through the model together, and how wide."""

    positions: torch.Tensor  # (n,) positions in the planned `rows`
    width: int | None  # the columns that go through the model (the longest sequence's); None: all of them


class OneProcess:
    """The part of accelerate.Accelerator the update calls, for one process without accelerate (tests, tools)."""

    num_processes, process_index = 1, 0

    def __init__(self, device):
        self.device = torch.device(device)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def no_sync(self, model):
        return contextlib.nullcontext()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


# ---------------------------------------------------------------------------------------------------------------
# the batch and one forward


def pack(samples, pad_id: int, device, float_dtype: torch.dtype = torch.float32) -> dict:
    """Right-padded (prompt + response) tensors of engines.base.Samples: input_ids and attention_mask (N, T);
    response_mask (N, T-1) marks the positions predicting response tokens; sampler_logp (N, T-1), where every sample
    carries the engine's token log-probs, holds them at those positions (0 elsewhere)."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    with_sampler = all(getattr(s, "token_logprobs", None) is not None for s in samples)
    # built as lists and converted once: a tensor write per row costs more than the rest of the packing
    input_ids, attention_mask, response_mask, sampler_logp = [], [], [], []
    for s in samples:
        length = len(s.prompt_ids) + len(s.response_ids)
        input_ids.append(s.prompt_ids + s.response_ids + [pad_id] * (width - length))
        attention_mask.append([1] * length + [0] * (width - length))
        # logits at position t predict token t + 1: response tokens are predicted from len(prompt) - 1 on
        response_mask.append([0] * (len(s.prompt_ids) - 1) + [1] * len(s.response_ids) + [0] * (width - length))
        if with_sampler:
            sampler_logp.append([0.0] * (len(s.prompt_ids) - 1) + list(s.token_logprobs) + [0.0] * (width - length))
    batch = {
        "input_ids": torch.tensor(input_ids, device=device),
        "attention_mask": torch.tensor(attention_mask, device=device),
        "response_mask": torch.tensor(response_mask, dtype=float_dtype, device=device),
    }
    if with_sampler:
        batch["sampler_logp"] = torch.tensor(sampler_logp, dtype=float_dtype, device=device)  # (N, T-1)
    return batch


def float_dtype(model) -> torch.dtype:
    """float64 for a float64 model (exactness tests), else float32 (the loss is computed in float32 at least)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def logits_keyword(model) -> str | None:
    """The model's keyword for computing the last positions' logits only (transformers >= 4.50: logits_to_keep;
    before: num_logits_to_keep), or None. `model` unwrapped: a DDP wrapper's forward takes **kwargs."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in parameters), None)


def forward_logprobs(
    model, batch, rows: torch.Tensor, options: UpdateOptions, with_entropy: bool = True, width: int | None = None
):
    """Token log-probs and (if asked) entropies (n, T-1) of the next tokens of the batch's sequences `rows`, under
    `model`; 0 at the positions before the earliest response of them. The vocabulary projection and softmax run
    from there on only (`logits_to_keep`, as TRL and verl do): on a real model with a long prompt they are most of
    the memory of a forward. With `options.logprob_chunk_tokens` they run that many tokens at a time, never
    building the full logits (`chunked_head.causal_lm_logprobs`, the same numbers).

    `width`: only the first `width` columns go through the model (a token-budget micro-batch, trimmed to its longest
    sequence: `pack` pads on the right, so the columns cut are padding, which no real position attends to); every
    position predicting padding is then 0, the columns cut included. None: all T columns, as they are (cutting the
    padding of fixed micro-batches would change the last bit of the update that runs have always made)."""
    if options.share_prompts:  # the same numbers to float32 rounding, each group's prompt computed once
        shared = shared_prompt_logprobs(
            model, batch, rows, options.temperature, with_entropy, options.logprob_chunk_tokens
        )
        if shared is not None:
            return shared
    input_ids = batch["input_ids"][rows]  # (n, T)
    attention_mask = batch["attention_mask"][rows]  # (n, T)
    full_width = input_ids.shape[1]
    if width is not None:
        input_ids, attention_mask = input_ids[:, :width], attention_mask[:, :width]  # (n, width)
    # logits at position t predict token t + 1: the first response token is predicted at its prompt's last one
    first = (
        int(batch["response_mask"][rows].argmax(-1).min())
        if options.logits_keyword or options.logprob_chunk_tokens
        else 0
    )
    if options.logprob_chunk_tokens:
        logp, entropy = causal_lm_logprobs(
            model, input_ids, attention_mask, first, options.temperature, with_entropy, options.logprob_chunk_tokens
        )  # (n, width-1) each
    else:
        keep = {options.logits_keyword: input_ids.shape[1] - first} if first else {}
        # use_cache=False: the model would otherwise build a KV cache (its config says use_cache) that nothing reads
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **keep).logits[:, :-1]
        logp, entropy = token_logprobs_and_entropy(logits, input_ids[:, first + 1 :], options.temperature, with_entropy)
        if first:
            logp = torch.nn.functional.pad(logp, (first, 0))
            entropy = torch.nn.functional.pad(entropy, (first, 0)) if entropy is not None else None
    if width is not None:
        # 0 wherever the next token is padding: another micro-batch plan (the old log-probs' pass) cuts other
        # columns, and a ratio exp(0 - logp) at a masked position must not overflow into the loss as inf * 0
        predicts_real = attention_mask[:, 1:].bool()  # (n, width-1)
        logp = torch.nn.functional.pad(torch.where(predicts_real, logp, 0.0), (0, full_width - width))  # (n, T-1)
        if entropy is not None:
            entropy = torch.nn.functional.pad(torch.where(predicts_real, entropy, 0.0), (0, full_width - width))
    return logp, entropy


def micro_batch_plan(batch, rows: torch.Tensor, options: UpdateOptions) -> list[MicroBatch]:
    """How the sequences `rows` (n,) go through the model: a MicroBatch (positions in `rows`, width) per forward.

    Default: micro_batch_size sequences at a time, in order, at the batch's full width (width None). With
    max_tokens_per_micro_batch (verl's use_dynamic_bsz): sorted by length (prompt + response tokens), longest
    first, and packed greedily while the micro-batch's sequences x its longest stay within the budget; each is
    trimmed to its longest (width), so padding is only that within a micro-batch. A sequence longer than the budget
    alone is a micro-batch of its own (the trainer refuses such a budget before the run starts). The loss is the
    same either way: each micro-batch's loss carries the mini-batch's normalizer."""
    positions = torch.arange(len(rows), device=rows.device)
    budget = options.max_tokens_per_micro_batch
    if budget is None:
        return [MicroBatch(chunk, None) for chunk in positions.split(options.micro_batch_size)]
    lengths = batch["attention_mask"][rows].sum(-1)  # (n,) real tokens of each sequence
    order = torch.argsort(lengths, descending=True, stable=True)  # (n,)
    sorted_lengths = lengths[order].tolist()
    micro_batches, start = [], 0
    for end in range(1, len(rows) + 1):
        # the micro-batch is order[start:end]; its longest is its first (sorted longest first)
        if end == len(rows) or (end + 1 - start) * sorted_lengths[start] > budget:
            micro_batches.append(MicroBatch(order[start:end], int(sorted_lengths[start])))
            start = end
    return micro_batches


def lockstep_forwards(count: int, options: UpdateOptions, accelerator) -> int:
    """How many forward passes this process runs where it needs `count`. With sharded weights (FSDP, ZeRO-3) every
    forward gathers the shards from all processes, so each must run as many as the busiest one (a process with
    fewer responses runs the rest on a placeholder and drops the result); otherwise just `count`."""
    if not options.lockstep:
        return count
    return int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max())


def logprobs_in_chunks(
    model, batch, rows: torch.Tensor, options: UpdateOptions, accelerator=None, with_entropy: bool = False
):
    """No-grad token log-probs (and entropies) (len(rows), T-1) of the sequences `rows`, one micro-batch
    (micro_batch_plan) at a time; (None, None) for no rows."""
    acc = accelerator or OneProcess(rows.device)
    model_was_training = model.training
    model.eval()
    outs_logp, outs_ent = [], []
    micro_batches = micro_batch_plan(batch, rows, options) if len(rows) else []
    with torch.inference_mode():
        for i in range(lockstep_forwards(len(micro_batches), options, acc)):
            positions, width = micro_batches[i] if i < len(micro_batches) else (None, None)
            chunk = rows[positions] if i < len(micro_batches) else torch.zeros(1, dtype=torch.long, device=rows.device)
            logp, ent = forward_logprobs(model, batch, chunk, options, with_entropy, width)
            if i < len(micro_batches):  # (a lockstep pass beyond this process's micro-batches is discarded)
                outs_logp.append(logp)
                outs_ent.append(ent)
    model.train(model_was_training)
    if not micro_batches:  # (a lockstep pass with no rows of its own)
        return None, None
    # back in the order of `rows` (the micro-batch plan may have sorted them); a new tensor, outside inference_mode:
    # tensors made under it cannot take part in the autograd graph of the loss
    in_order = torch.argsort(torch.cat([micro.positions for micro in micro_batches]))  # (len(rows),)
    return torch.cat(outs_logp)[in_order], torch.cat(outs_ent)[in_order] if with_entropy else None


# ---------------------------------------------------------------------------------------------------------------
# the update


def policy_update(
    model,
    optimizer,
    batch,
    advantages: torch.Tensor,
    options: UpdateOptions,
    accelerator=None,
    *,
    seed: int,
    ref_model=None,
    full_pass: bool = False,
    n_local: int | None = None,
    entropy_control: EntropyCoefficient | None = None,
) -> UpdateResult:
    """num_mini_batches x ppo_epochs optimizer steps over the batch's responses, whose advantages are `advantages`
    (N,); `seed` draws the mini-batches (the same on every process). Returns the stats and, when `full_pass` ran
    over every response, their old log-probs and entropies (N, T-1) of the sampling policy.

    The responses are the first `n_local` rows of the batch (default: all): a process with none (dynamic sampling
    filtered all its groups) passes one placeholder row and advantage, used only for its weight-0 passes.

    Old log-probs (the sampling policy's, for the ratio) are computed only where the loss needs them: not for
    gated responses (their loss is 0 whatever the ratio) unless the KL term, a loss that gives them a gradient
    (kl_cov, the entropy bonus: options.loss.gated_skip_exact) or the dense reference needs every response, and not
    for the first mini-batch, whose training forward runs on the sampling weights: its own log-probs, detached, are
    the old ones (ratio 1, as TRL does with one update per generation). `entropy_control`: the entropy bonus's
    coefficient, which --entropy-target adapts after each optimizer step (updated in place; default: a fixed one).
    """
    acc = accelerator or OneProcess(advantages.device)
    if options.rollout_correction != "none" and "sampler_logp" not in batch:
        raise QAEUserError(
            f"rollout-correction: {options.rollout_correction} reweights by the sampler's token "
            "log-probs, which this engine did not return. Use --rollout-correction none."
        )
    n_rows = advantages.shape[0]  # this process's responses, or one placeholder
    n_local = n_rows if n_local is None else n_local
    device = advantages.device
    tokens_per_seq = batch["response_mask"].sum(-1)  # (n_local,)
    epochs = mini_batch_plan(n_local, seed, options, acc, device)
    work, entropy = _mini_batch_work(
        model, batch, advantages, options, acc, seed, ref_model, full_pass, epochs[0].mine[0], entropy_control
    )
    forwarded, old_logp = work.forwarded, work.old_logp

    totals = dict.fromkeys(("loss", "pg_loss", "kl", "grad_norm", "clipped_low", "clipped_high", "selected"), 0.0)
    tokens = 0.0
    n_updates = 0
    if not all(module.training for module in model.modules()):  # (train() sets every module: ~1 ms a call on CPU)
        model.train()
    for epoch, (mini_batches, mine) in enumerate(epochs):
        # per mini-batch, over all processes: response tokens (the normalizer) and responses forwarded
        counts = torch.tensor(
            [[tokens_per_seq[ix].sum().item(), forwarded[ix].sum().item()] for ix in mine],
            dtype=torch.float64,
            device=acc.device,
        )  # (num_mini_batches, 2)
        if acc.num_processes > 1:
            counts = acc.reduce(counts, reduction="sum")
        for index, (mb, ix, (mb_tokens, mb_forwarded)) in enumerate(
            zip(mini_batches, mine, counts.tolist(), strict=True)
        ):
            normalizer = {"tokens": mb_tokens, "sequences": len(mb), "max_len": options.max_new_tokens}
            optimizer.zero_grad(set_to_none=True)
            if mb_forwarded == 0:
                zero_gradients(model)  # every advantage is 0 on every process: the gradient is exactly 0
            else:
                for key, value in train_mini_batch(model, work, ix, normalizer, (epoch, index)).items():
                    totals[key] += value
            grad_norm = clip_gradients(model, options.max_grad_norm, acc)
            optimizer.step()  # also on a zero gradient, as the dense update does
            n_updates += 1
            totals["grad_norm"] += grad_norm_value(grad_norm, acc)
            tokens += mb_tokens
    return UpdateResult(
        update_stats(totals, tokens, n_updates, work, batch, n_local),
        old_logp if full_pass else None,
        entropy,
        old_logp,
        work.have_old,
    )


def _mini_batch_work(
    model,
    batch,
    advantages: torch.Tensor,
    options: UpdateOptions,
    acc,
    seed: int,
    ref_model,
    full_pass: bool,
    first_mini_batch,
    entropy_control: EntropyCoefficient | None,
):
    """What every mini-batch reads: which responses are forwarded, their old log-probs (and entropies, on a full
    pass) and the reference model's log-probs; returned with the entropies."""
    n_rows = advantages.shape[0]
    device = advantages.device
    needs_all = ref_model is not None or not options.skip_gated or not options.loss.gated_skip_exact
    forwarded = torch.ones(n_rows, dtype=torch.bool, device=device) if needs_all else advantages != 0
    old_logp, have_old, entropy = old_logprobs(model, batch, forwarded, first_mini_batch, full_pass, options, acc)
    ref_logp = (
        logprobs_in_chunks(ref_model, batch, torch.arange(n_rows, device=device), options, acc)[0]
        if ref_model is not None
        else None
    )
    work = MiniBatchWork(
        batch,
        advantages,
        forwarded,
        old_logp,
        have_old,
        ref_logp,
        options,
        acc,
        entropy_control or EntropyCoefficient(options.loss.entropy_coef),
        seed,
    )
    return work, entropy


def zero_gradients(model) -> None:
    """A zero gradient without computing it, for an optimizer step on a mini-batch with nothing to learn from."""
    sharding.reshard(model)  # (FSDP2: onto the sharded parameters the optimizer holds)
    for p in model.parameters():
        if p.requires_grad:  # (not a frozen LoRA base weight: it would hold a gradient forever)
            p.grad = torch.zeros_like(p)


def update_stats(totals: dict, tokens: float, n_updates: int, work: MiniBatchWork, batch, n_local: int) -> dict:
    """The step's update columns: each process held its share of the loss sums and clip counts (grad_norm and the
    selection counts are the same everywhere)."""
    acc = work.accelerator
    if acc.num_processes > 1:
        shares = ("loss", "pg_loss", "kl", "clipped_low", "clipped_high")
        summed = acc.reduce(
            torch.tensor([totals[k] for k in shares], dtype=torch.float64, device=acc.device), reduction="sum"
        ).tolist()
        totals.update(zip(shares, summed, strict=True))
    stats = {key: totals[key] / max(n_updates, 1) for key in ("loss", "pg_loss", "kl", "grad_norm")}
    # (n_rows,) the responses whose loss terms count: advantage != 0, and every one under a KL term (its penalty
    # weighs each response's tokens)
    weighed = work.forwarded & work.have_old & ((work.advantages != 0) | (work.ref_logp is not None))
    weighed[n_local:] = False  # (not a placeholder)
    stats.update(rollout_mismatch(batch, work.old_logp, weighed, acc))
    stats.update(
        clip_frac_low=totals["clipped_low"] / max(tokens, 1),
        clip_frac_high=totals["clipped_high"] / max(tokens, 1),
        clip_frac=(totals["clipped_low"] + totals["clipped_high"]) / max(tokens, 1),
        n_updates=n_updates,
        cov_selected_frac=totals["selected"] / max(tokens, 1),
        entropy_coef=work.entropy_control.coef,
    )
    return stats


def clip_gradients(model, max_norm: float, accelerator) -> torch.Tensor:
    """Clip to max_norm; returns the norm of the whole gradient, also when its shards are spread over processes
    (FSDP2's DTensors, whoever sharded: accelerate's clipping on a CPU would take each process's shard for the whole,
    and on GPUs returns a DTensor)."""
    sharding.reshard(model)
    if sharding.is_sharded(model):
        if hasattr(accelerator, "unscale_gradients"):  # (fp16's loss scaler; a no-op otherwise)
            accelerator.unscale_gradients()
        return sharding.clip_grad_norm_(model.parameters(), max_norm)
    return accelerator.clip_grad_norm_(model.parameters(), max_norm)


def grad_norm_value(grad_norm, accelerator) -> float:
    """The clipped step's gradient norm as a float, read after optimizer.step().

    accelerate returns None under DeepSpeed: DeepSpeed clips inside its own step and knows the norm only after it,
    through its engine. NaN (the store's "not measured") where no engine reports one."""
    if grad_norm is None:
        engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
        grad_norm = engine.get_global_grad_norm() if engine is not None else None
    return math.nan if grad_norm is None else float(grad_norm)


def mini_batch_plan(n_local: int, seed: int, options: UpdateOptions, accelerator, device) -> list[MiniBatchPlan]:
    """A MiniBatchPlan per PPO epoch: the global mini-batches (a permutation of every process's responses drawn from
    `seed`, the same on each process, split into num_mini_batches) and this process's members of each, as local
    indices."""
    acc = accelerator
    # processes may hold different numbers of responses: number them globally, process by process
    counts_per_process = (
        acc.gather(torch.tensor([n_local], device=acc.device)).tolist() if acc.num_processes > 1 else [n_local]
    )
    first = sum(counts_per_process[: acc.process_index])  # global index of this process's first response
    generator = torch.Generator().manual_seed(seed)  # the same on every process
    epochs = []
    n_total = sum(counts_per_process)
    for _ in range(options.ppo_epochs):
        # fewer responses than mini-batches happens only when dynamic sampling's cap left few groups
        mini_batches = torch.randperm(n_total, generator=generator).tensor_split(min(options.num_mini_batches, n_total))
        epochs.append(
            MiniBatchPlan(
                mini_batches, [(mb[(mb >= first) & (mb < first + n_local)] - first).to(device) for mb in mini_batches]
            )
        )
    return epochs


def old_logprobs(
    model,
    batch,
    forwarded: torch.Tensor,
    first_mini_batch: torch.Tensor,
    full_pass: bool,
    options: UpdateOptions,
    accelerator=None,
):
    """(old_logp (N, T-1), have_old (N,), entropy (N, T-1) or None), before any optimizer step.

    `full_pass`: every response (the entropies and log-probs the rows report come from it). Otherwise only the
    responses the loss will forward (`forwarded`) outside the first mini-batch, which takes its own later."""
    n = forwarded.shape[0]
    device = forwarded.device
    if full_pass:
        old_logp, entropy = logprobs_in_chunks(
            model, batch, torch.arange(n, device=device), options, accelerator, with_entropy=True
        )
        return old_logp, torch.ones(n, dtype=torch.bool, device=device), entropy
    old_logp = torch.zeros_like(batch["response_mask"])
    have_old = forwarded.clone()
    have_old[first_mini_batch] = False
    rows = have_old.nonzero().squeeze(-1)
    if len(rows) or options.lockstep:
        logp = logprobs_in_chunks(model, batch, rows, options, accelerator)[0]
        if len(rows):
            old_logp[rows] = logp
    return old_logp, have_old, None


class MiniBatchWork(NamedTuple):
    """What every mini-batch of one policy_update reads: the batch, this process's advantages (N,), which responses
    its forward/backward passes take (`forwarded` (N,)), the old and reference log-probs (N, T-1), the options, the
    accelerator, the entropy bonus's coefficient and the seed the selections draw from."""

    batch: dict
    advantages: torch.Tensor
    forwarded: torch.Tensor
    old_logp: torch.Tensor
    have_old: torch.Tensor
    ref_logp: torch.Tensor | None
    options: UpdateOptions
    accelerator: object
    entropy_control: EntropyCoefficient
    seed: int


def train_mini_batch(model, work: MiniBatchWork, ix: torch.Tensor, normalizer: dict, where: tuple[int, int]) -> dict:
    """One mini-batch's gradient (this process's members `ix`, local indices; `where`: (epoch, index)): its token
    selections first when the loss makes any (select_tokens), then its forward/backward passes; the entropy
    coefficient adapts to the entropy they measured. Returns the sums the step's stats add up."""
    options, acc, settings = work.options, work.accelerator, work.options.loss
    selection = select_tokens(model, work, ix, where) if settings.selects_tokens else TokenSelection()
    normalizer = {
        **normalizer,
        "trained_tokens": (selection.trained_count if selection.trained is not None else normalizer["tokens"]),
    }
    coef = work.entropy_control.applied(settings)
    stats = accumulate_gradients(
        model,
        work.batch,
        ix[work.forwarded[ix]],
        work.old_logp,
        work.have_old,
        work.ref_logp,
        work.advantages,
        normalizer,
        ix,
        options,
        acc,
        selection=selection,
        entropy_coef=coef,
    )
    if settings.entropy_target is not None:
        entropy_sum = torch.tensor([stats.pop("entropy_sum")], dtype=torch.float64, device=acc.device)
        if acc.num_processes > 1:
            entropy_sum = acc.reduce(entropy_sum, reduction="sum")
        work.entropy_control.adapt(entropy_sum.item() / max(normalizer["trained_tokens"], 1), settings)
    stats.pop("entropy_sum", None)
    return {**stats, "selected": selection.selected_count}


def select_tokens(model, work: MiniBatchWork, ix: torch.Tensor, where: tuple[int, int]) -> TokenSelection:
    """The loss's selections over the whole mini-batch (this process's members `ix`): one no-grad pass over every
    member, gated ones too, under the current weights (a response without old log-probs yet, of the first
    mini-batch, takes these as its old ones, as its training forward will), then policy_losses.select_mini_batch,
    the same on every process. `where`: (epoch, index), which seeds Clip-Cov's draw."""
    options, settings, batch = work.options, work.options.loss, work.batch
    rows = ix.sort().values  # (n,) global order: the canonical token order
    logp, entropy = logprobs_in_chunks(
        model, batch, rows, options, work.accelerator, with_entropy=settings.top_entropy_quantile < 1.0
    )
    if logp is None:  # (no member here: the collectives still run, on no tokens)
        logp = entropy = batch["response_mask"][:0]
    tokens = SelectionTokens(
        logp,
        torch.where(work.have_old[rows, None], work.old_logp[rows], logp),
        work.advantages[rows],
        batch["response_mask"][rows],
        entropy,
    )
    return select_mini_batch(
        tokens,
        rows,
        batch["response_mask"],
        settings,
        settings.parameters(options.clip_low, options.clip_high),
        work.accelerator,
        selection_seed(work.seed, *where),
    )


def accumulate_gradients(
    model,
    batch,
    keep,
    old_logp,
    have_old,
    ref_logp,
    advantages,
    normalizer,
    fallback,
    options: UpdateOptions,
    accelerator,
    selection: TokenSelection = TokenSelection(),
    entropy_coef: float = 0.0,
) -> dict:
    """Backward of this process's share (`keep`) of one mini-batch's loss, in micro-batches.

    Each micro-batch's loss uses the mini-batch's normalizer, so their sum is the mini-batch loss exactly; only
    the last backward all-reduces under DDP. A process with nothing to contribute still runs one forward/backward
    (on the first of `fallback`, the mini-batch's members here), weighted 0, because the others wait for its
    gradients. A response without an old log-prob yet (the first mini-batch's) takes its own, detached, and keeps
    it for later epochs. `selection`: the mini-batch's token selections; `entropy_coef`: the entropy bonus's.
    """
    acc = accelerator
    weight = float(acc.num_processes)  # DDP averages gradients over processes: undo it
    if len(keep) == 0:
        keep, weight = (
            (fallback[:1] if len(fallback) else torch.zeros(1, dtype=torch.long, device=advantages.device)),
            0.0,
        )
    stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clipped_low": 0.0, "clipped_high": 0.0, "entropy_sum": 0.0}
    micro_batches = [(keep[positions], width, weight) for positions, width in micro_batch_plan(batch, keep, options)]
    # sharded weights: as many forwards as the busiest process, the extra ones weighted 0 (see lockstep_forwards)
    micro_batches += [(keep[:1], None, 0.0)] * (
        lockstep_forwards(len(micro_batches), options, acc) - len(micro_batches)
    )
    for i, (micro, width, weight) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else acc.no_sync(model):
            out = micro_batch_loss(
                model,
                batch,
                micro,
                width,
                old_logp,
                have_old,
                ref_logp,
                advantages,
                normalizer,
                options,
                selection,
                entropy_coef,
                keep_old=bool(weight),
            )
            acc.backward(out.loss * weight if weight != 1.0 else out.loss)
        if weight:
            stats["loss"] += out.loss.item()
            stats["pg_loss"] += out.pg_loss.item()
            stats["kl"] += out.kl.item()
            stats["clipped_low"] += out.clip_low_count.item()
            stats["clipped_high"] += out.clip_high_count.item()
            stats["entropy_sum"] += out.entropy_sum.item() if out.entropy_sum is not None else 0.0
    return stats


def micro_batch_loss(
    model,
    batch,
    micro,
    width,
    old_logp,
    have_old,
    ref_logp,
    advantages,
    normalizer,
    options: UpdateOptions,
    selection: TokenSelection,
    entropy_coef: float,
    keep_old: bool,
):
    """One forward of the sequences `micro` and their loss (losses.policy_loss, the run's policy loss by name)."""
    settings = options.loss
    logp, entropy = forward_logprobs(
        model, batch, micro, options, with_entropy=settings.with_entropy_bonus, width=width
    )
    known = have_old[micro][:, None]  # (n, 1)
    old = torch.where(known, old_logp[micro], logp.detach())
    if keep_old and not known.all():
        old_logp[micro], have_old[micro] = old, True
    weights = (
        tis_weights(old, batch["sampler_logp"][micro], options.rollout_correction_cap)
        if options.rollout_correction == "tis"
        else None
    )  # (n, T-1), or None: no correction
    return policy_loss(
        logp,
        old,
        advantages[micro],
        batch["response_mask"][micro],
        options.clip_low,
        options.clip_high,
        options.loss_agg,
        normalizer,
        ref_logp[micro] if ref_logp is not None else None,
        options.kl_beta,
        weights,
        loss=settings.name,
        params=dict(settings.params),
        selected=selection.selected[micro] if selection.selected is not None else None,
        trained=selection.trained[micro] if selection.trained is not None else None,
        entropy=entropy,
        entropy_coef=entropy_coef,
    )


MISMATCH_METRICS = ("mismatch_logp_abs", "mismatch_k3_kl", "mismatch_ratio_max")  # rollout_mismatch's columns


def rollout_mismatch(batch, old_logp: torch.Tensor, rows: torch.Tensor, accelerator) -> dict:
    """By how much the sampler's token log-probs (batch["sampler_logp"]) differ from the trainer's old ones
    (`old_logp` (N, T-1), the ratio's denominator) over the response tokens of `rows` (N,) bool, over every process:
    mean |d|, the k3 estimate of KL(sampler || trainer) and the largest pi_old / pi_sampler, d = old - sampler
    (losses.mismatch_sums). NaN without a token; nothing without the sampler's log-probs."""
    acc = accelerator
    if "sampler_logp" not in batch:
        return {}
    sums = mismatch_sums(old_logp[rows], batch["sampler_logp"][rows], batch["response_mask"][rows])  # (4,)
    if acc.num_processes > 1:
        sums = torch.cat(
            [acc.reduce(sums[:3].to(acc.device), reduction="sum"), acc.gather(sums[3:].to(acc.device)).max()[None]]
        )
    abs_sum, k3_sum, tokens, ratio_max = sums.tolist()
    if not tokens:
        return dict.fromkeys(MISMATCH_METRICS, math.nan)
    return dict(zip(MISMATCH_METRICS, (abs_sum / tokens, k3_sum / tokens, ratio_max), strict=True))


# a step with nothing to learn from (dynamic sampling)
NO_UPDATE = {
    **dict.fromkeys(
        (
            "loss",
            "pg_loss",
            "kl",
            "grad_norm",
            "clip_frac",
            "clip_frac_low",
            "clip_frac_high",
            "cov_selected_frac",
            "entropy_coef",
            *MISMATCH_METRICS,
        ),
        math.nan,
    ),
    "n_updates": 0,
}
