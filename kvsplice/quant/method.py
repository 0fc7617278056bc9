"""``KIVI``: KIVI-style low-bit K/V storage (Liu et al. 2024) as one storage method — in both doors, alone or under
a token selection (``TokenSelection(selector, budget, store=KIVI(bits=4))``).

Keys are quantised per channel (a group = ``group`` consecutive tokens of one channel: key outliers live in fixed
channels), values per token (a group = ``group`` consecutive channels of one token); each group keeps an fp16 scale
and minimum; the most recent ``residual`` tokens (and the incomplete group beyond them) stay at full precision
(:class:`~kvsplice.quant.cache.KIVICache`). Attention dequantises the held tokens transiently and runs the one dense
attention (:func:`kvsplice.core.attention.dense_attend`, with the door's mask and a selection's log-weights).
"""

from __future__ import annotations


from kvsplice.core.args import choice_arg, int_arg
from kvsplice.core.coded import coded_attend, seen_bias, split_bias
from kvsplice.core.method import CompressionMethod
from kvsplice.quant.cache import KIVICache, kivi_bytes
from models.quant import BITS

__all__ = ["KIVI"]


class KIVI(CompressionMethod):
    """``bits`` ∈ {2, 4, 8} per number + an fp16 scale and minimum per ``group`` numbers; the last ``residual``
    tokens at full precision. 4 bits, group 32: 5 bits per number (3.2× smaller than fp16) beyond the window."""

    name = "kivi"
    cache_type = KIVICache
    is_storage = True

    def __init__(self, bits: int = 4, group: int = 32, residual: int = 128) -> None:
        self.bits = choice_arg("bits", bits, BITS)
        self.group, self.residual = int_arg("group", group, 1, 1 << 16), int_arg("residual", residual)

    def _prepare(self, adapter, *, dtype, device):
        super()._prepare(adapter, dtype=dtype, device=device)
        if adapter.head_dim % self.group:
            raise ValueError(f"KIVI group {self.group} must divide the model's head_dim {adapter.head_dim}")

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        a = self._bound()
        return KIVICache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, bits=self.bits, group=self.group,
                         residual=self.residual, dtype=dtype, device=device, capacity=capacity)

    def check_cache(self, cache):
        super().check_cache(cache)
        if (cache.bits, cache.group, cache.residual) != (self.bits, self.group, self.residual):
            raise TypeError(f"{self!r} needs its own KIVICache; use decoder.new_cache()")

    def bytes_formula(self, batch_size, n_held, dtype):
        a = self._bound()
        return kivi_bytes(a.n_layer, a.n_kv_head, a.head_dim, batch_size, n_held, bits=self.bits, group=self.group,
                          residual=self.residual, dtype=dtype)

    def append(self, layer, k, v, cache, step):
        cache.append(layer, k, v)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        n = cache.layer_len(layer) + k.shape[2]
        if self.bits == 4 and q.shape[2] == 1 and (mask is None or mask.shape[-1] == n):
            # a decode step: attend from the codes as stored (kvsplice.core.coded: no dequantised copy)
            segments = cache.append_segments(layer, k.to(cache.dtype), v.to(cache.dtype))
            bias = seen_bias(mask, k.shape[0], k.shape[1], n)
            if logw is not None:
                bias = logw if bias is None else bias + logw
            for s, piece in zip(segments, split_bias(bias, [s.keys.n for s in segments])):
                s.bias = piece
            return coded_attend(q, segments, scale=step.scales[layer])  # (B, Hq, 1, D)
        kv = cache.append(layer, k, v)  # (B, Hkv, Tk, D) each, at the cache dtype
        y = step.attend(layer, q, kv["k"].to(q.dtype), kv["v"].to(q.dtype), mask=mask, logw=logw)
        return y  # (B, Hq, Tq, D)

    def __repr__(self) -> str:
        return f"KIVI(bits={self.bits}, group={self.group}, residual={self.residual})"
