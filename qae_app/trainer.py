"""The RL loop: sample, score, QAE advantages, clipped policy-gradient updates, log everything to DuckDB.

How this differs from GRPO: the only change is the baseline (`advantages.py`). With QAE about 80% of responses get
advantage exactly 0 ("gated"); their policy gradient is exactly 0, so when nothing else needs them (no KL term) they
are left out of the update's forward/backward, with the loss normalizer of the full mini-batch so the gradient is
unchanged.

One step, for B prompts x G samples:
    rollout   -> engine samples G responses per prompt                   (rollout_s)
    reward    -> verifier scores each response: 1, 0 or None             (reward_s)
    advantage -> estimator(rewards [B, G]) -> advantages, baseline, regime
    update    -> log-probs/entropy of the sampling policy (no grad), then num_mini_batches optimizer steps (update_s)
    log       -> one transaction into runs/<run_id>/qae.duckdb

Runs on one CPU process as is, and under `accelerate launch` (DDP, FSDP, DeepSpeed): each process samples its share
of the prompts, the main process gathers every row and is the only one to write the database.

    qae train                                   # built-in tiny model and arithmetic task, QAE K=0.4
    accelerate launch -m qae_app.cli train ...  # several processes
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from qae_app.advantages import REGIMES, compute_advantages
from qae_app.config import TrainConfig
from qae_app.errors import QAEUserError
from qae_app.evaluate import evaluate, load_benchmark
from qae_app.faults import fault_point
from qae_app.losses import policy_loss, token_logprobs_and_entropy
from qae_app.models import load_policy
from qae_app.rewards import Scorer
from qae_app.rollout import make_engine
from qae_app.store import DB_FILE, RunWriter, read_last_step
from qae_app.tasks import Task, load_task

CHECKPOINTS_DIR = "checkpoints"
RUN_LOCK = "trainer.pid"  # pid of the process training this run; absent when none is
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.json"
# config fields a resume may change (everything else must match the stored run)
ENTROPY_EMA_ALPHA = 0.1  # smoothing of the entropy that the band warnings watch (about the last 10 steps)
RESUMABLE_OVERRIDES = {"steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_limit",
                       "verify_timeout_s", "run_name"}


def auto_k(success_rate: float) -> float:
    """--k auto: harder tasks get a lower K (a wider hard regime), see config.AUTO_K_RULE."""
    return 0.3 if success_rate < 0.2 else 0.4 if success_rate < 0.5 else 0.5


@dataclass
class TrainerState:
    step: int = 0  # RL steps completed
    k: float | None = None  # K in use (set at step 1 when --k auto)
    entropy_zone: str = "ok"  # "low" / "ok" / "high" for the smoothed entropy: warn once per crossing of the band
    entropy_ema: float | None = None  # exponential moving average of step entropy (alpha ENTROPY_EMA_ALPHA)
    data_position: int = 0  # prompts consumed so far; a resume checks it against step * prompts_per_step

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, path: Path) -> "TrainerState":
        return cls(**json.loads(path.read_text()))


@dataclass
class StepOutput:
    metrics: dict  # one `steps` row (STEP_METRICS names)
    groups: list[dict]  # B `groups` rows, gathered from every process
    rollouts: list[dict]  # B * G `rollouts` rows


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    steps_done: int
    status: str
    last_metrics: dict = field(default_factory=dict)


def _step_seed(seed: int, step: int, process: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + process * 104_729) % (2**31 - 1)


def prompts_for_step(task: Task, seed: int, step: int, per_step: int) -> list[int]:
    """Indices into task.train for RL step `step` (1-based): an epoch-wise seeded shuffle, a pure function of step,
    so a resumed run sees exactly the prompts the uninterrupted run would have."""
    n = len(task.train)
    indices = []
    for position in range((step - 1) * per_step, step * per_step):
        epoch, offset = divmod(position, n)
        indices.append(_epoch_order(seed, epoch, n)[offset])
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 10_007 + epoch).shuffle(order)
    return tuple(order)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """Newest complete checkpoint (a `step-N.tmp` folder left by a kill mid-save is ignored)."""
    ckpts = [p for p in (Path(run_dir) / CHECKPOINTS_DIR).glob("step-*")
             if CHECKPOINT_NAME.match(p.name) and (p / TRAINER_STATE).exists()]
    return max(ckpts, key=lambda p: int(p.name.split("-")[1]), default=None)


def trainer_alive(run_dir: Path) -> bool:
    """Whether a process is training this run now (its pid file names a live process)."""
    try:
        pid = int((Path(run_dir) / RUN_LOCK).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, runs_dir: Path, resume: str | None = None, console=None,
                 cpu: bool | None = None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.console = console
        self.runs_dir = Path(runs_dir)
        # ---------------------------------------------------------------------------------------------------------
        # run folder and config
        if resume is not None:
            cfg, self.run_id = self._resume_config(resume, cfg)
        else:
            self.run_id = cfg.run_name or f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.estimator}"
        self.cfg = cfg
        self.run_dir = self.runs_dir / self.run_id
        if resume is None and (self.run_dir / DB_FILE).exists():
            raise QAEUserError(f"run-name: a run '{self.run_id}' already exists in {self.runs_dir}. "
                               f"Continue it with --resume {self.run_id}, or pick another --run-name.")

        self.accelerator = Accelerator(cpu=cpu if cpu is not None else not torch.cuda.is_available())
        self.is_main = self.accelerator.is_main_process
        if self.accelerator.num_processes > 1 and cfg.prompts_per_step % self.accelerator.num_processes:
            raise QAEUserError(f"prompts-per-step: {cfg.prompts_per_step} does not split over "
                               f"{self.accelerator.num_processes} processes. Use a multiple of the process count.")
        set_seed(cfg.seed)

        # ---------------------------------------------------------------------------------------------------------
        # task, policy, reference, optimizer
        self.task = load_task(cfg.data, cfg.heldout_fraction, cfg.seed)
        if len(self.task.train) == 0:
            raise QAEUserError(f"data: '{cfg.data}' has no training problems. Lower --heldout-fraction.")
        # what --eval-every evaluates: the task's held-out split, or --eval-bench named as `qae eval` names it;
        # loaded now so a bad path fails before anything is written
        self.eval_name, self.eval_problems, self.eval_task = (
            load_benchmark(cfg.eval_bench) if cfg.eval_bench
            else (f"{self.task.name}-heldout", self.task.heldout, self.task))
        model, self.codec = load_policy(cfg.model, cfg.dtype)
        self.ref_model = None
        if cfg.kl_beta > 0:
            self.ref_model, _ = load_policy(cfg.model, cfg.dtype)
            self.ref_model.requires_grad_(False).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        warmup = max(cfg.warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)
        self.engine = make_engine(cfg.engine, self.accelerator.unwrap_model(self.model), self.codec,
                                  model_path=cfg.model)
        self.scorer = Scorer(self.task.reward, cfg.verify_timeout_s)
        # one scorer for the whole run (a math verifier pool takes seconds to start): the training one if it fits
        self.eval_scorer = (self.scorer if self.eval_task.reward == self.task.reward
                            else Scorer(self.eval_task.reward, cfg.verify_timeout_s))
        self.state = TrainerState(k=None if cfg.k == "auto" else float(cfg.k))
        self.writer: RunWriter | None = None
        self.warnings: list[dict] = []
        self.skip_gated = True  # leave zero-advantage sequences out of the update (exact: same gradient)

        # ---------------------------------------------------------------------------------------------------------
        # database and resume
        if resume is not None:
            self._load_checkpoint()
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.writer = RunWriter(self.run_dir / DB_FILE, self.run_id)
            if resume is None:
                (self.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2))
                k = self.state.k if cfg.estimator == "qae" else None  # K means nothing to a mean baseline
                self.writer.create_run(self.run_id, cfg.to_dict(), cfg.estimator, k, cfg.model, cfg.data, cfg.seed)
            else:
                # rows written after the checkpoint are replayed by this run: drop them so each step is stored once
                self.writer.truncate_after(self.state.step)
                (self.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2))
                self.writer.update_run(status="running", error=None, config=cfg.to_dict())

    # -------------------------------------------------------------------------------------------------------------
    # resume

    def _resume_config(self, run: str, overrides: TrainConfig) -> tuple[TrainConfig, str]:
        from qae_app.store import validate_run_name

        run_dir = self.runs_dir / validate_run_name(run)
        if not (run_dir / CONFIG_FILE).exists():
            existing = ", ".join(sorted(p.parent.name for p in self.runs_dir.glob(f"*/{CONFIG_FILE}"))[-10:])
            raise QAEUserError(f"resume: no run '{run}' in {self.runs_dir} (existing: {existing or 'none'}). "
                               "See `qae runs`.")
        if trainer_alive(run_dir):
            raise QAEUserError(f"resume: run '{run}' is being trained right now by process "
                               f"{(run_dir / RUN_LOCK).read_text()}. Stop it first (Ctrl-C), then resume.")
        stored = TrainConfig(**json.loads((run_dir / CONFIG_FILE).read_text()))
        defaults = TrainConfig()
        for name, value in overrides.to_dict().items():
            # only options the user set differently from the defaults count as requested changes
            if value != getattr(defaults, name) and value != getattr(stored, name):
                if name not in RESUMABLE_OVERRIDES:
                    raise QAEUserError(
                        f"resume: --{name.replace('_', '-')} {value} conflicts with run '{run}', which was started "
                        f"with {getattr(stored, name)}. A resumed run keeps its config; start a new run to change "
                        f"it (resume may change: {', '.join(sorted(RESUMABLE_OVERRIDES - {'run_name'}))}).")
                setattr(stored, name, value)
        stored.run_name = run
        return stored.validate(), run

    def _load_checkpoint(self) -> None:
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return  # killed before the first checkpoint: start over from step 0, same run
        self.accelerator.load_state(str(ckpt))
        self.state = TrainerState.load(ckpt / TRAINER_STATE)
        expected = self.state.step * self.cfg.prompts_per_step
        if self.state.data_position != expected:
            raise QAEUserError(f"resume: checkpoint {ckpt} is at prompt {self.state.data_position} of the data, but "
                               f"{self.state.step} steps of {self.cfg.prompts_per_step} prompts end at {expected}. "
                               "The checkpoint does not belong to this run's config; start a new run.")
        self.engine.sync_weights(self.accelerator.unwrap_model(self.model))

    def save_checkpoint(self) -> Path:
        """checkpoints/step-N: accelerate state (model, optimizer, scheduler, RNG), an HF model folder for `qae
        eval`, and the trainer state. Written to a temporary folder and renamed, so a kill never leaves half of one."""
        self.accelerator.wait_for_everyone()
        final = self.run_dir / CHECKPOINTS_DIR / f"step-{self.state.step}"
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        if self.is_main:
            unwrapped = self.accelerator.unwrap_model(self.model)
            unwrapped.save_pretrained(tmp / "model", safe_serialization=True)
            self.codec.save(tmp / "model")
            self.state.save(tmp / TRAINER_STATE)
            fault_point("checkpoint_rename", self.state.step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            ckpts = sorted((p for p in final.parent.glob("step-*") if CHECKPOINT_NAME.match(p.name)),
                           key=lambda p: int(p.name.split("-")[1]))
            for old in ckpts[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    # -------------------------------------------------------------------------------------------------------------
    # one step

    def _forward_logprobs(self, model, input_ids, attention_mask):
        """Token log-probs and entropies (N, T-1) of each sequence's next tokens, under `model`."""
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # (N, T-1, vocab)
        return token_logprobs_and_entropy(logits, input_ids[:, 1:], self.cfg.temperature)

    def _pack(self, samples) -> dict:
        """Right-padded (prompt + response) tensors; response_mask marks the positions predicting response tokens."""
        pad = self.codec.pad_id
        width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        n = len(samples)
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        response_mask = torch.zeros((n, width - 1), dtype=torch.float32)
        for i, s in enumerate(samples):
            ids = s.prompt_ids + s.response_ids
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention_mask[i, : len(ids)] = 1
            # logits at position t predict token t + 1: response tokens are predicted from len(prompt) - 1 on
            response_mask[i, len(s.prompt_ids) - 1 : len(ids) - 1] = 1.0
        device = self.accelerator.device
        return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
                "response_mask": response_mask.to(device)}

    def train_step(self, step: int) -> StepOutput:
        cfg, acc = self.cfg, self.accelerator
        t_step = time.perf_counter()
        per_process = cfg.prompts_per_step // acc.num_processes
        indices = prompts_for_step(self.task, cfg.seed, step, cfg.prompts_per_step)
        mine = indices[acc.process_index * per_process : (acc.process_index + 1) * per_process]
        problems = [self.task.train[i] for i in mine]
        seed = _step_seed(cfg.seed, step, acc.process_index)

        # ---- rollout
        t0 = time.perf_counter()
        samples = self.engine.generate([self.task.prompt(p) for p in problems], cfg.group_size, cfg.temperature,
                                       cfg.max_new_tokens, seed)  # B * G, sample j of prompt i at i * G + j
        rollout_s = time.perf_counter() - t0

        # ---- reward
        t0 = time.perf_counter()
        raw = self.scorer([s.text for s in samples], [problems[s.prompt_index].answer for s in samples])
        reward_s = time.perf_counter() - t0
        rewards = torch.tensor([0.0 if r is None else r for r in raw]).view(len(problems), cfg.group_size)  # (B, G)

        if self.state.k is None and cfg.estimator == "qae":  # --k auto: choose K once, from the first step
            success = acc.reduce(rewards.mean().to(acc.device), reduction="mean").item()
            self.state.k = auto_k(success)
            self.warnings.append({"kind": "auto_k", "message": f"--k auto: first-step success rate {success:.3f} "
                                                               f"-> K = {self.state.k}"})
            if self.writer is not None:
                self.writer.update_run(k=self.state.k)

        # ---- advantages
        adv = compute_advantages(cfg.estimator, rewards, cfg.estimator_config(self.state.k))
        seq_adv = adv.advantages.reshape(-1).to(acc.device)  # (B * G,)

        # ---- update
        t0 = time.perf_counter()
        batch = self._pack(samples)
        old_logp, entropy = self._logprobs_in_chunks(self.model, batch, cfg.micro_batch_size)  # (N, T-1), no grad
        ref_logp = (self._logprobs_in_chunks(self.ref_model, batch, cfg.micro_batch_size)[0]
                    if self.ref_model is not None else None)
        update_stats = self._update(step, batch, old_logp, ref_logp, seq_adv)
        self.engine.sync_weights(acc.unwrap_model(self.model))  # vLLM holds its own copy; hf shares the model
        update_s = time.perf_counter() - t0

        # ---- rows for the store (gathered on the main process)
        mask = batch["response_mask"]
        n_tokens = mask.sum(-1)
        seq_entropy = ((entropy * mask).sum(-1) / n_tokens.clamp(min=1)).cpu()
        seq_logprob = (old_logp * mask).sum(-1).cpu()
        group_rows, rollout_rows = [], []
        offset = acc.process_index * per_process
        for b, problem in enumerate(problems):
            regime = REGIMES[adv.regime[b].item()]
            group_rows.append({
                "group_idx": offset + b, "prompt_id": problem.prompt_id, "prompt": self.task.prompt(problem),
                "answer": problem.answer, "n_correct": int((rewards[b] == 1).sum().item()),
                "group_size": cfg.group_size, "baseline": adv.baseline[b].item(), "regime": regime,
            })
            for g in range(cfg.group_size):
                i = b * cfg.group_size + g
                a = adv.advantages[b, g].item()
                rollout_rows.append({
                    "group_idx": offset + b, "sample_idx": g, "prompt_id": problem.prompt_id,
                    "response": samples[i].text, "reward": rewards[b, g].item(), "verified": raw[i] is not None,
                    "advantage": a, "gated": a == 0.0, "regime": regime, "n_tokens": int(n_tokens[i].item()),
                    "truncated": samples[i].truncated, "entropy": seq_entropy[i].item(),
                    "logprob": seq_logprob[i].item(),
                })
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            group_rows = gather_object(group_rows)
            rollout_rows = gather_object(rollout_rows)
            update_stats = {key: acc.reduce(torch.tensor(float(v), device=acc.device), "mean").item()
                            for key, v in update_stats.items()}
        metrics = step_metrics(group_rows, rollout_rows)
        metrics.update(update_stats)
        metrics.update(k=self.state.k if cfg.estimator == "qae" else None, rollout_s=rollout_s, reward_s=reward_s,
                       update_s=update_s, lr=self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        self._check_entropy(metrics["entropy"])
        metrics["step_s"] = time.perf_counter() - t_step
        return StepOutput(metrics, group_rows, rollout_rows)

    @torch.no_grad()
    def _logprobs_in_chunks(self, model, batch, chunk: int):
        model_was_training = model.training
        model.eval()
        outs_logp, outs_ent = [], []
        n = batch["input_ids"].shape[0]
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            logp, ent = self._forward_logprobs(model, batch["input_ids"][sl], batch["attention_mask"][sl])
            outs_logp.append(logp)
            outs_ent.append(ent)
        model.train(model_was_training)
        return torch.cat(outs_logp), torch.cat(outs_ent)

    def _update(self, step: int, batch, old_logp, ref_logp, seq_adv) -> dict:
        """num_mini_batches x ppo_epochs optimizer steps over this rollout batch."""
        cfg, acc = self.cfg, self.accelerator
        n = seq_adv.shape[0]
        mask = batch["response_mask"]
        generator = torch.Generator().manual_seed(_step_seed(cfg.seed, step, acc.process_index) + 1)
        # the KL term has gradient on gated sequences too; skip_gated=False is kept for benchmarks and tests
        needs_all = self.ref_model is not None or not self.skip_gated
        totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "grad_norm": 0.0}
        clipped_low = clipped_high = tokens = 0
        n_updates = 0
        self.model.train()
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=generator)
            for mb in order.chunk(cfg.num_mini_batches):
                mb = mb.to(seq_adv.device)
                normalizer = {"tokens": mask[mb].sum().item(), "sequences": len(mb), "max_len": cfg.max_new_tokens}
                keep = mb if needs_all else mb[seq_adv[mb] != 0]
                if len(keep) == 0:
                    if acc.num_processes == 1:
                        continue  # every advantage is 0: the gradient is exactly 0, skip the optimizer step
                    keep = mb[:1]  # other processes all-reduce gradients: take part with a zero-advantage sequence
                self.optimizer.zero_grad(set_to_none=True)
                # micro-batches accumulate gradients: each loss uses the mini-batch's normalizer, so their sum is
                # the mini-batch loss exactly; only the last backward all-reduces under DDP
                micro_batches = keep.split(cfg.micro_batch_size)
                for i, micro in enumerate(micro_batches):
                    last = i == len(micro_batches) - 1
                    with contextlib.nullcontext() if last else acc.no_sync(self.model):
                        logp, _ = self._forward_logprobs(self.model, batch["input_ids"][micro],
                                                         batch["attention_mask"][micro])
                        out = policy_loss(logp, old_logp[micro], seq_adv[micro], mask[micro], cfg.clip_low,
                                          cfg.clip_high, cfg.loss_agg, normalizer,
                                          ref_logp[micro] if ref_logp is not None else None, cfg.kl_beta)
                        acc.backward(out.loss)
                    totals["loss"] += out.loss.item()
                    totals["pg_loss"] += out.pg_loss.item()
                    totals["kl"] += out.kl.item()
                    clipped_low += out.clip_low_count.item()
                    clipped_high += out.clip_high_count.item()
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                n_updates += 1
                totals["grad_norm"] += float(grad_norm)
                tokens += normalizer["tokens"]
        stats = {key: value / max(n_updates, 1) for key, value in totals.items()}
        stats.update(clip_frac_low=clipped_low / max(tokens, 1), clip_frac_high=clipped_high / max(tokens, 1),
                     clip_frac=(clipped_low + clipped_high) / max(tokens, 1), n_updates=n_updates)
        return stats

    def _check_entropy(self, entropy: float) -> None:
        """Warn when the smoothed entropy leaves [entropy_low, entropy_high]: once per crossing, not every noisy step."""
        cfg = self.cfg
        if math.isnan(entropy):
            return
        ema = entropy if self.state.entropy_ema is None else (
            ENTROPY_EMA_ALPHA * entropy + (1 - ENTROPY_EMA_ALPHA) * self.state.entropy_ema)
        self.state.entropy_ema = ema
        entropy = ema
        zone = "low" if entropy < cfg.entropy_low else "high" if entropy > cfg.entropy_high else "ok"
        if zone != self.state.entropy_zone and zone != "ok":
            if zone == "low":
                message = (f"entropy (smoothed) {entropy:.3f} fell below {cfg.entropy_low} (collapse risk): raise --k (e.g. "
                           f"{min((self.state.k or 0.4) + 0.1, 0.9):.1f}) so more prompts are 'easy' and failures "
                           "are pushed down, which raises entropy.")
            else:
                message = (f"entropy (smoothed) {entropy:.3f} rose above {cfg.entropy_high} (explosion risk): lower --k (e.g. "
                           f"{max((self.state.k or 0.4) - 0.1, 0.1):.1f}) so more prompts are 'hard' and only "
                           "successes are reinforced, which lowers entropy.")
            self.warnings.append({"kind": f"entropy_{zone}", "message": message})
            if self.console is not None and self.is_main:
                self.console.print(f"[yellow]warning:[/] {message}")
        self.state.entropy_zone = zone

    # -------------------------------------------------------------------------------------------------------------
    # evaluation during training

    def evaluate_heldout(self, step: int) -> float | None:
        """Sampled accuracy on the held-out split (or --eval-bench); logs every metric to `evals`."""
        cfg, acc = self.cfg, self.accelerator
        name, task = self.eval_name, self.eval_task
        problems = self.eval_problems[: cfg.eval_limit] if cfg.eval_limit else self.eval_problems
        if not problems:
            return None
        share = problems[acc.process_index :: acc.num_processes]
        result = evaluate(self.engine, name, share, [task.prompt(p) for p in share], self.eval_scorer, cfg.eval_k,
                          cfg.temperature, cfg.max_new_tokens, seed=_step_seed(cfg.seed, step, acc.process_index) + 7)
        samples = result.samples
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            from qae_app.evaluate import summarize

            samples = gather_object(samples)
            metrics = summarize(name, problems, samples, cfg.eval_k)
        else:
            metrics = result.metrics
        if self.writer is not None:
            self.writer.add_step(step, evals=[{**m, "source": "train"} for m in metrics],
                                 eval_samples=[{**s, "benchmark": name, "source": "train"} for s in samples])
        return next(m["value"] for m in metrics if m["metric"] == "avg@k" and m["subset"] == "all")

    # -------------------------------------------------------------------------------------------------------------
    # the loop

    def fit(self, on_step=None) -> RunResult:
        """Train until cfg.steps. Ctrl-C (or SIGTERM) stops at the end of the current step with a checkpoint, so a
        resumed run is exactly the uninterrupted one; a second Ctrl-C stops at once (rows kept, no new checkpoint)."""
        cfg = self.cfg
        status, error = "running", None
        metrics: dict = {}
        self._stop_requested = False
        previous_handlers = self._install_stop_handlers()
        self._hold_run_lock()
        try:
            if self.state.step == 0 and cfg.eval_every:
                acc0 = self.evaluate_heldout(0)
                if on_step is not None:
                    on_step(0, {"heldout_accuracy": acc0})
                self._flush()
            while self.state.step < cfg.steps and not self._should_stop():
                step = self.state.step + 1
                out = self.train_step(step)
                metrics = out.metrics
                metrics["heldout_accuracy"] = None
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    metrics["heldout_accuracy"] = self.evaluate_heldout(step)
                self.state.step = step
                self.state.data_position = step * cfg.prompts_per_step
                if self.writer is not None:
                    self.writer.add_step(step, steps=[metrics], groups=out.groups, rollouts=out.rollouts,
                                         warnings=self.warnings)
                    self.warnings = []
                fault_point("after_step_rows", step)
                self._flush()
                if on_step is not None:
                    on_step(step, metrics)
                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                    self._flush(force=True)
                    self.save_checkpoint()
            if self.state.step < cfg.steps:  # stopped by a signal at a step boundary
                status = "interrupted"
                self._flush(force=True)
                newest = latest_checkpoint(self.run_dir)
                if newest is None or newest.name != f"step-{self.state.step}":
                    self.save_checkpoint()
            else:
                status = "finished"
        except KeyboardInterrupt:  # second Ctrl-C: stop now; the newest checkpoint stays the resume point
            status = "interrupted"
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
            raise
        finally:
            self._restore_handlers(previous_handlers)
            self.scorer.close()
            if self.eval_scorer is not self.scorer:
                self.eval_scorer.close()
            if self.writer is not None:
                try:
                    self._flush(force=True)
                finally:
                    self.writer.update_run(status=status, error=error)
            self._release_run_lock()
        result = RunResult(self.run_id, self.run_dir, self.state.step, status, metrics)
        if status == "interrupted":
            raise KeyboardInterrupt(result)
        return result

    # -------------------------------------------------------------------------------------------------------------
    # stopping and the run lock

    def _install_stop_handlers(self) -> dict:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            if self.console is not None and self.is_main:
                self.console.print("[yellow]stopping after this step (checkpoint, then exit); "
                                   "Ctrl-C again to stop at once[/]")

        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_handlers(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _should_stop(self) -> bool:
        """All processes agree to stop at the same step boundary (a signal may reach them at different times)."""
        flag = torch.tensor(float(self._stop_requested), device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        return flag.item() > 0

    def _hold_run_lock(self) -> None:
        if self.is_main:
            (self.run_dir / RUN_LOCK).write_text(str(os.getpid()))

    def _release_run_lock(self) -> None:
        if self.is_main:
            (self.run_dir / RUN_LOCK).unlink(missing_ok=True)

    def _flush(self, force: bool = False) -> None:
        if self.writer is None:
            return
        if not self.writer.flush(timeout_s=60 if force else None) and force:
            raise RuntimeError(f"could not write {self.writer.path}: another process kept it locked for 60 s")


# ---------------------------------------------------------------------------------------------------------------
# step metrics from the stored rows (so what the dashboard recomputes from rows equals what was logged)


def step_metrics(group_rows: list[dict], rollout_rows: list[dict]) -> dict:
    n = len(rollout_rows)
    tokens = sum(r["n_tokens"] for r in rollout_rows)
    adv = [r["advantage"] for r in rollout_rows]

    def token_mean(rows):
        count = sum(r["n_tokens"] for r in rows)
        return sum(r["entropy"] * r["n_tokens"] for r in rows) / count if count else math.nan

    # covariance over tokens of token log-prob and its sequence's advantage (logprob is the sequence's sum)
    if tokens:
        mean_logp = sum(r["logprob"] for r in rollout_rows) / tokens
        mean_adv = sum(r["advantage"] * r["n_tokens"] for r in rollout_rows) / tokens
        cov = sum(r["advantage"] * r["logprob"] for r in rollout_rows) / tokens - mean_logp * mean_adv
    else:
        cov = math.nan
    regimes = [g["regime"] for g in group_rows]
    return {
        "reward_mean": sum(r["reward"] for r in rollout_rows) / n,
        "accuracy": sum(r["reward"] == 1.0 for r in rollout_rows) / n,
        "entropy": token_mean(rollout_rows),
        "entropy_pos": token_mean([r for r in rollout_rows if r["advantage"] > 0]),
        "entropy_neg": token_mean([r for r in rollout_rows if r["advantage"] < 0]),
        "frac_zero_adv": sum(a == 0.0 for a in adv) / n,
        **{f"frac_{name}": regimes.count(name) / len(regimes) for name in REGIMES},
        "frac_unverified": sum(not r["verified"] for r in rollout_rows) / n,
        "cov_logp_adv": cov,
        "adv_abs_mean": sum(abs(a) for a in adv) / n,
        "response_len": tokens / n,
        "truncated_frac": sum(r["truncated"] for r in rollout_rows) / n,
    }
