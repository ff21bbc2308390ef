"""Where a run is, as a checkpoint's trainer_state.json holds it (the model, optimizer and RNG are checkpoint_state's),
and the check that a stored data position can follow the steps taken."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qae_app.config import TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.store.run_folder import read_run_file


@dataclass
class TrainerState:
    """What a checkpoint holds besides its training state (checkpoint_state): where the run is (trainer_state.json)."""

    step: int = 0  # RL steps completed
    k: float | None = None  # K in use (set at step 1 when --k auto)
    entropy_zone: str = "ok"  # "low" / "ok" / "high" for the smoothed entropy: warn once per crossing of the band
    entropy_ema: float | None = None  # moving average of step entropy (alpha entropy_band.ENTROPY_EMA_ALPHA)
    entropy_start: float | None = None  # step 1's entropy: the default band is relative to it
    data_position: int = 0  # prompts of the data stream consumed so far (every generation batch); a resume checks it
    data_fingerprint: str | None = None  # sha256 of the data file (None for a built-in task); a resume checks it
    # processes that trained the run (each samples with its own seed); a resume checks it (set by the trainer; a
    # pre-release's checkpoint gets it from `qae migrate`)
    num_processes: int | None = None
    # the entropy bonus's coefficient as --entropy-target adapts it, and the entropy it last measured (policy_losses.
    # EntropyCoefficient); None: the config's --entropy-coef, nothing measured yet
    entropy_coef: float | None = None
    entropy_measured: float | None = None
    # what the alerts remember of the run (train/alerts.py: recent metrics, streaks, the alerts holding); None: none yet
    alerts: dict | None = None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.__dict__))

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        """The state saved at `path`; QAEUserError naming the file when it is not one (`problem` says why)."""
        problem = cls.problem(path)
        if problem is not None:
            raise QAEUserError(
                f"checkpoint {Path(path).parent}: {problem}. Resume from another checkpoint (remove "
                "this folder) or start a new run."
            )
        return cls(**json.loads(read_run_file(path)))

    @classmethod
    def problem(cls, path: Path) -> str | None:
        """Why `path` is not a trainer state qae saved (missing, not JSON, a key or a value of the wrong type), or
        None."""
        name = Path(path).name
        try:
            stored = json.loads(read_run_file(path))
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, ValueError, RecursionError, QAEUserError) as err:  # (not UTF-8 or JSON, too deep, a link)
            return f"{name} is not JSON this qae wrote ({str(err).strip()[:200]})"
        if not isinstance(stored, dict):
            return f"{name} does not hold what qae writes there (a {type(stored).__name__}, not an object)"
        for key, value in stored.items():
            if key not in _STATE_TYPES:
                return f"{name} does not hold what qae writes there (an unknown key {str(key)[:60]!r})"
            if not _STATE_TYPES[key](value):
                return f"{name} does not hold what qae writes there ({key} = {json.dumps(value)[:60]})"
        return None


def _count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _real(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


# what each key of trainer_state.json may hold (TrainerState's fields)
_STATE_TYPES = {
    "step": _count,
    "k": _real,
    "entropy_zone": lambda v: v in ("low", "ok", "high"),
    "entropy_ema": _real,
    "entropy_start": _real,
    "data_position": _count,
    "data_fingerprint": lambda v: v is None or isinstance(v, str),
    "num_processes": lambda v: v is None or _count(v, 1),
    "entropy_coef": _real,
    "entropy_measured": _real,
    "alerts": lambda v: v is None or _alerts_record(v),
}


def _numbers(value) -> bool:
    return isinstance(value, list) and all(_real(v) and v is not None for v in value)


def _alerts_record(value) -> bool:
    """What train/alerts.new_record holds, and nothing else (a planted file is refused, not half read)."""
    if not isinstance(value, dict) or set(value) != {"history", "first_lengths", "steps", "streaks", "active"}:
        return False
    history, streaks, active = value["history"], value["streaks"], value["active"]
    return (
        isinstance(history, dict)
        and all(isinstance(k, str) and _numbers(v) for k, v in history.items())
        and _numbers(value["first_lengths"])
        and _count(value["steps"])
        and isinstance(streaks, dict)
        and all(isinstance(k, str) and _count(v) for k, v in streaks.items())
        and isinstance(active, list)
        and all(isinstance(name, str) for name in active)
    )


def data_position_problem(position: int, steps: int, cfg: TrainConfig) -> str | None:
    """Why `position` prompts consumed cannot follow `steps` steps of this config (None if it can): each step takes
    one generation batch of prompts_per_step prompts, or with dynamic sampling 1 to max_gen_batches of them."""
    P = cfg.prompts_per_step
    if not cfg.dynamic_sampling:
        return None if position == steps * P else f"{steps} steps of {P} prompts end at {steps * P}"
    most = steps * P * cfg.max_gen_batches if cfg.max_gen_batches else None
    if position % P == 0 and steps * P <= position and (most is None or position <= most):
        return None
    return (
        f"{steps} steps of 1 to {cfg.max_gen_batches or 'any number of'} generation batches of {P} prompts end "
        f"at a multiple of {P} from {steps * P}" + (f" to {most}" if most is not None else " on")
    )
