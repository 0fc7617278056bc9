"""Which layers of a model pool their KV heads' budgets (``layers=`` of
:class:`~kvsplice.select.kvzip.KVzipSelection` with ``heads="pooled"``): one layer, a range of layers, or a band of
the depth in percent that maps to layers on any model."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PooledLayers", "depth_band"]


@dataclass(frozen=True)
class PooledLayers:
    """``layers=`` of :class:`KVzipSelection`: the layers ``lo`` .. ``hi`` (inclusive), or with ``percent`` the band
    ``[lo, hi)`` percent of the depth (:func:`depth_band`: any model)."""

    lo: int | float
    hi: int | float
    percent: bool = False

    @classmethod
    def parse(cls, layers: int | str) -> "PooledLayers":
        """A layer ``L``, a range ``"A-B"`` (0 <= A <= B) or a band ``"P%-Q%"`` (0 <= P < Q <= 100); else a one-line
        ``ValueError``."""
        parts = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else str(layers).split("-")
        if len(parts) == 2 and all(str(p).endswith("%") for p in parts):
            try:
                lo, hi = (float(str(p)[:-1]) for p in parts)
            except ValueError:
                lo, hi = -1.0, -1.0
            if not 0 <= lo < hi <= 100:
                raise ValueError(f"layers as a band of the depth must be P%-Q% with 0 <= P < Q <= 100, got "
                                 f"{layers!r}")
            return cls(lo, hi, percent=True)
        try:
            lo, hi = int(parts[0]), int(parts[-1])
        except ValueError:
            lo, hi = -1, -1
        if len(parts) > 2 or not 0 <= lo <= hi:
            raise ValueError(f"layers must be a layer, a range A-B of layers (0 <= A <= B) or a band of the depth "
                             f"P%-Q%, got {layers!r}")
        return cls(lo, hi)

    def span(self, n_layer: int) -> tuple[int, int]:
        """The first and last pooled layer of a model with ``n_layer`` layers (checked against its depth)."""
        if self.percent:
            return depth_band((self.lo, self.hi), n_layer)
        if self.hi >= n_layer:
            raise ValueError(f"layers={self}: the model has layers 0-{n_layer - 1}")
        return int(self.lo), int(self.hi)

    def __str__(self) -> str:
        return f"{self.lo:g}%-{self.hi:g}%" if self.percent else f"{self.lo}-{self.hi}"


def depth_band(band: tuple[float, float], n_layer: int) -> tuple[int, int]:
    """The layers ``(A, B)`` (inclusive) of a model with ``n_layer`` layers whose middles lie in the band ``[P, Q)``
    percent of its depth (layer ``l``'s middle: ``100·(l + ½)/n_layer``; ``50%-67%`` of 30 layers: 15-19)."""
    inside = [l for l in range(n_layer) if band[0] <= 100 * (l + 0.5) / n_layer < band[1]]
    if not inside:
        raise ValueError(f"layers={band[0]:g}%-{band[1]:g}% holds none of the model's {n_layer} layers: widen the "
                         f"band")
    return inside[0], inside[-1]
