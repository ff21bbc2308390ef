"""What `qae rollouts RUN --step N --tokens` prints: each shown response token by token, with the number chosen by
`--color-by` (the sampler's log-prob, its entropy, or the sampler/trainer gap old_logprob - logprob).

On a terminal with colour each token's background shows the number (the darker, the less likely, the more uncertain or
the further apart: COLOR_SCALES), as the dashboard's token view does; anywhere else (a pipe, a file, NO_COLOR) one line
per token with every number, tab-separated, the token written as a JSON string so whitespace shows. Token texts are
the model's output, read from a run folder: the console shows control characters as escapes (cli/console.py) and the
plain lines quote them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.text import Text

from qae_app.core.formatting import number
from qae_app.store.tokens import COLOR_SCALES, strength, token_numbers

if TYPE_CHECKING:
    import pandas as pd

PLAIN_COLUMNS = ("group", "sample", "position", "token", "logprob", "entropy", "old_logprob", "gap")


def tokens_view(
    run: str, step: int, frame: pd.DataFrame, tokens: pd.DataFrame, color_by: str, limit: int
) -> RenderableType:
    """For a colour terminal: the shown responses of `frame` (rollout rows, up to `limit`), each token's background
    showing `color_by`, from their stored `tokens` rows."""
    by_response = _by_response(tokens)
    shown = frame.head(limit).to_dict("records")
    what, full = COLOR_SCALES[color_by]
    parts: list[RenderableType] = [
        Text(f"{run} step {step}: every token of {len(shown)} responses", style="bold"),
        Text(
            f"background: {what}, from none (0) to full ({'-' if color_by == 'logprob' else ''}{full:g} or beyond)",
            style="dim",
        ),
    ]
    for row in shown:
        key = (int(row["group_idx"]), int(row["sample_idx"]))
        parts.append(
            Text(
                f"\ngroup {key[0]} sample {key[1]} · reward {number(row['reward'])} · advantage "
                f"{row['advantage']:+.4f} · {int(row['n_tokens'])} tokens",
                style="bold",
            )
        )
        stored = by_response.get(key)
        parts.append(
            _coloured(token_numbers(stored), color_by) if stored is not None else Text(NOT_STORED, style="dim")
        )
    if len(frame) > limit:
        parts.append(Text(f"showing {limit} of {len(frame)} responses (--limit)", style="dim"))
    return Group(*parts)


def tokens_lines(frame: pd.DataFrame, tokens: pd.DataFrame, limit: int) -> list[str]:
    """For a pipe or a file: PLAIN_COLUMNS, tab-separated, a line per token of the shown responses (the token as a
    JSON string: whitespace and control characters written out)."""
    by_response = _by_response(tokens)
    lines = ["\t".join(PLAIN_COLUMNS)]
    for row in frame.head(limit).to_dict("records"):
        key = (int(row["group_idx"]), int(row["sample_idx"]))
        stored = by_response.get(key)
        if stored is None:
            lines.append(f"# group {key[0]} sample {key[1]}: {NOT_STORED}")
            continue
        lines += [
            "\t".join(
                [
                    str(key[0]),
                    str(key[1]),
                    str(position),
                    json.dumps(token["token"], ensure_ascii=False),
                    *(_cell(token[name]) for name in ("logprob", "entropy", "old_logprob", "gap")),
                ]
            )
            for position, token in enumerate(token_numbers(stored))
        ]
    return lines


NOT_STORED = "its tokens were not stored (--store-tokens)"


def _by_response(tokens: pd.DataFrame) -> dict[tuple[int, int], dict]:
    return {(int(r["group_idx"]), int(r["sample_idx"])): r for r in tokens.to_dict("records")}


def _coloured(numbers: list[dict], color_by: str) -> Text:
    text = Text()
    for token in numbers:
        level = strength(token[color_by], color_by)
        shade = round(255 * (1 - 0.75 * level))
        text.append(token["token"], style=f"black on rgb(255,{shade},{shade})" if level else "")
    return text


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"
