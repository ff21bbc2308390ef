"""What `qae eval --model RUN` takes from the training run it evaluates, so that an evaluation of a run agrees with
the run's own held-out evaluations unless the user says otherwise:

- its defaults are the run's: temperature, max new tokens, --prompt-template and --system-prompt (options given on
  the command line win);
- without --bench it evaluates the run's own task where that is a built-in one (`arith`, `builtin:chain`, `add`: its
  held-out split); a run trained on a data file is refused without --bench or --split, never evaluated on `arith`;
- `--split heldout` evaluates the run's own held-out split: its data file split as the run split it (its
  --heldout-fraction, --heldout-by and seed), the problems its --eval-every evaluations sampled.

Rewards are never taken from a run folder when they are code (a run folder names no code to run): with --split
heldout a run that scored with `PATH.py:FUNCTION` or `package.module:function` is refused until the rewards are named
again; built-in rewards (no code of the user's) are the run's unless --reward says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from qae_app.config import EvalConfig, TrainConfig, build_eval_config
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.data.tasks import builtin_task_name
from qae_app.rewards.specs import parse_reward_specs, weights_text
from qae_app.store.reader import results_only_kind
from qae_app.store.run_folder import CONFIG_FILE, RUN_NAME_PATTERN

SPLITS = ("heldout",)  # --split: the run's own held-out split
TAKEN_FROM_RUN = ("temperature", "max_new_tokens", "prompt_template", "system_prompt")  # its defaults, unless given


def trained_config(runs_dir, model: str | None) -> TrainConfig | None:
    """The stored config of the training run that `model` names in `runs_dir`, or None when it names none (a model
    folder, a Hub id, an evaluation's or a preview's folder: `resolve_model` says what is wrong with those)."""
    if model is None or not RUN_NAME_PATTERN.match(model):
        return None
    folder = Path(runs_dir) / model
    if not (folder / CONFIG_FILE).is_file() or results_only_kind(folder):
        return None
    from qae_app.train.session import stored_config

    return stored_config(folder)


def eval_config_for(runs_dir, **options) -> tuple[EvalConfig, TrainConfig | None, tuple[str, ...]]:
    """`qae eval`'s config from its options (None: not given), with the defaults of the run `--model` names (module
    docstring); that run's stored config (None: the model is no training run); and the options taken from it."""
    given = {name: value for name, value in options.items() if value is not None}
    trained = trained_config(runs_dir, given.get("model"))
    split = given.get("split")
    if split is not None:
        _check_split(split, given, trained)
    if trained is None:
        return build_eval_config(**given), None, ()
    run = given["model"]
    taken = tuple(name for name in TAKEN_FROM_RUN if name not in given and getattr(trained, name) is not None)
    given.update({name: getattr(trained, name) for name in taken})
    if split is not None:
        given["bench"] = trained.data
        given.update(_split_rewards(run, trained, given))
    elif "bench" not in given:
        if builtin_task_name(trained.data) is None:
            raise QAEUserError(
                f"bench: run '{run}' trained on the data file {trained.data}, so its evaluation is yours to "
                f"name: --split heldout (the run's own held-out split"
                + (")" if trained.heldout_fraction else ", which this run does not have: it held nothing out)")
                + f", or --bench FILE (a whole file; --bench {trained.data} is the data it trained on)."
            )
        given["bench"] = trained.data
    return build_eval_config(**given), trained, taken


def _check_split(split: str, given: dict, trained: TrainConfig | None) -> None:
    if split not in SPLITS:
        raise QAEUserError(
            f"split: unknown value '{clipped(split)}'. Choose one of: {', '.join(SPLITS)} (the run's "
            "own held-out split)."
        )
    if trained is None:
        raise QAEUserError(
            f"split: --split {split} evaluates a training run's own held-out split, and --model "
            f"'{clipped(str(given.get('model')))}' is no training run here (see `qae runs`). Pass "
            "--model RUN, or --bench FILE for a model that is not a run."
        )
    if "bench" in given:
        raise QAEUserError(
            f"split: --split {split} and --bench {clipped(str(given['bench']))} name two things to "
            "evaluate. Pass one of them."
        )
    if builtin_task_name(trained.data) is None and not trained.heldout_fraction:
        raise QAEUserError(
            f"split: run '{given['model']}' held nothing out of {trained.data} "
            "(--heldout-fraction 0). Evaluate it on another file with --bench FILE."
        )


def _split_rewards(run: str, trained: TrainConfig, given: dict) -> dict:
    """The rewards of an evaluation of the run's held-out split: the user's, else the run's own where they are
    built-in; a run whose rewards are code is refused until they are named again."""
    if "reward" in given or not trained.reward:
        return {}
    code = [spec.text for spec in parse_reward_specs(trained.reward) if spec.is_user_code]
    if code:
        flags = " ".join(f"--reward {spec}" for spec in trained.reward)
        if trained.reward_weights is not None:
            flags += f" --reward-weights {weights_text(trained.reward_weights)}"
        raise QAEUserError(
            f"reward: run '{run}' scored with reward code ({', '.join(code)}), which a run folder never "
            f"runs by itself. Name the rewards again to evaluate its held-out split as it trained: "
            f"qae eval --model {run} --split heldout {flags}"
        )
    return {"reward": list(trained.reward), "reward_weights": trained.reward_weights}
