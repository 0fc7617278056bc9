"""How many intra-op threads a CPU training run uses: as many as the cores other work leaves free.

| machine at start (2 cores)   | torch's default | this choice |
|------------------------------|-----------------|-------------|
| idle                         | 2 threads       | 2 threads   |
| one other CPU-bound process  | 2 threads       | 1 thread    |

torch's default, one thread per core, collapses when another process holds a core: every parallel op waits for the
thread that shares its core with the other process (``results/fit_busy_machine.md``). The free cores are measured
over the start-up of the run itself: the CPU time the machine's cores spent busy (``/proc/stat``, the cores this
process may run on) less this process's own, between :func:`cpu_sample` at the entry point's import and
:func:`pick_threads` just before training is built. ``--torch_threads N`` overrides the choice.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["CpuSample", "cpu_sample", "free_cores", "pick_threads"]

_STAT = Path("/proc/stat")
MIN_WINDOW_S = 0.5
"""Shortest measuring window (``/proc/stat`` counts in 10 ms ticks per core)."""


@dataclass(frozen=True)
class CpuSample:
    """One reading: ``wall`` (monotonic s), ``busy`` (CPU s the cores spent working, all processes), ``own`` (CPU s
    this process used, all its threads), ``cores`` (how many cores the reading covers)."""

    wall: float
    busy: float
    own: float
    cores: int


def cpu_sample(stat: Path = _STAT) -> Optional[CpuSample]:
    """The CPU time of the cores this process may run on (``None`` where ``/proc/stat`` is unreadable)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
        busy += user + nice + system + irq + softirq + steal  # guest time is counted inside user/nice
    own = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSample(time.monotonic(), busy / tick, own.ru_utime + own.ru_stime, len(cpus))


def free_cores(start: CpuSample, end: CpuSample) -> float:
    """Cores other processes left free between two readings, in ``[0, cores]``."""
    wall = max(end.wall - start.wall, 1e-9)
    others = (end.busy - start.busy) - (end.own - start.own)
    return min(float(end.cores), max(0.0, end.cores - others / wall))


def pick_threads(start: Optional[CpuSample], default: int) -> tuple[int, Optional[str]]:
    """``(threads, note)``: ``default`` (torch's count) capped by the free cores since ``start``, at least 1; the
    note says why when it differs. Waits until :data:`MIN_WINDOW_S` after ``start`` (this process sleeping)."""
    if start is None or default <= 1:
        return default, None
    time.sleep(max(0.0, MIN_WINDOW_S - (time.monotonic() - start.wall)))
    end = cpu_sample()
    if end is None:
        return default, None
    free = free_cores(start, end)
    threads = max(1, min(default, math.floor(free + 0.25)))  # a core counts when three quarters of it are free
    if threads == default:
        return threads, None
    return threads, (f"torch threads: {threads} of {default} (other processes keep {end.cores - free:.1f} of the "
                     f"{end.cores} cores busy; --torch_threads N chooses)")
