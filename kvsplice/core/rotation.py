"""The Hadamard frame of a storage method: rows stored rotated by an orthonormal Hadamard matrix ``R`` (QuaRot /
TurboQuant's move: a rotation spreads an outlier channel over every channel, so low-bit groups see no single large
number). Attention is invariant — ``q·k = (qR)·(kR)`` and ``Σ p v = (Σ p vR) Rᵀ`` — so a method stores ``kR, vR``,
attends with ``qR`` and rotates the output back (:class:`HadamardFrame`); ``R`` is not stored per token."""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["HadamardFrame", "hadamard"]


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal Sylvester–Hadamard matrix ``(n, n)`` (``n`` a power of two): ``H Hᵀ = I``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


class HadamardFrame:
    """Mixin of a storage method whose rows may live in the rotated frame: :meth:`set_rotation` at bind time
    (``None`` or a head dimension), then :meth:`rotated` for queries, keys and values and :meth:`unrotated` for
    attention outputs — both the identity without a rotation."""

    rot: Optional[torch.Tensor] = None

    def set_rotation(self, head_dim: Optional[int], dtype: torch.dtype, device) -> None:
        self.rot = None if head_dim is None else hadamard(head_dim, dtype, device)  # (D, D) orthonormal

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., D)`` in the stored rows' frame: ``x R`` (``x`` without a rotation)."""
        return x if self.rot is None else x @ self.rot.to(device=x.device, dtype=x.dtype)

    def unrotated(self, y: torch.Tensor) -> torch.Tensor:
        """An attention output ``y (..., D)`` back from the rotated frame: ``y Rᵀ`` (``y`` without a rotation)."""
        return y if self.rot is None else y @ self.rot.to(device=y.device, dtype=y.dtype).T
