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
from qae_app.store.run_folder import NotARegularFile, check_regular_file, read_run_file

LABELS_FILE = "labels.json"
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,39}$")
MAX_NOTE_CHARS = 2000
MAX_LABELS_BYTES = 1 << 20  # what a labels file may hold: readers read it whole, `qae tag` writes no more


@dataclass
class Labels:
    tags: list[str] = field(default_factory=list)
    note: str = ""


def check_tag(tag: str) -> str:
    if not TAG_PATTERN.match(tag):
        raise QAEUserError(
            f"tag: '{tag[:60]}' is not a tag. Use letters, digits, '.', '_' and '-' (at most 40, "
            "starting with a letter or digit), e.g. baseline or lr-too-high."
        )
    return tag


def tags_from_text(text: str) -> list[str]:
    """The tags in a text cell as one types them ("baseline, lr-too-high" or "baseline lr-too-high"), each checked,
    in order, once each; "" is no tags."""
    return list(dict.fromkeys(check_tag(tag) for tag in re.split(r"[,\s]+", text or "") if tag))


def check_note(note: str) -> str:
    if len(note) > MAX_NOTE_CHARS:
        raise QAEUserError(
            f"note: {len(note):,} characters, more than {MAX_NOTE_CHARS:,}. Keep a note short; put "
            "longer text in a file beside the run."
        )
    return note


def read_labels(run_dir: Path) -> Labels:
    """The run's tags and note; none when it has no labels file. A file that is not qae's (damaged, planted) reads as
    none: the run itself is still listed and shown."""
    try:
        return _stored_labels(Path(run_dir))
    except QAEUserError:
        return Labels()


def labels_to_change(run_dir: Path) -> Labels:
    """The run's labels for `qae tag`, `qae note` or the dashboard to change and write back, read whole or not at all:
    a labels file of the folder's own that does not read whole as qae's (larger than qae writes, damaged, edited) is
    refused by name, since writing back what could be read would lose the rest. None when there is no file, or where
    a link or a FIFO stands in its place (the write replaces it, never what it points at)."""
    path = Path(run_dir) / LABELS_FILE
    try:
        check_regular_file(path)
    except NotARegularFile:
        return Labels()
    try:
        return _stored_labels(Path(run_dir), whole=True)
    except QAEUserError as err:
        raise QAEUserError(
            f"labels: {err} Changing the run's labels would write them back without what could not "
            f"be read: fix {LABELS_FILE} or move it aside, then run the command again."
        ) from None


def _stored_labels(run_dir: Path, whole: bool = False) -> Labels:
    """The labels in the run's labels file (none without one); with `whole`, QAEUserError unless every tag and the
    note read as qae writes them, else whatever is not is left out."""
    path = run_dir / LABELS_FILE
    try:
        stored = json.loads(read_run_file(path, max_bytes=MAX_LABELS_BYTES))
    except FileNotFoundError:
        return Labels()
    except OSError as err:
        raise QAEUserError(f"{path} cannot be read ({err.strerror}).") from None
    except (ValueError, RecursionError) as err:
        raise QAEUserError(f"{path} is not JSON ({str(err)[:100]}).") from None
    if not isinstance(stored, dict):
        raise QAEUserError(f"{path} is not a JSON object of tags and a note.")
    tags, note = stored.get("tags", []), stored.get("note", "")
    kept = [tag for tag in tags if isinstance(tag, str) and TAG_PATTERN.match(tag)] if isinstance(tags, list) else []
    if whole and (
        not isinstance(tags, list)
        or len(kept) != len(tags)
        or not isinstance(note, str)
        or len(note) > MAX_NOTE_CHARS
        or set(stored) - {"tags", "note"}
    ):
        raise QAEUserError(
            f"{path} holds tags or a note that qae did not write (a tag that is not one, a note over "
            f"{MAX_NOTE_CHARS:,} characters, another key)."
        )
    return Labels(tags=kept, note=note[:MAX_NOTE_CHARS] if isinstance(note, str) else "")


def write_labels(run_dir: Path, labels: Labels) -> None:
    """Replace the run's labels atomically: written to a new temporary file of the folder, then renamed over the old
    one (a link planted as labels.json is replaced, never followed). Labels larger than the readers read are refused:
    a file qae writes is always read whole."""
    text = json.dumps({"tags": labels.tags, "note": labels.note}, ensure_ascii=False)
    size = len(text.encode("utf-8"))
    if size > MAX_LABELS_BYTES:
        raise QAEUserError(
            f"labels: {len(labels.tags):,} tags and the note take {size:,} bytes, more than the "
            f"{MAX_LABELS_BYTES:,} a run's labels may. Remove some tags (`qae tag RUN TAG... "
            "--remove`); a few tags tell runs apart best."
        )
    path = Path(run_dir) / LABELS_FILE
    tmp = path.with_name(f".{LABELS_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
