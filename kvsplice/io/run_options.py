"""The options every long model run shares (``plan``, ``eval_tasks``): overwrite, torch threads, the progress bar,
device and dtype — one option group on the command line, one typed base class of the commands' options objects."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from kvsplice.io.cli import add_device_dtype, pos_int

__all__ = ["RunOptions", "add_run_options", "run_option_values"]


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run runs, whatever it computes: ``force`` (overwrite the outputs), ``threads`` (torch's; None: its
    choice), ``progress`` (a progress bar), ``device`` (None: CUDA when available) and the model's ``dtype``."""

    force: bool = False
    threads: Optional[int] = None
    progress: bool = True
    device: Optional[str] = None
    dtype: str = "fp32"


def add_run_options(p: argparse.ArgumentParser, *, force_help: str) -> None:
    """``--force`` (``force_help`` says what it overwrites), ``--threads``, ``--no-progress``, ``--device`` and
    ``--dtype``: the command-line side of :class:`RunOptions`."""
    p.add_argument("--force", action="store_true", help=force_help)
    p.add_argument("--threads", type=pos_int)
    p.add_argument("--no-progress", action="store_true")
    add_device_dtype(p)


def run_option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`RunOptions` fields of a command line parsed with :func:`add_run_options`."""
    return dict(force=args.force, threads=args.threads, progress=not args.no_progress, device=args.device,
                dtype=args.dtype)
