"""RoPE tables for methods that keep keys in the un-rotated (pre-RoPE) space: :class:`RopeTables`.

Both doors hand a method post-RoPE keys (rotated at their positions, as transformers' attention modules do). A
method that stores pre-RoPE coefficients undoes the rotation of the new keys and rotates rebuilt keys at their
positions; both need the cos / sin of those positions. The ``Tk`` keys a layer holds are its last ``Tk`` tokens (a
sliding-window layer drops older ones: the first held key sits at ``offset = step.start + Tq - Tk``), so their
positions are ``offset .. offset + Tk - 1`` — or, under transformers' mask with left padding, ``generate``'s
numbering of each row's real tokens (``cumsum`` of the keys some query sees, minus one, plus the real tokens the
window dropped: ``offset - step.pads``).

The tables are the model's own rotary module (``rotary(x, positions) -> cos, sin (B or 1, T, D)``) evaluated once
for positions ``0 .. N-1`` (``N`` grows geometrically) — a function of the position alone, not cache state and not
counted in any cache's bytes (:meth:`RopeTables.nbytes`). Rotary types whose frequencies depend on the length
(``dynamic``, ``longrope``) are recomputed every call. Results are memoised per forward call on the
:class:`~kvsplice.core.method.Step` (shared by the layers). A model whose layers rotate differently (Gemma-3: a
local and a global RoPE base) has one :class:`RopeTables` per rotary, shared by the layers using it
(:func:`rope_tables`). Partial rotary (only the first dims of a head rotate) has no pre-RoPE form here and is
refused.

RoPE convention: ``rot(x) = x ⊙ cos + rotate_half(x) ⊙ sin`` with ``cos, sin`` scaled by the rotary's
``attention_scaling`` ``σ``; its inverse is ``(x ⊙ cos − rotate_half(x) ⊙ sin) / σ²`` because ``sin``'s two halves
repeat (checked).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from models.rope import rotate_half


__all__ = ["RopeTables", "rope_tables", "seen_by_any"]


def seen_by_any(mask: torch.Tensor) -> torch.Tensor:
    """``(B or 1, Tk)`` bool: the keys some query of ``mask`` sees — a row's real (not padding) keys, also under a
    sliding window, where the last query no longer sees the oldest keys."""
    m = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return m[:, 0].any(dim=-2)


def rope_tables(adapter) -> list["RopeTables"]:
    """One :class:`RopeTables` per layer of ``adapter``'s model, shared by the layers with the same rotary."""
    if adapter.rotary_dim != adapter.head_dim:
        raise ValueError(f"pre-RoPE keys need a rotary over the whole head: this {adapter.name} model rotates "
                         f"{adapter.rotary_dim} of {adapter.head_dim} dims (partial_rotary_factor); use post-RoPE")
    shared: dict[int, RopeTables] = {}
    out = []
    for l in range(adapter.n_layer):
        rot = adapter.rotary_embedding(l)
        if id(rot) not in shared:
            shared[id(rot)] = RopeTables(rot)
        out.append(shared[id(rot)])
    return out


class RopeTables:
    """Per-position RoPE tables of one rotary module (see the module docstring)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        rope_type = str(getattr(rotary, "rope_type", "default"))
        self.static = not ("dynamic" in rope_type or rope_type == "longrope")
        self.sigma2 = float(getattr(rotary, "attention_scaling", 1.0)) ** 2
        self._full: Optional[tuple] = None  # (scale, N, cosᵀ·scale (1, 1, D, N), sinᵀ·scale, un (1, N, 2, D))

    def unrotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``x`` back to the un-rotated space at the positions of ``cos, sin`` (broadcast to ``x``):
        ``(x⊙cos − rotate_half(x)⊙sin) / σ²`` (the module docstring's inverse)."""
        return (x * cos - rotate_half(x) * sin) / self.sigma2

    @staticmethod
    def positions(mask: Optional[torch.Tensor], t_k: int, offset: int = 0,
                  pads: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """``(B or 1, Tk)`` positions of the ``Tk`` held keys, the first at column ``offset`` of the tokens seen (see
        the module docstring), under transformers' ``mask`` (left padding: each row's real tokens numbered from 0;
        ``pads (B,)`` its padding columns), or ``None`` without a mask: ``offset .. offset + Tk - 1``."""
        if mask is None:
            return None
        pos = seen_by_any(mask).long().cumsum(-1) - 1  # (B or 1, Tk)
        if offset:  # + the real tokens the window dropped
            dropped = torch.full((pos.shape[0],), offset, device=pos.device)
            pos = pos + (dropped if pads is None else (dropped - pads.to(pos.device)).clamp_min(0))[:, None]
        return pos.clamp_min(0)

    @staticmethod
    def _offset(step, t_k: int, t_q: int) -> int:
        """Column of the first held key: tokens seen before this call + the call's, minus those held."""
        return step.start + t_q - t_k

    def cos_sin(self, step, mask: Optional[torch.Tensor], t_k: int, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin (B or 1, Tk, D)`` of the keys' positions (the reference path's tables), memoised on ``step``."""
        off = self._offset(step, t_k, step.t)
        key = ("cos_sin", id(self), t_k, off, None if mask is None else id(mask))
        hit = step.memo.get(key)
        if hit is None:
            pos = self.positions(mask, t_k, off, step.pads)
            pos = torch.arange(off, off + t_k)[None] if pos is None else pos  # (B or 1, Tk)
            hit = step.memo[key] = self._check(self.rotary(like, pos.to(like.device)), like)
        return hit

    @staticmethod
    def _check(cs: tuple[torch.Tensor, torch.Tensor], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if cs[0].shape[-1] != like.shape[-1]:
            raise ValueError(f"pre-RoPE keys need a rotary over the whole head ({like.shape[-1]} dims); this one "
                             f"rotates {cs[0].shape[-1]} (partial rotary): use post-RoPE")
        return cs

    def _derive(self, cos: torch.Tensor, sin: torch.Tensor, scale: float):
        """``cos, sin (B or 1, T, D)`` → ``(cosᵀ·scale, sinᵀ·scale (B or 1, 1, D, T), un (B or 1, T, 2, D))``."""
        h = cos.shape[-1] // 2
        if not torch.equal(sin[..., :h], sin[..., h:]):
            raise ValueError("pre-RoPE coefficients need rotate_half RoPE tables whose halves repeat (Llama's)")
        cos_t = (cos * scale).transpose(1, 2).contiguous()[:, None]  # (B or 1, 1, D, T)
        sin_t = (sin * scale).transpose(1, 2).contiguous()[:, None]  # (B or 1, 1, D, T)
        un = torch.stack([cos, sin], dim=-2) / self.sigma2  # (B or 1, T, 2, D)
        return cos_t, sin_t, un

    def tables(self, step, mask: Optional[torch.Tensor], t_k: int, t_q: int, scale: float, like: torch.Tensor):
        """For the ``Tk`` keys of this call (the last ``Tq`` new): ``cosᵀ·scale, sinᵀ·scale (B or 1, 1, D, Tk)``
        (rotating rebuilt keys, transposed, softmax scale folded in) and ``un (B or 1, 1, Tq, 2, D) = [cos ; sin]/σ²``
        of the new positions (the inverse rotation, folded into an encoder). Memoised on ``step``."""
        off = self._offset(step, t_k, t_q)
        key = ("rope", id(self), t_k, t_q, off, scale, None if mask is None else id(mask))
        hit = step.memo.get(key)
        if hit is not None:
            return hit
        pos = self.positions(mask, t_k, off, step.pads)
        if pos is not None:
            pos = pos.to(like.device)
        if not self.static:  # frequencies depend on the length: this call's positions only
            cos, sin = self._check(self.rotary(like, torch.arange(off, off + t_k, device=like.device)[None]
                                               if pos is None else pos), like)
            cos_t, sin_t, un = self._derive(cos, sin, scale)  # (B or 1, 1, D, Tk), (B or 1, Tk, 2, D)
            tables = (cos_t, sin_t, un[:, None, t_k - t_q:])  # un (B or 1, 1, Tq, 2, D)
        else:
            full = self._full
            need = off + t_k  # columns seen: no position is larger (padding only lowers them)
            if (full is None or full[0] != scale or full[1] < need or full[2].dtype != like.dtype
                    or full[2].device != like.device):
                n = max(need, 2 * full[1] if full is not None else 0, 64)
                cos, sin = self._check(self.rotary(like, torch.arange(n, device=like.device)[None]), like)  # (1, N, D)
                full = self._full = (scale, n, *self._derive(cos, sin, scale))
            cos_t, sin_t, un = full[2], full[3], full[4]  # (1, 1, D, N), (1, 1, D, N), (1, N, 2, D)
            if pos is None:
                tables = (cos_t[..., off:off + t_k], sin_t[..., off:off + t_k], un[:, None, off + t_k - t_q:off + t_k])
            else:
                cos_g = cos_t[0, 0][:, pos].transpose(0, 1).contiguous()[:, None]  # (D, B, Tk) → (B, 1, D, Tk)
                sin_g = sin_t[0, 0][:, pos].transpose(0, 1).contiguous()[:, None]  # (B, 1, D, Tk)
                tables = (cos_g, sin_g, un[0][pos[:, t_k - t_q:]][:, None])  # un (B, 1, Tq, 2, D)
        step.memo[key] = tables
        return tables

    def nbytes(self) -> int:
        """Bytes of the per-position tables (not cache state)."""
        return 0 if self._full is None else sum(t.numel() * t.element_size() for t in self._full[2:])
