"""Attention: the kernel choice (flash-attn / SDPA), the causal attention math (written once), MHA and MLA.

``attend`` is the only place where scores are formed; every module and every cache path calls it. It takes the
grouped-query layout ``q (B, Hq, Tq, D)``, ``k (B, Hkv, Tk, D)``, ``v (B, Hkv, Tk, Dv)`` with ``Hq % Hkv == 0``, and
aligns the causal mask bottom-right: with ``Tq`` new queries over ``Tk`` keys (cached + new), query ``i`` sits at
absolute position ``Tk - Tq + i``. (SDPA's ``is_causal=True`` aligns top-left, which is only right when
``Tq == Tk``: with one decode query it would see only key 0.)

MLA's absorbed path is the same call with ``Hkv = 1``: every query head attends over the one shared latent.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.cache import DecodeCache
from models.splice import LearnedKVSplice
from models.config import GPTConfig

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
LATENT_NORM_EPS = 1e-6
"""eps of MLA's latent RMSNorm (``cfg.latent_norm``)."""


# ------------------------------------------------------------------------------------------ kernel selection
@lru_cache(maxsize=1)
def flash_attn_func_or_none():
    """``flash_attn.flash_attn_func`` if the optional ``flash`` extra is installed and importable, else None."""
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA build
        return None
    return flash_attn_func


def flash_unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int, dv: Optional[int] = None,
                             *, installed: Optional[bool] = None) -> Optional[str]:
    """Why flash-attn cannot run this call, or None when it can."""
    if installed is None:
        installed = flash_attn_func_or_none() is not None
    if not installed:
        return "flash-attn is not installed (pip install -e '.[flash]' on a CUDA machine)"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, got {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn needs fp16 or bf16, got {dtype}"
    if dv is not None and dv != head_dim:
        return f"flash-attn needs equal q/k and v head dims, got {head_dim} and {dv}"
    if head_dim % 8 != 0 or head_dim > FLASH_MAX_HEAD_DIM:
        return f"flash-attn needs a head dim that is a multiple of 8 and <= {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    return None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   dv: Optional[int] = None, *, installed: Optional[bool] = None) -> str:
    """``"flash"`` or ``"sdpa"`` for this call. ``"auto"`` prefers flash where it can run; ``"flash"`` raises a
    ``RuntimeError`` saying why when it cannot (never a silent fallback); ``"sdpa"`` always gives SDPA."""
    if requested == "sdpa":
        return "sdpa"
    reason = flash_unsupported_reason(device, dtype, head_dim, dv, installed=installed)
    if requested == "flash":
        if reason is not None:
            raise RuntimeError(f"attn_backend='flash' cannot run here: {reason}; use attn_backend='auto' or 'sdpa'")
        return "flash"
    if requested == "auto":
        return "sdpa" if reason is not None else "flash"
    raise ValueError(f"attn_backend must be one of ('auto', 'flash', 'sdpa'), got {requested!r}")


# -------------------------------------------------------------------------------------------- the math, once
def causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask ``(Tq, Tk)``: True where query i (position Tk-Tq+i) may see key j."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]  # (Tq, 1)
    return torch.arange(t_k, device=device)[None, :] <= q_pos  # (Tq, Tk)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: Optional[torch.Tensor] = None,
         is_causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + mask)·v`` on matching head layouts: ``F.scaled_dot_product_attention``, except when the
    key and value head sizes differ (low-rank pre-RoPE keys vs value coefficients), where SDPA falls back to its slow
    generic kernel and the same math in three ops is faster. ``mask``: boolean (True = attend) or additive; a query
    row that may see no key gets zeros, not NaN."""
    if q.shape[-1] == v.shape[-1] or dropout_p > 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                              scale=scale)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Tq, Tk)
    if is_causal:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)  # (Tq, Tk)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1)
    if mask is not None:
        p = p.nan_to_num(0.0)
    return p @ v  # (B, H, Tq, Dv)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, backend: str = "sdpa",
           dropout_p: float = 0.0, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of ``Tq`` new queries over ``Tk >= Tq`` keys whose last ``Tq`` are the queries' own.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), Hq % Hkv == 0 → (B, Hq, Tq, Dv).
    Query head h reads key/value head ``h // (Hq // Hkv)`` (the grouped-query convention of HF ``repeat_kv``).
    ``bias`` (B, Hkv, Tk), optional, is added to every score of a key (per-token log-weights of a token-subset
    cache: ``softmax(q·kᵀ·scale + bias)``); it needs the SDPA backend.
    """
    b, hq, t_q, d = q.shape
    hkv, t_k = k.shape[1], k.shape[2]
    if hq % hkv != 0 or t_k < t_q:
        raise ValueError(f"attend: bad shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)}")
    if backend == "flash":
        if bias is not None:
            raise ValueError("attend: flash-attn takes no additive bias; use backend='sdpa'")
        flash_attn_func = flash_attn_func_or_none()
        # flash-attn >= 2.1 aligns its causal mask bottom-right and supports Hkv | Hq natively.
        y = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, T, H, D)
                            dropout_p=dropout_p, softmax_scale=scale, causal=True)
        return y.transpose(1, 2)  # (B, Hq, Tq, Dv)
    g = hq // hkv
    if g > 1:
        # Fold the g query heads that share a KV head into the query-row axis: no copy of K/V.
        q = q.reshape(b, hkv, g * t_q, d)  # (B, Hkv, g*Tq, D), rows ordered (head in group, query)
    if bias is not None:
        if tuple(bias.shape) != (b, hkv, t_k):
            raise ValueError(f"attend: bias must be (B, Hkv, Tk) = {(b, hkv, t_k)}, got {tuple(bias.shape)}")
        mask, is_causal = bias.to(q.dtype)[:, :, None, :], False  # (B, Hkv, 1, Tk), broadcast over query rows
        if t_q > 1:
            allowed = causal_mask(t_q, t_k, q.device).repeat(g, 1)  # (g*Tq, Tk)
            mask = mask.masked_fill(~allowed, float("-inf"))  # (B, Hkv, g*Tq, Tk)
    elif t_q == 1:
        mask, is_causal = None, False  # one new query sees every key
    elif t_q == t_k and g == 1:
        mask, is_causal = None, True  # square: SDPA's top-left alignment is right
    else:
        mask, is_causal = causal_mask(t_q, t_k, q.device).repeat(g, 1), False  # (g*Tq, Tk)
    y = sdpa(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)  # (B, Hkv, g*Tq, Dv)
    return y.reshape(b, hq, t_q, v.shape[-1])  # (B, Hq, Tq, Dv)


class _Attention(nn.Module):
    """What MHA and MLA share: config, output projection, dropout and the kernel choice for each call."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_head = cfg.n_head
        self.head_size = cfg.head_size
        self.scale = 1.0 / math.sqrt(cfg.head_size)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.last_backend: Optional[str] = None  # which kernel the last call ran ("flash" or "sdpa")

    def _attend(self, q, k, v) -> torch.Tensor:
        backend = select_backend(self.cfg.attn_backend, q.device, q.dtype, q.shape[-1], v.shape[-1])
        self.last_backend = backend
        return attend(q, k, v, scale=self.scale, backend=backend,
                      dropout_p=self.cfg.dropout if self.training else 0.0)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, h, t, hs = y.shape
        y = y.transpose(1, 2).reshape(b, t, h * hs)  # (B, T, d_model)
        return self.resid_dropout(self.c_proj(y))


class CausalSelfAttention(_Attention):
    """GPT-2 multi-head attention, or grouped-query / multi-query attention with ``cfg.n_kv_head`` KV heads; caches
    K and V ``(B, Hkv, T, hs)`` per layer. ``c_attn`` outputs ``[q (d_model) | k (Hkv·hs) | v (Hkv·hs)]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.n_kv_head = cfg.kv_heads
        self.c_attn = nn.Linear(cfg.d_model, cfg.d_model + 2 * self.n_kv_head * cfg.head_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        d_kv = self.n_kv_head * self.head_size
        q, k, v = self.c_attn(x).split([c, d_kv, d_kv], dim=2)  # (B, T, d_model), 2 × (B, T, Hkv·hs)
        q = q.view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        k, v = (z.view(b, t, self.n_kv_head, self.head_size).transpose(1, 2) for z in (k, v))  # (B, Hkv, T, hs)
        if cache is not None:
            kv = cache.append(layer, k=k, v=v)
            k, v = kv["k"], kv["v"]  # (B, Hkv, Tk, hs)
        return self._out(self._attend(q, k, v))


class MultiHeadLatentAttention(_Attention):
    """DeepSeek-style MLA without RoPE (GPT-2 keeps learned absolute positions), optionally with KVSplice.

    Per token ``c = w_dkv x`` (d_latent; ``c = RMSNorm(w_dkv x)`` with ``cfg.latent_norm``); with KVSplice ``s = C c`` (d_compressed) is what gets cached and
    ``ĉ = E s`` replaces ``c``. Per head ``k_h = w_uk[h] ĉ``, ``v_h = w_uv[h] ĉ``.

    * naive: expand every cached latent into K, V ``(B, H, Tk, hs)`` and attend (reference; also the training path).
    * absorb: ``q̃_h = (w_uk[h] E)ᵀ q_h`` and attend in latent space with the cached latents as the single shared
      key/value head; ``o_h = w_uv[h] E (Σ_t p_t s_t) + b_uv[h]``. The key bias ``b_uk`` adds ``q_h·b_uk[h]`` to
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

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache stores for ``x``: ``c`` (B, T, d_latent) or ``s = C c`` (B, T, d_compressed)."""
        c = self._c(x)  # (B, T, d_latent)
        return self.splice.compress(c) if self.splice is not None else c

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.w_q(x).view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, T, hs)
        if cache is None:
            c = self._c(x)  # (B, T, d_latent)
            if self.splice is not None:
                c = self.splice(c)  # E C c: both compress and expand are in the training graph
            return self._out(self._attend(q, *self._expand(c)))
        s = cache.append(layer, c=self.latent(x))["c"]  # (B, Tk, r)
        if self.cfg.mla_impl == "naive":
            c = self.splice.expand(s) if self.splice is not None else s  # (B, Tk, d_latent), re-expanded per call
            return self._out(self._attend(q, *self._expand(c)))
        return self._out(self._absorbed(q, s))

    def _c(self, x: torch.Tensor) -> torch.Tensor:
        """The latent ``c = w_dkv x`` (B, T, d_latent), RMS-normalised per token with ``cfg.latent_norm``."""
        c = self.w_dkv(x)  # (B, T, d_latent)
        return self.kv_norm(c) if self.kv_norm is not None else c

    def _expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = c.shape
        k = self.w_uk(c).view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, Tk, hs)
        v = self.w_uv(c).view(b, t, self.n_head, self.head_size).transpose(1, 2)  # (B, H, Tk, hs)
        return k, v

    def _absorbed(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """q (B, H, Tq, hs), cached latents s (B, Tk, r) → per-head outputs (B, H, Tq, hs)."""
        h, hs = self.n_head, self.head_size
        w_uk = self.w_uk.weight.view(h, hs, -1)  # (H, hs, d_latent)
        w_uv = self.w_uv.weight.view(h, hs, -1)  # (H, hs, d_latent)
        q_lat = torch.einsum("bhtd,hdl->bhtl", q, w_uk)  # (B, H, Tq, d_latent)
        if self.splice is not None:
            q_lat = q_lat @ self.splice.expand_weight()  # (B, H, Tq, r): (w_uk[h] E)ᵀ q_h
        z = self._attend(q_lat, s[:, None], s[:, None])  # (B, H, Tq, r): Σ_t p_t s_t
        if self.splice is not None:
            z = z @ self.splice.expand_weight().T  # (B, H, Tq, d_latent)
        y = torch.einsum("bhtl,hdl->bhtd", z, w_uv)  # (B, H, Tq, hs)
        if self.w_uv.bias is not None:
            y = y + self.w_uv.bias.view(1, h, 1, hs)
        return y
