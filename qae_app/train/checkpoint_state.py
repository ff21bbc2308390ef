"""A checkpoint's training state as data: weights and optimizer tensors in safetensors, everything else in JSON.

accelerate's `save_state` pickles the learning-rate scheduler (a registered custom object, `custom_checkpoint_0.pkl`,
which it loads with `weights_only=False`) and writes the optimizer and the random states with `torch.save`. A run
folder someone sent you would then run code on `qae train --resume`. Nothing here unpickles: a file that does not
parse as safetensors or JSON is refused with its name.

Files, in `checkpoints/step-N/`:
    policy.safetensors      the policy's parameters (tied ones once), written by the main process
    optimizer.safetensors   every per-parameter optimizer tensor, keyed `state.<param index>.<name>`
    optimizer.json          the optimizer's param groups and its non-tensor per-parameter values
    scheduler.json          the learning-rate scheduler's state_dict (plain numbers)
    rng-<process>.json      each process's Python, NumPy and torch random states

A sharded run (FSDP2: parameters and optimizer moments are DTensors, each process holding a slice) writes no
policy.safetensors and no optimizer.safetensors; every process writes its own slices instead:
    rank-<process>.safetensors  its local shards: `policy.<name>` and `optimizer.state.<param index>.<name>`
    rank-<process>.json         how they lie in the whole tensors: the process count, and per tensor its global
                                shape, placements and local shape (a resume checks them against the model it shards)
torch.distributed.checkpoint is not used: its `.metadata` file is a pickle (torch.save of the checkpoint's plan),
which a run folder may not hold (it is data: nothing in it may run code when loaded). The shards are not gathered on
save either: no process ever holds the whole optimizer state. The checkpoint's model/ folder (what `qae eval` and
`qae export` read) holds the full weights, gathered once per checkpoint by the session.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from qae_app.core.errors import QAEUserError
from qae_app.models.sharding import is_sharded, reshard
from qae_app.store.run_folder import read_run_file, safetensors_problem

POLICY_FILE = "policy.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
OPTIMIZER_FILE = "optimizer.json"
SCHEDULER_FILE = "scheduler.json"
RNG_FILE = "rng-{process}.json"
SHARD_FILE = "rank-{process}.safetensors"
SHARD_LAYOUT_FILE = "rank-{process}.json"
# what a pre-release's checkpoints held (accelerate's save_state): pickles, which only `qae migrate --trust-pickles`
# reads (train/run_migration.py)
PICKLED_SUFFIXES = (".pkl", ".bin", ".pt", ".pth")


def save_training_state(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, process_index: int, is_main: bool
) -> None:
    """Write this process's share of the training state into `folder` (which exists). Under DDP the weights, the
    optimizer and the scheduler are the same on every process, so the main process writes them; each process writes
    its own random states."""
    folder = Path(folder)
    if is_sharded(model):
        _save_shards(folder, model, optimizer, process_index)
        if is_main:
            _, plain = _split_optimizer_state(optimizer.state_dict())
            (folder / OPTIMIZER_FILE).write_text(json.dumps(plain))
            (folder / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
    elif is_main:
        save_model(model, str(folder / POLICY_FILE))
        tensors, plain = _split_optimizer_state(optimizer.state_dict())
        save_file(tensors, str(folder / OPTIMIZER_TENSORS_FILE))
        (folder / OPTIMIZER_FILE).write_text(json.dumps(plain))
        (folder / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
    save_random_states(folder, process_index)


def save_random_states(folder: Path, process_index: int) -> None:
    """This process's Python, NumPy and torch random states as rng-<process>.json."""
    (Path(folder) / RNG_FILE.format(process=process_index)).write_text(json.dumps(_random_states()))


def load_training_state(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, process_index: int
) -> None:
    """Restore what `save_training_state` wrote: the weights into `model` (unwrapped), the optimizer, the scheduler
    and this process's random states. A file that is not what it should be raises QAEUserError naming it."""
    folder = Path(folder)
    if is_sharded(model) or not (folder / POLICY_FILE).is_file():
        _load_shards(folder, model, optimizer, process_index)
    else:
        _load_whole(folder, model, optimizer)
    try:
        scheduler.load_state_dict(_read_json(folder, SCHEDULER_FILE))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _unreadable(folder, SCHEDULER_FILE, f"not a scheduler's state ({err})") from err
    name = RNG_FILE.format(process=process_index)
    try:
        _set_random_states(_read_json(folder, name))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise _unreadable(folder, name, f"not random states ({err})") from err


def _load_whole(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The weights and optimizer state of an unsharded checkpoint (the main process wrote them whole)."""
    try:
        missing, unexpected = load_model(model, str(folder / POLICY_FILE), strict=False)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise _unreadable(folder, POLICY_FILE, err) from err
    if missing or unexpected:
        raise _unreadable(
            folder,
            POLICY_FILE,
            f"its tensors are not this model's (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
        )
    try:
        tensors = load_file(str(folder / OPTIMIZER_TENSORS_FILE))
    except (SafetensorError, OSError) as err:
        raise _unreadable(folder, OPTIMIZER_TENSORS_FILE, err) from err
    plain = _read_json(folder, OPTIMIZER_FILE)
    try:
        optimizer.load_state_dict(_join_optimizer_state(tensors, plain))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise _unreadable(folder, OPTIMIZER_FILE, f"not this optimizer's state ({err})") from err


def _layout(tensor: torch.Tensor, world: int) -> dict:
    return {
        "shape": list(tensor.shape),
        "placements": [str(p) for p in tensor.placements],
        "local_shape": list(tensor.to_local().shape),
        "mesh": list(tensor.device_mesh.shape),
        "processes": world,
    }


def _save_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, process_index: int) -> None:
    """This process's slices of the weights and of the optimizer state, and their layout."""
    from torch.distributed.tensor import DTensor

    world = torch.distributed.get_world_size()
    reshard(model)
    whole = {f"policy.{name}": p.detach() for name, p in model.named_parameters()}  # (tied weights once)
    tensors, _ = _split_optimizer_state(optimizer.state_dict())
    whole.update({f"optimizer.{key}": value for key, value in tensors.items()})
    local, layout = {}, {}
    for key, value in whole.items():
        if isinstance(value, DTensor):
            layout[key] = _layout(value, world)
            value = value.to_local()
        local[key] = value.detach().contiguous().cpu()
    save_file(local, str(folder / SHARD_FILE.format(process=process_index)))
    (folder / SHARD_LAYOUT_FILE.format(process=process_index)).write_text(
        json.dumps({"processes": world, "tensors": layout})
    )


def _load_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, process_index: int) -> None:
    """This process's slices back into the sharded model and optimizer. The layout must be the one this launch
    shards into (the same process count and sharding); another is refused with the reason."""
    from torch.distributed.tensor import DTensor

    name, layout_name = SHARD_FILE.format(process=process_index), SHARD_LAYOUT_FILE.format(process=process_index)
    written_sharded = (folder / SHARD_LAYOUT_FILE.format(process=0)).is_file()
    if written_sharded != is_sharded(model) or not (folder / layout_name).is_file():
        written = "sharded (FSDP2)" if written_sharded else "unsharded"
        launch = "sharded (FSDP2)" if is_sharded(model) else "unsharded"
        raise QAEUserError(
            f"resume: checkpoint {folder} was written {written} and this launch trains {launch} "
            f"(process {process_index}). Resume it with the accelerate config it was trained with "
            "(configs/accelerate/fsdp2.yaml for a sharded run) and as many processes, or start a new "
            "run."
        )
    layout = _read_json(folder, layout_name)
    world = torch.distributed.get_world_size() if is_sharded(model) else 1
    if layout.get("processes") != world:
        raise QAEUserError(
            f"resume: checkpoint {folder} holds shards for {layout.get('processes')} processes and "
            f"this launch has {world}. Its shards lie where that many processes put them: resume with "
            f"--num_processes {layout.get('processes')}, or start a new run."
        )
    try:
        tensors = load_file(str(folder / name))
    except (SafetensorError, OSError) as err:
        raise _unreadable(folder, name, err) from err
    placed = layout["tensors"]
    reshard(model)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            key = f"policy.{param_name}"
            if key not in tensors or (isinstance(param, DTensor) and placed.get(key) != _layout(param, world)):
                raise _unreadable(folder, name, f"its shard of {param_name} is not this model's")
            (param.to_local() if isinstance(param, DTensor) else param).copy_(tensors[key])
    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's index order
    optimizer_tensors = {}
    for key, value in tensors.items():
        if not key.startswith("optimizer."):
            continue
        key = key.removeprefix("optimizer.")
        index = int(key.split(".")[1])
        if index >= len(params):
            raise _unreadable(
                folder, name, f"it holds optimizer state of parameter {index}; this optimizer has {len(params)}"
            )
        param = params[index]
        if f"optimizer.{key}" in placed:  # a moment sharded as its parameter is
            value = DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        optimizer_tensors[key] = value
    try:
        optimizer.load_state_dict(_join_optimizer_state(optimizer_tensors, _read_json(folder, OPTIMIZER_FILE)))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise _unreadable(folder, OPTIMIZER_FILE, f"not this optimizer's state ({err})") from err


# -------------------------------------------------------------------------------------------------------------------
# checking a checkpoint's state files before any is loaded


def training_state_problem(folder: Path) -> str | None:
    """Why the training state in `folder` cannot be loaded, found without loading any of it, or None: every process's
    files are there and each reads as what it should be (safetensors whose header and size agree; JSON of the shape
    this module writes). The main process checks them all before a resume picks the checkpoint, so a damaged one is
    passed over on every process alike, as one that fails its checksums is. (Whether the tensors are this model's is
    checked as they load.)"""
    folder = Path(folder)
    sharded = (folder / SHARD_LAYOUT_FILE.format(process=0)).is_file()
    if sharded:
        layout, problem = _json_file(folder, SHARD_LAYOUT_FILE.format(process=0), _shard_layout_problem)
        if problem:
            return problem
        processes = layout["processes"]
        names = [name.format(process=i) for i in range(processes) for name in (SHARD_LAYOUT_FILE, SHARD_FILE)]
    else:
        names = [POLICY_FILE, OPTIMIZER_TENSORS_FILE]
        processes = 1
    names += [OPTIMIZER_FILE, SCHEDULER_FILE, *(RNG_FILE.format(process=i) for i in range(processes))]
    names += sorted({p.name for p in folder.glob("rng-*.json")} - set(names))  # another process count's, too
    for name in names:
        problem = (
            safetensors_problem(folder / name)
            if name.endswith(".safetensors")
            else _json_file(folder, name, _JSON_SHAPES[name.split("-")[0] if "-" in name else name])[1]
        )
        if problem:
            return problem
    return None


def _json_file(folder: Path, name: str, shape_problem) -> tuple[object, str | None]:
    """(the parsed file, None), or (None, why it is not what `shape_problem` accepts)."""
    try:
        value = json.loads(read_run_file(folder / name))
    except FileNotFoundError:
        return None, f"{name} is missing"
    except (OSError, ValueError, RecursionError, QAEUserError) as err:  # (not UTF-8 or JSON, nested too deep, a link)
        return None, f"{name} is not JSON this qae wrote ({_short(err)})"
    why = shape_problem(value)
    return value, (f"{name} does not hold what qae writes there ({why})" if why else None)


def _short(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _ints(value, low: int = 0, high: int | None = None) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high) for v in value
    )


def _number(value, none: bool = False) -> bool:
    return (none and value is None) or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _rng_problem(states) -> str | None:
    if not isinstance(states, dict):
        return "not an object"
    python, numpy, torch_state = states.get("python"), states.get("numpy"), states.get("torch")
    if not (
        isinstance(python, list)
        and len(python) == 3
        and isinstance(python[0], int)
        and _ints(python[1])
        and len(python[1]) == 625
        and _number(python[2], none=True)
    ):
        return "python: not Python's random state"
    if not (
        isinstance(numpy, list)
        and len(numpy) == 5
        and numpy[0] == "MT19937"
        and _ints(numpy[1])
        and len(numpy[1]) == 624
        and all(isinstance(v, int) for v in numpy[2:4])
        and _number(numpy[4])
    ):
        return "numpy: not NumPy's random state"
    if not (_ints(torch_state, 0, 255) and torch_state):
        return "torch: not torch's random state (bytes)"
    cuda = states.get("cuda", [])
    if not (isinstance(cuda, list) and all(_ints(s, 0, 255) for s in cuda)):
        return "cuda: not CUDA random states"
    return None


def _optimizer_problem(plain) -> str | None:
    if not isinstance(plain, dict):
        return "not an object"
    groups, scalars, tuple_keys = plain.get("param_groups"), plain.get("scalars"), plain.get("tuple_keys")
    if not (
        isinstance(groups, list) and groups and all(isinstance(g, dict) and _ints(g.get("params")) for g in groups)
    ):
        return "param_groups: not a list of parameter groups"
    if not (isinstance(scalars, dict) and all(k.isdigit() and isinstance(v, dict) for k, v in scalars.items())):
        return "scalars: not per-parameter values"
    if not (isinstance(tuple_keys, list) and all(isinstance(k, str) for k in tuple_keys)):
        return "tuple_keys: not a list of names"
    return None


def _scheduler_problem(state) -> str | None:
    if not isinstance(state, dict):
        return "not an object"
    if not isinstance(state.get("last_epoch"), int) or not (
        isinstance(state.get("base_lrs"), list) and all(_number(v) for v in state["base_lrs"])
    ):
        return "last_epoch and base_lrs: not a scheduler's step and learning rates"
    for name in ("_step_count", "_last_lr", "lr_lambdas"):
        value = state.get(name)
        if name in state and not (isinstance(value, int) if name == "_step_count" else isinstance(value, list)):
            return f"{name}: a {type(value).__name__}"
    return None


def _shard_layout_problem(layout) -> str | None:
    if not isinstance(layout, dict) or not isinstance(layout.get("tensors"), dict):
        return "not an object with the tensors' layout"
    processes = layout.get("processes")
    if not (isinstance(processes, int) and not isinstance(processes, bool) and 1 <= processes <= 1 << 16):
        return f"processes: {str(processes)[:40]} is not a process count"
    for key, placed in layout["tensors"].items():
        if not (
            isinstance(placed, dict)
            and _ints(placed.get("shape"))
            and _ints(placed.get("local_shape"))
            and _ints(placed.get("mesh"))
            and isinstance(placed.get("placements"), list)
            and all(isinstance(p, str) for p in placed["placements"])
        ):
            return f"{key[:80]}: not a shard's layout"
    return None


_JSON_SHAPES = {
    OPTIMIZER_FILE: _optimizer_problem,
    SCHEDULER_FILE: _scheduler_problem,
    "rng": _rng_problem,
    "rank": _shard_layout_problem,
}


def is_data_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds its training state in this module's formats (not a pre-release's pickles)."""
    return (Path(folder) / POLICY_FILE).is_file() or (Path(folder) / SHARD_LAYOUT_FILE.format(process=0)).is_file()


def pickled_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that only an unpickler reads (a pre-release's accelerate state)."""
    return sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.suffix in PICKLED_SUFFIXES)


# -------------------------------------------------------------------------------------------------------------------
# the pieces


def _split_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """torch's optimizer state_dict -> (tensors for safetensors, the rest for JSON). Per-parameter values that are
    not tensors (some optimizers keep a plain `step`) go to JSON beside the param groups."""
    tensors, scalars = {}, {}
    for index, values in state_dict["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [
        {key: list(value) if isinstance(value, tuple) else value for key, value in group.items()}
        for group in state_dict["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars, "tuple_keys": _tuple_keys(state_dict)}


def _tuple_keys(state_dict: dict) -> list[str]:
    """Param-group keys whose values are tuples (AdamW's betas): JSON has lists only, and they are given back."""
    return sorted(
        {key for group in state_dict["param_groups"] for key, value in group.items() if isinstance(value, tuple)}
    )


def _join_optimizer_state(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, values in plain["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    tuple_keys = set(plain["tuple_keys"])
    groups = [
        {key: tuple(value) if key in tuple_keys else value for key, value in group.items()}
        for group in plain["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _random_states() -> dict:
    version, words, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states = {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        states["cuda"] = [state.tolist() for state in torch.cuda.get_rng_state_all()]
    return states


def _set_random_states(states: dict) -> None:
    version, words, gauss = states["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in states["cuda"]])


def _read_json(folder: Path, name: str):
    try:
        return json.loads(read_run_file(folder / name))
    except (OSError, ValueError, RecursionError, QAEUserError) as err:
        raise _unreadable(folder, name, str(err)[:300]) from err


def _unreadable(folder: Path, name: str, why) -> QAEUserError:
    return QAEUserError(
        f"checkpoint {folder}: {name} cannot be read ({why}). Resume from another checkpoint (remove "
        f"this folder) or start a new run."
    )
