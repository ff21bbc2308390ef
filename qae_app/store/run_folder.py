"""The run folder, `<runs-dir>/<run_id>/`: its layout, its checkpoints, whether a trainer is alive in it, and the
status a reader should show. Torch-free, so the CLI's readers and the dashboard use it without loading a model.

    <run_id>/
      qae.duckdb             every row of the run (qae_app/store/schema.py)
      config.json            the run's TrainConfig
      trainer.lock           held (flock) by the process training the run; it holds that process's pid
      checkpoints/step-N/    training state (safetensors + JSON), an HF `model/` folder, trainer_state.json,
                             manifest.json (checksums)
      pending/               rows waiting for the database while a reader holds it (writer.RunWriter)

The folder name is the run's id for every reader and writer: a copied or renamed run folder is that run.

Liveness is an OS file lock, not a pid file: the kernel drops the lock when the trainer dies however it dies (kill -9,
OOM, a container restart that reuses pids), so a dead trainer never looks alive and a live one never looks dead.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped
from qae_app.core.hashing import file_sha256

DB_FILE = "qae.duckdb"
CONFIG_FILE = "config.json"
LOCK_FILE = "trainer.lock"
CHECKPOINTS_DIR = "checkpoints"
PENDING_DIR = "pending"  # writes the trainer could not make yet because a reader held the database
TRAINER_STATE = "trainer_state.json"  # inside a checkpoint: what the trainer needs besides accelerate's state
MANIFEST = "manifest.json"  # inside a checkpoint: sha256 of every other file, written last
CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")

RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
STORED_STATUSES = ("running", "finished", "failed", "interrupted")  # what the trainer writes into `runs.status`
STOPPED = "stopped"  # shown, never stored: `running` in the file, but no trainer holds the run's lock


def listed_folder_name(name: str) -> bool:
    """Whether a folder of this name in the runs dir is shown to readers: any name a folder can have but a hidden
    one (a run being created, `.creating-*`; a sweep's logs, `.sweeps`). A run copied by hand to `a (copy)` is a run:
    readers list and read it; only a new run's name must be plain (`validate_run_name`)."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and "/" not in name and "\0" not in name


def validate_run_name(name: str, option: str = "run-name", runs_dir: Path | None = None) -> str:
    """`name` if it can name a run folder; else an error about `option`, the command-line option that gave it. With
    `runs_dir`, the name of a folder that exists there is taken as it is (a copy named `a (copy)`)."""
    if runs_dir is not None and listed_folder_name(name) and (Path(runs_dir) / name).is_dir():
        return name
    if not isinstance(name, str) or not RUN_NAME_PATTERN.match(name) or ".." in name:
        raise QAEUserError(
            f"{option}: '{clipped(name)}' is not a plain name. Use letters, digits, '.', '_' and '-' (at most 100, "
            "starting with a letter or digit, no '..', no '/'); the run is stored under --runs-dir."
        )
    return name


# the runs row's estimator of a folder that holds results only (no model, no training run's settings) -> what it is
RESULTS_ONLY_KINDS = {
    "eval": "an eval run (qae eval): it holds evaluation results",
    "preview": "a preview (qae preview): it holds a task's sampled responses and what they say",
}


def eval_run_error(option: str, folder: Path, what: str, kind: str = "eval") -> QAEUserError:
    """The error for a results-only run (`kind`: a RESULTS_ONLY_KINDS key) given where a training run is needed;
    `what`: what to do instead."""
    return QAEUserError(
        f"{option}: '{Path(folder).name}' is {RESULTS_ONLY_KINDS[kind]}, not a model or a training "
        f"run's settings. {what}"
    )


# ---------------------------------------------------------------------------------------------------------------
# opening what a run folder holds: a run folder may come from anyone, so a file in it is read only if it is a regular
# file of its own (a symlink could point qae's reads and writes at another run or any file; a FIFO or a device hangs a
# read or never ends), and a JSON file no larger than any qae writes


MAX_JSON_BYTES = 64 << 20  # config.json, manifest.json, trainer_state.json, a pending write: far below this


class NotARegularFile(QAEUserError):
    """A path in a run folder that is a symlink, a FIFO, a device or a folder where qae keeps a file."""


def _refusal(path: Path, what: str, kind: str = "file") -> NotARegularFile:
    return NotARegularFile(
        f"run folder: {path} is {what}, where qae keeps a {kind} of its own. A run folder holds "
        f"only qae's files: move it out of {path.parent} (the run then reads as if it were "
        "missing)."
    )


def check_own_folder(path: Path) -> bool:
    """True if `path` is a folder (not a symlink to one), False if nothing is there; NotARegularFile otherwise: qae
    writes into `checkpoints/`, `pending/` and `tensorboard/`, and a link planted there would take those writes out
    of the folder."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise _refusal(path, "a symbolic link", kind="folder")
    if not stat.S_ISDIR(info.st_mode):
        raise _refusal(path, "not a folder", kind="folder")
    return True


def _hard_link(path: Path, info: os.stat_result) -> NotARegularFile:
    return _refusal(
        path,
        f"a hard link (one file under {info.st_nlink} names: another file too, which qae must "
        "neither write nor take for the run's own)",
    )


def check_regular_file(path: Path, writing: bool = False) -> bool:
    """True if `path` is a regular file (not a symlink; when `writing`, not a hard link either), False if nothing is
    there; NotARegularFile otherwise."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise _refusal(path, "a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, "not a regular file (a FIFO, a device or a folder)")
    if writing and info.st_nlink > 1:  # another run's file, or any file the user can write, under a name of ours
        raise _hard_link(path, info)
    return True


def open_regular_file(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """os.open that neither follows a symlink nor blocks on a FIFO, and refuses anything but a regular file; opened
    for writing, a file with other names (a hard link) is refused too, before anything is written."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _refusal(path, "a symbolic link") from None
        if err.errno in (errno.ENXIO, errno.EISDIR):
            raise _refusal(path, "not a regular file (a FIFO, a device or a folder)") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refusal(path, "not a regular file (a FIFO, a device or a folder)")
    if flags & (os.O_WRONLY | os.O_RDWR) and info.st_nlink > 1:
        os.close(fd)
        raise _hard_link(path, info)
    return fd


def replace_run_file(path: Path, text: str) -> None:
    """`text` as the run folder's file `path`: written to a new file of the folder, then renamed over the old name, so
    a link planted there (symbolic or hard) is replaced, never written through."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # (left by a killed write of this pid: whatever it is, only its name is removed)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_run_file(path: Path, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file in a run folder, at most `max_bytes` (more is refused, not read)."""
    fd = open_regular_file(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise QAEUserError(
            f"run folder: {path} is larger than {max_bytes:,} bytes, more than qae ever writes there. "
            f"Move it out of {path.parent}."
        )
    return data


def read_run_config(folder: Path) -> dict:
    """The run's config.json as a dict (the file must exist); an error naming the file when it is not one."""
    path = Path(folder) / CONFIG_FILE
    fix = config_restore_hint(folder)
    try:
        stored = json.loads(read_run_file(path))
    except OSError as err:
        raise QAEUserError(f"config.json: cannot read {path} ({err.strerror}). {fix}") from err
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # (JSONDecodeError is a ValueError)
        raise QAEUserError(f"config.json: {path} is not valid JSON ({str(err)[:200]}). {fix}") from err
    if not isinstance(stored, dict):
        raise QAEUserError(
            f"config.json: {path} is not a JSON object of the run's settings (it holds a "
            f"{type(stored).__name__}). {fix}"
        )
    return stored


def config_restore_hint(folder: Path) -> str:
    """What to do about a damaged config.json: its settings are also in the run's database."""
    return (
        f"Restore it from a backup, or write the settings `qae show {Path(folder).name}` prints (from the run's "
        "database) back into it as JSON; nothing else in the run was changed."
    )


def run_dir(runs_dir: Path, run_id: str) -> Path:
    return Path(runs_dir) / validate_run_name(run_id, runs_dir=runs_dir)


def validated_run_dir(runs_dir: Path, run: str) -> Path:
    """The folder of a run named by a command's RUN argument (a bad name is reported as `run`, not --run-name)."""
    return Path(runs_dir) / validate_run_name(run, option="run", runs_dir=runs_dir)


def db_path(runs_dir: Path, run_id: str) -> Path:
    return run_dir(runs_dir, run_id) / DB_FILE


def list_run_dirs(runs_dir: Path) -> list[Path]:
    """Every run folder (one holding a database) in `runs_dir`, by name, whatever its name (`a (copy)` too). Folders
    being created are hidden."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    return sorted(p.parent for p in runs_dir.glob(f"*/{DB_FILE}") if listed_folder_name(p.parent.name))


def folders_not_runs(runs_dir: Path) -> list[tuple[Path, str]]:
    """(folder, why it is not a run) for every other listed folder in `runs_dir`: neither a database nor the
    config.json of a run that lost its database (those are `runs_without_database`)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    return [
        (
            folder,
            f"not a run: no {DB_FILE} in it (a run folder holds its database; `qae train` and `qae eval` "
            "make one). Move it out of the runs dir, or copy a whole run folder here.",
        )
        for folder in sorted(runs_dir.iterdir())
        if listed_folder_name(folder.name)
        and folder.is_dir()
        and not (folder / DB_FILE).exists()
        and not (folder / CONFIG_FILE).exists()
    ]


def lost_its_database(folder: Path) -> bool:
    """A training run's folder (its config.json) whose database is gone: deleted, or moved aside after it was
    damaged. (A new run's folder appears by one rename with both files, so no live creation looks like this.)"""
    folder = Path(folder)
    return (folder / CONFIG_FILE).exists() and not (folder / DB_FILE).exists()


def runs_without_database(runs_dir: Path) -> list[Path]:
    """The run folders in `runs_dir` that `lost_its_database`."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        return []
    return sorted(
        p.parent
        for p in runs_dir.glob(f"*/{CONFIG_FILE}")
        if listed_folder_name(p.parent.name) and lost_its_database(p.parent)
    )


def recent_runs_text(runs_dir: Path, limit: int = 10) -> str:
    """'c, b, a' (the runs last written first) for a message about a run that is not there; 'none' if there are
    none, '..., and 12 more' past `limit`."""
    folders = sorted(list_run_dirs(runs_dir), key=lambda folder: os.lstat(folder / DB_FILE).st_mtime, reverse=True)
    names = ", ".join(folder.name for folder in folders[:limit]) or "none"
    return names + (f", and {len(folders) - limit} more" if len(folders) > limit else "")


# ---------------------------------------------------------------------------------------------------------------
# checkpoints


def checkpoint_step(path: Path) -> int | None:
    """N for a folder named `step-N`, else None (a `step-N.tmp` left by a kill mid-save is not a checkpoint)."""
    match = CHECKPOINT_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(run_folder: Path) -> list[Path]:
    """The checkpoints of a run, oldest first. A save is written to step-N.tmp and renamed when complete, so every
    step-N folder was complete once; whether it still is, `checkpoint_problem` says (a file gone from one is named
    there, not passed over here)."""
    folder = Path(run_folder) / CHECKPOINTS_DIR
    if folder.is_symlink():  # (a linked folder is no checkpoint of this run's: a resume refuses it by name)
        return []
    found = [p for p in folder.glob("step-*") if checkpoint_step(p) is not None and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=checkpoint_step)


def check_checkpoint_entries(run_folder: Path) -> None:
    """NotARegularFile for an entry of the run's checkpoints/ named as a checkpoint (`step-N`, or `step-N.tmp` left
    by a killed save) that is a symbolic link or not a folder: a save at that step would remove it first, through a
    link outside the run folder. (list_checkpoints passes such entries over; a resume refuses them by name here.)"""
    folder = Path(run_folder) / CHECKPOINTS_DIR
    for path in sorted(folder.glob("step-*")) if check_own_folder(folder) else []:
        if checkpoint_step(path.with_name(path.name.removesuffix(".tmp"))) is not None:
            check_own_folder(path)


def remove_entry(path: Path) -> None:
    """Remove what stands at `path` in a run folder, if anything: a folder of its own with all it holds; a link, a
    file or a FIFO alone (never what a link points at: shutil.rmtree refuses a link, and following one would empty
    a folder outside the run)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def latest_checkpoint(run_folder: Path) -> Path | None:
    found = list_checkpoints(run_folder)
    return found[-1] if found else None


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file in a checkpoint folder; written last, so its presence means the
    checkpoint was complete when saved."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(entries, indent=1))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint cannot be trusted (a missing, truncated or altered file), or None when it checks out."""
    folder = Path(folder)
    try:
        entries = json.loads(read_run_file(folder / MANIFEST))
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)"
    except NotARegularFile as err:
        return str(err)
    except (OSError, ValueError, RecursionError, QAEUserError) as err:
        return f"{MANIFEST} is unreadable ({str(err)[:200]})"
    if not isinstance(entries, dict) or not entries:
        return f"{MANIFEST} lists no files"
    for name, entry in entries.items():
        path = folder / name
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            return f"{MANIFEST} holds no size and checksum for {name!r}"
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} names {name!r}, outside the checkpoint"
        try:
            if not check_regular_file(path):
                return f"{name} is missing"
        except NotARegularFile as err:
            return str(err)
        if not path.resolve().is_relative_to(folder.resolve()):  # through a linked folder (model/ -> elsewhere)
            return f"{name} lies outside the checkpoint, through a symbolic link"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were saved"
        if file_sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum (altered or corrupted on disk)"
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (missing, a link or a FIFO, a header that does not parse or does
    not cover the file), or None; reads the header only, through safetensors' own parser, which runs no code."""
    from safetensors import safe_open

    try:
        if not check_regular_file(path):
            return f"{path.name} is missing"
        with safe_open(str(path), framework="numpy") as f:  # (its header's sizes are checked against the file's)
            f.keys()
    except QAEUserError as err:
        return str(err)
    except BaseException as err:  # SafetensorError, OSError, or pyo3's PanicException (not an Exception)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{path.name} is not a whole safetensors file ({_first_line(err)})"
    return None


def model_folder_problem(folder: Path) -> str | None:
    """Why a checkpoint's model/ folder cannot be handed to a model loader, or None. transformers reads its JSON with
    a parser that deep nesting breaks (RecursionError) and its weights with errors of its own: each JSON file must be
    an object, each safetensors file whole, before any loader opens one."""
    folder = Path(folder)
    if not folder.is_dir() or folder.is_symlink():
        return f"{folder.name}/ is not a folder of the checkpoint's own"
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
        elif path.suffix == ".json":
            try:
                problem = (
                    None if isinstance(json.loads(read_run_file(path)), dict) else f"{path.name} is not a JSON object"
                )
            except (OSError, ValueError, RecursionError, QAEUserError) as err:
                problem = f"{path.name} is not JSON this qae wrote ({_first_line(err)})"
        else:
            continue
        if problem:
            return f"{folder.name}/{problem}" if problem.startswith(path.name) else problem
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


# ---------------------------------------------------------------------------------------------------------------
# liveness: the trainer holds an exclusive flock on trainer.lock for as long as it trains the run


class RunLock:
    """The exclusive lock a trainer holds on its run folder. `acquire()` raises QAEUserError if another live process
    holds it. The lock file keeps the holder's pid for messages; the lock itself, not the pid, decides liveness."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, what: str, attempts: int = 40) -> RunLock:
        from qae_app.core.host_faults import environment_errno, environment_error

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_regular_file(self.path, os.O_RDWR | os.O_CREAT)  # a planted link is refused, not truncated
        except OSError as err:  # a read-only file system, a permission: the run is intact but cannot be trained here
            if environment_errno(err) is None:
                raise
            raise environment_error(
                f"{what}: cannot lock run '{self.path.parent.name}' to train it", err, "The run is intact."
            ) from None
        # a reader checking liveness holds a shared lock for microseconds: retry briefly before calling it taken
        for attempt in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES) or attempt == attempts - 1:
                    os.close(fd)
                    if err.errno in (errno.EAGAIN, errno.EACCES):
                        holder = lock_holder_pid(self.path.parent)
                        raise QAEUserError(
                            f"{what}: run '{self.path.parent.name}' is being trained right now"
                            + (f" by process {holder}" if holder else "")
                            + ". Stop it first (Ctrl-C or kill -TERM), then resume it."
                        ) from None
                    raise
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def lock_holder_pid(folder: Path) -> int | None:
    try:
        return int(read_run_file(Path(folder) / LOCK_FILE, max_bytes=32).strip())
    except (OSError, ValueError, QAEUserError):
        return None


def trainer_alive(folder: Path) -> bool:
    """Whether a live process holds the run's lock (is training it now). A lock file that is a link, or a file with
    other names (a hard link: another run's lock, any process's locked pid file), is no trainer's: RunLock never takes
    one, so a lock held on it is someone else's."""
    try:
        fd = open_regular_file(Path(folder) / LOCK_FILE)
    except (OSError, QAEUserError):  # no lock file, or a planted one: no trainer of qae's holds it
        return False
    if os.fstat(fd).st_nlink > 1:
        os.close(fd)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock if we got it
    return False


def effective_status(stored: str | None, folder: Path) -> str:
    """The status to show: `stopped` for a run stored as `running` whose trainer is gone (kill -9, power loss)."""
    if stored == "running" and not trainer_alive(folder):
        return STOPPED
    return stored or STOPPED


def pending_writes(folder: Path) -> int:
    """Writes saved under pending/ and not in the database yet: the steps since the trainer's last database write (see
    writer.WRITE_SHARE), or all of them while a reader holds the file."""
    return sum(1 for path in (Path(folder) / PENDING_DIR).glob("*") if path.suffix == ".json")
