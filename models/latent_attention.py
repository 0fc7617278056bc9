"""MLA (multi-head latent attention), optionally with KVSplice and DeepSeek's decoupled RoPE key: one module,
naive and absorbed paths side by side, both through :func:`models.attention.attend` (the math, once)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import LATENT_NORM_EPS, _Attention, positions
from models.cache import Cache, DecodeCache
from models.config import GPTConfig
from models.rope import Rotary
from models.splice import LearnedKVSplice

__all__ = ["MultiHeadLatentAttention"]


def _fused_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` as one matrix product over the stacked weights (one GEMM, not one per
    layer: MLA's small latent projections use the GPU poorly alone). Same values to round-off."""
    w = torch.cat([lin.weight for lin in layers])  # (Σ out, in)
    bias = None if layers[0].bias is None else torch.cat([lin.bias for lin in layers])
    return F.linear(x, w, bias).split([lin.out_features for lin in layers], dim=-1)


class MultiHeadLatentAttention(_Attention):
    """DeepSeek-style MLA, optionally with KVSplice: without RoPE in the GPT-2 layout (learned absolute positions), with
    DeepSeek's decoupled RoPE key in the ``deepseek_v3`` layout.

    Per token ``c = w_dkv x`` (d_latent; ``c = RMSNorm(w_dkv x)`` with ``cfg.latent_norm``); with KVSplice ``s = C c``
    (d_compressed; RMS-normalised with ``cfg.kvsplice_norm``) is what gets cached and ``ĉ = E s`` replaces ``c``.
    Per head ``k_h = w_uk[h] ĉ``, ``v_h = w_uv[h] ĉ``. With ``qk_rope_head_dim = Dr > 0`` each head's query gains a
    RoPE part ``rope(w_qr[h] x)`` and every token one RoPE key ``rope(w_kr x)`` shared by all heads, cached after the
    latent (a row ``[s | k_rope]`` of ``cfg.cache_dim``); scores are ``(q_h·k_h + q_rope,h·k_rope)·(hs + Dr)^-½``.

    * naive: expand every cached latent into K, V ``(B, H, Tk, hs)`` and attend (reference; also the training path).
    * absorb: ``q̃_h = (w_uk[h] E)ᵀ q_h`` and attend in latent space with the cached rows as the single shared
      key/value head (``[q̃_h | q_rope,h]`` against ``[s | k_rope]``; the output's first ``r`` columns are
      ``Σ_t p_t s_t``); ``o_h = w_uv[h] E (Σ_t p_t s_t) + b_uv[h]``. The key bias ``b_uk`` adds ``q_h·b_uk[h]`` to
      every score of a query, which softmax ignores, and ``Σ_t p_t = 1`` turns the value bias into ``b_uv``: exact.
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

    def _expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = c.shape
        k, v = _fused_linear(c, (self.w_uk, self.w_uv))  # (B, Tk, d_model) each, one matrix product
        k = k.view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, Tk, hs)
        v = v.view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, Tk, hs)
        return k, v

    def _naive(self, q: torch.Tensor, c: torch.Tensor, qr: Optional[torch.Tensor], kr: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None, fixed_shape: bool = False,
               cache: Optional[Cache] = None) -> torch.Tensor:
        """q (B, H, Tq, hs), latents c (B, Tk, d_latent) [RoPE queries qr (B, H, Tq, Dr), keys kr (B, Tk, Dr)] →
        per-head outputs (B, H, Tq, hs), with K and V expanded from every latent."""
        k, v = self._expand(c)  # (B, H, Tk, hs) each
        if qr is None:
            return self._attend(q, k, v, bias, fixed_shape, cache)
        h, hs = self.n_head, self.head_size
        q = torch.cat([q, qr], dim=-1)  # (B, H, Tq, hs + Dr)
        k = torch.cat([k, kr[:, None].expand(-1, h, -1, -1)], dim=-1)  # (B, H, Tk, hs + Dr): one RoPE key, all heads
        v = F.pad(v, (0, self.d_rope))  # (B, H, Tk, hs + Dr): equal head sizes keep the fused kernels; pad dropped
        return self._attend(q, k, v, bias, fixed_shape, cache)[..., :hs]  # (B, H, Tq, hs)

    def _absorbed(self, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  fixed_shape: bool = False, cache: Optional[Cache] = None,
                  s_scale: Optional[torch.Tensor] = None, qr: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q (B, H, Tq, hs), cached rows s (B, Tk, r [+ Dr]) (int8 with ``s_scale (B, Tk, 1)`` for the kernel), RoPE
        queries qr (B, H, Tq, Dr) when Dr > 0 → per-head outputs (B, H, Tq, hs)."""
        h, hs = self.n_head, self.head_size
        w_uk = self.w_uk.weight.view(h, hs, -1)  # (H, hs, d_latent)
        w_uv = self.w_uv.weight.view(h, hs, -1)  # (H, hs, d_latent)
        q_lat = torch.einsum("bhtd,hdl->bhtl", q, w_uk)  # (B, H, Tq, d_latent)
        if self.splice is not None:
            q_lat = q_lat @ self.splice.expand_weight()  # (B, H, Tq, r): (w_uk[h] E)ᵀ q_h
        if qr is not None:
            q_lat = torch.cat([q_lat, qr], dim=-1)  # (B, H, Tq, r + Dr) against the rows [s | k_rope]
        sc = None if s_scale is None else s_scale[:, None]  # (B, 1, Tk, 1)
        z = self._attend(q_lat, s[:, None], s[:, None], bias, fixed_shape, cache, sc, sc)  # (B, H, Tq, r [+ Dr])
        z = z[..., :self.r]  # (B, H, Tq, r): Σ_t p_t s_t (the RoPE columns of the value are dropped)
        if self.splice is not None:
            z = z @ self.splice.expand_weight().T  # (B, H, Tq, d_latent)
        y = torch.einsum("bhtl,hdl->bhtd", z, w_uv)  # (B, H, Tq, hs)
        if self.w_uv.bias is not None:
            y = y + self.w_uv.bias.view(1, h, 1, hs)
        return y
