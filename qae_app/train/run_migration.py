"""`qae migrate RUN`: a run folder written by a pre-release of qae, rewritten in the current format, so that every
reader and writer knows one format (an older folder is refused by them with a message that names this command).

What a pre-release left, and what becomes of it:
- a database without the tables and columns added since: added, earlier rows filled (store/format_migration.py);
- pending writes saved as Python pickles, and checkpoints whose training state is accelerate's pickled `save_state`
  (`custom_checkpoint_0.pkl`, `optimizer.bin`, `random_states_<i>.pkl`): rewritten as JSON and safetensors
  (checkpoint_state.py). Unpickling can run any code a file carries, so this happens only with `--trust-pickles`,
  for a folder its user made; without it a folder holding pickles is refused, nothing changed;
- a checkpoint's trainer_state.json without the process count: the count its random-state files say;
- a training run's settings that this version has no option for: dropped from config.json and the runs row.

The run must not be training (its lock is taken). Running it again on a migrated folder changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from qae_app.analysis.settings import STORED_BESIDE_OPTIONS
from qae_app.config import FIELDS, TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.store.format_migration import (
    convert_pickled_pending,
    drop_config_keys,
    migrate_database,
    pickled_pending_files,
)
from qae_app.store.run_folder import (
    CONFIG_FILE,
    DB_FILE,
    TRAINER_STATE,
    RunLock,
    list_checkpoints,
    read_run_file,
    validated_run_dir,
    write_manifest,
)
from qae_app.train.checkpoint_state import (
    PICKLED_SUFFIXES,
    RNG_FILE,
    SHARD_LAYOUT_FILE,
    is_data_checkpoint,
    pickled_files,
    save_random_states,
    save_training_state,
)
from qae_app.train.session import check_holds_a_database, stored_config

ACCELERATE_RNG = "random_states_{process}.pkl"  # a pre-release checkpoint's random states, one file per process


def migrate_run(
    runs_dir: Path, run: str, trust_pickles: bool = False, say: Callable[[str], None] = lambda line: None
) -> list[str]:
    """Bring run folder `run` to the current format; returns what changed (empty: it was current already)."""
    folder = validated_run_dir(runs_dir, run)
    check_holds_a_database(runs_dir, run, folder, "run")  # (someone's folder with a config.json is not rewritten)
    lock = RunLock(folder).acquire("run")
    try:
        _refuse_pickles_untrusted(folder, trust_pickles)
        changes = migrate_database(folder / DB_FILE) if (folder / DB_FILE).exists() else []
        changes += convert_pickled_pending(folder)
        if (folder / CONFIG_FILE).exists():  # a training run's (eval and preview folders hold other settings)
            changes += drop_config_keys(folder, set(FIELDS) | set(STORED_BESIDE_OPTIONS))
        for ckpt in list_checkpoints(folder):
            changes += [f"checkpoints/{ckpt.name}: {change}" for change in _migrate_checkpoint(ckpt, folder, say)]
        return changes
    finally:
        lock.release()


def _refuse_pickles_untrusted(folder: Path, trust_pickles: bool) -> None:
    """A folder holding a pre-release's pickles is converted only when its user vouches for it; else nothing changes
    and the message says what to do."""
    pickled = [p.relative_to(folder) for p in pickled_pending_files(folder)]
    pickled += [
        p.relative_to(folder)
        for ckpt in list_checkpoints(folder)
        if not is_data_checkpoint(ckpt)
        for p in pickled_files(ckpt)
    ]
    if pickled and not trust_pickles:
        named = ", ".join(map(str, pickled[:3])) + (", ..." if len(pickled) > 3 else "")
        raise QAEUserError(
            f"trust-pickles: run '{folder.name}' holds Python pickles an older qae wrote ({named}). Reading a pickle "
            f"can run any code it carries: if you made this run folder yourself, run `qae migrate {folder.name} "
            "--trust-pickles`; for one from someone else, delete those files instead (its checkpoints' model/ folders "
            "are safetensors: `qae eval --model` reads them). Nothing was changed."
        )


def _migrate_checkpoint(ckpt: Path, folder: Path, say) -> list[str]:
    """One checkpoint in the current format: its training state as data, its trainer state with the process count;
    its manifest written again when a file changed."""
    changes = []
    processes = _process_count(ckpt)
    if not is_data_checkpoint(ckpt):
        say(f"converting checkpoints/{ckpt.name}: loading its pickled training state (--trust-pickles)")
        _convert_pickled_state(ckpt, stored_config(folder), processes)
        changes.append(f"training state of {processes} process(es) rewritten as safetensors and JSON")
    state_path = ckpt / TRAINER_STATE
    state = json.loads(read_run_file(state_path))
    if isinstance(state, dict) and state.get("num_processes") is None:
        state["num_processes"] = processes
        state_path.write_text(json.dumps(state))
        changes.append(f"{TRAINER_STATE} says the run was trained by {processes} process(es)")
    if changes:
        write_manifest(ckpt)
    return changes


def _process_count(ckpt: Path) -> int:
    """How many processes trained up to `ckpt`: one random-state file each (a sharded checkpoint: one layout each)."""
    counts = [
        len(list(ckpt.glob(pattern.format(process="*")))) for pattern in (RNG_FILE, SHARD_LAYOUT_FILE, ACCELERATE_RNG)
    ]
    return max(counts) or 1


def _convert_pickled_state(ckpt: Path, cfg: TrainConfig, processes: int) -> None:
    """A pre-release's accelerate `save_state` (the model, the optimizer, the scheduler registered as a custom
    object, each process's random states), loaded into the run's model and optimizer as the trainer builds them and
    saved as checkpoint_state writes it; accelerate's files are removed. The user vouched for the folder."""
    import random

    import numpy as np
    import torch
    from accelerate import Accelerator

    from qae_app.models.lora import apply_lora, trainable_parameters
    from qae_app.models.policy import load_policy
    from qae_app.train.optimizer import optimizer_and_schedule

    model, _ = load_policy(str(ckpt / "model"), cfg.dtype)  # (the checkpoint's own weights: no download)
    if cfg.lora_rank:
        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, model_name=cfg.model)
    optimizer, scheduler = optimizer_and_schedule(
        trainable_parameters(model), cfg.lr, cfg.weight_decay, cfg.warmup_steps
    )
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    accelerator.load_state(str(ckpt))  # the user vouched for this folder (--trust-pickles)
    save_training_state(ckpt, accelerator.unwrap_model(model), optimizer, scheduler, 0, True)
    for process in range(processes):  # each process's random states, as that process will read them
        path = ckpt / ACCELERATE_RNG.format(process=process)
        if path.exists():
            states = torch.load(path, weights_only=False)  # the user vouched for this folder (--trust-pickles)
            random.setstate(states["random_state"])
            np.random.set_state(states["numpy_random_seed"])
            torch.set_rng_state(states["torch_manual_seed"])
            save_random_states(ckpt, process)
    for path in ckpt.iterdir():  # accelerate's files: its pickles and its copy of the prepared model's weights
        if path.is_file() and (path.suffix in PICKLED_SUFFIXES or path.name == "model.safetensors"):
            path.unlink()
