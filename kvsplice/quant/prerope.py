"""``PreRopeKIVI``: KIVI storage with the keys quantised **before RoPE** (KVQuant's observation, Hooper et al. 2024:
a key's outlier channels are fixed before the rotation, which smears them over channel pairs at every position; per
channel groups of un-rotated keys see steadier ranges).

The cache is a plain :class:`~kvsplice.quant.cache.KIVICache` holding un-rotated keys (values as in KIVI): the
rotation of the new keys is undone at their positions (:class:`kvsplice.core.rope.RopeTables`,
``k = (k_rot⊙cos − rotate_half(k_rot)⊙sin)/σ²``). The HF door hands rotated keys; the ``Decoder`` un-rotated ones
(``key_rope = "pre"``), which are rotated first, so that both doors quantise the very same numbers: rounding decides
a code at a step's edge, and a last-bit difference there grows through the layers of a real model. At
attention the layer's keys — dequantised groups and the full-precision window — are rotated at their positions and
the one dense attention runs (the door's mask). So the keys attended are ``rot(dequant(quant(unrot(k))))``; the
bytes are KIVI's (the RoPE tables are a function of the position, not cache state). Exact when nothing is quantised
(``residual`` covering every token).

Refused: models without RoPE or with partial rotary (one line), and holding a token selection — a selection keeps
prompt tokens out of order and the cache does not store their positions, which the re-rotation needs.
"""

from __future__ import annotations

from kvsplice.adapters.base import apply_rope
from kvsplice.core.rope import rope_tables
from kvsplice.quant.method import KIVI

__all__ = ["PreRopeKIVI"]


class PreRopeKIVI(KIVI):
    """:class:`KIVI` (``bits``, ``group``, ``residual``) over un-rotated (pre-RoPE) keys; values as KIVI's."""

    name = "kivi_prerope"
    key_rope = "pre"

    def _prepare(self, adapter, *, dtype, device):
        if not adapter.has_rope:
            raise ValueError(f"kivi_prerope quantises keys before RoPE: this {adapter.name} model has no RoPE; "
                             f"use kivi")
        super()._prepare(adapter, dtype=dtype, device=device)
        self.rope = rope_tables(adapter)  # per layer (shared per rotary); refuses partial rotary

    def append(self, layer, k, v, cache, step):
        raise ValueError("kivi_prerope keeps un-rotated keys and needs their positions, which a token subset does "
                         "not keep: hold a selection with kivi or kivi_rotated")

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        t_q = q.shape[2]
        like = k.to(cache.dtype)
        cos, sin = self.rope[layer].cos_sin(step, mask, cache.layer_len(layer) + t_q, like)  # (B or 1, Tk, D)
        c, s = cos[:, -t_q:], sin[:, -t_q:]  # (B or 1, Tq, D): the new keys' positions
        if not step.k_rotated:  # the Decoder's un-rotated keys: rotated as the HF door's are, so that both doors
            like = apply_rope(like, c, s)  # quantise the same numbers (rounding decides codes at a step's edge)
        like = self.rope[layer].unrotate(like, c[:, None], s[:, None])  # undo the rotation
        kv = cache.append(layer, like, v)  # (B, Hkv, Tk, D) each: un-rotated keys, values
        keys = apply_rope(kv["k"], cos, sin)  # (B, Hkv, Tk, D): rotated at the keys' positions
        return step.attend(layer, q, keys.to(q.dtype), kv["v"].to(q.dtype), mask=mask, logw=logw)  # (B, Hq, Tq, D)

    def __repr__(self) -> str:
        return f"PreRopeKIVI(bits={self.bits}, group={self.group}, residual={self.residual})"
