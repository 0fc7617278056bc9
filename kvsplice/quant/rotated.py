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

from kvsplice.core.rotation import HadamardFrame, hadamard
from kvsplice.quant.method import KIVI

__all__ = ["RotatedKIVI", "hadamard"]


class RotatedKIVI(HadamardFrame, KIVI):
    """:class:`KIVI` (``bits``, ``group``, ``residual``) over Hadamard-rotated keys and values
    (:class:`~kvsplice.core.rotation.HadamardFrame`)."""

    name = "kivi_rotated"

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self.set_rotation(adapter.head_dim, dtype, device)

    def append(self, layer, k, v, cache, step):
        super().append(layer, self.rotated(k), self.rotated(v), cache, step)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        y = super().attend(layer, self.rotated(q), self.rotated(k), self.rotated(v), cache, step, mask=mask, logw=logw)
        return self.unrotated(y)  # (B, Hq, Tq, D): back from the rotated value space

    def __repr__(self) -> str:
        return f"RotatedKIVI(bits={self.bits}, group={self.group}, residual={self.residual})"
