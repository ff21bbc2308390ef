"""The record of the code a run's rewards run (which rewards, and scoring a batch with them: scoring/reward_path.py).

A run scored by user functions keeps, in its config.json's `reward_files`, each function's file and the
sha256 of its content (as the worker that imported it read it). A resume names the functions again (a run folder runs
no code by itself: `specs.check_named_again`); a file whose content changed since is refused before it is imported,
unless the user passes --accept-changed-reward, and then the run's record keeps the earlier sha256 and the step from
which the new one scored.
"""

from __future__ import annotations

from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.hashing import file_sha256
from qae_app.rewards.registry import RewardSet
from qae_app.store.run_folder import CONFIG_FILE, read_run_config

# ---------------------------------------------------------------------------------------------------------------
# the record of the code a run's rewards ran


def file_record(rewards: RewardSet) -> dict[str, dict]:
    """spec text -> {"path", "sha256"} of each `PATH.py:FUNCTION` reward, read here without importing it."""
    record = {}
    for spec in rewards.user_specs:
        kind, target, _ = spec.resolved()
        if kind == "file":
            record[spec.text] = {"path": target, "sha256": file_sha256(Path(target))}
    return record


def checked_record(run_dir: Path, now: dict[str, dict], step: int, accept_changed: bool, say=None) -> dict:
    """The run's `reward_files` record with `now` (what the files hold now), after checking `now` against what the
    run recorded: a file changed since is refused (QAEUserError) unless `accept_changed`, which keeps the earlier
    sha256 in the record with the step it scored until."""
    stored = _stored_record(run_dir)
    record = dict(stored)
    for text, entry in now.items():
        before = stored.get(text)
        if before is None or before.get("sha256") == entry["sha256"]:
            record[text] = {**(before or {}), **entry}
            continue
        if not accept_changed:
            raise QAEUserError(
                f"reward: {text}: {entry['path']} changed since this run scored with it (sha256 "
                f"{str(before.get('sha256'))[:12]}... then, {str(entry['sha256'])[:12]}... now), so its remaining "
                "steps would score with other code. Restore the file, or pass --accept-changed-reward to resume "
                "with it as it is now (the run records both versions)."
            )
        earlier = [*before.get("earlier", []), {"sha256": before.get("sha256"), "until_step": step}]
        record[text] = {**entry, "earlier": earlier}
        if say is not None:
            say(
                f"[yellow]note:[/] reward {text} changed since the run scored with it; steps after {step} score with "
                "the file as it is now (recorded in the run's config.json)."
            )
    return record


def _stored_record(run_dir: Path) -> dict:
    if not (Path(run_dir) / CONFIG_FILE).exists():
        return {}
    record = read_run_config(run_dir).get("reward_files") or {}
    return record if isinstance(record, dict) else {}
