"""What `qae runs`, `qae show` and `qae rollouts` print: rich renderables laid out for the console's width.

Designed for 80 columns and better with more:
- a number is never elided: numeric columns never wrap, and the columns that fit are chosen in order of importance;
  the ones left out are named under the table (with how to see them);
- a run id always shows the part that tells it apart: a prefix every listed id shares is written once, above the
  table, and an id that is still too long wraps instead of being cut;
- metric headers are the stored names (`heldout_accuracy`), broken at their underscores to stay narrow;
- text from runs (prompts, responses, messages) is never read as rich markup, and is cut with '…' only where it is
  prose, never where it is a number or an id.

Torch-free: `qae runs` and `qae show` start in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich import box
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from qae_app.analysis.differences import Differences, option_text, options_text, what_differs
from qae_app.core.formatting import as_float, estimator_label, missing, number, pace_line, run_pace, setup_label
from qae_app.core.names import GATE_REASONS
from qae_app.core.policy_losses import DEFAULT_POLICY_LOSS
from qae_app.store.reader import BUSY, NOT_A_RUN, READ_STATUSES, UNREADABLE, stored_config
from qae_app.store.run_folder import RESULTS_ONLY_KINDS, RUN_NAME_PATTERN, STOPPED
from qae_app.store.schema import STEP_METRICS
from qae_app.store.signal import signal_sentence
from qae_app.store.signal_reader import signal_table

if TYPE_CHECKING:  # `qae runs` draws from dicts and never imports pandas
    import pandas as pd

GAP = 2  # characters between two columns (SIMPLE_HEAD box, collapsed padding)
STATUS_STYLES = {
    "finished": "green",
    "running": "cyan",
    "failed": "red",
    "interrupted": "yellow",
    UNREADABLE: "bold red",
    BUSY: "yellow",
    STOPPED: "magenta",
    NOT_A_RUN: "dim",
}
ID_SEPARATORS = "-_."
MIN_ID_WIDTH = 24  # optional columns give way before a run id gets narrower than this (default ids: 19-23)
# `qae show`: the steps columns in order of importance (all of STEP_METRICS, the first ones kept at 80 columns)
SHOW_METRICS = [
    "reward_mean",
    "accuracy",
    "heldout_accuracy",
    "entropy",
    "frac_zero_adv",
    "frac_hard",
    "frac_easy",
    "cov_logp_adv",
    "kl",
    "clip_frac",
    "response_len",
    "step_s",
    "sync_s",
]


def metric_header(name: str) -> str:
    """'heldout_accuracy' -> 'heldout_\\naccuracy': the stored name, in lines no wider than its longest part."""
    return name.replace("_", "_\n")


def status_text(status: str) -> Text:
    return Text(str(status), style=STATUS_STYLES.get(str(status), "red"))


# ---------------------------------------------------------------------------------------------------------------
# fitting columns to the width


@dataclass(eq=False)  # a column is compared by identity: fit() asks which were chosen, not which hold equal cells
class Column:
    header: str
    cells: list  # str, Text or RunCell, one per row
    justify: str = "left"
    priority: int = 0  # 0: always shown; higher: dropped first when the table is too wide
    flexible: bool = False  # takes the room left (wraps or is cut instead of being dropped)
    overflow: str = "fold"  # for a flexible column: 'fold' (wrap anywhere) or 'ellipsis' (prose)
    min_width: int = MIN_ID_WIDTH  # for a flexible column: optional columns give way before it gets narrower
    name: str = ""  # what the note about dropped columns calls it
    style: str | None = None

    def width(self) -> int:
        header = max((len(line) for line in self.header.split("\n")), default=0)
        lines = (cell.plain if isinstance(cell, (Text, RunCell)) else str(cell) for cell in self.cells)
        return max([header, *(len(line) for text in lines for line in text.split("\n"))])


@dataclass
class Fitted:
    table: Table
    dropped: list[str] = field(default_factory=list)


def fit(columns: list[Column], width: int, title: str | None = None) -> Fitted:
    """A table of the columns that fit in `width`: every priority-0 column, then the others by priority (lower
    first) until one does not fit (the flexible column keeping at least its min_width, or its natural width if
    smaller)."""
    flexible = next((c for c in columns if c.flexible), None)
    widths = {c: c.width() for c in columns}  # measured once: a column of a long run has thousands of cells

    def total(chosen: list[Column]) -> int:
        fixed = sum(widths[c] for c in chosen if c is not flexible)
        return fixed + GAP * (len(chosen) - 1)

    def room_for_flexible(chosen: list[Column]) -> int:
        return width - total(chosen) - (GAP if flexible is not None else 0)

    chosen = [c for c in columns if c.priority == 0]
    for candidate in sorted((c for c in columns if c.priority > 0), key=lambda c: c.priority):
        trial = [c for c in columns if c in chosen or c is candidate]
        if flexible is not None:
            need = min(widths[flexible], flexible.min_width)
            fits = room_for_flexible([c for c in trial if c is not flexible]) >= need
        else:
            fits = total(trial) <= width
        if not fits:
            break  # in order of importance: a less important column never takes the place of a more important one
        chosen = trial
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        title=title,
        title_justify="left",
        title_style="bold",
    )
    for column in chosen:
        if column is flexible:
            room = max(room_for_flexible([c for c in chosen if c is not flexible]), 1)
            table.add_column(
                column.header,
                justify=column.justify,
                overflow=column.overflow,
                no_wrap=column.overflow == "ellipsis",
                max_width=room,
                style=column.style,
            )
        else:
            table.add_column(
                column.header, justify=column.justify, no_wrap=True, min_width=widths[column], style=column.style
            )
    for row in zip(*(c.cells for c in chosen), strict=True) if chosen and chosen[0].cells else []:
        table.add_row(*[cell if isinstance(cell, (Text, RunCell)) else Text(str(cell)) for cell in row])
    return Fitted(table, [c.name or c.header.replace("\n", "") for c in columns if c not in chosen])


def dropped_note(dropped: list[str], width: int, how: str) -> Text | None:
    if not dropped:
        return None
    return Text(f"not shown at {width} columns: {', '.join(dropped)} ({how})", style="dim")


def shared_prefix(ids: list[str]) -> str:
    """The longest prefix all `ids` share that ends at a separator (-, _ or .) and leaves every id something."""
    if len(ids) < 2:
        return ""
    prefix = ids[0]
    for other in ids[1:]:
        while not other.startswith(prefix):
            prefix = prefix[:-1]
    cut = max(prefix.rfind(sep) for sep in ID_SEPARATORS) + 1
    prefix = prefix[:cut]
    return prefix if all(len(i) > len(prefix) for i in ids) else ""


# ---------------------------------------------------------------------------------------------------------------
# qae runs


def runs_view(rows: list[dict], runs_dir: str, width: int) -> RenderableType:
    """The runs table (rows: run_summaries): run, status, estimator and K, progress and the latest metrics;
    model, task and creation time when there is room. Under each run id, the options that tell it apart from the
    others listed (`analysis.differences`); above the table, the options they all share that are not the defaults.
    Under it: what `stopped` means and why a run is unreadable."""
    ids = [str(row["run_id"]) for row in rows]
    readable = [row.get("status") not in READ_STATUSES for row in rows]
    # with 0/1 rewards the mean reward is the accuracy: one column says both, and leaves room for entropy
    same = all(
        number(row.get("reward_mean")) == number(row.get("accuracy"))
        for row, ok in zip(rows, readable, strict=True)
        if ok
    )

    # the run ids lose the prefix they all share when the run column cannot show them whole
    fitted, prefix = fit(_runs_columns(rows, readable, same), width), ""
    longest = max((len(i) for i in ids), default=0)
    run_width = next(c.max_width for c in fitted.table.columns if c.header == "run")
    if run_width is not None and run_width < longest:
        prefix = shared_prefix(ids)
    fitted, apart = _fitted_apart(rows, readable, same, prefix, width)
    parts: list[RenderableType] = [Text(f"{len(rows)} run(s) in {runs_dir}", style="bold")]
    if prefix:
        parts.append(Text(f"every run id below starts with {prefix}", style="dim"))
    if apart.shared:
        parts.append(Text(f"every run below: {options_text(apart.shared)} (not the defaults)", style="dim"))
    parts.append(fitted.table)
    if note := dropped_note(fitted.dropped, width, "widen the terminal, or `qae show RUN`"):
        parts.append(note)
    return Group(*parts, *_runs_notes(rows, readable, same))


@dataclass
class RunCell:
    """A run id and under it, indented and wrapped between options, what tells the run apart."""

    run_id: str
    options: str

    @property
    def plain(self) -> str:
        return f"{self.run_id}\n{OPTIONS_INDENT}{self.options}"

    def __rich__(self) -> RenderableType:
        return Group(Text(self.run_id), Padding(Text(self.options, style="dim"), (0, 0, 0, len(OPTIONS_INDENT))))


# the runs table's columns that show options: what differs leaves those out while they are shown
OPTIONS_INDENT = "  "  # the line under a run id that says what tells it apart
OPTIONS_IN_COLUMNS = {"estimator": ("estimator", "k"), "steps": ("steps",), "model": ("model",), "task": ("data",)}


def _fitted_apart(
    rows: list[dict], readable: list[bool], same: bool, prefix: str, width: int
) -> tuple[Fitted, Differences]:
    """The runs table with what tells each run apart under its id. Which columns fit decides what the ids' lines
    leave out (what a shown column says), and those lines which columns fit: settled in a few rounds (each round can
    only drop columns)."""
    configs = [
        _config(row) if ok and row.get("estimator") not in RESULTS_ONLY_KINDS else None
        for row, ok in zip(rows, readable, strict=True)
    ]
    dropped: list[str] | None = None
    while True:
        shown = [name for name in OPTIONS_IN_COLUMNS if dropped is None or name not in dropped]
        apart = what_differs(configs, leave_out=[key for name in shown for key in OPTIONS_IN_COLUMNS[name]])
        fitted = fit(_runs_columns(rows, readable, same, prefix, whole_ids=True, apart=apart.per_run), width)
        if fitted.dropped == dropped:
            return fitted, apart
        dropped = fitted.dropped


def _runs_columns(
    rows: list[dict],
    readable: list[bool],
    same: bool,
    prefix: str = "",
    whole_ids: bool = False,
    apart: list[list] | None = None,
) -> list[Column]:
    """The columns of the runs table, the run ids without `prefix`; an unreadable run shows its id and status only.
    `same`: reward_mean is the accuracy in every run (one column says both). `whole_ids`: optional columns give way
    before an id of up to 40 characters is cut. `apart`: each run's options that tell it apart, under its id."""
    configs = [_config(row) for row in rows]
    return [
        _run_id_column(rows, prefix, whole_ids, apart),
        Column("status", [status_text(row["status"]) for row in rows]),
        Column(
            "estimator", [_estimator(row) if ok else "" for row, ok in zip(rows, readable, strict=True)], priority=1
        ),
        Column(
            "steps",
            [_progress(row, config) if ok else "" for row, config, ok in zip(rows, configs, readable, strict=True)],
            justify="right",
        ),
        *_metric_columns(rows, readable, same),
        # (`qae tag`: only when a run has some; words of any length, so after the numbers, which never give way to it)
        *(
            [Column("tags", [str(row.get("tags") or "") for row in rows], priority=5, name="tags")]
            if any(row.get("tags") for row in rows)
            else []
        ),
        Column(
            "model",
            [str(row.get("model") or "") if ok else "" for row, ok in zip(rows, readable, strict=True)],
            priority=6,
        ),
        Column(
            "task",
            [str(row.get("task") or "") if ok else "" for row, ok in zip(rows, readable, strict=True)],
            priority=7,
        ),
        Column("created (UTC)", [_time(row.get("created_at")) for row in rows], priority=8, name="created"),
    ]


def _run_id_column(rows: list[dict], prefix: str, whole_ids: bool, apart: list[list] | None) -> Column:
    """The run ids without `prefix`, each with the options that tell it apart under it."""
    shown_ids = [str(row["run_id"])[len(prefix) :] for row in rows]
    apart = apart or [[] for _ in rows]
    run_cells = [
        RunCell(run_id, options_text(options)) if options else Text(run_id)
        for run_id, options in zip(shown_ids, apart, strict=True)
    ]
    # (an option wraps between options, never inside one, while the id's room allows)
    longest = max(
        [
            *map(len, shown_ids),
            *(len(OPTIONS_INDENT + option_text(*option)) + 1 for options in apart for option in options),
        ],
        default=0,
    )
    return Column(
        "run",
        run_cells,
        flexible=True,
        name="run",
        min_width=max(MIN_ID_WIDTH, min(40, longest)) if whole_ids else MIN_ID_WIDTH,
    )


def _metric_columns(rows: list[dict], readable: list[bool], same: bool) -> list[Column]:
    """reward_mean, accuracy (unless `same`: reward_mean is the accuracy), held-out accuracy and entropy; blank for
    an unreadable run."""

    def metric(key: str, priority: int) -> Column:
        return Column(
            metric_header(key),
            [number(row.get(key)) if ok else "" for row, ok in zip(rows, readable, strict=True)],
            justify="right",
            priority=priority,
            name=key,
        )

    return [
        metric("reward_mean", 2),
        *([] if same else [metric("accuracy", 2)]),
        metric("heldout_accuracy", 3),
        metric("entropy", 4),
    ]


def _runs_notes(rows: list[dict], readable: list[bool], same: bool) -> list[Text]:
    """The notes under the runs table: that reward_mean is the accuracy (`same`), what `stopped` means, why a run
    is unreadable, which run ids `qae train --resume` cannot take, and each run's `qae note`."""
    notes = []
    if same and any(readable):
        notes.append(Text("reward_mean is also the accuracy here (0/1 rewards: the same in every run)", style="dim"))
    if any(row["status"] == STOPPED for row in rows):
        notes.append(
            Text(
                "stopped: stored as running, but no trainer holds the run (killed by kill -9, OOM or a power "
                "loss). Continue it with `qae train --resume RUN`.",
                style="dim",
            )
        )
    for row in rows:
        if row["status"] in READ_STATUSES:
            notes.append(
                Text.assemble(
                    (f"{row['status']}: ", STATUS_STYLES[row["status"]]), (f"{row['run_id']}: {row.get('error')}", "")
                )
            )
        elif not RUN_NAME_PATTERN.match(str(row["run_id"])):
            notes.append(
                Text(
                    f"{row['run_id']}: read as a run, but not a plain name, so `qae train --resume` cannot "
                    f"continue it: rename it (mv '{row['run_id']}' {plain_name(str(row['run_id']))}).",
                    style="dim",
                )
            )
    notes.extend(_note_line(row) for row in rows if row.get("note"))
    return notes


NOTE_LINE_CHARS = 120  # a `qae note` in the runs listing; `qae show RUN` prints it whole


def _note_line(row: dict) -> Text:
    """A run's `qae note` on one line under the runs table, cut after NOTE_LINE_CHARS characters."""
    text = " ".join(str(row["note"]).split())
    if len(text) > NOTE_LINE_CHARS:
        text = f"{text[:NOTE_LINE_CHARS]}… ({len(text):,} characters; qae show {row['run_id']})"
    return Text.assemble(("note ", "bold"), f"{row['run_id']}: {text}")


def plain_name(name: str) -> str:
    """A plain run name close to `name`: 'a (copy)' -> 'a-copy'."""
    return "-".join(re.findall(r"[A-Za-z0-9._]+", name)).strip("._-")[:100] or "run"


# ---------------------------------------------------------------------------------------------------------------
# qae show


def show_view(
    info: dict,
    steps: pd.DataFrame,
    evals: pd.DataFrame,
    warnings: pd.DataFrame,
    width: int,
    metrics: list[str] | None = None,
    every: int = 0,
    components: pd.DataFrame | None = None,
    signal: pd.DataFrame | None = None,
) -> RenderableType:
    """A run: its id and status, what it trains, its pace while running, its config, every N-th step's metrics (the
    most important ones that fit, or `metrics`), each reward component's mean on the same steps (`components`:
    reader.component_table, a run given --reward) and its share of the advantage (`signal`: signal_reader's
    component_signal rows), its evaluations and its warnings."""
    config = _config(info)
    parts: list[RenderableType] = [
        Text.assemble((str(info["run_id"]), "bold"), "  ", status_text(info["status"])),
        Text(
            f"{_estimator(info)}{_policy_loss(info, config)} · model {info.get('model')} · task {info.get('task')} · "
            f"seed {info.get('seed')} · {_progress(info, config)} steps"
        ),
    ]
    parts += _run_state_lines(info, steps, config)
    parts += _config_lines(config)
    if not steps.empty:
        parts += _steps_table(steps, width, metrics, every)
    if components is not None and len(components.columns) > 1 and not steps.empty:
        parts += _components_table(steps, components, width, every)
    if signal is not None and not signal.empty and not steps.empty:
        parts += _signal_lines(steps, signal, config, width, every)
    if not evals.empty:
        parts += _evals_table(evals, width)
    for row in warnings.to_dict("records"):
        parts.append(Text.assemble((f"step {row['step']} {row['kind']}: ", "yellow"), str(row["message"])))
    return Group(*parts)


def _signal_lines(
    steps: pd.DataFrame, signal: pd.DataFrame, config: dict, width: int, every: int
) -> list[RenderableType]:
    """Each reward component's share of the advantage on the shown steps, and the last step's in a sentence."""
    parts = _components_table(
        steps,
        signal_table(signal),
        width,
        every,
        "which reward carries the signal (its share of the step's advantage)",
        "signal:",
    )
    last = signal[signal["step"] == signal["step"].max()].to_dict("records")
    if said := signal_sentence(
        [{**row, "adv_share": as_float(row["adv_share"])} for row in last], config.get("primary_reward")
    ):
        parts.append(Text(f"step {int(last[0]['step'])}: {said}"))
    return parts


def _run_state_lines(info: dict, steps: pd.DataFrame, config: dict) -> list[RenderableType]:
    """How the run was launched, its tags and note, whether it was copied, its pace or why it stopped, the writes
    still pending and its error."""
    parts: list[RenderableType] = []
    launched = setup_label(config.get("distributed"))
    if launched:
        parts.append(Text(f"ran as {launched}"))
    if info.get("tags"):  # `qae tag`, `qae note`
        parts.append(Text.assemble(("tags ", "bold"), str(info["tags"])))
    if info.get("note"):
        parts.append(Text.assemble(("note ", "bold"), str(info["note"])))
    stored = info.get("stored_run_id")
    if stored and stored != info["run_id"]:
        parts.append(Text(f"copied or renamed: the database names it {stored}", style="dim"))
    if info["status"] == "running":
        parts.append(Text(pace_line(run_pace(steps, config.get("steps")))))
    elif info["status"] == STOPPED:
        parts.append(
            Text(
                "stopped: no trainer holds this run (it was killed). Continue it with "
                f"`qae train --resume {info['run_id']}`.",
                style="magenta",
            )
        )
    pending = info.get("pending_writes") or 0
    if pending:  # rows saved by the trainer that the database does not have yet (see the README's store section)
        who = (
            "the trainer writes them within seconds"
            if info["status"] == "running"
            else f"`qae train --resume {info['run_id']}` writes them"
        )
        parts.append(Text(f"{pending} writes saved under pending/ are not in the database yet: {who}.", style="yellow"))
    if info.get("error"):
        parts.append(Text.assemble(("error: ", "red"), str(info["error"])))
    return parts


def _config_lines(config: dict) -> list[RenderableType]:
    """The run's config, and the file and hash of each user reward it ran."""
    parts: list[RenderableType] = []
    if config:
        parts.append(Text("config", style="bold"))
        parts.append(
            Columns(
                [
                    Text(f"{key} = {json.dumps(value)}")
                    for key, value in config.items()
                    if key not in ("distributed", "reward_files")
                ],
                padding=(0, 3),
                column_first=True,
                equal=True,
            )
        )
    for spec, entry in (config.get("reward_files") or {}).items():  # the code a user reward ran, by its content
        parts.append(
            Text(
                f"reward {spec}: {entry.get('path')} sha256 {str(entry.get('sha256'))[:16]}"
                + (
                    f" (changed during the run: {len(entry['earlier'])} earlier version(s))"
                    if entry.get("earlier")
                    else ""
                ),
                style="dim",
            )
        )
    return parts


SHOWN_STEPS = 15  # about this many rows of steps unless --every says otherwise


def picked_steps(steps: pd.DataFrame, every: int) -> tuple[list[int], str]:
    """The row positions `qae show` prints and the table's title: every n-th step, and the first and last. Without
    --every, in a run with held-out evaluations, n is a divisor or a multiple of the evaluation interval, so held-out
    accuracy is in the table (a stride of 2 from step 1 showed steps 1, 3, 5, ... and never step 10)."""
    numbers = [int(step) for step in steps["step"]]
    last = len(steps) - 1
    evaluated = (
        []
        if every or "heldout_accuracy" not in steps
        else [step for step, value in zip(numbers, steps["heldout_accuracy"], strict=True) if not missing(value)]
    )
    interval = math.gcd(*evaluated) if evaluated else 0
    if interval > 1:
        fitting = [d for d in range(1, interval + 1) if interval % d == 0 and len(steps) / d <= SHOWN_STEPS]
        stride = fitting[0] if fitting else interval * math.ceil(len(steps) / (SHOWN_STEPS * interval))
        picked = sorted({0, last, *(i for i, step in enumerate(numbers) if step % stride == 0)})
        return picked, f"steps (every {stride}, held-out evaluations among them; the first and the last)"
    stride = every or max(1, len(steps) // SHOWN_STEPS)
    picked = list(range(0, len(steps), stride))
    appended = picked[-1] != last
    if appended:
        picked.append(last)  # always the last step
    return picked, f"steps (every {stride}{', and the last' if appended else ''})" if stride > 1 else "steps"


def _steps_table(steps: pd.DataFrame, width: int, metrics: list[str] | None, every: int) -> list[RenderableType]:
    picked, title = picked_steps(steps, every)
    shown = steps.iloc[picked]
    names = metrics or SHOW_METRICS + [m for m in STEP_METRICS if m not in SHOW_METRICS]
    # a metric this run never recorded (dH without --log-entropy-delta) takes no column unless asked for
    empty = [] if metrics else [name for name in names if name in steps and steps[name].isna().all()]
    columns = [Column("step", [str(int(s)) for s in shown["step"]], justify="right")]
    for rank, name in enumerate(names, start=1):
        if name not in shown or name in empty:
            continue
        columns.append(
            Column(
                metric_header(name),
                [number(v) for v in shown[name]],
                justify="right",
                priority=0 if metrics else rank,
                name=name,
            )
        )
    fitted = fit(columns, width)
    parts: list[RenderableType] = [Text(title, style="bold"), fitted.table]
    if note := dropped_note(fitted.dropped, width, "widen the terminal or pick with --metrics"):
        parts.append(note)
    if empty:
        parts.append(Text(f"no values in this run: {empty_metrics_note(empty)}", style="dim"))
    return parts


def _components_table(
    steps: pd.DataFrame,
    components: pd.DataFrame,
    width: int,
    every: int,
    title: str = "reward components (mean per step)",
    prefix: str = "reward:",
) -> list[RenderableType]:
    """Each reward component's column of `components` (`<prefix><name>`: its mean over the responses it scored, or
    its share of the advantage), on the steps the steps table shows."""
    picked, _ = picked_steps(steps, every)
    shown = components.set_index("step").reindex([int(s) for s in steps.iloc[picked]["step"]])
    columns = [Column("step", [str(s) for s in shown.index], justify="right")]
    columns += [
        Column(name.removeprefix(prefix), [number(v) for v in shown[name]], justify="right", priority=rank)
        for rank, name in enumerate(shown.columns, start=1)
    ]
    fitted = fit(columns, width)
    parts: list[RenderableType] = [Text(title, style="bold"), fitted.table]
    if note := dropped_note(fitted.dropped, width, "widen the terminal"):
        parts.append(note)
    return parts


# columns only an option records: named once, with the option, in the "no values" line (nine attribution columns
# listed one by one hid the line's other names)
RECORDED_ONLY_WITH = {
    "--log-entropy-delta": ("dH, dH_hard, dH_easy", ("dH", "dH_hard", "dH_easy")),
    "--log-entropy-attribution": ("the 9 dH_*from_* columns", tuple(m for m in STEP_METRICS if "_from_" in m)),
}


def empty_metrics_note(empty: list[str]) -> str:
    """The empty columns, each option's family folded into one entry when all of it is empty."""
    entries, folded = [], set()
    for option, (label, family) in RECORDED_ONLY_WITH.items():
        if set(family) <= set(empty):
            folded.update(family)
            entries.append(f"{label} (recorded with {option})")
    plain = ", ".join(name for name in empty if name not in folded)
    return "; ".join(([plain] if plain else []) + entries)


def _evals_table(evals: pd.DataFrame, width: int) -> list[RenderableType]:
    whole = evals[evals["subset"] == "all"]
    if whole.empty:
        return []
    whole = whole.assign(name=whole["metric"].str.replace("@k", "@", regex=False) + whole["k"].astype(str))
    keys = ["benchmark", "source", "step", "n_problems"]
    wide = whole.pivot_table(index=keys, columns="name", values="value", sort=False).reset_index()
    names = [c for c in wide.columns if c not in keys]
    # avg@k and maj@k first, then pass@k from the largest k down
    order = sorted(
        names,
        key=lambda n: (
            not n.startswith("avg@"),
            not n.startswith("maj@"),
            -int(n.split("@")[1]) if n.split("@")[1].isdigit() else 0,
        ),
    )
    rows = wide.to_dict("records")
    columns = [
        Column("benchmark", [str(r["benchmark"]) for r in rows], flexible=True, min_width=8),
        Column("by", [str(r["source"]) for r in rows]),
        Column("step", [str(r["step"]) for r in rows], justify="right"),
        Column("problems", [str(r["n_problems"]) for r in rows], justify="right", priority=len(order) + 1),
    ]
    for rank, name in enumerate(order, start=1):
        columns.append(Column(name, [number(r[name]) for r in rows], justify="right", priority=rank))
    fitted = fit(columns, width)
    parts: list[RenderableType] = [
        Text.assemble(("evaluations", "bold"), (" (subset all; per subject and level in the dashboard)", "dim")),
        fitted.table,
    ]
    if note := dropped_note(fitted.dropped, width, "widen the terminal, or see them in the dashboard"):
        parts.append(note)
    return parts


# ---------------------------------------------------------------------------------------------------------------
# qae rollouts


def rollouts_view(
    run: str,
    step: int,
    frame: pd.DataFrame,
    everything: pd.DataFrame,
    width: int,
    limit: int,
    full: bool = False,
    model_prompts: dict[int, str] | None = None,
    components: pd.DataFrame | None = None,
) -> RenderableType:
    """One step: why its gated responses were gated (the step's breakdown), then each group (prompt, answer, success
    count, regime, baseline) with its responses (reward, each reward component's value, advantage, why gated, the
    text). `model_prompts` (group -> the prompt after the chat template; `qae rollouts --model-prompt`): printed under
    each prompt, whole. `components` (group_idx, sample_idx, name, value; a run given --reward): one column each."""
    values = (
        {}
        if components is None or components.empty
        else {(int(g), int(i), str(n)): v for g, i, n, v in components.itertuples(index=False)}
    )
    component_names = list(dict.fromkeys(str(n) for n in components["name"])) if values else []
    parts = _step_summary(run, step, frame, everything, width)
    filtered = frame["filtered"].fillna(False).astype(bool)  # left out of the update by dynamic sampling
    shown = frame.head(limit)
    for g, rows in shown.groupby("group_idx", sort=False):
        parts += _group_lines(
            g, rows, int((frame["group_idx"] == g).sum()), filtered, values, component_names, width, full, model_prompts
        )
    if len(frame) > limit:
        parts.append(Text(f"showing {limit} of {len(frame)} responses (--limit)", style="dim"))
    return Group(*parts)


def _step_summary(
    run: str, step: int, frame: pd.DataFrame, everything: pd.DataFrame, width: int
) -> list[RenderableType]:
    """The step's responses and groups, how many were filtered out of the update or gated, and why they were gated."""
    # a group left out of the update by dynamic sampling is filtered, neither gated nor kept: gated counts are of the
    # trained responses, as frac_zero_adv
    left_out = everything["filtered"].fillna(False).astype(bool)
    trained = everything[~left_out]
    n_gated = int(trained["gated"].sum())
    n_filtered = int(everything.loc[left_out, "group_idx"].nunique())
    parts: list[RenderableType] = [
        Text(
            f"{run} step {step}: {len(everything)} responses in {everything['group_idx'].nunique()} groups, "
            + (
                f"{n_filtered} groups ({int(left_out.sum())} responses) filtered out of the update by dynamic "
                f"sampling, {n_gated} of the {len(trained)} trained gated (advantage 0)"
                if n_filtered
                else f"{n_gated} gated (advantage 0)"
            ),
            style="bold",
        )
    ]
    counts = trained.loc[trained["gated"], "gate_reason"].value_counts()
    reasons = [reason for reason in GATE_REASONS if counts.get(reason, 0)]
    if reasons:
        breakdown = [
            Column("why gated", reasons),
            Column("responses", [str(int(counts[r])) for r in reasons], justify="right"),
            Column("share", [f"{counts[r] / max(len(trained), 1):.1%}" for r in reasons], justify="right"),
            Column("meaning", [GATE_REASONS[r] for r in reasons], flexible=True, min_width=20),
        ]
        parts.append(fit(breakdown, width).table)
    if len(frame) != len(everything):
        parts.append(Text(f"{len(frame)} of {len(everything)} responses match the filters", style="dim"))
    return parts


def _group_lines(
    g,
    rows: pd.DataFrame,
    total: int,
    filtered: pd.Series,
    values: dict,
    component_names: list[str],
    width: int,
    full: bool,
    model_prompts: dict[int, str] | None,
) -> list[RenderableType]:
    """One group: its success count, regime, baseline and answer, its prompt (and what the model saw), and a table
    of its shown `rows` of `total` responses."""
    parts: list[RenderableType] = []
    first = rows.iloc[0]
    parts.append(Text(""))
    parts.append(
        Text.assemble(
            (f"group {g}", "bold"),
            f" · {int(first['n_correct'])}/{int(first['group_size'])} correct · ",
            (str(first["regime"]), "bold"),
            f" · baseline {number(first['baseline'])} · answer ",
            (str(first["answer"]), "green"),
        )
    )
    prompt = Text("prompt: " + str(first["prompt"]).replace("\n", " ⏎ "))
    if not full:
        prompt.truncate(width, overflow="ellipsis")
    parts.append(prompt)
    if model_prompts is not None:
        seen = model_prompts.get(int(g))
        parts.append(
            Text(
                "model saw: " + seen.replace("\n", " ⏎ ")
                if seen is not None
                else "model saw: the prompt itself (no chat template)",
                style="dim" if seen is None else "",
            )
        )
    responses = [str(r).replace("\n", " ⏎ ") for r in rows["response"]]
    columns = [
        Column("#", [str(s) for s in rows["sample_idx"]], justify="right"),
        Column("reward", [number(v) for v in rows["reward"]], justify="right"),
        *(
            Column(
                name,
                [number(values.get((int(g), int(i), name))) for i in rows["sample_idx"]],
                justify="right",
                priority=rank,
            )
            for rank, name in enumerate(component_names, start=1)
        ),
        Column("advantage", [f"{v:+.4f}" for v in rows["advantage"]], justify="right"),
        Column(
            "why gated",
            [
                Text("filtered", style="yellow")
                if f
                else Text(str(r), style="dim")
                if g
                else Text("kept", style="bold")
                for r, g, f in zip(rows["gate_reason"], rows["gated"], filtered[rows.index].tolist(), strict=True)
            ],
        ),
        Column("response", responses, flexible=True, overflow="fold" if full else "ellipsis", min_width=16),
    ]
    parts.append(fit(columns, width).table)
    if len(rows) < total:
        parts.append(Text(f"… {total - len(rows)} more responses of this group (raise --limit)", style="dim"))
    return parts


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _config(row: dict) -> dict:
    return stored_config(row)


def _estimator(row: dict) -> str:
    return estimator_label(row.get("estimator"), row.get("k"))


def _policy_loss(row: dict, config: dict) -> str:
    """' · loss NAME' for a training run (a config stored before --policy-loss trained with clip); '' for `qae eval`
    and `qae preview`, which train nothing."""
    if row.get("estimator") in RESULTS_ONLY_KINDS:
        return ""
    return f" · loss {config.get('policy_loss', DEFAULT_POLICY_LOSS)}"


def _progress(row: dict, config: dict) -> str:
    if row.get("estimator") in RESULTS_ONLY_KINDS:  # `qae eval`, `qae preview`: no steps to count (the config's
        return "-"  # steps are those of the run a preview was made for)
    last = row.get("last_step")
    last = 0 if missing(last) else int(last)
    return f"{last}/{config['steps']}" if config.get("steps") else str(last)


def _time(value) -> str:
    if missing(value):
        return ""
    return value.strftime("%Y-%m-%d %H:%M")  # a datetime, or a pandas Timestamp


# ---------------------------------------------------------------------------------------------------------------
# qae compare


def _cell(e, sign: bool = False) -> Text:
    """'0.612' over '[0.581, 0.643]' (the 95% interval) or why there is none ('n=2: no interval'), and for a paired
    difference its p-value below, as `analysis.run_comparison.shown` rules (the Compare page prints the same); '-'
    without a value."""
    from qae_app.analysis.run_comparison import shown

    s = shown(e)
    if s.mean is None:
        return Text("-")
    text = Text(("+" if sign and s.mean > 0 else "") + number(s.mean))
    if s.interval is not None:
        text.append(f"\n[{number(s.interval[0])}, {number(s.interval[1])}]", style="dim")
    elif s.no_interval is not None:
        text.append(f"\n{s.no_interval}", style="dim")
    if s.p_value is not None:
        text.append(f"\np={s.p_value:.3g}", style="bold" if s.p_value < 0.05 else "dim")
    return text


def compare_view(comparison, width: int) -> RenderableType:
    """`qae compare`: one column per group (runs with the same config but the seed), one row per run metric, each
    cell the mean over seeds and its 95% t-interval; with a baseline, a second table of the paired differences (group
    minus baseline, seeds matched) with interval and p-value. Notes say when n is too small to mean much."""
    metrics = comparison.metrics  # RUN_METRICS, then each reward component the runs have
    groups = comparison.groups
    parts: list[RenderableType] = [
        Text(
            f"{sum(len(g.runs) for g in groups)} run(s) in {len(groups)} group(s) (same config but the seed); "
            "mean over seeds, 95% t-interval below it",
            style="bold",
        )
    ]
    for index, group in enumerate(groups, 1):
        seeds = ", ".join(map(str, group.seeds))
        parts.append(
            Text.assemble((f"G{index} ", "bold"), (group.label, "cyan"), f": n={len(group.runs)} (seeds {seeds})")
        )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("metric", no_wrap=True)
    for index, _ in enumerate(groups, 1):
        table.add_column(f"G{index}", justify="right", no_wrap=True)
    for name in metrics:
        table.add_row(name, *[_cell(group.metrics.get(name)) for group in groups])
    parts.append(table)
    if comparison.baseline is not None:
        parts += _differences_view(comparison, metrics)
    for index, group in enumerate(groups, 1):
        if note := group.note():
            parts.append(Text(f"G{index}: {note}", style="yellow"))
        unfinished = [f"{run.run_id} ({run.status})" for run in group.runs if run.status != "finished"]
        if unfinished:
            parts.append(Text(f"G{index}: not finished, numbers so far: {', '.join(unfinished)}", style="yellow"))
    if comparison.left_out:
        parts.append(
            Text(
                "left out: " + ", ".join(f"{run_id} ({why})" for run_id, why in comparison.left_out.items()),
                style="yellow",
            )
        )
    parts.extend(loss_table_view(comparison.groups))
    parts.append(Text("; ".join(f"{name}: {text}" for name, text in metrics.items()), style="dim"))
    return Group(*parts)


def _differences_view(comparison, metrics: dict) -> list[RenderableType]:
    """Each group minus the baseline, paired by seed: one row per metric, which runs were paired, and which seeds
    were left out for want of a partner."""
    groups = comparison.groups
    others = [(i, g) for i, g in enumerate(groups, 1) if g is not comparison.baseline]
    base_index = groups.index(comparison.baseline) + 1
    parts: list[RenderableType] = [
        Text(
            f"minus the baseline G{base_index} ({comparison.baseline.label}), paired by "
            "seed: mean, 95% t-interval, paired t-test p",
            style="bold",
        )
    ]
    diff = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    diff.add_column("metric", no_wrap=True)
    for index, _ in others:
        diff.add_column(f"G{index} - G{base_index}", justify="right", no_wrap=True)
    for name in metrics:
        diff.add_row(name, *[_cell(comparison.differences[g.label].get(name), sign=True) for _, g in others])
    parts.append(diff)
    for index, group in others:
        paired = comparison.differences[group.label][next(iter(metrics))]
        if paired.pairs:
            parts.append(
                Text(
                    f"G{index} - G{base_index} pairs: "
                    + ", ".join(f"seed {seed} {run} - {base_run}" for seed, run, base_run in paired.pairs),
                    style="dim",
                )
            )
        if len(paired.seeds) < len(group.runs) or len(paired.seeds) < len(comparison.baseline.runs):
            parts.append(
                Text(
                    f"G{index}: {len(paired.seeds)} seed(s) shared with the baseline are paired "
                    f"({', '.join(map(str, paired.seeds)) or 'none'}); the others are left out",
                    style="yellow",
                )
            )
    return parts


def loss_table_view(groups) -> list[RenderableType]:
    """The paper's layout where the groups are a grid of policy losses x (a base estimator, qae): per metric a table
    with a row per loss and the columns base, + QAE and QAE minus base paired by seed; nothing for other groups."""
    from qae_app.analysis.loss_table import loss_table

    table = loss_table(groups)
    if table is None:
        return []
    parts: list[RenderableType] = [
        Text(
            f"by policy loss, as the paper's Table 2: {table.base_estimator}, the same loss with qae, and qae minus "
            f"{table.base_estimator} paired by seed (mean, 95% t-interval, paired t-test p)",
            style="bold",
        )
    ]
    for name in next(iter(table.rows)).cells:
        rows = Table(
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
            title=name,
            title_justify="left",
            title_style="bold",
        )
        for column in ("policy loss", table.base_estimator, "+ qae", f"qae - {table.base_estimator}"):
            rows.add_column(column, justify="left" if column == "policy loss" else "right", no_wrap=True)
        for row in table.rows:
            base, qae, difference = row.cells[name]
            rows.add_row(row.policy_loss, _cell(base), _cell(qae), _cell(difference, sign=True))
        parts.append(rows)
    return parts
