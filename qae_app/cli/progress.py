"""What `qae train` prints while it trains: the banner, and one progress line per step.

On a terminal the line is a `rich` progress bar that redraws in place (step, reward, entropy, gated fraction, held-out
accuracy, steps/min and ETA); anywhere else (a log file, a pipe, a sweep's point log) the same facts are printed as
one plain line per step, so `tail -f` shows a live run and a silent one is a stuck one.
"""

from __future__ import annotations

import statistics
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qae_app.core import names
from qae_app.core.formatting import duration, number

PACE_STEPS = 20  # steps/min is the median pace of the last this many steps (an evaluation's pause does not skew it)


def banner(cfg, run_id: str) -> str:
    """'qae train run r: qae (K=0.4, quantile paper) on arith ...'; K and the quantile only for an estimator that
    reads them (a GRPO run has neither)."""
    estimator = cfg.estimator + (f" (K={cfg.k}, quantile {cfg.quantile})" if names.uses_k(cfg.estimator) else "")
    return (f"[bold]qae train[/] run [cyan]{run_id}[/]: {estimator} on {cfg.data} with {cfg.model}, {cfg.steps} "
            f"steps of {cfg.prompts_per_step} prompts x {cfg.group_size} samples")


class StepPace:
    """steps/min and ETA from when this process finished each step (monotonic clock)."""

    def __init__(self, total_steps: int, clock=time.monotonic):
        self.total_steps = total_steps
        self.clock = clock
        self.times: list[tuple[int, float]] = []  # (step, when it finished)

    def record(self, step: int) -> None:
        self.times = [*self.times[-PACE_STEPS:], (step, self.clock())]

    def steps_per_min(self) -> float | None:
        rates = [(b_step - a_step) / (b_time - a_time) * 60 for (a_step, a_time), (b_step, b_time)
                 in zip(self.times, self.times[1:]) if b_time > a_time and b_step > a_step]
        return statistics.median(rates) if rates else None

    def eta_s(self) -> float | None:
        rate = self.steps_per_min()
        if rate is None or not self.times:
            return None
        return max(0, self.total_steps - self.times[-1][0]) / rate * 60


def step_stats(metrics: dict, heldout: float | None, pace: StepPace, dynamic_sampling: bool = False) -> str:
    """'reward 0.531 H 0.412 gated 0.62 held-out 0.410 · 3.1 steps/min · ETA 28 min'."""
    rate = pace.steps_per_min()
    text = (f"reward {number(metrics.get('reward_mean'))} H {number(metrics.get('entropy'))} "
            f"gated {number(metrics.get('frac_zero_adv'))} held-out {number(heldout)}")
    if dynamic_sampling:
        text += f" filtered {number(metrics.get('frac_filtered'))}"
    return text + f" · {f'{rate:.3g}' if rate else '-'} steps/min · ETA {duration(pace.eta_s())}"


class TrainProgress:
    """The progress of one `qae train`: `update(step, metrics)` after each step (step 0: the evaluation before
    training). Use as a context manager around the training."""

    def __init__(self, console: Console, total_steps: int, done: int, show: bool, dynamic_sampling: bool = False):
        self.console, self.total_steps, self.show = console, total_steps, show
        self.dynamic_sampling = dynamic_sampling
        self.live = show and console.is_terminal  # redraw in place; else one plain line a step
        self.pace = StepPace(total_steps)
        self.heldout: float | None = None
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(bar_width=20),
                            TimeElapsedColumn(), TextColumn("{task.fields[stats]}"), console=console,
                            disable=not self.live, transient=False)
        self.task = self.bar.add_task("train", total=total_steps, completed=done, stats="")

    def __enter__(self) -> "TrainProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def update(self, step: int, metrics: dict) -> None:
        if metrics.get("heldout_accuracy") is not None:
            self.heldout = metrics["heldout_accuracy"]
        if step == 0:
            stats = f"held-out {number(self.heldout)} before training"
        else:
            self.pace.record(step)
            stats = step_stats(metrics, self.heldout, self.pace, self.dynamic_sampling)
        self.bar.update(self.task, completed=step, stats=stats)
        if self.show and not self.live:
            self.console.print(f"step {step}/{self.total_steps} {stats}", highlight=False, soft_wrap=True)
