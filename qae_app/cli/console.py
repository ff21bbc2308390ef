"""The console every qae command prints through, and `fail`, how each reports an error a user can fix.

Text from a run folder (a prompt, a response, an error message, a config value) may carry terminal escapes, and a run
folder can come from anyone: an OSC 52 sequence in a response would write the user's clipboard, `ESC [2J` clear the
screen. rich removes only a few control characters, so this console shows every other one as a visible escape
(`\\x1b`) in the text it is given, while its own styling and cursor control (the progress bar) are drawn as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import typer
from rich.console import Console
from rich.markup import escape
from rich.segment import Segment

from qae_app.core.errors import QAEUserError, SaidByTheMainProcess

# C0 controls but tab and newline, DEL, and the C1 controls (0x9b is a one-byte CSI on some terminals)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible_controls(text: str) -> str:
    """`text` with every control character but tab and newline written as a `\\xNN` escape."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


class SafeConsole(Console):
    """A rich Console whose text segments cannot reach the terminal as control sequences."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        # rich's own styles and cursor movements are not in the segments' text: they stay as they are
        return super()._render_buffer(
            segment if segment.control else Segment(visible_controls(segment.text), segment.style) for segment in buffer
        )


console = SafeConsole()
err_console = SafeConsole(stderr=True)


def fail(err: QAEUserError) -> None:
    if not isinstance(err, SaidByTheMainProcess):  # (another process of the launch says it)
        # soft_wrap: the terminal wraps the line; rich would fold a path longer than the width mid-name, and a user
        # copying it (or a test reading it) would get a broken path
        err_console.print(f"[bold red]error:[/] {escape(_clip_long_words(str(err)))}", soft_wrap=True)
    raise typer.Exit(code=2)


def _clip_long_words(message: str, limit: int = 400) -> str:
    """Each run of over `limit` characters without a space cut to its start and length: a value echoed from a config
    file (a 10 MB model name) is named, not printed whole. Paths and values of ordinary length are kept."""
    from qae_app.core.formatting import clipped

    return re.sub(rf"\S{{{limit + 1},}}", lambda match: clipped(match.group(0)), message)
