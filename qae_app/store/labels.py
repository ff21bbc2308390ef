"""A run's tags and note (`qae tag`, `qae note`): what its user says about it ("baseline for the paper", "lr too
high"), kept in `labels.json` beside the run's database rather than in it, so they change while the run trains
without waiting for the trainer's lock on the database. Data only: JSON, read as a regular file of the folder."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.store.run_folder import read_run_file

LABELS_FILE = "labels.json"
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,39}$")
MAX_NOTE_CHARS = 2000


@dataclass
class Labels:
    tags: list[str] = field(default_factory=list)
    note: str = ""


def check_tag(tag: str) -> str:
    if not TAG_PATTERN.match(tag):
        raise QAEUserError(f"tag: '{tag[:60]}' is not a tag. Use letters, digits, '.', '_' and '-' (at most 40, "
                           "starting with a letter or digit), e.g. baseline or lr-too-high.")
    return tag


def tags_from_text(text: str) -> list[str]:
    """The tags in a text cell as one types them ("baseline, lr-too-high" or "baseline lr-too-high"), each checked,
    in order, once each; "" is no tags."""
    return list(dict.fromkeys(check_tag(tag) for tag in re.split(r"[,\s]+", text or "") if tag))


def check_note(note: str) -> str:
    if len(note) > MAX_NOTE_CHARS:
        raise QAEUserError(f"note: {len(note):,} characters, more than {MAX_NOTE_CHARS:,}. Keep a note short; put "
                           "longer text in a file beside the run.")
    return note


def read_labels(run_dir: Path) -> Labels:
    """The run's tags and note; none when it has no labels file. A file that is not qae's (damaged, planted) reads as
    none: the run itself is still listed and shown."""
    try:
        stored = json.loads(read_run_file(Path(run_dir) / LABELS_FILE, max_bytes=64 * 1024))
    except (OSError, ValueError, RecursionError, QAEUserError):  # (FileNotFoundError too: no labels yet)
        return Labels()
    if not isinstance(stored, dict):
        return Labels()
    tags = [tag for tag in stored.get("tags", []) if isinstance(tag, str) and TAG_PATTERN.match(tag)]
    note = stored.get("note", "")
    return Labels(tags=tags, note=note[:MAX_NOTE_CHARS] if isinstance(note, str) else "")


def write_labels(run_dir: Path, labels: Labels) -> None:
    """Replace the run's labels atomically: written to a new temporary file of the folder, then renamed over the old
    one (a link planted as labels.json is replaced, never followed)."""
    path = Path(run_dir) / LABELS_FILE
    tmp = path.with_name(f".{LABELS_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"tags": labels.tags, "note": labels.note}, f, ensure_ascii=False)
    os.replace(tmp, path)
