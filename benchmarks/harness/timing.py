"""Median timers: wall seconds and CUDA-event milliseconds (each call started on an idle GPU); a background sampler."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Callable, Iterator

__all__ = ["cuda_time", "median_of", "sampled", "wall_time"]


def wall_time(fn: Callable[[], object], n: int) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``fn``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


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
    """The median of ``timer(fn, n)`` (seconds, or ms for :func:`cuda_time`) after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn, n))


@contextlib.contextmanager
def sampled(read: Callable[[], float], every: float) -> Iterator[list[float]]:
    """``read()`` at the block's start, every ``every`` s while it runs and at its end: the samples, in order."""
    got, stop = [read()], threading.Event()

    def sample() -> None:
        while not stop.wait(every):
            got.append(read())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        stop.set()
        thread.join(timeout=2 * every + 1)
        got.append(read())
