"""Median timers for the benchmarks.

* :func:`cpu_time` — thread-CPU seconds of each call (``time.thread_time``): with one torch thread, robust to other
  processes on a shared machine;
* :func:`wall_time` — wall seconds of each call (``time.perf_counter``), for calls too short for the CPU clock;
* :func:`cuda_time` — milliseconds of each call by CUDA events, each call started on an idle GPU, so that one call's
  time is not hidden behind another's queue;
* :func:`median_of` — the median of a timer's samples after ``warmup`` untimed calls.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

__all__ = ["cpu_time", "cuda_time", "median_of", "wall_time"]


def _timed(clock: Callable[[], float], fn: Callable[[], object], n: int) -> list[float]:
    """``clock`` seconds of each of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def cpu_time(fn: Callable[[], object], n: int) -> list[float]:
    """Thread-CPU seconds of each of ``n`` calls of ``fn``."""
    return _timed(time.thread_time, fn, n)


def wall_time(fn: Callable[[], object], n: int) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``fn``."""
    return _timed(time.perf_counter, fn, n)


def cuda_time(fn: Callable[[], object], n: int) -> list[float]:
    """ms of each of ``n`` calls, each started on an idle GPU and timed by CUDA events."""
    import torch

    out = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(n):
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def median_of(timer: Callable[[Callable[[], object], int], list[float]], fn: Callable[[], object], n: int,
              warmup: int = 0) -> float:
    """The median of ``timer(fn, n)`` (:func:`cpu_time`, :func:`wall_time`: seconds; :func:`cuda_time`: ms) after
    ``warmup`` untimed calls of ``fn``."""
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn, n))
