"""RoPE tables for methods that keep keys in the un-rotated (pre-RoPE) space: :class:`RopeTables`.

Both doors hand a method post-RoPE keys (rotated at their positions, as transformers' attention modules do). A
method that stores pre-RoPE coefficients undoes the rotation of the new keys and rotates rebuilt keys at their
positions; both need the cos / sin of those positions. Positions are the absolute positions ``0 .. Tk-1`` of the
keys, or — under transformers' mask with left padding — ``generate``'s numbering of each row's real tokens
(``cumsum`` of the keys the last query sees, minus one).

The tables are the model's own rotary module (``rotary(x, positions) -> cos, sin (B or 1, T, D)``) evaluated once
for positions ``0 .. N-1`` (``N`` grows geometrically) — a function of the position alone, not cache state and not
counted in any cache's bytes (:meth:`RopeTables.nbytes`). Rotary types whose frequencies depend on the length
(``dynamic``, ``longrope``) are recomputed every call. Results are memoised per forward call on the
:class:`~kvsplice.core.method.Step` (shared by the layers).

RoPE convention: ``rot(x) = x ⊙ cos + rotate_half(x) ⊙ sin`` with ``cos, sin`` scaled by the rotary's
``attention_scaling`` ``σ``; its inverse is ``(x ⊙ cos − rotate_half(x) ⊙ sin) / σ²`` because ``sin``'s two halves
repeat (checked).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvsplice.core.attention import keys_seen

__all__ = ["RopeTables"]


class RopeTables:
    """Per-position RoPE tables of one rotary module (see the module docstring)."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary = rotary
        rope_type = str(getattr(rotary, "rope_type", "default"))
        self.static = not ("dynamic" in rope_type or rope_type == "longrope")
        self.sigma2 = float(getattr(rotary, "attention_scaling", 1.0)) ** 2
        self._full: Optional[tuple] = None  # (scale, N, cosᵀ·scale (1, 1, D, N), sinᵀ·scale, un (1, N, 2, D))

    @staticmethod
    def positions(mask: Optional[torch.Tensor], t_k: int) -> Optional[torch.Tensor]:
        """``(B, Tk)`` positions of the keys under transformers' ``mask`` (left padding: each row's real tokens
        numbered from 0), or ``None`` for ``0 .. Tk-1``."""
        seen = keys_seen(mask)
        return None if seen is None else (seen.long().cumsum(-1) - 1).clamp_min(0)  # (B, Tk)

    def cos_sin(self, step, mask: Optional[torch.Tensor], t_k: int, like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin (B or 1, Tk, D)`` of the keys' positions (the reference path's tables), memoised on ``step``."""
        key = ("cos_sin", id(self), t_k, None if mask is None else id(mask))
        hit = step.memo.get(key)
        if hit is None:
            pos = self.positions(mask, t_k)
            hit = step.memo[key] = self.rotary(like, torch.arange(t_k, device=like.device)[None] if pos is None
                                               else pos)
        return hit

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
        key = ("rope", id(self), t_k, t_q, scale, None if mask is None else id(mask))
        hit = step.memo.get(key)
        if hit is not None:
            return hit
        pos = self.positions(mask, t_k)
        if not self.static:  # frequencies depend on the length: this call's positions only
            cos, sin = self.rotary(like, torch.arange(t_k, device=like.device)[None] if pos is None else pos)
            cos_t, sin_t, un = self._derive(cos, sin, scale)  # (B or 1, 1, D, Tk), (B or 1, Tk, 2, D)
            tables = (cos_t, sin_t, un[:, None, t_k - t_q:])  # un (B or 1, 1, Tq, 2, D)
        else:
            full = self._full
            if (full is None or full[0] != scale or full[1] < t_k or full[2].dtype != like.dtype
                    or full[2].device != like.device):
                n = max(t_k, 2 * full[1] if full is not None else 0, 64)
                cos, sin = self.rotary(like, torch.arange(n, device=like.device)[None])  # (1, N, D)
                full = self._full = (scale, n, *self._derive(cos, sin, scale))
            cos_t, sin_t, un = full[2], full[3], full[4]  # (1, 1, D, N), (1, 1, D, N), (1, N, 2, D)
            if pos is None:
                tables = (cos_t[..., :t_k], sin_t[..., :t_k], un[:, None, t_k - t_q:t_k])
            else:
                cos_g = cos_t[0, 0][:, pos].transpose(0, 1).contiguous()[:, None]  # (D, B, Tk) → (B, 1, D, Tk)
                sin_g = sin_t[0, 0][:, pos].transpose(0, 1).contiguous()[:, None]  # (B, 1, D, Tk)
                tables = (cos_g, sin_g, un[0][pos[:, t_k - t_q:]][:, None])  # un (B, 1, Tq, 2, D)
        step.memo[key] = tables
        return tables

    def nbytes(self) -> int:
        """Bytes of the per-position tables (not cache state)."""
        return 0 if self._full is None else sum(t.numel() * t.element_size() for t in self._full[2:])
