"""Ctrl-C while a tool is still importing: one ``PROG: interrupted`` line and exit status 130, as
:func:`kvsplice.io.cli.run_cli` reports it once the tool runs.

A tool's heavy imports (torch, transformers) take the first second or so of ``python -m kvsplice.TOOL``; a SIGINT
then raised ``KeyboardInterrupt`` inside them — a traceback and exit status -2. Each tool's module calls
:func:`quiet_interrupts_while_importing` first thing (this module imports nothing heavy); :func:`run_cli` hands
SIGINT back to Python's ``KeyboardInterrupt`` (:func:`end_quiet_interrupts`), which it reports the same way and
after which it releases what the command claimed. Once the command has ended (its outputs complete), Ctrl-C during
the interpreter's shutdown is the same one line and exit status 130 (:func:`quiet_interrupts_after_command`), not a
silent exit or a traceback from an exit handler.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Optional

__all__ = ["EXIT_INTERRUPTED", "MAIN", "end_quiet_interrupts", "quiet_interrupts_after_command",
           "quiet_interrupts_while_importing"]

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
MAIN = "__main__"
"""``__name__`` of the module Python runs (``python -m kvsplice.TOOL``)."""

_PROG: list[str] = []  # the tool whose imports are quiet (empty: none)
_MAIN_PROG: list[str] = []  # the tool Python runs as its program (empty: imported as a library)


def _interrupted(signum: int, frame: Optional[FrameType]) -> None:
    """SIGINT during the imports: nothing is claimed or written yet — one line, and exit at once."""
    sys.stderr.write(f"{_PROG[0]}: interrupted\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def quiet_interrupts_while_importing(module_name: str, prog: str) -> None:
    """When the calling module is the program Python runs (``module_name == "__main__"``), Ctrl-C from now until
    :func:`end_quiet_interrupts` is one ``PROG: interrupted`` line and exit status 130; imported as a library, it
    changes nothing."""
    if module_name != MAIN:
        return
    _PROG[:] = [prog]
    _MAIN_PROG[:] = [prog]
    signal.signal(signal.SIGINT, _interrupted)


def end_quiet_interrupts() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` again (Python's default), when :func:`quiet_interrupts_while_importing`
    had changed it."""
    if _PROG and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _PROG.clear()


def quiet_interrupts_after_command() -> None:
    """When a tool runs as the program (:func:`quiet_interrupts_while_importing` saw ``__main__``), Ctrl-C from now
    until the process exits — the command is over, its outputs complete — is one ``PROG: interrupted`` line and exit
    status 130; imported as a library, it changes nothing."""
    if not _MAIN_PROG:
        return
    _PROG[:] = _MAIN_PROG
    signal.signal(signal.SIGINT, _interrupted)
