"""Attention in coefficient space over a :class:`~kvsplice.lowrank.cache.CoefficientCache` — the absorbed path of
:class:`~kvsplice.lowrank.method.LowRank`, the one both doors run.

Per layer and call, with ``g`` query heads per KV head and bases ``k_enc, k_dec, v_enc, v_dec`` per KV head
(:mod:`kvsplice.lowrank.bases`); ``q, k`` arrive post-RoPE:

* values are never rebuilt: attention sums the cached coefficients ``Σ_t p_t b_t`` (``R_v`` numbers per query head
  and query) and the value basis is applied to that sum once per query row, ``(Σ_t p_t b_t) v_decᵀ`` (``Tq`` rows,
  never ``T``);
* keys, ``post``-RoPE (and models without RoPE, mode ``none``): the new keys' coefficients ``a = k k_enc`` are cached
  and the key basis (times the softmax scale) is folded into the query, ``q̃ = q k_dec · scale`` (``R_k`` numbers per
  query head): scores ``q̃·a`` run straight on the cached coefficients, no key is rebuilt;
* keys, ``pre``-RoPE: the ``Decoder`` hands over un-rotated keys, ``a = k k_enc``; the HF door's keys arrive
  rotated (mode ``pre-rotated``) and the inverse rotation is folded into the encoder,
  ``a = R(-θ) k k_enc = [k⊙cos | k⊙sin] [k_enc ; rot(k_enc)]`` (one matmul; ``rot`` = RoPE's rotate_half applied to
  the basis rows, exact because RoPE's ``sin`` repeats over the two halves). RoPE does not commute with the basis, so
  the layer's keys are rebuilt and rotated for the attention call, transposed and scaled:
  ``K̂ᵀ = (k_dec Aᵀ)⊙cosᵀ + (rot(k_dec) Aᵀ)⊙sinᵀ`` (one matmul against ``[k_dec ; rot(k_dec)]``, then one multiply
  and one multiply-add in place): a **transient** ``(B·Hkv, 2D, T)`` workspace per layer and call, never cached.
  Positions and tables: :class:`kvsplice.core.rope.RopeTables`.
* log-weights ``logw (B, Hkv, Tk)`` (a token subset held as coefficients) are added to the scores.

Layers whose KV heads share their ranks run as one :class:`Group` (one stream, one attention call); otherwise each
KV head is its own group. Unquantised caches get the new coefficients written straight into their storage
(:meth:`~kvsplice.lowrank.cache.CoefficientCache.reserve_coeffs`, the ``out=`` of the encoding matmul); one-token
steps run three batched matmuls over ``B·Hkv`` (scores, ``Σ_t p_t b_t``, ``v_decᵀ``) with the bases repeated per
sequence once per batch size (:class:`Operands`); prefill / multi-token calls go through
:func:`kvsplice.core.attention.dense_attend` in coefficient space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from models.rope import rotate_half
from kvsplice.core.attention import dense_attend, keys_seen
from kvsplice.lowrank.bases import HeadBases
from kvsplice.lowrank.cache import CoefficientCache

__all__ = ["Group", "Operands", "coefficient_attend", "decode_step", "encode", "general_attend", "kernel_step",
           "layer_groups"]


def _rot_rows(m: torch.Tensor) -> torch.Tensor:
    """RoPE's rotate_half along the rows (``D``) of a basis ``m (n, D, R)``: ``rot(m x) = _rot_rows(m) x``."""
    return rotate_half(m.transpose(1, 2)).transpose(1, 2)  # (n, D, R)


@dataclass
class Group:
    """KV heads ``[kv0, kv0 + n)`` of a layer sharing ranks: stacked bases ``(n, D, R)``."""

    kv0: int
    n: int
    k_enc: torch.Tensor  # (n, D, R_k)
    k_dec: torch.Tensor  # (n, D, R_k)
    v_enc: torch.Tensor  # (n, D, R_v)
    v_dec_t: torch.Tensor  # (n, R_v, D): v_decᵀ

    def operands(self, batch: int, mode: str, dtype: torch.dtype, device: torch.device) -> "Operands":
        """The bases repeated per sequence (batch index ``b·n + j``, as the flattened storage of
        :meth:`CoefficientCache.reserve_coeffs`), at the cache's dtype / device."""
        cv = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
        rep = lambda t: t.repeat(batch, 1, 1).contiguous()  # noqa: E731  (n, ·, ·) → (B·n, ·, ·)
        k_enc, k_dec = cv(self.k_enc), cv(self.k_dec)
        enc_k, enc_k_rot, dec_k = rep(k_enc), None, None  # (B·n, D, R_k); post: k_dec·scale is folded per scale
        if mode == "pre":
            enc_k_rot = rep(torch.cat([k_enc, _rot_rows(k_enc)], dim=1))  # [k_enc ; rot(k_enc)] (B·n, 2D, R_k)
            dec_k = rep(torch.cat([k_dec, _rot_rows(k_dec)], dim=1))  # [k_dec ; rot(k_dec)] (B·n, 2D, R_k)
        return Operands(self.kv0, self.n, batch, k_dec, enc_k, enc_k_rot, dec_k, rep(cv(self.v_enc)),
                        rep(cv(self.v_dec_t)))


@dataclass
class Operands:
    """One group's per-batch operands (see :meth:`Group.operands`)."""

    kv0: int
    n: int
    batch: int
    k_dec: torch.Tensor  # (n, D, R_k)
    enc_k: torch.Tensor  # k_enc (B·n, D, R_k)
    enc_k_rot: Optional[torch.Tensor]  # pre: [k_enc ; rot(k_enc)] (B·n, 2D, R_k), for keys that arrive rotated
    dec_k: Optional[torch.Tensor]  # pre: [k_dec ; rot(k_dec)] (B·n, 2D, R_k); post: k_dec·scale (scaled_dec_k)
    enc_v: torch.Tensor  # (B·n, D, R_v)
    dec_v: torch.Tensor  # v_decᵀ (B·n, R_v, D)
    dec_scale: Optional[float] = None  # the scale folded into dec_k (post)

    def scaled_dec_k(self, scale: float) -> torch.Tensor:
        """post: ``k_dec · scale`` (B·n, D, R_k), folded once per scale (a model's layers keep theirs)."""
        if self.dec_scale != scale:
            self.dec_k, self.dec_scale = (self.k_dec * scale).repeat(self.batch, 1, 1).contiguous(), scale
        return self.dec_k


def layer_groups(heads: list[HeadBases]) -> list[Group]:
    """One group for a layer whose KV heads share their ranks, else one group per head."""
    uniform = len({h.rank_k for h in heads}) == 1 and len({h.rank_v for h in heads}) == 1
    spans = [(0, len(heads))] if uniform else [(j, 1) for j in range(len(heads))]
    return [Group(kv0, n, torch.stack([h.k_enc for h in heads[kv0:kv0 + n]]),
                  torch.stack([h.k_dec for h in heads[kv0:kv0 + n]]),
                  torch.stack([h.v_enc for h in heads[kv0:kv0 + n]]),
                  torch.stack([h.v_dec.T for h in heads[kv0:kv0 + n]]).contiguous())
            for kv0, n in spans]


def _flat(x: torch.Tensor, op: Operands, single: bool) -> torch.Tensor:
    """The group's heads of ``x (B, Hkv, T, ·)`` as ``(B·n, T, ·)``."""
    b, _, t, c = x.shape
    return (x if single else x[:, op.kv0:op.kv0 + op.n]).reshape(b * op.n, t, c)


def encode(ops: list[Operands], k: torch.Tensor, v: torch.Tensor
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Coefficients of new keys/values per group: ``a (B, n, T, R_k)``, ``b (B, n, T, R_v)``. ``k (B, Hkv, T, ·)``
    is the plain key (D) or, for rotated keys of pre-RoPE bases, ``[k⊙cos | k⊙sin]/σ²`` (2D: the folded inverse
    rotation)."""
    b, _, t, c = k.shape
    single = len(ops) == 1
    a = [torch.bmm(_flat(k, op, single), op.enc_k if c == op.enc_k.shape[1] else op.enc_k_rot).view(b, op.n, t, -1)
         for op in ops]  # (B, n, T, R_k)
    bv = [torch.bmm(_flat(v, op, single), op.enc_v).view(b, op.n, t, -1) for op in ops]  # (B, n, T, R_v)
    return a, bv


def _not_mask(step, mask: torch.Tensor) -> torch.Tensor:
    """``~mask`` of a one-query call, ``(B, 1, 1, Tk)`` bool (computed once per call, shared by the layers)."""
    key = ("not_mask", id(mask))
    nm = step.memo.get(key)
    if nm is None:
        nm = step.memo[key] = ~keys_seen(mask)[:, None, None, :]  # (B, 1, 1, Tk)
    return nm


def _softmax(s: torch.Tensor, not_mask: Optional[torch.Tensor], logw: Optional[torch.Tensor], b: int, n: int,
             g: int, t_k: int) -> torch.Tensor:
    """``softmax(s + logw)`` of one-query scores ``s (B·n, g, Tk)`` with the masked keys at ``-inf`` (in place); a
    query that sees no key gets zeros, not NaN (as SDPA)."""
    s4 = s.view(b, n, g, t_k)
    if logw is not None:
        s4.add_(logw[:, :, None, :])  # (B, n, 1, Tk): per-token log-weights
    if not_mask is not None:
        s4.masked_fill_(not_mask, float("-inf"))
    p = torch.softmax(s, dim=-1)  # (B·n, g, Tk)
    return p.nan_to_num_(0.0) if (not_mask is not None or logw is not None) else p


def decode_step(ops: Operands, layer: int, q, k, v, cache: CoefficientCache, step, mode: str, scale: float,
                mask, logw, tables) -> torch.Tensor:
    """The common decode step: one new token, one group of KV heads, unquantised, the cache's dtype —
    :func:`coefficient_attend`'s math with ``Tq = 1`` and the group / dtype / layout branches taken once."""
    b, hq, _, d = q.shape
    n = ops.n
    g = hq // n
    t0, K, V = cache.reserve_coeffs(layer, 1)
    t_k = t0 + 1
    Kg, Vg = K[0], V[0]  # (B·n, capacity, R)
    if mode != "post" and mode != "none":  # pre-RoPE coefficients
        cos_t, sin_t, un = tables(t_k, 1)
        if mode == "pre-rotated":
            torch.bmm((k.reshape(b, n, 1, 1, d) * un).reshape(b * n, 1, 2 * d), ops.enc_k_rot, out=Kg[:, t0:t_k])  # a = R(-θ)k k_enc (B·n, 1, R_k)
        else:
            torch.bmm(k.reshape(b * n, 1, d), ops.enc_k, out=Kg[:, t0:t_k])  # a = k k_enc (B·n, 1, R_k)
        kk = torch.bmm(ops.dec_k, Kg[:, :t_k].transpose(1, 2)).view(b, n, 2 * d, t_k)  # [k_dec ; rot(k_dec)] Aᵀ (B, n, 2D, Tk)
        keys_t = kk[:, :, :d]
        keys_t.mul_(cos_t).addcmul_(kk[:, :, d:], sin_t)  # K̂ᵀ·scale, in place in the transient kk (B, n, D, Tk)
        s = torch.bmm(q.reshape(b * n, g, d), keys_t.view(b * n, d, t_k))  # (B·n, g, Tk)
    else:
        torch.bmm(k.reshape(b * n, 1, d), ops.enc_k, out=Kg[:, t0:t_k])  # a = k k_enc (B·n, 1, R_k)
        qt = torch.bmm(q.reshape(b * n, g, d), ops.scaled_dec_k(scale))  # q̃ = q k_dec · scale (B·n, g, R_k)
        s = torch.bmm(qt, Kg[:, :t_k].transpose(1, 2))  # (B·n, g, Tk)
    torch.bmm(v.reshape(b * n, 1, d), ops.enc_v, out=Vg[:, t0:t_k])  # b = v v_enc (B·n, 1, R_v)
    p = _softmax(s, None if mask is None else _not_mask(step, mask), logw, b, n, g, t_k)  # (B·n, g, Tk)
    z = torch.bmm(p, Vg[:, :t_k])  # Σ_t p_t b_t (B·n, g, R_v)
    return torch.bmm(z, ops.dec_v).view(b, n * g, 1, d)  # (B, Hq, 1, D)


def coefficient_attend(ops: list[Operands], layer: int, q, k, v, cache: CoefficientCache, step, mode: str,
                       scale: float, mask, logw, tables) -> torch.Tensor:
    """Encode and store the new ``k, v (B, Hkv, Tq, D)`` of ``layer``, attend ``q (B, Hq, Tq, D)`` over the cached
    coefficients → ``(B, Hq, Tq, D)``. ``mode``: ``post`` / ``none`` / ``pre`` (un-rotated keys) / ``pre-rotated``
    (pre-RoPE bases, rotated keys). ``tables(t_k, t_q)``: the RoPE tables of the call (pre-RoPE); ``logw``:
    ``(B, Hkv, Tk)`` log-weights or None. One-token steps of one unquantised group take :func:`decode_step`,
    everything else :func:`general_attend` (the same math; tested equal); with the split-KV kernel on (the door's
    ``decode_kernel``), one-token steps of post-RoPE / no-RoPE coefficients take :func:`kernel_step`."""
    if q.shape[2] == 1 and mode in ("post", "none") and step.kernel(q):
        return kernel_step(ops, layer, q, k, v, cache, step, scale, mask, logw)
    if q.shape[2] == 1 and len(ops) == 1 and cache.quant is None and q.dtype == cache.dtype:
        return decode_step(ops[0], layer, q, k, v, cache, step, mode, scale, mask, logw, tables)
    return general_attend(ops, layer, q, k, v, cache, step, mode, scale, mask, logw, tables)


def kernel_step(ops: list[Operands], layer: int, q, k, v, cache: CoefficientCache, step, scale: float, mask,
                logw) -> torch.Tensor:
    """One new token, post-RoPE (or no-RoPE) coefficients, any groups, int8 included: the split-KV kernel
    (:meth:`kvsplice.core.method.Step.decode_attend`) over the stored coefficient rows — scores ``q̃·a`` with
    ``q̃ = q k_dec · scale``, ``Σ_t p_t b_t`` — then ``v_decᵀ`` once; the math of :func:`decode_step`."""
    b, hq, _, d = q.shape
    g, out_dtype = hq // k.shape[1], q.dtype
    if q.dtype != cache.dtype:
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
    single = len(ops) == 1
    ys = []
    for op, (A, Bc, a_scale, b_scale) in zip(ops, cache.append_coeff_rows(layer, *encode(ops, k, v))):
        n = op.n  # A (B, n, Tk, R_k), Bc (B, n, Tk, R_v): the stored rows (int8 + scales (B, n, Tk, 1))
        qg = (q if single else q[:, op.kv0 * g:(op.kv0 + n) * g]).reshape(b * n, g, d)  # (B·n, g, D)
        qt = torch.bmm(qg, op.scaled_dec_k(scale)).view(b, n * g, 1, -1)  # q̃ (B, n·g, 1, R_k), scaled
        lw = None if logw is None else (logw if single else logw[:, op.kv0:op.kv0 + n])  # (B, n, Tk)
        z = step.decode_attend(layer, qt, A, Bc, mask, lw, scale=1.0, k_scale=a_scale, v_scale=b_scale)  # (B, n·g, 1, R_v)
        ys.append(torch.bmm(z.view(b * n, g, -1), op.dec_v).view(b, n * g, 1, d))  # (B, n·g, 1, D)
    y = ys[0] if single else torch.cat(ys, dim=1)  # (B, Hq, 1, D)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def general_attend(ops: list[Operands], layer: int, q, k, v, cache: CoefficientCache, step, mode: str,
                   scale: float, mask, logw, tables) -> torch.Tensor:
    """:func:`coefficient_attend` for any call: several queries, several groups, int8, another dtype."""
    b, hq, t_q, d = q.shape
    hkv, pre, out_dtype = k.shape[1], mode not in ("post", "none"), q.dtype
    g = hq // hkv
    if q.dtype != cache.dtype:
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
    t_k = cache.layer_len(layer) + t_q
    if pre:
        cos_t, sin_t, un = tables(t_k, t_q)
        if mode == "pre-rotated":
            k = (k.reshape(b, hkv, t_q, 1, d) * un).reshape(b, hkv, t_q, 2 * d)  # [k⊙cos | k⊙sin]/σ² (B, Hkv, Tq, 2D)
    single = len(ops) == 1
    if cache.quant is None:  # encode straight into the storage
        t0, K, V = cache.reserve_coeffs(layer, t_q)  # per group (B·n, capacity, R)
        for op, Kg, Vg in zip(ops, K, V):
            enc = op.enc_k_rot if mode == "pre-rotated" else op.enc_k
            torch.bmm(_flat(k, op, single), enc, out=Kg[:, t0:t_k])  # (B·n, Tq, R_k)
            torch.bmm(_flat(v, op, single), op.enc_v, out=Vg[:, t0:t_k])  # (B·n, Tq, R_v)
        A, Bc = [x[:, :t_k] for x in K], [x[:, :t_k] for x in V]  # (B·n, Tk, R)
    else:
        A4, B4 = cache.append_coeffs(layer, *encode(ops, k, v))  # per group (B, n, Tk, R), dequantised
        A = [x.reshape(b * x.shape[1], t_k, x.shape[-1]) for x in A4]  # (B·n, Tk, R_k)
        Bc = [x.reshape(b * x.shape[1], t_k, x.shape[-1]) for x in B4]  # (B·n, Tk, R_v)
    not_mask = _not_mask(step, mask) if (mask is not None and t_q == 1) else None
    ys = []
    for op, Ag, Bg in zip(ops, A, Bc):
        n = op.n
        lw = None if logw is None else (logw if single else logw[:, op.kv0:op.kv0 + n])  # (B, n, Tk)
        qg = (q if single else q[:, op.kv0 * g:(op.kv0 + n) * g]).reshape(b * n, g * t_q, d)  # (B·n, g·Tq, D): rows (head in group, query)
        if pre:
            # transient K̂ᵀ·scale rotated at its positions: (k_dec Aᵀ)⊙cosᵀ + (rot(k_dec) Aᵀ)⊙sinᵀ
            kk = torch.bmm(op.dec_k, Ag.transpose(1, 2)).view(b, n, 2 * d, t_k)  # (B, n, 2D, Tk)
            keys_t = torch.addcmul(kk[:, :, :d] * cos_t, kk[:, :, d:], sin_t).view(b * n, d, t_k)  # (B·n, D, Tk)
        else:
            qg = torch.bmm(qg, op.scaled_dec_k(scale))  # q̃ = q k_dec · scale (B·n, g·Tq, R_k)
            keys_t = Ag.transpose(1, 2)  # (B·n, R_k, Tk): scores q̃·a on the cached coefficients
        if t_q == 1:
            s = torch.bmm(qg, keys_t)  # (B·n, g, Tk), scaled
            z = torch.bmm(_softmax(s, not_mask, lw, b, n, g, t_k), Bg)  # (B·n, g, R_v): Σ_t p_t b_t
        else:  # prefill / several queries: causal + transformers' mask (+ log-weights)
            keys = keys_t.view(b, n, -1, t_k).transpose(-1, -2)  # (B, n, Tk, D or R_k)
            z = dense_attend(qg.view(b, n * g, t_q, -1), keys, Bg.view(b, n, t_k, -1), scale=1.0, mask=mask,
                             logw=lw, backend="sdpa")  # (B, n·g, Tq, R_v)
            z = z.reshape(b * n, g * t_q, -1)  # (B·n, g·Tq, R_v)
        ys.append(torch.bmm(z, op.dec_v).view(b, n * g, t_q, d))  # (B, n·g, Tq, D)
    y = ys[0] if single else torch.cat(ys, dim=1)  # (B, Hq, Tq, D)
    return y if y.dtype == out_dtype else y.to(out_dtype)
