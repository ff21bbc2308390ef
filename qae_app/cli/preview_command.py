"""`qae preview`: sample a task with a run's own options and say whether it is learnable at this group size, and at
which K (qae_app/evaluation/task_preview.py does the work); and what it prints, read back from the preview's file, so
the terminal shows exactly what is stored. Registered on the `qae` app by cli/main.py, with one option per
`TrainConfig` field, as `qae train` has."""

from __future__ import annotations

from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qae_app.cli.console import console, fail
from qae_app.cli.options import DEFAULT_RUNS_DIR, RunsDir
from qae_app.core import names
from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import number
from qae_app.store.signal import groups_with_signal

if TYPE_CHECKING:
    from qae_app.store.reader import PreviewView

BAR_CELLS = 30  # the widest bar of a histogram
TEXT_WIDTH = 100  # a sampled response is cut to this many characters


def preview_command(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="The run's TOML file (what `qae train --config` takes); command-line options override it."
        ),
    ] = None,
    prompts: Annotated[
        int,
        typer.Option(
            "--prompts", help="Prompts to sample, each --group-size times: the first ones of the run's data stream."
        ),
    ] = names.PREVIEW_PROMPTS,
    ks: Annotated[
        str,
        typer.Option("--ks", help="The K values to show QAE's gating at, comma-separated (the suggested K is added)."),
    ] = names.PREVIEW_KS,
    show: Annotated[
        int,
        typer.Option(
            "--show",
            help="Sampled responses to print (correct and wrong ones; every one is stored: `qae rollouts RUN`).",
        ),
    ] = 6,
    runs_dir: RunsDir = DEFAULT_RUNS_DIR,
    cpu: Annotated[bool, typer.Option("--cpu/--no-cpu", help="Force CPU even when a GPU is present.")] = False,
    **options: Any,
) -> None:
    """Before training: sample --prompts prompts x --group-size responses with the run's own options (the options
    and TOML of `qae train`), score them with its reward, and say whether the task is learnable at this group size
    and which K: the reward distribution, the groups with no signal, what QAE at each K would gate against GRPO, the
    response lengths and the share cut by max-new-tokens. Stored as a run folder (`qae rollouts RUN`, the
    dashboard's Preview page)."""
    from qae_app.cli.progress import PreviewProgress
    from qae_app.config import build_config
    from qae_app.evaluation.task_preview import PreviewOptions, parse_ks, run_preview
    from qae_app.store.reader import read_preview

    try:
        if show < 0:
            raise QAEUserError(f"show: {show} is negative. Use 0 (no responses printed) or a number of responses.")
        preview_options = PreviewOptions(prompts=prompts, ks=parse_ks(ks))
        cfg = build_config(config, **options)
        with PreviewProgress(console, prompts) as progress:
            run_id, path = run_preview(
                cfg, runs_dir, preview_options, on_progress=progress.update, device=None if not cpu else "cpu"
            )
        view = read_preview(path)
    except QAEUserError as err:
        fail(err)
    console.print(preview_view(run_id, view, show), highlight=False)
    console.print(
        f"Stored in [cyan]{escape(str(path))}[/]. Every response: `qae rollouts {run_id} --runs-dir "
        f"{escape(str(runs_dir))}`; the dashboard's Preview page draws it.",
        highlight=False,
    )


# ---------------------------------------------------------------------------------------------------------------
# what it prints


def preview_view(run_id: str, view: PreviewView, show: int = 6) -> RenderableType:
    """The preview as stored: verdict, rewards, groups by success rate, gating by K, lengths, sampled responses."""
    s = view.summary
    config = _config(view.run)
    head = Text.assemble(
        ("qae preview ", "bold"),
        (run_id, "cyan"),
        f": {view.run.get('model')} on {view.run.get('task')}, {s['n_prompts']} prompts x "
        f"G={s['group_size']}, temperature {config.get('temperature')}, max-new-tokens "
        f"{s['max_new_tokens']}",
    )
    learnable = str(s["verdict"]).startswith("learnable")
    parts: list[RenderableType] = [head, Text(str(s["verdict"]), style="bold green" if learnable else "bold red")]
    parts += [Text(""), _rewards(view), Text(""), _success_histogram(view)]
    if (signal := _signal_table(view)) is not None:
        parts += [Text(""), signal]
    parts += [Text(""), _gating_table(view)]
    if s.get("suggested_why") is not None and str(s["suggested_why"]) != "nan":
        parts.append(Text.assemble(("suggested K ", "bold"), f"{s['suggested_k']:g}: {s['suggested_why']}"))
    parts += [Text(""), _lengths(view)]
    if show:
        parts += [Text(""), _responses(view, show)]
    return Group(*parts)


def _config(run: dict) -> dict:
    from qae_app.analysis.settings import settings_problem
    from qae_app.store.reader import stored_config

    config = stored_config(run)
    return config if settings_problem(config) is None else {}


def _rewards(view: PreviewView) -> Text:
    s, rewards = view.summary, view.rollouts["reward"]
    counts = rewards.value_counts().sort_index()
    if len(counts) <= 8:
        spread = ", ".join(f"{count} x {value:g}" for value, count in counts.items())
    else:  # shaped rewards (the overlong penalty): quantiles instead of every value
        spread = ", ".join(f"{name} {rewards.quantile(q):.3g}" for name, q in (("min", 0), ("median", 0.5), ("max", 1)))
    return Text("\n").join(
        [
            Text(
                f"rewards: mean {number(s['reward_mean'])} · success rate {number(s['accuracy'])} · unverified "
                f"{s['frac_unverified']:.1%}"
            ),
            Text(f"per response: {spread}"),
            Text(f"groups with no signal (every reward equal): {s['frac_no_signal']:.1%}"),
        ]
    )


def _bar(count: int, most: int) -> str:
    return "█" * (round(BAR_CELLS * count / most) if most else 0)


def _bucket_note(c: int, G: int, count: int, with_signal: int) -> str:
    """What a bucket of groups with c correct of G says about their signal, as the verdict counts it (rewards that
    differ): shaped and weighted rewards give signal to groups the verifier calls all wrong or all correct."""
    if not count:
        return ""
    if c in (0, G):
        label = "all wrong" if c == 0 else "all correct"
        if not with_signal:
            return f" {label}: no signal"
        return f" {label}, yet {with_signal} with signal (other rewards, shaping)"
    return f" {count - with_signal} without signal (equal rewards)" if with_signal < count else ""


def _success_histogram(view: PreviewView) -> Table:
    """Groups by their number of correct responses, 0..G, each with a bar and how many have signal."""
    G = int(view.summary["group_size"])
    signal = groups_with_signal(view.rollouts["group_idx"], view.rollouts["reward"])
    by_c = {c: [int(g) for g in view.groups.loc[view.groups["n_correct"] == c, "group_idx"]] for c in range(G + 1)}
    table = Table(title="groups by success rate (correct of G)", title_justify="left", box=None, pad_edge=False)
    for name, justify in (("correct", "right"), ("groups", "right"), ("with signal", "right")):
        table.add_column(name, justify=justify, no_wrap=True, min_width=len(name))
    table.add_column("", justify="left", no_wrap=False)
    most = max(len(groups) for groups in by_c.values())
    for c, groups in by_c.items():
        with_signal = sum(signal.get(g, False) for g in groups)
        table.add_row(
            f"{c}/{G}",
            str(len(groups)),
            str(with_signal),
            Text(_bar(len(groups), most), style="cyan").append(
                _bucket_note(c, G, len(groups), with_signal), style="dim"
            ),
        )
    return table


def _signal_table(view: PreviewView) -> Table | None:
    """Each reward component: its weight, mean, the groups where it differs, the groups whose signal exists because
    of it, and its share of the advantage (store/signal.py); None with one reward."""
    if view.signal is None or view.signal.empty:
        return None
    table = Table(
        title="which reward carries the signal (differs: share of groups where it differs; signal: of "
        "groups whose signal exists because of it; advantage: its share of the advantage)",
        title_justify="left",
        box=None,
        pad_edge=False,
        collapse_padding=True,
    )
    table.add_column("component", justify="left", no_wrap=True, overflow="ellipsis")
    for name in ("weight", "mean", "differs", "signal", "advantage"):
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    for row in view.signal.to_dict("records"):
        table.add_row(
            str(row["name"]),
            number(row["weight"]),
            number(row["value_mean"]),
            f"{row['frac_differs']:.0%}",
            f"{row['frac_signal']:.0%}",
            "-" if row["adv_share"] is None or row["adv_share"] != row["adv_share"] else f"{row['adv_share']:.0%}",
        )
    return table


GATING_COLUMNS = ("estimator", "K", "gated", "with signal", "hard", "easy", "all-correct", "all-wrong", "mixed")


def _gating_table(view: PreviewView) -> Table:
    """One row per K of QAE, then GRPO: the share of responses gated, over all and over the groups with signal, and
    the groups of each regime; the suggested K marked."""
    marked = "; K* suggested" if view.by_k["suggested"].any() else ""
    table = Table(
        title=f"gated (advantage exactly 0), and groups by regime{marked}",
        title_justify="left",
        box=None,
        pad_edge=False,
        collapse_padding=True,
    )
    for name in GATING_COLUMNS:
        table.add_column(name, justify="left" if name == "estimator" else "right", no_wrap=True)
    for row in view.by_k.to_dict("records"):
        k = "-" if row["estimator"] == "grpo" else f"{row['k']:g}" + ("*" if row["suggested"] else "")
        informative = row["frac_zero_adv_informative"]
        table.add_row(
            row["estimator"],
            k,
            f"{row['frac_zero_adv']:.1%}",
            "-" if informative is None or informative != informative else f"{informative:.1%}",
            *(str(int(row[f"n_{name}"])) for name in ("hard", "easy", "all_correct", "all_wrong", "mixed")),
            style="bold" if row["suggested"] else None,
        )
    return table


def _lengths(view: PreviewView) -> Text:
    s, tokens = view.summary, view.rollouts["n_tokens"]
    return Text(
        f"lengths (tokens): mean {tokens.mean():.1f}, median {tokens.median():g}, 90% "
        f"{tokens.quantile(0.9):g}, max {tokens.max()}; {s['truncated_frac']:.1%} cut at max-new-tokens "
        f"{s['max_new_tokens']}"
    )


def _responses(view: PreviewView, show: int) -> Table:
    """Up to `show` responses, correct and wrong ones in turn, from different groups where there are enough."""
    rows = view.rollouts.merge(view.groups[["group_idx", "prompt", "answer"]], on="group_idx")
    firsts = rows.drop_duplicates(subset=["group_idx", "correct"])  # a group's first correct and first wrong one
    right, wrong = (firsts[firsts["correct"] == verdict].to_dict("records") for verdict in (True, False))
    picked = [row for pair in zip_longest(right, wrong) for row in pair if row is not None][:show]
    table = Table(title="sampled responses", title_justify="left", box=None, pad_edge=False, expand=True)
    for name in ("group", "prompt", "answer", "response", "reward", "tokens"):  # the texts give way, never a number
        text = name in ("prompt", "response")
        table.add_column(
            name,
            overflow="ellipsis",
            no_wrap=True,
            ratio=(1 if name == "prompt" else 2) if text else None,
            justify="left" if text or name == "answer" else "right",
        )
    for row in picked:
        table.add_row(
            str(row["group_idx"]),
            _one_line(row["prompt"]),
            _one_line(row["answer"]),
            _one_line(row["response"]),
            f"{row['reward']:g}",
            f"{row['n_tokens']}" + (" cut" if row["truncated"] else ""),
        )
    return table


def _one_line(text) -> Text:
    text = "" if text is None or text != text else str(text)
    flat = " ".join(text.split())
    return Text(flat if len(flat) <= TEXT_WIDTH else flat[: TEXT_WIDTH - 1] + "…")
