"""Claims on outputs: a second run writing the same file or folder while the first one lives is refused. A claim is an
exclusive ``flock`` on ``.<name>.claim`` beside the output, holding the pid (for the message); it is released when
the command ends (:func:`release_claims`, called by :func:`kvsplice.io.cli.run_cli` and at exit), and a killed
run's lock dies with it."""

from __future__ import annotations

import atexit
import os
import stat
from pathlib import Path

from kvsplice.io.cli import UsageError, at_command_end
from kvsplice.io.inputs import PathArg

__all__ = ["claim", "release_claim", "release_claims"]

_CLAIMS: dict[Path, int] = {}  # claim file -> the open descriptor holding its lock, for this process


def _claim_path(path: Path) -> Path:
    return path.parent / f".{path.name}.claim"


def _check_claim_file(mark: Path, option: str, value: PathArg, special: bool = False) -> None:
    """A ``.<name>.claim`` that is a symlink, a FIFO or a device was not made by a run: refused in one line (it is
    never opened through, written or removed)."""
    if special or mark.is_symlink() or (mark.exists() and not mark.is_file()):
        raise UsageError(f"{option} {value}: {mark} is not a claim file a run made (a symlink or special file); "
                         f"remove it or choose another output")


def claim(path: Path, option: str, value: PathArg) -> None:
    """Claim ``path`` for this process until :func:`release_claims`: an exclusive ``flock`` on ``.<name>.claim``
    beside it (holding the pid, for the message). Another live run's claim is a :class:`UsageError`; a killed run's
    lock died with it (the kernel releases it), so its leftover file is simply locked again."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): claims are best effort there
        return
    mark = _claim_path(path)
    if mark in _CLAIMS:
        return
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    for _ in range(5):
        try:
            fd = os.open(mark, flags, 0o644)  # never through a symlink: its target would be truncated
        except OSError:  # no folder yet: nothing to race for before it exists; or not a file we may claim
            _check_claim_file(mark, option, value)
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            _check_claim_file(mark, option, value, special=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(f"{option} {value} is being written by another run (pid {owner}); wait for it to end "
                             f"or choose another file") from None
        except OSError:  # a file system without locks
            os.close(fd)
            return
        try:
            same = os.fstat(fd).st_ino == os.stat(mark).st_ino  # not a file its holder unlinked meanwhile
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _CLAIMS[mark] = fd
        return
    raise UsageError(f"{option} {value} is being claimed by other runs; try again")


def _release(mark: Path, fd: int) -> None:
    """Unlink one claim file while still locked, then drop the lock."""
    try:
        if os.fstat(fd).st_ino == os.stat(mark).st_ino:
            mark.unlink()
    except OSError:
        pass
    os.close(fd)


def release_claims() -> None:
    """Remove the claims this process holds (a command's end): each file is unlinked while still locked."""
    while _CLAIMS:
        _release(*_CLAIMS.popitem())


def release_claim(path: PathArg) -> None:
    """Remove this process's claim on one output (a library function that wrote it and is done: no ``.claim`` file
    is left beside it until the process exits)."""
    mark = _claim_path(Path(path).expanduser().resolve())
    fd = _CLAIMS.pop(mark, None)
    if fd is not None:
        _release(mark, fd)


atexit.register(release_claims)
at_command_end(release_claims)
