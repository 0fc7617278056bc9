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
  the key basis (times the softmax scale) is folded into the query, ``q̃ = q k_dec · scale`` (``R_k`` numbers per
  query head): scores ``q̃·a`` run straight on the cached coefficients, no key is rebuilt;
* keys, ``pre``-RoPE: the module's new keys arrive rotated; the inverse rotation is folded into the encoder,
  ``a = R(-θ) k k_enc = [k⊙cos | k⊙sin] [k_enc ; rot(k_enc)]`` (one matmul; ``rot`` = RoPE's rotate_half applied to
  the basis rows, exact because RoPE's ``sin`` repeats over the two halves). RoPE does not commute with the basis, so
  the layer's keys are rebuilt and rotated for the attention call, transposed and scaled:
  ``K̂ᵀ = (k_dec Aᵀ)⊙cosᵀ + (rot(k_dec) Aᵀ)⊙sinᵀ`` (one matmul against ``[k_dec ; rot(k_dec)]``, then one multiply
  and one multiply-add in place): a **transient** ``(B·Hkv, 2D, T)`` workspace per layer and step, freed after the
  call and never cached (keeping rebuilt keys from step to step would be a full key cache, more bytes than the
  uncompressed one). Positions come from transformers' mask
  (``cumsum`` of the attended keys, as ``generate`` numbers left-padded rows), or ``0..T-1`` without one.
  The cos / sin tables are the model's own ``rotary_emb`` evaluated once for positions ``0..N-1`` (``N`` grows
  geometrically) — a function of the position alone, like the tables older transformers kept in every rotary
  module; not cache state, not counted in the cache's bytes (:meth:`CoefficientHFCache.rope_table_nbytes`).
  Rotary types whose frequencies depend on the length (``dynamic``, ``longrope``) recompute them every step.

Layers whose KV heads share their ranks run as one group (one append, one attention call); otherwise each KV
head is its own group. Unquantised caches write the new coefficients straight into the cache's storage
(:meth:`kvsplice.lowrank.cache.CoefficientCache.reserve_coeffs`, the ``out=`` of the encoding matmul); one-token decode
steps run the attention as three batched matmuls over ``B·Hkv`` (scores, ``Σ_t p_t b_t``, ``v_decᵀ``) with the
bases repeated per sequence once per cache, prefill / multi-token calls through :func:`masked_attend`.
Full-rank orthonormal bases reproduce the model (tested against ``DynamicCache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvsplice.adapters.base import rotate_half
from kvsplice.hf.attention import masked_attend
from kvsplice.hf.base import KVSpliceHFCache
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.cache import CoefficientCache
from kvsplice.lowrank.method import LowRank

__all__ = ["CoefficientHFCache"]


def _rot_rows(m: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate_half along the rows (``D``) of a basis ``m (n, D, R)``: ``rot(m x) = _rot_rows(m) x``."""
    return rotate_half(m.transpose(1, 2)).transpose(1, 2)  # (n, D, R)


@dataclass
class _Group:
    """KV heads ``[kv0, kv0 + n)`` of a layer sharing ranks: stacked bases ``(n, D, R)`` and the per-cache operands
    :meth:`prepare` derives from them (heads repeated ``B`` times: batch index ``b·n + j``, as the flattened storage
    of :meth:`CoefficientCache.reserve_coeffs`)."""

    kv0: int
    n: int
    k_enc: torch.Tensor  # (n, D, R_k)
    k_dec: torch.Tensor  # (n, D, R_k)
    v_enc: torch.Tensor  # (n, D, R_v)
    v_dec_t: torch.Tensor  # (n, R_v, D): v_decᵀ
    enc_k: Optional[torch.Tensor] = None  # post: k_enc (B·n, D, R_k); pre: [k_enc ; rot(k_enc)] (B·n, 2D, R_k)
    enc_v: Optional[torch.Tensor] = None  # (B·n, D, R_v)
    dec_v: Optional[torch.Tensor] = None  # v_decᵀ (B·n, R_v, D)
    dec_k: Optional[torch.Tensor] = None  # post: k_dec·scale (B·n, D, R_k) (scaled_dec_k); pre: [k_dec ; rot(k_dec)] (B·n, 2D, R_k)
    dec_scale: Optional[float] = None  # the scale folded into dec_k (post)

    def prepare(self, batch: int, mode: str, dtype: torch.dtype, device: torch.device) -> "_Group":
        cv = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
        g = _Group(self.kv0, self.n, *(cv(t) for t in (self.k_enc, self.k_dec, self.v_enc, self.v_dec_t)))
        rep = lambda t: t.repeat(batch, 1, 1).contiguous()  # noqa: E731  (n, ·, ·) → (B·n, ·, ·)
        if mode == "pre":
            g.enc_k = rep(torch.cat([g.k_enc, _rot_rows(g.k_enc)], dim=1))  # (B·n, 2D, R_k)
            g.dec_k = rep(torch.cat([g.k_dec, _rot_rows(g.k_dec)], dim=1))  # (B·n, 2D, R_k)
        else:
            g.enc_k = rep(g.k_enc)  # (B·n, D, R_k)
        g.enc_v, g.dec_v = rep(g.v_enc), rep(g.v_dec_t)  # (B·n, D, R_v), (B·n, R_v, D)
        return g

    def scaled_dec_k(self, scale: float) -> torch.Tensor:
        """post: ``k_dec · scale`` (B·n, D, R_k), folded once per scale (a model's layers keep theirs)."""
        if self.dec_scale != scale:
            batch = self.enc_v.shape[0] // self.n
            self.dec_k, self.dec_scale = (self.k_dec * scale).repeat(batch, 1, 1).contiguous(), scale  # (B·n, D, R_k)
        return self.dec_k


class _RopeTables:
    """RoPE tables of the pre-RoPE path, from the model's own ``rotary_emb`` (see the module docstring).

    :meth:`step` returns, for the ``Tk`` key positions of this forward call: ``cosᵀ·scale, sinᵀ·scale``
    ``(B or 1, 1, D, Tk)`` (the rebuilt keys' rotation, transposed, softmax scale folded in) and
    ``un (B or 1, 1, Tq, 2, D) = [cos ; sin] / σ²`` of the ``Tq`` new positions (the encoder's inverse rotation;
    ``σ`` = the rotary's ``attention_scaling``). Memoised per forward call (shared by the layers).
    """

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        rope_type = str(getattr(rotary, "rope_type", "default"))
        self.static = not ("dynamic" in rope_type or rope_type == "longrope")
        self.sigma2 = float(getattr(rotary, "attention_scaling", 1.0)) ** 2
        self._full: Optional[tuple] = None  # (scale, N, cosᵀ·scale (1, 1, D, N), sinᵀ·scale, un (1, N, 2, D))
        self._memo: Optional[tuple] = None  # (key, tables) of the current forward call

    def _derive(self, cos: torch.Tensor, sin: torch.Tensor, scale: float):
        """``cos, sin (B or 1, T, D)`` → ``(cosᵀ·scale, sinᵀ·scale (B or 1, 1, D, T), un (B or 1, T, 2, D))``."""
        h = cos.shape[-1] // 2
        if not torch.equal(sin[..., :h], sin[..., h:]):
            raise ValueError("pre-RoPE coefficients need rotate_half RoPE tables whose halves repeat (Llama's)")
        cos_t = (cos * scale).transpose(1, 2).contiguous()[:, None]  # (B or 1, 1, D, T)
        sin_t = (sin * scale).transpose(1, 2).contiguous()[:, None]  # (B or 1, 1, D, T)
        un = torch.stack([cos, sin], dim=-2) / self.sigma2  # (B or 1, T, 2, D)
        return cos_t, sin_t, un

    def step(self, mask: Optional[torch.Tensor], t_k: int, t_q: int, scale: float, like: torch.Tensor):
        key = (t_k, t_q, scale, None if mask is None else id(mask))
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        pos = None
        if mask is not None:
            seen = mask[:, 0, -1, :] if mask.dtype == torch.bool else mask[:, 0, -1, :] > torch.finfo(mask.dtype).min / 2
            pos = (seen.long().cumsum(-1) - 1).clamp_min(0)  # (B, Tk): generate's cumsum numbering of left padding
        if not self.static:  # frequencies depend on the length: this call's positions only
            cos, sin = self.rotary(like, torch.arange(t_k, device=like.device)[None] if pos is None else pos)
            cos_t, sin_t, un = self._derive(cos, sin, scale)  # (B or 1, ·, ·, Tk), (B or 1, Tk, 2, D)
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
        self._memo = (key, tables)
        return tables

    def nbytes(self) -> int:
        return 0 if self._full is None else sum(t.numel() * t.element_size() for t in self._full[2:])


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
        self._rope = _RopeTables(a.m.rotary_emb) if self.mode == "pre" else None
        self._mask_memo: Optional[tuple] = None  # (key, ~mask (B, 1, 1, Tk)) of the current decode step

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
        self.groups = [[g.prepare(batch_size, self.mode, dtype, device) for g in layer] for layer in self.groups]
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

    def rope_table_nbytes(self) -> int:
        """Bytes of the pre-RoPE cos / sin tables (per position, not per sequence; not cache state, 0 for post)."""
        return 0 if self._rope is None else self._rope.nbytes()

    # -------------------------------------------------------------------------------------------- attention
    def _not_mask(self, mask: torch.Tensor, t_k: int) -> torch.Tensor:
        """``~mask`` of a one-query step, ``(B, 1, 1, Tk)`` bool (computed once per step, shared by the layers)."""
        key = (t_k, id(mask))
        if self._mask_memo is None or self._mask_memo[0] != key:
            m = mask[..., -1:, :]  # (B, 1, 1, Tk)
            nm = ~m if m.dtype == torch.bool else m <= torch.finfo(m.dtype).min / 2
            self._mask_memo = (key, nm)
        return self._mask_memo[1]

    def attend(self, layer, q, k, v, mask, scale):
        st, groups = self.store, self.groups[layer]
        if q.shape[2] == 1 and len(groups) == 1 and st.quant is None and q.dtype == st.dtype:
            return self._decode_step(layer, groups[0], q, k, v, mask, scale)
        return self._attend_general(layer, groups, q, k, v, mask, scale)

    def _decode_step(self, layer: int, gr: _Group, q, k, v, mask, scale) -> torch.Tensor:
        """The common decode step: one new token, one group of KV heads, unquantised — :meth:`_attend_general`'s
        math with ``Tq = 1`` and the group / dtype / layout branches taken once, not per step."""
        b, _, _, d = q.shape
        n, g = gr.n, self.g
        t0, K, V = self.store.reserve_coeffs(layer, 1)
        t_k = t0 + 1
        Kg, Vg = K[0], V[0]  # (B·n, capacity, R)
        if self.mode == "pre":
            cos_t, sin_t, un = self._rope.step(mask, t_k, 1, scale, k)
            torch.bmm((k.reshape(b, n, 1, 1, d) * un).reshape(b * n, 1, 2 * d), gr.enc_k, out=Kg[:, t0:t_k])  # a = R(-θ)k k_enc (B·n, 1, R_k)
            kk = torch.bmm(gr.dec_k, Kg[:, :t_k].transpose(1, 2)).view(b, n, 2 * d, t_k)  # [k_dec ; rot(k_dec)] Aᵀ (B, n, 2D, Tk)
            keys_t = kk[:, :, :d]
            keys_t.mul_(cos_t).addcmul_(kk[:, :, d:], sin_t)  # K̂ᵀ·scale, in place in the transient kk (B, n, D, Tk)
            s = torch.bmm(q.reshape(b * n, g, d), keys_t.view(b * n, d, t_k))  # (B·n, g, Tk)
        else:
            torch.bmm(k.reshape(b * n, 1, d), gr.enc_k, out=Kg[:, t0:t_k])  # a = k k_enc (B·n, 1, R_k)
            qt = torch.bmm(q.reshape(b * n, g, d), gr.scaled_dec_k(scale))  # q̃ = q k_dec · scale (B·n, g, R_k)
            s = torch.bmm(qt, Kg[:, :t_k].transpose(1, 2))  # (B·n, g, Tk)
        torch.bmm(v.reshape(b * n, 1, d), gr.enc_v, out=Vg[:, t0:t_k])  # b = v v_enc (B·n, 1, R_v)
        if mask is not None:
            s.view(b, n, g, t_k).masked_fill_(self._not_mask(mask, t_k), float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a query that sees no key: zeros, not NaN (as SDPA)
        else:
            p = torch.softmax(s, dim=-1)  # (B·n, g, Tk)
        z = torch.bmm(p, Vg[:, :t_k])  # Σ_t p_t b_t (B·n, g, R_v)
        return torch.bmm(z, gr.dec_v).view(b, n * g, 1, d)  # (B, Hq, 1, D)

    def _attend_general(self, layer, groups, q, k, v, mask, scale):
        b, hq, t_q, d = q.shape
        hkv, g, st, pre, out_dtype = k.shape[1], self.g, self.store, self.mode == "pre", q.dtype
        if q.dtype != st.dtype:
            q, k, v = q.to(st.dtype), k.to(st.dtype), v.to(st.dtype)
        t_k = st.layer_len(layer) + t_q
        if pre:
            cos_t, sin_t, un = self._rope.step(mask, t_k, t_q, scale, k)
            k = (k.reshape(b, hkv, t_q, 1, d) * un).reshape(b, hkv, t_q, 2 * d)  # [k⊙cos | k⊙sin]/σ² (B, Hkv, Tq, 2D)
        single = len(groups) == 1
        flat = lambda x, gr: (x if single else x[:, gr.kv0:gr.kv0 + gr.n]).reshape(b * gr.n, t_q, x.shape[-1])  # noqa: E731  (B·n, Tq, ·)
        if st.quant is None:  # encode straight into the storage
            t0, K, V = st.reserve_coeffs(layer, t_q)  # per group (B·n, capacity, R)
            for gr, Kg, Vg in zip(groups, K, V):
                torch.bmm(flat(k, gr), gr.enc_k, out=Kg[:, t0:t_k])  # (B·n, Tq, R_k)
                torch.bmm(flat(v, gr), gr.enc_v, out=Vg[:, t0:t_k])  # (B·n, Tq, R_v)
            A, Bc = [x[:, :t_k] for x in K], [x[:, :t_k] for x in V]  # (B·n, Tk, R)
        else:
            a = [torch.bmm(flat(k, gr), gr.enc_k).view(b, gr.n, t_q, -1) for gr in groups]  # (B, n, Tq, R_k)
            bv = [torch.bmm(flat(v, gr), gr.enc_v).view(b, gr.n, t_q, -1) for gr in groups]  # (B, n, Tq, R_v)
            A4, B4 = st.append_coeffs(layer, a, bv)  # per group (B, n, Tk, R), dequantised
            A = [x.reshape(b * x.shape[1], t_k, x.shape[-1]) for x in A4]  # (B·n, Tk, R_k)
            Bc = [x.reshape(b * x.shape[1], t_k, x.shape[-1]) for x in B4]  # (B·n, Tk, R_v)
        not_mask = self._not_mask(mask, t_k) if (mask is not None and t_q == 1) else None
        ys = []
        for gr, Ag, Bg in zip(groups, A, Bc):
            n = gr.n
            qg = (q if single else q[:, gr.kv0 * g:(gr.kv0 + n) * g]).reshape(b * n, g * t_q, d)  # (B·n, g·Tq, D): rows (head in group, query)
            if pre:
                # transient K̂ᵀ·scale rotated at its positions: (k_dec Aᵀ)⊙cosᵀ + (rot(k_dec) Aᵀ)⊙sinᵀ
                kk = torch.bmm(gr.dec_k, Ag.transpose(1, 2)).view(b, n, 2 * d, t_k)  # (B, n, 2D, Tk)
                keys_t = torch.addcmul(kk[:, :, :d] * cos_t, kk[:, :, d:], sin_t).view(b * n, d, t_k)  # (B·n, D, Tk)
            else:
                qg = torch.bmm(qg, gr.scaled_dec_k(scale))  # q̃ = q k_dec · scale (B·n, g·Tq, R_k)
                keys_t = Ag.transpose(1, 2)  # (B·n, R_k, Tk): scores q̃·a on the cached coefficients
            if t_q == 1:
                s = torch.bmm(qg, keys_t)  # (B·n, g, Tk), scaled
                if not_mask is not None:
                    s.view(b, n, g, t_k).masked_fill_(not_mask, float("-inf"))
                p = torch.softmax(s, dim=-1)
                if not_mask is not None:  # a query that sees no key: zeros, not NaN (as SDPA returns)
                    p.nan_to_num_(0.0)
                z = torch.bmm(p, Bg)  # (B·n, g, R_v): Σ_t p_t b_t
            else:  # prefill / several queries: causal + transformers' mask
                keys = keys_t.view(b, n, -1, t_k).transpose(-1, -2)  # (B, n, Tk, D or R_k)
                z = masked_attend(qg.view(b, n * g, t_q, -1), keys, Bg.view(b, n, t_k, -1), mask, scale=1.0)  # (B, n·g, Tq, R_v)
                z = z.reshape(b * n, g * t_q, -1)  # (B·n, g·Tq, R_v)
            ys.append(torch.bmm(z, gr.dec_v).view(b, n * g, t_q, d))  # (B, n·g, Tq, D)
        y = ys[0] if single else torch.cat(ys, dim=1)  # (B, Hq, Tq, D)
        return y if y.dtype == out_dtype else y.to(out_dtype)
