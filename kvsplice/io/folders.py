"""Folder outputs (``training.export``, ``kvsplice to-mla``, ``kvsplice convert-llama2c``): :func:`output_dir` checks
one before any work, :func:`write_dir` fills it. A command that owns its folder replaces a non-empty one only with
``--force`` and only when the folder's marker (:mod:`kvsplice.io.marker`) says that command wrote it and the folder
holds nothing else: ownership is the marker's, never the file names'. ``--force`` replaces that earlier output whole
and removes only files a valid marker lists and records. A new folder is filled as a temporary sibling and renamed
into place in one step."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Collection, Optional

from kvsplice.io.claims import claim
from kvsplice.io.cli import UsageError
from kvsplice.io.inputs import Inputs, PathArg, command_inputs, resolve_path, within
from kvsplice.io.marker import (MARKER, changed_files, check_marker, file_record, file_records, plain_name, read_marker,
                                write_marker)
from kvsplice.io.write import check_writable, disk_errors
from models.checkpoint import fsync_dir, remove_stale_temp_files, temp_path

__all__ = ["output_dir", "write_dir"]


def _foreign(path: Path, entries: list[str], writer: str) -> tuple[list[str], str]:
    """The entries of an owned folder its marker does not list, and why (empty: every one is a file of an earlier
    output of ``writer``; whether each is still the file it wrote is :func:`changed_files`'s)."""
    m = read_marker(path)
    if m is None:
        return [e for e in entries if e != MARKER], f"no {MARKER} marker says {writer} wrote them"
    if m["writer"] != writer:
        return [e for e in entries if e != MARKER], f"{m['writer']} wrote them"
    return [e for e in entries if e != MARKER and e not in m["files"]], "the marker of the earlier output does not " \
                                                                        "list them"


def output_dir(value: PathArg, *, force: bool, option: str = "--out", inputs: Inputs = None,
               owned: Optional[Collection[str]] = None, writer: str = "this command") -> Path:
    """The resolved path of a folder output (see the module docstring); removes this name's stale temporaries.

    Args:
        owned: ``None``: the command writes its files beside others (kept), never into a folder whose marker names
            another command. Otherwise the command owns the folder: a
            non-empty folder is replaced (with ``force``) only when its :data:`MARKER` names ``writer`` and it holds
            nothing the marker does not list; :func:`write_dir` with the same ``writer`` writes the marker.
        writer: the command's name, for messages and the marker.
    """
    path = resolve_path(value, option)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {value} exists and is not a directory")
    for what, src in command_inputs(inputs):
        if within(src, path):
            raise UsageError(f"{option} {value} contains the input {what}; choose another folder")
        if src.is_dir() and within(path, src):
            raise UsageError(f"{option} {value} is inside the input folder {what}; choose a folder outside it")
    if path.is_dir():
        remove_stale_temp_files(path, path.name)
        entries = sorted(e.name for e in path.iterdir() if not e.name.startswith(f".{path.name}."))
        marked, problem = check_marker(path) if entries else (None, None)
        if problem is not None:  # a marker that is not ours: never written into, nothing of it trusted
            raise UsageError(f"{option} {value}: its {MARKER} is not a marker kvsplice wrote ({problem}); nothing "
                             f"there is replaced or removed; choose a new or empty folder")
        foreign, why = _foreign(path, entries, writer) if owned is not None and entries else ([], "")
        if owned is None and marked is not None and marked["writer"] != writer:  # never into another tool's folder
            foreign = [e for e in marked["files"] if e in entries][:3] or [MARKER]
            why = f"{marked['writer']} wrote them"
        if foreign:
            more = ", ..." if len(foreign) > 3 else ""
            raise UsageError(f"{option} {value} holds files {writer} does not write ({', '.join(foreign[:3])}{more}): "
                             f"{why}; --force replaces only an earlier output of {writer}; choose a new or empty "
                             f"folder")
        changed = changed_files(path, marked) if force and marked is not None and marked["writer"] == writer else []
        if changed:  # --force replaces and removes only the very files the marker recorded
            more = ", ..." if len(changed) > 3 else ""
            raise UsageError(f"{option} {value} holds files changed since {writer} wrote them "
                             f"({', '.join(changed[:3])}{more}; or a marker that does not record them): --force "
                             f"replaces only an earlier output of {writer} as written; move them away or choose a "
                             f"new or empty folder")
        if entries and not force:
            raise UsageError(f"{option} {value} is not empty (use --force to replace its files)")
    check_writable(path if path.is_dir() else path.parent, option, value)
    claim(path, option, value)
    remove_stale_temp_files(path.parent, path.name)
    return path


def _plain_modes(folder: Path) -> None:
    """Every file under ``folder`` readable as the user's umask allows (``0666 & ~umask``): a library that writes
    through ``mkstemp`` (transformers' ``save_pretrained``) leaves ``0600`` files beside ``0644`` ones."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off while a folder is filled (``save_pretrained``'s "Writing model shards" bar
    on stderr would be a second line beside a command's one error line)."""
    if "transformers" not in sys.modules:
        yield
        return
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def write_dir(path: Path, fill: Callable[[Path], None], owned: Optional[Collection[str]] = None,
              writer: Optional[str] = None) -> list[str]:
    """Write a folder output checked by :func:`output_dir`: ``fill(tmp)`` writes every file into a temporary folder,
    which becomes ``path`` in one rename when ``path`` does not exist; into an existing ``path`` each file is moved
    with ``os.replace`` (an existing folder, even ``.``, is never removed, nor a sub-folder in the way), then the files
    of the earlier output that this one no longer has are removed: only those a valid marker of ``writer`` lists and
    records (:func:`check_marker`; never a path outside ``path``, never a file changed since). ``writer``: the folder
    gets its :data:`MARKER` (the command, the files it wrote and their records). ``owned``: accepted for the callers
    of :func:`output_dir`, which refused a folder holding anything else. Files get the
    modes the umask gives (:func:`_plain_modes`). An error (a full disk included) leaves ``path`` as it was or, past
    the first move, the new files and the earlier ones the marker still lists. Returns the names written (the marker
    aside)."""
    fresh = not path.exists()
    tmp = temp_path(path) if fresh else temp_path(path, folder=path)
    m = read_marker(path) if writer is not None and not fresh else None
    m = m if m is not None and m["writer"] == writer else {"files": [], "records": {}}
    earlier, recorded = m["files"], m.get("records") or {}
    try:
        with disk_errors(path):
            tmp.mkdir(parents=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        with disk_errors(path), _no_progress_bars():
            fill(tmp)
        names = sorted(f.name for f in tmp.iterdir() if f.name != MARKER)
        with disk_errors(path):
            _plain_modes(tmp)
            made = file_records(tmp, names)  # [size, mtime_ns]: a rename into place keeps both
            if writer is not None:
                write_marker(tmp, writer, names, made)
        if fresh:
            os.rename(tmp, path)
            fsync_dir(path.parent)
            return names
        folders = [n for n in names if (path / n).is_dir() and not (path / n).is_symlink()]
        if folders:  # never removed to make room
            raise UsageError(f"{path} holds a folder named like an output file ({', '.join(folders)}); move it away")
        if writer is not None:  # while files move, the marker vouches for the earlier files and the new ones
            with disk_errors(path):
                write_marker(path, writer, [*earlier, *names], {**recorded, **made})
        for name in names:
            os.replace(tmp / name, path / name)
        for name in sorted(set(earlier) - set(names)):  # only plain names a valid marker lists (check_marker) ...
            now = file_record(path / name)
            if plain_name(name) and now is not None and now == recorded.get(name):
                (path / name).unlink()  # ... and only the very file it recorded: a regular file, same size and mtime
        if writer is not None:
            os.replace(tmp / MARKER, path / MARKER)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
