"""How a reward is named: `--reward NAME`, `--reward PATH.py:FUNCTION` or `--reward package.module:function`.

Parsing a spec reads no file and imports nothing: the config checks specs with it (`qae --help`, `qae show` and a
stored config.json never run reward code), and only `qae train`, `qae eval` and `qae sweep`, given a reward by the
user, hand the specs to a `RewardSet` (registry.py), whose worker processes import the code (user_functions.py).

| spec                        | kind      | what runs                                                           |
|-----------------------------|-----------|---------------------------------------------------------------------|
| `math`                      | `builtin` | a built-in reward (names.REWARDS), as a task's default runs it      |
| `rewards/fmt.py:score`      | `file`    | the function `score` of that Python file (relative to the cwd)      |
| `mypkg.rewards:score`       | `module`  | the function `score` of an installed module                         |

The part after the last `:` is the function, so a Windows path (`C:\\r.py:score`) parses too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.core.names import REWARDS

SPEC_FORMS = "a built-in reward (" + ", ".join(REWARDS) + "), PATH.py:FUNCTION or package.module:function"


@dataclass(frozen=True)
class RewardSpec:
    text: str  # as the user wrote it: what the run's config stores
    kind: str  # "builtin", "file" or "module"
    target: str  # the built-in's name, the file's path as written, or the module's dotted name
    function: str | None = None  # the function's name (None for a built-in)

    @property
    def name(self) -> str:
        """The component's name in the store and the views: the built-in's name or the function's."""
        return self.target if self.kind == "builtin" else str(self.function)

    @property
    def is_user_code(self) -> bool:
        return self.kind != "builtin"

    def resolved(self) -> tuple[str, str, str]:
        """(kind, target, function) as a worker imports it: a file's path made absolute against the cwd and checked
        to be a file. QAEUserError when it is not."""
        if self.kind == "file":
            path = Path(self.target).expanduser()
            if not path.is_file():
                why = "is a folder" if path.is_dir() else "does not exist"
                raise QAEUserError(
                    f"reward: {self.text}: {path} {why}. Pass PATH.py:FUNCTION with the path of a "
                    "Python file (relative to the folder you run qae from)."
                )
            return self.kind, str(path.resolve()), str(self.function)
        return self.kind, self.target, str(self.function)


def parse_reward_spec(text: str, option: str = "reward") -> RewardSpec:
    """The spec of one --reward value; QAEUserError naming the value and the forms it may take."""
    text = str(text).strip()
    if ":" not in text:
        if text in REWARDS:
            return RewardSpec(text, "builtin", text)
        raise QAEUserError(f"{option}: '{clipped(text)}' is not a built-in reward. Pass {SPEC_FORMS}.")
    target, function = text.rsplit(":", 1)
    if not function.isidentifier():
        raise QAEUserError(
            f"{option}: '{clipped(text)}' names no function after the last ':' ('{clipped(function)}'"
            f" is not a Python name). Pass {SPEC_FORMS}."
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        return RewardSpec(text, "file", target, function)
    if target and all(part.isidentifier() for part in target.split(".")):
        return RewardSpec(text, "module", target, function)
    raise QAEUserError(
        f"{option}: '{clipped(text)}': '{clipped(target)}' is neither a .py file nor a dotted module "
        f"name. Pass {SPEC_FORMS}."
    )


def reads_gold_answer(reward: list[str] | None) -> bool:
    """Whether the rewards need each data row's gold answer: the task's own reward (no --reward) and every built-in
    do; user functions alone do not (one that asks for `answer` gets it where the rows have one, and is refused by
    name where they do not)."""
    return not reward or any(not spec.is_user_code for spec in parse_reward_specs(reward))


def parse_reward_specs(texts: list[str] | None, option: str = "reward") -> list[RewardSpec]:
    """Every --reward value's spec; the same spec twice is refused (its component would be counted twice)."""
    specs = [parse_reward_spec(text, option) for text in texts or []]
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise QAEUserError(
            f"{option}: two rewards are named {', '.join(twice)} (a built-in's name or the function's "
            "name names its component). Give each function its own name, or weight one reward with "
            "--reward-weights instead of naming it twice."
        )
    return specs


def parse_reward_weights(text: str | None, n_rewards: int) -> tuple[float, ...]:
    """The weights of `n_rewards` rewards from --reward-weights "1,0.5" (default: 1 each)."""
    if text is None:
        return (1.0,) * n_rewards
    parts = [part.strip() for part in str(text).split(",")]
    try:
        weights = tuple(float(part) for part in parts)
    except ValueError:
        raise QAEUserError(
            f"reward-weights: '{clipped(text)}' is not a comma list of numbers. Pass one number per "
            "--reward, e.g. --reward-weights 1,0.5."
        ) from None
    if not all(math.isfinite(w) for w in weights):
        raise QAEUserError(
            f"reward-weights: '{clipped(text)}' holds a value that is not a finite number. Pass finite "
            "numbers, e.g. 1,0.5."
        )
    if not math.isfinite(sum(abs(w) for w in weights)):  # (a response's weighted sum could be no number)
        raise QAEUserError(
            f"reward-weights: '{clipped(text)}' sum to more than a number holds, so a response's "
            "weighted sum of its rewards would be infinite. Pass weights such as 1,0.5."
        )
    if len(weights) != n_rewards:
        raise QAEUserError(
            f"reward-weights: {len(weights)} weight{'s' * (len(weights) != 1)} ({clipped(text)}) for "
            f"{n_rewards} reward{'s' * (n_rewards != 1)}. Pass one weight per --reward, in the same "
            "order."
        )
    return weights


def check_reward_options(reward: list[str] | None, reward_weights: str | None) -> None:
    """--reward and --reward-weights as a config checks them: the specs' syntax, one weight per reward (no file is
    read, nothing imported)."""
    if reward_weights is not None and not reward:
        raise QAEUserError(
            f"reward-weights: {clipped(str(reward_weights))} weighs the rewards of --reward, and "
            "none is given (the task's own reward needs no weight). Add --reward NAME for each weight, "
            "or drop --reward-weights."
        )
    if reward is not None and not reward:
        raise QAEUserError(
            "reward: an empty list names no reward. Name one or more, or leave it out for the task's own."
        )
    parse_reward_weights(reward_weights, len(parse_reward_specs(reward)))


def weights_text(value) -> str | None:
    """--reward-weights as the config stores it: TOML's list of numbers [1, 0.5] as the command line's "1,0.5"."""
    if isinstance(value, (list, tuple)):
        return ",".join(repr(v) if isinstance(v, float) else str(v) for v in value)
    return value


def check_named_again(
    stored: list[str] | None, given: list[str] | None, run: str, stored_weights: str | None = None
) -> None:
    """A resumed run imports reward code only when the user names it again: `stored` is what the run's config.json
    says (and `stored_weights` its --reward-weights), `given` what the user passed now (None: nothing). QAEUserError
    when the run's rewards run user code and the user did not name them."""
    code = [spec for spec in parse_reward_specs(stored) if spec.is_user_code]
    if not code or given is not None:
        return
    flags = " ".join(f"--reward {spec}" for spec in stored or [])
    if stored_weights is not None:
        flags += f" --reward-weights {weights_text(stored_weights)}"
    raise QAEUserError(
        f"resume: run '{run}' scores with reward code ({', '.join(s.text for s in code)}). A run "
        f"folder never runs code by itself: name the rewards again to resume it, e.g. `qae train "
        f"--resume {run} {flags}`."
    )
