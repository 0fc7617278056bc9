"""What a command writes, checked before any work and written so that nothing a user owns is lost; file outputs here,
folders in :mod:`kvsplice.io.folders`.

Every tool that writes a file (``--out``, ``--json``) or a folder (``training.export``, ``convert_llama2c``) goes
through :func:`output_file` / :func:`kvsplice.io.folders.output_dir` first and writes with
:func:`kvsplice.io.write.write_json`, :func:`models.checkpoint.atomic_write` or :func:`kvsplice.io.folders.write_dir`:

* the path is resolved first (``~``, ``.``, ``..``, symlinks): ``--out some/dir/..`` *is* ``some``; a file output
  that is itself a symlink, a FIFO, a socket or a device is refused (writing would replace the link or what it
  points to unseen, or block);
* an output is never an input of the same command, even with ``--force``: not the same file (``--out X.ckpt`` with
  ``--model X.ckpt``, also through a symlink, a hard link or another spelling), not an existing file of an input
  folder, not a folder that holds an input nor one inside an input folder; every file an input names is an input
  too (:func:`kvsplice.io.inputs.input_files`: a plan's or a spec file's bases, the files of a ``--method`` spec,
  ``SpecArgs``), and so is a statistics cache that exists (``--calib-stats``, :func:`cache_file`); two outputs of
  one command are never the same file;
* an output is claimed for the run (:func:`kvsplice.io.claims.claim`): a second run writing the same file or folder
  while the first one lives is refused; the claim (an exclusive lock on ``.<name>.claim`` beside it, holding the
  pid; never a symlink or special file) is released when the command ends (``release_claims``, called by
  :func:`kvsplice.io.cli.run_cli` and at exit), and a killed run's lock dies with it;
* an existing file is replaced only with ``--force``; a non-empty folder only with ``--force`` and, for a command
  that owns its folder (``writer`` with ``owned``), only when the folder's marker (:mod:`kvsplice.io.marker`,
  written by ``write_dir``) says that command wrote it and the folder holds nothing the marker does not list, each
  file still the one it recorded: ownership is the marker's, never the file names' (another tool's folder with the
  same names is refused), and ``--force`` replaces that earlier output whole (no file of it is left beside the new
  one); a marker that is not one kvsplice wrote (a path outside the folder, a symlink, a FIFO, a huge file) means
  "not ours": refused, nothing removed;
* the destination must be writable: a read-only folder is a user error before any work is done;
* files are written to a temporary sibling ``.<name>.<pid>.tmp`` and renamed into place; a new folder is filled
  as a temporary sibling and renamed into place in one step; temporaries a killed run of the command left behind
  are removed first (:func:`models.checkpoint.remove_stale_temp_files`).

Every refusal is a :class:`kvsplice.io.cli.UsageError` with one line naming the option and the path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Mapping, Optional

from kvsplice.io.claims import claim
from kvsplice.io.cli import UsageError
from kvsplice.io.inputs import Inputs, PathArg, command_inputs, resolve_path, same_file, within
from kvsplice.io.write import check_writable
from models.checkpoint import remove_stale_temp_files

__all__ = ["cache_file", "out_and_json", "output_file"]

WEIGHT_SUFFIXES = (".safetensors", ".ckpt", ".gguf", ".pt", ".pth", ".bin")
"""Names a JSON report is never written to: a reader of weights would find text (``--json plan.safetensors``)."""


def _regular_or_new(given: Path, path: Path, option: str, value: PathArg) -> None:
    """A file output is a new name or a regular file: a symlink is refused (writing would replace the link, or the
    file it points to, unseen), and so is a FIFO, a socket or a device (opening one blocks or writes elsewhere)."""
    if given.is_symlink():
        raise UsageError(f"{option} {value} is a symbolic link (to {os.readlink(given)}); give the file itself or a "
                         f"new name")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise UsageError(f"{option} {value} exists and is not a regular file (a FIFO, socket or device); choose "
                         f"another file")


def output_file(value: PathArg, *, force: bool, option: str = "--out", inputs: Inputs = None,
                outputs: Optional[Mapping[str, Path]] = None) -> Path:
    """The resolved path of a file output (see the module docstring); removes this name's stale temporaries.

    Args:
        value: the path as given.
        force: replace an existing file.
        option: the option's name for messages.
        inputs: the command's inputs (never written).
        outputs: ``{option: resolved path}`` of the command's other outputs (never the same file, nor a file inside
            an output folder).
    """
    path = resolve_path(value, option)
    if path.is_dir():
        raise UsageError(f"{option} {value} is a directory")
    sources = command_inputs(inputs)
    for what, src in sources:
        if same_file(path, src):
            raise UsageError(f"{option} {value} is the input {what}: writing it would replace the input; choose "
                             f"another file")
    for other, p in (outputs or {}).items():
        if same_file(path, p):
            raise UsageError(f"{option} {value} is also {other}: give them different files")
        if within(path, p):  # p is the command's output folder: its files are the command's, never a report
            raise UsageError(f"{option} {value} is inside the output folder {other} {p}; write it elsewhere")
    if option == "--json" and path.suffix.lower() in WEIGHT_SUFFIXES:
        raise UsageError(f"{option} {value}: a JSON report named as weights ({path.suffix}); give a .json name")
    _regular_or_new(Path(value).expanduser(), path, option, value)
    if path.exists() and not force:
        raise UsageError(f"{option} {value} already exists (use --force to overwrite)")
    for what, src in sources:
        if path.exists() and src.is_dir() and within(path, src):
            raise UsageError(f"{option} {value} is a file of the input {what}; choose another file")
    check_writable(path.parent, option, value)
    claim(path, option, value)
    remove_stale_temp_files(path.parent, path.name)
    return path


def cache_file(value: Optional[PathArg], *, option: str, inputs: Inputs = None,
               outputs: Optional[Mapping[str, Path]] = None) -> Optional[Path]:
    """A file a command reads when it exists and writes otherwise (``--calib-stats``): an existing one is an input
    (give it in the command's ``inputs``: no output may replace it, even with ``--force``); a new one is an output
    checked as :func:`output_file` (never one of the command's other ``outputs``). ``None`` when not given."""
    if value is None:
        return None
    p = Path(value).expanduser()
    if p.exists():
        if p.is_dir():
            raise UsageError(f"{option} {value} is a directory, not a statistics file")
        if not p.is_file():
            raise UsageError(f"{option} {value} is not a regular file (a FIFO, socket or device)")
        return p.resolve()
    return output_file(value, force=False, option=option, inputs=inputs, outputs=outputs)


def out_and_json(out: PathArg, json_report: Optional[PathArg], *, force: bool,
                 inputs: Inputs = None) -> tuple[Path, Optional[Path]]:
    """``--out`` and the optional ``--json`` report of a tool that writes one file (:func:`output_file` each, never
    the same file)."""
    path = output_file(out, force=force, inputs=inputs)
    if json_report is None:
        return path, None
    return path, output_file(json_report, force=force, option="--json", inputs=inputs, outputs={"--out": path})
