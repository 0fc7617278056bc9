"""``RotatedKIVI``: KIVI storage of keys and values rotated by an orthonormal Hadamard matrix (QuaRot / TurboQuant's
move): a rotation spreads an outlier channel over every channel, so the per-token value groups and per-channel key
groups see no single large number and 2–4-bit codes hold (digits and rare tokens, whose keys carry such outliers,
keep their identity).

Attention is invariant: with ``R`` orthonormal (``R Rᵀ = I``), ``q·k = (qR)·(kR)`` and ``Σ p v = (Σ p vR) Rᵀ``; so the
method rotates the post-RoPE ``q, k, v`` by ``R``, lets :class:`~kvsplice.quant.method.KIVI` store and attend, and
rotates the output back. Same bytes as KIVI (the closed form is KIVI's; ``R`` is not stored per token). Exact when
nothing is quantised (``residual`` covering every token); ``head_dim`` must be a power of two.
"""

from __future__ import annotations

import math

import torch

from kvsplice.quant.method import KIVI

__all__ = ["RotatedKIVI", "hadamard"]


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal Sylvester–Hadamard matrix ``(n, n)`` (``n`` a power of two): ``H Hᵀ = I``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


class RotatedKIVI(KIVI):
    """:class:`KIVI` (``bits``, ``group``, ``residual``) over Hadamard-rotated keys and values."""

    name = "kivi_rotated"

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self.rot = hadamard(adapter.head_dim, dtype, device)  # (D, D) orthonormal

    def append(self, layer, k, v, cache, step):
        super().append(layer, k @ self.rot.to(k.dtype), v @ self.rot.to(v.dtype), cache, step)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        r = self.rot.to(q.dtype)
        y = super().attend(layer, q @ r, k @ r.to(k.dtype), v @ r.to(v.dtype), cache, step, mask=mask, logw=logw)
        return y @ r.T  # (B, Hq, Tq, D): back from the rotated value space

    def __repr__(self) -> str:
        return f"RotatedKIVI(bits={self.bits}, group={self.group}, residual={self.residual})"
