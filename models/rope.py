"""Rotary position embedding (rotate-half layout, Llama's): what the ``deepseek_v3`` layout's attention applies.

Pairs ``(x_i, x_{i + D/2})`` rotate by ``pos · θ^(-2i/D)``. The DeepSeek-V3 export permutes the RoPE columns to
DeepSeek's interleaved pairs ``(x_{2i}, x_{2i+1})`` (``rope_interleave: true``); the Llama export keeps them.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (..., T, D)`` rotated by the tables ``cos, sin`` (broadcast against it): ``x⊙cos + rotate_half(x)⊙sin``."""
    return x * cos + rotate_half(x) * sin


class Rotary(nn.Module):
    """``rotary(x, y, pos=pos)``: ``x``, ``y`` ``(..., T, D)`` rotated at absolute positions ``pos (T,)``.

    The frequencies are kept in fp32 off the module's buffers (one copy per device), so casting the model to
    fp16 / bf16 does not round them; the rotation itself runs in ``x``'s dtype.
    """

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE rotates pairs: dim must be even, got {dim}")
        self.dim, self.theta = dim, float(theta)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """``θ^(-2i/D)``, ``(D/2,)`` fp32 on ``device``."""
        f = self._inv_freq.get(device)
        if f is None:
            f = self.theta ** (-torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
            self._inv_freq[device] = f
        return f

    def tables(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``(T, D)`` at ``pos (T,)`` (each frequency twice: rotate-half layout)."""
        ang = pos.float()[:, None] * self.inv_freq(pos.device)[None]  # (T, D/2)
        ang = torch.cat([ang, ang], dim=-1)  # (T, D)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def forward(self, *xs: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each of ``xs`` rotated at ``pos``; the tables are computed once for all of them."""
        cos, sin = self.tables(pos, xs[0].dtype)  # (T, D), broadcast over the leading dims of each x (..., T, D)
        return tuple(rotate(x, cos, sin) for x in xs)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, theta={self.theta:g}"
