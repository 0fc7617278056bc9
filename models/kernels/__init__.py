"""Decode kernels: the split-KV Triton kernel (:mod:`models.kernels.split_kv`) behind one call with the layout of
:func:`models.attention.attend`, and the one-time choice of whether it runs.

``triton`` is optional (the ``triton`` extra; CUDA builds of torch ship it). Without it every path keeps its eager
attention. The choice is made once, when a module or method is built (:func:`resolve_decode_kernel`), never inside a
traced forward; a call then only compares its device and query count with it (:func:`use_decode_kernel`).

``decode_kernel`` settings: ``"auto"`` (the kernel for one-query calls on CUDA when triton is installed, the eager
path elsewhere — CPU numbers do not change), ``"triton"`` (the kernel for every one-query call; on a CPU tensor only
under Triton's interpreter, ``TRITON_INTERPRET=1`` set before triton is imported — the tests), ``"eager"`` (never).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Optional

import torch

DECODE_KERNELS = ("auto", "triton", "eager")
# The default of every decode path (GPTConfig, Decoder, the HF caches): "auto" — the kernel on CUDA, the eager path
# on CPU. Chosen on the H200 run of benchmarks/gpu_check.py (results/gpu_check_h200.md): the 61 `gpu` tests pass
# (compiled kernel == eager), and the CUDA-graph decode step at batch 8 / 16k is 1.3-9.4x faster on the kernel for
# MHA, MLA and KVSplice-90 (bf16 and int8 rows); at the 24 GB capacity batch it is faster in 10 of 12 rows (MHA bf16:
# 0.98x at 1k, 0.83x at 16k). Opt out with decode_kernel="eager".
DEFAULT_DECODE_KERNEL = "auto"


@lru_cache(maxsize=1)
def triton_missing_reason() -> Optional[str]:
    """Why the Triton kernel cannot be imported here, or None (resolved once per process)."""
    try:
        import triton  # noqa: F401  (type: ignore[import-not-found])
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not installed ({type(e).__name__}: {e}); pip install -e '.[triton]'"
    return None


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_decode_kernel(requested: str) -> bool:
    """Whether one-query calls of a module / method built now may run the split-KV kernel. ``"triton"`` raises a
    ``RuntimeError`` saying why when it cannot run (never a silent fallback); ``"auto"`` needs triton and CUDA."""
    if requested not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {requested!r}")
    if requested == "eager":
        return False
    reason = triton_missing_reason()
    if requested == "auto":
        return reason is None and torch.cuda.is_available()
    if reason is None and not torch.cuda.is_available() and not interpreting():
        reason = "no CUDA device, and Triton's interpreter is off (set TRITON_INTERPRET=1 before importing triton)"
    if reason is not None:
        raise RuntimeError(f"decode_kernel='triton' cannot run here: {reason}; use 'auto' or 'eager'")
    return True


def use_decode_kernel(enabled: bool, requested: str, q: torch.Tensor) -> bool:
    """Whether this call runs the kernel: built with it (``enabled``), one query, and on CUDA (``"auto"``) or
    anywhere (``"triton"``). Plain comparisons: ``torch.compile`` traces them without a graph break."""
    return enabled and q.shape[-2] == 1 and (requested == "triton" or q.device.type == "cuda")


def decode_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  bias: Optional[torch.Tensor] = None, lengths: Optional[torch.Tensor] = None,
                  k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                  num_splits: Optional[int] = None) -> torch.Tensor:
    """One query per head over cached rows by the split-KV kernel, in :func:`models.attention.attend`'s layout:
    q (B, Hq, 1, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) → (B, Hq, 1, Dv) at ``q``'s dtype.

    ``bias (B|1, Hkv|1, T)``: added to every score of a key (log-weights; ``-inf`` masks). ``lengths (B|1,)``: keys
    past ``lengths[b]`` are not read. int8 ``k``/``v`` with per-row scales ``k_scale``/``v_scale (B, Hkv, T, 1)``
    (:func:`models.quant.quantize_int8`) are dequantised in the kernel; other rows run at their own dtype (``q`` is
    cast to it)."""
    from models.kernels.split_kv import split_kv_decode

    out_dtype = q.dtype
    if k.dtype != torch.int8 and q.dtype != k.dtype:
        q = q.to(k.dtype)
    y = split_kv_decode(q[:, :, 0], k, v, scale=scale, bias=bias, lengths=lengths, k_scale=k_scale,
                        v_scale=v_scale, num_splits=num_splits)  # (B, Hq, Dv)
    return y[:, :, None].to(out_dtype)  # (B, Hq, 1, Dv)


__all__ = ["DECODE_KERNELS", "decode_attend", "interpreting", "resolve_decode_kernel", "triton_missing_reason",
           "use_decode_kernel"]
