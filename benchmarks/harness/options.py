"""The benchmarks' parser and shared options (``add_*``) on :mod:`kvsplice.io.cli`'s plumbing (a study's command:
:class:`benchmarks.harness.runner.Study`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness.paths import EVAL
from kvsplice.io import cli
from kvsplice.io.cli import Parser, UsageError, add_device_dtype, device_dtype, pos_int

__all__ = ["Parser", "UsageError", "add_device_dtype", "add_model", "add_progress", "add_threads", "add_windows",
           "device_dtype", "parser", "pos_int"]


def parser(script: str, doc: Optional[str] = None, *, raw: bool = False, **kw: Any) -> Parser:
    """The parser of ``script`` (its ``__file__``), described by ``doc``'s first paragraph (``raw``: lines kept)."""
    if raw:
        kw.setdefault("formatter_class", argparse.RawTextHelpFormatter)
    description = doc.strip().split("\n\n")[0] if doc else None
    return Parser(prog=Path(script).stem, description=description, **kw)


def add_threads(p: argparse.ArgumentParser, default: Optional[int] = 1, help: Optional[str] = None) -> None:
    """``--threads``: torch's intra-op threads, one by default (ratios side by side, robust on a shared machine)."""
    cli.add_threads(p, help=help or f"torch intra-op threads (default {default})")
    p.set_defaults(threads=default)


def add_model(p: argparse.ArgumentParser, default: Any = None, help: Optional[str] = None,
              required: bool = False) -> None:
    """``--model``: a model folder, checkpoint, GGUF file or Hub id (:func:`kvsplice.loading.load_model`)."""
    cli.add_model_option(p, required=required, help=help or f"the model (folder, checkpoint, GGUF file or Hub id; "
                                                            f"default {default})")
    if default is not None:
        p.set_defaults(model=str(default))


def add_windows(p: argparse.ArgumentParser, windows: Optional[int] = None, *, data: bool = True) -> None:
    """``--windows`` of ``--prompt`` (384) + ``--cont`` (128) tokens of ``--data`` (with ``data``; the stories
    evaluation text); with ``windows`` None the three default to None (the study's YAML sizes give them)."""
    if data:
        p.add_argument("--data", default=str(EVAL))
    given = windows is not None
    p.add_argument("--windows", type=int, default=windows, help="windows of text scored")
    p.add_argument("--prompt", type=int, default=384 if given else None, help="prompt tokens of a window")
    p.add_argument("--cont", type=int, default=128 if given else None, help="scored continuation tokens")


def add_progress(p: argparse.ArgumentParser) -> None:
    """``--no-progress``: no progress bars (logs, CI); ``args.progress`` is the flag's opposite."""
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
