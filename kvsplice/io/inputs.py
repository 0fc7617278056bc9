"""A command's inputs, as output checks see them (:mod:`kvsplice.io.files`, :mod:`kvsplice.io.folders`): every file
an input option names — the path itself, and the files a spec file, a plan or a ``--method`` spec names in turn
(:class:`SpecArgs`, :func:`kvsplice.core.spec_files.document_files`) — so that no output ever replaces one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from kvsplice.io.cli import UsageError

__all__ = ["Inputs", "PathArg", "SpecArgs", "command_inputs", "input_files", "resolve_path", "same_file", "within"]

PathArg = Union[str, "os.PathLike[str]"]
Inputs = Optional[Mapping[str, Union[None, PathArg, Iterable[PathArg], "SpecArgs"]]]
"""``{option: path or paths}`` of a command's inputs, e.g. ``{"--model": args.model, "--bases": args.bases,
"--method": SpecArgs.of(args.method)}``; ``None`` values and names that are no local path (Hub ids) are skipped."""


def resolve_path(value: PathArg, option: str) -> Path:
    """``value`` as an absolute path (``~``, ``.``, ``..`` and symlinks resolved); an empty value is a UsageError."""
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


def command_inputs(inputs: Inputs) -> list[tuple[str, Path]]:
    out = []
    for option, values in (inputs or {}).items():
        if values is None:
            continue
        for v in [values] if isinstance(values, (str, os.PathLike, SpecArgs)) else values:
            out += input_files(option, v)
    return out



def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links too
    except OSError:
        return a == b


def within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents
