"""A run's checkpoints (runs/<run_id>/checkpoints/step-N), as verl keeps them in utils/checkpoint/: saved whole or
not at all, and on a resume the newest one whose files check out, loaded and checked against the run.

    checkpoints = RunCheckpoints(run_dir, run_id, cfg, accelerator, say)
    state = checkpoints.restore(data_fingerprint, model, optimizer, scheduler)  # None: none yet, train from step 0
    checkpoints.save(model, optimizer, scheduler, codec, state)                # checkpoints/step-N, renamed in place

Every process takes part (a checkpoint holds each process's random states, and sharded weights are gathered); the
main process does the file operations and decides which checkpoint is loaded. The session (session.py) makes a step's
rows durable before a checkpoint is saved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NoReturn

from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError, SaidByTheMainProcess
from qae_app.core.faults import fault_point
from qae_app.models.lora import is_lora, load_lora_adapter, save_lora_artifacts
from qae_app.models.sharding import full_state_dict, is_sharded
from qae_app.store.reader import last_logged_step
from qae_app.store.run_file import migrate_hint
from qae_app.store.run_folder import (
    CHECKPOINTS_DIR,
    TRAINER_STATE,
    checkpoint_problem,
    checkpoint_step,
    list_checkpoints,
    read_run_file,
    remove_entry,
    write_manifest,
)
from qae_app.train.checkpoint_state import (
    is_data_checkpoint,
    load_training_state,
    pickled_files,
    save_training_state,
    training_state_problem,
)
from qae_app.train.trainer_state import TrainerState, data_position_problem


def format_problem(ckpt: Path) -> str | None:
    """What a checkpoint lacks of the current format, or None: its training state as safetensors and JSON
    (checkpoint_state), and a trainer_state.json that says how many processes trained it. (A damaged one is for the
    checks of `_newest_valid_checkpoint` to say.)"""
    if not is_data_checkpoint(ckpt):
        pickled = ", ".join(p.name for p in pickled_files(ckpt)[:4])
        return f"its training state is Python pickles ({pickled or 'no state files of this version'})"
    try:
        stored = json.loads(read_run_file(Path(ckpt) / TRAINER_STATE))
    except (OSError, ValueError, RecursionError, QAEUserError):
        return None
    if isinstance(stored, dict) and stored.get("num_processes") is None:
        return f"its {TRAINER_STATE} does not say how many processes trained the run"
    return None


class RunCheckpoints:
    """The checkpoints of one run, for one session of it: `say` prints a line (the trainer's console)."""

    def __init__(self, run_dir: Path, run_id: str, cfg: TrainConfig, accelerator, say=None):
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.cfg = cfg
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self._say = say or (lambda message: None)

    def restore(self, data_fingerprint: str | None, model, optimizer, scheduler) -> TrainerState | None:
        """Load the newest checkpoint whose files match their checksums into the accelerator's prepared objects and
        return its trainer state, checked against this run (process count, data position, --steps, the data file's
        sha256); None when the run has no checkpoint (killed before its first: it trains again from step 0). Says so
        when a newer checkpoint was skipped."""
        acc = self.accelerator
        ckpt, logged = self._newest_valid_checkpoint()
        if ckpt is None:
            self._check_start_over(logged)
            return None
        state = TrainerState.load(ckpt / TRAINER_STATE)
        self._check_process_count(state, ckpt)
        self._load_training_state(ckpt, model, optimizer, scheduler)
        if is_lora(acc.unwrap_model(model)):  # (a LoRA run's adapter, from its own folder)
            load_lora_adapter(ckpt, acc.unwrap_model(model))
        self._say(f"resuming run {self.run_id} from checkpoint {ckpt.name}")
        self._check_checkpoint_fits_run(state, ckpt, logged, data_fingerprint)
        return state

    def _newest_valid_checkpoint(self) -> tuple[Path | None, int]:
        """The newest checkpoint whose files match their checksums (None if none does; each one skipped is said),
        and the newest step whose rows the run kept (stored or saved): decided by the main process, the same on
        every process."""
        from accelerate.utils import broadcast_object_list

        chosen = [None, 0, None]  # the checkpoint, the newest step whose rows the run kept, a refusal
        if self.is_main:
            checkpoints = list_checkpoints(self.run_dir)
            old = [(ckpt, problem) for ckpt in checkpoints if (problem := format_problem(ckpt))]
            if old:
                chosen[2] = (
                    f"resume: checkpoint {old[0][0].name} of run '{self.run_id}' was written by an older "
                    f"qae: {old[0][1]}. {migrate_hint(self.run_dir)}"
                )
            else:
                chosen[0] = self._newest_that_checks_out(checkpoints)
                if chosen[0] is None and checkpoints:
                    chosen[2] = (
                        f"resume: no checkpoint of run '{self.run_id}' checks out (see the warnings "
                        "above). Start a new run."
                    )
            chosen[1] = last_logged_step(self.run_dir)
        if self.accelerator.num_processes > 1:
            broadcast_object_list(chosen)
        if chosen[2] is not None:
            self._refuse(chosen[2])
        return (Path(chosen[0]) if chosen[0] is not None else None), chosen[1]

    def _newest_that_checks_out(self, checkpoints: list[Path]) -> str | None:
        """The newest of `checkpoints` whose files are as saved (checksums) and each as what it should hold (a
        manifest rewritten to match a damaged or planted file passes the first), every process's, before any
        process loads one; each one skipped is said."""
        for ckpt in reversed(checkpoints):
            problem = (
                checkpoint_problem(ckpt) or TrainerState.problem(ckpt / TRAINER_STATE) or training_state_problem(ckpt)
            )
            if problem is None:
                return str(ckpt)
            self._say(f"[yellow]warning:[/] skipping checkpoint {ckpt.name}: {problem}")
        return None

    def _check_start_over(self, logged: int) -> None:
        """A run with no checkpoint starts over from step 0, same run, same seed (the same steps again): refused
        when --steps would drop steps it logged; said when it replaces logged steps. (A run whose checkpoints all
        failed their checks was refused by `_newest_valid_checkpoint`.)"""
        cfg = self.cfg
        if cfg.steps < logged:
            self._refuse(
                f"steps: {cfg.steps} is below the {logged} steps run '{self.run_id}' has logged. It has no "
                f"checkpoint (killed before its first; --checkpoint-every {cfg.checkpoint_every}), so a resume "
                f"trains it again from step 0 and replaces their rows: pass --steps {logged} or more to keep "
                "every logged step, or start a new run."
            )
        if logged:
            self._say(
                f"[yellow]warning:[/] run {self.run_id} has no checkpoint: training it again from step 0 "
                f"(same seed); the {logged} steps it logged are replaced as they are trained again."
            )

    def _check_process_count(self, state: TrainerState, ckpt: Path) -> None:
        """Every process samples with its own seed: another process count trains other steps than the logged ones."""
        trained_by = state.num_processes
        if trained_by != self.accelerator.num_processes:
            self._refuse(
                f"resume: run '{self.run_id}' was trained by {trained_by} processes and this resume has "
                f"{self.accelerator.num_processes}. Each process samples with its own seed, so the steps after "
                f"checkpoint {ckpt.name} would not be the ones logged: resume it as it was launched (accelerate "
                f"launch --num_processes {trained_by} ...), or start a new run."
            )

    def _check_checkpoint_fits_run(
        self, state: TrainerState, ckpt: Path, logged: int, data_fingerprint: str | None
    ) -> None:
        """The checkpoint's trainer state against this run: its data position (the config's prompts per step),
        --steps (neither below the steps done nor below those logged) and the data file's sha256."""
        cfg = self.cfg
        problem = data_position_problem(state.data_position, state.step, cfg)
        if problem:
            self._refuse(
                f"resume: checkpoint {ckpt} is at prompt {state.data_position} of the data, but "
                f"{problem}. The checkpoint does not belong to this run's config; start a new run."
            )
        if cfg.steps < state.step:
            self._refuse(
                f"steps: {cfg.steps} is below the {state.step} steps run '{self.run_id}' has "
                "already done. Pass --steps above that to train further."
            )
        if cfg.steps < logged:
            self._refuse(
                f"steps: {cfg.steps} is below the {logged} steps run '{self.run_id}' has logged (its "
                f"newest checkpoint is at step {state.step}; the steps after it are trained "
                f"again and replace their rows). Pass --steps {logged} or more to keep every logged "
                "step."
            )
        if state.data_fingerprint != data_fingerprint:
            self._refuse(
                f"data: {cfg.data} changed since run '{self.run_id}' was started (its sha256 differs "
                "from the one the checkpoint recorded). A resumed run must see the same prompts: "
                "restore the file, or start a new run on the new data."
            )

    def save(self, model, optimizer, scheduler, codec, state: TrainerState) -> Path:
        """checkpoints/step-N: the training state (weights, optimizer, scheduler, each process's random states) as
        safetensors and JSON (checkpoint_state), an HF model folder for `qae eval`, the trainer state, and a manifest
        of checksums. Written to a temporary folder and renamed once every process has written its part, so a kill
        never leaves half of one."""
        acc = self.accelerator
        acc.wait_for_everyone()
        final = self.run_dir / CHECKPOINTS_DIR / f"step-{state.step}"
        tmp = final.with_name(final.name + ".tmp")
        if self.is_main:
            remove_entry(tmp)
        acc.wait_for_everyone()
        if self.is_main:
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        unwrapped = acc.unwrap_model(model)
        save_training_state(tmp, unwrapped, optimizer, scheduler, acc.process_index, self.is_main)
        # sharded weights (FSDP2): model/ needs them whole, gathered once here (every process takes part)
        full = full_state_dict(unwrapped) if is_sharded(unwrapped) else None
        acc.wait_for_everyone()  # every process's random states (and shards) are in tmp before it is renamed
        if self.is_main:
            if is_lora(unwrapped):  # model/: the merged weights, as a full model folder; adapter/: the adapter
                save_lora_artifacts(tmp, unwrapped)
            else:
                unwrapped.save_pretrained(tmp / "model", state_dict=full, safe_serialization=True)
            codec.save(tmp / "model")
            state.save(tmp / TRAINER_STATE)
            write_manifest(tmp)
            fault_point("checkpoint_rename", state.step)
            remove_entry(final)  # (a link planted there is removed, never followed)
            os.replace(tmp, final)
            for old in list_checkpoints(self.run_dir)[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def _load_training_state(self, ckpt: Path, model, optimizer, scheduler) -> None:
        """`_load_training_state_here` on every process; under a launch, a refusal any process meets (its own shard
        not this model's) is said once, by the main process, and every process ends with it."""
        acc = self.accelerator
        if acc.num_processes == 1:
            self._load_training_state_here(ckpt, model, optimizer, scheduler)
            return
        from accelerate.utils import gather_object

        refusal = None
        try:
            self._load_training_state_here(ckpt, model, optimizer, scheduler)
        except QAEUserError as err:
            refusal = str(err)
        refusals = [r for r in gather_object([refusal]) if r]
        if refusals:
            self._refuse(refusals[0])

    def _refuse(self, message: str) -> NoReturn:
        """End every process of the launch with a refusal they all reached: the main process says it, the others
        exit without a word (a user reads it once; a process left running would wait in a collective and die with a
        gloo traceback when the main one exits)."""
        raise QAEUserError(message) if self.is_main else SaidByTheMainProcess(message)

    def _load_training_state_here(self, ckpt: Path, model, optimizer, scheduler) -> None:
        """A checkpoint's training state into the prepared model, optimizer and scheduler."""
        acc = self.accelerator
        load_training_state(ckpt, acc.unwrap_model(model), optimizer, scheduler, acc.process_index)

    def has_checkpoint(self, step: int) -> bool:
        """The newest checkpoint is at `step`."""
        newest = list_checkpoints(self.run_dir)
        return bool(newest) and checkpoint_step(newest[-1]) == step
