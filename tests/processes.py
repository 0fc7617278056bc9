"""Waiting on other processes without a clock: a process is watched through a pidfd (Linux ≥ 5.3), which becomes
readable the moment the process ends (gone, or a zombie left for its parent), so a test blocks exactly until then
and only pytest's own timeout bounds it; no timed poll, nothing that depends on the machine's speed or load."""

from __future__ import annotations

import os
import select
from typing import Optional

__all__ = ["wait_ended", "watch"]


def watch(pid: int) -> Optional[int]:
    """A pidfd of the running process ``pid`` (open it while the process is known to live: no reused pid is ever
    watched), or None when it has already ended and been reaped."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def wait_ended(fd: Optional[int]) -> None:
    """Block until the process behind ``fd`` (:func:`watch`) has ended; closes ``fd``."""
    if fd is None:
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)
