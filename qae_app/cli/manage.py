"""Managing runs: `qae tag`, `qae note` (labels kept beside the run's database, so they change while it trains),
`qae stop` (a live run, as Ctrl-C stops it) and `qae rm`. Registered on the `qae` app by cli/main.py."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from qae_app.cli.console import console, fail
from qae_app.cli.options import DEFAULT_RUNS_DIR, RunsDir
from qae_app.core.errors import QAEUserError


def _change_labels(run: str, runs_dir, change):
    """Read the run's labels, apply `change` (which checks its input), write them back; one message on bad input."""
    from qae_app.store.labels import labels_to_change, write_labels
    from qae_app.store.reader import resolve_run

    try:
        folder = resolve_run(runs_dir, run).parent
        labels = labels_to_change(folder)
        change(labels)
        write_labels(folder, labels)
    except QAEUserError as err:
        fail(err)
    return labels


def tag(
    run: Annotated[str, typer.Argument(help="Run id (see `qae runs`).")],
    tags: Annotated[list[str], typer.Argument(help="Tags to add (letters, digits, '.', '_', '-').")],
    remove: Annotated[bool, typer.Option("--remove", help="Remove these tags instead.")] = False,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Tag a run (e.g. baseline, lr-too-high): shown by `qae runs` and `qae show`, filtered by `qae runs --tag`.
    Works while the run trains: tags live beside its database, not in it."""
    from qae_app.store.labels import check_tag

    def change(labels) -> None:
        given = [check_tag(t) for t in tags]
        labels.tags = (
            [t for t in labels.tags if t not in given]
            if remove
            else labels.tags + [t for t in dict.fromkeys(given) if t not in labels.tags]
        )

    labels = _change_labels(run, runs_dir, change)
    console.print(f"run {escape(run)}: tags {escape(', '.join(labels.tags)) or '(none)'}", highlight=False)


def note(
    run: Annotated[str, typer.Argument(help="Run id (see `qae runs`).")],
    text: Annotated[str, typer.Argument(help='The note; "" clears it.')],
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Write a run's note ("lr too high", "the paper's baseline"), shown by `qae runs` and `qae show`. Works while
    the run trains."""
    from qae_app.store.labels import check_note

    def change(labels) -> None:
        labels.note = check_note(text)

    _change_labels(run, runs_dir, change)
    console.print(f"run {escape(run)}: note {'cleared' if not text else 'saved'}", highlight=False)


def stop(
    run: Annotated[str | None, typer.Argument(help="Run id (see `qae runs`), or --sweep.")] = None,
    sweep: Annotated[
        str | None,
        typer.Option(
            help="Stop this sweep (its id or name): its `qae sweep` process and every run of it training now."
        ),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for its checkpoint.")] = 600.0,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Stop a live run as Ctrl-C does: after its current step, with a checkpoint; it resumes with --resume. Only the
    process the kernel says holds the run's lock is signalled (every rank of a launch stops with it)."""
    from qae_app.store.reader import read_last_step, read_run, resolve_run
    from qae_app.store.stop import stop_run

    if sweep is not None:
        _stop_sweep(sweep, runs_dir, timeout)
    if run is None:
        if sweep is None:
            fail(QAEUserError("run: name the run to stop (see `qae runs`), or --sweep NAME for a sweep."))
        return

    def signalled() -> None:  # (said once the trainer was found: a run nobody trains is only said to be so)
        console.print(
            f"stopping run {escape(run)} after its current step (its checkpoint is written on the way out)...",
            highlight=False,
        )

    try:
        path = resolve_run(runs_dir, run)
        if not stop_run(path.parent, timeout, on_signalled=signalled):
            raise QAEUserError(
                f"stop: run '{run}' is still running after {timeout:g} s (a long step, or a large "
                "checkpoint). It will stop on its own; check with `qae runs`."
            )
        status, step = read_run(path).get("status"), read_last_step(path)
    except QAEUserError as err:
        fail(err)
    console.print(
        f"run {escape(run)} {status} at step {step}. Continue it with: qae train --resume {escape(run)} "
        f"--runs-dir {escape(str(runs_dir))}",
        highlight=False,
        soft_wrap=True,
    )


def _stop_sweep(sweep: str, runs_dir, timeout: float) -> None:
    """`qae stop --sweep`: the sweep's `qae sweep` processes and live runs stopped, each stopped run said."""
    from qae_app.analysis.run_comparison import in_sweep
    from qae_app.cli.sweep import SWEEPS_DIR
    from qae_app.store.reader import DB_FILE, read_last_step, read_run, run_summaries, stored_config
    from qae_app.store.stop import stop_sweep

    try:
        configs = {row["run_id"]: stored_config(row) for row in run_summaries(runs_dir)}
        runs = [run_id for run_id, config in configs.items() if in_sweep(config, sweep)]
        names = {sweep, *(configs[run_id].get("sweep_name") for run_id in runs)} - {None}
        folders = [runs_dir / SWEEPS_DIR / str(name) for name in sorted(names)]
        folders = [folder for folder in folders if folder.is_dir()]
        if not runs and not folders:
            raise QAEUserError(f"sweep: no run of sweep '{sweep}' in {runs_dir}. Nothing was signalled.")
        stopped = stop_sweep(
            sweep,
            folders,
            [runs_dir / run_id for run_id in runs],
            timeout,
            on_signalled=lambda: console.print(
                f"stopping sweep {escape(sweep)}: each run after its current step...", highlight=False
            ),
        )
    except QAEUserError as err:
        fail(err)
    for folder in stopped:
        db = folder / DB_FILE
        console.print(
            f"run {escape(folder.name)} {read_run(db).get('status')} at step {read_last_step(db)}",
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        f"sweep {escape(sweep)} stopped. Continue it by re-running its `qae sweep` command (finished runs "
        "are kept, interrupted ones resume).",
        highlight=False,
        soft_wrap=True,
    )


def rm(
    runs: Annotated[list[str] | None, typer.Argument(help="Run ids to delete (or --sweep).")] = None,
    sweep: Annotated[str | None, typer.Option(help="Delete every run of this sweep (its id or name).")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Delete without asking.")] = False,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
) -> None:
    """Delete runs: their folders, database, checkpoints and all. A run being trained is refused (stop it first)."""
    from qae_app.store.removal import folders_to_remove, remove_run_folder

    try:
        if sweep is not None:
            from qae_app.analysis.run_comparison import in_sweep
            from qae_app.store.reader import run_summaries, stored_config

            of_sweep = [row["run_id"] for row in run_summaries(runs_dir) if in_sweep(stored_config(row), sweep)]
            if not of_sweep:  # (whatever else is named: a sweep that is not there is a mistake, as `qae stop` says)
                raise QAEUserError(f"sweep: no run of sweep '{sweep}' in {runs_dir}. Nothing was deleted.")
            runs = [*(runs or []), *of_sweep]
        folders = folders_to_remove(runs_dir, runs or [])
    except QAEUserError as err:
        fail(err)
    names_text = ", ".join(
        folder.name + (" (a link: only the link is removed)" if folder.is_symlink() else "") for folder in folders
    )
    if not yes and not typer.confirm(f"Delete {len(folders)} run(s) from {runs_dir}: {names_text}?", default=False):
        console.print("nothing deleted")  # the user's "no" is an answer, not a failure
        raise typer.Exit(code=0)
    for folder in folders:
        try:
            target = remove_run_folder(folder)
        except QAEUserError as err:
            fail(err)
        if target is not None:
            console.print(
                f"{escape(folder.name)} was a link to {escape(target)}: the link is removed, the folder it "
                "points at is kept (delete it yourself if you mean to)",
                highlight=False,
                soft_wrap=True,
            )
    console.print(
        f"deleted {len(folders)} run(s): {escape(', '.join(folder.name for folder in folders))}", highlight=False
    )
