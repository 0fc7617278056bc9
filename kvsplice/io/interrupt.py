"""Ctrl-C while a tool is still importing: one ``PROG: interrupted`` line and exit status 130, as
:func:`kvsplice.io.cli.run_cli` reports it once the tool runs.

A verb's heavy imports (torch, transformers) take the first second or so of ``kvsplice VERB``; a SIGINT
then raised ``KeyboardInterrupt`` inside them — a traceback and exit status -2. The ``kvsplice`` command's first
module (:mod:`kvsplice.cli.main`) calls :func:`quiet_interrupts_as_program` before its own imports, and each tool's
module calls :func:`quiet_interrupts_while_importing` first thing (this module imports nothing heavy);
:func:`run_cli` hands SIGINT back to Python's ``KeyboardInterrupt`` (:func:`end_quiet_interrupts`), which it reports
the same way and after which it releases what the command claimed. Once the command has ended (its outputs
complete), Ctrl-C is the same one line and exit status 130 until the process is gone
(:func:`quiet_interrupts_after_command`): the exit handlers run with the line in place and the process then ends
without the interpreter's teardown, during which Python restores the default SIGINT action (a silent death).
SIGTERM (``kill``) is handled the same way from the same moment with exit status 143 (128 + SIGTERM): one ``PROG:
terminated`` line, then ``SystemExit(143)`` so the command's ``finally`` blocks and exit handlers release its claims
(killed by the default action, a run left its ``.claim`` files beside its outputs).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from types import FrameType
from typing import Optional

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "MAIN", "end_quiet_interrupts", "program_name", "quiet_interrupts_after_command",
           "quiet_interrupts_as_program", "quiet_interrupts_while_importing"]

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""
EXIT_TERMINATED = 143
"""Exit status after SIGTERM (128 + SIGTERM, as a shell reports it)."""
MAIN = "__main__"
"""``__name__`` of the module Python runs as the program."""

_PROG: list[str] = []  # the tool whose imports are quiet (empty: none)
_MAIN_PROG: list[str] = []  # the tool Python runs as its program (empty: imported as a library)
_STATUS: list[int] = []  # the exit status of the command that ended (empty: none yet)
_ENDING: list[bool] = []  # [True] once the exit handler that ends the process is registered / running


def _interrupted(signum: int, frame: Optional[FrameType]) -> None:
    """SIGINT during the imports: nothing is claimed or written yet — one line, and exit at once."""
    sys.stderr.write(f"{_PROG[0]}: interrupted\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _terminated(signum: int, frame: Optional[FrameType]) -> None:
    """SIGTERM: one line; during the command ``SystemExit(143)`` (its ``finally`` blocks and exit handlers release
    what it claimed); once it ended (claims released), exit at once."""
    sys.stderr.write(f"{(_PROG or _MAIN_PROG or ['kvsplice'])[0]}: terminated\n")
    sys.stderr.flush()
    if _STATUS or _ENDING:
        os._exit(EXIT_TERMINATED)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one line, one exit: a second SIGTERM during cleanup waits
    raise SystemExit(EXIT_TERMINATED)


def quiet_interrupts_while_importing(module_name: str, prog: str) -> None:
    """When the calling module is the program Python runs (``module_name == "__main__"``), Ctrl-C from now until
    :func:`end_quiet_interrupts` is one ``PROG: interrupted`` line and exit status 130; imported as a library, it
    changes nothing."""
    if module_name != MAIN:
        return
    _PROG[:] = [prog]
    _MAIN_PROG[:] = [prog]
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _terminated)


def end_quiet_interrupts() -> None:
    """Ctrl-C raises ``KeyboardInterrupt`` again (Python's default), when :func:`quiet_interrupts_while_importing`
    had changed it."""
    if _PROG and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _PROG.clear()


def program_name(argv: list[str], orig_argv: list[str]) -> Optional[str]:
    """``kvsplice VERB`` when this process is the ``kvsplice`` command (the console script, or its module
    ``kvsplice.cli.main`` run by ``-m``), from its command line; ``None`` otherwise."""
    module = orig_argv[orig_argv.index("-m") + 1] if "-m" in orig_argv[:-1] else None
    if module in ("kvsplice.cli.main", "kvsplice.cli") or (module is None and argv and
                                                             os.path.basename(argv[0]) == "kvsplice"):
        verb = argv[1] if len(argv) > 1 and argv[1][:1].isalpha() and argv[1].replace("-", "").isalnum() else ""
        return f"kvsplice {verb}".strip()
    return None


def quiet_interrupts_as_program() -> None:
    """The first instruction of the ``kvsplice`` command: when this process is it (:func:`program_name`), Ctrl-C
    from now on is one ``kvsplice VERB: interrupted`` line and exit status 130 (the verb's own module takes over
    with :func:`quiet_interrupts_while_importing`); in any other program, nothing changes."""
    prog = program_name(list(sys.argv), list(getattr(sys, "orig_argv", [])))
    if prog is not None:
        try:
            quiet_interrupts_while_importing(MAIN, prog)
        except ValueError:  # not the main thread: no signal handling to change
            _PROG.clear()
            _MAIN_PROG.clear()


def quiet_interrupts_after_command(status: int = 0) -> None:
    """When a tool runs as the program (:func:`quiet_interrupts_while_importing` saw ``__main__``), Ctrl-C from now
    until the process is gone — the command is over, its outputs complete — is one ``PROG: interrupted`` line and
    exit status 130: the exit handlers run with that line in place, then the process ends with ``status`` (the
    command's) without the interpreter's teardown, which would restore the default SIGINT action first (Ctrl-C then
    killed the process silently). Imported as a library, it changes nothing."""
    if not _MAIN_PROG:
        return
    _PROG[:] = _MAIN_PROG
    _STATUS[:] = [status]
    signal.signal(signal.SIGINT, _interrupted)
    if not _ENDING:
        _ENDING.append(True)
        atexit.register(_end_after_exit_handlers)  # registered last: runs first, and runs the others itself


def _end_after_exit_handlers() -> None:
    """Run the other exit handlers (Ctrl-C still one line), flush the standard streams and end the process."""
    if len(_ENDING) > 1 or not _STATUS:  # called again by the handlers' own run below
        return
    _ENDING.append(True)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(_STATUS[0])
