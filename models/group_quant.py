"""Asymmetric group quantisation to ``bits`` ∈ {2, 4, 8} and the bit packing of the codes (``8 / bits`` codes per
byte), written once for keys (groups along tokens, one per channel) and values (groups along channels, per token):
KIVI (:mod:`kvsplice.quant`) and the ``int4`` rows of :class:`models.cache.DecodeCache` (a converted MLA model's
latent and RoPE keys, groups along channels per token).

A group ``x`` of numbers is stored as codes ``c = round((x − m) / s)`` in ``[0, 2^bits − 1]`` with ``m = min x`` and
``s = (max x − m) / (2^bits − 1)``, both fp16 (the fp16-rounded values are the ones used to round), so
``x ≈ c·s + m`` with an error ≤ ``s / 2`` per number.
"""

from __future__ import annotations

import torch

__all__ = ["BITS", "dequantize", "pack_codes", "quantize", "unpack_codes"]

BITS = (2, 4, 8)


def quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 shaped like x, scale fp16, min fp16)``: one group per slice along ``dim`` (the caller reshapes
    so that each group is one slice; the statistics keep ``dim`` as size 1)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    levels = 2 ** bits - 1
    xf = x.float()
    mn = xf.amin(dim, keepdim=True).to(torch.float16)
    scale = ((xf.amax(dim, keepdim=True) - mn.float()) / levels).clamp(min=2.0 ** -14).to(torch.float16)
    c = torch.round((xf - mn.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    return c, scale, mn


def dequantize(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes·scale + min`` at ``dtype`` (statistics broadcast over their group's dim)."""
    return (codes.to(dtype) * scale.to(dtype)).add_(mn.to(dtype))


def pack_codes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., D)`` codes < ``2^bits`` → ``(..., D·bits/8)`` uint8, code ``i`` of a byte in bits ``[bits·i, bits·(i+1))``."""
    per = 8 // bits
    if per == 1:
        return c
    c = c.view(*c.shape[:-1], c.shape[-1] // per, per)  # (..., D/per, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)  # (per,)
    return (c << shifts).sum(-1, dtype=torch.uint8)  # disjoint bit fields: the sum is the bitwise or


def unpack_codes(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(..., D·bits/8)`` uint8 → ``(..., D)`` codes."""
    per = 8 // bits
    if per == 1:
        return p
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)  # (per,)
    c = (p[..., None] >> shifts) & (2 ** bits - 1)  # (..., D/per, per)
    return c.reshape(*p.shape[:-1], p.shape[-1] * per)
