"""Attention of a decode step straight from quantised rows: no dequantised copy of the held keys and values.

A compressed cache that dequantises everything it holds at every step (codes unpacked, times the scale, plus the
minimum, copied into a workspace, then attention over it) makes five or six passes over a full-precision-sized
tensor per stream — slower per token than the full cache it is meant to beat. Here the scales and minima are
folded into the small operands instead:

* **int8 rows** (one scale ``s_t`` per row): ``q·k_t = s_t · (q·c_t)`` and ``Σ_t p_t v_t = Σ_t (p_t s_t) c_t``;
* **4-bit rows in groups of channels** (an fp16 scale and minimum per group of a token's row, ``models.quant`` int4
  rows, KIVI's values): per group ``γ``, ``Σ_{c∈γ} q_c k_{t,c} = s_{t,γ} Σ_{c∈γ} q_c c_{t,c} + m_{t,γ} Σ_{c∈γ} q_c``;
* **4-bit keys in groups of tokens** (KIVI's keys: a scale and minimum per channel and group of ``G`` tokens):
  ``q·k_t = Σ_c (q_c s_{γ(t),c}) c_{t,c} + Σ_c q_c m_{γ(t),c}``, one small matrix product per token group;

so the only pass over the held rows is their conversion to floats. Packed 4-bit codes are not unpacked either:
with ``b`` a byte (code ``lo`` in its low nibble, channel ``2j``; ``hi`` in its high nibble, channel ``2j + 1``),
``lo = b − 16·hi``, hence ``q_{2j}·lo + q_{2j+1}·hi = q_{2j}·b + (q_{2j+1} − 16 q_{2j})·hi``: the byte as a float
and its high nibble as a float are the two operands (:func:`nibbles`). The scores of every segment of the step
(quantised rows, the full-precision window, a pool shared by the heads) are joined, biased (log-weights, a pooled
head's ownership) and soft-maxed once in float32.

This is the same attention, in another order of sums: the tests compare it with the dequantise-then-attend
reference (``tests/kvsplice/core/test_coded.py``). Transient per call: the float conversion of one layer's codes and scores of
``g`` query rows per key — a workspace, not cache bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvsplice.core.attention import keys_seen
from models.quant import MIN, SCALE

__all__ = ["ChannelGroupKeys", "Rows", "Segment", "coded_attend", "nibbles", "seen_bias", "split_bias",
           "stream_rows"]


_CONST: dict = {}


def _const(kind: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small constant operands, made once: ``"pair"`` — ``[[1, 0], [-16, 1]]``, from the sums against a byte and
    its high nibble to the sums against the two codes; ``"pairq"`` — its transpose, the weights of a byte and a high
    nibble from two channels' weights; ``"own"`` ``(n, n)`` — the identity, a group's own columns."""
    key = (kind, n, dtype, device)
    t = _CONST.get(key)
    if t is None:
        if kind == "own":
            t = torch.eye(n, dtype=dtype, device=device)
        else:
            t = torch.tensor([[1.0, 0.0], [-16.0, 1.0]], dtype=dtype, device=device)
            t = t if kind == "pair" else t.T.contiguous()
        _CONST[key] = t
    return t


def nibbles(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed 4-bit codes ``p (..., D/2)`` uint8 (channel ``2j`` in the low nibble of byte ``j``) → ``(..., D)`` at
    ``dtype``: the bytes ``b_j`` (columns ``0 .. D/2 − 1``), then their high nibbles ``hi_j`` (``code_{2j} = b_j −
    16·hi_j``, ``code_{2j+1} = hi_j``): one conversion, no unpacking (blocks, not interleaved: a strided write
    costs twice as much)."""
    return torch.cat((p, p >> 4), -1).to(dtype)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Weights of the codes ``x (..., D)`` → the weights of :func:`nibbles`' columns: ``x_{2j}`` on byte ``j``,
    ``x_{2j+1} − 16 x_{2j}`` on its high nibble."""
    w = x.unflatten(-1, (-1, 2)) @ _const("pairq", 2, x.dtype, x.device)  # (..., D/2, 2)
    return w.transpose(-1, -2).flatten(-2)


def _unpairs(o: torch.Tensor) -> torch.Tensor:
    """Sums against :func:`nibbles`' columns ``(..., D)`` → the sums against the codes: ``o_{b_j} − 16 o_{hi_j}``
    for channel ``2j``, ``o_{hi_j}`` for ``2j + 1``."""
    return (o.unflatten(-1, (2, -1)).transpose(-1, -2) @ _const("pair", 2, o.dtype, o.device)).flatten(-2)


@dataclass
class Rows:
    """Rows ``(B, H, n, D)`` as stored (the parts of :mod:`models.quant`'s quantisers): ``kind`` ``"float"``
    (``data``), ``"int8"`` (``data`` int8, ``scale`` ``(B, H, n, 1)``) or ``"int4"`` (``data`` packed codes
    ``(B, H, n, D/2)``, ``scale`` and ``mn`` ``(B, H, n, D/G)``: groups of ``G`` channels per token)."""

    kind: str
    data: torch.Tensor
    scale: Optional[torch.Tensor] = None
    mn: Optional[torch.Tensor] = None

    @property
    def n(self) -> int:
        return self.data.shape[2]

    def scores(self, qf: torch.Tensor) -> torch.Tensor:
        """``qf (B, H, R, D)`` float32 → ``q·k (B, H, R, n)``."""
        if self.kind == "float":
            return qf @ self.data.to(qf.dtype).transpose(-1, -2)
        if self.kind == "int8":
            return (qf @ self.data.to(qf.dtype).transpose(-1, -2)) * self.scale.to(qf.dtype).transpose(-1, -2)
        b, h, r, d = qf.shape
        ng = self.scale.shape[-1]
        x = nibbles(self.data, qf.dtype)  # (B, H, n, D): bytes and high nibbles
        w = _pairs(qf).unflatten(-1, (2, ng, -1))  # (B, H, R, 2, ng, D/2/ng): bytes', nibbles' weights by group
        own = _const("own", ng, qf.dtype, qf.device)[:, None, None, :, None]  # (ng, 1, 1, ng, 1)
        wg = (w[:, :, None] * own).flatten(-3)  # (B, H, ng, R, D): zero outside group γ
        part = wg.flatten(2, 3) @ x.transpose(-1, -2)  # (B, H, ng·R, n): Σ_{c∈γ} q_c code_{t,c}
        qsum = qf.view(b, h, r, ng, d // ng).sum(-1)  # (B, H, R, ng): Σ_{c∈γ} q_c
        s, m = self.scale.to(qf.dtype), self.mn.to(qf.dtype)  # (B, H, n, ng)
        return torch.einsum("bhgrn,bhng->bhrn", part.view(b, h, ng, r, -1), s) + qsum @ m.transpose(-1, -2)

    def weighted(self, p: torch.Tensor) -> torch.Tensor:
        """Weights ``p (B, H, R, n)`` float32 → ``Σ_t p_t v_t (B, H, R, D)``."""
        if self.kind == "float":
            return p @ self.data.to(p.dtype)
        if self.kind == "int8":
            return (p * self.scale.to(p.dtype).transpose(-1, -2)) @ self.data.to(p.dtype)
        b, h, r, n = p.shape
        ng, d = self.scale.shape[-1], 2 * self.data.shape[-1]
        x = nibbles(self.data, p.dtype)  # (B, H, n, D)
        s, m = self.scale.to(p.dtype), self.mn.to(p.dtype)  # (B, H, n, ng)
        st = s.transpose(-1, -2).contiguous()  # (B, H, ng, n): contiguous along tokens (a strided one is slow)
        ws = (p[:, :, None] * st[:, :, :, None]).flatten(2, 3)  # (B, H, ng·R, n): p_t s_{t,γ}
        o = (ws @ x).view(b, h, ng, r, 2, ng, d // 2 // ng)  # (B, H, γ of the weights, R, 2, γ of the columns, ·)
        o = torch.diagonal(o, dim1=2, dim2=5).permute(0, 1, 2, 3, 5, 4).reshape(b, h, r, d)  # each column's own γ
        return _unpairs(o) + (p @ m).repeat_interleave(d // ng, -1)  # (B, H, R, D)


@dataclass
class ChannelGroupKeys:
    """KIVI's keys ``(B, H, n, D)``: packed 4-bit codes (or bytes at 8 bits) ``data (B, H, n, D·bits/8)``, a scale
    and a minimum per channel and group of ``G`` tokens, ``scale``/``mn (B, H, n/G, D)``."""

    data: torch.Tensor
    scale: torch.Tensor
    mn: torch.Tensor
    bits: int

    @property
    def n(self) -> int:
        return self.data.shape[2]

    def scores(self, qf: torch.Tensor) -> torch.Tensor:
        b, h, r, d = qf.shape
        ng = self.scale.shape[2]
        g = self.n // ng
        s, m = self.scale.to(qf.dtype), self.mn.to(qf.dtype)  # (B, H, ng, D)
        qs = qf[:, :, None] * s[:, :, :, None]  # (B, H, ng, R, D): q scaled per token group
        if self.bits == 8:
            c = self.data.to(qf.dtype).view(b, h, ng, g, d)
            part = c @ qs.transpose(-1, -2)  # (B, H, ng, G, R)
        else:  # bytes and high nibbles against the pairs' weights
            part = nibbles(self.data, qf.dtype).view(b, h, ng, g, d) @ _pairs(qs).transpose(-1, -2)  # (B,H,ng,G,R)
        bias = qf @ m.transpose(-1, -2)  # (B, H, R, ng): Σ_c q_c m_{γ,c}
        return part.permute(0, 1, 4, 2, 3).reshape(b, h, r, self.n) + bias.repeat_interleave(g, -1)


@dataclass
class Segment:
    """Keys and values a step attends over: ``keys`` / ``values`` (``Rows`` or ``ChannelGroupKeys``), ``bias``
    ``(B, H, n)`` added to the scores (log-weights; ``-inf`` hides), ``shared``: one row sequence (``H = 1``) every
    query head reads (a pool), its ``bias`` per KV head ``(B, Hkv, n)``."""

    keys: object
    values: Rows
    bias: Optional[torch.Tensor] = None
    shared: bool = False


def coded_attend(q: torch.Tensor, segments: Sequence[Segment], *, scale: float) -> torch.Tensor:
    """One decode query per head, ``q (B, Hq, 1, D)``, over ``segments`` (their keys in order; a step's own new
    token is in one of them) → ``(B, Hq, 1, Dv)`` at ``q``'s dtype: ``softmax(q·Kᵀ·scale + bias)·V`` with scores
    and sums in float32 (query head ``h`` reads KV head ``h // (Hq / Hkv)``)."""
    b, hq, t_q, d = q.shape
    if t_q != 1:
        raise ValueError(f"coded_attend takes one query per head, got {t_q}")
    dt = torch.promote_types(q.dtype, torch.float32)
    qs = q.to(dt) * scale
    hkv = next((s.values.data.shape[1] for s in segments if not s.shared), None)
    if hkv is None:
        raise ValueError("coded_attend needs a segment with the KV heads (the new token's)")
    rows = qs.reshape(b, hkv, hq // hkv, d)  # (B, Hkv, g, D)
    parts = []
    for s in segments:
        x = s.keys.scores(qs.reshape(b, 1, hq, d) if s.shared else rows).view(b, hkv, hq // hkv, -1)  # (B, Hkv, g, n)
        if s.bias is not None:
            x = x + s.bias.to(dt)[:, :, None, :]
        parts.append(x)
    p = torch.softmax(parts[0] if len(parts) == 1 else torch.cat(parts, -1), -1)  # (B, Hkv, g, Σn)
    if any(s.bias is not None for s in segments):
        p = p.nan_to_num_(0.0)  # a row whose every key is hidden
    y, at = 0, 0
    for s, x in zip(segments, parts):
        ps = p[..., at:at + x.shape[-1]]
        at += x.shape[-1]
        out = s.values.weighted(ps.reshape(b, 1, hq, -1) if s.shared else ps)  # (B, 1|Hkv, Hq|g, Dv)
        y = y + out.reshape(b, hkv, hq // hkv, -1)
    return y.reshape(b, hq, 1, -1).to(q.dtype)


def stream_rows(cache, layer: int, name: str) -> Rows:
    """Stream ``name`` of ``layer`` of a :class:`models.stream_cache.DecodeCache` as it is stored (no copy): float rows,
    int8 rows with their scales or int4 rows with their groups' scales and minima."""
    rows = cache.stored(layer)
    mode = cache.mode(name)
    if mode is None:
        return Rows("float", rows[name])
    return Rows(mode, rows[name], rows[name + SCALE], rows.get(name + MIN))


def seen_bias(mask: Optional[torch.Tensor], b: int, h: int, n: int) -> Optional[torch.Tensor]:
    """A one-query step's mask (transformers', over the ``n`` keys held) → an additive bias ``(B, H, n)``
    (``-inf`` where the query may not look), or ``None``."""
    if mask is None:
        return None
    seen = keys_seen(mask)  # (B|1, n)
    if seen.shape[-1] != n:
        raise ValueError(f"a mask over {seen.shape[-1]} keys for {n} held")
    hidden = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill(~seen, float("-inf"))
    return hidden[:, None, :].expand(b, h, n)


def split_bias(bias: Optional[torch.Tensor], sizes: Sequence[int]) -> list[Optional[torch.Tensor]]:
    """``bias (B, H, Σ sizes)`` (or ``None``) cut along the keys into the segments' pieces."""
    if bias is None:
        return [None] * len(sizes)
    return list(torch.split(bias, list(sizes), dim=-1))
