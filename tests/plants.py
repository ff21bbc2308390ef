"""The plant harness of issue 40: every file a run folder holds, replaced by each hostile variant, then every command
that reads run folders and every dashboard page run on it (tests/cli/test_planted_run_folders.py,
tests/dashboard/test_dashboard_plants.py).

A case is a copy of one small real run (`base_run`: two steps of the built-in tiny model, a checkpoint, a tag and a
saved pending write) with one plant in run `r`; beside it stand `ok`, an untouched copy of the same run (the other
runs of a folder must still be listed and shown), and `outside/`, the files a planted link points at (they must not
change, and their text must never be printed). A payload that runs writes MARKER; a crafted view reads SECRET.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

RUN = "r"  # the run each case plants in
OTHER = "ok"  # an untouched run beside it
SECRET = "SECRET-OUTSIDE-THE-RUN-FOLDER"
MARKER = "payload-ran.txt"  # in the case folder, outside the runs dir
DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_BYTES = 300 << 20  # sparse: larger than any limit qae reads a run file up to, cheap to make
PENDING = "pending/00000001-run.json"  # a write saved while a reader held the database (planted by base_run)
CHECKPOINT = "checkpoints/step-2"


# ---------------------------------------------------------------------------------------------------------------
# the files of a run folder


def checkpoint_files() -> list[str]:
    return [
        f"{CHECKPOINT}/{name}"
        for name in (
            "manifest.json",
            "trainer_state.json",
            "policy.safetensors",
            "optimizer.safetensors",
            "optimizer.json",
            "scheduler.json",
            "rng-0.json",
            "model/config.json",
            "model/model.safetensors",
            "model/qae_char_tokenizer.json",
            "model/generation_config.json",
        )
    ]


TARGETS = ["qae.duckdb", "config.json", "labels.json", "trainer.lock", PENDING, *checkpoint_files()]


# ---------------------------------------------------------------------------------------------------------------
# the variants


class _Payload:
    """Pickled, it opens its marker for writing when unpickled: the proof that a reader ran code from the folder."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


def safetensors_with_wrong_types() -> bytes:
    """A safetensors file whose header parses as JSON but holds the wrong types (a dtype number, a shape string)."""
    header = json.dumps({"policy.x": {"dtype": 5, "shape": "big", "data_offsets": [0]}}).encode()
    return struct.pack("<Q", len(header)) + header


def wrong_types(target: str) -> bytes:
    """A JSON value of the wrong type where the file holds an object: a list; a config with bad types."""
    if target.endswith(".safetensors"):
        return safetensors_with_wrong_types()
    if target == "config.json":
        return json.dumps({"steps": "many", "group_size": [4], "seed": {"x": 1}, "lr": None}).encode()
    if target == PENDING:
        return json.dumps({"kind": "run", "fields": {"status": ["finished"]}}).encode()
    return b"[1, 2, 3]"


@dataclass(frozen=True)
class Plant:
    target: str  # the file's path in the run folder
    variant: str

    @property
    def name(self) -> str:
        return f"{self.target.replace('/', '~')}:{self.variant}"


FILE_VARIANTS = (
    "link-out",
    "hard-link",
    "link-zero",
    "fifo",
    "empty",
    "truncated",
    "garbage",
    "deep",
    "wrong-types",
    "huge",
    "pickle",
)
DB_VARIANTS = (
    "view",
    "macro",
    "config-list",
    "config-bad-types",
    "config-deep",
    "column-type",
    "column-dropped",
    "config-nan-text",
    "config-huge-int",
    "config-bad-records",
)


# a saved write that parses (issue 48): a truncation planted alone, a timestamp that is a number, a 4,000-digit integer
PENDING_VARIANTS = {
    "truncate": {"kind": "truncate", "step": 0},
    "timestamp-number": {
        "kind": "step",
        "step": 1,
        "tables": {"steps": [{"loss": 0.5}]},
        "logged_at": {"$datetime": 12345},
    },
    "huge-int": {"kind": "step", "step": 1, "tables": {"steps": [{"reward_mean": 10**4000}]}},
}


def all_plants() -> list[Plant]:
    plants = [Plant(target, variant) for target in TARGETS for variant in FILE_VARIANTS]
    plants += [Plant(PENDING, variant) for variant in PENDING_VARIANTS]
    plants += [Plant("qae.duckdb", variant) for variant in DB_VARIANTS]
    plants += [Plant("qae.duckdb.wal", variant) for variant in ("link-out", "fifo", "garbage")]
    plants += [Plant(folder, "link-out-dir") for folder in ("pending", f"{CHECKPOINT}/model", "checkpoints")]
    return plants


# a quick subset for the quick test set: one of each kind of harm, on the files every command reads
QUICK = [
    Plant("config.json", "deep"),
    Plant("trainer.lock", "fifo"),
    Plant("qae.duckdb", "view"),
    Plant("qae.duckdb", "config-bad-types"),
    Plant("qae.duckdb", "config-list"),
    Plant("qae.duckdb", "config-deep"),
    Plant(f"{CHECKPOINT}/manifest.json", "wrong-types"),
    Plant(f"{CHECKPOINT}/trainer_state.json", "pickle"),
    Plant("labels.json", "link-zero"),
    Plant(PENDING, "deep"),
    Plant("labels.json", "hard-link"),
    Plant("qae.duckdb", "column-type"),
    Plant("qae.duckdb", "column-dropped"),
    Plant("qae.duckdb", "config-nan-text"),
    Plant("qae.duckdb", "config-huge-int"),
    Plant("qae.duckdb", "config-bad-records"),
]


# ---------------------------------------------------------------------------------------------------------------
# making a case


def make_case(base: Path, case: Path, plant: Plant | None) -> Path:
    """case/runs holding `r` (planted, unless `plant` is None: the control) and `ok` (untouched), case/outside the
    files links point at; returns the runs dir."""
    runs = case / "runs"
    shutil.copytree(base / RUN, runs / RUN, symlinks=True)
    shutil.copytree(base / RUN, runs / OTHER, symlinks=True)
    outside = case / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    shutil.copytree(base / RUN / CHECKPOINT / "model", outside / "model")  # a model folder to link to
    (outside / "model" / "README.md").write_text(SECRET + "\n")
    if plant is not None:
        plant_file(runs / RUN, plant, case / MARKER, outside)
    return runs


def plant_file(run_dir: Path, plant: Plant, marker: Path, outside: Path) -> None:
    path = run_dir / plant.target
    original = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
    if plant.variant in DB_VARIANTS:
        _craft_database(path, plant.variant, outside)
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    variant = plant.variant
    if variant == "link-out":
        path.symlink_to(outside / "secret.txt")
    elif variant == "hard-link":  # its own bytes, as a second name of a file outside (a tar archive can make one)
        shared = outside / f"hard-{plant.name}"
        shared.write_bytes(original)
        os.link(shared, path)
    elif variant == "link-out-dir":
        path.symlink_to(outside / ("model" if path.name == "model" else "."))
    elif variant == "link-zero":
        path.symlink_to("/dev/zero")
    elif variant == "fifo":
        os.mkfifo(path)
    elif variant == "huge":
        with open(path, "wb") as f:
            f.truncate(HUGE_BYTES)
    elif variant in PENDING_VARIANTS:
        path.write_text(json.dumps(PENDING_VARIANTS[variant]))
    else:
        contents = {
            "empty": b"",
            "truncated": original[: len(original) // 2],
            "garbage": bytes(range(256)) * 16,
            "deep": DEEP,
            "pickle": pickle_payload(marker),
        }
        path.write_bytes(contents[variant] if variant in contents else wrong_types(plant.target))
    parts = Path(plant.target).parts
    if parts[0] == "checkpoints" and len(parts) > 2 and parts[-1] != "manifest.json":
        rewrite_manifest(run_dir / parts[0] / parts[1])  # as whoever planted it would: the checksums then pass


def rewrite_manifest(checkpoint: Path) -> None:
    """The checkpoint's manifest.json listing its regular files' sizes and checksums as they are now, a link or a FIFO
    under its old entry (reading through either is what is under test, not the checksum)."""
    import hashlib

    manifest = checkpoint / "manifest.json"
    entries = json.loads(manifest.read_text())
    for name in list(entries):
        path = checkpoint / name
        if path.is_symlink() or not path.exists() or not path.is_file():
            continue
        if path.stat().st_size > 64 << 20:  # the huge plant: its size says it all
            entries[name] = {"bytes": path.stat().st_size, "sha256": "0" * 64}
            continue
        entries[name] = {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest.write_text(json.dumps(entries, indent=1))


def _craft_database(path: Path, variant: str, outside: Path) -> None:
    """qae.duckdb edited with DuckDB itself: a view or macro that would read outside the folder, a `config` column
    that is not the run's settings, columns of qae's made text holding text, or a column of qae's dropped."""
    import duckdb

    secret = str(outside / "secret.txt").replace("'", "''")
    with duckdb.connect(str(path)) as con:
        if variant == "view":  # qae's `runs` table replaced by a view reading a file outside the folder
            con.execute("CREATE TABLE runs_kept AS SELECT * FROM runs")
            con.execute("DROP TABLE runs")
            con.execute(
                f"CREATE VIEW runs AS SELECT k.* EXCLUDE (error), t.content AS error FROM runs_kept k, "
                f"read_text('{secret}') t"
            )
        elif variant == "macro":
            con.execute("CREATE MACRO coalesce_secret(x) AS x")
            con.execute(f"CREATE MACRO secret() AS TABLE SELECT * FROM read_text('{secret}')")
        elif variant == "column-type":
            for table, column in (("steps", "step"), ("rollouts", "reward"), ("runs", "seed")):
                con.execute(f"ALTER TABLE {table} ALTER {column} TYPE VARCHAR")
                con.execute(f"UPDATE {table} SET {column} = 'not a number'")
        elif variant == "column-dropped":
            con.execute("ALTER TABLE runs DROP COLUMN status")
        else:
            value = {
                "config-list": "[1, 2, 3]",
                "config-bad-types": json.dumps({"steps": "many", "group_size": [4], "k": {"a": 1}}),
                "config-deep": DEEP.decode(),
                # issue 48 L10: `qae compare` met int('NaN'), `qae runs` an int too large for a float, and `qae
                # show` compared text with a number
                "config-nan-text": json.dumps({"seed": "NaN", "steps": "NaN"}),
                "config-huge-int": json.dumps({"seed": 10**4000, "lr": 10**4000}),
                "config-bad-records": json.dumps(
                    {"distributed": {"machines": "2", "processes": 2}, "reward_files": [1]}
                ),
            }[variant]
            con.execute("UPDATE runs SET config = ?", [value])


def make_base_run(folder: Path) -> Path:
    """The run every case copies, as `folder/r`: two steps of the built-in tiny model with a checkpoint at step 2, a
    tag (labels.json) and a write saved under pending/ (as while a reader held the database)."""
    from qae_app.config import build_config
    from qae_app.store.labels import Labels, write_labels
    from qae_app.store.schema import PendingWrite, pending_write_json
    from qae_app.train.trainer import Trainer

    cfg = build_config(run_name=RUN, steps=2, prompts_per_step=2, group_size=4, eval_every=0, checkpoint_every=2)
    with Trainer(cfg, folder, cpu=True) as trainer:
        assert trainer.fit().status == "finished"
    write_labels(folder / RUN, Labels(tags=["base"], note="the base run"))
    (folder / RUN / PENDING).parent.mkdir(exist_ok=True)
    (folder / RUN / PENDING).write_text(pending_write_json(PendingWrite("run", fields={"status": "finished"})))
    return folder


def snapshot(folder: Path, leave_out: tuple[Path, ...]) -> dict[str, tuple]:
    """path -> (kind, size, mtime, link target) of every file under `folder` but in the folders `leave_out` (a
    folder by its kind only: its mtime changes when the run beside it is removed)."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if Path(root, d) not in leave_out]
        for name in dirs:
            seen[str(Path(root, name).relative_to(folder))] = (os.lstat(Path(root, name)).st_mode,)
        for name in files:
            path = Path(root, name)
            info = os.lstat(path)
            seen[str(path.relative_to(folder))] = (
                info.st_mode,
                info.st_size,
                info.st_mtime_ns,
                os.readlink(path) if path.is_symlink() else None,
            )
    return seen


# ---------------------------------------------------------------------------------------------------------------
# the commands: readers first, then the ones that write the run, `rm` last; `{case}` is the case folder

COMMANDS = (
    ("runs", ["runs"]),
    ("show", ["show", RUN]),
    ("show-other", ["show", OTHER]),
    ("rollouts", ["rollouts", RUN, "--step", "2"]),
    ("compare", ["compare", RUN, OTHER]),
    ("export", ["export", RUN, "--out", "{case}/export"]),
    ("eval", ["eval", "--model", RUN, "--limit", "2", "--samples", "1"]),
    ("tag", ["tag", RUN, "planted"]),
    ("stop", ["stop", RUN, "--timeout", "5"]),
    ("resume", ["train", "--resume", RUN, "--steps", "3"]),
    ("runs-after", ["runs"]),
    ("rm", ["rm", RUN, "--yes"]),
)
