"""Quantised rows, one interface: a :class:`Quantizer` stores rows ``x (..., D)`` as named parts and reads them back,
and says what one row costs. Every quantised cache uses it: :class:`models.stream_cache.DecodeCache` (``quant="int8"`` /
``"int4"``), its fixed-capacity view, KIVI (:mod:`kvsplice.quant`) and the decode-from-codes attention
(:mod:`kvsplice.core.coded`, which reads the same parts without dequantising).

| mode | quantiser | a row of ``D`` numbers is stored as | bytes a row (:meth:`Quantizer.row_bytes`) |
| --- | --- | --- | --- |
| ``"int8"`` | :class:`Int8Rows` | int8 codes, one fp16 absmax scale | ``D + 2`` |
| ``"int4"`` | :class:`GroupRows` (4 bits) | ``8 / bits`` codes per byte, an fp16 scale and minimum per group of ``G`` | ``D·bits/8 + 4·D/G`` |

Parts are named by suffix: ``""`` (the codes), :data:`SCALE`, :data:`MIN`; a cache stores part ``p`` of stream
``name`` as buffer ``name + p``.

Group quantisation (asymmetric, ``bits`` ∈ {2, 4, 8}): a group ``x`` is stored as codes ``c = round((x − m) / s)`` in
``[0, 2^bits − 1]`` with ``m = min x`` and ``s = (max x − m) / (2^bits − 1)``, both fp16 (the fp16-rounded values
are the ones used to round), so ``x ≈ c·s + m`` with an error ≤ ``s / 2`` per number. Groups run along the row
(values; the int4 rows) or, for KIVI's keys, along the tokens of one channel (:meth:`GroupRows.quantize_tokens`).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

__all__ = ["BITS", "INT4_GROUP", "MIN", "QUANT_MODES", "SCALE", "GroupRows", "Int8Rows", "Quantizer",
           "dequantize", "dequantize_int8", "int4_row_bytes", "pack_codes", "quantize", "quantize_int8",
           "row_bytes", "row_quantizer", "unpack_codes"]

BITS = (2, 4, 8)
SCALE = ".scale"
"""Suffix of a quantised stream's scales (int8: ``(…, T, 1)`` fp16; groups: ``(…, T, D / G)``)."""
MIN = ".min"
"""Suffix of a group-quantised stream's minima (``(…, T, D / G)`` fp16)."""
INT4_GROUP = 32
"""Numbers per group of an int4 row, when the row's width is a multiple of it (else the whole row is one group)."""


# ------------------------------------------------------------------------------------------ the arithmetic
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


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 per row of the last dim: ``x (..., D)`` → ``q (..., D)`` int8 in [-127, 127] and
    ``scale (..., 1)`` fp16 with ``x ≈ q · scale`` (the fp16-rounded scale is the one used to round; rows of no
    numbers, ``D = 0``, get the smallest)."""
    xf = x.float()
    top = xf.abs().amax(-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(*xf.shape[:-1], 1)  # (..., 1)
    scale = (top / 127.0).clamp(2.0**-14, 65504.0).to(torch.float16)  # (..., 1)
    q = torch.round(xf / scale.float()).clamp_(-127, 127).to(torch.int8)  # (..., D)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q · scale`` at ``dtype`` (a transient tensor for the attention call; never stored)."""
    return q.to(dtype) * scale.to(dtype)


# ------------------------------------------------------------------------------------------ the interface
class Quantizer:
    """How one kind of quantised row is stored: :meth:`parts` (suffix → width and dtype a row), :meth:`quantize`,
    :meth:`dequantize` and :meth:`row_bytes` (== the bytes of the parts :meth:`quantize` returns, per row)."""

    name: str

    def parts(self, d: int) -> dict[str, tuple[int, torch.dtype]]:
        """The stored parts of a row of width ``d``: suffix → (width, dtype)."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``x (..., D)`` → their parts ``{suffix: (..., width)}``."""
        raise NotImplementedError

    def dequantize(self, parts: Mapping[str, torch.Tensor], d: int, dtype: torch.dtype,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Parts of rows of width ``d`` → the rows ``(..., D)`` at ``dtype`` (written into ``out`` when given)."""
        raise NotImplementedError

    def row_bytes(self, d: int) -> int:
        """Bytes of one stored row of width ``d``."""
        return sum(w * torch.empty((), dtype=dt).element_size() for w, dt in self.parts(d).values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Int8Rows(Quantizer):
    """Symmetric absmax int8 per row (:func:`quantize_int8`): the codes and one fp16 scale."""

    name = "int8"

    def parts(self, d):
        return {"": (d, torch.int8), SCALE: (1, torch.float16)}

    def quantize(self, x):
        q, scale = quantize_int8(x)  # (..., D) int8, (..., 1) fp16
        return {"": q, SCALE: scale}

    def dequantize(self, parts, d, dtype, out=None):
        if out is None:
            return dequantize_int8(parts[""], parts[SCALE], dtype)
        return out.copy_(parts[""]).mul_(parts[SCALE])


class GroupRows(Quantizer):
    """Asymmetric ``bits``-bit codes packed ``8 / bits`` per byte, groups of ``group`` numbers along the row (default
    :data:`INT4_GROUP`, or the whole row when its width is not a multiple of it), an fp16 scale and minimum each."""

    def __init__(self, bits: int = 4, group: Optional[int] = None) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        self.bits, self.group, self.name = bits, group, f"int{bits}"

    def group_of(self, d: int) -> int:
        """Numbers per group of a row of width ``d``."""
        if self.group is not None:
            return self.group
        return INT4_GROUP if d % INT4_GROUP == 0 else d

    def parts(self, d):
        ng = d // self.group_of(d)
        return {"": (d * self.bits // 8, torch.uint8), SCALE: (ng, torch.float16), MIN: (ng, torch.float16)}

    def quantize(self, x):
        g = self.group_of(x.shape[-1])
        codes, scale, mn = quantize(x.unflatten(-1, (-1, g)), -1, self.bits)  # (..., D/G, G), (..., D/G, 1)
        return {"": pack_codes(codes.flatten(-2), self.bits), SCALE: scale[..., 0], MIN: mn[..., 0]}

    def dequantize(self, parts, d, dtype, out=None):
        codes = unpack_codes(parts[""], self.bits).unflatten(-1, (-1, self.group_of(d)))  # (..., D/G, G)
        x = dequantize(codes, parts[SCALE][..., None], parts[MIN][..., None], dtype).flatten(-2)  # (..., D)
        return x if out is None else out.copy_(x)

    def quantize_tokens(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Groups along the tokens instead (KIVI's keys: one group per channel and ``group`` tokens): ``x (..., T, D)``
        → codes packed along the row ``(..., T, D·bits/8)``, scale and minimum ``(..., T/G, D)``."""
        x = x.unflatten(-2, (-1, self.group))  # (..., T/G, G, D)
        codes, scale, mn = quantize(x, -2, self.bits)  # (..., T/G, G, D), stats (..., T/G, 1, D)
        return {"": pack_codes(codes.flatten(-3, -2), self.bits), SCALE: scale[..., 0, :], MIN: mn[..., 0, :]}

    def dequantize_tokens(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`quantize_tokens`: ``(..., T, D)`` at ``dtype``."""
        codes = unpack_codes(parts[""], self.bits).unflatten(-2, (-1, self.group))  # (..., T/G, G, D)
        return dequantize(codes, parts[SCALE][..., None, :], parts[MIN][..., None, :], dtype).flatten(-3, -2)

    def __repr__(self) -> str:
        return f"GroupRows(bits={self.bits}, group={self.group})"


_ROWS = {"int8": Int8Rows(), "int4": GroupRows(4)}
QUANT_MODES = (None, *_ROWS)
"""How a stream of a :class:`models.stream_cache.DecodeCache` may be stored: ``None`` (at the cache dtype) or a row
quantiser's name."""


def row_quantizer(mode: Optional[str]) -> Optional[Quantizer]:
    """The quantiser of a cache mode (:data:`QUANT_MODES`), None for rows at the cache dtype."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {mode!r}")
    return None if mode is None else _ROWS[mode]


def row_bytes(mode: Optional[str], d: int, dtype: torch.dtype) -> int:
    """Bytes of one cached row of width ``d`` stored as ``mode``: ``d`` numbers at ``dtype``, or the quantiser's."""
    q = row_quantizer(mode)
    return d * torch.empty((), dtype=dtype).element_size() if q is None else q.row_bytes(d)


def int4_row_bytes(d: int) -> int:
    """Bytes of one int4 row of width ``d`` (even): ``d / 2`` code bytes and an fp16 scale and minimum per group."""
    return _ROWS["int4"].row_bytes(d)
