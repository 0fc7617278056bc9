"""A Llama-family decoder whose attention is MLA with decoupled RoPE: what ``kvsplice to-mla`` makes of a
pretrained Llama / Mistral / Qwen2 / Qwen3 (:mod:`kvsplice.convert.llama_mla`).

Per layer and token the cache holds the latent ``c = w_dkv x`` (``d_latent``; RMS-normalised with
``latent_norm``) and ``rope_heads`` RoPE keys of ``rope_dims`` each — ``n_kv_head`` of them (``per-head`` layout:
each KV head keeps its own few rotary frequency pairs, MHA2MLA) or one (``shared``: one RoPE key per token whose
pairs mix the KV heads per frequency, TransMLA / DeepSeek). Attention of query head ``i`` (KV group ``g``)::

    score = scale · ( q_i · k_nope[g]  +  rope(q_i A_i) · rope_key[r(i)] )
    k_nope = w_uk c (+ b_k),  v = w_uv c (+ b_v),  rope_key = norm_k(w_k x) B  (selected / mixed pairs)

``A_i`` (``q_rope``, ``(H, D, rope_dims)``) and ``B`` (``k_rope``, ``(Hkv·D, rope_heads·rope_dims)``) are fixed maps
from the source model's head coordinates to the RoPE part (selection, and for ``shared`` the per-frequency mixing
weights); the queries' no-RoPE part is the whole unrotated query. RoPE uses the rotate-half layout over each RoPE
head, with its own frequencies (``inv_freq``, ``(rope_heads, rope_dims / 2)``, kept from the source's table).

Two decode paths, the latent math of :mod:`models.latent_attention` (shared with the trained MLA models): ``naive``
(expand the latent to K/V per call) and ``absorbed`` (``w_uk`` folded into the query, attention over the latent
itself, ``w_uv`` applied to the attention-weighted latent); tests hold them equal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.compat import current_value
from models.config import MLA_IMPLS, MLAImpl
from models.attention import attend
from models.latent_attention import LATENT_NORM_EPS, Attend, absorbed, naive
from models.quant import QUANT_MODES, row_bytes
from models.rope import rotate
from models.stream_cache import DecodeCache

__all__ = ["MLALlama", "MLALlamaConfig", "MODEL_TYPE", "ROPE_LAYOUTS"]

MODEL_TYPE = "kvsplice_mla_llama"
"""``model_type`` in the ``config.json`` of a converted model folder."""
ROPE_LAYOUTS = ("per-head", "shared")


@dataclass
class MLALlamaConfig:
    """Everything that shapes an :class:`MLALlama`; saved as ``config.json`` (``model_type`` :data:`MODEL_TYPE`)."""

    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    d_latent: int
    rope_dims: int  # dims of one RoPE key (even); 0: no RoPE part
    rope_layout: str = "per-head"
    latent_norm: bool = False
    norm_eps: float = 1e-6
    latent_norm_eps: float = LATENT_NORM_EPS  # eps of the latent RMSNorm
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    head_norms: bool = False  # RMSNorm of each q / k head before RoPE (Qwen3)
    softmax_scale: Optional[float] = None  # None: (head_dim)^-0.5
    rope_attention_scaling: float = 1.0  # transformers' cos/sin factor of some RoPE types
    max_positions: int = 2048
    tie_embeddings: bool = False
    windows: list = field(default_factory=list)  # per layer: sliding window (tokens a query sees) or None
    mla_impl: MLAImpl = "naive"  # how cached decode attends: models.config.MLA_IMPLS (the trained family's names)
    cache_quant: Optional[str] = None  # None | "int8" (int8 rows + an fp16 scale per row) | "int4" (models.stream_cache)
    source: dict = field(default_factory=dict)  # where it came from (model_type, path, conversion settings)

    def __post_init__(self) -> None:
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if self.rope_dims % 2 or not 0 <= self.rope_dims <= self.head_dim:
            raise ValueError(f"rope_dims must be even and in [0, head_dim={self.head_dim}], got {self.rope_dims}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.mla_impl not in MLA_IMPLS:
            raise ValueError(f"mla_impl must be one of {MLA_IMPLS}, got {self.mla_impl!r}")
        if self.cache_quant not in QUANT_MODES:
            raise ValueError(f"cache_quant must be one of {QUANT_MODES}, got {self.cache_quant!r}")
        if not self.windows:
            self.windows = [None] * self.n_layer

    @property
    def rope_heads(self) -> int:
        return self.n_kv_head if self.rope_layout == "per-head" else 1

    @property
    def cache_dim(self) -> int:
        """Numbers cached per token per layer: the latent and the RoPE keys."""
        return self.d_latent + self.rope_heads * self.rope_dims

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MLALlamaConfig":
        d = {k: current_value(k, v) for k, v in d.items() if k != "model_type"}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown {MODEL_TYPE} config keys: {sorted(unknown)}")
        return cls(**d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLALlamaConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, kv, d, hd, r, dr = cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.head_dim, cfg.d_latent, cfg.rope_dims
        self.q_proj = nn.Linear(d, h * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=cfg.attention_bias)  # source keys: the RoPE part is cut from them
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.head_norms else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.head_norms else None
        self.w_dkv = nn.Linear(d, r, bias=False)
        self.kv_norm = RMSNorm(r, cfg.latent_norm_eps) if cfg.latent_norm else None
        self.w_uk = nn.Linear(r, kv * hd, bias=cfg.attention_bias)
        self.w_uv = nn.Linear(r, kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.register_buffer("q_rope", torch.zeros(h, hd, dr))  # (H, D, Dr): query head -> its RoPE query
        self.register_buffer("k_rope", torch.zeros(kv * hd, cfg.rope_heads * dr))  # keys -> RoPE keys
        self.register_buffer("inv_freq", torch.zeros(cfg.rope_heads, dr // 2))  # (Hr, Dr/2)

    # ------------------------------------------------------------------------------------------- pieces
    def _rope_tables(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``(Hr, T, Dr)`` at positions ``pos (T,)`` (rotate-half layout: each frequency twice)."""
        ang = pos.float()[None, :, None] * self.inv_freq.float()[:, None, :]  # (Hr, T, Dr/2)
        ang = torch.cat([ang, ang], dim=-1)  # (Hr, T, Dr)
        s = self.cfg.rope_attention_scaling
        return (ang.cos() * s).to(dtype), (ang.sin() * s).to(dtype)

    def queries(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q (B, H, T, D)`` (unrotated: the no-RoPE part) and the rotated RoPE queries ``(B, H, T, Dr)``."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, cfg.n_head, cfg.head_dim).transpose(1, 2)  # (B, H, T, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
        qr = torch.einsum("bhtd,hde->bhte", q, self.q_rope.to(q.dtype))  # (B, H, T, Dr)
        cos, sin = self._rope_tables(pos, q.dtype)  # (Hr, T, Dr)
        g = cfg.n_head // cfg.rope_heads
        cos, sin = cos.repeat_interleave(g, 0), sin.repeat_interleave(g, 0)  # (H, T, Dr): head i reads rope head i//g
        return q, rotate(qr, cos, sin)

    def cached(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds for ``x (B, T, d)``: the latent ``(B, T, R)`` and rotated RoPE keys ``(B, Hr, T, Dr)``."""
        b, t, _ = x.shape
        cfg = self.cfg
        c = self.w_dkv(x)  # (B, T, R)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        k = self.k_proj(x)  # (B, T, Hkv·D)
        if self.k_norm is not None:
            k = self.k_norm(k.view(b, t, cfg.n_kv_head, cfg.head_dim)).flatten(2)  # per head
        kr = (k @ self.k_rope.to(k.dtype)).view(b, t, cfg.rope_heads, cfg.rope_dims).transpose(1, 2)  # (B, Hr, T, Dr)
        cos, sin = self._rope_tables(pos, kr.dtype)  # (Hr, T, Dr)
        return c, rotate(kr, cos, sin)

    # ------------------------------------------------------------------------------------------- attention
    def _attend_fn(self) -> Attend:
        """Causal attention at the model's scale, within this layer's sliding window (SDPA)."""
        cfg = self.cfg
        return lambda q, k, v, *_: attend(q, k, v, scale=cfg.scale, window=cfg.windows[self.layer])

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None, layer: Optional[int] = None
                ) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        start = cache.layer_len(self.layer) if cache is not None else 0
        pos = torch.arange(start, start + t, device=x.device)  # (T,)
        q, qr = self.queries(x, pos)  # (B, H, T, D), (B, H, T, Dr)
        c, kr = self.cached(x, pos)  # (B, T, R), (B, Hr, T, Dr)
        if cache is not None:
            views = cache.append(self.layer, c=c, kr=kr)
            c, kr = views["c"], views["kr"]  # (B, Tk, R), (B, Hr, Tk, Dr)
        if not cfg.rope_dims:
            qr = kr = None
        if cache is not None and cfg.mla_impl == "absorb":
            rows = c[:, None]  # (B, 1, Tk, R)
            if kr is not None:
                rows = torch.cat([rows.expand(-1, cfg.rope_heads, -1, -1), kr], dim=-1)  # (B, Hr, Tk, R + Dr)
            z = absorbed(self._attend_fn(), q, rows, self.w_uk, self.w_uv, cfg.n_kv_head, cfg.d_latent, qr)
        else:
            z = naive(self._attend_fn(), q, c, self.w_uk, self.w_uv, cfg.n_kv_head, qr, kr)  # (B, H, T, D)
        return self.o_proj(z.transpose(1, 2).reshape(b, t, -1))  # (B, T, d)


class Block(nn.Module):
    def __init__(self, cfg: MLALlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAAttention(cfg, layer)
        self.post_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: torch.Tensor, cache: Optional[DecodeCache] = None) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cache)
        return x + self.mlp(self.post_norm(x))


class MLALlama(nn.Module):
    """``model(ids (B, T), cache=None) -> logits (B, T, V)``; with a cache (:meth:`new_cache`) each call appends."""

    def __init__(self, cfg: MLALlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, cache: Optional[DecodeCache] = None) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, d)
        for block in self.layers:
            x = block(x, cache)
        return self.lm_head(self.norm(x))

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                  device=None, quant: Any = ...) -> DecodeCache:
        """Per layer a latent stream ``c (B, T, R)`` and a RoPE-key stream ``kr (B, Hr, T, Dr)``; ``quant``
        defaults to ``cfg.cache_quant``."""
        cfg, p = self.cfg, self.embed.weight
        quant = cfg.cache_quant if quant is ... else quant
        spec = {"c": (cfg.d_latent,), "kr": (cfg.rope_heads, cfg.rope_dims)}
        return DecodeCache([spec] * cfg.n_layer, batch_size, dtype=dtype or p.dtype, device=device or p.device,
                           capacity=capacity, quant=quant)

    def cache_bytes_formula(self, batch_size: int, n_tokens: int, dtype: torch.dtype) -> int:
        """Bytes a cache of ``n_tokens`` per layer holds: a latent row and ``rope_heads`` RoPE-key rows per token and
        layer, each ``d`` numbers at ``dtype`` or, with ``cache_quant``, the quantiser's bytes a row
        (:func:`models.quant.row_bytes`: int8 ``d + 2``, int4 ``d/2`` plus an fp16 scale and minimum per group)."""
        cfg = self.cfg
        per_token = (row_bytes(cfg.cache_quant, cfg.d_latent, dtype)
                     + cfg.rope_heads * row_bytes(cfg.cache_quant, cfg.rope_dims, dtype))
        return batch_size * n_tokens * cfg.n_layer * per_token

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

