"""`qae sweep`: a grid of ordinary training runs (policy losses x estimators x K x seeds), run one after another or
N at a time.

Every point is a plain `qae train` run in the runs dir, started as its own process (so `--parallel 2` trains two at
once, each with its share of the cores), its config tagged with the sweep's id and name (`qae runs --sweep`,
`qae compare --sweep`). A mean-baseline estimator ignores K, so it gets one point per seed, not one per K.

The sweep's id is a hash of the options its points share, and its runs are named from the sweep's name and the point
(`study-qae-k0.4-s1`; with --policy-loss, the loss first: `study-kl_cov-qae-k0.4-s1`). So re-running the same command
after a kill resumes the sweep: a finished run is kept, an interrupted (or killed) one resumes from its newest
checkpoint, the rest start; and the same command with more seeds, Ks or losses extends it. A run of that name that
belongs to another sweep (other options under the same --name) is refused rather than mixed in.

Each point's options are written to runs/.sweeps/<name>/<run>.toml (what `qae train --config` reads) with its log
beside it (the trainer's output, between lines saying when its process started and exited, with the exit code);
the dot keeps the folder out of `qae runs`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from qae_app.config import build_config
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.formatting import clipped
from qae_app.core.host_faults import environment_errno, environment_error, leave_the_terminal
from qae_app.core.policy_losses import OWNERS, POLICY_LOSSES
from qae_app.store.run_folder import (
    CONFIG_FILE,
    DB_FILE,
    db_path,
    lost_its_database,
    read_run_config,
    run_dir,
    trainer_alive,
    validate_run_name,
)
from qae_app.store.stop import hold_sweep

SWEEPS_DIR = ".sweeps"  # under the runs dir: each sweep's point files and logs
POLL_S = 2.0  # how often the sweep looks at its running processes and their step counts
# A sweep plans, tags and lists every run before the first starts; hundreds of runs are a study, a million a typo
MAX_SWEEP_RUNS = 500
# train options whose default differs in a sweep (`plan_sweep` applies them, `qae sweep --help` shows them): how the
# update moves each regime's entropy (dH_easy, dH_hard) is what a sweep compares, so it is measured unless turned off
SWEEP_DEFAULTS = {"log_entropy_delta": True}


@dataclass(frozen=True)
class SweepPoint:
    run_name: str
    options: dict  # every option the user gave plus this point's estimator, K, seed and the sweep tags

    @property
    def steps(self) -> int:
        return build_config(**self.options).steps


@dataclass
class Sweep:
    sweep_id: str
    name: str
    points: list[SweepPoint]
    folder: Path  # runs/.sweeps/<name>


LIST_EXAMPLES = {"estimator": "qae,grpo", "k": "0.3,0.4", "policy-loss": "clip,kl_cov"}


def parse_list(flag: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise QAEUserError(
            f"{flag}: '{text}' names nothing. Give a comma-separated list, e.g. {LIST_EXAMPLES.get(flag, 'a,b')}."
        )
    if len(set(items)) != len(items):
        raise QAEUserError(f"{flag}: '{text}' repeats a value. Give each once.")
    if flag == "k":  # 0.4 and 0.40 are one K: it would train one point twice, under two names
        seen: dict[float, str] = {}
        for item in items:
            try:
                value = float(item)
            except ValueError:
                continue  # 'auto', or a bad value that the config check names
            if value in seen:
                raise QAEUserError(
                    f"k: '{clipped(text)}' gives the same K twice ({seen[value]} and {item}). Give each once."
                )
            seen[value] = item
    return items


def plan_sweep(
    runs_dir: Path,
    estimators: str,
    ks: str | None,
    seeds: int,
    options: dict,
    name: str | None = None,
    losses: str | None = None,
) -> Sweep:
    """The sweep's points, validated before anything runs: `estimators` 'qae,grpo', `ks` '0.3,0.4' (QAE only;
    default: the options' K or names.DEFAULT_K), `seeds` how many seeds from the options' seed on, `options` the train
    options the user gave (TOML and command line, not the defaults), `losses` 'clip,kl_cov' (None: the options' own
    --policy-loss, and run names without it, as a sweep before the option had)."""
    estimator_list, k_list = _grid(estimators, ks, seeds, options)
    loss_list = _losses(
        losses, seeds * sum(len(k_list) if ESTIMATORS[estimator].reads_k else 1 for estimator in estimator_list)
    )
    for key in ("run_name", "sweep_id", "sweep_name", "estimator", "k"):
        options.pop(key, None)
    first_seed = int(options.pop("seed", 0))
    for key, value in SWEEP_DEFAULTS.items():  # e.g. the entropy change is measured unless turned off
        options.setdefault(key, value)
    # the id hashes the options every point shares, not the grid: the same command with more seeds or Ks extends the
    # sweep (its finished points kept), and a point's run name says where in the grid it is
    # (a grid over losses names its runs by loss: it is not the same sweep as one that names none)
    hashed = options if losses is None else {**options, "policy_loss": "(a grid)"}
    sweep_id = hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = validate_run_name(f"sweep-{sweep_id[:6]}" if name is None else name, option="name")
    points = [
        point
        for loss in loss_list
        for point in _points(
            name,
            sweep_id,
            estimator_list,
            k_list,
            range(first_seed, first_seed + seeds),
            _loss_options(options, loss, loss_list),
            loss,
        )
    ]
    check_data_files(build_config(**points[0].options))  # shared by every point: a bad file fails all of them
    _check_point_folders(runs_dir, points, sweep_id)
    return Sweep(sweep_id, name, points, _sweep_folder(runs_dir, name))


def _grid(estimators: str, ks: str | None, seeds: int, options: dict) -> tuple[list[str], list[str]]:
    """The sweep's estimators and Ks, checked with its seed count before any point is planned."""
    estimator_list = parse_list("estimator", estimators)
    for estimator in estimator_list:
        if estimator not in ESTIMATORS:
            raise QAEUserError(f"estimator: unknown '{estimator}'. Choose from: {', '.join(ESTIMATORS)}.")
    if ks is not None and not any(ESTIMATORS[estimator].reads_k for estimator in estimator_list):
        raise QAEUserError(
            f"k: {ks} is QAE's quantile level, and the sweep has no qae run. Drop --k or add qae to --estimator."
        )
    k_list = parse_list("k", ks) if ks is not None else [str(options.get("k", names.DEFAULT_K))]
    if seeds < 1:
        raise QAEUserError(f"seeds: {seeds}. Use 1 or more seeds (3 or more to get a confidence interval).")
    n_runs = sum(len(k_list) if ESTIMATORS[estimator].reads_k else 1 for estimator in estimator_list) * seeds
    if n_runs > MAX_SWEEP_RUNS:  # counted before any point is planned: a typo like --seeds 1000000 never hangs
        raise QAEUserError(
            f"seeds: {seeds} makes {n_runs:,} runs, more than the {MAX_SWEEP_RUNS} a sweep may have "
            "(each run is a full training run). Use fewer seeds or Ks, or split the study into "
            "several sweeps."
        )
    return estimator_list, k_list


def _losses(losses: str | None, runs_per_loss: int) -> list[str | None]:
    """The sweep's policy losses, checked: [None] without --policy-loss (each point takes the options' own loss)."""
    if losses is None:
        return [None]
    loss_list = parse_list("policy-loss", losses)
    for loss in loss_list:
        if loss not in POLICY_LOSSES:
            raise QAEUserError(f"policy-loss: unknown '{loss}'. Choose from: {', '.join(POLICY_LOSSES)}.")
    if len(loss_list) * runs_per_loss > MAX_SWEEP_RUNS:
        raise QAEUserError(
            f"policy-loss: {len(loss_list)} losses make {len(loss_list) * runs_per_loss:,} runs, more "
            f"than the {MAX_SWEEP_RUNS} a sweep may have. Use fewer losses, seeds or Ks."
        )
    return loss_list


def _loss_options(options: dict, loss: str | None, loss_list: list[str | None]) -> dict:
    """The shared options as one loss's points take them: its name, and without the options that only the sweep's
    other losses own (--clip-cov-ratio is Clip-Cov's points' alone; an option of a loss outside the sweep stays, and
    the config refuses it)."""
    if loss is None:
        return options
    others = {name for name, owners in OWNERS.items() if loss not in owners and set(owners) & set(loss_list)}
    return {**{key: value for key, value in options.items() if key not in others}, "policy_loss": loss}


def _points(
    name: str,
    sweep_id: str,
    estimator_list: list[str],
    k_list: list[str],
    seeds: range,
    options: dict,
    loss: str | None = None,
) -> list[SweepPoint]:
    """One point per estimator, K (QAE only) and seed, each with its run name (`loss` first where the sweep names
    its losses) and its options (the shared `options` and its own), built into a config here so that every bad
    value is refused before any run starts."""
    points = []
    prefix = f"{loss}-" if loss is not None else ""
    for estimator in estimator_list:
        for k in k_list if ESTIMATORS[estimator].reads_k else [None]:  # a mean baseline ignores K: one point per seed
            for seed in seeds:
                run_name = validate_run_name(f"{name}-{prefix}{estimator}{f'-k{k}' if k is not None else ''}-s{seed}")
                point = dict(
                    options,
                    estimator=estimator,
                    seed=seed,
                    run_name=run_name,
                    sweep_id=sweep_id,
                    sweep_name=name,
                    **({"k": k} if k is not None else {}),
                )
                try:
                    build_config(**point)  # every bad value is refused here, before any run starts
                except QAEUserError as err:
                    raise QAEUserError(f"{err} (in sweep point {run_name})") from None
                points.append(SweepPoint(run_name, point))
    return points


def _check_point_folders(runs_dir: Path, points: list[SweepPoint], sweep_id: str) -> None:
    """Refuse a point whose run name is taken by a folder that is not this sweep's run (no training run, a run
    that lost its database, a run of another sweep): the same name under other options is another sweep, and the
    two never mix."""
    for point in points:
        stored = run_dir(runs_dir, point.run_name) / CONFIG_FILE
        if not stored.exists() and stored.parent.exists():
            raise QAEUserError(
                f"name: run '{point.run_name}' already exists in {runs_dir} and is not a training run (no "
                f"{CONFIG_FILE}: an eval run, or what is left of a run). Pass another --name, or move the folder "
                "aside."
            )
        if lost_its_database(stored.parent):
            raise QAEUserError(
                f"name: run '{point.run_name}' of this sweep has lost its database ({stored.parent / DB_FILE} was "
                "deleted or moved aside), so it can neither be resumed nor started again under its name. Restore "
                "the file, or move the run's folder aside to train that point anew."
            )
        if stored.exists():
            other = read_run_config(stored.parent).get("sweep_id")
            if other != sweep_id:
                raise QAEUserError(
                    f"name: run '{point.run_name}' already exists in {runs_dir} and belongs to "
                    f"{'sweep ' + other if other else 'no sweep'}, not to this one (other options). "
                    "Pass another --name, or the same options as that sweep to resume it."
                )


def _sweep_folder(runs_dir: Path, name: str) -> Path:
    """The sweep's folder for its point files and logs, made before any run starts: a read-only runs dir is said
    now."""
    folder = Path(runs_dir) / SWEEPS_DIR / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if environment_errno(err) is None:
            raise
        raise environment_error(
            f"runs-dir: cannot write the sweep's files in {runs_dir}", err, "Its runs are intact."
        ) from None
    return folder


# ---------------------------------------------------------------------------------------------------------------
# running the points


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):  # reward = [...]
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, (int, float)):
        return repr(value)
    # a TOML basic string: JSON's escapes are TOML's, but not its surrogate pairs for characters beyond U+FFFF, so
    # the rest of Unicode is written as it is (UTF-8), and DEL, which JSON leaves bare and TOML refuses, escaped
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def write_point_file(path: Path, options: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(f"{key} = {_toml_value(value)}\n" for key, value in sorted(options.items())), encoding="utf-8"
    )
    return path


def point_state(runs_dir: Path, point: SweepPoint) -> str:
    """'new' (no run yet), 'done' (finished all its steps), 'busy' (another process trains it), 'taken' (a run of
    another sweep, or of none, took its name after the sweep was planned: never trained by the sweep) or 'resume'."""
    folder = run_dir(runs_dir, point.run_name)
    if taken_by_another_run(folder, point.options["sweep_id"]):
        return "taken"
    if not db_path(runs_dir, point.run_name).exists():
        return "new"
    if trainer_alive(folder):
        return "busy"
    from qae_app.store.reader import read_last_step, read_run

    try:
        status, last = (
            read_run(db_path(runs_dir, point.run_name))["status"],
            read_last_step(db_path(runs_dir, point.run_name)),
        )
    except QAEUserError:
        return "resume"
    return "done" if status == "finished" and (last or 0) >= point.steps else "resume"


def taken_by_another_run(folder: Path, sweep_id: str) -> bool:
    """Whether the folder holds a run that is not this sweep's (plan_sweep refuses those it finds; one started later,
    a plain `qae train --run-name` racing the sweep, is found here)."""
    if (folder / CONFIG_FILE).exists():
        try:
            return read_run_config(folder).get("sweep_id") != sweep_id
        except QAEUserError:
            return False  # a damaged config.json: the resume says so
    return (folder / DB_FILE).exists()  # a database without a config: an eval run (`qae eval --run-name`)


@dataclass
class PointRun:
    point: SweepPoint
    action: str  # "start" or "resume"
    process: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.monotonic)
    asked_to_stop: bool = False  # sent SIGTERM by a stopping sweep


def _command(sweep: Sweep, point: SweepPoint, action: str, runs_dir: Path, cpu: bool) -> list[str]:
    base = [sys.executable, "-m", "qae_app.cli", "train", "--runs-dir", str(runs_dir), *(["--cpu"] if cpu else [])]
    if action == "resume":  # the stored config is the run's; only the step count may grow; reward code named again
        rewards = [flag for spec in point.options.get("reward") or [] for flag in ("--reward", str(spec))]
        return [*base, "--resume", point.run_name, "--steps", str(point.steps), *rewards]
    return [*base, "--config", str(write_point_file(sweep.folder / f"{point.run_name}.toml", point.options))]


def check_data_files(cfg) -> None:
    """Load the training data and the evaluation benchmark as each run will (each run loads its own again), and find
    each --reward file (read, not imported: each run's workers import it): a bad file is refused once, before any run
    starts, not by every run in turn."""
    from qae_app.rewards.specs import parse_reward_specs
    from qae_app.scoring.reward_path import run_benchmark, run_task

    for spec in parse_reward_specs(cfg.reward):
        spec.resolved()
    run_task(cfg)
    if cfg.eval_bench:
        run_benchmark(cfg, cfg.eval_bench, "eval-bench")


def check_parallel(parallel: int) -> None:
    cores = os.cpu_count() or 1
    if not 1 <= parallel <= cores:
        raise QAEUserError(
            f"parallel: {parallel}. Use 1 to {cores} runs at a time (this machine has {cores} cores; "
            "each run gets its share of them)."
        )


def run_sweep(sweep: Sweep, runs_dir: Path, parallel: int = 1, cpu: bool = False, on_update=None) -> dict:
    """Run every point not yet done, `parallel` at a time. `on_update(states, steps)` is called every POLL_S seconds
    with each point's state ('done', 'kept', 'queued', 'running', 'failed', 'busy', 'interrupted') and its stored
    step count. Returns {run_name: final state}. Ctrl-C, SIGTERM or SIGHUP stop the running points the trainer's way
    (checkpoint, status interrupted) and return with them 'interrupted'."""
    check_parallel(parallel)
    states, queue = _starting_states(sweep, runs_dir)
    steps = {}
    threads = max(1, (os.cpu_count() or 1) // parallel)  # each run its share of the cores, not all of them each
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), COLUMNS="120")
    active: list[PointRun] = []
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        if signum == signal.SIGHUP:
            leave_the_terminal()  # (its points' logs are files: only this process's terminal output goes)
        stopping = True

    # `qae stop --sweep` finds this process by its hold on the sweep; taken before the handlers are swapped, so a
    # refused lock file leaves the caller's handlers in place
    held = hold_sweep(sweep.folder)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while (queue and not stopping) or active:
            while queue and len(active) < parallel and not stopping:
                point, action = queue.pop(0)
                if point_state(runs_dir, point) == "taken":  # another run took the name since the sweep began
                    states[point.run_name] = "taken"
                    continue
                active.append(_start_point(sweep, point, action, runs_dir, cpu, env))
                states[point.run_name] = "running"
            if stopping:
                _ask_to_stop(active)
            states.update(_collect_exited(sweep, runs_dir, active, stopping))
            for point in sweep.points:
                if states[point.run_name] in ("running", "done", "kept", "interrupted", "failed"):
                    steps[point.run_name] = _stored_steps(runs_dir, point.run_name, steps.get(point.run_name))
            if on_update:
                on_update(states, steps)
            if active:
                time.sleep(POLL_S)
    finally:
        os.close(held)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return states


def _starting_states(sweep: Sweep, runs_dir: Path) -> tuple[dict[str, str], list[tuple[SweepPoint, str]]]:
    """Each point's state as the sweep starts ('kept', 'busy', 'taken' or 'queued'), and the queue: the points to
    start or resume, in order, each with its action."""
    states, queue = {}, []
    for point in sweep.points:
        state = point_state(runs_dir, point)
        states[point.run_name] = {"done": "kept", "busy": "busy", "taken": "taken"}.get(state, "queued")
        if state in ("new", "resume"):
            queue.append((point, "start" if state == "new" else "resume"))
    return states, queue


def _start_point(sweep: Sweep, point: SweepPoint, action: str, runs_dir: Path, cpu: bool, env: dict) -> PointRun:
    """Start (or resume: `action`) a point's trainer in a process of its own, its output appended to the point's
    log after a line that says when."""
    log = sweep.folder / f"{point.run_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n# qae sweep {sweep.name}: {action} {point.run_name} at {_now()}\n")
        out.flush()
        process = subprocess.Popen(
            _command(sweep, point, action, runs_dir, cpu),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
    return PointRun(point, action, process, log)


def _ask_to_stop(active: list[PointRun]) -> None:
    """SIGTERM, once, to each running trainer: it finishes its step, checkpoints and says interrupted."""
    for run in active:
        if run.process.poll() is None and not run.asked_to_stop:
            run.process.send_signal(signal.SIGTERM)
            run.asked_to_stop = True


def _collect_exited(sweep: Sweep, runs_dir: Path, active: list[PointRun], stopping: bool) -> dict[str, str]:
    """The final state of each trainer that has exited ('done', 'taken', 'interrupted' or 'failed'), by run name;
    each leaves `active`, and its log ends with its exit code."""
    exited = {}
    for run in list(active):
        code = run.process.poll()
        if code is None:
            continue
        active.remove(run)
        with run.log.open("a") as out:  # the trainer has exited: nothing else writes to its log now
            out.write(
                f"# qae sweep {sweep.name}: {run.point.run_name} exited with code {code} at {_now()} "
                f"after {time.monotonic() - run.started:.1f} s\n"
            )
        final = point_state(runs_dir, run.point)  # (the name may have been taken as the point started)
        exited[run.point.run_name] = (
            "done"
            if code == 0 and final == "done"
            else "taken"
            if code != 0 and final == "taken"
            else "interrupted"
            if stopping or code == 130
            else "failed"
        )
    return exited


def _now() -> str:
    """The wall-clock time a point log records (ISO 8601, UTC, to the microsecond)."""
    return datetime.now(timezone.utc).isoformat()


def _stop_with_parent() -> None:
    """In the child: have the kernel send it SIGTERM when the sweep dies, even by kill -9, so a killed sweep leaves
    no orphan trainer behind (the trainer checkpoints and stops as interrupted; re-running the sweep resumes it).
    Linux only; elsewhere a child outlives a killed sweep."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stored_steps(runs_dir: Path, run_name: str, before: int | None) -> int | None:
    """The run's stored step count, or the last one seen when its file is busy this instant."""
    path = db_path(runs_dir, run_name)
    if not path.exists():
        return before
    from qae_app.store.reader import read_last_step

    try:
        return read_last_step(path) or 0
    except Exception:  # noqa: BLE001 - a file being written may be unreadable for a moment; the next poll reads it
        return before


def failure_tail(log: Path, lines: int = 15) -> str:
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
