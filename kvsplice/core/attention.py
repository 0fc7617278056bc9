"""Attention over full (or rebuilt) keys and values, written once for every method and both doors.

* :func:`dense_attend` — what a method calls to attend over keys/values it holds: causal bottom-right
  (:func:`models.attention.attend`, flash or SDPA) when there is no mask and no log-weight, otherwise
  :func:`masked_attend` / :func:`weighted_attend`.
* :func:`masked_attend` — with transformers' mask (boolean ``(B or 1, 1, Tq, Tk)``, True = attend, over the absolute
  positions ``0 .. Tk-1``; or an additive float mask), optionally plus per-token log-weights.
* :func:`weighted_attend` — ``softmax(q·Kᵀ·scale + logw)·V`` with the causal convention of ``attend`` (token subsets:
  a kept token that stands for ``w`` tokens carries ``log w``).
* :func:`reference_attention` — the float64 reference every error measurement compares against.
* :func:`keys_seen` — which keys the last query of a mask may see (a padded row's real tokens).

Layouts: ``q (B, Hq, Tq, d)``, ``k (B, Hkv, Tk, d)``, ``v (B, Hkv, Tk, dv)``; query head ``h`` reads KV head
``h // (Hq // Hkv)`` (the ``g`` query heads of a KV head are folded into query rows: no K/V copy).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from models.attention import attend, sdpa, select_backend

__all__ = ["dense_attend", "kernel_attend", "keys_seen", "masked_attend", "reference_attention", "weighted_attend"]


def keys_seen(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``(B or 1, Tk)`` bool: the keys the last query of ``mask`` may see (True); ``None`` for ``None``."""
    if mask is None:
        return None
    last = mask[:, 0, -1, :]  # (B or 1, Tk)
    return last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2


def weighted_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logw: Optional[torch.Tensor], *,
                    scale: float) -> torch.Tensor:
    """``softmax(q·Kᵀ·scale + logw)·V`` with :func:`models.attention.attend`'s layout and causal convention.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), logw (B, Hkv, Tk, 1) / (B, Hkv, Tk) / None; query ``i``
    sits at key position ``Tk - Tq + i`` and sees keys ``<=`` it (the last ``Tq`` keys are the queries' own).
    → (B, Hq, Tq, Dv). Scores are formed in float32 at least.
    """
    if logw is not None and logw.dim() == 4:
        logw = logw.squeeze(-1)  # (B, Hkv, Tk)
    dt = torch.promote_types(q.dtype, torch.float32)
    y = attend(q.to(dt), k.to(dt), v.to(dt), scale=scale, backend="sdpa",
               bias=None if logw is None else logw.to(dt))  # (B, Hq, Tq, Dv)
    return y.to(q.dtype)


def masked_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float,
                  logw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention with transformers' ``mask`` (boolean ``(B or 1, 1, Tq, Tk)``, True = attend, or additive) and
    optional log-weights ``logw (B, Hkv, Tk)`` → ``(B, Hq, Tq, dv)``; a query that sees no key gets zeros."""
    b, hq, t_q, d = q.shape
    hkv, t_k = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.reshape(b, hkv, g * t_q, d)  # (B, Hkv, g·Tq, d): rows ordered (head in group, query)
    if mask.dtype != torch.bool:  # an additive float mask (0 / large negative)
        mask = mask > torch.finfo(mask.dtype).min / 2
    mask = mask.repeat(1, 1, g, 1) if g > 1 else mask  # (B or 1, 1, g·Tq, Tk)
    if logw is not None:  # additive: log-weights where visible, -inf elsewhere
        dt = torch.promote_types(q.dtype, torch.float32)
        qf, k, v = qf.to(dt), k.to(dt), v.to(dt)
        mask = logw.to(dt)[:, :, None, :].masked_fill(~mask, float("-inf"))  # (B, Hkv, g·Tq, Tk)
    y = sdpa(qf, k, v, mask=mask, scale=scale)  # (B, Hkv, g·Tq, dv)
    if logw is not None:
        y = y.nan_to_num(0.0)  # SDPA's fully masked rows under an additive mask
    return y.reshape(b, hq, t_q, v.shape[-1]).to(q.dtype)  # (B, Hq, Tq, dv)


def dense_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                 mask: Optional[torch.Tensor] = None, logw: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> torch.Tensor:
    """The one attention over held keys/values: ``attend`` (``backend``: auto / flash / sdpa) without mask or
    log-weights; :func:`weighted_attend` with log-weights only; :func:`masked_attend` with a mask."""
    if mask is not None:
        return masked_attend(q, k, v, mask, scale=scale, logw=logw)
    if logw is not None:
        return weighted_attend(q, k, v, logw, scale=scale)
    return attend(q, k, v, scale=scale, backend=select_backend(backend, q.device, q.dtype, q.shape[-1], v.shape[-1]))


def kernel_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  mask: Optional[torch.Tensor] = None, logw: Optional[torch.Tensor] = None,
                  k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`dense_attend` of one query per head by the split-KV kernel (``attend(..., backend="split_kv")``):
    q (B, Hq, 1, d), k (B, Hkv, Tk, d), v (B, Hkv, Tk, dv), int8 rows with per-row scales ``(B, Hkv, Tk, 1)``
    allowed. The keys the last row of ``mask`` hides and the log-weights ``logw (B, Hkv, Tk)`` become one additive
    per-key bias; a query that sees no key gets zeros."""
    seen = keys_seen(mask)  # (B|1, Tk) or None
    bias = None if logw is None else logw.float()  # (B, Hkv, Tk)
    if seen is not None:
        hidden = torch.zeros(seen.shape, dtype=torch.float32, device=q.device).masked_fill(~seen, float("-inf"))
        bias = hidden[:, None, :] if bias is None else bias + hidden[:, None, :]  # (B|1, 1|Hkv, Tk)
    return attend(q, k, v, scale=scale, backend="split_kv", bias=bias, k_scale=k_scale, v_scale=v_scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 reference every error measurement compares against: ``logits = scale·q kᵀ`` (``-inf`` where
    ``mask (Tq, T)`` is False), ``α = softmax(logits)``, ``o = α v``; ``q (..., Tq, d)``, ``k (..., T, d)``,
    ``v (..., T, d_v)`` (broadcast over the leading dims) → ``(logits, α, o)``."""
    logits = scale * q.double() @ k.double().transpose(-1, -2)  # (..., Tq, T)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    alpha = torch.softmax(logits, -1)
    return logits, alpha, alpha @ v.double()
