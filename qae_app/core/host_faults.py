"""Faults of the machine, not of the user's data: a read-only or full disk, a file-size limit (`ulimit -f`), a
permission, a name longer than the file system allows. Each is said with its cause and what to do, and told apart from
a damaged run file (`run_file.is_damage_error`), whose advice (restore from a backup) would be wrong here. And a
terminal that hung up (`leave_the_terminal`).

Torch- and DuckDB-free: config.py and the CLI's option checks use it at start-up.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from qae_app.core.errors import QAEUserError
from qae_app.core.formatting import clipped

NAME_MAX_BYTES = 255  # the longest name of one file or folder on Linux, macOS and Windows file systems

# errno -> (what it means, what to do); the errors of the environment, as opposed to a damaged file
ENVIRONMENT_ERRNOS: dict[int, tuple[str, str]] = {
    errno.EROFS: ("the file system is read-only", "Use a writable --runs-dir, or remount it read-write"),
    errno.EACCES: ("permission denied", "Check the permissions of the folder and its files, or use another --runs-dir"),
    errno.EPERM: (
        "operation not permitted",
        "Check the permissions of the folder and its files, or use another --runs-dir",
    ),
    errno.ENOSPC: ("the disk is full", "Free some space on the disk"),
    errno.EDQUOT: ("the disk quota is exceeded", "Free some space within your quota"),
    errno.EFBIG: (
        "the file is larger than this process may write (a file-size limit, `ulimit -f`)",
        "Raise the limit (`ulimit -f unlimited`)",
    ),
    errno.ENAMETOOLONG: ("a name is longer than the file system allows", "Use shorter names"),
}

# DuckDB wraps the OS error in an IOException and keeps only its text
_DUCKDB_TEXTS = (
    (re.compile(r"read-only file system", re.I), errno.EROFS),
    (re.compile(r"permission denied", re.I), errno.EACCES),
    (re.compile(r"no space left on device", re.I), errno.ENOSPC),
    (re.compile(r"disk quota exceeded", re.I), errno.EDQUOT),
    (re.compile(r"file too large", re.I), errno.EFBIG),
    (re.compile(r"file name too long", re.I), errno.ENAMETOOLONG),
)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def environment_errno(err: BaseException) -> int | None:
    """The errno of `err` (or of the error it wraps) when it is a fault of the environment, not damage; else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in ENVIRONMENT_ERRNOS:
            return err.errno
        for pattern, number in _DUCKDB_TEXTS:
            if "duckdb" in type(err).__module__ and pattern.search(str(err)):
                return number
        # Rust writers (safetensors: the checkpoint's tensors) report the OS error in their text only
        rust_os_error = _RUST_OS_ERROR.search(str(err))
        if rust_os_error and int(rust_os_error.group(1)) in ENVIRONMENT_ERRNOS:
            return int(rust_os_error.group(1))
        err = err.__cause__ or err.__context__
    return None


def write_fault(err: BaseException, folder: Path) -> int | None:
    """The environment fault behind a failed write into `folder`: `environment_errno(err)`, or, for a writer that
    drops the errno (torch.save's C++ zip writer raises RuntimeError 'unexpected pos'), the machine's state: a finite
    file-size limit (EFBIG) or a nearly full disk (ENOSPC). None when neither explains it (a bug: let it be seen)."""
    number = environment_errno(err)
    if number is not None or not isinstance(err, (OSError, RuntimeError)):
        return number
    import resource

    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return errno.ENOSPC if stat.f_bavail * stat.f_frsize < 64 * 2**20 else None


def free_space_text(folder: Path) -> str:
    """'1.2 GB free on the disk of <folder>' (empty when it cannot be told)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stat = os.statvfs(folder)
    except OSError:
        return ""
    return f"{stat.f_bavail * stat.f_frsize / 1e9:.2f} GB free on the disk of {folder}"


def environment_error(
    what: str, err: BaseException, advice: str = "", number: int | None = None, then: str = ""
) -> QAEUserError:
    """The error for an environment fault while doing `what` ('cannot write run r's checkpoint step-3'): the cause,
    the free space where it matters, and `advice` (what becomes of the run) then what to do. `number`: the errno when
    `err` does not carry it (see write_fault); `then`: what to do once the fault is fixed."""
    number = number or environment_errno(err)
    cause, fix = ENVIRONMENT_ERRNOS.get(number, (getattr(err, "strerror", None) or str(err), ""))
    filename = getattr(err, "filename", None)
    where = f" ({clipped(filename, 200)})" if filename else ""
    space = ""
    if number == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        space = f" (the limit is {limit / 1e6:.2f} MB)" if limit != resource.RLIM_INFINITY else ""
    elif number in (errno.ENOSPC, errno.EDQUOT) and filename:
        free = free_space_text(Path(filename).parent)
        space = f" ({free})" if free else ""
    todo = f"{fix}, then {then}" if fix and then else fix or then
    return QAEUserError(
        f"{what}: {cause}{where}{space}. "
        + " ".join(part for part in (advice, todo + "." if todo else "") if part).strip()
    )


def name_too_long(path: Path | str) -> str | None:
    """The first name in `path` over NAME_MAX_BYTES, clipped for a message; None when every name fits."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX_BYTES:
            return clipped(part)
    return None


def check_path_names(option: str, path: Path | str) -> None:
    """Refuse a path with a name the file system cannot hold (`Errno 36` from every call that touches it)."""
    long = name_too_long(path)
    if long is not None:
        raise QAEUserError(
            f"{option}: '{long}' has a name over {NAME_MAX_BYTES} bytes, longer than the file system "
            f"allows for one file or folder. Use a shorter name."
        )


def leave_the_terminal() -> None:
    """After SIGHUP (the terminal closed, an ssh session dropped): this process's standard output and error, where
    they are a terminal, go to /dev/null from here on. A write to a terminal that hung up fails (EIO), and a run
    stopping after its step with a checkpoint must not fail on a progress line nobody can see any more; a log file or
    a pipe stays as it is. Safe in a signal handler."""
    devnull = None
    for fd in (1, 2):
        try:
            if not stat.S_ISCHR(os.fstat(fd).st_mode):  # a file, a pipe, a socket: its reader is still there
                continue
            if devnull is None:
                devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(devnull, fd)
        except OSError:  # (closed already)
            continue
    if devnull is not None:
        os.close(devnull)
