"""`qae`: train with QAE, evaluate, and inspect runs. Each command parses options and calls the library.

Options of `qae train` are generated from `config.TrainConfig`, so the dataclass is the one place that names them,
sets their defaults and writes their help.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qae_app.cli import dashboard_command, launch, manage, preview_command
from qae_app.cli.console import SafeConsole, console, fail
from qae_app.cli.options import DEFAULT_RUNS_DIR, RunsDir
from qae_app.config import EvalConfig, TrainConfig
from qae_app.core.errors import QAEUserError
from qae_app.core.faults import fault_point
from qae_app.core.formatting import number
from qae_app.store.run_folder import DB_FILE

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="RL from verifiable rewards with Quantile Advantage Estimation (QAE).",
)

# ---------------------------------------------------------------------------------------------------------------
# options generated from the config dataclasses (config.TrainConfig, config.EvalConfig)

_PYTHON_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list[str]": list[str]}


def _option_parameters(config_class, own_defaults: dict | None = None) -> list[inspect.Parameter]:
    """One typer option per dataclass field, all defaulting to None (= not given: keep the TOML value or default).
    `own_defaults`: the command's defaults where they differ from the dataclass's, for the help to show."""
    params = []
    defaults = config_class()
    for f in dataclasses.fields(config_class):
        base = str(f.type).split(" |")[0]
        default = (own_defaults or {}).get(f.name, getattr(defaults, f.name))
        help_text = f.metadata["help"]
        choices = f.metadata.get("choices")
        if isinstance(choices, dict):  # a names.* registry: say what each choice means
            help_text += " " + escape("; ".join(f"{name}: {text}" for name, text in choices.items()))
        elif choices:
            help_text += " " + escape(f"[{'|'.join(choices)}]")
        if default is not None:
            help_text += f" [dim](default: {default})[/]"
        flag = f"--{f.name.replace('_', '-')}"
        if base == "bool":  # a switch: --x / --no-x (not given: keep the TOML value or default)
            flag = f"{flag}/--no-{f.name.replace('_', '-')}"
        option = typer.Option(
            flag,
            help=help_text,
            show_default=False,
            metavar="<str>..." if base == "list[str]" else None,
            rich_help_panel=f.metadata["group"].capitalize(),
        )
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[_PYTHON_TYPES[base] | None, option],
            )
        )
    return params


def _with_config_options(command, config_class):
    """Give `command` (which takes **options) one option per field of `config_class`, and register it."""
    command.__signature__ = inspect.Signature(
        [
            p
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.kind != inspect.Parameter.VAR_KEYWORD
        ]
        + _option_parameters(config_class)
    )
    return command


# ---------------------------------------------------------------------------------------------------------------
# qae train


def train(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML file with any of the options below; command-line options override it."),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue the run with this id from its newest "
            "valid checkpoint (options marked resumable may change).",
        ),
    ] = None,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    cpu: Annotated[bool, typer.Option("--cpu/--no-cpu", help="Force CPU even when a GPU is present.")] = False,
    accept_changed_reward: Annotated[
        bool,
        typer.Option(
            "--accept-changed-reward",
            help="With --resume: score the rest of the run with a --reward file that changed "
            "since the run scored with it (the run records both versions).",
        ),
    ] = False,
    **options: Any,
) -> None:
    """Train a policy with QAE (or a mean-baseline estimator) and log every rollout to DuckDB."""
    launch.end_with_the_launcher()
    from qae_app.config import build_config
    from qae_app.train.session import resume_config
    from qae_app.train.trainer import Trainer

    try:
        cfg = (
            resume_config(runs_dir, resume, config, **options)
            if resume is not None
            else build_config(config, **options)
        )
        trainer = Trainer(
            cfg,
            runs_dir,
            resume=resume is not None,
            console=console,
            cpu=True if cpu else None,
            accept_changed_reward=accept_changed_reward,
        )
    except QAEUserError as err:
        fail(err)
    run_training(trainer)


def plan(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="The run's TOML file; its \\[plan] table may give the options below."),
    ] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Processes, one per GPU (default: 1).")] = None,
    gpu_memory: Annotated[
        float | None, typer.Option("--gpu-memory", help="Each GPU's memory in GB (default: 80).")
    ] = None,
    sharding: Annotated[
        str | None,
        typer.Option(
            "--sharding",
            help="ddp: every process holds everything; fsdp: "
            "weights, gradients and optimizer state split over the GPUs "
            "(default: ddp).",
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            help="The longest prompt in tokens "
            "(default: the task's longest for a built-in model, which "
            "reads one token a character; else 1024).",
        ),
    ] = None,
    **options: Any,
) -> None:
    """The per-GPU memory of a training run by component, whether it fits, and what to turn if not. Reads the
    model's config only (a folder, a .gguf file, the HF cache): nothing is loaded or downloaded."""
    from qae_app.analysis.memory_plan import (
        Hardware,
        builtin_prompt_tokens,
        model_shape,
        plan_run,
        recipe_hardware,
        render,
    )
    from qae_app.config import build_config

    try:
        cfg = build_config(config, **options)
        given = {"gpus": gpus, "gpu_memory_gb": gpu_memory, "sharding": sharding, "prompt_tokens": prompt_tokens}
        hardware = Hardware(
            **{
                "gpus": 1,
                "gpu_memory_gb": 80.0,
                **builtin_prompt_tokens(cfg),
                **recipe_hardware(config),
                **{k: v for k, v in given.items() if v is not None},
            }
        )
        result = plan_run(cfg, model_shape(cfg.model), hardware)
    except QAEUserError as err:
        fail(err)
    render(result, _view_console())
    if not result.fits:
        raise typer.Exit(code=1)


def print_command(command: str) -> None:
    """A command for the user to paste, indented, on one line whatever the terminal's width: wrapped at a space (or
    a long path anywhere), a paste ran its first half."""
    console.print(Text("  " + command), soft_wrap=True, highlight=False)


def run_training(trainer) -> None:
    from qae_app.cli.progress import TrainProgress, banner

    cfg = trainer.cfg
    main = trainer.is_main
    if main:
        console.print(banner(cfg, trainer.run_id))
        _note_nothing_to_evaluate(cfg, trainer.eval_problems)
    progress = TrainProgress(console, cfg.steps, trainer.state.step, show=main, dynamic_sampling=cfg.dynamic_sampling)
    steps_before = trainer.state.step  # a resumed run's steps already done
    try:
        with progress:
            result = trainer.fit(on_step=progress.update)
    except QAEUserError as err:
        fail(_with_reward_resume(trainer, err))
    except Exception as err:  # a full disk or a file-size limit mid-run: say so, and how the run continues
        fail_on_write_fault(trainer, err)
        raise
    launch.done_with_the_run()
    if main and progress.heldout is None and trainer.resuming:  # nothing evaluated now: the run's last evaluation
        from qae_app.store.reader import read_last_heldout_accuracy

        progress.heldout = read_last_heldout_accuracy(result.run_dir / DB_FILE)
    if main and result.steps_done == steps_before and steps_before >= cfg.steps:
        console.print(
            f"run {result.run_id} had already done its {cfg.steps} steps: nothing to train. Pass --steps "
            f"above {cfg.steps} to train further.",
            highlight=False,
        )
    if result.status == "interrupted":
        if main:
            _say_how_to_continue(result, trainer.runs_dir)
        trainer.release_models()  # (before the process group: FSDP2's modules hold it)
        launch.end_processes()
        raise typer.Exit(code=130)
    if main:
        _say_done(result, progress.heldout, trainer.runs_dir)
    fault_point("done", result.steps_done)  # (crash tests: a SIGTERM once the run said it is done)
    trainer.release_models()  # (before the process group: FSDP2's modules hold it)
    launch.end_processes()


def _note_nothing_to_evaluate(cfg, eval_problems) -> None:
    """--eval-every with nothing held out (given explicitly, config.check_given_together refuses it): say so once."""
    if cfg.eval_every and not eval_problems:
        console.print(
            f"[yellow]note:[/] nothing to evaluate every {cfg.eval_every} steps: {cfg.data} has no "
            "held-out split. Pass --heldout-fraction 0.1 or --eval-bench FILE to track held-out "
            "accuracy, or --eval-every 0 to silence this.",
            highlight=False,
        )


def _say_how_to_continue(result, runs_dir) -> None:
    """An interrupted run: where it stopped and the command that continues it from its newest checkpoint."""
    from qae_app.store.run_folder import latest_checkpoint

    newest = latest_checkpoint(result.run_dir)
    start = (
        f"from its newest checkpoint, {newest.name},"
        if newest is not None
        else "from step 0 (no checkpoint yet; the same seed trains the same steps again)"
    )
    console.print(
        f"\n[yellow]interrupted[/] after step {result.steps_done}. Continue it {start} with:", highlight=False
    )
    print_command(f"qae train --resume {result.run_id} --runs-dir {runs_dir}")


def _say_done(result, heldout: float | None, runs_dir) -> None:
    """A finished run: its steps, status and held-out accuracy, and the commands that inspect it."""
    console.print(
        f"[green]done[/]: {result.steps_done} steps, status {result.status}. Held-out accuracy {number(heldout)}."
    )
    console.print(f"Stored in [cyan]{escape(str(result.run_dir / DB_FILE))}[/]. Inspect it with:", highlight=False)
    print_command(f"qae show {result.run_id} --runs-dir {runs_dir}")
    print_command(f"qae rollouts {result.run_id} --gated --runs-dir {runs_dir}")
    print_command(f"qae dashboard --runs-dir {runs_dir}")


def _with_reward_resume(trainer, err: QAEUserError) -> QAEUserError:
    """A reward function that failed mid-run (RewardError) said with what is kept and the command that continues the
    run once the cause is fixed; any other error as it is."""
    from qae_app.rewards.registry import RewardError
    from qae_app.store.run_folder import latest_checkpoint

    if not isinstance(err, RewardError):
        return err
    newest = latest_checkpoint(Path(trainer.runs_dir) / trainer.run_id)
    kept = f"its newest checkpoint ({newest.name})" if newest is not None else "no checkpoint yet (it restarts at 0)"
    command = reward_resume_command(trainer.run_id, trainer.cfg, trainer.runs_dir)
    if err.spec is not None and err.spec.kind == "module":  # an installed library's function: not the user's to fix
        cause = (
            f"{err.spec.target} is an installed module, so the cause is more likely what it was given than its "
            "code: docs/rewards.md says what a reward function receives (messages for conversational data, text "
            "otherwise) and the data's columns it gets. Once that is settled, continue it with"
        )
    else:
        cause = "Once the function is fixed, continue it with"
    return RewardError(
        f"{err}\nThe run stopped failed at step {trainer.state.step + 1}; the steps before it and "
        f"{kept} are kept. {cause}: {command} (add --accept-changed-reward if the fix changed the "
        "reward's file: the run records both versions).",
        err.spec,
    )


def reward_resume_command(run_id: str, cfg, runs_dir) -> str:
    """`qae train --resume RUN` with every option a run that scores with reward code needs named again: its --reward
    specs and their --reward-weights (a run folder never names code to run)."""
    import shlex

    from qae_app.rewards.specs import weights_text

    command = ["qae", "train", "--resume", run_id, *[part for spec in cfg.reward or [] for part in ("--reward", spec)]]
    if cfg.reward and cfg.reward_weights is not None:
        command += ["--reward-weights", weights_text(cfg.reward_weights)]
    return shlex.join([*command, "--runs-dir", str(runs_dir)])


def fail_on_write_fault(trainer, err: Exception) -> None:
    """Exit 2 with the cause when `err` is the machine's (disk full, file-size limit, read-only), not a bug: the steps
    stored and the checkpoints before this one are safe, and the run resumes once the cause is gone."""
    from qae_app.core.host_faults import environment_error, free_space_text, write_fault

    folder = Path(trainer.runs_dir) / trainer.run_id
    number = write_fault(err, folder if folder.exists() else Path(trainer.runs_dir))
    if number is None:
        return
    checkpoint_bytes = 3 * sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # weights, Adam x2
    free = free_space_text(folder)
    fail(
        environment_error(
            f"run {trainer.run_id}: cannot write its files",
            err,
            f"The data is safe: the steps stored so far and its complete checkpoints are kept (a partial checkpoint is "
            f"never resumed from). A checkpoint of this run needs about {checkpoint_bytes / 1e6:,.1f} MB"
            + (f"; {free}" if free else "")
            + ".",
            number,
            then=f"continue it with: qae train --resume {trainer.run_id} --runs-dir {trainer.runs_dir}",
        )
    )


# ---------------------------------------------------------------------------------------------------------------
# qae warmstart


def warmstart(
    task: Annotated[
        str,
        typer.Option(
            help="Built-in task to warm-start on: arith (ships as builtin:tiny) or chain (builtin:tiny-chain)."
        ),
    ] = "arith",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the checkpoint (default: ./warmstart/<task>). Train "
            "from it with `qae train --model FOLDER --data <task>`."
        ),
    ] = None,
    into_package: Annotated[
        bool,
        typer.Option(
            "--into-package",
            help="Overwrite the task's shipped checkpoint inside the installed package (what `qae "
            "train --data <task>` loads by default) instead of writing ./warmstart/<task>.",
        ),
    ] = False,
    steps: Annotated[int | None, typer.Option(help="Supervised steps (default: the shipped recipe's).")] = None,
    seed: Annotated[int, typer.Option(help="Initialisation and data seed.")] = 0,
) -> None:
    """Rebuild a built-in task's starting checkpoint (supervised, deterministic, seconds on 2 cores), into
    ./warmstart/<task> unless --out or --into-package says otherwise; train from it with `qae train --model FOLDER`."""
    from rich.progress import Progress

    from qae_app.data.tasks import builtin_task_name
    from qae_app.train.warmstart import WarmstartConfig, check_out_dir, default_out_dir, shipped_dir
    from qae_app.train.warmstart import warmstart as run_warmstart

    try:
        cfg = WarmstartConfig(task=builtin_task_name(task) or task, steps=steps, seed=seed).resolved()
        if into_package and out is not None:
            raise QAEUserError(
                f"out: --out {out} and --into-package name two folders. Pass one: --into-package "
                f"writes {shipped_dir(cfg.task)}."
            )
        out = check_out_dir(shipped_dir(cfg.task) if into_package else out or default_out_dir(cfg.task))
    except QAEUserError as err:
        fail(err)
    with Progress(console=console) as progress:
        bar = progress.add_task("warm start", total=cfg.steps)
        run_warmstart(
            out,
            cfg,
            on_step=lambda step, loss, *_: progress.update(bar, completed=step + 1, description=f"loss {loss:.3f}"),
        )
    console.print(Text.assemble("saved to ", (str(out), "cyan"), ". Train from it with:"), highlight=False)
    print_command(f"qae train --model {out} --data {cfg.task}")


# ---------------------------------------------------------------------------------------------------------------
# inspecting runs


def _view_console() -> SafeConsole:
    """A console sized now (COLUMNS, or the terminal): the views lay themselves out for its width."""
    return SafeConsole(highlight=False)


def list_runs(
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    sweep: Annotated[str | None, typer.Option(help="Only the runs of this sweep (its id or name).")] = None,
    tag: Annotated[str | None, typer.Option(help="Only the runs tagged so (`qae tag`).")] = None,
) -> None:
    """List runs: status, estimator, K, steps and the latest reward, accuracy and entropy (model and task when the
    terminal is wide enough). A run is its folder; an unreadable database is listed with the reason."""
    from qae_app.analysis.settings import listed_with_settings_checked
    from qae_app.cli.views import runs_view
    from qae_app.store.reader import run_summaries

    out = _view_console()
    rows = [listed_with_settings_checked(row, runs_dir) for row in run_summaries(runs_dir)]
    if sweep is not None:
        from qae_app.analysis.run_comparison import in_sweep
        from qae_app.store.reader import stored_config

        rows = [row for row in rows if in_sweep(stored_config(row), sweep)]
        if not rows:
            out.print(f"no run of sweep '{escape(sweep)}' in {escape(str(runs_dir))}. Start it with `qae sweep`.")
            return
    if tag is not None:
        rows = [row for row in rows if tag in (row.get("tags") or "").split(", ")]
        if not rows:
            out.print(f"no run tagged '{escape(tag)}' in {escape(str(runs_dir))}. Tag one with `qae tag RUN {tag}`.")
            return
    if not rows:
        out.print(f"no runs in {escape(str(runs_dir))}. Start one with `qae train`.")
        return
    out.print(runs_view(rows, str(runs_dir), out.width))


def show(
    run: Annotated[str, typer.Argument(help="Run id: its folder under --runs-dir (see `qae runs`).")],
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    every: Annotated[int, typer.Option(help="Show every N-th step (default: about 15 rows).")] = 0,
    metrics: Annotated[
        str | None,
        typer.Option(help="Comma-separated step metrics to show (default: the most important that fit the terminal)."),
    ] = None,
) -> None:
    """Summarize a run: status, config, pace while running, per-step metrics, evaluations and warnings."""
    from qae_app.analysis.settings import checked_settings
    from qae_app.cli.views import show_view
    from qae_app.store.reader import (
        component_table,
        read_component_means,
        read_evals,
        read_preview,
        read_run,
        read_steps,
        read_warnings,
        resolve_run,
    )
    from qae_app.store.schema import STEP_METRICS
    from qae_app.store.signal_reader import read_component_signal

    try:
        chosen = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else None
        unknown = [m for m in chosen or [] if m not in STEP_METRICS]
        if unknown:
            raise QAEUserError(
                f"metrics: {', '.join(unknown)} not a step metric. Choose from: {', '.join(STEP_METRICS)}."
            )
        if every < 0:
            raise QAEUserError(f"every: {every} is negative. Use 0 (about 15 rows) or a positive stride.")
        path = resolve_run(runs_dir, run)
        info = read_run(path)  # everything is read before anything is printed: a damaged file gives one message
        checked_settings(info, path)
        steps, evals, warnings = read_steps(path), read_evals(path), read_warnings(path)
        found = read_preview(path) if info.get("estimator") == "preview" else None
        components = component_table(read_component_means(path))
        signal = read_component_signal(path)
    except QAEUserError as err:
        fail(err)
    out = _view_console()
    out.print(show_view(info, steps, evals, warnings, out.width, chosen, every, components, signal))
    if found is not None:  # a preview: what it found, as `qae preview` printed it
        out.print(preview_command.preview_view(run, found))


def rollouts(
    run: Annotated[str, typer.Argument(help="Run id: its folder under --runs-dir (see `qae runs`).")],
    step: Annotated[int | None, typer.Option(help="Step to show (default: the latest).")] = None,
    gated: Annotated[bool, typer.Option("--gated", help="Only trained responses gated out (advantage 0).")] = False,
    kept: Annotated[bool, typer.Option("--kept", help="Only responses that carried gradient.")] = False,
    filtered: Annotated[
        bool, typer.Option("--filtered", help="Only responses of groups that dynamic sampling left out of the update.")
    ] = False,
    regime: Annotated[str | None, typer.Option(help="Only groups in this regime.")] = None,
    why: Annotated[str | None, typer.Option(help="Only responses gated for this reason.")] = None,
    search: Annotated[str | None, typer.Option(help="Only responses or prompts containing this text.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many responses.")] = 64,
    full: Annotated[
        bool, typer.Option("--full", help="Print prompts and responses whole (wrapped), not cut to one line.")
    ] = False,
    model_prompt: Annotated[
        bool,
        typer.Option(
            "--model-prompt",
            help="Also print each prompt as the model saw it: chat template applied (system message, role markers).",
        ),
    ] = False,
    tokens: Annotated[
        bool,
        typer.Option(
            "--tokens",
            help="Print the shown responses token by token with their "
            "stored numbers (--store-tokens): coloured by --color-by on a colour "
            "terminal, one tab-separated line per token elsewhere.",
        ),
    ] = False,
    color_by: Annotated[
        str,
        typer.Option(
            "--color-by",
            help="With --tokens: the number that colours each token: "
            "logprob, entropy or gap (the trainer's old log-prob minus the "
            "sampler's).",
        ),
    ] = "logprob",
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Show one step's responses: reward, advantage, why each gated one was gated (with the step's breakdown by
    reason), which groups dynamic sampling filtered out of the update, and each group's prompt, answer, baseline and
    regime."""
    from qae_app.cli.console import visible_controls
    from qae_app.cli.token_view import COLOR_SCALES, tokens_lines, tokens_view
    from qae_app.cli.views import rollouts_view
    from qae_app.core.names import GATE_REASONS, REGIMES
    from qae_app.store.reader import read_components, read_model_prompts, read_rollout_steps, read_rollouts, resolve_run
    from qae_app.store.signal_reader import read_token_values

    try:
        if gated + kept + filtered > 1:
            raise QAEUserError(
                "--gated, --kept and --filtered exclude each other. Pass one of them, or none for every response."
            )
        if regime is not None and regime not in REGIMES:
            raise QAEUserError(f"regime: unknown value '{regime}'. Choose one of: {', '.join(REGIMES)}.")
        if why is not None and kept:
            raise QAEUserError("--why selects gated responses, --kept the others. Pass one of them.")
        if why is not None and why not in GATE_REASONS:
            raise QAEUserError(f"why: unknown reason '{why}'. Choose one of: {', '.join(GATE_REASONS)}.")
        if limit < 1:
            raise QAEUserError(f"limit: {limit} shows nothing. Use a positive number of responses.")
        if color_by not in COLOR_SCALES:
            raise QAEUserError(f"color-by: unknown value '{color_by}'. Choose one of: {', '.join(COLOR_SCALES)}.")
        path = resolve_run(runs_dir, run)
        steps = read_rollout_steps(path)  # (a preview's one step has rollouts and no `steps` row)
        if not steps:
            raise QAEUserError(f"run: '{run}' has no steps yet.")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise QAEUserError(f"step: {step} is not a step of '{run}'. Use {steps[0]}..{steps[-1]}.")
        everything = read_rollouts(path, step, with_text=False)  # first: a damaged file gives one message
        frame = read_rollouts(
            path,
            step,
            gated=True if gated or why else False if kept else None,
            regime=regime,
            search=search,
            filtered=True if filtered else False if gated or kept or why else None,
        )
        shown = read_model_prompts(path, step) if model_prompt else None
        components = read_components(path, step)
        stored_tokens = read_token_values(path, step) if tokens else None
    except QAEUserError as err:
        fail(err)
    if why is not None:
        frame = frame[frame["gate_reason"] == why]
    out = _view_console()
    if stored_tokens is not None and out.color_system is not None:
        out.print(tokens_view(run, step, frame, stored_tokens, color_by, limit))
        return
    if stored_tokens is not None:  # a pipe, a file: tab-separated numbers, as they are (rich would expand the tabs)
        for line in tokens_lines(frame, stored_tokens, limit):
            typer.echo(visible_controls(line))
        return
    out.print(rollouts_view(run, step, frame, everything, out.width, limit, full, shown, components))


# ---------------------------------------------------------------------------------------------------------------
# qae compare and qae sweep


def compare(
    runs: Annotated[list[str] | None, typer.Argument(help="Run ids to compare (or --sweep).")] = None,
    sweep: Annotated[str | None, typer.Option(help="Compare every run of this sweep (its id or name).")] = None,
    baseline: Annotated[
        str | None,
        typer.Option(
            help="A group to compare the others with, paired by seed: its label or a value only it has (e.g. grpo)."
        ),
    ] = None,
    group_by: Annotated[
        str | None,
        typer.Option(
            help="Group by these instead (comma list): tags (the runs' "
            "`qae tag` tags, e.g. with --baseline baseline) or config keys "
            "(estimator,k)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON (no tables).")] = False,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Compare runs across seeds: runs with the same config but the seed form a group; per group, the mean over
    seeds of final, best and area-under-curve held-out accuracy, late entropy and its slope, the zero-advantage
    fractions and seconds per step, each with a 95% t-interval; with --baseline, each group's paired difference from
    it (interval and p-value). A grid of policy losses x (grpo, qae), as `qae sweep --policy-loss` makes, is also
    laid out as the paper's Table 2: a row per loss, base, + QAE and their paired difference."""
    from qae_app.analysis.run_comparison import compare_runs, load_runs
    from qae_app.cli.views import compare_view

    try:
        by = [key.strip() for key in group_by.split(",") if key.strip()] if group_by is not None else None
        comparison = compare_runs(load_runs(runs_dir, runs, sweep), baseline, by)
    except QAEUserError as err:
        fail(err)
    if as_json:
        from qae_app.analysis.loss_table import loss_table

        by_loss = loss_table(comparison.groups)
        print(
            json.dumps(
                _finite({**comparison.to_dict(), "by_policy_loss": by_loss and by_loss.to_dict()}),
                indent=2,
                default=str,
            )
        )
        return
    out = _view_console()
    out.print(compare_view(comparison, out.width))


def _finite(value):
    """NaN and infinities as null: JSON has no NaN."""
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sweep_command(
    seeds: Annotated[int, typer.Option(help="Seeds per point, from --seed on (3 or more give intervals).")] = 1,
    name: Annotated[
        str | None,
        typer.Option(help="The sweep's name (prefix of its run ids); default: sweep-<hash of the shared options>."),
    ] = None,
    parallel: Annotated[
        int, typer.Option(help="Runs at a time, each with its share of the cores (at most the number of cores).")
    ] = 1,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="TOML file with train options for every point; command-line options override it."
        ),
    ] = None,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    cpu: Annotated[bool, typer.Option("--cpu/--no-cpu", help="Force CPU even when a GPU is present.")] = False,
    **options: Any,
) -> None:
    """Run a grid of training runs: --policy-loss, --estimator and --k take comma-separated lists (clip,kl_cov;
    qae,grpo; 0.3,0.4,0.5), and each point runs --seeds seeds (a mean baseline ignores K: it is not repeated per K; a
    loss's own options go to its points only). Every point is an ordinary
    run tagged with the sweep (`qae runs --sweep`, `qae compare --sweep`). Re-running the same command resumes:
    finished runs are kept, an interrupted one resumes, the rest start."""
    try:
        plan = _plan_sweep_from_options(runs_dir, seeds, name, parallel, config, options)
    except QAEUserError as err:
        fail(err)
    console.print(
        f"[bold]qae sweep[/] [cyan]{plan.name}[/] (id {plan.sweep_id}): {len(plan.points)} runs, "
        f"{parallel} at a time, in {escape(str(runs_dir))}",
        highlight=False,
    )
    try:
        states = _run_sweep_with_progress(plan, runs_dir, parallel, cpu)
    except QAEUserError as err:
        fail(err)
    _report_sweep(plan, states, runs_dir)
    if "interrupted" in states.values():
        console.print("[yellow]interrupted[/]: re-run the same command to resume the sweep.")
        raise typer.Exit(code=130)
    if {"failed", "busy", "taken"} & set(states.values()):
        raise typer.Exit(code=1)


def _plan_sweep_from_options(runs_dir, seeds: int, name: str | None, parallel: int, config: Path | None, options: dict):
    """The sweep's plan from the command line and --config: its lists (--policy-loss, --estimator, --k) taken out
    of the options every point shares."""
    from qae_app.cli.sweep import check_parallel, plan_sweep
    from qae_app.config import given_options

    check_parallel(parallel)
    given = given_options(config, **options)
    estimators, ks = str(given.pop("estimator", "qae")), given.pop("k", None)
    losses = given.pop("policy_loss", None)
    return plan_sweep(
        runs_dir,
        estimators,
        None if ks is None else str(ks),
        seeds,
        given,
        name,
        None if losses is None else str(losses),
    )


def _run_sweep_with_progress(plan, runs_dir, parallel: int, cpu: bool) -> dict:
    """Run the sweep's points with a bar each on a terminal, a line per state change elsewhere; their end states."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from qae_app.cli.sweep import run_sweep

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
        console=console,
        disable=not console.is_terminal,
    )
    bars = {p.run_name: progress.add_task(p.run_name, total=p.steps, state="") for p in plan.points}
    seen: dict[str, str] = {}

    def on_update(states: dict, steps: dict) -> None:
        for run_name, state in states.items():
            progress.update(bars[run_name], completed=steps.get(run_name) or 0, state=state)
            if not console.is_terminal and seen.get(run_name) != state:  # logs and CI: one line per change
                console.print(f"{run_name}: {state}", highlight=False)
            seen[run_name] = state

    with progress:
        return run_sweep(plan, runs_dir, parallel, cpu, on_update)


def _report_sweep(plan, states: dict, runs_dir) -> None:
    """How many runs ended in each state, the command that compares them, and why each failed or skipped run did."""
    from qae_app.cli.sweep import failure_tail

    counts = {state: sum(1 for s in states.values() if s == state) for state in sorted(set(states.values()))}
    compared = {"done", "kept"} & set(states.values())  # (compare leaves out runs without a step)
    console.print(
        "sweep "
        + ", ".join(f"{n} {state}" for state, n in counts.items())
        + (". Compare them with:" if compared else ""),
        highlight=False,
    )
    if compared:
        print_command(f"qae compare --sweep {plan.name} --runs-dir {runs_dir}")
    for run_name, state in states.items():
        if state == "failed":
            log = plan.folder / f"{run_name}.log"
            console.print(f"[red]failed[/]: {run_name} (log {escape(str(log))}):\n{escape(failure_tail(log))}")
        elif state == "busy":
            console.print(f"[yellow]skipped[/]: {run_name} is being trained by another process.")
        elif state == "taken":
            console.print(
                f"[yellow]skipped[/]: {run_name} was taken by another run (not of this sweep) while the "
                "sweep ran; that run is left alone. Pass another --name to train this point.",
                highlight=False,
            )


def _sweep_options(command):
    """The train options, less those a sweep sets itself for each point (the run id and the sweep tags)."""
    from qae_app.cli.sweep import SWEEP_DEFAULTS

    own = {"run_name", "sweep_id", "sweep_name"}
    command.__signature__ = inspect.Signature(
        [
            p
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.kind != inspect.Parameter.VAR_KEYWORD
        ]
        + [p for p in _option_parameters(TrainConfig, SWEEP_DEFAULTS) if p.name not in own]
    )
    return command


# ---------------------------------------------------------------------------------------------------------------
# qae eval


def eval_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the metrics as JSON (no table).")] = False,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    **options: Any,
) -> None:
    """Evaluate a model: avg@k, pass@k (unbiased) and maj@k on a benchmark; every sample is stored in DuckDB."""
    from qae_app.cli.trained_defaults import eval_config_for
    from qae_app.evaluation.evaluate import run_eval_command

    try:
        cfg, trained, taken = eval_config_for(runs_dir, **options)
        result, target_run, path = run_eval_command(cfg, runs_dir, None if as_json else console, trained, taken)
    except QAEUserError as err:
        fail(err)
    if as_json:
        print(
            json.dumps(
                {
                    "run_id": target_run,
                    "database": str(path),
                    "benchmark": result.benchmark,
                    "samples": result.k,
                    "options": cfg.to_dict(),
                    "metrics": result.metrics,
                },
                indent=2,
            )
        )
        return
    table = Table(
        title=f"{result.benchmark}: {cfg.model}, k={result.k}, temperature {cfg.temperature:g}, top-p {cfg.top_p:g}"
    )
    for column in ("subset", "metric", "k", "value", "problems"):
        table.add_column(column, justify="right")
    for row in result.metrics:
        table.add_row(row["subset"], row["metric"], str(row["k"]), f"{row['value']:.4f}", str(row["n_problems"]))
    console.print(table)
    # a few answers a reader can check by eye, wrong ones first: what was read from the response, and the gold answer
    for sample in sorted(result.samples, key=lambda sample: bool(sample["correct"]))[:3]:
        console.print(
            Text(
                f"problem {sample['problem_id']} sample {sample['sample_idx']}: extracted "
                f"{sample['extracted']!r}, gold {sample['answer']!r}, " + ("correct" if sample["correct"] else "wrong")
            )
        )
    console.print("every sample, with its gold answer: the dashboard's Eval samples page")
    console.print(f"samples and metrics stored in [cyan]{path}[/] (run {target_run})")


def export(
    run: Annotated[str, typer.Argument(help="Run id: its folder under --runs-dir (see `qae runs`).")],
    out: Annotated[Path, typer.Option(help="Folder to write the Hugging Face model to (new or empty).")],
    checkpoint: Annotated[int | None, typer.Option(help="Checkpoint step (default: the newest).")] = None,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Write a run's model as a Hugging Face folder (config, safetensors, tokenizer) for vLLM or the hub."""
    from qae_app.evaluation.evaluate import export_model

    try:
        target = export_model(run, runs_dir, out, checkpoint)
    except QAEUserError as err:
        fail(err)
    for skipped in target.skipped:
        console.print(f"[yellow]warning:[/] {escape(skipped)}", highlight=False)
    console.print(f"run {run} at step {target.step} exported to [cyan]{out}[/]")


def migrate(
    run: Annotated[str, typer.Argument(help="Run id: its folder under --runs-dir (see `qae runs`).")],
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    trust_pickles: Annotated[
        bool,
        typer.Option(
            "--trust-pickles",
            help="Read the Python pickles an older qae left in the run folder (its pending "
            "writes and its checkpoints' training state) to rewrite them as JSON and "
            "safetensors. A pickle can run code: only for a folder you made yourself.",
        ),
    ] = False,
) -> None:
    """Rewrite a run folder an older qae wrote in this version's format (its database, pending writes, checkpoints and
    config), which every other command then reads; a folder already current is left as it is."""
    from qae_app.train.run_migration import migrate_run

    try:
        changes = migrate_run(
            runs_dir, run, trust_pickles, say=lambda line: console.print(escape(line), highlight=False)
        )
    except QAEUserError as err:
        fail(err)
    if not changes:
        console.print(f"run {escape(run)} is in this version's format already: nothing to do")
        return
    for change in changes:
        console.print(f"  {escape(change)}", highlight=False)
    console.print(f"run {escape(run)} is in this version's format now")


# ---------------------------------------------------------------------------------------------------------------
# every command, registered here the one way, in the order `qae --help` lists them: the commands of other modules
# (cli/preview_command.py, cli/manage.py, cli/dashboard_command.py) as those of this one

COMMANDS = {
    "train": _with_config_options(train, TrainConfig),
    "plan": _with_config_options(plan, TrainConfig),
    "preview": _with_config_options(preview_command.preview_command, TrainConfig),
    "warmstart": warmstart,
    "runs": list_runs,
    "tag": manage.tag,
    "note": manage.note,
    "stop": manage.stop,
    "rm": manage.rm,
    "show": show,
    "rollouts": rollouts,
    "compare": compare,
    "sweep": _sweep_options(sweep_command),
    "eval": _with_config_options(eval_command, EvalConfig),
    "export": export,
    "migrate": migrate,
    "dashboard": dashboard_command.dashboard,
}
for name, command in COMMANDS.items():
    app.command(name)(command)


def main() -> None:  # pragma: no cover - the `qae` entry point
    launch.own_process = True
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
