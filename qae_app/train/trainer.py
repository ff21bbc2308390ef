"""The RL loop: sample, score, QAE advantages, clipped policy-gradient updates, log everything to DuckDB.

How this differs from GRPO: the only change is the baseline (`advantages.py`). With QAE about 80% of responses get
advantage exactly 0 ("gated"); their policy gradient is exactly 0, so when nothing else needs them (no KL term) they
are left out of the update's forward/backward, with the loss normalizer of the full mini-batch, so the update is the
one the dense computation gives (`update.py`).

One step, for B prompts x G samples (`train_step` reads as these six):
    sample and score -> engine samples G responses per prompt (rollout_s); the run's rewards score each (reward_s):
                        the task's verifier (1, 0 or None) or --reward's weighted sum (scoring/reward_path.py)
    the K in use     -> --k auto chooses K once, from the first step's success rate
    advantages       -> estimator(rewards [B, G]) -> advantages, baseline, regime
    update           -> log-probs/entropy of the sampling policy (no grad), then num_mini_batches optimizer steps, and
                        its diagnostics (dH, the entropy attribution) (update_s), then the weight sync (sync_s)
    weight sync      -> the engine takes the new weights (vLLM holds its own copy; hf shares the model)
    output           -> the step's rows and metrics; `fit` hands them to the run's session, which writes them into
                        runs/<run_id>/qae.duckdb

Runs on one CPU process as is, and under `accelerate launch` (DDP, FSDP, DeepSpeed; configs/accelerate/, and for
FSDP2 on CPUs `sharding.py`): each process samples its share of the prompts; mini-batches are drawn over the whole
step's responses, so every loss normalizer counts the tokens of all processes and the update equals the one-process
update on the same samples; the main process gathers every row and is the only one to write the run folder's
database (`session.py`: the run folder's life, checkpoints, signals).

    qae train                                   # built-in tiny model and arithmetic task, QAE K=0.4
    accelerate launch -m qae_app.cli train ...  # several processes
"""

from __future__ import annotations

import time
from datetime import datetime
from functools import partial
from pathlib import Path

import torch

from qae_app.algo.advantages import EstimatorConfig, step_advantages
from qae_app.algo.chunked_head import logprob_chunk_tokens
from qae_app.algo.policy_loss_registry import EntropyCoefficient
from qae_app.config import TrainConfig, check_launch_mixed_precision
from qae_app.core import names
from qae_app.core.alert_levels import parse_alerts
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.faults import fault_point
from qae_app.core.formatting import as_float
from qae_app.core.hashing import file_sha256
from qae_app.data.tasks import prompts_at
from qae_app.engines.factory import make_engine
from qae_app.engines.sampling import step_seed
from qae_app.engines.sharded_policy import ShardedPolicy
from qae_app.evaluation.evaluate import evaluate, summarize
from qae_app.models.lora import AdaptersDisabled, apply_lora, trainable_parameters
from qae_app.models.policy import (
    check_prompt_lengths,
    check_token_budget,
    disable_dropout,
    enable_gradient_checkpointing,
    load_policy,
    rollout_positions,
    token_texts,
)
from qae_app.models.sharding import describe, prepare, shard_models, sharding_plan_for
from qae_app.rewards.registry import data_columns
from qae_app.scoring.reward_path import run_benchmark, run_rewards, run_task, score_batch
from qae_app.store.rows import step_metrics
from qae_app.store.signal import primary_component
from qae_app.store.tokens import kept_responses, responses_kept
from qae_app.train import token_values
from qae_app.train.alerts import StepFacts, watch
from qae_app.train.entropy_attribution import ATTRIBUTION_METRICS, entropy_attribution
from qae_app.train.entropy_change import ENTROPY_CHANGE_METRICS, entropy_change
from qae_app.train.optimizer import optimizer_and_schedule
from qae_app.train.precision import check_updates_move_the_weights
from qae_app.train.reward_record import checked_record, file_record
from qae_app.train.session import RunSession
from qae_app.train.step_results import (
    GenerationBatch,
    HeldoutEval,
    RunResult,
    SampledStep,
    StepOutput,
    StepRows,
    StepUpdate,
    TokenSources,
    group_results,
    sampling_policy_stats,
    step_rows,
    step_tables,
)
from qae_app.train.token_values import CAPPED_METRICS, capped_tokens, trainer_tokens
from qae_app.train.trainer_state import TrainerState
from qae_app.train.update import (
    MISMATCH_METRICS,
    NO_UPDATE,
    UpdateOptions,
    float_dtype,
    logits_keyword,
    pack,
    policy_update,
)

# ---------------------------------------------------------------------------------------------------------------
# sampling: which groups dynamic sampling keeps (each batch's seed: engines.sampling.step_seed)


def groups_with_signal(rewards: torch.Tensor, correct: torch.Tensor, metric: str) -> torch.Tensor:
    """(B,) bool: the groups dynamic sampling keeps, by names.FILTER_METRICS. rewards (B, G), correct (B, G) bool."""
    if metric == "correct":
        return correct.any(dim=1) & ~correct.all(dim=1)
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def generation_cap_warning(cfg: TrainConfig, step: int, n_trained: int, n_batches: int) -> dict | None:
    """When dynamic sampling's --max-gen-batches batches found fewer than prompts_per_step groups with signal: the
    step's `warnings` row (--on-gen-cap train: the step trains on the groups found), or, with --on-gen-cap stop, a
    QAEUserError that ends the run failed, the reason as its error, before the step trains (as verl raises)."""
    if not cfg.dynamic_sampling or n_trained >= cfg.prompts_per_step:
        return None
    found = (
        f"dynamic sampling found {n_trained} of the {cfg.prompts_per_step} groups with signal it wanted in "
        f"{n_batches} generation batches (--max-gen-batches {cfg.max_gen_batches})"
    )
    if cfg.on_gen_cap == "stop":
        raise QAEUserError(
            f"on-gen-cap: stop: at step {step}, {found}; the step was not trained. Raise "
            "--max-gen-batches (0: no cap), or use --on-gen-cap train to train on the groups found."
        )
    return {
        "kind": "dynamic_sampling_cap",
        "message": f"{found}; this step trains on those {n_trained}. Raise --max-gen-batches, or check the data: "
        "the policy solves all or none of the responses to most prompts (frac_all_correct, "
        "frac_all_wrong).",
    }


# ---------------------------------------------------------------------------------------------------------------


def check_prompts_split(prompts_per_step: int, n_processes: int) -> None:
    if n_processes > 1 and prompts_per_step % n_processes:
        raise QAEUserError(
            f"prompts-per-step: {prompts_per_step} does not split over {n_processes} processes. Use a "
            "multiple of the process count."
        )


def close_workers(trainer) -> None:
    """Stop the verifier pools (the training and evaluation rewards may be one object) and the engine, each once."""
    workers = [getattr(trainer, name, None) for name in ("rewards", "eval_rewards", "engine")]
    for worker in {id(w): w for w in workers if w is not None}.values():
        worker.close()


class Trainer:
    """`Trainer(cfg, runs_dir).fit()` trains a new run; `Trainer(resume_config(...), runs_dir, resume=True)` continues
    one from its newest valid checkpoint. Setup takes the run's lock first (its RunSession), so nothing slow runs for
    a run that another process is training, and a new run's folder appears (atomically, by a rename) only once it can
    train. `fit` lets go of the run folder when it ends; a caller that only runs train_step calls close() (or uses
    `with Trainer(...) as trainer:`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        runs_dir: Path,
        resume: bool = False,
        console=None,
        cpu: bool | None = None,
        accept_changed_reward: bool = False,
    ):
        self._t_start = time.perf_counter()
        self.cfg = cfg
        self.console = console
        self.runs_dir = Path(runs_dir)
        self.resuming = resume
        self.skip_gated = True  # leave zero-advantage sequences out of the update (same update; tests turn it off)
        self.alerts = parse_alerts(cfg.alerts)  # what the alerts watch for (train/alerts.py)
        self._setup_s: float | None = None
        self._wall_s_before = self._setup_s_before = 0.0  # time spent by earlier sessions of a resumed run
        self._setup_processes(cpu)
        self.session = RunSession(
            self.runs_dir,
            self.run_id,
            cfg,
            self.accelerator,
            resume,
            say=self._say,
            started=self._t_start,
            distributed=describe(self.accelerator, sharding_plan_for(self.accelerator).sharding),
        )
        self.run_dir = self.session.run_dir
        try:
            self._load_data()
            self._load_models()
            if resume:
                restored = self.session.checkpoints.restore(
                    self.data_fingerprint, self.model, self.optimizer, self.scheduler
                )
                if restored is not None:
                    self.state = restored
                    self.engine.sync_weights(self.accelerator.unwrap_model(self.model))
            self.session.reward_files = self._check_rewards(accept_changed_reward)
            earlier = self.session.open_store(self.state)
            # (the earlier sessions' times of a resumed run; NULL in a run that never finished a step)
            self._wall_s_before = as_float(earlier.get("wall_s")) or 0.0
            self._setup_s_before = as_float(earlier.get("setup_s")) or 0.0
        except BaseException:  # nothing is left behind: no lock, no half-made run folder, no verifier workers
            self.close()
            raise

    # -------------------------------------------------------------------------------------------------------------
    # setup phases, in the order __init__ runs them

    def _setup_processes(self, cpu: bool | None) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, set_seed

        cfg = self.cfg
        check_launch_mixed_precision(cfg.mixed_precision)
        # no buffer broadcast at each DDP forward: it is a collective, and processes run different numbers of
        # forwards (gated responses skip theirs); the models' buffers (rotary tables) are constants anyway
        self.accelerator = Accelerator(
            cpu=cpu if cpu is not None else not torch.cuda.is_available(),
            mixed_precision=cfg.mixed_precision,  # bf16: autocast, float32 weights
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        )
        # sharded weights (FSDP, ZeRO-3): every forward is a collective, so processes run them in lockstep
        self.lockstep = self.accelerator.num_processes > 1 and sharding_plan_for(self.accelerator).sharding != "none"
        self.is_main = self.accelerator.is_main_process
        n = self.accelerator.num_processes
        check_prompts_split(cfg.prompts_per_step, n)
        # the run id, decided once by the main process (a default id from the clock could differ between processes)
        run_id = [cfg.run_name or f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.estimator}"]
        if n > 1:
            broadcast_object_list(run_id)
        self.run_id = run_id[0]
        set_seed(cfg.seed)

    def _load_data(self) -> None:
        cfg = self.cfg
        self.task = run_task(cfg)
        if len(self.task.train) == 0:
            raise QAEUserError(f"data: '{cfg.data}' has no training problems. Lower --heldout-fraction.")
        self.data_fingerprint = file_sha256(Path(cfg.data)) if Path(cfg.data).is_file() else None
        # what --eval-every evaluates: the task's held-out split, or --eval-bench named as `qae eval` names it;
        # loaded now so a bad path fails before anything is written
        self.eval_name, self.eval_problems, self.eval_task = (
            run_benchmark(cfg, cfg.eval_bench, "eval-bench")
            if cfg.eval_bench
            else (f"{self.task.name}-heldout", self.task.heldout, self.task)
        )

    def _check_rewards(self, accept_changed: bool) -> dict:
        """The rewards' code, checked before it runs: on a resume a `PATH.py:FUNCTION` file that changed since the
        run scored with it is refused before a worker imports it (unless `accept_changed`); then the workers import
        every function and check what it asks for against the data's columns. Returns the run's `reward_files`."""
        if self.resuming and not accept_changed:
            checked_record(self.run_dir, file_record(self.rewards), self.state.step, accept_changed=False)
        found = self.rewards.check(data_columns(self.task.train + self.task.heldout))
        if self.eval_rewards is not self.rewards:
            self.eval_rewards.check(data_columns(self.eval_problems))
        return checked_record(self.run_dir, found, self.state.step, accept_changed, self._say)

    def _load_models(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        model, self.codec = load_policy(cfg.model, cfg.dtype)
        disable_dropout(model)  # old log-probs (no grad) and the update must see the same network
        data = [(p.prompt_id, self.task.prompt(p)) for p in self.task.train + self.task.heldout]  # both splits
        evals = [(p.prompt_id, self.eval_task.prompt(p)) for p in self._evaluated_problems()]  # --eval-every's
        self._check_prompts_fit(model, data, evals)
        if cfg.gradient_checkpointing:  # (only training forwards: the no-grad passes and generate run as they are)
            enable_gradient_checkpointing(model)
        self.logits_keyword = logits_keyword(model)  # (of the Hugging Face model: peft's and DDP's take **kwargs)
        if cfg.log_entropy_attribution and getattr(acc.state, "deepspeed_plugin", None) is not None:
            raise QAEUserError(
                "log-entropy-attribution: DeepSpeed keeps its own master weights inside its optimizer, "
                "which the trial updates cannot restore. Launch with DDP or FSDP, or drop the option."
            )
        model = self._with_lora_and_reference(model)
        # with LoRA only the adapters are trainable: no gradient or moments for the rest. The scheduler is stepped once
        # per RL step on every process; not passed to accelerate.prepare, whose wrapper would step it once per process
        # per call (a warmup num_processes times too fast); checkpointed by the session, as JSON
        # FSDP2 where accelerate falls back to DDP (CPUs): sharded here, before the optimizer takes the parameters
        check_updates_move_the_weights(trainable_parameters(model), cfg.lr, cfg.dtype)
        model, self.ref_model = shard_models(acc, model, self.ref_model)
        optimizer, self.scheduler = optimizer_and_schedule(
            trainable_parameters(model), cfg.lr, cfg.weight_decay, cfg.warmup_steps
        )
        self.model, self.optimizer = prepare(acc, model, optimizer)
        self.logprob_chunk_tokens = logprob_chunk_tokens(self.model, cfg.logprob_chunk_tokens, self._say)
        # each group's prompt once per training forward (shared_prompts): not over sharded weights, whose forward
        # gathers them once per call, nor under gradient checkpointing, which drops the prompt's cache
        self.share_prompts = sharding_plan_for(acc).sharding == "none" and not cfg.gradient_checkpointing
        if self.ref_model is not None and not cfg.lora_rank:
            self.ref_model.to(acc.device)
        self.engine = make_engine(
            cfg.engine,
            acc.unwrap_model(self.model),
            self.codec,
            model_path=cfg.model,
            sharded=ShardedPolicy.of(acc, self.model),
            rollout_dtype=cfg.rollout_dtype,
            sleep=cfg.vllm_sleep,
            gpu_memory_utilization=cfg.vllm_gpu_memory,
            max_model_len=rollout_positions(model, self.codec, data + evals, cfg.max_new_tokens),
        )
        self.rewards = run_rewards(cfg, self.task.reward)  # (its workers start when it first scores)
        # one RewardSet for the whole run (a math verifier pool takes seconds to start): the training one if it fits
        self.eval_rewards = (
            self.rewards
            if cfg.reward or self.eval_task.reward == self.task.reward
            else run_rewards(cfg, self.eval_task.reward)
        )
        self.state = TrainerState(
            k=None if cfg.k == "auto" else float(cfg.k),
            data_fingerprint=self.data_fingerprint,
            num_processes=acc.num_processes,
        )

    def _check_prompts_fit(self, model, data: list, evals: list) -> None:
        """Refuse prompts (the data's, --eval-bench's) too long for the model's context with the responses, and a
        --max-tokens-per-micro-batch a single prompt and response overflow."""
        cfg = self.cfg
        check_prompt_lengths(model, self.codec, data, cfg.max_new_tokens, "data", cfg.system_prompt)
        if cfg.eval_bench and cfg.eval_every:  # the problems --eval-every evaluates, as `qae eval` checks them
            check_prompt_lengths(model, self.codec, evals, cfg.max_new_tokens, "eval-bench")
        if cfg.max_tokens_per_micro_batch is not None:  # (the trained prompts: the held-out ones are only sampled)
            check_token_budget(
                self.codec,
                [(p.prompt_id, self.task.prompt(p)) for p in self.task.train],
                cfg.max_new_tokens,
                cfg.max_tokens_per_micro_batch,
                "the data's",
            )

    def _with_lora_and_reference(self, model):
        """The policy with its LoRA adapters (--lora-rank), and self.ref_model for --kl-beta: the policy with its
        adapters off under LoRA, else a frozen second copy."""
        cfg, acc = self.cfg, self.accelerator
        if cfg.lora_rank:
            if sharding_plan_for(acc).sharding != "none":
                raise QAEUserError(
                    f"lora-rank: LoRA is not supported with sharded weights "
                    f"({sharding_plan_for(acc).sharding}). Launch with DDP (accelerate launch "
                    "--multi_gpu) or one process, or train every weight (--lora-rank 0)."
                )
            model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, model_name=cfg.model)
        self.ref_model = None
        if cfg.kl_beta > 0 and cfg.lora_rank:  # the base model is the policy with its adapters off: no second copy
            self.ref_model = AdaptersDisabled(model)
        elif cfg.kl_beta > 0:
            self.ref_model, _ = load_policy(cfg.model, cfg.dtype)
            self.ref_model.requires_grad_(False).eval()
        return model

    # -------------------------------------------------------------------------------------------------------------
    # the loop

    def fit(self, on_step=None) -> RunResult:
        """Train until cfg.steps. Ctrl-C (or SIGTERM, SIGHUP) stops at the end of the current step with a checkpoint,
        so a resumed run is exactly the uninterrupted one, and returns status `interrupted`; a second Ctrl-C stops at
        once (rows kept, the newest checkpoint stays the resume point).

        Every second of a step is in its row: rollout_s, reward_s, update_s and sync_s (train_step), eval_s, write_s
        (building rows and waiting for the store, which writes on its own thread while the next step trains) and
        checkpoint_s; step_s is the whole iteration. store_s is the CPU time the store's thread spent on the step.
        The run's row gets setup_s and wall_s."""
        cfg = self.cfg
        status, error = "running", None
        self.session.catch_stop_signals()
        try:
            if self.state.step == 0 and cfg.eval_every:
                heldout = self.evaluate_heldout(0)
                self.session.write_step(0, step_tables(None, heldout))
                if on_step is not None:
                    on_step(0, {"heldout_accuracy": heldout.accuracy if heldout else None})
            self._setup_s = time.perf_counter() - self._t_start
            while self.state.step < cfg.steps and not self.session.should_stop():
                self._fit_step(self.state.step + 1, on_step)
            if self.state.step < cfg.steps:  # stopped by a signal at a step boundary
                status = "interrupted"
                if not self.session.checkpoints.has_checkpoint(self.state.step):
                    self.session.drain_writes()
                    self.session.save_checkpoint(self.model, self.optimizer, self.scheduler, self.codec, self.state)
            else:
                status = "finished"
        except KeyboardInterrupt:  # second Ctrl-C: stop now; the newest checkpoint stays the resume point
            status = "interrupted"
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
            raise
        finally:
            # late signals are ignored from here on: the final status must be written, whatever arrives
            self.session.finishing = True
            try:
                fault_point("finishing", self.state.step)
                close_workers(self)
                self.session.finish(
                    status,
                    error,
                    wall_s_before=self._wall_s_before,
                    setup_s=self._setup_s_before + (self._setup_s or 0.0),
                )
            finally:
                self.session.close()  # (the lock, the signal handlers)
        return RunResult(self.run_id, self.run_dir, self.state.step, status)

    def _fit_step(self, step: int, on_step) -> None:
        """One step of fit: train, evaluate if due, queue the step's rows, checkpoint if due, report; its times go in
        its row."""
        cfg = self.cfg
        t_iteration = time.perf_counter()
        out = self.train_step(step)
        t0 = time.perf_counter()
        heldout = (
            self.evaluate_heldout(step)
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
            else None
        )
        out.metrics.update(heldout_accuracy=heldout.accuracy if heldout else None, eval_s=time.perf_counter() - t0)
        self.state.step = step  # (train_step advanced state.data_position by the prompts it consumed)
        write_s = self.session.write_step(
            step, step_tables(out, heldout, cfg.store_responses, cfg.seed, step), out.chosen_k
        )
        checkpoint_s = 0.0
        if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
            t0 = time.perf_counter()
            write_s += self.session.drain_writes()  # the rows up to here are stored (or safe under pending/)
            self.session.save_checkpoint(self.model, self.optimizer, self.scheduler, self.codec, self.state)
            checkpoint_s = time.perf_counter() - t0
        if on_step is not None:
            on_step(step, out.metrics, out.warnings)
        # (known only now that the step's rows are queued: the session writes them with the next step's)
        self.session.record_step_times(
            step, write_s=write_s, checkpoint_s=checkpoint_s, step_s=time.perf_counter() - t_iteration
        )

    def train_step(self, step: int) -> StepOutput:
        """One RL step on this process's share of the step's prompts. Updates the model, optimizer, scheduler and
        trainer state (data_position included); writes nothing (the rows, metrics and warnings come back in the
        StepOutput)."""
        cfg = self.cfg
        t_step = time.perf_counter()

        # ---- sample and score, in generation batches of prompts_per_step prompts (several: dynamic sampling)
        sampled = self._sample_and_score(step)

        # ---- the K in use: --k auto chooses it once, at the first step
        auto_k = self._choose_k(sampled.batches[0])  # the `warnings` row that says so, at that step only
        record = ESTIMATORS[cfg.estimator]
        k = record.k_in_use(self.state.k)  # None: a mean baseline reads no K
        split_k = record.split_k(k)  # the K that splits groups into hard and easy (dH's regimes)

        # ---- advantages of every group sampled (a filtered group's are stored but never trained)
        estimator = EstimatorConfig(k=k, quantile=cfg.quantile, scale=cfg.scale)
        adv = step_advantages(
            cfg.estimator,
            sampled.rewards,
            sampled.correct,
            names.reward_values(cfg.reward_values),
            estimator,
            cfg.shaping,
        )

        # ---- the update with its diagnostics, on the trained groups only
        self.engine.release_memory()  # (vLLM's sleep mode: its GPU memory goes to the update until the weight sync)
        t_update = time.perf_counter()
        update = self._update_with_diagnostics(step, sampled, adv.advantages, split_k)

        update_s = time.perf_counter() - t_update

        # ---- the weight sync: vLLM holds its own copy of the weights (the hf engine a bf16 one with
        # --rollout-dtype bfloat16; else it samples from the trained model itself and the sync is a no-op)
        sync_s = self._sync_engine_weights(sampled.n_trained)

        # ---- the step's output: its rows (every process's groups, gathered on the main one), metrics and warnings
        rows = self._step_rows(sampled, adv, update)
        metrics = {
            **step_metrics(rows.groups, rows.rollouts),
            **update.stats,
            "k": k,
            "gen_batches": len(sampled.batches),
            "rollout_s": sampled.rollout_s,
            "reward_s": sampled.reward_s,
            "update_s": update_s,
            "sync_s": sync_s,
        }
        warnings = self._step_warnings(step, auto_k, sampled, rows, metrics)
        metrics["step_s"] = time.perf_counter() - t_step
        return StepOutput(
            metrics,
            rows.groups,
            rows.rollouts,
            warnings,
            chosen_k=self.state.k if auto_k else None,
            components=rows.components,
            signal=rows.signal,
            tokens=rows.tokens,
        )

    # -------------------------------------------------------------------------------------------------------------
    # the step's parts, in the order train_step runs them

    def _sample_and_score(self, step: int) -> SampledStep:
        """The step's generation batches, sampled and scored (_sample_generation_batches), as one step's responses;
        moves the data position past the prompts they took. Says when dynamic sampling's cap left the step short of
        groups with signal, or, with --on-gen-cap stop, ends the run here, before the step trains."""
        cfg, G = self.cfg, self.cfg.group_size
        batches, trained_global, rollout_s, reward_s = self._sample_generation_batches(step)
        self.state.data_position += len(batches) * cfg.prompts_per_step
        n_trained = sum(trained_global)
        cap = generation_cap_warning(cfg, step, n_trained, len(batches))  # (or stops the run: --on-gen-cap stop)
        if cap is not None:
            self._say(f"[yellow]warning:[/] step {step}: {cap['message']}")
        samples = [s for b in batches for s in b.samples]  # (B * G): sample j of group i at i * G + j
        trained = [trained_global[b.first_group + i] for b in batches for i in range(len(b.problems))]  # (B,)
        return SampledStep(
            batches=batches,
            trained=trained,
            n_trained=n_trained,
            rewards=torch.cat([b.rewards for b in batches]),
            correct=torch.cat([b.correct for b in batches]),
            samples=samples,
            trained_samples=[s for i, keep in enumerate(trained) if keep for s in samples[i * G : (i + 1) * G]],
            engine_measured=all(s.token_logprobs is not None and s.token_entropies is not None for s in samples),
            rollout_s=rollout_s,
            reward_s=reward_s,
            cap_warning=cap,
            kept_tokens=kept_responses(
                responses_kept(cfg.store_tokens, cfg.prompts_per_step * G * cfg.max_new_tokens),
                len(batches) * cfg.prompts_per_step * G,
                cfg.seed,
                step,
            ),
            weights={name: w for b in batches for name, w in b.weights.items()},
        )

    def _sample_generation_batches(self, step: int) -> tuple[list[GenerationBatch], list[bool], float, float]:
        """Sample and score batches of prompts_per_step prompts, taken in order from the data stream at
        state.data_position: one batch, or with dynamic sampling as many as it takes to find prompts_per_step groups
        with signal over all processes, at most max_gen_batches.

        Returns this process's share of each batch; which groups train, one flag per group of every batch in
        step-wide group_idx order (the same on every process): all of them without dynamic sampling, else the first
        prompts_per_step with signal; and the seconds spent sampling and scoring."""
        cfg, acc = self.cfg, self.accelerator
        P, G = cfg.prompts_per_step, cfg.group_size
        per_process = P // acc.num_processes
        offset = acc.process_index * per_process  # this process's share of every batch: groups offset .. + per_process
        batches: list[GenerationBatch] = []
        signal: list[bool] = []  # one flag per group of every batch so far, in group_idx order
        rollout_s = reward_s = 0.0
        while True:
            index = len(batches)
            stream = prompts_at(self.task, cfg.seed, self.state.data_position + index * P, P)
            problems = [self.task.train[i] for i in stream[offset : offset + per_process]]
            prompts = [self.task.prompt(p) for p in problems]
            t0 = time.perf_counter()
            samples = self.engine.generate(
                prompts, G, cfg.temperature, cfg.max_new_tokens, step_seed(cfg.seed, step, acc.process_index, index)
            )
            rollout_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            fault_point("scoring", step)
            scored = score_batch(self.rewards, cfg, samples, problems, prompts, step)
            reward_s += time.perf_counter() - t0
            batch = GenerationBatch(
                index=index,
                first_group=index * P + offset,
                problems=problems,
                prompts=prompts,
                samples=samples,
                verified=scored.verified,
                components=scored.components,
                reward_warning=scored.warning,
                parts=scored.parts,
                weights=scored.weights,
                rewards=torch.tensor(scored.rewards, dtype=torch.float64).view(len(problems), G),
                correct=torch.tensor(scored.correct, dtype=torch.bool).view(len(problems), G),
            )
            batches.append(batch)
            if not cfg.dynamic_sampling:
                return batches, [True] * P, rollout_s, reward_s
            mine = groups_with_signal(batch.rewards, batch.correct, cfg.filter_metric)  # (per_process,)
            signal += acc.gather(mine.long().to(acc.device)).bool().tolist() if acc.num_processes > 1 else mine.tolist()
            if sum(signal) >= P or (cfg.max_gen_batches and len(batches) >= cfg.max_gen_batches):
                break
        trained, count = [], 0
        for has_signal in signal:
            trained.append(has_signal and count < P)
            count += has_signal
        return batches, trained, rollout_s, reward_s

    def _choose_k(self, first_batch: GenerationBatch) -> dict | None:
        """--k auto: K from the success rate of the first step's first generation batch over every process
        (names.AUTO_K_RULE), kept in the trainer state for the rest of the run; returns the `warnings` row that says
        so. None once K is known, and for a mean baseline (it reads no K)."""
        if self.state.k is not None or not ESTIMATORS[self.cfg.estimator].reads_k:
            return None
        acc = self.accelerator
        success = acc.reduce(first_batch.correct.float().mean().to(acc.device), reduction="mean").item()
        self.state.k = names.auto_k(success)
        return {"kind": "auto_k", "message": f"--k auto: first-step success rate {success:.3f} -> K = {self.state.k}"}

    def _update_with_diagnostics(
        self, step: int, sampled: SampledStep, advantages: torch.Tensor, split_k: float
    ) -> StepUpdate:
        """The policy update on the trained groups (a filtered group enters neither the loss nor its normalizer) and
        the LR schedule's step, with what the step's row reports of them: the update's stats and LR, the entropy
        attribution (--log-entropy-attribution: trial updates from the weights before it), dH (--log-entropy-delta:
        after it) and, where the engine did not measure them, each trained response's mean token entropy and summed
        log-prob from the update's no-grad pass. `advantages` (B, G) of every group sampled; `split_k`: the K that
        splits dH's groups into hard and easy."""
        cfg, acc = self.cfg, self.accelerator
        lr = self.scheduler.get_last_lr()[0]  # (the row's: the LR this update steps with)
        if not sampled.n_trained:  # dynamic sampling found no group with signal on any process: nothing to learn from
            return self._no_update(lr)  # (and the schedule counts updates: the warmup stays where it is)
        G, n_local = cfg.group_size, len(sampled.trained_samples)
        trained = torch.tensor(sampled.trained, dtype=torch.bool)  # (B,)
        correct = sampled.correct[trained]  # (B_trained, G) bool
        batch, trained_adv = self._trained_batch(sampled, advantages[trained])
        options = self.update_options()
        seed = step_seed(cfg.seed, step, 0) + 1  # (the mini-batches: the attribution draws the same)
        control = self.entropy_control()
        attribution = (
            entropy_attribution(
                self.model,
                self.optimizer,
                batch,
                trained_adv,
                correct,
                split_k,
                G,
                options,
                acc,
                seed=seed,
                n_local=n_local,
                entropy_control=control,
            )
            if cfg.log_entropy_attribution
            else dict.fromkeys(ATTRIBUTION_METRICS)
        )
        updated = policy_update(
            self.model,
            self.optimizer,
            batch,
            trained_adv,
            options,
            acc,
            seed=seed,
            ref_model=self.ref_model,
            n_local=n_local,
            entropy_control=control,
            full_pass=not sampled.engine_measured or cfg.log_entropy_delta,
        )
        self.state.entropy_coef, self.state.entropy_measured = control.coef, control.measured
        dH = (
            entropy_change(self.model, batch, updated.entropy, correct, split_k, G, options, acc, n_local)
            if cfg.log_entropy_delta
            else dict.fromkeys(ENTROPY_CHANGE_METRICS)
        )
        self.scheduler.step()  # once per RL step, on every process (the scheduler is not prepared: see _load_models)
        response_stats = None if sampled.engine_measured else sampling_policy_stats(batch, updated, n_local)
        mismatch = dict.fromkeys(MISMATCH_METRICS)  # (NULL: an engine that returns no log-probs)
        capped = capped_tokens(batch, updated, trained_adv, n_local, cfg.rollout_correction_cap, acc)
        return StepUpdate(
            {**mismatch, **updated.stats, **capped, **attribution, **dH, "lr": lr},
            response_stats,
            self._trained_tokens(sampled, batch, updated),
        )

    @staticmethod
    def _no_update(lr: float) -> StepUpdate:
        """The row of a step that trained nothing: no update's numbers, the LR it would have used."""
        return StepUpdate(
            {**NO_UPDATE, **dict.fromkeys((*ENTROPY_CHANGE_METRICS, *ATTRIBUTION_METRICS, *CAPPED_METRICS)), "lr": lr}
        )

    def _trained_batch(self, sampled: SampledStep, trained_advantages: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """This process's trained responses packed on its device, and their advantages (N,). A process whose groups
        were all filtered packs one placeholder sequence with advantage 0: it still takes part in the collective
        forward/backward passes, weighted 0 (see update.accumulate_gradients), and contributes nothing."""
        acc = self.accelerator
        batch = pack(
            sampled.trained_samples or sampled.samples[:1], self.codec.pad_id, acc.device, float_dtype(self.model)
        )
        trained_adv = trained_advantages.reshape(-1).to(acc.device)  # (N,) the trained responses
        if not sampled.trained_samples:
            trained_adv = trained_adv.new_zeros(1)  # (the placeholder's)
        return batch, trained_adv

    def _trained_tokens(self, sampled: SampledStep, batch: dict, updated):
        """The trainer's per-token numbers of the trained responses whose tokens the step keeps (token_values)."""
        ids = token_values.trained_response_ids(sampled.batches, sampled.trained, self.cfg.group_size)
        kept_rows = [row for row, i in enumerate(ids) if sampled.kept_tokens is None or i in sampled.kept_tokens]
        return trainer_tokens(batch, updated, len(sampled.trained_samples), kept_rows)

    def _sync_engine_weights(self, n_trained: int) -> float:
        """Give the engine the updated weights if the step trained any group; the seconds it took."""
        t_sync = time.perf_counter()
        if n_trained:
            self.engine.sync_weights(self.accelerator.unwrap_model(self.model))
        return time.perf_counter() - t_sync

    def _step_rows(self, sampled: SampledStep, adv, update: StepUpdate) -> StepRows:
        """The step's `groups`, `rollouts`, `reward_components`, `component_signal` and `token_values` rows: every
        process's groups, gathered on the main process, in group_idx order."""
        sources = TokenSources(update.tokens, sampled.kept_tokens, partial(token_texts, self.codec))
        results = group_results(
            sampled.batches,
            sampled.trained,
            adv,
            sampled.rewards,
            sampled.correct,
            self.cfg.group_size,
            sampled.engine_measured,
            update.response_stats,
            sources,
        )
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            results = gather_object(results)
        results.sort(key=lambda g: g.group_idx)
        return step_rows(results, sampled.weights)

    def _step_warnings(self, step: int, auto_k, sampled: SampledStep, rows: StepRows, metrics: dict) -> list:
        """The step's `warnings` rows: the K --k auto chose, dynamic sampling's cap, the rewards', and the alerts
        the step's numbers raise (core.alert_levels)."""
        facts = StepFacts(step, metrics, rows.signal, primary_component(self.cfg.primary_reward, rows.signal))
        alerts = watch(self.state, facts, self.alerts, self.cfg)
        return [
            row
            for row in (auto_k, sampled.cap_warning, *(b.reward_warning for b in sampled.batches), *alerts)
            if row is not None
        ]

    # -------------------------------------------------------------------------------------------------------------
    # the update's options

    def entropy_control(self) -> EntropyCoefficient:
        """The entropy bonus's coefficient where the run left it (--entropy-target adapts it; the checkpoint keeps
        it), else --entropy-coef."""
        coef = self.state.entropy_coef
        return EntropyCoefficient(self.cfg.entropy_coef if coef is None else coef, self.state.entropy_measured)

    def update_options(self) -> UpdateOptions:
        """The config's options and the trainer's attributes that a test or benchmark may switch: skip_gated (the
        dense reference), lockstep (on one machine), logits_keyword (full forward), logprob_chunk_tokens."""
        return UpdateOptions.from_config(
            self.cfg,
            skip_gated=self.skip_gated,
            lockstep=self.lockstep,
            logits_keyword=self.logits_keyword,
            logprob_chunk_tokens=self.logprob_chunk_tokens,
            share_prompts=self.share_prompts and not self.lockstep,
        )

    # -------------------------------------------------------------------------------------------------------------
    # evaluation

    def _evaluated_problems(self) -> list:
        """What --eval-every evaluates: the held-out split or --eval-bench, cut to --eval-limit."""
        limit = self.cfg.eval_limit
        return self.eval_problems[:limit] if limit else self.eval_problems

    def evaluate_heldout(self, step: int) -> HeldoutEval | None:
        """Sampled accuracy on the held-out split (or --eval-bench), with every metric and sample (not written)."""
        cfg, acc = self.cfg, self.accelerator
        name, task = self.eval_name, self.eval_task
        problems = self._evaluated_problems()
        if not problems:
            return None
        share = problems[acc.process_index :: acc.num_processes]
        result = evaluate(
            self.engine,
            name,
            share,
            [task.prompt(p) for p in share],
            self.eval_rewards,
            cfg.eval_k,
            cfg.temperature,
            cfg.max_new_tokens,
            seed=step_seed(cfg.seed, step, acc.process_index) + 7,
        )
        samples, metrics = result.samples, result.metrics
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            samples = gather_object(samples)
            metrics = summarize(name, problems, samples, cfg.eval_k)
        accuracy = next(m["value"] for m in metrics if m["metric"] == "avg@k" and m["subset"] == "all")
        sampled = {"temperature": cfg.temperature, "top_p": 1.0, "samples": cfg.eval_k, "problem_limit": cfg.eval_limit}
        return HeldoutEval(
            accuracy,
            [{**m, "source": "train", **sampled} for m in metrics],
            [{**s, "benchmark": name, "source": "train"} for s in samples],
        )

    # -------------------------------------------------------------------------------------------------------------
    # teardown

    def close(self) -> None:
        """Stop the verifier workers and the engine, let go of the run folder (RunSession.close). Safe to repeat."""
        close_workers(self)
        self.session.close()

    def release_models(self) -> None:
        """Let go of the networks, their optimizer and the engine, here and in the accelerator, and collect them now.
        FSDP2's modules hold their process group: a run's networks kept to the interpreter's exit had gloo's threads
        destroyed with the interpreter, and a finished rank could abort (SIGABRT) after its run was stored. For the
        end of a run, after fit(); the process group is torn down after this."""
        import gc

        close_workers(self)  # (fit closed them: a no-op then)
        self.accelerator.free_memory()  # its references: the prepared models, optimizers, schedulers
        self.model = self.ref_model = self.optimizer = self.scheduler = self.engine = None
        gc.collect()  # (modules with hooks are cycles: freed by a collection, not by their last reference)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _say(self, message: str) -> None:
        if self.console is not None and self.is_main:
            self.console.print(message)
