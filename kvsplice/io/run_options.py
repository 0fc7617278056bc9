"""The options every long model run shares (``plan``, ``eval-tasks``): overwrite, torch threads, the progress bar,
device and dtype — one typed base class of the commands' options objects, whose fields declare the command-line
group too (:mod:`kvsplice.io.options`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from kvsplice.io.cli import DTYPE_NAMES, pos_int
from kvsplice.io.options import add_options, opt

__all__ = ["RunOptions", "add_run_options"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run runs, whatever it computes: ``force`` (overwrite the outputs), ``threads`` (torch's; None: its
    choice), ``progress`` (a progress bar), ``device`` (None: CUDA when available) and the model's ``dtype``."""

    force: bool = opt(False, help="overwrite the outputs")
    threads: Optional[int] = opt(None, parse=pos_int, help="torch threads (default: torch's)")
    progress: bool = opt(True, flags=("--no-progress",), help="no progress bar")
    device: Optional[str] = opt(None, help="torch device for the model and caches (default: cuda if available, "
                                "else cpu)")
    dtype: str = opt("fp32", choices=DTYPE_NAMES, help="the model's dtype (default fp32); fp16/bf16 halve its "
                     "memory and the caches'")


def add_run_options(p: argparse.ArgumentParser, *, force_help: str) -> None:
    """``--force`` (``force_help`` says what it overwrites), ``--threads``, ``--no-progress``, ``--device`` and
    ``--dtype``: the command-line side of :class:`RunOptions`."""
    add_options(p, RunOptions, help={"force": force_help})
