"""What a command writes, checked before any work and written so that nothing a user owns is lost.

Every tool that writes a file (``--out``, ``--json``) or a folder (``training.export``, ``convert_llama2c``) goes
through :func:`output_file` / :func:`output_dir` first and writes with :func:`write_json`,
:func:`models.checkpoint.atomic_write` or :func:`write_dir`:

* the path is resolved first (``~``, ``.``, ``..``, symlinks): ``--out some/dir/..`` *is* ``some``;
* an output is never an input of the same command, even with ``--force``: not the same file (``--out X.ckpt`` with
  ``--model X.ckpt``, also through a symlink, a hard link or another spelling), not an existing file of an input
  folder, not a folder that holds an input nor one inside an input folder; every file an input names is an input
  too (:func:`input_files`: a plan's or a spec file's bases, the files of a ``--method`` spec, :class:`SpecArgs`),
  and so is a statistics cache that exists (``--calib-stats``, :func:`cache_file`); two outputs of one command are
  never the same file;
* an output is claimed for the run (:func:`claim`): a second run writing the same file or folder while the first
  one lives is refused; the claim (an exclusive lock on ``.<name>.claim`` beside it, holding the pid) is released
  when the command ends (:func:`release_claims`, called by :func:`kvsplice.io.cli.run_cli` and at exit), and a
  killed run's lock dies with it;
* an existing file is replaced only with ``--force``; a non-empty folder only with ``--force`` and, for a command
  that owns its folder (``writer`` with ``owned``), only when the folder's marker (:data:`MARKER`, written by
  :func:`write_dir`) says that command wrote it and the folder holds nothing the marker does not list: ownership is
  the marker's, never the file names' (another tool's folder with the same names is refused), and ``--force``
  replaces that earlier output whole (no file of it is left beside the new one);
* the destination must be writable: a read-only folder is a user error before any work is done;
* files are written to a temporary sibling ``.<name>.<pid>.tmp`` and renamed into place; a new folder is filled
  as a temporary sibling and renamed into place in one step; temporaries a killed run of the command left behind
  are removed first (:func:`models.checkpoint.remove_stale_temp_files`).

Every refusal is a :class:`kvsplice.io.cli.UsageError` with one line naming the option and the path.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Optional, Union

from kvsplice.io.cli import UsageError, at_command_end, first_line
from models.checkpoint import atomic_write, fsync_dir, remove_stale_temp_files, temp_path

__all__ = ["MARKER", "SpecArgs", "cache_file", "check_marker", "claim", "disk_errors", "input_files", "output_dir", "output_file", "out_and_json",
           "read_marker", "release_claim", "release_claims", "write_dir", "write_json"]

PathArg = Union[str, "os.PathLike[str]"]
Inputs = Optional[Mapping[str, Union[None, PathArg, Iterable[PathArg], "SpecArgs"]]]
"""``{option: path or paths}`` of a command's inputs, e.g. ``{"--model": args.model, "--bases": args.bases,
"--method": SpecArgs.of(args.method)}``; ``None`` values and names that are no local path (Hub ids) are skipped."""


def _resolve(value: PathArg, option: str) -> Path:
    if not str(value).strip():
        raise UsageError(f"{option} is empty")
    return Path(value).expanduser().resolve()


@dataclass(frozen=True)
class SpecArgs:
    """Method-spec arguments as a command's inputs (``--method``, ``--stores``; give them as
    ``inputs={"--method": SpecArgs.of(args.method)}``): what they name is read — a spec file or a plan
    (``plan:P``) and every file the spec names (:func:`kvsplice.core.spec_files.argument_files`), so no output
    may replace it either."""

    values: tuple[str, ...]

    @classmethod
    def of(cls, values: Union[None, str, Iterable[str]]) -> "SpecArgs":
        return cls(() if values is None else (values,) if isinstance(values, str) else tuple(values))


def _existing(found: Iterable[tuple[str, Path]]) -> list[tuple[str, Path]]:
    return [(what, p) for what, p in found if p.exists()]


def input_files(option: str, value: Union[PathArg, SpecArgs]) -> list[tuple[str, Path]]:
    """``[(what, resolved path)]`` a command reads through one input option: the path itself when it exists and
    every file it names when it is a spec file or a plan (:func:`kvsplice.core.spec_files.document_files`); for
    :class:`SpecArgs`, the files each spec argument is or names."""
    from kvsplice.core.spec_files import argument_files, document_files

    if isinstance(value, SpecArgs):
        out = []
        for text in value.values:
            own, named = argument_files(text)
            out += [(f"{option} {text}", own)] if own is not None else []
            out += [(f"the {arg} file {f.name} named by {option} {text}", f) for arg, f in named]
        return _existing(out)
    p = Path(value).expanduser()
    if not str(value).strip() or not p.exists():
        return []
    return _existing([(f"{option} {value}", p.resolve())] +
                     [(f"the {arg} file {f.name} named by {option} {value}", f) for arg, f in document_files(p)])


def _inputs(inputs: Inputs) -> list[tuple[str, Path]]:
    out = []
    for option, values in (inputs or {}).items():
        if values is None:
            continue
        for v in [values] if isinstance(values, (str, os.PathLike, SpecArgs)) else values:
            out += input_files(option, v)
    return out


# ------------------------------------------------------------------------------------------------ claims
_CLAIMS: dict[Path, int] = {}  # claim file -> the open descriptor holding its lock, for this process


def _claim_path(path: Path) -> Path:
    return path.parent / f".{path.name}.claim"


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
    for _ in range(5):
        try:
            fd = os.open(mark, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # no folder yet: nothing to race for before it exists
            return
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


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links too
    except OSError:
        return a == b


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_writable(folder: Path, option: str, value: PathArg) -> None:
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
    path = _resolve(value, option)
    if path.is_dir():
        raise UsageError(f"{option} {value} is a directory")
    sources = _inputs(inputs)
    for what, src in sources:
        if _same_file(path, src):
            raise UsageError(f"{option} {value} is the input {what}: writing it would replace the input; choose "
                             f"another file")
    for other, p in (outputs or {}).items():
        if _same_file(path, p):
            raise UsageError(f"{option} {value} is also {other}: give them different files")
        if _within(path, p):  # p is the command's output folder: its files are the command's, never a report
            raise UsageError(f"{option} {value} is inside the output folder {other} {p}; write it elsewhere")
    _regular_or_new(Path(value).expanduser(), path, option, value)
    if path.exists() and not force:
        raise UsageError(f"{option} {value} already exists (use --force to overwrite)")
    for what, src in sources:
        if path.exists() and src.is_dir() and _within(path, src):
            raise UsageError(f"{option} {value} is a file of the input {what}; choose another file")
    _check_writable(path.parent, option, value)
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


MARKER = ".kvsplice-output.json"
"""The file a command that owns its output folder writes into it: ``{"writer": ..., "files": [...], "records":
{name: [size, mtime_ns]}}``, the command, the files it wrote and what each was when written. ``--force`` replaces a
folder only when its marker names the same command; it is a claim, never a command: a marker that fails any check
of :func:`check_marker` means the folder is not ours, and a file is removed only when the marker lists it and it is
still the file recorded."""
MAX_MARKER_BYTES = 1 << 20
"""A larger marker is not one this package wrote (never read)."""
MAX_MARKER_FILES = 10_000


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


def _record(path: Path) -> Optional[list[int]]:
    """``[size, mtime_ns]`` of a regular file (not a symlink), else ``None``."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns] if stat.S_ISREG(st.st_mode) else None


def _changed(folder: Path, m: dict) -> list[str]:
    """The files the marker lists that are in ``folder`` but are not what it recorded (edited, replaced, a symlink
    or folder now, or never recorded: a hand-made marker)."""
    records = m.get("records") or {}
    out = []
    for name in m["files"]:
        p = folder / name
        if not os.path.lexists(p):
            continue
        if _record(p) is None or _record(p) != records.get(name):
            out.append(name)
    return out


def _foreign(path: Path, entries: list[str], writer: str) -> tuple[list[str], str]:
    """The entries of an owned folder its marker does not vouch for, and why (empty: every one is an earlier output
    of ``writer``, unchanged since it wrote it)."""
    m = read_marker(path)
    if m is None:
        return [e for e in entries if e != MARKER], f"no {MARKER} marker says {writer} wrote them"
    if m["writer"] != writer:
        return [e for e in entries if e != MARKER], f"{m['writer']} wrote them"
    foreign = [e for e in entries if e != MARKER and e not in m["files"]]
    if foreign:
        return foreign, "the marker of the earlier output does not list them"
    return _changed(path, m), f"they changed since {writer} wrote them (or the marker does not record them)"


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
    path = _resolve(value, option)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {value} exists and is not a directory")
    for what, src in _inputs(inputs):
        if _within(src, path):
            raise UsageError(f"{option} {value} contains the input {what}; choose another folder")
        if src.is_dir() and _within(path, src):
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
            foreign, why = [e for e in marked["files"] if e in entries][:3] or [MARKER], f"{marked['writer']} wrote them"
        elif owned is None and marked is not None and force and _changed(path, marked):  # removes only what it recorded
            foreign, why = _changed(path, marked), f"they changed since {writer} wrote them"
        if foreign:
            more = ", ..." if len(foreign) > 3 else ""
            raise UsageError(f"{option} {value} holds files {writer} does not write ({', '.join(foreign[:3])}{more}): "
                             f"{why}; --force replaces only an earlier output of {writer}; choose a new or empty "
                             f"folder")
        if entries and not force:
            raise UsageError(f"{option} {value} is not empty (use --force to replace its files)")
    _check_writable(path if path.is_dir() else path.parent, option, value)
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
            free = shutil.disk_usage(_existing_folder(Path(path))).free
            room = f", {free:,} bytes free"
        except OSError:
            room = ""
        raise UsageError(f"cannot write {path}: {cause}{room}; nothing was written there") from None


def _existing_folder(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p if p.is_dir() else p.parent


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


def _write_marker(folder: Path, writer: str, files: Iterable[str], records: Mapping[str, list[int]]) -> None:
    names = sorted(set(files) - {MARKER})
    kept = {n: records[n] for n in names if records.get(n) is not None}
    text = json.dumps({"writer": writer, "files": names, "records": kept}, indent=1) + "\n"
    atomic_write(folder / MARKER, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _records(folder: Path, names: Iterable[str]) -> dict[str, list[int]]:
    return {n: r for n in names if (r := _record(folder / n)) is not None}


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
            made = _records(tmp, names)  # [size, mtime_ns]: a rename into place keeps both
            if writer is not None:
                _write_marker(tmp, writer, names, made)
        if fresh:
            os.rename(tmp, path)
            fsync_dir(path.parent)
            return names
        folders = [n for n in names if (path / n).is_dir() and not (path / n).is_symlink()]
        if folders:  # never removed to make room
            raise UsageError(f"{path} holds a folder named like an output file ({', '.join(folders)}); move it away")
        if writer is not None:  # while files move, the marker vouches for the earlier files and the new ones
            with disk_errors(path):
                _write_marker(path, writer, [*earlier, *names], {**recorded, **made})
        for name in names:
            os.replace(tmp / name, path / name)
        for name in sorted(set(earlier) - set(names)):  # only plain names a valid marker lists (check_marker) ...
            if plain_name(name) and _record(path / name) is not None and _record(path / name) == recorded.get(name):
                (path / name).unlink()  # ... and only the very file it recorded: a regular file, same size and mtime
        if writer is not None:
            os.replace(tmp / MARKER, path / MARKER)
        return names
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(obj: Any, path: PathArg) -> Path:
    """Write ``obj`` as indented JSON (objects JSON does not know as their ``str``) atomically
    (:func:`models.checkpoint.atomic_write`)."""
    text = json.dumps(obj, indent=2, default=str) + "\n"
    return atomic_write(Path(path), lambda tmp: tmp.write_text(text))
