"""Helpers every command-line tool of ``kvsplice`` shares: the argument parser whose errors are one line, the exit
status of user errors, argument types and the device choice. Output paths and their writing:
:mod:`kvsplice.io.files`, :mod:`kvsplice.io.folders`.

Every tool's ``main`` is ``run_cli(PROG, body, errors)``: a user error — a bad argument, a missing or unreadable
input, a read-only destination, a refused input file — is one ``PROG: error: ...`` line on stderr and exit status 2,
never a traceback; Ctrl-C is one ``PROG: interrupted`` line and exit status 130; the outputs the command claimed
(:func:`kvsplice.io.claims.claim`) are released when it ends.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvsplice.io.interrupt import EXIT_INTERRUPTED, end_quiet_interrupts, quiet_interrupts_after_command

__all__ = ["DTYPES", "DTYPE_NAMES", "EXIT_INTERRUPTED", "EXIT_USAGE", "Parser", "UsageError", "add_device_dtype", "add_model_option",
           "add_threads", "apply_threads", "at_command_end",
           "default_seq_len", "device_dtype", "first_line", "help_text", "pick_device", "pos_int", "run_cli"]

EXIT_USAGE = 2
"""Exit status of every user error (as argparse's own)."""


class UsageError(Exception):
    """A bad argument or input: reported as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UsageError` (one line, exit 2 through :func:`run_cli`)
    instead of printing the usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def help_text(text: str) -> str:
    """``text`` as an argparse help string shows it: ``%`` escaped (argparse formats help with ``%``, so a value
    such as ``layers=50%-67%`` interpolated into a help string would break ``--help``)."""
    return text.replace("%", "%%")


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, whitespace collapsed, at most ``limit`` characters."""
    text = " ".join(str(e).strip().split("\n")[0].split()) if str(e).strip() else type(e).__name__
    return text[:limit]


def run_cli(prog: str, body: Callable[[], int], errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a tool's ``body`` and return its exit status; :class:`UsageError`, ``OSError`` (a missing input, a
    read-only destination), ``ValueError``, ``RecursionError`` (a file nested too deep) and the tool's own
    ``errors`` become one ``PROG: error: ...`` line on stderr and :data:`EXIT_USAGE`; ``KeyboardInterrupt`` one
    ``PROG: interrupted`` line and :data:`EXIT_INTERRUPTED`. The outputs it claimed are released either way
    (:func:`at_command_end`); Ctrl-C during the tool's imports, and after it ended, is the same line
    (:mod:`kvsplice.io.interrupt`)."""
    status = 1  # an unexpected exception: Python's traceback and exit status
    try:
        end_quiet_interrupts()
        status = body()
        return status
    except SystemExit as e:  # --help / --version
        if e.code in (None, 0):
            status = 0
            return 0
        status = e.code if isinstance(e.code, int) else 1
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
        return status
    except RecursionError:
        print(f"{prog}: error: an input is nested too deeply to read (a damaged or hostile file)", file=sys.stderr)
        status = EXIT_USAGE
        return status
    except (UsageError, OSError, ValueError, *errors) as e:
        print(f"{prog}: error: {first_line(e)}", file=sys.stderr)
        status = EXIT_USAGE
        return status
    finally:
        for fn in _AT_END:
            fn()
        # Ctrl-C from here until the process is gone: the same one line, exit 130
        quiet_interrupts_after_command(status if isinstance(status, int) else 0)


_AT_END: list[Callable[[], None]] = []


def at_command_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever :func:`run_cli` ends a command (:mod:`kvsplice.io.claims` releases its
    claims)."""
    if fn not in _AT_END:
        _AT_END.append(fn)


def pos_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


def default_seq_len(max_positions: Optional[int], cap: int = 1024) -> int:
    """Calibration / evaluation window: the model's context, at most ``cap`` (512 when unknown)."""
    return min(max_positions or 512, cap)


if TYPE_CHECKING:
    import torch


def pick_device(name: Optional[str] = None) -> "torch.device":
    import torch

    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPE_NAMES = ("bf16", "fp16", "fp32")
"""``--dtype`` names of the model's compute dtype (the caches follow it); :data:`DTYPES` maps them to torch's."""


def __getattr__(name: str) -> Any:
    """``DTYPES``: ``{"fp32": torch.float32, "bf16": ..., "fp16": ...}``, made when first asked for, so that a
    command's parser and ``--help`` do not import torch."""
    if name == "DTYPES":
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_device_dtype(p: argparse.ArgumentParser, *, dtype: bool = True, default_dtype: str = "fp32") -> None:
    """``--device`` (``cpu``, ``cuda``, ``cuda:1``, ...; default: CUDA when available) and ``--dtype`` (the model's
    weights and compute: fp32 / bf16 / fp16)."""
    p.add_argument("--device", help="torch device for the model and caches (default: cuda if available, else cpu)")
    if dtype:
        p.add_argument("--dtype", choices=list(DTYPE_NAMES), default=default_dtype,
                       help=f"the model's dtype (default {default_dtype}); fp16/bf16 halve its memory and the caches'")


def device_dtype(args: Any) -> tuple["torch.device", Optional["torch.dtype"]]:
    """The device and dtype of a command's options object (its ``device`` and ``dtype``, e.g.
    :class:`~kvsplice.io.run_options.RunOptions`); a device that is not there is a :class:`UsageError` (one line)."""
    import torch

    try:
        dev = pick_device(getattr(args, "device", None))
        torch.empty(0, device=dev)  # "cuda" without CUDA, "cuda:3" on a 1-GPU box, "xpu" without support
    except (RuntimeError, AssertionError, ValueError) as e:
        raise UsageError(f"--device {args.device}: {first_line(e)}") from None
    name = getattr(args, "dtype", None)
    return dev, __getattr__("DTYPES").get(name) if isinstance(name, str) else None


# ------------------------------------------------------------------------------------------------ option groups
def add_threads(p: argparse.ArgumentParser, *, help: str = "torch threads (default: torch's)") -> None:
    """``--threads N`` (``pos_int``; apply with :func:`apply_threads`)."""
    p.add_argument("--threads", type=pos_int, default=None, help=help)


def apply_threads(args: Any) -> None:
    """``torch.set_num_threads(--threads)`` when given, within this machine's CPUs (100000 threads made the model's
    libraries fail to load, reported as a model that cannot be loaded)."""
    if getattr(args, "threads", None):
        import torch

        from kvsplice.core.limits import check_threads

        torch.set_num_threads(check_threads("--threads", args.threads))


def add_model_option(p: argparse.ArgumentParser, *, required: bool = True,
                     help: str = "a model folder, a GGUF file, a training checkpoint or a Hub id") -> None:
    """``--model`` (the model a command reads: :func:`kvsplice.loading.load_model`'s spec)."""
    p.add_argument("--model", required=required, help=help)
