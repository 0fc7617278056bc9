"""The options long model runs share, one typed dataclass each — ``force`` (overwrite the outputs), ``threads``
(torch's), ``progress`` (a progress bar), ``device`` and the model's ``dtype`` — and :class:`RunOptions`, all five
(``plan``, ``eval-tasks``). A command's options dataclass derives from the ones it takes (``to-mla``: no ``dtype``,
the converted checkpoint keeps the source's; ``generate``: ``force``, ``device``, ``dtype``), so each shared option
is declared here once, its fields declaring the command-line group too (:mod:`kvsplice.io.options`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvsplice.io.cli import DTYPE_NAMES, Parser, pos_int
from kvsplice.io.options import add_options, opt

__all__ = ["DeviceOption", "DtypeOption", "ForceOption", "ProgressOption", "RunOptions", "ThreadsOption",
           "run_parser"]


@dataclass(frozen=True, kw_only=True)
class ForceOption:
    """``force``: overwrite the outputs (a command says which: ``add_options(help={"force": ...})``)."""

    force: bool = opt(False, help="overwrite the outputs")


@dataclass(frozen=True, kw_only=True)
class ThreadsOption:
    """``threads``: torch's threads (None: its choice)."""

    threads: Optional[int] = opt(None, parse=pos_int, help="torch threads (default: torch's)")


@dataclass(frozen=True, kw_only=True)
class ProgressOption:
    """``progress``: a progress bar (``--no-progress`` turns it off)."""

    progress: bool = opt(True, flags=("--no-progress",), help="no progress bar")


@dataclass(frozen=True, kw_only=True)
class DeviceOption:
    """``device``: the torch device of the model and caches (None: CUDA when available)."""

    device: Optional[str] = opt(None, help="torch device for the model and caches (default: cuda if available, "
                                "else cpu)")


@dataclass(frozen=True, kw_only=True)
class DtypeOption:
    """``dtype``: the model's weights and compute (``fp32``, ``bf16``, ``fp16``)."""

    dtype: str = opt("fp32", choices=DTYPE_NAMES, help="the model's dtype (default fp32); fp16/bf16 halve its "
                     "memory and the caches'")


@dataclass(frozen=True, kw_only=True)
class RunOptions(ForceOption, ThreadsOption, ProgressOption, DeviceOption, DtypeOption):
    """How a run runs, whatever it computes: ``force`` (overwrite the outputs), ``threads`` (torch's; None: its
    choice), ``progress`` (a progress bar), ``device`` (None: CUDA when available) and the model's ``dtype``."""


def run_parser(prog: str, options: type, *, force_help: str, description: Optional[str] = None) -> Parser:
    """The command line of a model run: ``options``' own fields (they declare it), then the run options — ``--force``
    (``force_help`` says what it overwrites), ``--threads``, ``--no-progress``, ``--device`` and ``--dtype``."""
    p = Parser(prog=prog, description=description)
    add_options(p, options, skip=RunOptions)
    add_options(p, RunOptions, help={"force": force_help})
    return p
