"""MLA (multi-head latent attention) with DeepSeek's decoupled RoPE key: the latent math once — naive and absorbed
side by side (:func:`naive`, :func:`absorbed`), both through one ``attend`` call — for every model that has a latent:
:class:`MultiHeadLatentAttention` (the trained GPT-2 / DeepSeek-V3 layouts, optionally with KVSplice) and the
converted Llama family's attention (:class:`models.mla_llama.MLAAttention`).

Per token a latent ``c`` (R) is cached, with ``Hr`` rotated RoPE keys ``k_rope`` (Dr each; ``Hr`` is 1, one key
shared by all heads, or ``Hkv``). Per KV head ``k_g = w_uk[g] c (+ b_uk)``, ``v_g = w_uv[g] c (+ b_uv)``; query head
``h`` reads KV head ``h // (H / Hkv)`` and RoPE key ``h // (H / Hr)``, and its score is
``scale · (q_h·k_g + q_rope,h·k_rope)``.

* naive: expand every cached latent into K, V ``(B, Hkv, Tk, hs)``, join the RoPE parts and attend;
* absorbed: ``q̃_h = w_uk[h]ᵀ q_h`` (R) and attend in latent space with the rows ``[c | k_rope]`` as ``Hr`` shared
  key/value heads; the output's first ``R`` columns are ``Σ_t p_t c_t`` and ``o_h = w_uv[h] Σ_t p_t c_t + b_uv[h]``.
  The key bias adds ``q_h·b_uk[h]`` to every score of a query, which softmax ignores, and ``Σ_t p_t = 1`` turns the
  value bias into ``b_uv``: exact.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import _Attention, positions
from models.cache import Cache
from models.config import GPTConfig
from models.rope import Rotary
from models.splice import LearnedKVSplice
from models.stream_cache import DecodeCache

__all__ = ["LATENT_NORM_EPS", "MultiHeadLatentAttention", "absorbed", "naive"]

LATENT_NORM_EPS = 1e-6
"""eps of every MLA latent RMSNorm (``cfg.latent_norm``, ``cfg.kvsplice_norm``, a converted model's
``latent_norm``): transformers' DeepSeek-V3 fixes its ``kv_a_layernorm`` at this value, so an export computes the
same norm in transformers (llama.cpp and vLLM use ``rms_norm_eps``; the trained layout's
:data:`models.config.RMS_NORM_EPS` is the same number)."""

Attend = Callable[..., torch.Tensor]
"""``attend(q (B, H, Tq, D), k (B, Hk, Tk, D), v (B, Hk, Tk, Dv)[, k_scale, v_scale]) -> (B, H, Tq, Dv)``: causal
grouped-query attention (:func:`models.attention.attend` with the module's scale and kernel choice)."""


def _fused_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` as one matrix product over the stacked weights (one GEMM, not one per
    layer: MLA's small latent projections use the GPU poorly alone). Same values to round-off."""
    w = torch.cat([lin.weight for lin in layers])  # (Σ out, in)
    bias = None if layers[0].bias is None else torch.cat([lin.bias for lin in layers])
    return F.linear(x, w, bias).split([lin.out_features for lin in layers], dim=-1)


def _per_query_head(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """A KV-head-major tensor ``(Hkv, ...)`` repeated for the query heads that read each KV head: ``(H, ...)``."""
    return w if w.shape[0] == n_head else w.repeat_interleave(n_head // w.shape[0], 0)


def naive(attend: Attend, q: torch.Tensor, c: torch.Tensor, w_uk: nn.Linear, w_uv: nn.Linear, n_kv_head: int,
          qr: Optional[torch.Tensor] = None, kr: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (B, H, Tq, hs), latents c (B, Tk, R) [rotated RoPE queries qr (B, H, Tq, Dr), keys kr (B, Hr, Tk, Dr)] →
    per-head outputs (B, H, Tq, hs), with K and V expanded from every latent."""
    b, tk, _ = c.shape
    k, v = _fused_linear(c, (w_uk, w_uv))  # (B, Tk, Hkv·hs) each, one matrix product
    k = k.view(b, tk, n_kv_head, -1).transpose(1, 2)  # (B, Hkv, Tk, hs)
    v = v.view(b, tk, n_kv_head, -1).transpose(1, 2)  # (B, Hkv, Tk, hs)
    if qr is None:
        return attend(q, k, v)
    hs = q.shape[-1]
    kr = kr.expand(-1, n_kv_head, -1, -1) if kr.shape[1] == 1 else kr  # (B, Hkv, Tk, Dr): Hr ∈ {1, Hkv}
    q = torch.cat([q, qr], dim=-1)  # (B, H, Tq, hs + Dr)
    k = torch.cat([k, kr], dim=-1)  # (B, Hkv, Tk, hs + Dr)
    v = F.pad(v, (0, qr.shape[-1]))  # (B, Hkv, Tk, hs + Dr): equal head sizes keep the fused kernels; pad dropped
    return attend(q, k, v)[..., :hs]  # (B, H, Tq, hs)


def absorbed(attend: Attend, q: torch.Tensor, rows: torch.Tensor, w_uk: nn.Linear, w_uv: nn.Linear, n_kv_head: int,
             r: int, qr: Optional[torch.Tensor] = None, expand: Optional[torch.Tensor] = None,
             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (B, H, Tq, hs), cached rows (B, Hr, Tk, r [+ Dr]) — ``[c | k_rope]``, the key and value heads of the latent
    space (int8 with per-row ``scale (B, Hr, Tk, 1)`` for a kernel that reads them as stored) — and the rotated RoPE
    queries qr (B, H, Tq, Dr) when Dr > 0 → per-head outputs (B, H, Tq, hs). With KVSplice the rows hold ``s`` (r)
    and ``expand`` is E (R, r): ``q̃_h = (w_uk[h] E)ᵀ q_h``, ``o_h = w_uv[h] E Σ_t p_t s_t``."""
    h, hs = q.shape[1], q.shape[-1]
    w_k = _per_query_head(w_uk.weight.view(n_kv_head, hs, -1), h)  # (H, hs, R)
    w_v = _per_query_head(w_uv.weight.view(n_kv_head, hs, -1), h)  # (H, hs, R)
    q_lat = torch.einsum("bhtd,hdl->bhtl", q, w_k)  # (B, H, Tq, R)
    if expand is not None:
        q_lat = q_lat @ expand  # (B, H, Tq, r): (w_uk[h] E)ᵀ q_h
    if qr is not None:
        q_lat = torch.cat([q_lat, qr], dim=-1)  # (B, H, Tq, r + Dr) against the rows [s | k_rope]
    z = attend(q_lat, rows, rows, scale, scale)  # (B, H, Tq, r [+ Dr])
    z = z[..., :r]  # (B, H, Tq, r): Σ_t p_t s_t (the RoPE columns of the value are dropped)
    if expand is not None:
        z = z @ expand.T  # (B, H, Tq, R)
    y = torch.einsum("bhtl,hdl->bhtd", z, w_v)  # (B, H, Tq, hs)
    if w_uv.bias is not None:
        y = y + _per_query_head(w_uv.bias.view(n_kv_head, 1, hs), h)  # (H, 1, hs) over (B, H, Tq, hs)
    return y


class MultiHeadLatentAttention(_Attention):
    """DeepSeek-style MLA, optionally with KVSplice: without RoPE in the GPT-2 layout (learned absolute positions), with
    DeepSeek's decoupled RoPE key in the ``deepseek_v3`` layout (the latent math: :func:`naive`, :func:`absorbed`).

    Per token ``c = w_dkv x`` (d_latent; ``c = RMSNorm(w_dkv x)`` with ``cfg.latent_norm``); with KVSplice ``s = C c``
    (d_compressed; RMS-normalised with ``cfg.kvsplice_norm``) is what gets cached and ``ĉ = E s`` replaces ``c``.
    Per head ``k_h = w_uk[h] ĉ``, ``v_h = w_uv[h] ĉ``. With ``qk_rope_head_dim = Dr > 0`` each head's query gains a
    RoPE part ``rope(w_qr[h] x)`` and every token one RoPE key ``rope(w_kr x)`` shared by all heads, cached after the
    latent (a row ``[s | k_rope]`` of ``cfg.cache_dim``); scores are ``(q_h·k_h + q_rope,h·k_rope)·(hs + Dr)^-½``.

    The cached rows are the one shared key/value head of the absorbed path (:func:`absorbed`, ``Hr = 1``).
    The full forward without a cache uses the naive path (flash-friendly head size); cached calls follow
    ``cfg.mla_impl``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.w_q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.w_dkv = nn.Linear(cfg.d_model, cfg.d_latent, bias=cfg.bias)
        self.w_uk = nn.Linear(cfg.d_latent, cfg.d_model, bias=cfg.bias)
        self.w_uv = nn.Linear(cfg.d_latent, cfg.d_model, bias=cfg.bias)
        self.kv_norm = nn.RMSNorm(cfg.d_latent, eps=LATENT_NORM_EPS) if cfg.latent_norm else None
        self.splice = (LearnedKVSplice(cfg.d_latent, cfg.d_compressed, orthogonal=cfg.kvsplice_orthogonal)
                       if cfg.d_compressed is not None else None)
        self.splice_norm = nn.RMSNorm(cfg.d_compressed, eps=LATENT_NORM_EPS) if cfg.kvsplice_norm else None
        self.d_rope = dr = cfg.qk_rope_head_dim
        self.r = cfg.d_cached_latent
        if dr:  # decoupled RoPE (deepseek_v3 layout): DeepSeek's W^QR (per head) and W^KR (one key per token)
            self.w_qr = nn.Linear(cfg.d_model, cfg.n_head * dr, bias=False)
            self.w_kr = nn.Linear(cfg.d_model, dr, bias=False)
            self.rotary = Rotary(dr, cfg.rope_theta)
            self.scale = 1.0 / math.sqrt(cfg.head_size + dr)  # DeepSeek's fixed (nope + rope)^-½

    def latent(self, x: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What the cache stores for ``x`` at positions ``pos (T,)`` (default from 0): ``c`` (B, T, d_latent) or
        ``s = C c`` (B, T, d_compressed), followed by the rotated RoPE key (B, T, Dr) when ``Dr > 0``."""
        kr = None
        if self.d_rope:
            pos = positions(None, x.shape[1], x.device) if pos is None else pos  # (T,)
            kr = self.rotary(self.w_kr(x), pos=pos)[0]  # (B, T, Dr)
        return self._row(x, kr)

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        qr = kr = None  # each head's RoPE query (B, H, T, Dr), the shared RoPE key (B, T, Dr)
        if self.d_rope:
            pos = positions(cache, t, x.device)  # (T,), before this layer's append
            qr = self.w_qr(x).view(b, t, self.n_head, self.d_rope).transpose(1, 2)  # (B, H, T, Dr)
            qr, kr = self.rotary(qr, self.w_kr(x), pos=pos)  # one cos/sin table for both
        if cache is None:  # training / full forward: w_q and w_dkv as one matrix product
            q, c = _fused_linear(x, (self.w_q, self.w_dkv))  # (B, T, d_model), (B, T, d_latent)
            q = q.view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, hs)
            c = self.kv_norm(c) if self.kv_norm is not None else c
            if self.splice is not None:  # E (norm) C c: compress and expand are in the training graph
                c = self.splice.expand(self._normed_s(self.splice.compress(c)))  # (B, T, d_latent)
            return self._out(self._naive(q, c, qr, kr, fixed_shape=True))
        q = self.w_q(x).view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        bias, fixed = cache.key_bias(), cache.fixed_shape  # (1, 1, Tk) for a fixed-capacity view, else None
        if self.cfg.mla_impl == "naive":
            rows = cache.append(layer, c=self._row(x, kr))["c"]  # (B, Tk, r [+ Dr])
            s, kr = (rows, None) if not self.d_rope else rows.split([self.r, self.d_rope], dim=-1)
            c = self.splice.expand(s) if self.splice is not None else s  # (B, Tk, d_latent), re-expanded per call
            return self._out(self._naive(q, c, qr, kr, bias, fixed, cache))
        rows, sc = self._append(q, cache, layer, c=self._row(x, kr))  # (B, Tk, r [+ Dr]) (int8 + scales: kernel)
        return self._out(self._absorbed(q, rows["c"], bias, fixed, cache, sc.get("c"), qr))

    def _row(self, x: torch.Tensor, kr: Optional[torch.Tensor]) -> torch.Tensor:
        """The cached row of each token: the (compressed, normalised) latent, then the rotated RoPE key ``kr``."""
        c = self._c(x)  # (B, T, d_latent)
        s = c if self.splice is None else self._normed_s(self.splice.compress(c))  # (B, T, r)
        return s if kr is None else torch.cat([s, kr], dim=-1)  # (B, T, r [+ Dr])

    def _c(self, x: torch.Tensor) -> torch.Tensor:
        """The latent ``c = w_dkv x`` (B, T, d_latent), RMS-normalised per token with ``cfg.latent_norm``."""
        c = self.w_dkv(x)  # (B, T, d_latent)
        return self.kv_norm(c) if self.kv_norm is not None else c

    def _normed_s(self, s: torch.Tensor) -> torch.Tensor:
        """The compressed latent as cached: RMS-normalised per token with ``cfg.kvsplice_norm``."""
        return self.splice_norm(s) if self.splice_norm is not None else s

    def _attend_fn(self, bias: Optional[torch.Tensor] = None, fixed_shape: bool = False,
                   cache: Optional[Cache] = None) -> Attend:
        """This call's ``attend``: the module's kernel choice (:meth:`_Attention._attend`) over the cache's view."""
        return lambda q, k, v, k_scale=None, v_scale=None: self._attend(q, k, v, bias, fixed_shape, cache, k_scale,
                                                                         v_scale)

    def _naive(self, q: torch.Tensor, c: torch.Tensor, qr: Optional[torch.Tensor], kr: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None, fixed_shape: bool = False,
               cache: Optional[Cache] = None) -> torch.Tensor:
        """q (B, H, Tq, hs), latents c (B, Tk, d_latent) [RoPE queries qr (B, H, Tq, Dr), keys kr (B, Tk, Dr)] →
        per-head outputs (B, H, Tq, hs) (:func:`naive`)."""
        return naive(self._attend_fn(bias, fixed_shape, cache), q, c, self.w_uk, self.w_uv, self.n_head, qr,
                     None if kr is None else kr[:, None])  # (B, 1, Tk, Dr): one RoPE key for every head

    def _absorbed(self, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  fixed_shape: bool = False, cache: Optional[Cache] = None,
                  s_scale: Optional[torch.Tensor] = None, qr: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (B, H, Tq, hs), cached rows s (B, Tk, r [+ Dr]) (int8 with ``s_scale (B, Tk, 1)`` for the kernel), RoPE
        queries qr (B, H, Tq, Dr) when Dr > 0 → per-head outputs (B, H, Tq, hs) (:func:`absorbed`, the rows as
        one shared key/value head)."""
        e = self.splice.expand_weight() if self.splice is not None else None  # (d_latent, r)
        sc = None if s_scale is None else s_scale[:, None]  # (B, 1, Tk, 1)
        return absorbed(self._attend_fn(bias, fixed_shape, cache), q, s[:, None], self.w_uk, self.w_uv, self.n_head,
                        self.r, qr, e, sc)
