"""The coefficient cache: post-training low-rank bases, only the coefficients are cached.

Per layer and KV head ``j`` the cache holds ``T × R_k[j]`` key coefficients ``a = k @ k_enc`` and ``T × R_v[j]``
value coefficients ``b = v @ v_enc`` (see :mod:`kvsplice.lowrank.bases`). Ranks may differ per head and per layer
(energy-chosen ranks), so the stream layout is chosen per layer:

* the layer's KV heads share their ranks (all ``R_k`` equal and all ``R_v`` equal) → one stream per kind,
  ``"k": (B, Hkv, T, R_k)`` and ``"v": (B, Hkv, T, R_v)`` — one append and one attention call for the layer;
* otherwise → one stream per head and kind, ``"k{j}": (B, T, R_k[j])`` and ``"v{j}": (B, T, R_v[j])``.

Either way the cache holds exactly ``Σ_layers Σ_heads (R_k + R_v) · T · B`` numbers
(:meth:`CoefficientCache.bytes_formula`), which ``nbytes()`` and :func:`kvsplice.report.memory.measure_cache` measure from
the live tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from models.quant import SCALE
from models.stream_cache import DecodeCache

__all__ = ["CoefficientCache", "coefficient_bytes"]


def _check_ranks(ranks_k: Sequence[Sequence[int]], ranks_v: Sequence[Sequence[int]]) -> tuple[list, list]:
    rk = [[int(r) for r in layer] for layer in ranks_k]
    rv = [[int(r) for r in layer] for layer in ranks_v]
    if not rk or len(rk) != len(rv):
        raise ValueError(f"ranks_k and ranks_v need the same (non-zero) number of layers, got {len(rk)} and {len(rv)}")
    for l, (lk, lv) in enumerate(zip(rk, rv)):
        if not lk or len(lk) != len(lv):
            raise ValueError(f"layer {l}: ranks_k has {len(lk)} heads, ranks_v {len(lv)} (need the same, >= 1)")
        if min(lk + lv) < 1:
            raise ValueError(f"layer {l}: every rank must be >= 1, got k {lk}, v {lv}")
    return rk, rv


class CoefficientCache(DecodeCache):
    """Key/value coefficients per layer and KV head; see the module docstring for the stream layout.

    ``ranks_k[l][j]`` / ``ranks_v[l][j]``: the ranks of KV head ``j`` of layer ``l``. Build it from bases with
    :meth:`from_bases`; :class:`kvsplice.lowrank.method.LowRank` fills it with :meth:`append_coeffs` /
    :meth:`reserve_coeffs`.
    """

    kind = "coefficients"

    def __init__(self, ranks_k: Sequence[Sequence[int]], ranks_v: Sequence[Sequence[int]], batch_size: int,
                 **kw) -> None:
        self.ranks_k, self.ranks_v = _check_ranks(ranks_k, ranks_v)
        self._grouped = [len(set(lk)) == 1 and len(set(lv)) == 1 for lk, lv in zip(self.ranks_k, self.ranks_v)]
        specs = []
        for lk, lv, grouped in zip(self.ranks_k, self.ranks_v, self._grouped):
            if grouped:
                specs.append({"k": (len(lk), lk[0]), "v": (len(lv), lv[0])})  # (B, Hkv, T, R)
            else:
                spec = {f"k{j}": (r,) for j, r in enumerate(lk)}  # (B, T, R_k[j])
                spec.update({f"v{j}": (r,) for j, r in enumerate(lv)})  # (B, T, R_v[j])
                specs.append(spec)
        super().__init__(specs, batch_size, **kw)
        self._flat: dict[int, tuple] = {}  # layer -> (first key buffer, flattened key views, value views): reserve_coeffs

    @classmethod
    def from_bases(cls, bases, batch_size: int, **kw) -> "CoefficientCache":
        """An empty cache for :class:`kvsplice.lowrank.bases.KVBases` ``bases`` (its per-head ranks)."""
        r = bases.ranks()
        return cls(r["k"], r["v"], batch_size, **kw)

    # ------------------------------------------------------------------------------------------------ layout
    def grouped(self, layer: int) -> bool:
        """True when ``layer`` stores one ``(B, Hkv, T, R)`` stream per kind (its heads share their ranks)."""
        return self._grouped[layer]

    def n_kv_head(self, layer: int) -> int:
        return len(self.ranks_k[layer])

    def append_coeffs(self, layer: int, a: Sequence[torch.Tensor] | torch.Tensor,
                      b: Sequence[torch.Tensor] | torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Append new key coefficients ``a`` and value coefficients ``b`` of ``layer``; return the full views.

        Grouped layer: ``a (B, Hkv, T_new, R_k)``, ``b (B, Hkv, T_new, R_v)`` (or one-element lists of them) →
        ``([A (B, Hkv, T, R_k)], [B (B, Hkv, T, R_v)])``. Per-head layer: lists of ``(B, T_new, R[j])`` (or
        ``(B, 1, T_new, R[j])``) per head → lists of per-head views ``(B, 1, T, R[j])`` (``attend``'s layout with one
        KV head; views, no copies).
        """
        if self._grouped[layer]:
            a = a[0] if isinstance(a, (list, tuple)) else a
            b = b[0] if isinstance(b, (list, tuple)) else b
            out = self.append(layer, k=a, v=b)
            return [out["k"]], [out["v"]]
        n = self.n_kv_head(layer)
        if len(a) != n or len(b) != n:
            raise ValueError(f"layer {layer} stores {n} heads separately; got {len(a)} key and {len(b)} value "
                             f"coefficient tensors")
        new = {f"k{j}": (x[:, 0] if x.dim() == 4 else x) for j, x in enumerate(a)}
        new.update({f"v{j}": (x[:, 0] if x.dim() == 4 else x) for j, x in enumerate(b)})
        out = self.append(layer, **new)
        return [out[f"k{j}"][:, None] for j in range(n)], [out[f"v{j}"][:, None] for j in range(n)]

    def append_coeff_rows(self, layer: int, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
                          ) -> list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """:meth:`append_coeffs` (``a``, ``b``: per group ``(B, n, T_new, R)``), returning per group the stored rows
        as they are — ``(A (B, n, T, R_k), B (B, n, T, R_v), A scales, B scales)``, the scales ``(B, n, T, 1)`` fp16
        for an int8 cache, else None — for a kernel that dequantises as it reads (no dequantised copy)."""
        if self._grouped[layer]:
            rows = self.append_rows(layer, k=a[0], v=b[0])  # (B, Hkv, T, R)
            names = [("k", "v")]
        else:
            n = self.n_kv_head(layer)
            new = {f"k{j}": a[j].reshape(a[j].shape[0], -1, a[j].shape[-1]) for j in range(n)}  # (B, T_new, R_k[j])
            new.update({f"v{j}": b[j].reshape(b[j].shape[0], -1, b[j].shape[-1]) for j in range(n)})
            rows = {name: x[:, None] for name, x in self.append_rows(layer, **new).items()}  # (B, 1, T, R[j])
            names = [(f"k{j}", f"v{j}") for j in range(n)]
        return [(rows[kn], rows[vn], rows.get(kn + SCALE), rows.get(vn + SCALE)) for kn, vn in names]

    def reserve_coeffs(self, layer: int, t_new: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`~models.stream_cache.DecodeCache.reserve` in the coefficient layout: ``(t0, K, V)`` with, per group
        of KV heads (one group for a grouped layer, one per head otherwise, as :meth:`append_coeffs`), the whole key /
        value storage flattened to ``(B·n_heads, capacity, R)``; the flattened views are kept until the cache grows."""
        t0, bufs = self.reserve(layer, t_new)
        key = "k" if self._grouped[layer] else "k0"
        memo = self._flat.get(layer)
        if memo is None or memo[0] is not bufs[key]:  # first call, or the storage grew
            b = self.batch_size
            if self._grouped[layer]:
                kb, vb = bufs["k"], bufs["v"]  # (B, Hkv, cap, R)
                ks = [kb.view(b * kb.shape[1], kb.shape[2], kb.shape[3])]  # (B·Hkv, cap, R_k)
                vs = [vb.view(b * vb.shape[1], vb.shape[2], vb.shape[3])]  # (B·Hkv, cap, R_v)
            else:
                n = self.n_kv_head(layer)
                ks = [bufs[f"k{j}"] for j in range(n)]  # (B, cap, R_k[j]) == (B·1, cap, R)
                vs = [bufs[f"v{j}"] for j in range(n)]
            memo = self._flat[layer] = (bufs[key], ks, vs)
        return t0, memo[1], memo[2]

    # ------------------------------------------------------------------------------------------------ bytes
    def elements_per_token(self) -> int:
        """``Σ_layers Σ_kv-heads (R_k + R_v)`` numbers per token per sequence."""
        return sum(sum(lk) + sum(lv) for lk, lv in zip(self.ranks_k, self.ranks_v))

    def formula_nbytes(self) -> int:
        """:func:`coefficient_bytes` of the tokens held (== :meth:`nbytes`)."""
        return coefficient_bytes(self.ranks_k, self.ranks_v, self.batch_size, self.seq_len, self.dtype, self.quant)


def coefficient_bytes(ranks_k: Sequence[Sequence[int]], ranks_v: Sequence[Sequence[int]], batch_size: int,
                      seq_len: int | Sequence[int], dtype: torch.dtype, quant: str | None = None) -> int:
    """``Σ_layers Σ_heads (R_k + R_v) · T · B · bytes`` (``seq_len``: ``T``, or a list of each layer's tokens);
    with ``quant="int8"``: 1 byte per coefficient plus a 2-byte scale per KV head, kind (key/value), layer and
    token."""
    lens = [int(seq_len)] * len(ranks_k) if isinstance(seq_len, int) else [int(t) for t in seq_len]
    # numbers and rows (one key and one value row per KV head) held per sequence, summed over layers
    elements = sum((sum(lk) + sum(lv)) * t for lk, lv, t in zip(ranks_k, ranks_v, lens))
    if quant == "int8":
        rows = sum(2 * len(lk) * t for lk, t in zip(ranks_k, lens))
        return (elements + 2 * rows) * batch_size
    return elements * batch_size * torch.empty((), dtype=dtype).element_size()
