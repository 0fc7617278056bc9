"""``LowRank``: fitted low-rank bases; the cache holds only key/value coefficients — in both doors.

::

    dec = Decoder(model, LowRank(bases))               # bases from kvsplice fit-bases (KVBases.load)
    cache = dec.new_cache(batch_size=1)                # a CoefficientCache
    logits = dec(prompt_ids, cache)
    hf_cache = CoefficientHFCache(model, bases)        # = KVSpliceHFCache(model, LowRank(bases)): inside generate()

:meth:`LowRank.attend` is the method's one attention function (both doors call it with post-RoPE ``q, k``):

* ``impl="absorb"`` (default): attention in coefficient space, :func:`kvsplice.lowrank.attention.coefficient_attend`
  — values never rebuilt, post-RoPE / no-RoPE keys never rebuilt (``k_dec`` folded into the query), pre-RoPE keys
  rebuilt transiently and rotated at their positions. The scale is the original model's (``1/sqrt(head_dim)``, or
  GPT-2's per-layer ``scaling``), not ``1/sqrt(R)``.
* ``impl="naive"``: the reference — the same coefficients cached, then ``K̂ = A k_decᵀ`` (rotated for pre-RoPE)
  and ``V̂ = B v_decᵀ`` rebuilt for every cached token and plain attention
  (:func:`kvsplice.core.attention.dense_attend`). Tested against the absorbed path.

Key modes (``bases.rope``; models without RoPE always ``none``): ``post`` caches coefficients of rotated keys;
``pre`` of un-rotated keys (the rotation of the new keys is undone, :class:`kvsplice.core.rope.RopeTables`), so a
``pre`` method needs its keys' positions and cannot store a reordered token subset.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch

from kvsplice.adapters.base import apply_rope
from kvsplice.adapters.fingerprint import model_fingerprint
from kvsplice.core.args import choice_arg
from kvsplice.core.method import CompressionMethod
from kvsplice.core.rope import rope_tables
from kvsplice.lowrank.attention import coefficient_attend, encode, layer_groups
from kvsplice.lowrank.bases import BasesMismatchError, KVBases
from kvsplice.lowrank.cache import CoefficientCache, coefficient_bytes

__all__ = ["BasesStorage", "LowRank"]

Impl = Literal["absorb", "naive"]


class BasesStorage(CompressionMethod):
    """A storage method built from fitted bases, its one file argument (``bases``: a ``bases_type`` file)."""

    is_storage = True
    spec_files = ("bases",)
    bases_type: type = KVBases

    @classmethod
    def load_spec_file(cls, arg, path):
        return cls.bases_type.load(path)

    def __init__(self, bases) -> None:
        if not isinstance(bases, self.bases_type):
            raise TypeError(f"bases must be {self.bases_type.__module__}.{self.bases_type.__qualname__}, got "
                            f"{type(bases).__name__}")
        self.bases = bases


class LowRank(BasesStorage):
    """Low-rank key/value coefficients from fitted :class:`~kvsplice.lowrank.bases.KVBases`;
    ``cache_quant="int8"`` stores them as int8 rows with fp16 scales."""

    name = "lowrank"
    cache_type = CoefficientCache

    def __init__(self, bases: KVBases, *, impl: Impl = "absorb", cache_quant: Optional[str] = None) -> None:
        super().__init__(bases)
        if impl not in ("absorb", "naive"):
            raise ValueError(f"impl must be 'absorb' or 'naive', got {impl!r}")
        self.impl = impl
        self.cache_quant = choice_arg("cache_quant", cache_quant, (None, "int8"))
        self.key_mode: Optional[str] = None  # post / pre / none, once bound

    # ------------------------------------------------------------------------------------------- binding
    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        self._check_bases(adapter)
        self.key_mode = self.bases.rope if adapter.has_rope else "none"
        self.key_rope = "pre" if self.key_mode == "pre" else "post"
        self.bases = self.bases.to(device=device, dtype=dtype)
        self.groups = [layer_groups(heads) for heads in self.bases.layers]
        self.rope = rope_tables(adapter) if self.key_mode == "pre" else None  # per layer (shared per rotary)
        self._operands: dict[tuple, list] = {}  # (batch, dtype, device) -> per layer, per group Operands

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

    def _ops(self, layer: int, cache: CoefficientCache) -> list:
        key = (cache.batch_size, cache.dtype, cache.device)
        ops = self._operands.get(key)
        if ops is None:
            ops = self._operands[key] = [[g.operands(cache.batch_size, self.key_mode, cache.dtype, cache.device)
                                          for g in groups] for groups in self.groups]
        return ops[layer]

    # --------------------------------------------------------------------------------------------- cache
    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        self._bound()
        return CoefficientCache.from_bases(self.bases, batch_size, dtype=dtype, device=device, capacity=capacity,
                                           quant=self.cache_quant)

    def check_cache(self, cache):
        r = self.bases.ranks()
        if not isinstance(cache, CoefficientCache) or cache.ranks_k != r["k"] or cache.ranks_v != r["v"] \
                or cache.quant != self.cache_quant:
            raise TypeError("this decoder needs a CoefficientCache with its bases' ranks; use decoder.new_cache()")

    def bytes_formula(self, batch_size, n_held, dtype):
        r = self.bases.ranks()
        return coefficient_bytes(r["k"], r["v"], batch_size, n_held, dtype, self.cache_quant)

    # ----------------------------------------------------------------------------------------- attention
    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if self.impl == "naive":
            return self._naive(layer, q, k, v, cache, step, mask, logw)
        scale = step.scales[layer]
        tables = None if self.rope is None else \
            (lambda t_k, t_q: self.rope[layer].tables(step, mask, t_k, t_q, scale, k))  # noqa: E731
        mode = "pre-rotated" if self.key_mode == "pre" and step.k_rotated else self.key_mode
        return coefficient_attend(self._ops(layer, cache), layer, q, k, v, cache, step, mode, scale, mask, logw,
                                  tables)

    def append(self, layer, k, v, cache, step):
        """Store post-RoPE ``k, v (B, Hkv, T, D)`` as coefficients without attending (a kept token subset)."""
        if self.key_rope == "pre":
            raise ValueError("pre-RoPE coefficients need their keys' positions; store a token subset with "
                             "post-RoPE bases")
        cache.append_coeffs(layer, *encode(self._ops(layer, cache), k.to(cache.dtype), v.to(cache.dtype)))

    def _naive(self, l: int, q, k, v, cache: CoefficientCache, step, mask, logw) -> torch.Tensor:
        """Reference: cache the same coefficients, rebuild K̂ and V̂ for every cached token, plain attention."""
        heads = self.bases.layers[l]
        out_dtype = q.dtype
        if q.dtype != cache.dtype:
            q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
        if self.key_mode == "pre":
            cos, sin = self.rope[l].cos_sin(step, mask, cache.layer_len(l) + q.shape[2], k)  # (B or 1, Tk, D)
            if step.k_rotated:  # undo the rotation of the new keys: k = (k_rot⊙cos − rot(k_rot)⊙sin)/σ²
                c, s = cos[:, None, -q.shape[2]:], sin[:, None, -q.shape[2]:]  # (B or 1, 1, Tq, D)
                k = self.rope[l].unrotate(k, c, s)
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
            k_hat = apply_rope(k_hat, cos, sin)  # rotated at the keys' positions
        y = step.attend(l, q, k_hat, v_hat, mask=mask, logw=logw)  # (B, Hq, Tq, D)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def __repr__(self) -> str:
        q = f", cache_quant={self.cache_quant!r}" if self.cache_quant else ""
        return f"LowRank({self.bases.method} bases, rope={self.key_mode or self.bases.rope}, {self.impl}{q})"
