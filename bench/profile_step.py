"""Where one `qae train` step spends its time, and what the update would cost if it skipped more.

    python bench/profile_step.py [--steps 16] [--num-mini-batches 4] [--threads 1] [--group-size 16]

A real `Trainer` at the defaults (8 prompts x 16, 8 new tokens, QAE K=0.4) runs --steps steps, alternating the
gated skip on and off (`skip_gated`, as bench/bench_step.py; both give the same gradient), so the dense update and
the gated one are timed in the same process under the same noise (two consecutive steps are a pair, the order
alternating: bench/harness.py, whose per-pair ratios end the output). The trainer is not changed: the functions it
calls are wrapped to time each phase (rollout, reward, packing, the no-grad log-prob pass over all sequences,
the training forwards, backwards, grad clip + optimizer step, row building, the store write that `fit` does).

Then, on each step's real batch, the alternatives for the update are timed directly:
- the no-grad log-prob pass over the non-gated sequences only (with no KL term the gated ones need no old log-prob);
- the same pass under torch.inference_mode instead of no_grad, and trimmed to the longest kept sequence;
- with --num-mini-batches 1 (and ppo_epochs 1) no separate pass at all: the old log-prob is the training forward's own
  value, detached (ratio 1 by construction, as TRL does); the metrics that the pass also feeds (per-response entropy
  and log-prob, for the rows, the entropy warnings and the dashboard) would then come from the rollout:
  `generate(output_logits=True)` is timed against plain `generate` for that.
Last, one training forward and its backward on 1, 7 and 32 sequences of a real batch: what a forward costs however few
sequences it holds. Timings on a shared machine are noisy: medians with min/max. The first --warmup steps are dropped.
The update's gated / dense ratio, of the medians and per pair, goes to the results log (bench/harness.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from functools import partial

import torch
from harness import describe, pair_order, pair_ratios, report, spread

import qae_app.train.trainer
from qae_app.config import build_config
from qae_app.train import update
from qae_app.train.step_results import step_tables
from qae_app.train.trainer import Trainer


class PhaseClock:
    """Seconds per named phase within the current step."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name_of() if callable(name_of) else name_of] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        out, self.current = dict(self.current), defaultdict(float)
        return out


def kept_subset(batch: dict, seq_adv: torch.Tensor, trim: bool) -> dict:
    keep = (seq_adv != 0).nonzero().squeeze(-1)
    sub = {key: value[keep] for key, value in batch.items()}
    if trim:  # right padding: cut the columns that no kept sequence reaches
        width = int(sub["attention_mask"].sum(-1).max().item())
        sub = {
            "input_ids": sub["input_ids"][:, :width],
            "attention_mask": sub["attention_mask"][:, :width],
            "response_mask": sub["response_mask"][:, : width - 1],
        }
    return sub


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def generate_with_and_without_logits(trainer: Trainer, prompts: list[str], seed: int) -> tuple[float, float]:
    """Plain generate vs generate that also returns each step's logits and turns them into entropy and log-prob."""
    cfg, codec = trainer.cfg, trainer.codec
    model = trainer.accelerator.unwrap_model(trainer.model)
    encoded = [codec.encode(p) for p in prompts for _ in range(cfg.group_size)]
    width = max(len(ids) for ids in encoded)
    input_ids = torch.tensor([[codec.pad_id] * (width - len(ids)) + ids for ids in encoded])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=cfg.temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=codec.pad_id,
        eos_token_id=codec.eos_id,
    )
    model.eval()

    @torch.no_grad()
    def plain():
        torch.manual_seed(seed)
        model.generate(**kwargs)

    @torch.no_grad()
    def with_logits():
        torch.manual_seed(seed)
        out = model.generate(**kwargs, return_dict_in_generate=True, output_logits=True)
        logits = torch.stack(out.logits, 1).float() / cfg.temperature  # (N, new, vocab)
        logp_all = torch.log_softmax(logits, -1)
        logp_all.gather(-1, out.sequences[:, width:, None])  # sampled tokens' log-probs
        -(logp_all.exp() * logp_all).sum(-1)  # entropies

    result = (timed(plain), timed(with_logits))
    model.train()
    return result


def forward_backward_cost(trainer: Trainer, batch: dict, sizes=(1, 7, 32), repeats: int = 10) -> dict:
    """Median seconds of one training forward and of its backward on the first n sequences of a real batch, for each n
    in `sizes`: how much of a forward is paid however few sequences it holds (the gated update runs one per
    mini-batch on its few kept responses)."""
    trainer.model.train()
    cost = {}
    for n in sizes:
        rows = torch.arange(min(n, len(batch["input_ids"])))
        forwards, backwards = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            logp, _ = update.forward_logprobs(trainer.model, batch, rows, trainer.update_options(), with_entropy=False)
            loss = (logp * batch["response_mask"][rows]).sum()
            middle = time.perf_counter()
            loss.backward()
            forwards.append(middle - start)
            backwards.append(time.perf_counter() - middle)
        cost[len(rows)] = (statistics.median(forwards), statistics.median(backwards))
    trainer.optimizer.zero_grad(set_to_none=True)
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="steps (half with the gated skip, half dense)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-mini-batches", type=int, default=4, help="the trainer's default is 4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=16, help="samples per prompt (the trainer's default: 16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as runs_dir:
        cfg = build_config(
            run_name="profile",
            steps=args.steps,
            eval_every=0,
            checkpoint_every=0,
            num_mini_batches=args.num_mini_batches,
            group_size=args.group_size,
        )
        trainer = Trainer(cfg, runs_dir, cpu=True)
        clock = PhaseClock()
        acc = trainer.accelerator
        trainer.engine.generate = clock.wrap("rollout", trainer.engine.generate)
        # the update's functions are wrapped where they are looked up: the trainer's names and the update module's
        qae_app.train.trainer.pack = clock.wrap("pack", qae_app.train.trainer.pack)
        update.logprobs_in_chunks = clock.wrap("logprob pass (no grad, all)", update.logprobs_in_chunks)
        update.forward_logprobs = clock.wrap(
            lambda: "train forward" if torch.is_grad_enabled() else "(pass forwards)", update.forward_logprobs
        )
        acc.backward = clock.wrap("backward", acc.backward)
        acc.clip_grad_norm_ = clock.wrap("clip + optimizer step", acc.clip_grad_norm_)
        trainer.optimizer.step = clock.wrap("clip + optimizer step", trainer.optimizer.step)
        captured = {}
        policy_update = qae_app.train.trainer.policy_update

        def capturing_update(model, optimizer, batch, advantages, *args, **kwargs):
            captured.update(batch=batch, seq_adv=advantages)
            return policy_update(model, optimizer, batch, advantages, *args, **kwargs)

        qae_app.train.trainer.policy_update = clock.wrap("policy_update", capturing_update)
        options = trainer.update_options()

        rows = {"skip": [], "dense": []}
        pairs: dict[int, dict[str, float]] = defaultdict(dict)  # pair index -> update_s of each mode
        whatif = defaultdict(list)
        for step in range(1, args.steps + 1):
            # steps 2i+1 and 2i+2 are pair i, the order alternating (bench/harness.py)
            pair, place = divmod(step - 1, 2)
            mode = ("skip", "dense")[pair_order(pair)[place]]
            trainer.skip_gated = mode == "skip"
            out = trainer.train_step(step)
            phases = clock.take()
            m = out.metrics
            t0 = time.perf_counter()
            m["heldout_accuracy"] = None
            trainer.session.write_step(step, step_tables(out, None))  # what fit does after each step
            trainer.session.drain_writes()
            phases["store write"] = time.perf_counter() - t0
            phases["reward"] = m["reward_s"]
            phases["update_s"] = m["update_s"]
            phases["step_s"] = m["step_s"]
            phases["other update (loss, sync)"] = (
                m["update_s"]
                - phases.get("pack", 0)
                - phases.get("logprob pass (no grad, all)", 0.0)
                - phases["train forward"]
                - phases["backward"]
                - phases["clip + optimizer step"]
            )
            phases["rows, advantages, metrics"] = m["step_s"] - m["rollout_s"] - m["reward_s"] - m["update_s"]
            phases["frac_gated"] = m["frac_zero_adv"]
            phases["n_updates"] = m["n_updates"]
            if step <= args.warmup:
                continue
            rows[mode].append(phases)
            pairs[pair][mode] = m["update_s"]
            batch, seq_adv = captured["batch"], captured["seq_adv"]
            all_rows = torch.arange(len(seq_adv))
            kept_rows = (seq_adv != 0).nonzero().squeeze(-1).cpu()
            kept_trim = kept_subset(batch, seq_adv, trim=True)
            whatif["pass, all, + entropy"].append(
                timed(partial(update.logprobs_in_chunks, trainer.model, batch, all_rows, options, with_entropy=True))
            )
            whatif["pass, all"].append(
                timed(partial(update.logprobs_in_chunks, trainer.model, batch, all_rows, options))
            )
            whatif["pass, kept only"].append(
                timed(partial(update.logprobs_in_chunks, trainer.model, batch, kept_rows, options))
            )
            whatif["pass, kept only, trimmed"].append(
                timed(
                    partial(update.logprobs_in_chunks, trainer.model, kept_trim, torch.arange(len(kept_rows)), options)
                )
            )
            prompts = sorted({g["prompt"] for g in out.groups})
            plain, with_logits = generate_with_and_without_logits(trainer, prompts, step)
            whatif["generate, plain"].append(plain)
            whatif["generate, + logits -> entropy, log-prob"].append(with_logits)
            clock.take()  # what-if timings are not phases of the step
        per_size = forward_backward_cost(trainer, captured["batch"])
        clock.take()

    def med(values):
        return statistics.median(values) * 1e3

    print(
        f"{args.steps - args.warmup} steps after {args.warmup} warm-up, alternating skip/dense; "
        f"num_mini_batches {args.num_mini_batches}, micro_batch_size {cfg.micro_batch_size}, torch threads "
        f"{torch.get_num_threads()} (shared machine: noisy; medians, min-max in brackets)"
    )
    gated = statistics.mean(r["frac_gated"] for r in rows["skip"] + rows["dense"])
    print(
        f"mean gated fraction {gated:.2f}; optimizer updates per step (skip) "
        f"{sorted({r['n_updates'] for r in rows['skip']})}"
    )
    names = [
        "rollout",
        "reward",
        "pack",
        "logprob pass (no grad, all)",
        "train forward",
        "backward",
        "clip + optimizer step",
        "other update (loss, sync)",
        "update_s",
        "rows, advantages, metrics",
        "step_s",
        "store write",
    ]
    print(f"{'phase (ms)':32s} {'gated skip':>22s} {'dense':>22s}")
    for name in names:
        cells = []
        for mode in ("skip", "dense"):
            values = [r.get(name, 0.0) for r in rows[mode]]
            cells.append(f"{med(values):7.1f} [{min(values) * 1e3:5.1f}-{max(values) * 1e3:6.1f}]")
        print(f"  {name:30s} {cells[0]:>22s} {cells[1]:>22s}")
    print("what-if, on the same batches (ms):")
    for name, values in whatif.items():
        print(f"  {name:42s} {med(values):7.1f} [{min(values) * 1e3:5.1f}-{max(values) * 1e3:6.1f}]")

    print(
        "one training forward / its backward on n sequences of the last step's batch (ms; the fixed part is what "
        "the gated update pays per mini-batch):"
    )
    for n, (forward_s, backward_s) in per_size.items():
        print(f"  n = {n:3d}: {forward_s * 1e3:6.1f} / {backward_s * 1e3:6.1f}")

    update_skip = statistics.median(r["update_s"] for r in rows["skip"])
    update_dense = statistics.median(r["update_s"] for r in rows["dense"])
    pass_all = statistics.median(r.get("logprob pass (no grad, all)", 0.0) for r in rows["skip"])
    pass_kept = statistics.median(whatif["pass, kept only, trimmed"])
    print(
        f"update, gated skip / dense (measured): {update_skip * 1e3:.1f} / {update_dense * 1e3:.1f} ms = "
        f"{update_skip / update_dense:.2f}x"
    )
    print(
        f"  with the pass over kept sequences only (estimate: skip - pass(all) + pass(kept)): "
        f"{(update_skip - pass_all + pass_kept) / update_dense:.2f}x"
    )
    if args.num_mini_batches == 1 and cfg.ppo_epochs == 1:
        print(
            f"  with no separate pass (old log-prob = training forward, detached): "
            f"{(update_skip - pass_all) / update_dense:.2f}x"
        )
    complete = [p for p in pairs.values() if len(p) == 2]
    ratios = pair_ratios([p["skip"] for p in complete], [p["dense"] for p in complete])
    print(f"update ratio gated/dense, per pair of consecutive steps: {describe(ratios)}")
    shape = f"builtin:tiny G={args.group_size}, {args.num_mini_batches} mini-batches"
    note = (
        f"{gated:.0%} gated, {torch.get_num_threads()} threads; medians {update_skip * 1e3:.0f} against "
        f"{update_dense * 1e3:.0f} ms"
    )
    report(
        f"profile_step: update time, gated skip / dense, {shape}",
        round(update_skip / update_dense, 4),
        None,
        unit="x",
        note=f"ratio of the medians; {note}",
    )
    report(
        f"profile_step: update time, gated skip / dense per pair, {shape}",
        round(spread(ratios).median, 4),
        None,
        unit="x",
        spread=spread(ratios),
        note=note,
    )


if __name__ == "__main__":
    main()
