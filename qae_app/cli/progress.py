"""What `qae train` prints while it trains: the banner, and one progress line per step.

On a terminal the line is a `rich` progress bar that redraws in place (step, bar, elapsed time, reward, entropy, gated
fraction, held-out accuracy, steps/min and ETA), fitted to the terminal's width by dropping its least useful fields
first (`DROP_ORDER`): "step N/M" and the ETA stay down to 60 columns and no field is cut. Anywhere else (a log file,
a pipe, a sweep's point log) the same facts are printed as one plain line per step, so `tail -f` shows a live run and a
silent one is a stuck one.
"""

from __future__ import annotations

import itertools
import statistics
import time
from datetime import timedelta

from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task
from rich.table import Column
from rich.text import Text

from qae_app.core.alert_levels import ALERT_KINDS
from qae_app.core.estimators import ESTIMATORS
from qae_app.core.formatting import duration, number

BAR_WIDTH = 20
# the live line's fields, least useful first: dropped in this order while the line is wider than the terminal ("step
# N/M" and the ETA are never dropped; the bar repeats the step count, the pace is in the ETA)
DROP_ORDER = ("bar", "pace", "elapsed", "filtered", "gated", "entropy", "heldout", "reward")
PACE_STEPS = 20  # steps/min is the median pace of the last this many steps (an evaluation's pause does not skew it)


def banner(cfg, run_id: str) -> str:
    """'qae train run r: qae (K=0.4, quantile paper) on arith ...'; K and the quantile only for an estimator that
    reads them (a GRPO run has neither)."""
    estimator = cfg.estimator + (f" (K={cfg.k}, quantile {cfg.quantile})" if ESTIMATORS[cfg.estimator].reads_k else "")
    return (
        f"[bold]qae train[/] run [cyan]{run_id}[/]: {estimator} on {cfg.data} with {cfg.model}, {cfg.steps} "
        f"steps of {cfg.prompts_per_step} prompts x {cfg.group_size} samples"
    )


class StepPace:
    """steps/min and ETA from when this process finished each step (monotonic clock)."""

    def __init__(self, total_steps: int, clock=time.monotonic):
        self.total_steps = total_steps
        self.clock = clock
        self.times: list[tuple[int, float]] = []  # (step, when it finished)

    def record(self, step: int) -> None:
        self.times = [*self.times[-PACE_STEPS:], (step, self.clock())]

    def steps_per_min(self) -> float | None:
        rates = [
            (b_step - a_step) / (b_time - a_time) * 60
            for (a_step, a_time), (b_step, b_time) in itertools.pairwise(self.times)
            if b_time > a_time and b_step > a_step
        ]
        return statistics.median(rates) if rates else None

    def eta_s(self) -> float | None:
        rate = self.steps_per_min()
        if rate is None or not self.times:
            return None
        return max(0, self.total_steps - self.times[-1][0]) / rate * 60


def stat_fields(metrics: dict, heldout: float | None, pace: StepPace, dynamic_sampling: bool = False) -> dict[str, str]:
    """The step's fields in the order printed, each named as in `DROP_ORDER` (and "eta")."""
    rate = pace.steps_per_min()
    fields = {
        "reward": f"reward {number(metrics.get('reward_mean'))}",
        "entropy": f"H {number(metrics.get('entropy'))}",
        "gated": f"gated {number(metrics.get('frac_zero_adv'))}",
        "heldout": f"held-out {number(heldout)}",
    }
    if dynamic_sampling:
        fields["filtered"] = f"filtered {number(metrics.get('frac_filtered'))}"
    return {**fields, "pace": f"· {f'{rate:.3g}' if rate else '-'} steps/min", "eta": f"· ETA {duration(pace.eta_s())}"}


def fit_line(fields: dict[str, Text], width: int) -> Text:
    """The fields joined by spaces, the least useful dropped (`DROP_ORDER`) until the line fits `width` columns."""
    shown = dict(fields)
    for name in DROP_ORDER:
        if sum(text.cell_len for text in shown.values()) + len(shown) - 1 <= width:
            break
        shown.pop(name, None)
    return Text(" ", no_wrap=True, overflow="ellipsis").join(shown.values())


def bar(completed: float, total: float | None) -> Text:
    filled = round(BAR_WIDTH * min(1.0, completed / total)) if total else 0
    done = "bar.finished" if filled == BAR_WIDTH else "bar.complete"
    return Text.assemble(("━" * filled, done), ("━" * (BAR_WIDTH - filled), "bar.back"))


class FittedLine(ProgressColumn):
    """'step 120/300 ━━━━━━━━ 0:03:10 reward 0.531 ... · ETA 28 min', as wide as the console is (`fit_line`): rich's
    columns squeezed each other instead, cutting '300' to '3…' and dropping the step count first."""

    def __init__(self, console: Console):
        super().__init__(table_column=Column(no_wrap=True))
        self.console = console

    def render(self, task: Task) -> Text:
        elapsed = "-:--:--" if task.elapsed is None else str(timedelta(seconds=max(0, int(task.elapsed))))
        fields = {
            "step": Text.assemble(("step", "bold"), f" {int(task.completed)}/{int(task.total or 0)}"),
            "bar": bar(task.completed, task.total),
            "elapsed": Text(elapsed, style="progress.elapsed"),
            **{name: Text(text) for name, text in task.fields["stats"].items()},
        }
        return fit_line(fields, self.console.width)


class TrainProgress:
    """The progress of one `qae train`: `update(step, metrics)` after each step (step 0: the evaluation before
    training). Use as a context manager around the training."""

    def __init__(self, console: Console, total_steps: int, done: int, show: bool, dynamic_sampling: bool = False):
        self.console, self.total_steps, self.show = console, total_steps, show
        self.dynamic_sampling = dynamic_sampling
        self.live = show and console.is_terminal  # redraw in place; else one plain line a step
        self.pace = StepPace(total_steps)
        self.heldout: float | None = None
        self.bar = Progress(FittedLine(console), console=console, disable=not self.live, transient=False)
        self.task = self.bar.add_task("train", total=total_steps, completed=done, stats={})

    def __enter__(self) -> TrainProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def update(self, step: int, metrics: dict, warnings: list[dict] = ()) -> None:
        """After each step: its line (redrawn in place on a terminal), then a line for each alert that fired
        (`warnings`: the step's `warnings` rows; printed above the live bar, which stays the last line)."""
        self._update(step, metrics)
        for row in warnings:
            if row["kind"] in ALERT_KINDS:
                self.console.print(
                    Text.assemble(("warning: ", "yellow"), f"{row['kind']}: {row['message']}"), soft_wrap=True
                )

    def _update(self, step: int, metrics: dict) -> None:
        if metrics.get("heldout_accuracy") is not None:
            self.heldout = metrics["heldout_accuracy"]
        if step == 0:
            stats = {"heldout": f"held-out {number(self.heldout)} before training"}
        else:
            self.pace.record(step)
            stats = stat_fields(metrics, self.heldout, self.pace, self.dynamic_sampling)
        self.bar.update(self.task, completed=step, stats=stats)
        if self.show and not self.live:
            self.console.print(
                f"step {step}/{self.total_steps} {' '.join(stats.values())}", highlight=False, soft_wrap=True
            )


class PreviewProgress:
    """What `qae preview` prints while it samples and scores: a bar of the prompts done and what it is doing (on a
    terminal); elsewhere one plain line per batch. `update(phase, prompts_done)` is evaluation.task_preview's
    on_progress. Use as a context manager around the preview."""

    def __init__(self, console: Console, total_prompts: int):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        self.console, self.total = console, total_prompts
        self.bar = Progress(
            TextColumn("[bold]preview[/] {task.description}"),
            BarColumn(bar_width=BAR_WIDTH),
            MofNCompleteColumn(),
            TextColumn("prompts"),
            TimeElapsedColumn(),
            console=console,
            disable=not console.is_terminal,
            transient=True,
        )
        self.task = self.bar.add_task("loading", total=total_prompts)

    def __enter__(self) -> PreviewProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def update(self, phase: str, prompts_done: int) -> None:
        self.bar.update(self.task, completed=prompts_done, description=phase)
        if not self.console.is_terminal:
            self.console.print(f"preview: {phase} ({prompts_done}/{self.total} prompts done)", highlight=False)
