"""GPU timing by CUDA events for ``benchmarks/gpu_check.py`` until it is on the benchmark harness, whose
:func:`benchmarks.harness.timing.cuda_time` every other benchmark uses (then this module goes): each call starts on
an idle GPU, so one call's time is not hidden behind another's queue."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["cuda_time"]


def cuda_time(fn: Callable[[], object], n: int) -> list[float]:
    """ms of each of ``n`` calls, each started on an idle GPU and timed by CUDA events."""
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
