"""Low-rank coefficients inside HF ``generate()``: :class:`CoefficientHFCache`.

::

    bases = KVBases.load("s260k_r4_post.safetensors")             # python -m kvsplice.fit_bases
    cache = CoefficientHFCache(model, bases)                       # switches model to the "kvsplice" attention
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)
    cache.nbytes() == cache.bytes_formula()                        # Σ_layers Σ_kv-heads (R_k + R_v) · T · B · bytes

The numbers live in a :class:`kvsplice.lowrank.cache.CoefficientCache` (``a = k k_enc``, ``b = v v_enc`` per KV
head and token; bases from :mod:`kvsplice.lowrank.bases`). Per layer and step, with ``g`` query heads per KV head:

* values are never rebuilt: attention sums the cached coefficients ``Σ_t p_t b_t`` (``R_v`` numbers per query head
  and query) and the value basis is applied to that sum once per query row, ``(Σ_t p_t b_t) v_decᵀ`` (the
  ``(B, Hq, Tq, D)`` the module's own output projection expects; ``Tq`` rows, never ``T``);
* keys, ``post``-RoPE (and GPT-2, no RoPE): the module hands over rotated keys; their coefficients are cached and
  the key basis is folded into the query, ``q̃ = q k_dec`` (``R_k`` numbers per query head): scores ``q̃·a`` run
  straight on the cached coefficients, no key is rebuilt;
* keys, ``pre``-RoPE: the module's new keys are rotated back to their un-rotated form (the inverse rotation at
  their positions; rotations are orthogonal) and projected, ``a = k k_enc``. RoPE does not commute with the basis,
  so the layer's keys are rebuilt and rotated for the attention call, ``K̂ = rope(A k_decᵀ)``: a **transient**
  ``(B, Hkv, T, D)`` per layer, freed after the call and never cached. The rotation tables of the ``T`` cached
  positions are computed once per step (shared by the layers, also transient). Positions come from transformers'
  mask (``cumsum`` of the attended keys, as ``generate`` numbers left-padded rows), or ``0..T-1`` without one.

Layers whose KV heads share their ranks run as one group (one append, one attention call); otherwise each KV
head is its own group. Full-rank orthonormal bases reproduce the model (tested against ``DynamicCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.adapters.base import apply_rope, rotate_half
from kvsplice.hf.attention import masked_attend
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.cache import CoefficientCache
from kvsplice.lowrank.method import LowRank

__all__ = ["CoefficientHFCache"]


@dataclass
class _Group:
    """KV heads ``[kv0, kv0 + n)`` of a layer sharing ranks: stacked bases ``(n, D, R)``."""

    kv0: int
    n: int
    k_enc: torch.Tensor
    k_dec: torch.Tensor
    v_enc: torch.Tensor
    v_dec_t: torch.Tensor  # (n, R_v, D): v_decᵀ

    @property
    def k_dec_both(self) -> torch.Tensor:
        """``[k_decᵀ | rot(k_dec)ᵀ]`` (n, R_k, 2D) with ``rot`` = RoPE's rotate_half applied to each key row."""
        kt = self.k_dec.transpose(1, 2)  # (n, R_k, D)
        if getattr(self, "_both", None) is None or self._both.dtype != kt.dtype:
            self._both = torch.cat([kt, rotate_half(kt)], dim=-1).contiguous()
        return self._both


class CoefficientHFCache(KVSpliceHFCache):
    """A ``transformers.Cache`` holding only key/value coefficients of fitted low-rank ``bases``.

    ``cache_quant="int8"`` stores them as int8 rows with fp16 scales (dequantised for the attention call).
    ``capacity`` preallocates that many tokens (storage == live bytes); otherwise storage grows geometrically.
    """

    def __init__(self, model: torch.nn.Module, bases: KVBases, *, cache_quant: Optional[str] = None,
                 capacity: Optional[int] = None) -> None:
        super().__init__(model, capacity=capacity)
        a = self.adapter
        p = a.param()
        method = LowRank(bases, impl="naive", cache_quant=cache_quant)  # its checks: model, layers, heads, dims
        method.bind(a, dtype=p.dtype, device=p.device)
        self.bases, self.mode, self.cache_quant = method.bases, method.key_mode, cache_quant
        self.g = a.n_head // a.n_kv_head
        self.groups = [self._plan(heads) for heads in self.bases.layers]
        self._rope_memo: Optional[tuple] = None

    @staticmethod
    def _plan(heads) -> list[_Group]:
        uniform = len({h.rank_k for h in heads}) == 1 and len({h.rank_v for h in heads}) == 1
        spans = [(0, len(heads))] if uniform else [(j, 1) for j in range(len(heads))]
        return [_Group(kv0, n, torch.stack([h.k_enc for h in heads[kv0:kv0 + n]]),
                       torch.stack([h.k_dec for h in heads[kv0:kv0 + n]]),
                       torch.stack([h.v_enc for h in heads[kv0:kv0 + n]]),
                       torch.stack([h.v_dec.T for h in heads[kv0:kv0 + n]]).contiguous())
                for kv0, n in spans]

    def _build_store(self, batch_size, dtype, device):
        if dtype != self.groups[0][0].k_enc.dtype or device != self.groups[0][0].k_enc.device:
            self.groups = [[_Group(g.kv0, g.n, *(t.to(dtype=dtype, device=device)
                                                 for t in (g.k_enc, g.k_dec, g.v_enc, g.v_dec_t)))
                            for g in layer] for layer in self.groups]
        self.store = CoefficientCache.from_bases(self.bases, batch_size, dtype=dtype, device=device,
                                                 capacity=self.capacity, quant=self.cache_quant)

    # ------------------------------------------------------------------------------------------------ bytes
    def bytes_formula(self, seq_len: Optional[int] = None) -> int:
        """``Σ_layers Σ_kv-heads (R_k + R_v) · T · B · bytes`` (int8: + 2-byte scales per row)."""
        return 0 if self.store is None else self.store.bytes_formula(seq_len)

    def full_bytes(self, seq_len: Optional[int] = None) -> int:
        """Bytes of the full K/V cache of the same tokens: ``2 · L · Hkv · head_dim · T · B · bytes``."""
        if self.store is None:
            return 0
        a, s = self.adapter, self.store
        t = s.seq_len if seq_len is None else int(seq_len)
        return 2 * a.n_layer * a.n_kv_head * a.head_dim * t * s.batch_size * torch.empty((), dtype=s.dtype).element_size()

    # -------------------------------------------------------------------------------------------- attention
    def _rope_tables(self, mask: Optional[torch.Tensor], t_k: int, like: torch.Tensor):
        """``cos, sin (B or 1, Tk, D)`` of the positions of all ``Tk`` keys (computed once per step)."""
        key = (t_k, None if mask is None else id(mask))
        if self._rope_memo is not None and self._rope_memo[0] == key:
            return self._rope_memo[1]
        if mask is None:
            pos = torch.arange(t_k, device=like.device)[None]  # (1, Tk)
        else:
            seen = mask[:, 0, -1, :] if mask.dtype == torch.bool else mask[:, 0, -1, :] > torch.finfo(mask.dtype).min / 2
            pos = (seen.long().cumsum(-1) - 1).clamp_min(0)  # (B, Tk): generate's cumsum numbering of left padding
        tables = self.adapter.m.rotary_emb(like, pos)  # cos, sin (B or 1, Tk, D)
        self._rope_memo = (key, tables)
        return tables

    def attend(self, layer, q, k, v, mask, scale):
        b, _, t_q, d = q.shape
        groups, g = self.groups[layer], self.g
        if self.mode == "pre":
            cos, sin = self._rope_tables(mask, self.store.layer_len(layer) + t_q, k)
            k = apply_rope(k, cos[:, -t_q:], -sin[:, -t_q:])  # rotated back: R(-θ) R(θ) k = k
        k, v = k.to(self.store.dtype), v.to(self.store.dtype)
        a = [k[:, gr.kv0:gr.kv0 + gr.n] @ gr.k_enc for gr in groups]  # (B, n, Tq, D) @ (n, D, R_k) → (B, n, Tq, R_k)
        bv = [v[:, gr.kv0:gr.kv0 + gr.n] @ gr.v_enc for gr in groups]  # (B, n, Tq, R_v)
        A, Bc = self.store.append_coeffs(layer, a, bv)  # per group (B, n, Tk, R)
        ys = []
        for gr, Ag, Bg in zip(groups, A, Bc):
            qg = q[:, gr.kv0 * g:(gr.kv0 + gr.n) * g].to(Ag.dtype)  # (B, n·g, Tq, D)
            if self.mode == "pre":
                # transient K̂ rotated at its positions, rope(A k_decᵀ) = (A k_decᵀ)·cos + (A rot(k_dec)ᵀ)·sin:
                # one matmul against [k_decᵀ | rot(k_dec)ᵀ] (precomputed), no rotate_half pass over the keys
                kk = Ag @ gr.k_dec_both  # (B, n, Tk, 2D)
                keys = torch.addcmul(kk[..., :d] * cos[:, None], kk[..., d:], sin[:, None])  # (B, n, Tk, D)
            else:
                qg = (qg.reshape(b, gr.n, g, t_q, d) @ gr.k_dec[:, None]).reshape(b, gr.n * g, t_q, -1)  # q̃ (B, n·g, Tq, R_k)
                keys = Ag  # scores q̃·a on the cached coefficients
            z = masked_attend(qg, keys, Bg, mask, scale=scale)  # (B, n·g, Tq, R_v): Σ_t p_t b_t
            ys.append((z.reshape(b, gr.n, g, t_q, -1) @ gr.v_dec_t[:, None]).reshape(b, gr.n * g, t_q, d))  # (B, n·g, Tq, D)
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # (B, Hq, Tq, D)
        return y.to(q.dtype)
