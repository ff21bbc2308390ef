"""The Rollouts page's token view: one response's tokens as HTML, each token's background coloured by the chosen
number (the sampler's log-prob, its entropy, or the sampler/trainer gap: qae_app.store.tokens.COLOR_SCALES, as `qae
rollouts --tokens` colours them) and every number of the token in its hover text.

A token's text is the model's output read from a run folder, so it is data, never markup: html.escape'd (quotes
too, in the hover attribute) before it is put between tags, and the page shows the result with st.html. (Streamlit
sanitizes st.html and drops `title` attributes, so the hover text is a `data-tip` shown by CSS.)"""

from __future__ import annotations

import html
import json

from qae_app.store.tokens import COLOR_SCALES, strength

RED = "214, 39, 40"  # the colour of a token at full strength (with the strength as its opacity)
NUMBERS = ("logprob", "entropy", "old_logprob", "gap")
HOVER_CSS = """<style>
.qae-token { position: relative; }
.qae-token:hover { outline: 1px solid currentColor; }
.qae-token:hover::after { content: attr(data-tip); position: absolute; left: 0; top: 1.7em; z-index: 20;
  white-space: pre; padding: 2px 6px; border-radius: 4px; font-size: 0.8em; background: #262730; color: #fafafa; }
</style>"""


def _quoted(text: str) -> str:
    """The token as a JSON string, its angle brackets as \\u003c and \\u003e: Streamlit's sanitizer drops an
    attribute whose value holds a closing tag, which would leave markup-like tokens without their hover text."""
    return json.dumps(text, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e")


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def token_html(numbers: list[dict], color_by: str) -> str:
    """`numbers` (store.tokens.token_numbers: one dict per token) as a block of spans, coloured by `color_by`."""
    spans = []
    for position, token in enumerate(numbers):
        level = strength(token[color_by], color_by)
        hover = f"#{position} {_quoted(token['token'])}: " + " · ".join(
            f"{name} {_value(token[name])}" for name in NUMBERS
        )
        spans.append(
            f'<span class="qae-token" data-value="{_value(token[color_by])}" '
            f'data-tip="{html.escape(hover, quote=True)}" '
            f'style="background: rgba({RED}, {0.8 * level:.3f})">{html.escape(token["token"])}</span>'
        )
    return (
        HOVER_CSS + '<div class="qae-tokens" style="font-family: monospace; white-space: pre-wrap; '
        'line-height: 1.9">' + "".join(spans) + "</div>"
    )


def legend(color_by: str) -> str:
    what, full = COLOR_SCALES[color_by]
    return (
        f"Each token's background: {what}, from none (0) to full ({'-' if color_by == 'logprob' else ''}{full:g} "
        "or beyond); hover a token for all its numbers."
    )
