"""Apply low-rank KV bases: decode HF GPT-2 / HF Llama / our MHA GPT with a cache that stores only coefficients.

:class:`CoefficientDecoder` is a small decode driver. It runs the model's own submodules (embeddings, norms,
MLPs, rotary embedding, LM head) layer by layer and does the attention itself, through
:func:`models.attention.attend`, over a :class:`~kvsplice.lowrank.cache.CoefficientCache`::

    dec = CoefficientDecoder(model, bases)             # or apply_bases(model, bases); bases=None → full K/V cache
    cache = dec.new_cache(batch_size=1)
    logits = dec(prompt_ids, cache)                    # prefill (B, T, V): appends T tokens
    logits = dec(next_ids, cache)                      # decode one token (or a chunk of several)
    out = generate(dec, prompt_ids, max_new_tokens=20)  # greedy by default
    ppl = perplexity(dec, ids)                         # every token attends over the compressed cache

Supported: ``transformers.GPT2LMHeadModel``, ``transformers.LlamaForCausalLM`` (GQA + RoPE) and
``models.GPT`` with ``attention="mha"``; anything else raises ``ValueError`` naming the supported families.

How a layer attends (``impl="absorb"``, the default), per KV head ``j`` with bases ``k_enc, k_dec, v_enc, v_dec``
(:mod:`kvsplice.lowrank.bases`) and ``g`` query heads per KV head:

* values never exist: ``v_enc`` is folded into the value projection (``b = x (W_v v_enc) + b_v v_enc``, the new
  tokens' coefficients straight from the hidden state), attention runs over the cached coefficients
  (``Σ_t p_t b_t``, ``R_v`` numbers per query head) and ``v_decᵀ`` is folded into the output projection
  (``W_o[:, head h] v_dec``), so ``(Σ_t p_t b_t) v_decᵀ W_oᵀ`` is one matmul of the ``R_v``-wide head outputs.
* keys, by ``bases.rope``:

  - ``"post"`` (coefficients of rotated keys): ``q, k`` are projected and rotated with HF's
    ``apply_rotary_pos_emb`` as usual; the new keys' coefficients are ``a = k_rot k_enc`` and each query head is
    projected once per step into its KV head's key space, ``q̃ = q_rot k_dec`` (``R_k`` numbers). Scores
    ``q̃·a`` over the cached coefficients: no key is rebuilt.
  - ``"pre"`` (coefficients of un-rotated keys, ``k_enc`` folded into the key projection): RoPE does not commute
    with the projection, so the cached keys are rebuilt ``k̂ = a k_decᵀ`` and rotated at their positions before
    scoring. This necessarily materialises ``K̂ (B, Hkv, T, head_dim)`` of the layer for the attention call (a
    transient, never cached); values are still never materialised.
  - ``"none"`` / a model without RoPE (GPT-2, our GPT; any ``bases.rope`` is then the same thing): ``k_enc`` is
    folded into the key projection and ``k_dec`` into the query projection, ``q̃ = x (W_q k_dec) + b_q k_dec``.

  The scale is the original model's (``1/sqrt(head_dim)``, or GPT-2's per-layer ``scaling``), not ``1/sqrt(R)``.
* GQA: the ``g`` query heads of a KV head are contiguous; ``attend`` folds them into query rows (no K/V copy).
* Layers whose heads share ranks are one stream ``(B, Hkv, T, R)`` and one ``attend`` call; otherwise each KV
  head has its own stream and call.

``impl="naive"`` is the reference: it computes full ``q, k, v`` with the original weights, caches the same
coefficients, then rebuilds ``K̂ = A k_decᵀ`` (rotated for pre-RoPE) and ``V̂ = B v_decᵀ`` for every cached
token and runs plain attention with the original output projection. ``bases=None`` is the full-cache reference
(:class:`~models.cache.KVCache` of post-RoPE keys and values), for "full cache vs compressed cache" comparisons.

The folded weights are computed (in float64, then cast to the model's dtype) when the decoder is built: build a
new decoder after changing the model's weights. The driver is inference-only: no dropout, no gradients.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.lowrank.bases import BasesMismatchError, HeadBases, KVBases
from models.cache import DecodeCache, KVCache
from kvsplice.lowrank.cache import CoefficientCache
from models.attention import attend, select_backend

__all__ = ["CoefficientDecoder", "SUPPORTED_FAMILIES", "apply_bases", "generate", "perplexity", "sequence_nll"]

SUPPORTED_FAMILIES = ("transformers.GPT2LMHeadModel (model_type 'gpt2')",
                      "transformers.LlamaForCausalLM (model_type 'llama')",
                      "models.GPT (attention='mha')")

Impl = Literal["absorb", "naive"]


# ================================================================================================ families
@dataclass
class _Proj:
    """A layer's attention projections in ``nn.Linear`` convention (``y = x Wᵀ + b``); views of the model's."""

    wq: torch.Tensor  # (Hq·D, d_model)
    bq: Optional[torch.Tensor]
    wk: torch.Tensor  # (Hkv·D, d_model)
    bk: Optional[torch.Tensor]
    wv: torch.Tensor  # (Hkv·D, d_model)
    bv: Optional[torch.Tensor]
    wo: torch.Tensor  # (d_model, Hq·D)
    bo: Optional[torch.Tensor]


class _Family:
    """What the driver needs from a model family: shapes, the non-attention submodules, projections, RoPE."""

    name: str
    has_rope: bool = False
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    max_positions: Optional[int] = None

    def check_room(self, cache_batch: int, held: int, b: int, t: int) -> None:
        """A batch of ``b`` sequences of ``t`` new tokens may go into a cache for ``cache_batch`` sequences that has
        seen ``held`` tokens: same batch size, and within the model's positions."""
        if cache_batch != b:
            raise ValueError(f"cache was built for batch size {cache_batch}, got a batch of {b}")
        mp = self.max_positions
        if mp is not None and held + t > mp:
            raise ValueError(f"sequence of {held + t} tokens ({held} cached + {t} new) exceeds the model's {mp} "
                             f"positions")

    def param(self) -> torch.Tensor:
        raise NotImplementedError

    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        raise NotImplementedError

    def attn_in(self, l: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def after_attn(self, l: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def proj(self, l: int) -> _Proj:
        raise NotImplementedError

    def scale(self, l: int) -> float:
        raise NotImplementedError

    def rope_tables(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class _GPT2Like(_Family):
    """HF ``GPT2LMHeadModel`` (Conv1D weights) and our ``models.GPT`` (nn.Linear): the same module names."""

    def __init__(self, model: nn.Module, *, hf: bool) -> None:
        self.model, self.hf = model, hf
        self.t = model.transformer
        if hf:
            cfg = model.config
            self.name, self.n_layer, self.n_head = "gpt2", cfg.n_layer, cfg.n_head
            self.head_dim = cfg.n_embd // cfg.n_head
            self.max_positions = cfg.n_positions
        else:
            cfg = model.cfg
            self.name, self.n_layer, self.n_head = "gpt", cfg.n_layer, cfg.n_head
            self.head_dim, self.max_positions = cfg.head_size, cfg.block_size
        self.n_kv_head = self.n_head

    def param(self) -> torch.Tensor:
        return self.t.wte.weight

    def embed(self, ids, start):
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        return self.t.wte(ids) + self.t.wpe(pos)[None]  # dropout skipped: inference only

    def attn_in(self, l, x):
        return self.t.h[l].ln_1(x)

    def after_attn(self, l, x, y):
        block = self.t.h[l]
        x = x + y
        return x + block.mlp(block.ln_2(x))

    def head(self, x):
        return self.model.lm_head(self.t.ln_f(x))

    def proj(self, l):
        attn = self.t.h[l].attn
        w, b = attn.c_attn.weight, attn.c_attn.bias
        wo, bo = attn.c_proj.weight, attn.c_proj.bias
        if self.hf:  # Conv1D stores (in, out)
            w, wo = w.T, wo.T
        d = wo.shape[0]
        wq, wk, wv = w.split(d, dim=0)
        bq, bk, bv = b.split(d) if b is not None else (None, None, None)
        return _Proj(wq, bq, wk, bk, wv, bv, wo, bo)

    def scale(self, l):
        attn = self.t.h[l].attn
        return float(attn.scaling) if self.hf else float(attn.scale)


class _Llama(_Family):
    """HF ``LlamaForCausalLM``: GQA, RoPE (``model.model.rotary_emb`` + the module's ``apply_rotary_pos_emb``)."""

    name = "llama"
    has_rope = True

    def __init__(self, model: nn.Module) -> None:
        self.model, self.m = model, model.model
        cfg = model.config
        attn = self.m.layers[0].self_attn
        self.n_layer = cfg.num_hidden_layers
        self.n_head, self.n_kv_head = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        mod = sys.modules[type(attn).__module__]
        self._apply_rope, self._rotate_half = mod.apply_rotary_pos_emb, mod.rotate_half

    def param(self):
        return self.m.embed_tokens.weight

    def embed(self, ids, start):
        return self.m.embed_tokens(ids)

    def attn_in(self, l, x):
        return self.m.layers[l].input_layernorm(x)

    def after_attn(self, l, x, y):
        layer = self.m.layers[l]
        x = x + y
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def head(self, x):
        return self.model.lm_head(self.m.norm(x))

    def proj(self, l):
        a = self.m.layers[l].self_attn
        return _Proj(a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias, a.v_proj.weight,
                     a.v_proj.bias, a.o_proj.weight, a.o_proj.bias)

    def scale(self, l):
        return float(self.m.layers[l].self_attn.scaling)

    def rope_tables(self, x, positions):
        return self.m.rotary_emb(x, positions[None])  # cos, sin (1, T, D)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of one tensor ``(B, H, T, D)`` at the positions of ``cos, sin (1, T, D)`` (HF's ``rotate_half``)."""
        cos, sin = cos[:, None], sin[:, None]
        return x * cos + self._rotate_half(x) * sin

    def rotate_qk(self, q, k, cos, sin):
        return self._apply_rope(q, k, cos, sin)


def _family(model: nn.Module) -> _Family:
    from models.gpt import GPT

    if isinstance(model, GPT):
        if model.cfg.attention != "mha":
            raise ValueError(f"unsupported model family: models.GPT with attention={model.cfg.attention!r} (its "
                             f"cache is already a latent); supported: {', '.join(SUPPORTED_FAMILIES)}")
        return _GPT2Like(model, hf=False)
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    cls = type(model).__name__
    if mtype == "gpt2" and cls == "GPT2LMHeadModel":
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError("unsupported model family: GPT-2 with cross-attention (add_cross_attention=True); "
                             f"supported: {', '.join(SUPPORTED_FAMILIES)}")
        return _GPT2Like(model, hf=True)
    if mtype == "llama" and cls == "LlamaForCausalLM":
        return _Llama(model)
    raise ValueError(f"unsupported model family: {cls} (model_type={mtype!r}); supported: "
                     f"{', '.join(SUPPORTED_FAMILIES)}")


family_adapter = _family  # public alias: the per-family adapter (used by kvsplice.select.driver)


# ================================================================================================== plans
@dataclass
class _Group:
    """KV heads ``[kv0, kv0 + n)`` of a layer that share ranks and one cache stream (+ one attend call)."""

    kv0: int
    n: int
    rk: int
    rv: int
    k_enc: torch.Tensor  # (n, D, R_k) — post-RoPE: applied to the rotated new keys
    k_dec: torch.Tensor  # (n, D, R_k) — post-RoPE: query projection; pre-RoPE: key rebuild


@dataclass
class _Plan:
    """One layer's precomputed (folded) weights for the absorbed path."""

    w_in: torch.Tensor  # fused input projection: [query part | key part | value coefficients]
    b_in: Optional[torch.Tensor]
    split: tuple[int, int, int]
    groups: list[_Group]
    w_out: torch.Tensor  # (d_model, Σ_h R_v(h)): W_o[:, h] v_dec folded
    b_out: Optional[torch.Tensor]


def _blocks(w: torch.Tensor, n: int, size: int) -> list[torch.Tensor]:
    """Split the rows of ``w`` into ``n`` blocks of ``size`` (per-head rows of a projection)."""
    return [w[i * size:(i + 1) * size] for i in range(n)]


def _fold_rows(w: torch.Tensor, b: Optional[torch.Tensor], mats: Sequence[torch.Tensor], d: int):
    """Per head ``i``: rows ``mats[i]ᵀ W_i`` (R_i, d_model) and bias ``mats[i]ᵀ b_i``; concatenated over heads."""
    rows = torch.cat([m.T @ wi for m, wi in zip(mats, _blocks(w, len(mats), d))], dim=0)
    bias = None if b is None else torch.cat([m.T @ bi for m, bi in zip(mats, _blocks(b, len(mats), d))])
    return rows, bias


def _cat_bias(parts: Sequence[Optional[torch.Tensor]], sizes: Sequence[int], like: torch.Tensor):
    if all(p is None for p in parts):
        return None
    return torch.cat([p if p is not None else like.new_zeros(s) for p, s in zip(parts, sizes)])


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, T, h·D) → (B, h, T, D)."""
    b, t, _ = x.shape
    return x.view(b, t, h, -1).transpose(1, 2)


def _merge(z: torch.Tensor) -> torch.Tensor:
    """(B, h, T, R) → (B, T, h·R), head-major."""
    b, h, t, r = z.shape
    return z.transpose(1, 2).reshape(b, t, h * r)


# ================================================================================================ decoder
class CoefficientDecoder:
    """Prefill / decode driver for a supported model; ``bases=None`` gives the full K/V cache reference.

    ``dec(input_ids (B, T), cache) -> logits (B, T, V)`` appends ``T`` tokens to ``cache`` (from
    :meth:`new_cache`) and returns their logits (``last_only=True``: only the last position's, ``(B, 1, V)``).
    """

    def __init__(self, model: nn.Module, bases: Optional[KVBases] = None, *, impl: Impl = "absorb",
                 attn_backend: str = "auto") -> None:
        if impl not in ("absorb", "naive"):
            raise ValueError(f"impl must be 'absorb' or 'naive', got {impl!r}")
        if attn_backend not in ("auto", "flash", "sdpa"):
            raise ValueError(f"attn_backend must be one of ('auto', 'flash', 'sdpa'), got {attn_backend!r}")
        self.model = model
        self.fam = _family(model)
        self.family = self.fam.name
        self.impl = impl
        self.attn_backend = attn_backend
        p = self.fam.param()
        self.dtype, self.device = p.dtype, p.device
        self.scales = [self.fam.scale(l) for l in range(self.fam.n_layer)]
        self.bases: Optional[KVBases] = None
        self.key_mode: Optional[str] = None
        if bases is not None:
            self._check_bases(bases)
            self.key_mode = bases.rope if self.fam.has_rope else "none"
            self.bases = bases.to(device=self.device, dtype=self.dtype)
            if impl == "absorb":
                with torch.no_grad():
                    self._plans = [self._plan(l, bases.layers[l]) for l in range(self.fam.n_layer)]

    # ------------------------------------------------------------------------------------------- checks
    def _check_bases(self, bases: KVBases) -> None:
        f = self.fam
        if not isinstance(bases, KVBases):
            raise TypeError(f"bases must be a kvsplice.lowrank.bases.KVBases, got {type(bases).__name__}")
        fp = bases.meta.get("model_fingerprint")
        if fp is not None:
            try:  # the calibration code owns the fingerprint; check it where it is available
                from kvsplice.lowrank.calibrate import model_fingerprint  # type: ignore[attr-defined]
            except Exception:
                model_fingerprint = None
            if model_fingerprint is not None:
                bases.check_model(model_fingerprint(self.model))
        if bases.n_layer != f.n_layer:
            raise BasesMismatchError(f"bases have {bases.n_layer} layers, the {f.name} model has {f.n_layer}")
        for l, layer in enumerate(bases.layers):
            if len(layer) != f.n_kv_head:
                raise BasesMismatchError(f"bases layer {l} has {len(layer)} KV heads, the {f.name} model has "
                                         f"{f.n_kv_head}")
            for j, hb in enumerate(layer):
                if hb.k_enc.shape[0] != f.head_dim or hb.v_enc.shape[0] != f.head_dim:
                    raise BasesMismatchError(
                        f"bases layer {l} head {j} have head dim k {hb.k_enc.shape[0]} / v {hb.v_enc.shape[0]}, "
                        f"the {f.name} model has head_dim {f.head_dim}")
                if hb.rank_k < 1 or hb.rank_v < 1:
                    raise BasesMismatchError(f"bases layer {l} head {j} have rank k {hb.rank_k} / v {hb.rank_v}; "
                                             f"ranks must be >= 1")
        if bases.rope not in ("post", "pre", "none"):
            raise BasesMismatchError(f"bases.rope must be 'post', 'pre' or 'none', got {bases.rope!r}")
        if f.has_rope and bases.rope == "none":
            raise BasesMismatchError(f"the {f.name} model uses RoPE but these bases were fitted with rope='none'; "
                                     f"fit them with rope='post' or 'pre'")

    # ------------------------------------------------------------------------------------------- folding
    def _plan(self, l: int, heads: list[HeadBases]) -> _Plan:
        f, mode = self.fam, self.key_mode
        D, hq, hkv = f.head_dim, f.n_head, f.n_kv_head
        g = hq // hkv
        P = f.proj(l)
        P64 = _Proj(*(t.detach().double() if t is not None else None for t in vars(P).values()))
        hb = [_HeadB(h) for h in heads]
        k_enc, k_dec = [h.k_enc for h in hb], [h.k_dec for h in hb]
        v_enc, v_dec = [h.v_enc for h in hb], [h.v_dec for h in hb]
        per_q = lambda mats: [mats[h // g] for h in range(hq)]  # query head h reads KV head h // g

        # query part: rope none → q̃ = x (W_q k_dec) + b_q k_dec; else the plain query (projected after RoPE)
        if mode == "none":
            wq, bq = _fold_rows(P64.wq, P64.bq, per_q(k_dec), D)
        else:
            wq, bq = P64.wq, P64.bq
        # key part: post → plain keys (rotated, then projected); pre / none → a = x (W_k k_enc) + b_k k_enc
        if mode == "post":
            wk, bk = P64.wk, P64.bk
        else:
            wk, bk = _fold_rows(P64.wk, P64.bk, k_enc, D)
        wv, bv = _fold_rows(P64.wv, P64.bv, v_enc, D)  # value coefficients b = x (W_v v_enc) + b_v v_enc
        split = (wq.shape[0], wk.shape[0], wv.shape[0])
        w_in = torch.cat([wq, wk, wv], dim=0)
        b_in = _cat_bias([bq, bk, bv], split, w_in)
        # output: Σ_h W_o[:, h] v̂_h = Σ_h (W_o[:, h] v_dec_j) (Σ_t p_t b_t)
        w_out = torch.cat([wo_h @ m for wo_h, m in zip(P64.wo.split(D, dim=1), per_q(v_dec))], dim=1)

        uniform = len({h.rank_k for h in heads}) == 1 and len({h.rank_v for h in heads}) == 1
        spans = [(0, hkv)] if uniform else [(j, 1) for j in range(hkv)]
        cast = dict(dtype=self.dtype, device=self.device)
        groups = [_Group(kv0, n, heads[kv0].rank_k, heads[kv0].rank_v,
                         torch.stack(k_enc[kv0:kv0 + n]).to(**cast), torch.stack(k_dec[kv0:kv0 + n]).to(**cast))
                  for kv0, n in spans]
        return _Plan(w_in.to(**cast), None if b_in is None else b_in.to(**cast), split, groups, w_out.to(**cast),
                     None if P.bo is None else P.bo)

    # ------------------------------------------------------------------------------------------- caches
    def new_cache(self, batch_size: int, capacity: Optional[int] = None, *, dtype: Optional[torch.dtype] = None,
                  device=None) -> DecodeCache:
        """An empty cache: :class:`CoefficientCache` with the bases' ranks, or a full :class:`KVCache`
        (``bases=None``). dtype / device default to the model's; ``capacity`` preallocates exactly."""
        kw = dict(dtype=dtype or self.dtype, device=device or self.device, capacity=capacity)
        if self.bases is None:
            return KVCache(self.fam.n_layer, self.fam.n_kv_head, self.fam.head_dim, batch_size, **kw)
        return CoefficientCache.from_bases(self.bases, batch_size, **kw)

    def _check_cache(self, cache: DecodeCache, b: int, t: int) -> None:
        if self.bases is None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"this decoder (bases=None) needs a KVCache from new_cache(), got "
                                f"{type(cache).__name__}")
        else:
            r = self.bases.ranks()
            if not isinstance(cache, CoefficientCache) or cache.ranks_k != r["k"] or cache.ranks_v != r["v"]:
                raise TypeError("this decoder needs a CoefficientCache with its bases' ranks; use "
                                "decoder.new_cache()")
        self.fam.check_room(cache.batch_size, cache.seq_len, b, t)

    # ------------------------------------------------------------------------------------------- forward
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l: int) -> torch.Tensor:
        backend = select_backend(self.attn_backend, q.device, q.dtype, q.shape[-1], v.shape[-1])
        return attend(q, k, v, scale=self.scales[l], backend=backend)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: DecodeCache, *, last_only: bool = False) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be (B, T) with T >= 1, got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        self._check_cache(cache, b, t)
        start = cache.seq_len
        x = self.fam.embed(input_ids, start)  # (B, T, d_model)
        rope = None
        if self.fam.has_rope:
            pos = torch.arange(0, start + t, device=x.device)
            cos, sin = self.fam.rope_tables(x, pos)  # (1, start + T, D): every position (pre-RoPE rebuild)
            rope = (cos, sin, cos[:, start:], sin[:, start:])
        for l in range(self.fam.n_layer):
            h = self.fam.attn_in(l, x)
            if self.bases is None:
                y = self._layer_full(l, h, cache, rope)
            elif self.impl == "absorb":
                y = self._layer_absorb(l, h, cache, rope)
            else:
                y = self._layer_naive(l, h, cache, rope)
            x = self.fam.after_attn(l, x, y)
        if last_only:
            x = x[:, -1:]
        return self.fam.head(x)

    forward = __call__

    def _qkv(self, l: int, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plain q (B, Hq, T, D), k, v (B, Hkv, T, D) from the original weights; q rotated, k rotated iff
        post-RoPE (or full cache)."""
        f, P = self.fam, self.fam.proj(l)
        q = _heads(F.linear(h, P.wq, P.bq), f.n_head)
        k = _heads(F.linear(h, P.wk, P.bk), f.n_kv_head)
        v = _heads(F.linear(h, P.wv, P.bv), f.n_kv_head)
        if rope is not None:
            cos_new, sin_new = rope[2], rope[3]
            if self.key_mode == "pre":
                q = f.rotate(q, cos_new, sin_new)
            else:
                q, k = f.rotate_qk(q, k, cos_new, sin_new)
        return q, k, v

    def _out(self, l: int, z: torch.Tensor) -> torch.Tensor:
        P = self.fam.proj(l)
        return F.linear(_merge(z), P.wo, P.bo)

    def _layer_full(self, l, h, cache, rope):
        q, k, v = self._qkv(l, h, rope)
        kv = cache.append(l, k=k, v=v)  # (B, Hkv, Tk, D) each
        return self._out(l, self._attend(q, kv["k"], kv["v"], l))

    def _layer_naive(self, l, h, cache, rope):
        """Reference: cache the same coefficients, rebuild K̂ and V̂ for every cached token, plain attention."""
        f, heads = self.fam, self.bases.layers[l]
        q, k, v = self._qkv(l, h, rope)
        a = [k[:, j] @ hb.k_enc for j, hb in enumerate(heads)]  # (B, T, R_k[j])
        bb = [v[:, j] @ hb.v_enc for j, hb in enumerate(heads)]  # (B, T, R_v[j])
        if cache.grouped(l):
            A, Bc = cache.append_coeffs(l, torch.stack(a, 1), torch.stack(bb, 1))
            A, Bc = list(A[0].unbind(1)), list(Bc[0].unbind(1))
        else:
            A, Bc = cache.append_coeffs(l, a, bb)
            A, Bc = [x[:, 0] for x in A], [x[:, 0] for x in Bc]
        k_hat = torch.stack([Aj @ hb.k_dec.T for Aj, hb in zip(A, heads)], 1)  # (B, Hkv, Tk, D)
        v_hat = torch.stack([Bj @ hb.v_dec.T for Bj, hb in zip(Bc, heads)], 1)  # (B, Hkv, Tk, D)
        if self.key_mode == "pre":
            k_hat = f.rotate(k_hat, rope[0], rope[1])
        return self._out(l, self._attend(q, k_hat, v_hat, l))

    def _layer_absorb(self, l, h, cache, rope):
        f, P, mode = self.fam, self._plans[l], self.key_mode
        D, hkv = f.head_dim, f.n_kv_head
        g = f.n_head // hkv
        b, t, _ = h.shape
        qx, kx, vx = F.linear(h, P.w_in, P.b_in).split(P.split, dim=-1)

        def cols(x: torch.Tensor, grp: _Group, heads_per_kv: int, r: int, off: int) -> torch.Tensor:
            """The group's columns of a head-major (B, T, Σ heads·R) tensor as (B, heads, T, R)."""
            n = grp.n * heads_per_kv
            return x[..., off:off + n * r].view(b, t, n, r).transpose(1, 2)

        a_new, b_new, q_grp = [], [], []
        if mode == "post":
            q = _heads(qx, f.n_head)
            k = _heads(kx, hkv)
            q, k = f.rotate_qk(q, k, rope[2], rope[3])
        elif mode == "pre":
            q = f.rotate(_heads(qx, f.n_head), rope[2], rope[3])
        off_q = off_k = off_v = 0
        for grp in P.groups:
            s_kv, s_q = slice(grp.kv0, grp.kv0 + grp.n), slice(grp.kv0 * g, (grp.kv0 + grp.n) * g)
            b_new.append(cols(vx, grp, 1, grp.rv, off_v))  # (B, n, T, R_v)
            off_v += grp.n * grp.rv
            if mode == "post":
                a_new.append(k[:, s_kv] @ grp.k_enc)  # (B, n, T, D) @ (n, D, R_k) → (B, n, T, R_k)
                qg = q[:, s_q].reshape(b, grp.n, g, t, D) @ grp.k_dec[:, None]  # (B, n, g, T, R_k)
                q_grp.append(qg.reshape(b, grp.n * g, t, grp.rk))  # q̃: one projection per query head
            else:
                a_new.append(cols(kx, grp, 1, grp.rk, off_k))  # (B, n, T, R_k) from the folded projection
                off_k += grp.n * grp.rk
                if mode == "none":
                    q_grp.append(cols(qx, grp, g, grp.rk, off_q))  # (B, n·g, T, R_k), folded k_dec
                    off_q += grp.n * g * grp.rk
                else:
                    q_grp.append(q[:, s_q])  # (B, n·g, T, D) rotated, full head dim
        A, Bc = cache.append_coeffs(l, a_new, b_new)  # per group: (B, n, Tk, R)
        zs = []
        for grp, qg, Ag, Bg in zip(P.groups, q_grp, A, Bc):
            if mode == "pre":
                # RoPE does not commute with the projection: rebuild and rotate the keys (transient K̂)
                keys = f.rotate(Ag @ grp.k_dec.transpose(1, 2), rope[0], rope[1])  # (B, n, Tk, D)
            else:
                keys = Ag  # scores q̃·a straight on the cached coefficients
            zs.append(_merge(self._attend(qg, keys, Bg, l)))  # (B, T, n·g·R_v): Σ_t p_t b_t per query head
        return F.linear(torch.cat(zs, dim=-1), P.w_out, P.b_out)  # v_decᵀ folded into the output projection

    def __repr__(self) -> str:
        what = "full K/V" if self.bases is None else f"{self.bases.method} bases, rope={self.key_mode}, {self.impl}"
        return f"CoefficientDecoder({self.family}, {what})"


class _HeadB:
    """float64 copies of one head's bases (for folding)."""

    def __init__(self, h: HeadBases) -> None:
        self.k_enc, self.k_dec = h.k_enc.detach().double(), h.k_dec.detach().double()
        self.v_enc, self.v_dec = h.v_enc.detach().double(), h.v_dec.detach().double()


def apply_bases(model: nn.Module, bases: Optional[KVBases] = None, **kw) -> CoefficientDecoder:
    """``CoefficientDecoder(model, bases, **kw)``: decode ``model`` with a coefficient cache (full cache if None)."""
    return CoefficientDecoder(model, bases, **kw)


# ========================================================================================= generate / eval
@torch.no_grad()
def generate(decoder: CoefficientDecoder, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Prefill ``idx (B, T)`` into a fresh cache of the decoder, then decode ``max_new_tokens`` one at a time from
    that cache. ``temperature=0`` is greedy. Returns ``(B, T + max_new_tokens)``."""
    from models.gpt import sample_next

    if max_new_tokens <= 0:
        return idx
    cache = decoder.new_cache(idx.shape[0], capacity=idx.shape[1] + max_new_tokens - 1)
    logits = decoder(idx, cache, last_only=True)[:, -1]
    out = [idx]
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)  # (B, 1)
        out.append(nxt)
        if step + 1 < max_new_tokens:
            logits = decoder(nxt, cache)[:, -1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def sequence_nll(decoder: CoefficientDecoder, input_ids: torch.Tensor, chunk_size: Optional[int] = None
                 ) -> tuple[float, int]:
    """Summed next-token NLL of ``input_ids (B, T)`` and the number of predicted tokens, feeding the sequence
    through a fresh cache of the decoder in chunks of ``chunk_size`` (None: one prefill call; 1: token by token).
    Every token attends over the decoder's cache (compressed or full), so full vs compressed is apples to apples."""
    b, t = input_ids.shape
    cache = decoder.new_cache(b, capacity=t)
    step = t if chunk_size is None else int(chunk_size)
    if step < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    total = 0.0
    for s in range(0, t, step):
        logits = decoder(input_ids[:, s:s + step], cache).float()  # (B, c, V)
        tgt = input_ids[:, s + 1:s + step + 1]  # next tokens (the last chunk predicts one fewer)
        logits = logits[:, :tgt.shape[1]]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum").item()
    return total, b * (t - 1)


def perplexity(decoder: CoefficientDecoder, input_ids: torch.Tensor, chunk_size: Optional[int] = None) -> float:
    """``exp`` of the mean next-token NLL (see :func:`sequence_nll`)."""
    total, n = sequence_nll(decoder, input_ids, chunk_size)
    return math.exp(total / max(n, 1))
