"""``DenseKV``: the full K/V cache (post-RoPE keys and values) — the uncompressed reference every method is
compared against, and the plain storage under a token selection."""

from __future__ import annotations

import torch

from kvsplice.core.args import choice_arg
from kvsplice.core.method import CompressionMethod, layer_tokens
from models.cache import SCALE, KVCache

__all__ = ["DenseKV"]


class DenseKV(CompressionMethod):
    """Full keys and values; ``cache_quant="int8"`` stores them as int8 rows with fp16 scales (the baseline of
    quantisation on its own)."""

    name = "dense"
    cache_type = KVCache
    is_storage = True

    def __init__(self, *, cache_quant: str | None = None) -> None:
        self.cache_quant = choice_arg("cache_quant", cache_quant, (None, "int8"))

    def new_cache(self, batch_size, capacity=None, *, dtype, device):
        a = self._bound()
        return KVCache(a.n_layer, a.n_kv_head, a.head_dim, batch_size, dtype=dtype, device=device,
                       capacity=capacity, quant=self.cache_quant)

    def bytes_formula(self, batch_size, n_held, dtype):
        """``2 · L · Hkv · D · T · B · bytes``; int8: 1 byte per number + a 2-byte scale per row (token, head, k/v)."""
        a = self._bound()
        rows = 2 * a.n_kv_head * layer_tokens(n_held, a.n_layer) * batch_size  # a key and a value row per head, token
        if self.cache_quant == "int8":
            return rows * (a.head_dim + 2)
        return rows * a.head_dim * torch.empty((), dtype=dtype).element_size()

    def append(self, layer, k, v, cache, step):
        cache.append(layer, k=k, v=v)

    def attend(self, layer, q, k, v, cache, step, mask=None, logw=None):
        if k.dtype != cache.dtype:
            k, v = k.to(cache.dtype), v.to(cache.dtype)
        if step.kernel(q):  # one-token step: the split-KV kernel reads the rows as stored (int8 + scales)
            rows = cache.append_rows(layer, k=k, v=v)  # (B, Hkv, Tk, D) each; "k.scale" (B, Hkv, Tk, 1) when int8
            return step.decode_attend(layer, q, rows["k"], rows["v"], mask, logw, k_scale=rows.get("k" + SCALE),
                                      v_scale=rows.get("v" + SCALE))  # (B, Hq, 1, D)
        kv = cache.append(layer, k=k, v=v)  # (B, Hkv, Tk, D) each
        return step.attend(layer, q, kv["k"], kv["v"], mask=mask, logw=logw)  # (B, Hq, Tq, D)

    def __repr__(self) -> str:
        return f"DenseKV(cache_quant={self.cache_quant!r})" if self.cache_quant else "DenseKV()"
