"""Writing outputs: the destination checked for writability before any work (:func:`check_writable`), a failed
write (a full disk) turned into one line (:func:`disk_errors`), JSON written atomically (:func:`write_json`;
:func:`models.checkpoint.atomic_write` for any file)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvsplice.io.cli import UsageError
from kvsplice.io.inputs import PathArg

__all__ = ["check_writable", "disk_errors", "existing_folder", "write_json"]


def check_writable(folder: Path, option: str, value: PathArg) -> None:
    """The nearest existing folder of ``folder`` accepts a new file (probed: permission bits say nothing to root
    on a read-only mount or a pseudo file system)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option} {value}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UsageError(f"{option} {value}: cannot write in {existing} ({e.strerror or type(e).__name__})") from None


_WRITE_FAILURES = ("no space left", "storagefull", "disk quota", "file write failed", "read-only file system",
                   "errno 28", "code: 28", "file too large", "iostream error", "inline_container.cc")
"""Words of a failed write in the messages of writers that do not raise ``OSError`` (safetensors' ``SafetensorError``,
torch's ``PytorchStreamWriter`` ``RuntimeError``)."""


@contextlib.contextmanager
def disk_errors(path: PathArg):
    """Turn a failed write of ``path`` — ``OSError`` or a library's own error that wraps one (a full disk: safetensors
    and ``torch.save`` do not raise ``OSError``) — into one :class:`UsageError` line naming the path and the cause."""
    try:
        yield
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - only write failures are translated, the rest is raised unchanged
        text = str(e).lower()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
            cause = os.strerror(e.errno)
        elif any(w in text for w in _WRITE_FAILURES[:3] + ("errno 28", "code: 28")):
            cause = "No space left on device"
        elif any(w in text for w in _WRITE_FAILURES) or re.search(r"\d+ requested and \d+ written", text):
            cause = "the write failed (a full disk?)"  # torch.save / numpy's tofile: the cause is not in the text
        else:
            raise
        try:
            free = shutil.disk_usage(existing_folder(Path(path))).free
            room = f", {free:,} bytes free"
        except OSError:
            room = ""
        raise UsageError(f"cannot write {path}: {cause}{room}; nothing was written there") from None


def existing_folder(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p if p.is_dir() else p.parent


def write_json(obj: Any, path: PathArg) -> Path:
    """Write ``obj`` as indented JSON (objects JSON does not know as their ``str``) atomically
    (:func:`models.checkpoint.atomic_write`)."""
    from models.checkpoint import atomic_write  # (torch with it: the module stays light for parsers and checks)

    text = json.dumps(obj, indent=2, default=str) + "\n"
    return atomic_write(Path(path), lambda tmp: tmp.write_text(text))
