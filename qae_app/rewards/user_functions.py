"""A user's reward functions inside the verifier's worker processes: imported there, called there, checked there.

The trainer's own process never imports a user's reward: `RewardSet` (registry.py) starts a `MathVerifierPool` whose
workers run `load_user_rewards` when they start (importing each function named by a `--reward PATH.py:FUNCTION` or
`package.module:function`) and `handle_item` for each item, under the pool's hard deadline per item. Everything a
worker sends back is plain data (floats, None, text), so no object of the user's can reach the trainer either.

A function is called as TRL's GRPOTrainer calls it, one response at a time:

    fn(prompts=[prompt], completions=[completion], completion_ids=[ids], **columns)  ->  [score]  or  {"part": [score]}

What `prompt` and `completion` are depends on the data, as in TRL (registry.reward_inputs): for conversational data
(the row's `prompt` is a list of chat messages, sent as it is) the prompt is that list of messages (after the
--system-prompt message, if given) and the completion a list of one message, `[{"role": "assistant", "content":
text}]`; for plain-text data both are strings, the prompt as the model read it without a chat template (prompts.
prompt_text). `completion_ids` are the response's token ids. `columns` are the data row's fields (each a one-element
list, as TRL passes dataset columns), `answer` (the gold answer qae read) and `step` (the RL step; 0 in `qae eval`); a
function without `**kwargs` gets only the names it declares. A score is a finite number (bool counts as 0/1) or None
("could not verify"); a dict gives named parts, each such a list. Anything else (a raise, a list of another length,
NaN, a string) comes back as an error whose text the trainer shows once.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

# what every reward can ask for besides the data row's fields
PASSED_ALWAYS = ("completions", "prompts", "completion_ids", "answer", "step")

_loaded: list[Callable | str] = []  # per reward index: the function, or why it could not be imported (text)
_paths: list[str | None] = []  # per reward index: the file it came from (its sha256 is the run's record)


def load_user_rewards(specs: list[tuple[str, str, str]]) -> None:
    """At a worker's start: import each (kind, target, function); a failure is kept as its text and answered to every
    item of that reward."""
    _loaded.clear()
    _paths.clear()
    for kind, target, function in specs:
        try:
            module = _import(kind, target)
            fn = getattr(module, function, None)
            if fn is None or not callable(fn):
                have = sorted(
                    name
                    for name, value in vars(module).items()
                    if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
                )
                raise LookupError(f"{target} has no function '{function}' (its functions: {', '.join(have) or 'none'})")
            _loaded.append(fn)
            _paths.append(getattr(module, "__file__", None))
        except LookupError as err:
            _loaded.append(str(err).strip("'\""))
            _paths.append(None)
        except ModuleNotFoundError as err:
            hint = "\n(a module must be importable here, e.g. installed; for a file of yours pass PATH.py:FUNCTION)"
            _loaded.append("importing it raised:\n" + _user_traceback(err) + (hint if kind == "module" else ""))
            _paths.append(None)
        except BaseException as err:  # noqa: BLE001 - a SyntaxError, an ImportError, a SystemExit of the user's module
            _loaded.append("importing it raised:\n" + _user_traceback(err))
            _paths.append(None)


def _import(kind: str, target: str):
    if kind == "module":
        return importlib.import_module(target)
    folder = str(Path(target).parent)
    if folder not in sys.path:  # its own helper modules beside it import as they would under `python file.py`
        sys.path.insert(0, folder)
    name = "qae_user_reward_" + hashlib.sha256(target.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _user_traceback(err: BaseException) -> str:
    """The traceback from the user's code on (this module's frames left out)."""
    tb = err.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, importlib.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen importlib")
    ):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(err), err, tb)).rstrip()


class BadReturn(Exception):
    """A reward function returned something that is not one score per completion."""


def handle_item(kind: str, index: int, *args) -> tuple[str, object]:
    """One pool item: ("probe", index) -> what the function asks for; ("score", index, completion, prompt,
    completion_ids, columns, step) -> its scores. Returns ("ok", value) or ("error", text); never raises."""
    fn = _loaded[index]
    if isinstance(fn, str):
        return "error", fn
    if kind == "probe":
        return "ok", _signature(fn, _paths[index])
    completion, prompt, completion_ids, columns, step = args
    try:
        value = _call(fn, completion, prompt, completion_ids, columns, step)
    except BaseException as err:  # noqa: BLE001 - whatever the user's code raises is reported, with its traceback
        return "error", "raised:\n" + _user_traceback(err)
    try:
        return "ok", _checked(value)
    except BadReturn as err:
        return "error", str(err)


def _signature(fn: Callable, path: str | None) -> dict:
    """The names `fn` requires (no default), whether it takes **kwargs, and its file's sha256."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: assume TRL's (completions, **kwargs)
        parameters = []
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest() if path and Path(path).is_file() else None
    return {
        "required": required,
        "var_keyword": any(p.kind == p.VAR_KEYWORD for p in parameters),
        "path": path,
        "sha256": sha,
    }


def _call(fn: Callable, completion, prompt, completion_ids: list[int], columns: dict, step: int):
    offered = {
        **{name: [value] for name, value in columns.items()},
        "completions": [completion],
        "prompts": [prompt],
        "completion_ids": [completion_ids],
        "step": step,
    }
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    if not parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return fn(**offered)
    kwargs = {name: value for name, value in offered.items() if name in parameters}
    if "completions" not in parameters:  # a function that names its first argument otherwise: TRL passes it first
        return fn([completion], **kwargs)
    return fn(**kwargs)


def _checked(value) -> dict[str, float | None]:
    """{part: score} from a function's return value for one completion ("" names an undivided reward)."""
    if isinstance(value, dict):
        if not value:
            raise BadReturn("returned an empty dict: return a list of scores, or a dict of named lists of scores")
        return {str(name): _one(part, f" (its part '{name}')") for name, part in value.items()}
    return {"": _one(value)}


def _one(values, where: str = "") -> float | None:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise BadReturn(
            f"returned {_shown(values)} (a {type(values).__name__}){where} where a list of scores goes, "
            "one per completion: return e.g. [1.0] for one completion"
        )
    values = list(values)
    if len(values) != 1:
        raise BadReturn(
            f"returned {len(values)} scores for 1 completion{where}: {_shown(values)}. Return one score "
            "per completion, a list as long as `completions`"
        )
    score = values[0]
    if score is None:
        return None
    if not isinstance(score, numbers.Real):
        raise BadReturn(
            f"returned {_shown(score)} (a {type(score).__name__}) as a score{where}: a score is a number "
            "(float, int or bool), or None when the response cannot be verified"
        )
    score = float(score)
    if not math.isfinite(score):
        raise BadReturn(
            f"returned {score} as a score{where}: a score must be a finite number, or None when the "
            "response cannot be verified"
        )
    return score


def _shown(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
