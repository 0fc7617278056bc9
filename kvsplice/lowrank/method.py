"""``LowRank``: decode with fitted low-rank bases; the cache holds only key/value coefficients.

::

    dec = Decoder(model, LowRank(bases))               # or CoefficientDecoder(model, bases); bases from fit_bases
    cache = dec.new_cache(batch_size=1)                # a CoefficientCache
    logits = dec(prompt_ids, cache)

How a layer attends (``impl="absorb"``, the default), per KV head with bases ``k_enc, k_dec, v_enc, v_dec``:

* values never exist: ``v_enc`` is folded into the value projection, attention sums the cached coefficients
  (``Σ_t p_t b_t``, ``R_v`` numbers per query head) and ``v_decᵀ`` is folded into the output projection
  (:mod:`kvsplice.lowrank.fold`).
* keys, by ``bases.rope``:

  - ``"post"`` (coefficients of rotated keys): ``q, k`` are projected and rotated as usual; the new keys'
    coefficients are ``a = k_rot k_enc`` and each query head is projected once per step into its KV head's key
    space, ``q̃ = q_rot k_dec`` (``R_k`` numbers). Scores ``q̃·a`` over the cached coefficients: no key is rebuilt.
  - ``"pre"`` (coefficients of un-rotated keys, ``k_enc`` folded into the key projection): RoPE does not commute
    with the projection, so the cached keys are rebuilt ``k̂ = a k_decᵀ`` and rotated at their positions before
    scoring. This materialises ``K̂ (B, Hkv, T, head_dim)`` of the layer for the attention call (a transient, never
    cached); values are still never materialised.
  - ``"none"`` / a model without RoPE (GPT-2, our GPT): ``k_enc`` is folded into the key projection and ``k_dec``
    into the query projection.

  The scale is the original model's (``1/sqrt(head_dim)``, or GPT-2's per-layer ``scaling``), not ``1/sqrt(R)``.
* GQA: the ``g`` query heads of a KV head are contiguous; ``attend`` folds them into query rows (no K/V copy).
* Layers whose heads share ranks are one stream ``(B, Hkv, T, R)`` and one ``attend`` call; otherwise each KV head
  has its own stream and call.

``impl="naive"`` is the reference: full ``q, k, v`` with the original weights, the same coefficients cached, then
``K̂ = A k_decᵀ`` (rotated for pre-RoPE) and ``V̂ = B v_decᵀ`` rebuilt for every cached token and plain attention.
The folded weights are computed when the decoder is built: build a new decoder after changing the model's weights.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.adapters.base import apply_rope, merge_heads, split_heads
from kvsplice.adapters.fingerprint import model_fingerprint
from kvsplice.decode.decoder import Decoder
from kvsplice.decode.dense import DenseKV
from kvsplice.decode.method import CompressionMethod, Step
from kvsplice.lowrank.bases import BasesMismatchError, KVBases
from kvsplice.lowrank.cache import CoefficientCache
from kvsplice.lowrank.fold import Group, plan_layer

__all__ = ["CoefficientDecoder", "LowRank", "apply_bases"]

Impl = Literal["absorb", "naive"]


class LowRank(CompressionMethod):
    """Low-rank key/value coefficients from fitted :class:`~kvsplice.lowrank.bases.KVBases`."""

    name = "lowrank"
    cache_type = CoefficientCache

    def __init__(self, bases: KVBases, *, impl: Impl = "absorb", cache_quant: Optional[str] = None) -> None:
        if not isinstance(bases, KVBases):
            raise TypeError(f"bases must be a kvsplice.lowrank.bases.KVBases, got {type(bases).__name__}")
        if impl not in ("absorb", "naive"):
            raise ValueError(f"impl must be 'absorb' or 'naive', got {impl!r}")
        self.bases, self.impl, self.cache_quant = bases, impl, cache_quant
        self.key_mode: Optional[str] = None

    # ------------------------------------------------------------------------------------------- binding
    def bind(self, adapter, *, dtype, device):
        super().bind(adapter, dtype=dtype, device=device)
        self._check_bases(adapter)
        self.key_mode = self.bases.rope if adapter.has_rope else "none"
        self.bases = self.bases.to(device=device, dtype=dtype)
        self._plans = None
        if self.impl == "absorb":
            self._plans = [plan_layer(adapter.proj(l), self.bases.layers[l], mode=self.key_mode,
                                      n_head=adapter.n_head, head_dim=adapter.head_dim, dtype=dtype, device=device)
                           for l in range(adapter.n_layer)]

    def _check_bases(self, a) -> None:
        bases = self.bases
        fp = bases.meta.get("model_fingerprint")
        if fp is not None:
            bases.check_model(model_fingerprint(a.model))
        if bases.n_layer != a.n_layer:
            raise BasesMismatchError(f"bases have {bases.n_layer} layers, the {a.name} model has {a.n_layer}")
        for l, layer in enumerate(bases.layers):
            if len(layer) != a.n_kv_head:
                raise BasesMismatchError(f"bases layer {l} has {len(layer)} KV heads, the {a.name} model has "
                                         f"{a.n_kv_head}")
            for j, hb in enumerate(layer):
                if hb.k_enc.shape[0] != a.head_dim or hb.v_enc.shape[0] != a.head_dim:
                    raise BasesMismatchError(
                        f"bases layer {l} head {j} have head dim k {hb.k_enc.shape[0]} / v {hb.v_enc.shape[0]}, "
                        f"the {a.name} model has head_dim {a.head_dim}")
                if hb.rank_k < 1 or hb.rank_v < 1:
                    raise BasesMismatchError(f"bases layer {l} head {j} have rank k {hb.rank_k} / v {hb.rank_v}; "
                                             f"ranks must be >= 1")
        if bases.rope not in ("post", "pre", "none"):
            raise BasesMismatchError(f"bases.rope must be 'post', 'pre' or 'none', got {bases.rope!r}")
        if a.has_rope and bases.rope == "none":
            raise BasesMismatchError(f"the {a.name} model uses RoPE but these bases were fitted with rope='none'; "
                                     f"fit them with rope='post' or 'pre'")

    # --------------------------------------------------------------------------------------------- cache
    def new_cache(self, adapter, batch_size, capacity=None, *, dtype, device):
        return CoefficientCache.from_bases(self.bases, batch_size, dtype=dtype, device=device, capacity=capacity,
                                           quant=self.cache_quant)

    def check_cache(self, cache):
        r = self.bases.ranks()
        if not isinstance(cache, CoefficientCache) or cache.ranks_k != r["k"] or cache.ranks_v != r["v"] \
                or cache.quant != self.cache_quant:
            raise TypeError("this decoder needs a CoefficientCache with its bases' ranks; use decoder.new_cache()")

    # ----------------------------------------------------------------------------------------- attention
    def attention(self, layer, h, cache, step):
        if self.impl == "naive":
            return self._naive(layer, h, cache, step)
        return self._absorb(layer, h, cache, step)

    def _naive(self, l: int, h: torch.Tensor, cache: CoefficientCache, step: Step) -> torch.Tensor:
        """Reference: cache the same coefficients, rebuild K̂ and V̂ for every cached token, plain attention."""
        a, heads = step.adapter, self.bases.layers[l]
        q, k, v = a.qkv(l, h, step.rope, rotate_k=self.key_mode != "pre")  # (B, Hq, T, D), (B, Hkv, T, D) × 2
        ka = [k[:, j] @ hb.k_enc for j, hb in enumerate(heads)]  # (B, T, R_k[j])
        vb = [v[:, j] @ hb.v_enc for j, hb in enumerate(heads)]  # (B, T, R_v[j])
        if cache.grouped(l):
            A, Bc = cache.append_coeffs(l, torch.stack(ka, 1), torch.stack(vb, 1))  # [(B, Hkv, Tk, R)]
            A, Bc = list(A[0].unbind(1)), list(Bc[0].unbind(1))  # per head (B, Tk, R)
        else:
            A, Bc = cache.append_coeffs(l, ka, vb)  # per head (B, 1, Tk, R[j])
            A, Bc = [x[:, 0] for x in A], [x[:, 0] for x in Bc]  # (B, Tk, R[j])
        k_hat = torch.stack([Aj @ hb.k_dec.T for Aj, hb in zip(A, heads)], 1)  # (B, Hkv, Tk, D)
        v_hat = torch.stack([Bj @ hb.v_dec.T for Bj, hb in zip(Bc, heads)], 1)  # (B, Hkv, Tk, D)
        if self.key_mode == "pre":
            k_hat = apply_rope(k_hat, *step.rope_upto())
        return a.out(l, step.attend(l, q, k_hat, v_hat))

    def _absorb(self, l: int, h: torch.Tensor, cache: CoefficientCache, step: Step) -> torch.Tensor:
        a, P, mode = step.adapter, self._plans[l], self.key_mode
        D, hkv = a.head_dim, a.n_kv_head
        g = a.n_head // hkv
        b, t, _ = h.shape
        qx, kx, vx = F.linear(h, P.w_in, P.b_in).split(P.split, dim=-1)  # head-major (B, T, Σ heads·R) each

        def cols(x: torch.Tensor, grp: Group, heads_per_kv: int, r: int, off: int) -> torch.Tensor:
            """The group's columns of a head-major (B, T, Σ heads·R) tensor as (B, heads, T, R)."""
            n = grp.n * heads_per_kv
            return x[..., off:off + n * r].view(b, t, n, r).transpose(1, 2)  # (B, n, T, R)

        a_new, b_new, q_grp = [], [], []
        if mode == "post":
            q = apply_rope(split_heads(qx, a.n_head), *step.rope)  # (B, Hq, T, D)
            k = apply_rope(split_heads(kx, hkv), *step.rope)  # (B, Hkv, T, D)
        elif mode == "pre":
            q = apply_rope(split_heads(qx, a.n_head), *step.rope)  # (B, Hq, T, D)
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
                keys = apply_rope(Ag @ grp.k_dec.transpose(1, 2), *step.rope_upto())  # (B, n, Tk, D)
            else:
                keys = Ag  # scores q̃·a straight on the cached coefficients
            zs.append(merge_heads(step.attend(l, qg, keys, Bg)))  # (B, T, n·g·R_v): Σ_t p_t b_t per query head
        return F.linear(torch.cat(zs, dim=-1), P.w_out, P.b_out)  # v_decᵀ folded into the output projection

    def __repr__(self) -> str:
        return f"LowRank({self.bases.method} bases, rope={self.key_mode or self.bases.rope}, {self.impl})"


class CoefficientDecoder(Decoder):
    """``Decoder(model, LowRank(bases, impl=impl))``; ``bases=None`` is the full K/V cache reference (``DenseKV``);
    ``cache_quant="int8"`` stores the cached numbers as int8 rows with fp16 scales."""

    def __init__(self, model: nn.Module, bases: Optional[KVBases] = None, *, impl: Impl = "absorb",
                 attn_backend: str = "auto", cache_quant: Optional[str] = None) -> None:
        if impl not in ("absorb", "naive"):
            raise ValueError(f"impl must be 'absorb' or 'naive', got {impl!r}")
        method = DenseKV(cache_quant=cache_quant) if bases is None else LowRank(bases, impl=impl,
                                                                                 cache_quant=cache_quant)
        super().__init__(model, method, attn_backend=attn_backend)
        self.impl = impl

    @property
    def bases(self) -> Optional[KVBases]:
        return getattr(self.method, "bases", None)

    @property
    def key_mode(self) -> Optional[str]:
        return getattr(self.method, "key_mode", None)


def apply_bases(model: nn.Module, bases: Optional[KVBases] = None, **kw) -> CoefficientDecoder:
    """``CoefficientDecoder(model, bases, **kw)``: decode ``model`` with a coefficient cache (full cache if None)."""
    return CoefficientDecoder(model, bases, **kw)
