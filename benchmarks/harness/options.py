"""The benchmarks' parser and shared options (``add_*``) on :mod:`kvsplice.io.cli`'s plumbing; :func:`command` wraps
a hand-written ``main(argv)``: a bad argument is one ``PROG: error: ...`` line and exit 2, Ctrl-C exit 130."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.harness.paths import EVAL
from kvsplice.io import cli
from kvsplice.io.cli import Parser, UsageError, add_device_dtype, device_dtype, pos_int, run_cli

__all__ = ["Parser", "UsageError", "add_device_dtype", "add_model", "add_out",
           "add_progress", "add_threads", "add_windows", "command", "device_dtype", "parser", "pos_int"]


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


def add_out(p: argparse.ArgumentParser, default: Any = None, help: Optional[str] = None, *,
            flag: str = "--out", **kw: Any) -> None:
    """``--out`` (or ``flag``): where the results go."""
    p.add_argument(flag, type=kw.pop("type", Path), default=default,
                   help=help or f"where the results go (default {default})", **kw)


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


def command(main: Callable[..., int]) -> Callable[..., int]:
    """``main(argv=None) -> int`` run as a command named after its script (:func:`kvsplice.io.cli.run_cli`)."""
    prog = Path(main.__code__.co_filename).stem

    @functools.wraps(main)
    def run(argv: Optional[Sequence[str]] = None, *rest: Any, **kw: Any) -> int:
        return run_cli(prog, lambda: main(argv, *rest, **kw))

    run.prog = prog  # type: ignore[attr-defined]
    return run
