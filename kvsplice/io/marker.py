"""The marker of an owned output folder (:data:`MARKER`): which command wrote the folder, the files it wrote and what
each was then. It is a claim, never a command: :func:`check_marker` accepts only a small regular file (never a
symlink, FIFO or device, never read past :data:`MAX_MARKER_BYTES`) listing plain names inside the folder, and a file
counts as the earlier output's only while it is the one recorded (:func:`changed_files`)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterable, Mapping, Optional

from kvsplice.io.cli import first_line
from models.checkpoint import atomic_write

__all__ = ["MARKER", "MAX_MARKER_BYTES", "changed_files", "check_marker", "file_record", "file_records", "plain_name",
           "read_marker", "write_marker"]

MARKER = ".kvsplice-output.json"
"""The file a command that owns its output folder writes into it: ``{"writer": ..., "files": [...], "records":
{name: [size, mtime_ns]}}``, the command, the files it wrote and what each was when written. ``--force`` replaces a
folder only when its marker names the same command; it is a claim, never a command: a marker that fails any check
of :func:`check_marker` means the folder is not ours, and a file is removed only when the marker lists it and it is
still the file recorded."""
MAX_MARKER_BYTES = 1 << 20
"""A larger marker is not one this package wrote (never read)."""
MAX_MARKER_FILES = 10_000
"""A marker listing more files is not one this package wrote."""


class _NotOurs(Exception):
    """Why a marker is not one this package wrote."""


def plain_name(name: object) -> bool:
    """``name`` is a file name inside a folder: no separator, not ``.`` / ``..``, no NUL, not the marker itself."""
    return isinstance(name, str) and name not in ("", ".", "..", MARKER) and "/" not in name and "\\" not in name \
        and "\0" not in name and not (os.altsep and os.altsep in name)


def _read_small_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file (not a symlink, FIFO, device) of at most ``limit`` bytes,
    checked before and after opening (never blocks, never reads more than ``limit + 1`` bytes)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _NotOurs("it is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _NotOurs("it is not a regular file")
    if st.st_size > limit:
        raise _NotOurs(f"it is larger than {limit:,} bytes")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise _NotOurs("it is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _NotOurs(f"it is larger than {limit:,} bytes")
    return data


def check_marker(folder: Path) -> tuple[Optional[dict], Optional[str]]:
    """``(marker, None)`` for a valid marker of ``folder``, ``(None, None)`` when there is none, ``(None, why)``
    when its :data:`MARKER` is not one this package wrote: not a small regular file, not JSON, not ``{"writer":
    str, "files": [plain names]}``, or records that are not ``{listed name: [size, mtime_ns]}``."""
    try:
        data = _read_small_regular(Path(folder) / MARKER, MAX_MARKER_BYTES)
        m = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        return None, None
    except _NotOurs as e:
        return None, str(e)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        return None, f"it cannot be read as JSON ({first_line(e, 80)})"
    if not isinstance(m, dict) or not isinstance(m.get("writer"), str) or not isinstance(m.get("files"), list):
        return None, 'it is not {"writer": ..., "files": [...]}'
    if len(m["files"]) > MAX_MARKER_FILES:
        return None, f"it lists more than {MAX_MARKER_FILES:,} files"
    bad = [f for f in m["files"] if not plain_name(f)]
    if bad:
        return None, f"it lists {str(bad[0])[:80]!r}, not a plain file name inside the folder"
    records = m.get("records")
    if records is not None and (not isinstance(records, dict) or any(
            k not in m["files"] or not isinstance(v, list) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in v) for k, v in records.items())):
        return None, "its records are not {listed name: [size, mtime_ns]}"
    return m, None


def read_marker(folder: Path) -> Optional[dict]:
    """The marker of ``folder`` (``{"writer": str, "files": [names], "records": {...}}``), or ``None`` when there is
    none or it is not one this package wrote (:func:`check_marker`)."""
    return check_marker(folder)[0]


def file_record(path: Path) -> Optional[list[int]]:
    """``[size, mtime_ns]`` of a regular file (not a symlink), else ``None``."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else None


def changed_files(folder: Path, m: dict) -> list[str]:
    """The files the marker lists that are in ``folder`` but are not what it recorded (edited, replaced, a symlink
    or folder now, or never recorded: a hand-made marker)."""
    records = m.get("records") or {}
    out = []
    for name in m["files"]:
        p = folder / name
        if not os.path.lexists(p):
            continue
        if file_record(p) is None or file_record(p) != records.get(name):
            out.append(name)
    return out


def write_marker(folder: Path, writer: str, files: Iterable[str], records: Mapping[str, list[int]]) -> None:
    """Write ``folder``'s marker atomically: ``writer``, the ``files`` and the ``records`` of those that have one."""
    names = sorted(set(files) - {MARKER})
    kept = {n: records[n] for n in names if records.get(n) is not None}
    text = json.dumps({"writer": writer, "files": names, "records": kept}, indent=1) + "\n"
    atomic_write(folder / MARKER, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def file_records(folder: Path, names: Iterable[str]) -> dict[str, list[int]]:
    """``{name: [size, mtime_ns]}`` of the regular files among ``names`` in ``folder``."""
    return {n: r for n in names if (r := file_record(folder / n)) is not None}
